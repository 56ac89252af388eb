"""Every torch LR scheduler works, ReduceLROnPlateau included: it steps at each evaluation on
the --plateau-metric, or once per epoch on the epoch's mean training loss, exactly as a plain
single-process PyTorch loop steps it; its state goes into checkpoints like any scheduler's."""
import random
import uuid

import numpy as np
import pytest
import torch

from elastic_jupyter import RunConfig, RunSetupError, TrainingRun, UsageError
from elastic_jupyter.engine.state import checkpoint as ckpt
from elastic_jupyter.engine.data.batching import BatchPlan

CELL = '''
import torch
g = torch.Generator().manual_seed(5)
x = torch.randn(230, 6, generator=g, dtype=torch.float64)
y = (x @ torch.randn(6, 3, generator=g, dtype=torch.float64)).argmax(1)
dataset = torch.utils.data.TensorDataset(x[:170], y[:170])
eval_dataset = torch.utils.data.TensorDataset(x[170:], y[170:])
model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(),
                            torch.nn.Linear(12, 3)).double()
optimizer = torch.optim.SGD(model.parameters(), lr=0.8, momentum=0.9)
S = torch.optim.lr_scheduler
lr_scheduler = {scheduler}
def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)
def metric_fn(model, batch):
    x, y = batch
    out = model(x)
    return {"loss": torch.nn.functional.cross_entropy(out, y),
            "accuracy": (out.argmax(1) == y).double().mean()}
'''
PLATEAU = "S.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.02)"
B, SEED = 40, 4


def cell(scheduler: str) -> str:
    return CELL.replace("{scheduler}", scheduler)


def reference(steps: int, eval_every: int | None, metric: str | None, code=PLATEAU):
    """The cell in a plain single-process PyTorch loop: the same batches (the run's data
    order); a ReduceLROnPlateau stepped at each evaluation on `metric`, or at each epoch's end
    on the mean training loss over the epoch's samples; any other scheduler after every
    optimizer step. Returns (lr of each step, model, scheduler)."""
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    ns = {}
    exec(cell(code), ns)
    model, optimizer, scheduler = ns["model"], ns["optimizer"], ns["lr_scheduler"]
    dataset, eval_dataset = ns["dataset"], ns["eval_dataset"]
    plan = BatchPlan(len(dataset), B, SEED)
    epoch = position = 0
    lrs, epoch_loss = [], 0.0
    for step in range(1, steps + 1):
        indices = plan.batch(epoch, position)
        batch = torch.utils.data.default_collate([dataset[int(i)] for i in indices])
        optimizer.zero_grad()
        loss = ns["loss_fn"](model, batch)
        loss.backward()
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        epoch_loss += loss.item() * len(batch[0])
        ended, (epoch, position) = epoch, plan.advance(epoch, position)
        if code is not PLATEAU:
            scheduler.step()
        elif metric and (step % eval_every == 0 or step == steps):
            with torch.no_grad():
                values = ns["metric_fn"](model, eval_dataset[:])
            scheduler.step(values[metric[len("val_"):]].item())
        elif not metric and epoch != ended:
            scheduler.step(epoch_loss / len(dataset))
            epoch_loss = 0.0
    return lrs, model, scheduler


def _check_against_reference(run, steps, eval_every, metric):
    lrs, model, scheduler = reference(steps, eval_every, metric)
    assert len(set(lrs)) >= 3, lrs  # the plateau did cut the rate, more than once
    assert [r["lr"] for r in run.history] == lrs
    for k, v in model.state_dict().items():
        assert torch.allclose(run.state_dict()[k], v, rtol=1e-9, atol=1e-12), k
    saved = ckpt.load_latest(run.checkpoint_dir)[1]["lr_scheduler"]  # as in the file
    for key in ("best", "num_bad_epochs", "last_epoch", "cooldown_counter", "_last_lr"):
        assert saved[key] == pytest.approx(scheduler.state_dict()[key], rel=1e-9), key


def test_plateau_steps_at_each_evaluation_on_the_named_metric(idle_pool, tmp_path):
    config = RunConfig(name=f"plateau-{uuid.uuid4().hex[:6]}", global_batch=B, steps=40,
                       eval_every=4, plateau_metric="val_loss", seed=SEED, checkpoint_every=15)
    # a resize in between changes nothing
    run = TrainingRun(idle_pool, config, source=cell(PLATEAU), engines=2,
                      workspace=str(tmp_path), schedule=[(18, 1)]).start()
    assert run.wait(timeout=240) == "finished", run.logs()
    _check_against_reference(run, 40, 4, "val_loss")


