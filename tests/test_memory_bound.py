"""A sharded run's memory bound (engine.sharded.memory_need, run.memory_bound,
``--memory-per-rank``).

The count is checked against what FSDP2 and the optimizers really hold after a step; the bound
refuses a pool's --min and a resize below it with the numbers, leaving the pool usable; where a
rank's passes would accumulate a whole unsharded gradient beyond the budget, they
reduce-scatter one by one, with the same result.
"""
from __future__ import annotations

import argparse
import datetime

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from elastic_jupyter import RunConfig, TrainingRun, UsageError
from elastic_jupyter.config import byte_size
from elastic_jupyter.engine.sharded.memory_need import MemoryNeed, activation_bytes, measure
from elastic_jupyter.engine.sharded.resizable_model import default_units, skeleton_of
from elastic_jupyter.engine.worker import Worker
from elastic_jupyter.run.memory_bound import NoMemoryBound, ShardedMemoryBound
from test_sharded_step import CELL
from worlds import cell_namespace, config, train


@pytest.mark.parametrize("text, expected", [
    ("24G", 24 * 2**30), ("800M", 800 * 2**20), ("1.5GiB", int(1.5 * 2**30)), ("2gb", 2 * 2**30),
    ("64K", 65536), ("1T", 2**40), ("123", 123), (" 4G ", 4 * 2**30)])
def test_sizes_read_in_binary_units(text, expected):
    assert byte_size(text) == expected


@pytest.mark.parametrize("text", ["", "G", "abc", "0", "-1G", "0.1", "12X", "nan", "inf"])
def test_a_size_that_is_no_size_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="expected a size like 24G"):
        byte_size(text)


def test_memory_per_rank_without_shard_is_refused():
    with pytest.raises(UsageError, match="--memory-per-rank bounds a sharded run"):
        RunConfig(name="r", memory_per_rank=2**30).validate()


