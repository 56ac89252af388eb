"""Several optimizers (engine.step.optimizers): a GAN on the digits, its discriminator and generator
stepped in order within each step, resized, SIGKILLed between its sub-steps, stopped and
resumed — the parameters of the undisturbed run (float64), each optimizer's step once."""
import pytest
import torch
from test_faults import kill_in_phase, wait_for
from worlds import cell_namespace

from elastic_jupyter import RunConfig, TrainingRun
from elastic_jupyter.engine.state import checkpoint as ckpt
from elastic_jupyter.engine.step.objects import CellObjects, SetupError
from elastic_jupyter.engine.modes.factory import state_mode
from elastic_jupyter.pool.processes import alive

GAN_CELL = '''
import time
import torch
from sklearn.datasets import load_digits
X, _ = load_digits(return_X_y=True)
dataset = torch.utils.data.TensorDataset(torch.tensor(X[:512], dtype=torch.float64) / 16)
G = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 64),
                        torch.nn.Sigmoid())
# BatchNorm, called on the real batch, then on the fake one (no bias before it, as DCGAN: its
# gradient is round-off, which Adam would scale up to whole steps)
D = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False), torch.nn.BatchNorm1d(32),
                        torch.nn.LeakyReLU(0.2), torch.nn.Linear(32, 1))
model = torch.nn.ModuleDict({"generator": G, "discriminator": D}).double()
optimizer = {"discriminator": torch.optim.Adam(D.parameters(), lr=2e-3, betas=(0.5, 0.999)),
             "generator": torch.optim.Adam(G.parameters(), lr=2e-3, betas=(0.5, 0.999))}
lr_scheduler = {"generator": torch.optim.lr_scheduler.StepLR(optimizer["generator"], 8, 0.5)}
bce = torch.nn.functional.binary_cross_entropy_with_logits

def d_loss(model, batch):
    (x,) = batch
    time.sleep(PAUSE)
    fake = model["generator"](torch.randn(len(x), 16, dtype=torch.float64)).detach()
    real, fake = model["discriminator"](x), model["discriminator"](fake)
    return bce(real, torch.ones_like(real)) + bce(fake, torch.zeros_like(fake))

def g_loss(model, batch):  # the same noise as d_loss drew: the micro-batch's stream
    (x,) = batch
    fake = model["discriminator"](model["generator"](torch.randn(len(x), 16, dtype=torch.float64)))
    return bce(fake, torch.ones_like(fake))

loss_fn = {"discriminator": d_loss, "generator": g_loss}
'''
STEPS = 24


def start(pool, tmp_path, name, engines=2, schedule=None, resume=False, pause=0.0, **options):
    fault_dir = tmp_path / "faults"
    fault_dir.mkdir(parents=True, exist_ok=True)
    config = RunConfig(name=name, global_batch=32, steps=STEPS, seed=5, pass_cost=0.0,
                       collective_timeout=5, fault_dir=str(fault_dir), **options)
    return TrainingRun(pool, config, source=GAN_CELL, push={"PAUSE": pause}, engines=engines,
                       schedule=schedule, workspace=str(tmp_path), resume=resume).start()


def test_a_gan_resized_killed_between_its_optimizers_and_resumed_equals_the_undisturbed_run(
        idle_pool, tmp_path):
    whole = start(idle_pool, tmp_path / "whole", "gan-whole", checkpoint_every=0)
    assert whole.wait(timeout=120) == "finished", whole.logs()
    expected = whole.state_dict()

    # grown to 3 after step 4; rank 1 killed after the discriminator's update of a step past
    # 8 (the generator's sub-step in flight); stopped past step 14 and resumed on 3 engines
    run = start(idle_pool, tmp_path, "gan", schedule=[(4, 3)], checkpoint_every=4, pause=0.01)
    victim = run.members[1]
    hit_step, _ = kill_in_phase(run, "substep", victim.slot, after_step=8)
    wait_for(lambda: not alive(victim), timeout=10, what="the kill")
    wait_for(lambda: run.step >= 14 or not run.active, timeout=60, what="step 14")
    run.stop()
    assert run.wait(timeout=60) == "stopped", run.logs()
    fault = [e for e in run.events if e["kind"] == "fault"]
    assert [f["lost_slots"] for f in fault] == [[victim.slot]], run.events
    assert run.step < STEPS and run.checkpoints[-1]["step"] == run.step
    resumed = start(idle_pool, tmp_path, "gan", engines=3, resume=True, checkpoint_every=4)
    assert resumed.wait(timeout=120) == "finished", resumed.logs()

    got = resumed.state_dict()
    for k in expected:  # float64: the same sums in the same order
        assert torch.allclose(got[k], expected[k], rtol=1e-9, atol=0), k
    # each optimizer stepped once per step: the discriminator's update before the kill was
    # kept, not done again
    _, newest, _ = ckpt.load_latest(resumed.checkpoint_dir)
    for name in ("discriminator", "generator"):  # the checkpoint keeps each one's state
        steps = {float(s["step"]) for s in newest["optimizer"][name]["state"].values()}
        assert steps == {float(STEPS)}, (name, steps)
    records = resumed.history
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r, clean in zip(records, whole.history):
        assert r["loss"] == pytest.approx(r["loss_discriminator"], abs=0)
        assert r["loss_generator"] == pytest.approx(clean["loss_generator"], rel=1e-9)
        assert r["loss_discriminator"] == pytest.approx(clean["loss_discriminator"], rel=1e-9)
    # the generator's rate in the last step: its scheduler halved it after steps 8 and 16
    assert records[-1]["lr_generator"] == pytest.approx(2e-3 * 0.5 ** 2)
    assert records[-1]["lr"] == records[-1]["lr_discriminator"] == 2e-3
    assert hit_step >= 8


