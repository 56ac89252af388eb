"""The cost of a pass (engine.step.calibration): measured on rank 0, shared by every rank, without a
trace in the model, and kept by the run's state so every generation and a resume cut steps alike.
"""
import time

import pytest
import torch

from elastic_jupyter import RunConfig, TrainingRun
from elastic_jupyter.engine.step import calibration
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


def test_measuring_leaves_no_trace():
    """--pass-cost measure: buffers (a cumulative BatchNorm counts its batches), gradients, the
    optimizer and the RNG are as before; the run then cuts its steps by the measured cost."""
    worker = Worker(cell_namespace(CELL, 3), config(global_batch=32, steps=2, pool_min_size=1,
                                                    pool_max_size=4, pass_cost="measure"), "cpu")
    assert worker.progress.cut is None
    state = {k: v.clone() for k, v in worker.model.state_dict().items()}
    rng = torch.get_rng_state()
    event = worker.cut_choice.record(worker.plan, worker.progress, 0, 1)
    assert all(torch.equal(v, state[k]) for k, v in worker.model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in worker.model.parameters())
    assert worker.optimizer.state_dict()["state"] == {}
    cost = worker.progress.pass_cost
    assert cost is not None and worker.plan.cut.pass_cost == cost and event["pass_cost"] == cost
    assert worker.progress.cut == worker.plan.cut.as_dict() and worker.plan.cut.rule == "pass_cost"
    count = worker.plan.micro_batch_count(32)
    assert event["kind"] == "micro_batches" and f"cut into {count} micro-batches" in event["message"]
    assert f"--pass-cost {cost:g}" in event["message"]


def test_the_default_cut_is_a_rule_and_a_restore_keeps_the_states_cut():
    """No clock by default: 32 samples on a pool of --max 4 are 4 micro-batches of 8 (floor 8:
    BatchNorm), on every engine; a state's recorded cut wins over this run's options."""
    worker = Worker(cell_namespace(CELL, 3), config(global_batch=32, steps=2, pool_min_size=1,
                                                    pool_max_size=4), "cpu")
    event = worker.cut_choice.record(worker.plan, worker.progress, 0, 1)
    assert event["micro_batches"] == 4 and event["floor"] == 8 and event["pass_cost"] is None
    assert "4 micro-batches of 8 (one per virtual worker: the pool's --max 4; floor 8: " \
        "BatchNorm" in event["message"]
    state = worker.capture()
    other = Worker(cell_namespace(CELL, 3), config(global_batch=32, steps=2, micro_batch=16),
                   "cpu")
    assert other.plan.micro_batch_count(32) == 2
    other.restore(state)
    assert other.plan.micro_batch_count(32) == 4 and other.progress.cut == state["progress"]["cut"]


def test_every_rank_gets_rank0s_cost(tmp_path):
    ranks = train(CELL, config(global_batch=32, pool_min_size=1, pool_max_size=4,
                               pass_cost="measure"), 2, 3, tmp_path)
    assert ranks[0].pass_cost is not None and ranks[0].pass_cost == ranks[1].pass_cost
    assert all(torch.equal(ranks[0].params[k], ranks[1].params[k]) for k in ranks[0].params)


def test_a_resume_keeps_the_cut_its_checkpoint_recorded(idle_pool, tmp_path):
    config_ = RunConfig(name="cut", global_batch=32, steps=4, checkpoint_every=2, seed=1)
    run = TrainingRun(idle_pool, config_, source=CELL, engines=2, schedule=[(2, 3)],
                      workspace=str(tmp_path)).start()
    assert run.wait(timeout=240) == "finished", run.logs()
    cut, = [e for e in run.events if e["kind"] == "micro_batches"]
    assert cut["step"] == 0 and cut["micro_batches"] == 4 and "cut into" in run.logs()
    saved = torch.load(run.checkpoints[-1]["path"], weights_only=True)
    recorded = saved["progress"]["cut"]
    assert recorded["rule"] == "virtual workers" and recorded["virtual"] == 4

    more = RunConfig(name="cut", global_batch=32, steps=8, checkpoint_every=2, seed=1,
                     micro_batch=16)
    resumed = TrainingRun(idle_pool, more, source=CELL, engines=2, resume=True,
                          workspace=str(tmp_path)).start()
    assert resumed.wait(timeout=240) == "finished", resumed.logs()
    said = [e["message"] for e in resumed.events if e["kind"] == "micro_batches"]
    assert len(said) == 1 and "this run keeps that cut" in said[0], said
    saved = torch.load(resumed.checkpoints[-1]["path"], weights_only=True)
    assert saved["progress"]["step"] == 8 and saved["progress"]["cut"] == recorded


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


def test_a_cut_below_the_floor_is_refused_with_what_to_change():
    """BatchNorm sets a floor of 8 samples a micro-batch: 16 samples on a pool of --max 4 are
    refused at setup; the cell's min_micro_batch accepts them; a short last step (44 % 16 =
    12) is one micro-batch, not two of 6."""
    cfg = dict(global_batch=16, steps=1, pool_min_size=1, pool_max_size=4)
    with pytest.raises(SetupError, match=r"--global-batch 16 over the pool's --max 4 gives "
                       r"micro-batches of 4 samples, below the floor of 8 \(BatchNorm"):
        Worker(cell_namespace(BATCHNORM_CELL, 3), config(**cfg), "cpu")
    worker = Worker(cell_namespace(BATCHNORM_CELL + "min_micro_batch = 4\n", 3), config(**cfg),
                    "cpu")
    assert worker.plan.micro_batch_count(16) == 4 and worker.plan.micro_batch_count(12) == 3
    worker = Worker(cell_namespace(BATCHNORM_CELL, 3), config(**dict(cfg, pool_max_size=2)),
                    "cpu")
    assert worker.plan.micro_batch_count(16) == 2 and worker.plan.micro_batch_count(12) == 1
    with pytest.raises(SetupError, match="min_micro_batch must be a positive integer"):
        Worker(cell_namespace(BATCHNORM_CELL + "min_micro_batch = 0\n", 3), config(**cfg), "cpu")
