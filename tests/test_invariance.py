"""Resize invariance: the parameters after S steps do not depend on the world-size schedule.

Each run trains the same float64 model on the same data with a constant global batch of 64:
at world size 1, at 2, and 2 -> 3 -> 1 with resizes scheduled mid-epoch, on default settings:
the test pool's --max 4 cuts every step into 4 micro-batches of 16 (engine.data.batching.Cut), by
rule, the same in every run. All must end with the parameters (and buffers) of
a single-process reference that runs the same micro-batches in order, each with its own random
stream, and takes the mean gradient of each batch. The model is plain, or has dropout (a mask per
micro-batch), or BatchNorm in training mode (statistics per micro-batch, running statistics updated
in micro-batch order).
"""
import pytest
import torch

from elastic_jupyter import RunConfig, TrainingRun
from elastic_jupyter.engine.data.batching import BATCHNORM_FLOOR, BatchPlan, choose_cut, rank_share
from elastic_jupyter.engine.data.randomness import stream_seed

CELL = '''
import torch
from sklearn.datasets import load_digits
X, y = load_digits(return_X_y=True)
dataset = torch.utils.data.TensorDataset(torch.tensor(X[:1000], dtype=DTYPE) / 16, torch.tensor(y[:1000]))
model = torch.nn.Sequential(torch.nn.Linear(64, 16), LAYER torch.nn.Tanh(),
                            torch.nn.Linear(16, 10)).to(DTYPE)
optimizer = OPTIMIZER(model.parameters())
def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)
'''
OPTIMIZERS = {"sgd": "lambda p: torch.optim.SGD(p, lr=0.2)",
              "adam": "lambda p: torch.optim.Adam(p, lr=0.01)"}
LAYERS = {"plain": "", "dropout": "torch.nn.Dropout(0.5),",
          "batchnorm": "torch.nn.BatchNorm1d(16),"}
STEPS, BATCH = 56, 64  # 1000 samples: 16 steps per epoch, the last one of 40
SCHEDULE = [(20, 3), (40, 1)]  # both mid-epoch
POOL = (1, 4)  # the test pool's bounds, which fix the micro-batches


def cell(optimizer: str, dtype: str, layer: str = "plain") -> str:
    return (CELL.replace("DTYPE", f"torch.{dtype}").replace("LAYER", LAYERS[layer])
            .replace("OPTIMIZER", f"({OPTIMIZERS[optimizer]})"))


def run_elastic(pool, tmp_path, source, engines, schedule=(), name="inv"):
    config = RunConfig(name=name, global_batch=BATCH, steps=STEPS, checkpoint_every=0, seed=7)
    run = TrainingRun(pool, config, source=source, engines=engines, schedule=list(schedule),
                      workspace=str(tmp_path / f"{name}-{engines}-{len(schedule)}")).start()
    assert run.wait(timeout=240) == "finished", run.logs()
    return run


def reference(source: str, passes, layer: str):
    """Single-process training of the same cell: each step runs the forward passes
    ``passes(plan, step, batch)`` gives as (sample indices, loss weight, torch seed), in order,
    with the micro-batches the default cut gives on the test pool. Returns the named
    parameters before training, the state dict after it and the number of micro-batches of
    all steps."""
    import random
    import numpy as np
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    ns = {}
    exec(source, ns)
    model, opt, data, loss_fn = ns["model"], ns["optimizer"], ns["dataset"], ns["loss_fn"]
    start = {k: p.detach().clone() for k, p in model.named_parameters()}
    floor = BATCHNORM_FLOOR if layer == "batchnorm" else 1
    cut = choose_cut(BATCH, None, None, *POOL, floor, "")
    plan, epoch, position, micro_batches = BatchPlan(len(data), BATCH, 7, cut), 0, 0, 0
    for step in range(STEPS):
        idx = plan.batch(epoch, position)
        micro_batches += plan.micro_batch_count(len(idx))
        opt.zero_grad()
        for samples, weight, seed in passes(plan, step, idx):
            torch.manual_seed(seed)
            batch = torch.utils.data.default_collate([data[int(i)] for i in samples])
            (loss_fn(model, batch) * weight).backward()
        opt.step()
        epoch, position = plan.advance(epoch, position)
    return start, {k: v.detach() for k, v in model.state_dict().items()}, micro_batches


def micro_batch_passes(plan, step, idx):
    """What every schedule must match: the plan's micro-batches, micro-batch k of step s drawing
    from the stream of (seed, s, k), each mean loss weighted by its share of the batch."""
    return [(m, len(m) / len(idx), stream_seed(7, step, k))
            for k, m in enumerate(plan.micro_batches(idx))]


