"""A Worker's state across aborted steps, restores, evaluation and fp16 steps, in one process."""
import pytest
import torch
from worlds import cell_namespace, config

from elastic_jupyter.engine.group.vote import StepAborted, Vote
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


def worker(data=64, layer="torch.nn.Identity()", min_micro_batch=None, **options) -> Worker:
    source = CELL.replace("DATA", str(data)).replace("LAYER", layer)
    if min_micro_batch is not None:
        source += f"\nmin_micro_batch = {min_micro_batch}\n"
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


def test_batchnorm_never_gets_a_micro_batch_of_one_sample():
    # 37 samples, B 16 on a pool of 1..4 with BatchNorm's floor lowered to 2 by the cell: full
    # steps are 4 micro-batches of 4; the epoch's last step of 5 is 2 (3 and 2), not 4 (a 1 among
    # them); the floor of 2 holds even when the cell declares 1
    for declared in (2, 1):
        w = worker(data=37, layer="torch.nn.BatchNorm1d(16)", global_batch=16, pool_max_size=4,
                   min_micro_batch=declared)
        assert w.plan.cut.floor == 2
        assert [len(m) for m in w.plan.micro_batches(torch.arange(5))] == [2, 3]
        assert [len(m) for m in w.plan.micro_batches(torch.arange(16))] == [4] * 4


def test_evaluation_gives_each_rank_its_own_buffers_back():
    w = worker(layer="torch.nn.BatchNorm1d(16)")
    w.eval_dataset, w.metric_fn = w.dataset, (lambda model, batch: {"n": 1.0})
    w.train_step(0, 1)
    before = [b.clone() for b in w.model.buffers()]
    w.evaluate(0, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, w.model.buffers()))


def test_a_step_record_logs_every_param_groups_learning_rate():
    """``lr`` is the first group's; ``lr_1``, ``lr_2`` the further groups' (as the scheduler
    set them for the step), only where there are several; the views' columns leave them out."""
    from elastic_jupyter.server import series
    w = worker(global_batch=16)
    assert set(w.train_step(0, 1)[0]) & {"lr", "lr_1"} == {"lr"}
    groups = CELL.replace("DATA", "64").replace("LAYER", "torch.nn.Identity()").replace(
        "optimizer = torch.optim.Adam(model.parameters(), lr=0.05)",
        "optimizer = torch.optim.SGD([{'params': model[0].parameters()},\n"
        "    {'params': model[3].parameters(), 'lr': 0.5},\n"
        "    {'params': [], 'lr': torch.tensor(0.25)}], lr=0.1)\n"
        "lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)")
    w = Worker(cell_namespace(groups, 3), config(steps=100, global_batch=16), "cpu")
    record = w.train_step(0, 1)[0]
    assert (record["lr"], record["lr_1"], record["lr_2"]) == (0.1, 0.5, 0.25)
    assert type(record["lr_2"]) is float and "lr_3" not in record
    w.lr_scheduler.step()  # as the generation steps it (engine.step.schedulers)
    record = w.train_step(0, 1)[0]
    assert (record["lr"], record["lr_1"]) == (0.05, 0.25)
    names = series.column_names([record])
    assert "lr" not in names and "lr_1" not in names and "lr_2" not in names
