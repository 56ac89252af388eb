"""The state broadcast of a generation's start (engine.group.state_transfer), on a real gloo group
of 3 processes: every receiver ends with rank 0's state, bit for bit, whatever the bucket size."""
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from worlds import spawn

from elastic_jupyter.engine.state import training_state as state_mod
from elastic_jupyter.engine.group import state_transfer
from elastic_jupyter.engine.group.state_transfer import broadcast_state, plan_buckets


def _objects(seed: int):
    """A model of several dtypes (float32, bfloat16, BatchNorm's int64 counter, a bool buffer)
    and an Adam with state (a numpy learning rate) after one step, all drawn from `seed`."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5),
                                torch.nn.Linear(5, 3).to(torch.bfloat16))
    model.register_buffer("mask", torch.rand(4) > 0.5)
    # dtypes gloo cannot send, a strided view, an empty and a 0-dim tensor
    model.register_buffer("counts", torch.arange(5, dtype=torch.int16) * (seed + 1))
    model.register_buffer("ids", torch.tensor([1 + seed, 2, 3], dtype=torch.uint32))
    model.register_buffer("every_other", torch.arange(8.0)[::2] * (seed + 1))
    model.register_buffer("nothing", torch.empty(0, 3))
    model.register_buffer("scale", torch.tensor(2.0 + seed))
    optimizer = torch.optim.Adam(model.parameters(), lr=np.float64(1e-3) * (seed + 1))
    out = model[2](model[1](model[0](torch.randn(8, 6))).to(torch.bfloat16))
    out.float().pow(2).mean().backward()
    optimizer.step()
    # a Counter in the state (milestones, one of them twice): a dict whose update() adds
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [3, 3, 5 + seed])
    scheduler.step()
    return model, optimizer, scheduler


def _capture(objects, step: int, copy_tensors: bool = False) -> dict:
    return state_mod.capture(*objects, state_mod.Progress(step=step), [], {},
                             copy_tensors=copy_tensors)


def _rank(rank: int, store_path: str, bucket_bytes: int, out: str) -> None:
    state_transfer.BUCKET_BYTES = state_transfer.DIRECT_BYTES = bucket_bytes
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 3), rank=rank, world_size=3)
    try:
        random.seed(rank)
        objects = _objects(seed=rank)  # receivers start from other values
        model, optimizer, _ = objects
        # rank 2 receives into its own model's tensors, rank 1 into new memory
        into = _capture(objects, 0) if rank == 2 else None
        addresses = {k: t.data_ptr() for k, t in model.state_dict().items() if t.numel()}
        state = broadcast_state(_capture(objects, 7) if rank == 0 else None, rank,
                                torch.device("cpu"), into=into)
        if rank:
            in_place = {k for k, t in state["model"].items()
                        if k in addresses and t.data_ptr() == addresses[k]}
            assert in_place == (set(addresses) if into else set()), in_place
            state_mod.restore(state, *objects)
        del state
        # the optimizer keeps its received tensors: their storages must hold nothing else
        held = [t for s in optimizer.state.values() for t in s.values()]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
        extra = sum(storages.values()) - sum(t.numel() * t.element_size() for t in held)
        torch.save((_capture(objects, 7, copy_tensors=True), extra), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _assert_same(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@pytest.mark.parametrize("bucket_bytes", [16 * 2**20, 64])  # 64: most tensors sent alone
def test_receivers_get_rank0s_state(tmp_path, bucket_bytes):
    spawn(_rank, (str(tmp_path / "store"), bucket_bytes, str(tmp_path)), 3)
    (sent, _), *received = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
                            for r in range(3)]
    assert not torch.equal(_objects(1)[0][0].weight, _objects(0)[0][0].weight)  # differed
    assert sent["optimizer"]["state"] and sent["numpy_types"]  # Adam moments, a numpy lr
    assert sent["lr_scheduler"]["milestones"] == {3: 2, 5: 1}
    for state, extra_bytes in received:  # RNG states included: restored from rank 0's
        _assert_same(state, sent)
        assert extra_bytes == 0  # no model bytes kept alive beside the optimizer's


def test_buckets_keep_sections_and_devices_apart_and_stay_small():
    f32, b16 = torch.float32, torch.bfloat16
    meta = [("model", f32, "cpu", (10,)), ("model", b16, "cpu", (4,)),
            ("optimizer", f32, "cpu", (10,)), ("model", f32, "cpu", (30,)),
            ("model", f32, "cuda", (2,)), ("model", f32, "cpu", (3,))]
    # (tensor, byte offset): offsets aligned to 16 bytes, dtypes mixed in a bucket
    assert plan_buckets(meta) == [[(0, 0), (1, 48), (3, 64), (5, 192)], [(2, 0)], [(4, 0)]]
    original = state_transfer.BUCKET_BYTES, state_transfer.DIRECT_BYTES
    state_transfer.BUCKET_BYTES = 100
    try:
        assert plan_buckets(meta) == [[(0, 0), (1, 48)], [(3, 0)], [(5, 0)], [(2, 0)], [(4, 0)]]
        state_transfer.DIRECT_BYTES = 100  # tensor 3 (120 bytes) travels alone, first
        assert plan_buckets(meta) == [[(3, 0)], [(0, 0), (1, 48), (5, 64)], [(2, 0)], [(4, 0)]]
    finally:
        state_transfer.BUCKET_BYTES, state_transfer.DIRECT_BYTES = original


class _Layouts(torch.nn.Module):
    """Every layout a model's state holds in the field: a positional-encoding table built as
    pytorch/examples' (``pe.unsqueeze(0).transpose(0, 1)``: contiguous to torch, strides not the
    standard ones; over 1 MiB, so it travels alone), an embedding tied to the output layer,
    two overlapping views of one storage, a non-contiguous slice, an empty and a 0-dim buffer,
    a complex buffer and a float64 one."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(11, 8)
        self.head = torch.nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight  # tied, as GPT-2's lm_head
        self.register_buffer("pe", torch.randn(1, 4096, 80).transpose(0, 1))
        base = torch.randn(10, dtype=torch.float64)
        self.register_buffer("front", base[:6])
        self.register_buffer("back", base[4:])
        self.register_buffer("columns", torch.randn(5, 6)[:, 1::2])
        self.register_buffer("nothing", torch.empty(3, 0))
        self.register_buffer("scalar", torch.tensor(seed, dtype=torch.int64))
        self.register_buffer("phase", torch.randn(4, dtype=torch.complex64))


