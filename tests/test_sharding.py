"""An FSDP2-sharded model and its AdamW state resized in memory (issue 36): over real gloo
process groups, a float64 model with a BatchNorm buffer and a frozen layer trains 2 steps at each
world size of 2 -> 3 -> 1 -> 2 (a newcomer, two leavers, another newcomer) and ends with the
parameters of the same model trained at 2 throughout (rtol 1e-9). Each step's loss is weighted by
the rank's share of the global batch and the reduce-scatter sums, as the engine weights
micro-batches."""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from worlds import spawn

from elastic_jupyter.engine.sharded.reshard import Layout
from elastic_jupyter.engine.sharded.resizable_model import (ShardedModel, ShardingError,
                                                            default_units)

B = 12  # the global batch: 6, 4 and 12 samples a rank at 2, 3 and 1


def build() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(9, 9), nn.BatchNorm1d(9), nn.Tanh()) for _ in range(3)]
    blocks[0][0].weight.requires_grad_(False)  # frozen: no optimizer state of its own
    return nn.Sequential(nn.Sequential(*blocks), nn.Linear(9, 1)).double()


def data():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(8 * B, 9, generator=g, dtype=torch.float64),
            torch.randn(8 * B, 1, generator=g, dtype=torch.float64))


def train_step(model, optimizer, step: int, rank: int, world_size: int) -> None:
    x, y = data()
    n = B // world_size
    lo = step * B + rank * n
    model.eval()  # BatchNorm's running statistics as buffers, never updated: the same per rank
    loss = ((model(x[lo:lo + n]) - y[lo:lo + n]) ** 2).sum() / B  # the rank's share of the mean
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def whole(model) -> dict:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v
            for k, v in model.state_dict().items()}


# world sizes by step pair, and the process group ranks each generation holds
GENERATIONS = [(0, [0, 1]), (2, [0, 1, 2]), (4, [2]), (6, [2, 3])]


def sharded_cell(world_size: int) -> tuple[ShardedModel, torch.optim.Optimizer]:
    """The test cell and its AdamW, sharded over `world_size` ranks (the process group's)."""
    cell = build()
    optimizer = torch.optim.AdamW(cell.parameters(), lr=0.01)
    sharded = ShardedModel(cell)
    sharded.shard(init_device_mesh("cpu", (world_size,)), optimizer)
    return sharded, optimizer


def fixed_at_2(rank: int, folder: str, steps: int) -> None:
    """Rank `rank` of the run fixed at 2 ranks for `steps` steps; rank 0 saves its whole
    parameters to ``folder/fixed.pt`` (the right answer of the resized runs)."""
    dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store-fixed", 2),
                            rank=rank, world_size=2)
    try:
        sharded, optimizer = sharded_cell(2)
        for step in range(steps):
            train_step(sharded.module, optimizer, step, rank, 2)
        result = whole(sharded.module)
        if rank == 0:
            torch.save(result, f"{folder}/fixed.pt")
    finally:
        dist.destroy_process_group()


def _rank(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, 4), rank=rank, world_size=4)
    try:
        groups = {tuple(members): dist.new_group(members) for _, members in GENERATIONS}
        groups[(0, 1, 2, 3)] = dist.group.WORLD
        if rank < 2:  # the reference: fixed at 2
            mesh = DeviceMesh.from_group(groups[(0, 1)], "cpu")
            sharded = ShardedModel(build())
            model = sharded.shard(mesh, None)
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
            for step in range(8):
                train_step(model, optimizer, step, rank, 2)
            fixed = whole(model)
        cell = build()
        optimizer = torch.optim.AdamW(cell.parameters(), lr=0.01)  # made before sharding
        sharded = ShardedModel(cell)
        if rank == 3:  # as a warm engine: no rows until it joins, then built from the skeleton
            sharded.release()
            assert all(p.untyped_storage().nbytes() == 0 for p in cell.parameters()
                       if p.requires_grad)  # (the frozen one stays)
            assert not sharded.holds_rows
        held = []  # process group ranks holding the state
        for first, members in GENERATIONS:
            mesh = DeviceMesh.from_group(groups[tuple(members)], "cpu") \
                if rank in members else None
            if not held:
                if rank in members:
                    sharded.shard(mesh, optimizer)
            else:  # every process resizes over the world group: old holders and newcomers
                layout = Layout(tuple(held.index(g) if g in held else None for g in range(4)),
                                tuple(members.index(g) if g in members else None
                                      for g in range(4)))
                sharded.reshard_to(mesh, layout, rank, optimizer, torch.device("cpu"))
            held = members
            if rank in members:
                for step in (first, first + 1):
                    train_step(sharded.module, optimizer, step, members.index(rank),
                               len(members))
            dist.barrier()
        if rank == 0:
            torch.save(fixed, f"{out}/fixed.pt")
        if rank in held:
            got = whole(sharded.module)
            if rank == held[0]:
                torch.save(got, f"{out}/resized.pt")
    finally:
        dist.destroy_process_group()


