"""The checkpoint writer process: a large staged state is written beside the engine, from
shared memory, and loads as captured; the process dies with its engine, and a writer process
that is killed fails only the checkpoint it was writing."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import torch

from elastic_jupyter import RunConfig, TrainingRun
from elastic_jupyter.engine.state import checkpoint as ckpt
from elastic_jupyter.engine.state.checkpoint_writer import CheckpointWriter
from elastic_jupyter.engine.state import training_state as state_mod

WRITER = "elastic_jupyter.engine.state.checkpoint_process"


def _writers(pid: int | None = None) -> list[psutil.Process]:
    children = psutil.Process(pid or os.getpid()).children()
    return [p for p in children if any(WRITER in part for part in p.cmdline())]


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256))
    opt = torch.optim.Adam(model.parameters())
    return model, opt


def _step(model, opt, staging=None):
    opt.zero_grad()
    model(torch.randn(8, 256)).pow(2).mean().backward()
    if staging is not None:  # as Worker.train_step: the copies read what the update changes
        staging.wait()
    opt.step()


def _tensors(state: dict) -> list[torch.Tensor]:
    model = list(state["model"].values())
    return model + [t for s in state["optimizer"]["state"].values() for t in s.values()]


def test_a_staged_state_is_written_by_the_writer_process_as_captured(tmp_path, monkeypatch):
    """Captures into shared buffers while training goes on, as a generation checkpoints: the
    process writes each file with the state as captured, every tensor its own record. The
    engine works in the notebook's folder, whose modules do not shadow the writer's."""
    notebook = tmp_path / "notebook"
    notebook.mkdir()
    (notebook / "numbers.py").write_text("raise SystemExit('the notebook shadowed numbers')\n")
    monkeypatch.chdir(notebook)
    tmp_path = tmp_path / "checkpoints"
    tmp_path.mkdir()
    model, opt = _trained()
    staging = state_mod.Staging()
    writer = CheckpointWriter(str(tmp_path), keep=1, process_min_bytes=1)
    try:
        for step in (1, 2):
            _step(model, opt)
            expected = state_mod.capture(model, opt, None, state_mod.Progress(step=step), [], {})
            writer.wait()
            writer.submit(state_mod.capture(model, opt, None, state_mod.Progress(step=step),
                                            [{"step": step}], {}, staging=staging),
                          ready=staging.ready, arena=staging.arena)
            _step(model, opt, staging)  # the next steps change the model while the write goes on
            _step(model, opt, staging)
            writer.wait()
            assert len(_writers()) == 1  # one process, kept from one checkpoint to the next
        events = writer.drain()
    finally:
        writer.close()
    assert [e["kind"] for e in events] == ["checkpoint", "checkpoint"], events
    assert not _writers()  # ended with the writer
    path = ckpt.latest_checkpoint(str(tmp_path))
    assert ckpt.verify(path) is None
    loaded = ckpt.load_checkpoint(path)
    assert loaded["progress"]["step"] == 2 and loaded["history"] == [{"step": 2}]
    assert all(torch.equal(a, b) for a, b in zip(_tensors(loaded), _tensors(expected)))
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size()
               for t in _tensors(loaded))  # not the shared chunk it was staged in


def test_a_small_state_is_written_on_the_writer_thread(tmp_path):
    model, opt = _trained()
    _step(model, opt)
    staging = state_mod.Staging()
    writer = CheckpointWriter(str(tmp_path), keep=1)  # a state below PROCESS_MIN_BYTES
    try:
        writer.submit(state_mod.capture(model, opt, None, state_mod.Progress(step=1), [], {},
                                        staging=staging), ready=staging.ready,
                      arena=staging.arena)
        assert [e["kind"] for e in writer.drain()] == ["checkpoint"]
        assert not _writers()
    finally:
        writer.close()


class _Custom:
    pass


def test_a_state_holding_other_values_is_refused_with_its_key_path(tmp_path):
    """A value that is not plain data never reaches the process: the check on the writer
    thread names where it is, as for any checkpoint."""
    model, opt = _trained()
    _step(model, opt)
    opt.param_groups[0]["custom"] = _Custom()
    staging = state_mod.Staging()
    writer = CheckpointWriter(str(tmp_path), keep=1, process_min_bytes=1)
    try:
        writer.submit(state_mod.capture(model, opt, None, state_mod.Progress(step=1), [], {},
                                        staging=staging), ready=staging.ready,
                      arena=staging.arena)
        [event] = writer.drain()
    finally:
        writer.close()
    assert event["kind"] == "checkpoint_failed"
    assert "optimizer.param_groups[0].custom is a test_checkpoint_process._Custom" in \
        event["message"]
    assert ckpt.list_checkpoints(str(tmp_path)) == []


def test_a_checkpoint_whose_writer_process_is_killed_is_written_on_the_thread(tmp_path):
    """The buffers outlive the process that was reading them: the engine writes that state
    itself, and the next checkpoint starts a new process."""
    model, opt = _trained()
    staging = state_mod.Staging()

    killed = []

    def kill_the_writer():  # stopped, so that it is sent the state, then killed
        if writer_steps and writer_steps.pop(0) == 2:
            killed.extend(_writers())
            killed[0].suspend()
            threading.Timer(0.5, killed[0].kill).start()

    writer_steps = [1, 2, 3]
    writer = CheckpointWriter(str(tmp_path), keep=3, before_write=kill_the_writer,
                                   process_min_bytes=1)
    try:
        events = []
        for step in (1, 2, 3):
            _step(model, opt, staging)
            writer.submit(state_mod.capture(model, opt, None, state_mod.Progress(step=step),
                                            [], {}, staging=staging),
                          ready=staging.ready, arena=staging.arena)
            events += writer.drain()
        assert [p.pid for p in _writers()] != [killed[0].pid]  # a new one
    finally:
        writer.close()
    assert [e["kind"] for e in events] == ["checkpoint"] * 3, events
    assert [c["step"] for c in ckpt.list_checkpoints(str(tmp_path))] == [1, 2, 3]
    for c in ckpt.list_checkpoints(str(tmp_path)):
        assert ckpt.verify(c["path"]) is None
        assert ckpt.load_checkpoint(c["path"])["progress"]["step"] == c["step"]


ENGINE = textwrap.dedent("""
    import sys, time, torch
    from elastic_jupyter.engine.state import training_state as state_mod
    from elastic_jupyter.engine.state.checkpoint_writer import CheckpointWriter
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    staging = state_mod.Staging()
    writer = CheckpointWriter(sys.argv[1], keep=1, process_min_bytes=1)
    writer.submit(state_mod.capture(model, opt, None, state_mod.Progress(step=1), [], {},
                                    staging=staging), ready=staging.ready, arena=staging.arena)
    print(writer.drain()[0]["kind"], flush=True)
    time.sleep(120)