def _layouts_rank(rank: int, store_path: str, bucket_bytes: int, out: str) -> None:
    state_transfer.BUCKET_BYTES = bucket_bytes
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 3), rank=rank, world_size=3)
    try:
        model = _Layouts(seed=rank)
        live = {"model": model.state_dict()}
        addresses = {k: t.data_ptr() for k, t in live["model"].items() if t.numel()}
        # rank 1 receives into its own model's tensors, rank 2 into new memory
        state = broadcast_state(live if rank == 0 else None, rank, torch.device("cpu"),
                                into=live if rank == 1 else None)
        received = state["model"]
        layout = {k: (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
                  for k, t in received.items()}
        shares = {k: t.untyped_storage().data_ptr() for k, t in received.items() if t.numel()}
        in_place = sorted(k for k, t in received.items()
                          if k in addresses and t.data_ptr() == addresses[k])
        model.load_state_dict(received)
        torch.save({"values": {k: t.clone() for k, t in received.items()}, "layout": layout,
                    "tied": model.head.weight is model.embed.weight,
                    "same_storage": (shares["embed.weight"] == shares["head.weight"],
                                     shares["front"] == shares["back"]),
                    "in_place": in_place}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("bucket_bytes", [16 * 2**20, 64])
def test_every_layout_arrives_as_sent_and_shared_storages_stay_shared(tmp_path, bucket_bytes):
    spawn(_layouts_rank, (str(tmp_path / "store"), bucket_bytes, str(tmp_path)), 3)
    sent, *received = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    assert sent["layout"]["pe"][2] == (80, 80 * 4096, 1)  # the layout of the crash
    for rank, got in enumerate(received, start=1):
        _assert_same(got["values"], sent["values"])
        assert got["layout"] == sent["layout"], rank
        assert got["tied"] and got["same_storage"] == (True, True), rank
    # the receiver's own tensors took the bytes: the table, the tied weight, the views
    assert received[0]["in_place"] == sorted(k for k, (_, shape, _, _) in
                                             sent["layout"].items() if 0 not in shape)
    assert received[1]["in_place"] == []
