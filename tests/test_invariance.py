"""Resize invariance: the parameters after S steps do not depend on the world-size schedule.

Each run trains the same float64 model on the same data with a constant global batch of 64:
at world size 1, at 2, and 2 -> 3 -> 1 with resizes scheduled mid-epoch. 64 over 3 ranks gives
uneven shares (22, 21, 21) and the micro-batch of 16 forces gradient accumulation. All must end
with the parameters of a single-process reference that takes the mean gradient of each batch.
"""
import pytest
import torch

from elastic_jupyter import RunConfig, TrainingRun
from elastic_jupyter.engine.batching import BatchPlan, rank_share

CELL = '''
import torch
from sklearn.datasets import load_digits
X, y = load_digits(return_X_y=True)
dataset = torch.utils.data.TensorDataset(torch.tensor(X[:1000], dtype=DTYPE) / 16, torch.tensor(y[:1000]))
model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10)).to(DTYPE)
optimizer = OPTIMIZER(model.parameters())
def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)
'''
OPTIMIZERS = {"sgd": "lambda p: torch.optim.SGD(p, lr=0.2)",
              "adam": "lambda p: torch.optim.Adam(p, lr=0.01)"}
STEPS, BATCH, MICRO = 56, 64, 16  # 1000 samples: 16 steps per epoch, the last one of 40
SCHEDULE = [(20, 3), (40, 1)]  # both mid-epoch


def cell(optimizer: str, dtype: str) -> str:
    return CELL.replace("DTYPE", f"torch.{dtype}").replace("OPTIMIZER", f"({OPTIMIZERS[optimizer]})")


def run_elastic(pool, tmp_path, source, engines, schedule=(), name="inv"):
    config = RunConfig(name=name, global_batch=BATCH, micro_batch=MICRO, steps=STEPS,
                       checkpoint_every=0, seed=7)
    run = TrainingRun(pool, config, source=source, engines=engines, schedule=list(schedule),
                      workspace=str(tmp_path / f"{name}-{engines}-{len(schedule)}")).start()
    assert run.wait(timeout=240) == "finished", run.logs()
    return run


def reference(source: str, world_sizes=None):
    """Single-process training of the same cell. With `world_sizes` (step -> W), each rank's
    share is weighted 1/W instead of n_rank/B: the classic mistake the test must catch."""
    import random
    import numpy as np
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    ns = {}
    exec(source, ns)
    model, opt, data, loss_fn = ns["model"], ns["optimizer"], ns["dataset"], ns["loss_fn"]
    start = [p.detach().clone() for p in model.parameters()]
    plan, epoch, position = BatchPlan(len(data), BATCH, 7), 0, 0
    for step in range(STEPS):
        idx = plan.batch(epoch, position)
        opt.zero_grad()
        if world_sizes is None:
            loss_fn(model, torch.utils.data.default_collate([data[int(i)] for i in idx])).backward()
        else:
            W = world_sizes(step)
            for r in range(W):
                share = idx[rank_share(len(idx), r, W)]
                batch = torch.utils.data.default_collate([data[int(i)] for i in share])
                (loss_fn(model, batch) / W).backward()
        opt.step()
        epoch, position = plan.advance(epoch, position)
    return start, {k: v.detach() for k, v in model.state_dict().items()}


def scheduled_world_size(step: int) -> int:
    return 2 if step < 20 else 3 if step < 40 else 1


def max_relative_deviation(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_parameters_do_not_depend_on_the_world_size_schedule(idle_pool, tmp_path, optimizer):
    source = cell(optimizer, "float64")
    start, expected = reference(source)
    _, wrong = reference(source, scheduled_world_size)
    close = dict(rtol=1e-7, atol=1e-9)
    # the check is sharp enough to see a loss scaled by 1/W instead of n_rank/B
    assert not all(torch.allclose(wrong[k], expected[k], **close) for k in expected)
    moved = sum((p - s).norm() for p, s in zip(expected.values(), start)) / sum(s.norm() for s in start)
    assert moved > 0.01

    runs = {"1": run_elastic(idle_pool, tmp_path, source, 1),
            "2": run_elastic(idle_pool, tmp_path, source, 2),
            "2-3-1": run_elastic(idle_pool, tmp_path, source, 2, SCHEDULE)}
    for label, run in runs.items():
        got = run.state_dict()
        for k in expected:
            assert torch.allclose(got[k], expected[k], **close), (label, k)

    events = runs["2-3-1"].events
    assert [(e["step"], e["from"], e["to"]) for e in events if e["kind"] == "resize"] == \
        [(20, 2, 3), (40, 3, 1)]
    sizes = {r["step"]: r["world_size"] for r in runs["2-3-1"].history}
    assert (sizes[20], sizes[21], sizes[40], sizes[41]) == (2, 3, 3, 1)


def test_float32_deviation_is_round_off(idle_pool, tmp_path):
    """In float32 the schedules differ only by summation order; prints the figure."""
    source = cell("adam", "float32")
    base = run_elastic(idle_pool, tmp_path, source, 1, name="f32").state_dict()
    for engines, schedule in ((2, ()), (2, SCHEDULE)):
        got = run_elastic(idle_pool, tmp_path, source, engines, schedule, name="f32").state_dict()
        deviation = max_relative_deviation(got, base)
        print(f"float32 max relative deviation, {engines} engines, schedule {list(schedule)}: "
              f"{deviation:.2e}")
        assert deviation < 1e-4
