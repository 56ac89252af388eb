"""A late user error loses no training (issue 33, item 4).

Every user function the run calls later (metric_fn, the scheduler's step, collate_fn) is tried
when the cell runs, without changing any state, and an error there is a setup error; and an
error in the final evaluation leaves the final state written: ``run.state_dict()``,
``export()`` and ``--resume`` work from it, and the history keeps every step.
"""
import random

import numpy as np
import pytest
import torch
from conftest import DIGITS_CELL
from worlds import cell_namespace, config

from elastic_jupyter import RunConfig, RunSetupError, TrainingRun
from elastic_jupyter.engine.step.trials import SetupTrials
from elastic_jupyter.engine.worker import SetupError, Worker

# the issue's typo: top-50 accuracy over 10 classes
TOPK_TYPO = '''
eval_dataset = torch.utils.data.Subset(dataset, range(300))
def metric_fn(model, batch):
    x, y = batch
    top = model(x).topk(50, dim=1).indices
    return {"top5": (top == y[:, None]).any(1).float().mean()}
'''

# BatchNorm, dropout, SGD with momentum and a OneCycleLR, which sets lr and momentum each step
STATEFUL_CELL = '''
import torch
g = torch.Generator().manual_seed(0)
X, Y = torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
dataset = torch.utils.data.TensorDataset(X, Y)
eval_dataset = torch.utils.data.TensorDataset(X[:20], Y[:20])
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                            torch.nn.Dropout(0.3), torch.nn.Linear(16, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
lr_scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=50)
def collate_fn(samples):
    x, y = torch.utils.data.default_collate(samples)
    return x + 0.1 * torch.randn_like(x), y  # a random augmentation
def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)
def metric_fn(model, batch):
    x, y = batch
    return {"accuracy": (model(x).argmax(1) == y).double().mean(), "draw": torch.rand(())}
'''


def _everything(w: Worker) -> list:
    """Every piece of state a trial could change, as comparable values."""
    return [[t.clone() for t in w.model.state_dict().values()],
            [{k: v for k, v in g.items() if k != "params"} for g in w.optimizer.param_groups],
            str(w.lr_scheduler.state_dict()), [m.training for m in w.model.modules()],
            torch.get_rng_state(), random.getstate(), str(np.random.get_state())]


def _try(worker):
    """The setup's trials of the functions the run calls later (engine.entrypoints runs them)."""
    SetupTrials(worker.config, worker.objects, worker.plan, worker.device).run()


def test_the_trials_change_nothing():
    tried = Worker(cell_namespace(STATEFUL_CELL, 3), config(steps=4), "cpu")
    plain = Worker(cell_namespace(STATEFUL_CELL, 3), config(steps=4), "cpu")
    before = _everything(tried)
    _try(tried)
    after = _everything(tried)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    assert before[1:4] == after[1:4] and torch.equal(before[4], after[4])
    assert before[5:] == after[5:]
    for w in (tried, plain):
        for _ in range(4):
            w.history.append(w.train_step(0, 1)[0])
            w.lr_scheduler.step()
    for a, b in zip(tried.model.state_dict().values(), plain.model.state_dict().values()):
        assert torch.equal(a, b)
    assert [r["lr"] for r in tried.history] == [r["lr"] for r in plain.history]
    assert tried.evaluate(0, 1) == plain.evaluate(0, 1)


@pytest.mark.parametrize("change, words", [
    (TOPK_TYPO, "metric_fn, tried at setup on the first 4 samples of eval_dataset, failed: "
                "RuntimeError: selected index k out of range"),
    ("\nlr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 - step))\n",
     "the lr_scheduler's step, tried at setup, failed: ZeroDivisionError"),
    ("\ndef collate_fn(samples):\n    return torch.stack(samples)\n",
     "reading 4 training samples and collating them (dataset[i], collate_fn), tried at setup, "
     "failed: TypeError"),
    ("\neval_dataset = dataset\ndef metric_fn(model, batch):\n    return model(batch[0]).mean(0)\n",
     "metric_fn, tried at setup on the first 4 samples of eval_dataset, failed: TypeError: "
     "metric_fn must return a dict"),
], ids=["metric_fn", "lr_scheduler", "collate_fn", "metric_fn's output"])
def test_a_function_called_later_fails_at_setup(change, words):
    w = Worker(cell_namespace(DIGITS_CELL + change, 3), config(steps=4), "cpu")
    with pytest.raises(SetupError) as raised:
        _try(w)
    assert str(raised.value).startswith(words), str(raised.value)


def test_plateau_metric_missing_from_metric_fn_fails_at_setup():
    cell = DIGITS_CELL + TOPK_TYPO.replace("50", "5") + (
        "\nlr_scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)\n")
    w = Worker(cell_namespace(cell, 3), config(steps=4, plateau_metric="val_accuracy"), "cpu")
    with pytest.raises(SetupError, match="--plateau-metric val_accuracy: metric_fn, tried at setup, "
                                         "gives val_top5"):
        _try(w)


