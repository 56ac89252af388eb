"""A Worker's state across aborted steps, restores, evaluation and fp16 steps, in one process."""
import pytest
import torch
from worlds import cell_namespace, config

from elastic_jupyter.engine.vote import StepAborted, Vote
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


class FailingVote(Vote):
    """A one-rank vote that aborts its next round, as when a peer died before voting."""

    def __init__(self):
        super().__init__(None, 0, 1, 0.0)
        self.fail = True

    def _round(self, payload: bytes) -> list[bytes]:
        if self.fail:
            self.fail = False
            raise StepAborted("rank 1 did not finish its part in time")
        return super()._round(payload)


def snapshot(w: Worker) -> tuple:
    return (params(w), [b.clone() for b in w.model.buffers()],
            w.optimizer.state_dict()["state"], w.progress.as_dict(), len(w.history))


def test_a_step_the_vote_aborts_leaves_the_state_as_it_found_it():
    """No copy of the state is kept: what a step changes before its vote (BatchNorm's running
    statistics) is put back, and the step runs again as if it had never begun."""
    w, clean = worker(layer="torch.nn.BatchNorm1d(16)"), worker(layer="torch.nn.BatchNorm1d(16)")
    for _ in range(2):
        w.train_step(0, 1)
        clean.train_step(0, 1)
    before = snapshot(w)
    vote = FailingVote()
    with pytest.raises(StepAborted):
        w.train_step(0, 1, vote)
    after = snapshot(w)
    assert all(torch.equal(a, b) for a, b in zip(before[0] + before[1], after[0] + after[1]))
    assert str(before[2]) == str(after[2]) and before[3:] == after[3:]
    assert w.in_flight and w.pending is not None  # the fault lost the step in flight
    w.train_step(0, 1, vote)
    clean.train_step(0, 1)
    assert not w.in_flight
    assert all(torch.equal(a, b) for a, b in zip(params(w), params(clean)))
    assert all(torch.equal(a, b) for a, b in zip(w.model.buffers(), clean.model.buffers()))


def test_an_evaluation_a_peer_fails_gives_modes_and_buffers_back():
    w = worker(layer="torch.nn.BatchNorm1d(16)")
    w.eval_dataset, w.metric_fn = w.dataset, (lambda model, batch: {"n": 1.0})
    w.model[0].eval()  # frozen by the cell: stays so
    w.train_step(0, 1)
    buffers = [b.clone() for b in w.model.buffers()]
    with pytest.raises(StepAborted):
        w.evaluate(0, 1, FailingVote())
    assert [m.training for m in w.model] == [False, True, True, True]
    assert all(torch.equal(a, b) for a, b in zip(buffers, w.model.buffers()))


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
    w.train_step(0, 1)
    before = [b.clone() for b in w.model.buffers()]
    w.evaluate(0, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, w.model.buffers()))
