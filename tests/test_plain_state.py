"""Non-plain values in the training state (numpy learning rates, numpy scheduler settings, a
value of the user's own class): checkpoints of such runs load with the safe load, restored
objects step exactly as the captured ones, and a value no checkpoint could hold refuses the run
before its first step, naming its key path."""
import collections
import time
import uuid

import numpy as np
import pytest
import torch

from elastic_jupyter import RunConfig, RunSetupError, TrainingRun
from elastic_jupyter.engine.state import checkpoint as ckpt
from elastic_jupyter.engine.state import training_state as state_mod

Betas = collections.namedtuple("Betas", "beta1 beta2")


def _objects(seed: int):
    """Adam with a numpy.float64 lr (the issue's 1e-3 * np.sqrt(2)), a second group with a
    numpy.float32 lr, numpy betas, and a MultiStepLR with numpy milestones and gamma."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.Adam(
        [{"params": model[0].parameters(), "lr": 1e-3 * np.sqrt(2)},
         {"params": model[1].parameters(), "lr": np.float32(3e-3)}],
        betas=(np.float64(0.9), np.float64(0.99)))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=np.array([2, 4]),
                                                     gamma=np.float32(0.5))
    return model, optimizer, scheduler


def _train(model, optimizer, scheduler, steps: int, start: int) -> None:
    for i in range(start, start + steps):
        x = torch.linspace(-1, 1, 15).reshape(5, 3) * (i + 1)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        scheduler.step()


def _capture(model, optimizer, scheduler, step, history=()):
    return state_mod.capture(model, optimizer, scheduler, state_mod.Progress(step=step),
                             list(history), {"name": "t", "clip": np.float32(1.5)})


def test_a_numpy_state_checkpoints_as_plain_data_and_restores_numpy_values(tmp_path):
    model, optimizer, scheduler = _objects(seed=0)
    _train(model, optimizer, scheduler, steps=3, start=0)
    history = [{"step": 3, "lr": np.float32(0.25), "loss": 1.0}]
    ckpt.write_checkpoint(str(tmp_path), _capture(model, optimizer, scheduler, 3, history), keep=2)

    path = ckpt.latest_checkpoint(str(tmp_path))
    loaded = torch.load(path, weights_only=True)  # the safe load takes it as it is
    groups = loaded["optimizer"]["param_groups"]
    live = [g["lr"] for g in optimizer.param_groups]  # halved once by the milestone at 2
    assert type(live[0]) is np.float64 and live[0] == 1e-3 * np.sqrt(2) / 2
    assert type(groups[0]["lr"]) is float and groups[0]["lr"] == live[0]
    assert type(groups[1]["lr"]) is float and groups[1]["lr"] == live[1]
    assert groups[0]["betas"] == (0.9, 0.99) and type(groups[0]["betas"][0]) is float
    assert type(loaded["history"][0]["lr"]) is float and loaded["config"]["clip"] == 1.5
    assert loaded["lr_scheduler"]["milestones"] == collections.Counter({2: 1, 4: 1})

    # restored into fresh objects, the numpy types come back ...
    model2, optimizer2, scheduler2 = _objects(seed=1)
    progress, restored_history = state_mod.restore(ckpt.load_checkpoint(path), model2,
                                                   optimizer2, scheduler2)
    assert progress.step == 3 and restored_history == [{"step": 3, "lr": 0.25, "loss": 1.0}]
    lr0, lr1 = (g["lr"] for g in optimizer2.param_groups)
    assert type(lr0) is np.float64 and lr0 == optimizer.param_groups[0]["lr"]
    assert type(lr1) is np.float32 and lr1 == optimizer.param_groups[1]["lr"]
    assert type(optimizer2.param_groups[0]["betas"][1]) is np.float64
    assert type(scheduler2.gamma) is np.float32
    # ... and the restored objects step exactly as the captured ones (float32 lr included)
    _train(model, optimizer, scheduler, steps=4, start=3)
    _train(model2, optimizer2, scheduler2, steps=4, start=3)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert [g["lr"] for g in optimizer2.param_groups] == [g["lr"] for g in optimizer.param_groups]


def test_an_in_memory_state_restores_more_than_once(tmp_path):
    """Restoring reads the state and never changes it (the caller may restore it again)."""
    model, optimizer, scheduler = _objects(seed=0)
    state = _capture(model, optimizer, scheduler, 0)
    for _ in range(2):
        state_mod.restore(state, model, optimizer, scheduler)
        assert type(optimizer.param_groups[1]["lr"]) is np.float32
    assert type(state["optimizer"]["param_groups"][1]["lr"]) is float


class Tag:
    """A value of the user's own class: no safe load can rebuild it."""


@pytest.mark.parametrize("where, value, path, kind", [
    ("betas", Betas(0.9, 0.999), "optimizer.param_groups[0].betas", "Betas"),
    ("tag", Tag(), "optimizer.param_groups[0].tag", "Tag"),
    ("counts", collections.defaultdict(int), "optimizer.param_groups[0].counts", "defaultdict"),
])
def test_unloadable_names_the_key_path_and_what_to_change(where, value, path, kind):
    model, optimizer, scheduler = _objects(seed=0)
    optimizer.param_groups[0][where] = value
    problem = ckpt.unloadable(_capture(model, optimizer, scheduler, 0))
    assert problem.startswith(f"{path} is a ") and kind in problem
    assert "torch.load(weights_only=True)" in problem and "convert it to plain data" in problem
    optimizer.param_groups[0].pop(where)
    assert ckpt.unloadable(_capture(model, optimizer, scheduler, 0)) is None