""")


def test_the_writer_process_dies_with_its_engine(tmp_path):
    """A SIGKILLed engine leaves no writer behind that could still publish a checkpoint."""
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout.readline().strip() == "checkpoint"
        [writer] = _writers(engine.pid)
        os.kill(engine.pid, signal.SIGKILL)
        engine.wait(10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _alive(writer):
            time.sleep(0.05)
        assert not _alive(writer)
    finally:
        engine.kill()


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


LARGE_CELL = '''
import torch
torch.manual_seed(0)
dataset = torch.utils.data.TensorDataset(torch.randn(256, 2048), torch.randn(256, 3072))
model = torch.nn.Linear(2048, 3072)  # 6.3 M parameters: 75 MB of state with Adam's moments
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)
'''


def test_a_run_checkpoints_through_the_writer_process_and_a_killed_engine_leaves_none(
        idle_pool, tmp_path):
    """On a real pool: rank 0's engine writes a large state through its writer process; killed
    while it checkpoints, it takes the process with it, and the run finishes on the survivor
    with a last checkpoint that holds its final weights."""
    faults = tmp_path / "faults"
    faults.mkdir()
    config = RunConfig(name="large-state", global_batch=8, steps=24, checkpoint_every=4,
                       seed=1, collective_timeout=10, fault_dir=str(faults))
    run = TrainingRun(idle_pool, config, source=LARGE_CELL, engines=2,
                      workspace=str(tmp_path)).start()
    _wait_for(lambda: any(e["kind"] == "checkpoint" for e in run.events), "a checkpoint")
    rank0 = run.members[0]
    [writer] = _writers(rank0.pid)
    (faults / "arm.checkpoint").write_text(str(rank0.slot))
    _wait_for(lambda: list(faults.glob(f"hit.checkpoint.{rank0.slot}.*")), "the fault point")
    os.kill(rank0.pid, signal.SIGKILL)
    _wait_for(lambda: not _alive(writer), "the writer process to end with its engine")
    assert run.wait(timeout=240) == "finished", run.logs()
    assert any(e["kind"] == "fault" for e in run.events)
    assert run.checkpoints[-1]["step"] == 24
    loaded = ckpt.load_checkpoint(run.checkpoints[-1]["path"])
    final = run.state_dict()
    assert all(torch.equal(loaded["model"][k], final[k]) for k in final)


def _wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
