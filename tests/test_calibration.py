"""The cost of a pass (engine.calibration): measured on rank 0, shared by every rank, without a
trace in the model, and kept by the run's state so every generation and a resume cut steps alike.
"""
import time

import pytest
import torch

from elastic_jupyter import RunConfig, TrainingRun
from elastic_jupyter.engine import calibration
from elastic_jupyter.engine.worker import SetupError, Worker

from worlds import cell_namespace, config, train

CELL = '''
import torch
X = torch.randn(96, 8, dtype=torch.float64)
dataset = torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True))
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8, momentum=None),
                            torch.nn.Dropout(0.5), torch.nn.Linear(8, 1)).double()
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)
'''


def test_pass_cost_from_two_timings():
    # a pass costs 1 s plus 0.01 s a sample: P = 100 samples, rounded to 128
    assert calibration.pass_cost_from(1.02, 1.16, 2, 16) == 128.0
    assert calibration.pass_cost_from(0.0201, 0.16, 2, 16) == 0.0  # P = 0.01: samples only
    assert calibration.pass_cost_from(1.0, 0.9, 2, 16) == calibration.MAX_PASS_COST
    with pytest.raises(ValueError):
        calibration.measure_pass_cost(lambda size: None, 8, 8)


def test_measure_pass_cost_times_real_passes():
    """A pass that sleeps 20 ms plus 1 ms a sample costs 20 samples: 16 after rounding."""
    sizes = []

    def run_pass(size):
        sizes.append(size)
        time.sleep(0.020 + 0.001 * size)

    assert calibration.measure_pass_cost(run_pass, 2, 16) == 16.0
    assert sizes == [2, 16] * (1 + calibration.REPEATS)  # untimed first, then interleaved


def test_calibration_leaves_no_trace():
    """Buffers (a cumulative BatchNorm counts its batches), gradients, the optimizer and the
    RNG are as before; the run then cuts its steps by the measured cost."""
    worker = Worker(cell_namespace(CELL, 3), config(global_batch=32, steps=2, pool_min_size=1,
                                                    pool_max_size=4), "cpu")
    assert worker.progress.pass_cost is None
    state = {k: v.clone() for k, v in worker.model.state_dict().items()}
    rng = torch.get_rng_state()
    event = worker.calibrate(0, 1)
    assert all(torch.equal(v, state[k]) for k, v in worker.model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in worker.model.parameters())
    assert worker.optimizer.state_dict()["state"] == {}
    cost = worker.progress.pass_cost
    assert cost is not None and worker.plan.pass_cost == cost and event["pass_cost"] == cost
    count = worker.plan.micro_batch_count(32)
    assert event["kind"] == "micro_batches" and f"cut into {count} micro-batches" in event["message"]
    assert f"--pass-cost {cost:g}" in event["message"]


def test_a_given_pass_cost_is_kept_over_a_restored_one():
    """--pass-cost is not measured, and wins over the cost a resumed checkpoint holds."""
    worker = Worker(cell_namespace(CELL, 3), config(global_batch=32, steps=1, pass_cost=4),
                    "cpu")
    assert worker.progress.pass_cost == worker.plan.pass_cost == 4.0
    state = worker.capture()
    state["progress"]["pass_cost"] = 64.0
    worker.restore(state)
    assert worker.progress.pass_cost == worker.plan.pass_cost == 4.0


def test_every_rank_gets_rank0s_cost(tmp_path):
    ranks = train(CELL, config(global_batch=32, pool_min_size=1, pool_max_size=4), 2, 3,
                  tmp_path)
    assert ranks[0].pass_cost is not None and ranks[0].pass_cost == ranks[1].pass_cost
    assert all(torch.equal(ranks[0].params[k], ranks[1].params[k]) for k in ranks[0].params)


def test_a_run_measures_once_and_a_resume_keeps_the_cut(idle_pool, tmp_path):
    config_ = RunConfig(name="cut", global_batch=32, steps=4, checkpoint_every=2, seed=1)
    run = TrainingRun(idle_pool, config_, source=CELL, engines=2, schedule=[(2, 3)],
                      workspace=str(tmp_path)).start()
    assert run.wait(timeout=240) == "finished", run.logs()
    cut, = [e for e in run.events if e["kind"] == "micro_batches"]
    assert cut["step"] == 0 and "cut into" in run.logs()
    saved = torch.load(run.checkpoints[-1]["path"], weights_only=True)
    assert saved["progress"]["pass_cost"] == cut["pass_cost"]

    more = RunConfig(name="cut", global_batch=32, steps=8, checkpoint_every=2, seed=1)
    resumed = TrainingRun(idle_pool, more, source=CELL, engines=2, resume=True,
                          workspace=str(tmp_path)).start()
    assert resumed.wait(timeout=240) == "finished", resumed.logs()
    assert not [e for e in resumed.events if e["kind"] == "micro_batches"]
    saved = torch.load(resumed.checkpoints[-1]["path"], weights_only=True)
    assert saved["progress"]["step"] == 8 and saved["progress"]["pass_cost"] == cut["pass_cost"]


def test_a_long_pass_means_samples_dominate():
    sizes = []

    def run_pass(size):
        sizes.append(size)
        time.sleep(calibration.LONG_PASS_S if size == 16 else 0.0)

    assert calibration.measure_pass_cost(run_pass, 2, 16) == 0.0
    assert sizes == [2, 16]  # no timed passes after a long one


BATCHNORM_CELL = '''
import torch
dataset = torch.utils.data.TensorDataset(torch.randn(44, 4), torch.randn(44, 1))
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)
'''


def test_a_pass_cost_that_cuts_batchnorm_too_fine_is_refused():
    """22 samples capped at 2 a micro-batch on 1..2 ranks: 11 micro-batches of 2 with a free
    pass, but 12 (some of 1 sample) with a pass costing 1: BatchNorm cannot train on those."""
    worker = Worker(cell_namespace(BATCHNORM_CELL, 3),
                    config(global_batch=22, micro_batch=2, steps=1, pool_min_size=1,
                           pool_max_size=2, pass_cost=0.0), "cpu")
    state = worker.capture()
    state["progress"]["pass_cost"] = 1.0
    worker.config["pass_cost"] = None  # as a resumed run that measured its cost
    with pytest.raises(SetupError, match="at least 2 samples per micro-batch"):
        worker.restore(state)