def test_a_sharded_model_resized_2_3_1_2_in_memory_ends_as_one_fixed_at_2(tmp_path):
    spawn(_rank, (str(tmp_path / "store"), str(tmp_path)), 4)
    fixed = torch.load(tmp_path / "fixed.pt", weights_only=True)
    resized = torch.load(tmp_path / "resized.pt", weights_only=True)
    assert fixed.keys() == resized.keys()
    for key, want in fixed.items():
        assert torch.allclose(resized[key], want, rtol=1e-9, atol=0), key
    assert not torch.equal(fixed["1.weight"], build().state_dict()["1.weight"])  # it trained


def test_the_default_units_are_the_blocks_and_a_failing_shard_fn_says_what_to_do():
    model = build()
    assert default_units(model) == list(model[0])  # the list holding the bulk of parameters
    assert default_units(nn.Linear(3, 3)) == []

    def shard_fn(model, mesh):
        raise RuntimeError("no such layer")
    with pytest.raises(ShardingError, match="shard_fn.*raised RuntimeError: no such layer. Fix"):
        ShardedModel(build(), shard_fn=shard_fn).shard(None, None)
    with pytest.raises(ShardingError, match="FSDP2 could not shard.*train without --shard"):
        ShardedModel(build()).shard(None, None)  # no mesh: no process group either
    # at setup, on a copy without storage over a one-rank group of its own
    with pytest.raises(ShardingError, match="shard_fn.*raised RuntimeError: no such layer"):
        ShardedModel(build(), shard_fn=shard_fn).check()
    ShardedModel(build()).check()
    assert not torch.distributed.is_initialized()


class _Tied(nn.Module):
    """A frozen embedding tied to the output layer, a non-persistent buffer, trained blocks."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.out = nn.Linear(8, 11, bias=False)
        self.out.weight = self.embed.weight
        self.embed.weight.requires_grad_(False)
        self.register_buffer("scale", torch.tensor([0.5]), persistent=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.out(x * self.scale)


def test_frozen_weights_and_kept_buffers_are_each_ranks_own_in_every_new_module(tmp_path):
    torch.manual_seed(0)
    model = _Tied().double()
    tokens = torch.arange(11).view(1, 11)
    expected = model(tokens).detach()
    frozen, scale = model.embed.weight, model.scale
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        sharded = ShardedModel(model)
        assert list(sharded.frozen) == ["embed.weight", "out.weight"]  # both names of the tie
        assert sharded.names == [f"blocks.{i}.{k}" for i in range(3) for k in ("weight", "bias")]
        mesh = init_device_mesh("cpu", (1,))
        sharded.shard(mesh, None)
        new = sharded.reshard_to(mesh, Layout((0,), (0,)), 0, None, torch.device("cpu"))
        assert new is not None and new is not model
        assert new.embed.weight is frozen and new.out.weight is frozen and new.scale is scale
        assert not sharded.snapshot(None).buffers  # they never travel
        assert torch.allclose(new(tokens), expected, rtol=1e-12, atol=0)
    finally:
        dist.destroy_process_group()


def test_the_optimizer_lets_go_of_the_cells_parameters_while_they_are_sharded(tmp_path):
    """At the first mesh the optimizer holds none of the cell's parameters while FSDP2 shards
    them (on a GPU it moves each unit there whole to shard it: kept referenced, every unit
    would stay whole on the device), and holds the sharded ones after, with its groups' order;
    the cell's whole parameters are freed."""
    import gc
    import weakref
    model = build()
    optimizer = torch.optim.AdamW([{"params": list(model[1].parameters())},
                                   {"params": [p for p in model[0].parameters()
                                               if p.requires_grad], "lr": 0.5}], lr=0.01)
    seen = []
    whole = [weakref.ref(p) for p in model.parameters() if p.requires_grad]

    def shard_fn(module, mesh):  # called while the module is being sharded
        seen.append([len(g["params"]) for g in optimizer.param_groups])
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        sharded = ShardedModel(model, shard_fn=shard_fn)
        names = sharded.held.names(optimizer)
        module = sharded.reshard_to(init_device_mesh("cpu", (1,)), Layout((0,), (0,)), 0,
                                    optimizer, torch.device("cpu"))
        assert seen == [[0, 0]]
        params = dict(module.named_parameters())
        assert [[params[n] for n in group] for group in names] == \
            [g["params"] for g in optimizer.param_groups]
        assert optimizer.param_groups[1]["lr"] == 0.5
        gc.collect()
        assert all(ref() is None for ref in whole)
    finally:
        dist.destroy_process_group()