def one_stream_passes(plan, step, idx):
    """Wrong: a stream per (seed, step) only, so every micro-batch draws the same mask."""
    return [(m, weight, stream_seed(7, step, 0))
            for m, weight, _ in micro_batch_passes(plan, step, idx)]


def rank_share_passes(weighting):
    """Wrong: one forward pass per rank of the 2 -> 3 -> 1 schedule over its share (per-rank
    BatchNorm statistics), its loss weighted by ``weighting(n_rank, B, W)``."""
    def passes(plan, step, idx):
        W = scheduled_world_size(step)
        shares = [idx[rank_share(len(idx), r, W)] for r in range(W)]
        return [(s, weighting(len(s), len(idx), W), 7) for s in shares]
    return passes


# per model, a mistake the comparison must be sharp enough to see
WRONG = {"plain": rank_share_passes(lambda n, B, W: 1 / W),  # the classic: 1/W for n_rank/B
         "dropout": one_stream_passes,
         "batchnorm": rank_share_passes(lambda n, B, W: n / B)}


def scheduled_world_size(step: int) -> int:
    return 2 if step < 20 else 3 if step < 40 else 1


def max_relative_deviation(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)


@pytest.mark.parametrize("optimizer,layer", [("sgd", "plain"), ("adam", "plain"),
                                             ("sgd", "dropout"), ("adam", "batchnorm")])
def test_parameters_do_not_depend_on_the_world_size_schedule(idle_pool, tmp_path, optimizer,
                                                             layer):
    assert (idle_pool.config.min_size, idle_pool.config.max_size) == POOL
    source = cell(optimizer, "float64", layer)
    runs = {"2-3-1": run_elastic(idle_pool, tmp_path, source, 2, SCHEDULE)}
    runs.update({str(n): run_elastic(idle_pool, tmp_path, source, n) for n in (1, 2)})
    start, expected, micro_batches = reference(source, micro_batch_passes, layer)
    _, wrong, _ = reference(source, WRONG[layer], layer)
    close = dict(rtol=1e-7, atol=1e-9)
    assert not all(torch.allclose(wrong[k], expected[k], **close) for k in expected)
    moved = sum((expected[k] - s).norm() for k, s in start.items())
    assert moved / sum(s.norm() for s in start.values()) > 0.01
    if layer == "batchnorm":  # one update of the running statistics per micro-batch
        assert int(expected["1.num_batches_tracked"]) == micro_batches
    cuts = {e["message"] for run in runs.values() for e in run.events
            if e["kind"] == "micro_batches"}  # the same cut, said in each run
    assert len(cuts) == 1 and "4 micro-batches of 16" in cuts.pop()
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


MIXUP_CELL = '''
import random
import numpy as np
import torch
from sklearn.datasets import load_digits
X, y = load_digits(return_X_y=True)
dataset = torch.utils.data.TensorDataset(torch.tensor(X[:512], dtype=torch.float64) / 16,
                                         torch.tensor(y[:512]))
model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(),
                            torch.nn.Linear(16, 10)).double()
optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
def loss_fn(model, batch):
    """timm's Mixup: the mixing ratio from numpy's global generator, the batch mixed with its
    flipped self, the loss of both targets; a Python random draw picks the smoothing."""
    x, y = batch
    lam = float(np.random.beta(1.0, 1.0))
    smoothing = random.choice([0.0, 0.1])
    out = model(lam * x + (1 - lam) * x.flip(0))
    ce = lambda t: torch.nn.functional.cross_entropy(out, t, label_smoothing=smoothing)
    return lam * ce(y) + (1 - lam) * ce(y.flip(0))
'''


def test_numpy_and_python_draws_in_loss_fn_do_not_depend_on_the_world_size(idle_pool, tmp_path):
    """A Mixup-like loss_fn drawing from numpy's and Python's global generators: a run resized
    2 -> 3 -> 1 ends with the parameters of a run fixed at 2 (each micro-batch draws from
    its own stream, whichever rank runs it; before, each rank drew its own sequence)."""
    def run(schedule):
        config = RunConfig(name="mixup", global_batch=64, micro_batch=16, steps=12,
                           checkpoint_every=0, seed=7)
        return TrainingRun(idle_pool, config, source=MIXUP_CELL, engines=2,
                           schedule=list(schedule),
                           workspace=str(tmp_path / f"mixup-{len(schedule)}")).start()
    resized = run([(4, 3), (8, 1)])
    assert resized.wait(timeout=240) == "finished", resized.logs()
    assert [r["world_size"] for r in resized.history] == [2] * 4 + [3] * 4 + [1] * 4
    fixed = run([])
    assert fixed.wait(timeout=240) == "finished", fixed.logs()
    got, expected = resized.state_dict(), fixed.state_dict()
    for k in expected:
        assert torch.allclose(got[k], expected[k], rtol=1e-9, atol=0), k