def _held(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer state) bytes a rank holds."""
    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t
    size = lambda ts: sum(local(t).numel() * local(t).element_size() for t in ts)  # noqa: E731
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values()
             if torch.is_tensor(t) and t.dim() > 0]
    return size(params), size(p.grad for p in params if p.grad is not None), size(state)


@pytest.mark.parametrize("optimizer, moments, eager", [
    ("torch.optim.AdamW(model.parameters(), lr=0.01)", 2, False),
    ("torch.optim.Adam(model.parameters(), lr=0.01, amsgrad=True)", 3, False),
    ("torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)", 1, False),
    ("torch.optim.SGD(model.parameters(), lr=0.01)", 0, False),
    ("torch.optim.Adagrad(model.parameters(), lr=0.01)", 1, True),  # its state from the start
])
def test_the_count_is_what_fsdp2_and_the_optimizer_hold(tmp_path, optimizer, moments, eager):
    namespace = cell_namespace(CELL, 0)
    model = namespace["model"]
    model.head.requires_grad_(False)  # frozen: sharded, without a gradient or moments
    def make() -> torch.optim.Optimizer:
        return eval(optimizer.replace("model.parameters()", "[p for p in model.parameters() if "
                                      "p.requires_grad]"), {"torch": torch, "model": model})
    need = measure(skeleton_of(model), default_units(model), make(),
                   [[n for n, p in model.named_parameters() if p.requires_grad]], 4)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        for unit in default_units(model):
            fully_shard(unit)
        fully_shard(model)
        opt = make()  # over the sharded parameters
        x, y, rare = namespace["dataset"][:8]
        torch.nn.functional.mse_loss(model(x, rare), y).backward()
        opt.step()
        held = _held(model, opt)
    finally:
        dist.destroy_process_group()
    # counted for every trainable parameter; `unused` (7 of them) has no gradient, and so no
    # moments, after this step
    trainable = sum(p.numel() * 8 for p in model.parameters() if p.requires_grad)
    used = trainable - 7 * 8
    assert need.parameters == held[0]
    assert (need.gradients, held[1]) == (trainable, used)
    assert (need.optimizer, held[2]) == (moments * trainable,
                                         moments * (trainable if eager else used))
    assert not need.optimizer_estimated


def test_an_optimizer_whose_step_needs_values_is_estimated_as_adamw():
    model = cell_namespace(CELL, 0)["model"]
    need = measure(skeleton_of(model), default_units(model),
                   torch.optim.Adafactor(model.parameters()),
                   [[n for n, _ in model.named_parameters()]], 1)
    assert need.optimizer_estimated and need.optimizer == 2 * need.gradients
    assert "(estimated as AdamW)" in need.describe(1)


NEED = MemoryNeed(parameters=8 * 2**30, gradients=8 * 2**30, optimizer=16 * 2**30,
                  gathers=2**30, accumulation=8 * 2**30, micro_batches=4)


def test_the_bound_is_the_smallest_world_size_that_fits():
    # 32 GiB divided over W ranks, plus 1 GiB of gather buffers; 8 GiB more while a rank
    # accumulates more than one pass (W < 4), unless it reduce-scatters after each
    assert [NEED.at(w) / 2**30 for w in (1, 2, 4)] == [41, 25, 9]
    assert [NEED.at(w, per_pass=True) / 2**30 for w in (1, 2, 4)] == [33, 17, 9]
    assert NEED.smallest_world(20 * 2**30, 8) == 2 and NEED.per_pass(2, 20 * 2**30)
    assert not NEED.per_pass(2, 25 * 2**30) and not NEED.per_pass(2, None)
    assert NEED.smallest_world(None, 8) == 1 and NEED.smallest_world(8 * 2**30, 4) is None


def _found(budget: int | None, given: bool = True) -> list[dict]:
    return [{"need": NEED.as_dict(), "budget": budget, "given": given}]


def test_a_pool_min_and_a_resize_below_the_bound_are_refused_with_the_numbers():
    bound = ShardedMemoryBound()
    with pytest.raises(UsageError, match=r"the pool's --min 1 is below this sharded run's "
                       r"memory bound 2: 33.00 GiB per rank at world size 1 .* against 20.00 "
                       r"GiB per rank \(--memory-per-rank\), while 17.00 GiB .* Start the pool "
                       r"with --min 2"):
        bound.set_up(_found(20 * 2**30), 1, 4)
    with pytest.raises(UsageError, match=r"does not fit a rank even at the pool's --max 3: "
                       r"11.67 GiB .* against 8.00 GiB \(the device's memory\)"):
        bound.set_up(_found(8 * 2**30, given=False), 1, 3)
    assert bound.need is None and bound.mode == "sharded"  # nothing taken from a refusal
    bound.set_up(_found(20 * 2**30) + _found(40 * 2**30), 2, 4)  # the smallest budget counts
    assert bound.world_size == 2
    assert bound.mode == ("sharded, memory bound: world size >= 2 (17.00 of 20.00 GiB per rank "
                          "there, activations not counted)")  # NEED counts none
    bound.check(2)
    with pytest.raises(UsageError, match="world size 1 is below this sharded run's memory "
                       "bound 2: 33.00 GiB per rank at world size 1"):
        bound.check(1)
    assert NoMemoryBound().mode == "replicated"


def _need_of(options: dict, cell: str = CELL) -> MemoryNeed:
    worker = Worker(cell_namespace(cell, 3), dict(config(shard=True), **options), "cpu")
    found = worker.mode.memory_need(worker.optimizer, worker.plan.micro_batch_count(16),
                                    worker.device)
    assert found is not None, "a sharded run counts its memory"
    return MemoryNeed(**found["need"])


def test_passes_reduce_scatter_one_by_one_where_accumulating_does_not_fit(tmp_path):
    options = config(micro_batch=3, clip_grad_norm=0.5)  # 6 micro-batches: 3 a rank at 2
    need = _need_of(options)
    budget = need.at(2, per_pass=True)  # fits only without the whole unsharded gradient
    accumulated = train(CELL, dict(options, shard=True), 2, 6, tmp_path)
    one_by_one = train(CELL, dict(options, shard=True, memory_per_rank=budget), 2, 6, tmp_path)
    assert [r.per_pass for r in accumulated] == [False] * 2
    assert [r.per_pass for r in one_by_one] == [True] * 2
    for got, expected in zip(one_by_one, accumulated):
        for k, value in expected.params.items():
            assert torch.allclose(got.params[k], value, rtol=1e-9, atol=1e-12), k


def test_a_pool_below_a_runs_memory_bound_is_refused_and_stays_usable(idle_pool, tmp_path):
    need = _need_of({"micro_batch": 4})  # 4 micro-batches: 2 a rank at 2, so per pass there
    config_of = lambda name, budget: RunConfig(  # noqa: E731
        name=name, global_batch=16, micro_batch=4, seed=3, steps=2, shard=True,
        memory_per_rank=budget)
    refused = TrainingRun(idle_pool, config_of("bounded", need.at(2, per_pass=True)),
                          source=CELL, workspace=str(tmp_path))
    with pytest.raises(UsageError, match="the pool's --min 1 is below this sharded run's memory "
                       "bound 2"):
        refused.start()
    assert not refused.active
    run = TrainingRun(idle_pool, config_of("fits", need.at(1, per_pass=True)), source=CELL,
                      workspace=str(tmp_path), engines=2).start()
    mode = idle_pool.status()["run_mode"]
    assert run.wait(timeout=120) == "finished", run.logs()
    assert mode.startswith("sharded, memory bound: world size >= 1 (")


def _mlp_loss(model, batch):
    x, y = batch
    return (model(x) - y).pow(2).mean()


def test_one_micro_batchs_activations_are_what_its_forward_saves():
    """Counted on the meta copy: the first layer's input (5 x 8), the tanh's output, which
    the second layer saves too (5 x 16, once), and the loss's difference (5 x 1), float32; the
    weights are parameters, not activations. A forward that reads a value says so."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    batch = [torch.empty(5, 8, device="meta"), torch.empty(5, 1, device="meta")]
    skeleton = skeleton_of(model)
    assert activation_bytes(skeleton, _mlp_loss, batch) == (5 * (8 + 16 + 1) * 4, "")
    assert not hasattr(skeleton[0], "cache")

    def reads_a_value(model, batch):
        model[0].cache = batch[0]  # kept by the copy it ran on, not by the skeleton
        if batch[0].sum() > 0:
            return _mlp_loss(model, batch)
        return _mlp_loss(model, batch)
    got, why = activation_bytes(skeleton, reads_a_value, batch)
    assert got == 0 and why.startswith("activations not counted: the forward could not run on "
                                       "the meta device (")
    assert not hasattr(skeleton[0], "cache")
    need = measure(skeleton, [], None, [], 1, activations=(1000, ""))
    assert need.at(1) - measure(skeleton, [], None, [], 1).at(1) == 1000
    assert need.describe(1).endswith(", 0.00 activations)")


def test_the_cells_activations_are_counted_at_setup():
    """A sharded Worker with a memory budget counts one micro-batch of the cell's first samples
    (4 at a cut of 16 over 64 samples); this cell's forward branches on its data, so they are
    not counted and the bound says why. Without a budget loss_fn is not run at setup."""
    bounded = config(micro_batch=4, memory_per_rank=2**30)
    need = _need_of(bounded)
    assert need.activations == 0 and "could not run on the meta device" in need.describe(2)
    cell = CELL.replace("if rare.any():", "if False:")
    assert cell != CELL
    counted = _need_of(bounded, cell)
    # each block saves its input, its linear's output, BatchNorm's, tanh's and dropout's
    # output and mask: float64 rows of 6 for 4 samples, about 5 tensors a block
    assert 3 * 4 * 4 * 6 * 8 < counted.activations < 3 * 8 * 4 * 6 * 8
    assert counted.activations_unknown == "" and "activations)" in counted.describe(2)
    unbounded = _need_of(config(micro_batch=4), cell)
    assert unbounded.activations_unknown == "activations not counted: no memory bound"