# ------------------------------------------------------------------------- runs on the pool

def test_the_issues_metric_typo_is_refused_at_setup(idle_pool, tmp_path):
    run = TrainingRun(idle_pool, RunConfig(name="topk-typo", steps=300, global_batch=32),
                      source=DIGITS_CELL + TOPK_TYPO, engines=2, workspace=str(tmp_path))
    with pytest.raises(RunSetupError) as raised:
        run.start()
    first = str(raised.value).splitlines()[0]
    assert "metric_fn, tried at setup" in first and "selected index k out of range" in first
    assert "topk(50" in str(raised.value)  # the engine traceback shows the cell's line
    assert idle_pool.run is None and run.step == 0


# metric_fn fails at its first call after training began: the final evaluation (no
# --eval-every); the trial at setup comes before any training
FINAL_EVAL_CELL = DIGITS_CELL + '''
eval_dataset = torch.utils.data.Subset(dataset, range(200))
_trained, _loss = [False], loss_fn
def loss_fn(model, batch):
    _trained[0] = True
    return _loss(model, batch)
def metric_fn(model, batch):
    x, y = batch
    if FAIL and _trained[0]:
        raise ValueError("metric_fn broke at the final evaluation")
    return {"accuracy": (model(x).argmax(1) == y).double().mean()}
'''


def _final_eval_run(pool, tmp_path, name: str, fail: bool, resume: bool = False):
    config = RunConfig(name=name, global_batch=32, micro_batch=8, steps=12, checkpoint_every=0)
    run = TrainingRun(pool, config, source=FINAL_EVAL_CELL.replace("FAIL", str(fail)), engines=2,
                      workspace=str(tmp_path), resume=resume).start()
    run.wait(timeout=120)
    return run


def test_an_error_in_the_final_evaluation_keeps_the_final_state(idle_pool, tmp_path):
    failed = _final_eval_run(idle_pool, tmp_path, "late-error", fail=True)
    assert failed.state == "failed", failed.summary()
    assert "ValueError: metric_fn broke at the final evaluation" in failed.error
    # every step is in the history, the last one without its evaluation
    assert [r["step"] for r in failed.history] == list(range(1, 13))
    assert not any("val_accuracy" in r for r in failed.history)
    clean = _final_eval_run(idle_pool, tmp_path, "no-error", fail=False)
    assert clean.state == "finished", clean.summary()
    # the trained weights are the run's final ones, as a run without the error ends with
    expected = clean.state_dict()
    got = failed.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    exported = torch.load(failed.export(str(tmp_path / "late.pt")), weights_only=True)
    assert all(torch.equal(exported[k], expected[k]) for k in expected)
    assert [r["loss"] for r in failed.history] == [r["loss"] for r in clean.history]
    # --resume with metric_fn fixed runs the missing evaluation: the clean run's end
    resumed = _final_eval_run(idle_pool, tmp_path, "late-error", fail=False, resume=True)
    assert resumed.state == "finished", resumed.summary()
    def steps(history):
        return [{k: v for k, v in r.items() if k not in ("time", "samples_per_s")}
                for r in history]
    assert steps(resumed.history) == steps(clean.history)
    assert "val_accuracy" in resumed.history[-1]
    got = resumed.state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


# loss_fn raises on rank 1 at step 8's pass: steps 1..7 are committed, none checkpointed
MID_RUN_CELL = DIGITS_CELL + '''
import torch.distributed as dist
_loss, _passes = loss_fn, [0]
def loss_fn(model, batch):
    _passes[0] += 1
    if FAIL and dist.get_rank() == 1 and _passes[0] > 7 * PASSES:
        raise ValueError("a bad sample in step 8")
    return _loss(model, batch)
'''


def test_an_error_mid_run_keeps_every_committed_step(idle_pool, tmp_path):
    """Was: the run failed and state_dict() raised 'no state in memory and no usable
    checkpoint'. Now the state of the last committed step (7) is the run's, written as a
    checkpoint: state_dict(), export() and --resume work from it."""
    def run(name, fail, steps, resume=False):
        config = RunConfig(name=name, global_batch=32, steps=steps, checkpoint_every=0, seed=2)
        source = MID_RUN_CELL.replace("FAIL", str(fail)).replace("PASSES", "2")
        run = TrainingRun(idle_pool, config, source=source, engines=2, resume=resume,
                          workspace=str(tmp_path)).start()
        run.wait(timeout=120)
        return run
    failed = run("mid", True, 12)
    assert failed.state == "failed" and "a bad sample in step 8" in failed.error
    assert [r["step"] for r in failed.history] == list(range(1, 8))
    assert [c["step"] for c in failed.checkpoints] == [7]
    expected = run("seven", False, 7).state_dict()
    got = failed.state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    resumed = run("mid", False, 12, resume=True)
    assert resumed.state == "finished" and resumed.history[0]["step"] == 1, resumed.error
    clean = run("clean", False, 12).state_dict()
    got = resumed.state_dict()
    assert all(torch.equal(got[k], clean[k]) for k in clean)
