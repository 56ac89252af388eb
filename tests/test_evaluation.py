"""Evaluation leaves every layer's mode as it found it and uses rank 0's buffers on every rank;
its value is the exact mean over the eval set (token means included) at any world size."""
import datetime
import json
import math
import re

import pytest
import torch
import torch.distributed as dist
from worlds import cell_namespace, config, spawn

from elastic_jupyter import MeanOver, RunConfig, TrainingRun
from elastic_jupyter.engine.data.batching import BatchPlan, choose_cut
from elastic_jupyter.engine.group.vote import Vote
from elastic_jupyter.engine.worker import Worker

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
    # the run's cut: --pass-cost 0 on the pool's bounds; no floor (the BatchNorm is frozen)
    plan, epoch, position = BatchPlan(120, 20, 0, choose_cut(20, None, 0.0, *bounds, 1, "")), 0, 0
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
    totals, uneven = rank0_samples(history, (idle_pool.config.min_size, idle_pool.config.max_size))
    assert uneven
    assert [r["val_seen"] for r in evals] == [totals[4], totals[8], totals[12]]
    assert float(state["2.seen"]) == totals[12]


# ---------------------------------------------------------------- the mean over the eval set

# A sequence model in float64: each eval sample holds 5 tokens, of which 0..5 count (the rest
# padding); metric_fn gives a token mean (MeanOver), a tensor mean over the samples and a float
TOKEN_CELL = '''
import torch
from elastic_jupyter import MeanOver
g = torch.Generator().manual_seed(0)
X = torch.randn(96, 6, generator=g, dtype=torch.float64)
Y = torch.randint(0, 3, (96,), generator=g)
dataset = torch.utils.data.TensorDataset(X, Y)
EX = torch.randn(53, 5, 6, generator=g, dtype=torch.float64)
EY = torch.randint(0, 3, (53, 5), generator=g)
EN = torch.randint(0, 6, (53,), generator=g)
eval_dataset = torch.utils.data.TensorDataset(EX, EY, EN)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                            torch.nn.Linear(16, 3)).double()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)
def token_losses(model, batch):
    x, y, n = batch
    losses = torch.nn.functional.cross_entropy(model(x).transpose(1, 2), y, reduction="none")
    return losses, torch.arange(5) < n[:, None]
def metric_fn(model, batch):
    losses, mask = token_losses(model, batch)
    count = mask.sum()
    return {"token_loss": MeanOver((losses * mask).sum() / count.clamp(min=1), count),
            "first_loss": losses[:, 0].mean(),
            "tokens": float(mask.sum(1).double().mean())}
'''
# chunks of 7 (--micro-batch): 53 samples make 8 chunks, the last of 4; at 3 ranks 3 + 3 + 2
EVAL_CONFIG = dict(micro_batch=7, steps=1)


def _evaluate_rank(rank: int, worlds: tuple, store_path: str, out: str):
    """Evaluate at each world size of `worlds` in turn (ranks beyond one leave), every world
    with its own process group and commit vote; --loader-processes 2."""
    results, files = {}, dist.FileStore(store_path, max(worlds))  # one for all: see FileStore
    for world_size in worlds:
        if rank >= world_size:
            break
        store = dist.PrefixStore(f"world{world_size}/", files)
        dist.init_process_group("gloo", store=dist.PrefixStore("pg/", store), rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=60))
        try:
            vote = Vote(dist.PrefixStore("control/", store), rank, world_size, 60.0)
            worker = Worker(cell_namespace(TOKEN_CELL, 3),
                            config(**EVAL_CONFIG, loader_processes=2), "cpu")
            results[world_size] = worker.evaluate(rank, world_size, vote)
        finally:
            dist.destroy_process_group()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(results, f)


def test_evaluation_is_the_exact_mean_over_the_eval_set_at_any_world_size(tmp_path):
    """Evaluation at 1, 2 and 3 ranks (2 and 3 through --loader-processes 2) equals a
    plain loop's mean over the eval set, token means included, and is bitwise the same."""
    ns = cell_namespace(TOKEN_CELL, 3)
    with torch.no_grad():
        losses, mask = ns["token_losses"](ns["model"], ns["eval_dataset"][:])
    expected = {"val_token_loss": float((losses * mask).sum() / mask.sum()),
                "val_first_loss": float(losses[:, 0].mean()),
                "val_tokens": float(mask.sum(1).double().mean())}
    one = Worker(cell_namespace(TOKEN_CELL, 3), config(**EVAL_CONFIG), "cpu").evaluate(0, 1)
    assert one.keys() == expected.keys()
    for name, value in expected.items():
        assert abs(one[name] - value) <= 1e-12 * abs(value), (name, one[name], value)
    # weighting the token mean by samples per chunk (as evaluation once did) is far off
    assert abs(one["val_token_loss"] - float((losses * mask).sum(1).div(
        mask.sum(1).clamp(min=1)).mean())) > 1e-3
    spawn(_evaluate_rank, ((3, 2), str(tmp_path / "store"), str(tmp_path)), 3)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    # every rank of each world returns the same metrics as one rank, bit for bit
    assert [list(r) for r in ranks] == [["3", "2"], ["3", "2"], ["3"]]
    assert all(result == one for r in ranks for result in r.values())


def test_metric_fn_values_must_be_means(tmp_path):
    w = Worker(cell_namespace(TOKEN_CELL, 3), config(**EVAL_CONFIG), "cpu")
    cases = [(lambda m, b: [1.0], "must return a dict {name: value}"),
             (lambda m, b: {"per_sample": b[2].double()},
              "metric_fn's 'per_sample': its value must be a number or a one-element tensor"),
             (lambda m, b: {"n": MeanOver(1.0, "many")}, "its MeanOver count must be a number"),
             (lambda m, b: {"n": MeanOver(1.0, -1)}, "MeanOver count must be >= 0, got -1")]
    for fn, words in cases:
        w.metric_fn = fn
        with pytest.raises((TypeError, ValueError), match=re.escape(words)):
            w.evaluate(0, 1)
    # counts of 0 add nothing: a metric no chunk counts is NaN
    w.metric_fn = lambda m, b: {"none": MeanOver(torch.tensor(float("nan")), 0), "one": 1.0}
    result = w.evaluate(0, 1)
    assert math.isnan(result["val_none"]) and result["val_one"] == 1.0