def test_a_state_no_safe_load_could_read_is_not_written(tmp_path):
    model, optimizer, scheduler = _objects(seed=0)
    ckpt.write_checkpoint(str(tmp_path), _capture(model, optimizer, scheduler, 1), keep=3)
    optimizer.param_groups[0]["tag"] = Tag()
    with pytest.raises(ckpt.CheckpointError, match=r"optimizer.param_groups\[0\].tag is a "):
        ckpt.write_checkpoint(str(tmp_path), _capture(model, optimizer, scheduler, 2), keep=3)
    assert ckpt.latest_checkpoint(str(tmp_path)).endswith("step-00000001.pt")
    assert [c["step"] for c in ckpt.list_checkpoints(str(tmp_path))] == [1]


def test_an_unsupported_type_and_a_corrupted_file_get_different_messages(tmp_path):
    """A file holding a numpy value (as written before values were converted) is not damage,
    and says so; a torn file says torn or corrupted."""
    typed = tmp_path / "step-00000001.pt"
    torch.save({"progress": {"step": 1}, "optimizer": {"lr": np.float64(0.1)}}, str(typed))
    torn = tmp_path / "step-00000002.pt"
    torch.save({"progress": {"step": 2}, "model": {"w": torch.ones(1000)}}, str(torn))
    torn.write_bytes(torn.read_bytes()[:1000])
    with pytest.raises(ckpt.CheckpointError) as refused:
        ckpt.load_latest(str(tmp_path))
    lines = str(refused.value).splitlines()
    assert "torn or corrupted" in lines[1] and str(torn) in lines[1]
    assert str(typed) in lines[2] and "it holds a type the safe load (weights_only) refuses: " \
        "numpy" in lines[2] and "not damage" in lines[2]


# ----------------------------------------------------------------------------- on the pool

NUMPY_CELL = '''
import numpy as np
import torch
from sklearn.datasets import load_digits
X, y = load_digits(return_X_y=True)
dataset = torch.utils.data.TensorDataset(torch.tensor(X[:400], dtype=torch.float64) / 16,
                                         torch.tensor(y[:400]))
model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(),
                            torch.nn.Linear(16, 10)).double()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3 * np.sqrt(2))
lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=np.int64(7),
                                               gamma=np.float32(0.5))
def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)
'''
STEPS = 30


def _config(name):
    return RunConfig(name=name, global_batch=40, steps=STEPS, checkpoint_every=5, seed=2)


def test_a_run_with_numpy_settings_resumes_like_an_uninterrupted_one(idle_pool, tmp_path):
    name = f"numpy-{uuid.uuid4().hex[:6]}"
    whole = TrainingRun(idle_pool, _config(name), source=NUMPY_CELL, engines=2,
                        workspace=str(tmp_path / "whole")).start()
    assert whole.wait(timeout=240) == "finished", whole.logs()

    cut = TrainingRun(idle_pool, _config(name), source=NUMPY_CELL + "\nimport time\n_l = loss_fn"
                      "\ndef loss_fn(m, b):\n    time.sleep(0.02)\n    return _l(m, b)\n",
                      engines=2, workspace=str(tmp_path / "cut")).start()
    while cut.step < 8 and cut.active:
        time.sleep(0.02)
    cut.stop()
    assert cut.wait(timeout=120) == "stopped"
    assert not [e for e in cut.events if e["kind"] == "checkpoint_failed"]
    path, state, warnings = ckpt.load_latest(cut.checkpoint_dir)  # weights_only inside
    assert warnings == [] and state["progress"]["step"] == cut.step

    resumed = TrainingRun(idle_pool, _config(name), source=NUMPY_CELL, resume=True,
                          engines=1, workspace=str(tmp_path / "cut")).start()
    assert resumed.wait(timeout=240) == "finished", resumed.logs()
    assert not [e for e in resumed.events if e["kind"] == "warning"]
    assert [r["step"] for r in resumed.history] == list(range(1, STEPS + 1))
    assert [r["lr"] for r in resumed.history] == [r["lr"] for r in whole.history]
    expected, got = whole.state_dict(), resumed.state_dict()
    for k in expected:
        assert torch.allclose(got[k], expected[k], rtol=1e-9, atol=1e-12), k


def test_a_value_no_checkpoint_could_hold_refuses_the_run_before_its_first_step(idle_pool,
                                                                                tmp_path):
    cell = NUMPY_CELL + '''
import collections
optimizer.param_groups[0]["betas"] = collections.namedtuple("Betas", "b1 b2")(0.9, 0.999)
'''
    run = TrainingRun(idle_pool, _config(f"refused-{uuid.uuid4().hex[:6]}"), source=cell,
                      workspace=str(tmp_path))
    with pytest.raises(RunSetupError) as refused:
        run.start()
    message = str(refused.value)
    assert "the training state could not be checkpointed: optimizer.param_groups[0].betas is " \
           "a __elastic_cell__.Betas" in message
    assert "torch.load(weights_only=True)" in message and "convert it to plain data" in message
    assert run.step == 0 and run.checkpoints == []