def test_plateau_steps_once_per_epoch_on_the_mean_training_loss(idle_pool, tmp_path):
    steps = 5 * 8  # 170 samples in batches of 40: 5 steps an epoch, the last of 10 samples
    config = RunConfig(name=f"plateau-{uuid.uuid4().hex[:6]}", global_batch=B, epochs=8,
                       seed=SEED, checkpoint_every=10)
    run = TrainingRun(idle_pool, config, source=cell(PLATEAU), engines=2,
                      workspace=str(tmp_path)).start()
    assert run.wait(timeout=240) == "finished", run.logs()
    assert run.total_steps == steps
    _check_against_reference(run, steps, None, None)


def test_a_plateau_metric_the_evaluation_lacks_is_refused_at_setup_naming_those_it_has(
        idle_pool, tmp_path):
    config = RunConfig(name=f"plateau-{uuid.uuid4().hex[:6]}", global_batch=B, steps=10,
                       eval_every=5, plateau_metric="val_los", seed=SEED)
    run = TrainingRun(idle_pool, config, source=cell(PLATEAU), workspace=str(tmp_path))
    # metric_fn is tried when the cell runs (engine.step.trials.SetupTrials, from
    # engine.entrypoints)
    with pytest.raises(RunSetupError, match="--plateau-metric val_los: metric_fn, tried at "
                                            "setup, gives val_accuracy, val_loss"):
        run.start()


def test_a_plateau_metric_for_another_scheduler_is_refused_at_setup(idle_pool, tmp_path):
    config = RunConfig(name=f"plateau-{uuid.uuid4().hex[:6]}", global_batch=B, steps=10,
                       eval_every=5, plateau_metric="val_loss", seed=SEED)
    run = TrainingRun(idle_pool, config, source=cell("S.StepLR(optimizer, 3)"),
                      workspace=str(tmp_path))
    with pytest.raises(RunSetupError, match="--plateau-metric val_loss is for a "
                                            "ReduceLROnPlateau lr_scheduler; the cell's "
                                            "lr_scheduler is StepLR"):
        run.start()


@pytest.mark.parametrize("scheduler", [
    "S.OneCycleLR(optimizer, max_lr=1.0, total_steps=12)",
    "S.CyclicLR(optimizer, base_lr=0.1, max_lr=1.0, step_size_up=3)",
    "S.CosineAnnealingWarmRestarts(optimizer, T_0=4)",
    "S.SequentialLR(optimizer, [S.LinearLR(optimizer, 0.1, total_iters=4), "
    "S.MultiStepLR(optimizer, [7, 9])], milestones=[4])",
])
def test_other_schedulers_step_once_per_optimizer_step(idle_pool, tmp_path, scheduler):
    config = RunConfig(name=f"sched-{uuid.uuid4().hex[:6]}", global_batch=B, steps=12,
                       seed=SEED, checkpoint_every=5)
    run = TrainingRun(idle_pool, config, source=cell(scheduler), engines=2,
                      workspace=str(tmp_path)).start()
    assert run.wait(timeout=120) == "finished", run.logs()
    lrs, model, _ = reference(12, None, None, scheduler)
    assert [r["lr"] for r in run.history] == pytest.approx(lrs, rel=1e-12)
    for k, v in model.state_dict().items():
        assert torch.allclose(run.state_dict()[k], v, rtol=1e-9, atol=1e-12), k


@pytest.mark.parametrize("options, expected", [
    (dict(plateau_metric="loss", eval_every=5), "names a validation metric as logged"),
    (dict(plateau_metric="val_loss"), "needs --eval-every N"),
])
def test_plateau_metric_options_are_validated(options, expected):
    with pytest.raises(UsageError, match=expected):
        RunConfig(name="x", **options).validate()


def test_an_epochs_mean_loss_weighs_each_step_by_what_its_loss_is_a_mean_over():
    from elastic_jupyter.engine.step.schedulers import epoch_mean_loss
    # 40 samples, B 16: steps of 16, 16 and 8 samples
    by_samples = [{"epoch": 0, "loss": 1.0}, {"epoch": 1, "loss": 2.0}, {"epoch": 1, "loss": 4.0},
                  {"epoch": 1, "loss": 8.0}]
    assert epoch_mean_loss(by_samples, 1, 40, 16) == pytest.approx((2 * 16 + 4 * 16 + 8 * 8) / 40)
    # MeanOver: the steps' losses are means over 10, 30 and 60 tokens
    by_tokens = [dict(r, items=n) for r, n in zip(by_samples[1:], (10, 30, 60))]
    assert epoch_mean_loss(by_tokens, 1, 40, 16) == pytest.approx((2 * 10 + 4 * 30 + 8 * 60) / 100)
