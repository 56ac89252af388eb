"""Evaluation leaves every layer's mode as it found it and uses rank 0's buffers on every rank."""
from elastic_jupyter import RunConfig, TrainingRun
from elastic_jupyter.engine.batching import BatchPlan

CELL = '''
import torch

class Counter(torch.nn.Module):
    """Counts the samples it sees in training mode: a buffer each rank updates from its own
    micro-batches, so ranks disagree unless evaluation shares rank 0's."""
    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.float64))
    def forward(self, x):
        if self.training:
            self.seen += x.shape[0]
        return x

g = torch.Generator().manual_seed(0)
X = torch.randn(120, 4, generator=g, dtype=torch.float64)
Y = torch.randint(0, 2, (120,), generator=g)
dataset = torch.utils.data.TensorDataset(X, Y)
eval_dataset = torch.utils.data.TensorDataset(X[:30], Y[:30])
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), Counter(),
                            torch.nn.Linear(8, 2)).double()
model[1].running_mean.fill_(0.5)
model[1].running_var.fill_(2.0)
model[1].eval()  # frozen: its running statistics must never change
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)
def metric_fn(model, batch):
    return {"seen": float(model[2].seen), "frozen_mean": float(model[1].running_mean.mean())}
'''


def rank0_samples(history: list, bounds: tuple) -> tuple[dict, bool]:
    """({step: samples rank 0 has processed after it}, whether another rank had more in some
    step, so that ranks' counters disagree), from the plan and each step's world size."""
    plan, epoch, position = BatchPlan(120, 20, 0, None, *bounds), 0, 0
    total, totals, uneven = 0, {}, False
    for record in history:
        batch = plan.batch(epoch, position)
        per_rank = [sum(len(m) for _, m in plan.rank_micro_batches(batch, r, record["world_size"]))
                    for r in range(record["world_size"])]
        total += per_rank[0]
        uneven |= max(per_rank) > per_rank[0]
        totals[record["step"]] = total
        epoch, position = plan.advance(epoch, position)
    return totals, uneven


def test_evaluation_keeps_modes_and_uses_rank0_buffers(idle_pool, tmp_path):
    # a free pass: the cut of 20 samples on 1..4 ranks gives a peer more samples than rank 0
    config = RunConfig(name="evalmodes", global_batch=20, steps=12, eval_every=4,
                       checkpoint_every=0, pass_cost=0.0)
    run = TrainingRun(idle_pool, config, source=CELL, engines=2, schedule=[(6, 3)],
                      workspace=str(tmp_path)).start()
    assert run.wait(timeout=240) == "finished", run.logs()
    history = run.history
    assert [r["world_size"] for r in history] == [2] * 6 + [3] * 6

    # the frozen BatchNorm never updated, also after the evaluations at steps 4 and 8
    state = run.state_dict()
    assert (state["1.running_mean"] == 0.5).all() and (state["1.running_var"] == 2.0).all()
    assert int(state["1.num_batches_tracked"]) == 0
    evals = [r for r in history if "val_seen" in r]
    assert [r["step"] for r in evals] == [4, 8, 12]
    assert all(r["val_frozen_mean"] == 0.5 for r in evals)

    # every rank evaluated with rank 0's counter, and the counter (in training mode) kept
    # counting after each evaluation: rank 0's samples so far, at 3 ranks fewer than a peer's
    totals, uneven = rank0_samples(history, (idle_pool.min_size, idle_pool.max_size))
    assert uneven
    assert [r["val_seen"] for r in evals] == [totals[4], totals[8], totals[12]]
    assert float(state["2.seen"]) == totals[12]
