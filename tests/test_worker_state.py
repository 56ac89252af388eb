"""A Worker's state across rollbacks, restores, evaluation and fp16 steps, in one process."""
import pytest
import torch
from worlds import cell_namespace, config

from elastic_jupyter.engine.worker import SetupError, Worker

CELL = '''
import torch
g = torch.Generator().manual_seed(0)
dataset = torch.utils.data.TensorDataset(torch.randn(DATA, 8, generator=g),
                                         torch.randn(DATA, 1, generator=g))
model = torch.nn.Sequential(torch.nn.Linear(8, 16), LAYER, torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)
'''


def worker(data=64, layer="torch.nn.Identity()", **options) -> Worker:
    source = CELL.replace("DATA", str(data)).replace("LAYER", layer)
    return Worker(cell_namespace(source, 3), config(steps=100, **options), "cpu")


def params(w: Worker) -> list[torch.Tensor]:
    return [p.detach().clone() for p in w.model.parameters()]


def test_a_commit_restored_twice_gives_the_same_training_both_times():
    w = worker()
    for _ in range(2):
        w.train_step(0, 1, 0.0)
    w.commit()
    after = []
    for _ in range(2):  # a fault, a rollback, another fault before the next commit
        w.rollback(2)
        for _ in range(2):
            w.train_step(0, 1, 0.0)
        after.append(params(w))
    assert all(torch.equal(a, b) for a, b in zip(*after))
    assert w.optimizer.state_dict()["state"][0]["step"].item() == 4


def test_a_restore_from_elsewhere_drops_the_commits_of_the_old_timeline():
    w = worker()
    w.train_step(0, 1, 0.0)
    w.commit()
    w.restore(worker().capture())  # a broadcast or a checkpoint at step 0
    assert w.commit_steps() == []


def test_fp16_steps_on_a_rank_that_scaled_no_loss(monkeypatch):
    pytest.importorskip("torch.amp")
    try:
        w = worker(precision="fp16")
    except SetupError as e:  # a torch without fp16 autocast on CPU
        pytest.skip(str(e))
    for p in w.model.parameters():  # the reduced gradients of its peers; no backward here
        p.grad = torch.zeros_like(p)
    w.precision.step(w.optimizer, None, w.model.parameters())
    assert w.precision.scaler.get_scale() == 65536.0


def test_batchnorm_in_training_mode_refuses_micro_batches_of_one_sample():
    # 37 samples, B 16 on a pool of 1..4: full steps cut into 8 micro-batches of 2; the
    # epoch's last step holds 5, cut into 4 micro-batches (one of them a single sample)
    with pytest.raises(SetupError, match="at least 2 samples per micro-batch.*step of 5"):
        worker(data=37, layer="torch.nn.BatchNorm1d(16)", global_batch=16, pool_max_size=4)
    worker(data=32, layer="torch.nn.BatchNorm1d(16)", global_batch=16, pool_max_size=4)


def test_evaluation_gives_each_rank_its_own_buffers_back():
    w = worker(layer="torch.nn.BatchNorm1d(16)")
    w.eval_dataset, w.metric_fn = w.dataset, (lambda model, batch: {"n": 1.0})
    w.train_step(0, 1, 0.0)
    before = [b.clone() for b in w.model.buffers()]
    w.evaluate(0, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, w.model.buffers()))