def _objects(source: str, **options):
    config = RunConfig.from_dict({"name": "gan", "global_batch": 8, "pool_max_size": 2,
                                  "steps": 4, **options})
    cell = CellObjects.of(cell_namespace(source, 0), config)
    state_mode(config).check(cell, torch.device("cpu"))  # what --shard refuses
    return cell


@pytest.mark.parametrize("change, options, message", [
    ('optimizer["generator"] = torch.optim.SGD(model.parameters(), lr=0.1)', {},
     "optimizer 'generator' holds a parameter (shape (32, 64)) that optimizer 'discriminator' "
     "holds too: each parameter is stepped by one optimizer"),
    ('optimizer = {"": optimizer["generator"]}\nloss_fn = {"": g_loss}', {},
     "optimizer must be a torch.optim.Optimizer, or a dict {name: optimizer}"),
    ('optimizer = optimizer["generator"]\nloss_fn = g_loss', {},
     "lr_scheduler is a dict of schedulers but optimizer is one optimizer"),
    ('loss_fn = {"discriminator": d_loss}', {},
     "loss_fn has no loss for optimizer 'generator': give loss_fn = {name: loss_fn(model, "
     "batch)} for each of 'discriminator', 'generator'"),
    ('loss_fn = dict(loss_fn, critic=d_loss)', {},
     "loss_fn names 'critic', which no optimizer has"),
    ("loss_fn = d_loss", {}, "with several optimizers, loss_fn must be a dict {name: "
     "loss_fn(model, batch)}, one for each of 'discriminator', 'generator', got function"),
    ('optimizer = optimizer["generator"]', {},
     "loss_fn is a dict of losses but optimizer is one optimizer"),
    ('lr_scheduler = {"generator": torch.optim.lr_scheduler.StepLR(optimizer["discriminator"], '
     '8)}', {}, "lr_scheduler['generator'] does not schedule optimizer['generator']"),
    ('lr_scheduler = lr_scheduler["generator"]', {}, "with several optimizers, lr_scheduler "
     "must be a dict {name: scheduler}"),
    ('optimizer["generator"] = "adam"', {},
     "optimizer['generator'] must be a torch.optim.Optimizer, got str"),
    ("", {"precision": "fp16"}, "--precision fp16 scales one optimizer's gradients"),
    ("", {"shard": True}, "--shard trains one optimizer"),
])
def test_optimizers_that_cannot_make_sub_steps_are_refused_at_setup(change, options, message):
    with pytest.raises(SetupError) as excinfo:
        _objects(GAN_CELL.replace("time.sleep(PAUSE)", "") + change + "\n", **options)
    assert message in str(excinfo.value), str(excinfo.value)


def test_a_later_optimizers_loss_with_metrics_fails_at_its_step(idle_pool, tmp_path):
    cell = GAN_CELL.replace("    return bce(fake, torch.ones_like(fake))",
                            '    return bce(fake, torch.ones_like(fake)), {"d_fake": fake.mean()}')
    run = TrainingRun(idle_pool, RunConfig(name="gan-metrics", global_batch=32, steps=4,
                                           checkpoint_every=0), source=cell,
                      push={"PAUSE": 0.0}, engines=1, workspace=str(tmp_path)).start()
    assert run.wait(timeout=60) == "failed"
    assert ("loss_fn['generator'] returned extra metrics: with several optimizers only the "
            "first one's loss_fn may" in run.error), run.error
    assert idle_pool.run is None


def test_a_state_between_sub_steps_resumes_only_with_its_optimizers_in_order():
    """A state taken after the discriminator's sub-step goes on only where the discriminator
    steps first: another order would step it twice and skip the generator."""
    from elastic_jupyter.engine.step.optimizers import check_resumed
    steps = _objects(GAN_CELL.replace("time.sleep(PAUSE)", "")).substeps
    check_resumed(steps, 1, {"discriminator": [0.7]})
    check_resumed(steps, 0, {})
    swapped = list(reversed(steps))
    with pytest.raises(ValueError, match="resume with the optimizers in the order it was "
                                         "trained with"):
        check_resumed(swapped, 1, {"discriminator": [0.7]})
