"""Checkpoint files: atomic writes, the latest pointer, pruning, safe loading, a run's
listing (read again only when its folder changed)."""
import os
import pickle

import pytest
import torch
from conftest import DIGITS_CELL

from elastic_jupyter import RunConfig, TrainingRun
from elastic_jupyter.engine.state import checkpoint as ckpt
from elastic_jupyter.engine.state.checkpoint_writer import CheckpointWriter
from elastic_jupyter.engine.state import training_state as state_mod


def _state(step):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return state_mod.capture(model, opt, None, state_mod.Progress(step=step), [{"step": step}],
                             {"name": "t"})


def test_write_keeps_last_n_and_points_to_latest(tmp_path):
    for step in (10, 20, 30, 40):
        ckpt.write_checkpoint(str(tmp_path), _state(step), keep=2)
    assert [c["step"] for c in ckpt.list_checkpoints(str(tmp_path))] == [30, 40]
    latest = ckpt.latest_checkpoint(str(tmp_path))
    assert latest.endswith("step-00000040.pt")
    loaded = ckpt.load_checkpoint(latest)
    assert loaded["progress"]["step"] == 40 and loaded["history"] == [{"step": 40}]
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_state_round_trip_restores_rng_and_optimizer(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    saved = state_mod.capture(model, opt, None, state_mod.Progress(step=5), [], {})
    expected = torch.rand(3)
    ckpt.write_checkpoint(str(tmp_path), saved, keep=1)
    loaded = ckpt.load_checkpoint(ckpt.latest_checkpoint(str(tmp_path)))
    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.Adam(model2.parameters())
    progress, _ = state_mod.restore(loaded, model2, opt2, None)
    assert progress.step == 5
    assert torch.equal(torch.rand(3), expected)  # RNG continues where it was captured
    assert torch.equal(model2.weight, model.weight)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def _tensors(state: dict) -> list[torch.Tensor]:
    found = []
    def walk(obj):
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
    walk({k: state[k] for k in ("model", "optimizer")})
    return found


def test_checkpoint_copies_reuse_their_buffers_and_equal_a_fresh_copy(tmp_path):
    """A checkpoint's copy goes into buffers kept from the last one: no allocation of the
    state's size per checkpoint, and the same values a fresh copy has."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    staging, pointers = state_mod.Staging(), []
    for step in (1, 2):
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        staged = state_mod.capture(model, opt, None, state_mod.Progress(step=step), [], {},
                                   staging=staging)
        staging.wait()
        fresh = state_mod.capture(model, opt, None, state_mod.Progress(step=step), [], {})
        assert all(torch.equal(a, b) for a, b in zip(_tensors(staged), _tensors(fresh)))
        pointers.append([t.data_ptr() for t in _tensors(staged)])
        ckpt.write_checkpoint(str(tmp_path), staged, keep=2)
    assert pointers[0] == pointers[1]
    loaded = ckpt.load_checkpoint(ckpt.latest_checkpoint(str(tmp_path)))
    assert torch.equal(loaded["model"]["weight"], model.weight)


def test_a_copy_overlapping_the_next_step_holds_the_state_as_captured(tmp_path):
    """Parameters and optimizer state are copied on a thread while the next step's forward
    and backward run; the step waits for the copies before its update (as Worker.train_step
    does), and so does the writer: the file holds the state as captured."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.BatchNorm1d(512))
    opt = torch.optim.Adam(model.parameters())
    staging = state_mod.Staging()
    writer = CheckpointWriter(str(tmp_path), keep=1)
    try:
        for step in (1, 2):
            model(torch.randn(8, 512)).pow(2).mean().backward()
            opt.step()
            expected = state_mod.capture(model, opt, None, state_mod.Progress(step=step), [], {})
            writer.wait()
            writer.submit(state_mod.capture(model, opt, None, state_mod.Progress(step=step),
                                            [], {}, staging=staging), ready=staging.ready)
            assert staging._copier is not None  # the large tensors' copies were deferred
            opt.zero_grad()
            model(torch.randn(8, 512)).pow(2).mean().backward()  # BatchNorm's buffers change
            staging.wait()
            opt.step()
        assert [e["kind"] for e in writer.drain()] == ["checkpoint", "checkpoint"]
    finally:
        writer.close()
    loaded = ckpt.load_checkpoint(ckpt.latest_checkpoint(str(tmp_path)))
    assert all(torch.equal(a, b) for a, b in zip(_tensors(loaded), _tensors(expected)))
    assert not torch.equal(loaded["model"]["0.weight"], model[0].weight)  # it moved on


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch /tmp/elastic-jupyter-pwned",))


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    path = tmp_path / "step-00000001.pt"
    with open(path, "wb") as f:
        torch.save({"model": _RunsCode()}, f, pickle_module=pickle)
    with pytest.raises(ckpt.CheckpointError, match="cannot load checkpoint"):
        ckpt.load_checkpoint(str(path))
    assert not os.path.exists("/tmp/elastic-jupyter-pwned")


def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path):
    ckpt.write_checkpoint(str(tmp_path), _state(10), keep=3)
    bad = _state(20)
    bad["model"] = {"w": lambda: None}  # torch.save cannot pickle a lambda: the write fails
    with pytest.raises(Exception):
        ckpt.write_checkpoint(str(tmp_path), bad, keep=3)
    assert ckpt.latest_checkpoint(str(tmp_path)).endswith("step-00000010.pt")
    assert sorted(os.listdir(tmp_path)) == ["history.jsonl", "latest.json", "step-00000010.json",
                                           "step-00000010.pt"]


def test_a_runs_listing_is_read_again_only_when_its_folder_changes(idle_pool, tmp_path,
                                                                    monkeypatch):
    run = TrainingRun(idle_pool, RunConfig(name="listing", steps=10), source=DIGITS_CELL,
                      workspace=str(tmp_path))
    folder = run.checkpoint_dir
    assert run.checkpoints == []  # no folder yet
    os.makedirs(folder)
    listed, listdir = [], os.listdir
    monkeypatch.setattr(ckpt.os, "listdir", lambda path: listed.append(path) or listdir(path))

    def steps():
        return [c["step"] for c in run.checkpoints]

    def settle():  # the folder as if its last change were a minute ago
        st = os.stat(folder)
        os.utime(folder, ns=(st.st_atime_ns, st.st_mtime_ns - 60 * 10**9))

    def add(step):
        with open(os.path.join(folder, ckpt.checkpoint_name(step)), "wb") as f:
            f.write(b"x" * step)

    add(10)
    settle()
    assert steps() == [10] and steps() == [10] and listed.count(folder) == 1
    run.checkpoints.clear()  # a copy: the cached listing stays whole
    assert steps() == [10] and listed.count(folder) == 1
    add(20)
    assert steps() == [10, 20]
    settle()
    os.unlink(os.path.join(folder, ckpt.checkpoint_name(10)))
    assert steps() == [20] and run.checkpoints[0]["bytes"] == 20
    # a change within the mtime's granularity leaves it as it was: a listing of a folder that
    # changed just now is not kept
    before = os.stat(folder)
    add(30)
    os.utime(folder, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert steps() == [20, 30]
