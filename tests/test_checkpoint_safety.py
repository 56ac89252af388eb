"""Checkpoint safety under real failures: writers SIGKILLed mid-write, corrupted and truncated
files, a full file system during training, and checkpoint files that would run code.

Everything here is real: real files, real processes killed with SIGKILL, a real tmpfs that
fills up, and the shared session pool for the runs.
"""
import hashlib
import json
import os
import pickle
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch
from conftest import DIGITS_CELL

from elastic_jupyter import RunConfig, RunSetupError, TrainingRun
from elastic_jupyter.engine.state import checkpoint as ckpt

RUN_TIMEOUT = 180  # generous: other people's tests share these 2 cores


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _state(step: int, numel: int = 16) -> dict:
    """A checkpoint state whose every value tells its step (a torn mix of two would show)."""
    return {"progress": {"step": step}, "model": {"w": torch.full((numel,), float(step))},
            "history": [{"step": step}], "config": {"name": "t"}}


def _tmp_files(folder) -> list[str]:
    return sorted(f for f in os.listdir(folder) if ".tmp-" in f)


def _sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _wait_finished(run) -> None:
    state = run.wait(timeout=RUN_TIMEOUT)
    assert state == "finished", run.summary() + "\n" + run.logs()


# ----------------------------------------------------------------------------- 1. SIGKILL

# A "zygote": imports torch and the checkpoint module once (that costs seconds here), then for
# each start step read on stdin forks a writer that writes checkpoints start, start+1, ... for
# ever, prints its pid, and reports how it died once it is reaped. The test SIGKILLs writers.
ZYGOTE = r'''
import os, sys
import torch
from elastic_jupyter.engine.state.checkpoint import write_checkpoint
folder, numel = sys.argv[1], int(sys.argv[2])
print("ready", flush=True)
for line in sys.stdin:
    start = int(line)
    pid = os.fork()
    if pid == 0:
        try:
            torch.set_num_threads(1)
            step = start
            while True:
                state = {"progress": {"step": step},
                         "model": {"w": torch.full((numel,), float(step))},
                         "history": [{"step": step}], "config": {"name": "t"}}
                write_checkpoint(folder, state, keep=3)
                step += 1
        finally:
            os._exit(3)  # a writer must only ever end by the test's SIGKILL
    print(pid, flush=True)
    _, status = os.waitpid(pid, 0)
    print("reaped", pid, status, flush=True)
'''
NUMEL = 1 << 20  # 4 MB of float32 per checkpoint: a write takes a while, kills land inside it
KILLS = 20


class _Lines:
    """Lines of a subprocess's stdout, read on a thread, with a timeout per line."""

    def __init__(self, stream):
        self._queue = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream):
        for line in stream:
            self._queue.put(line.strip())
        self._queue.put(None)

    def next(self, timeout=60.0) -> str:
        line = self._queue.get(timeout=timeout)
        assert line is not None, "the writer zygote exited"
        return line


def test_sigkilled_writers_never_leave_a_torn_or_older_latest_checkpoint(tmp_path):
    folder = str(tmp_path / "ckpts")
    os.makedirs(folder)
    ckpt.write_checkpoint(folder, _state(1, NUMEL), keep=3)  # the first good checkpoint
    rng = random.Random(20240611)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", ZYGOTE, folder, str(NUMEL)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lines = _Lines(proc.stdout)
    writer = None  # pid of a forked writer not reaped yet
    try:
        assert lines.next(timeout=120) == "ready"
        previous, dead_pids, seen_stale = 1, [], set()
        for i in range(KILLS):
            start = 1000 * (i + 1)  # every writer's steps are above all earlier ones
            proc.stdin.write(f"{start}\n")
            proc.stdin.flush()
            pid = writer = int(lines.next())
            if i % 4 == 3:
                # every 4th kill waits until the writer is inside a checkpoint file's write
                deadline = time.monotonic() + 30
                while not any(f.endswith(f".pt.tmp-{pid}") for f in os.listdir(folder)):
                    assert time.monotonic() < deadline, "the writer never started a file"
                    time.sleep(0.001)
            else:
                time.sleep(rng.uniform(0.0, 0.6))
            os.kill(pid, signal.SIGKILL)
            reaped = lines.next().split()
            assert reaped[:2] == ["reaped", str(pid)]
            status = int(reaped[2])
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, \
                f"writer {pid} ended by itself (status {status}), not by the kill"
            writer = None
            dead_pids.append(pid)

            path, state, warnings = ckpt.load_latest(folder)  # weights_only=True inside
            step = state["progress"]["step"]
            assert warnings == [], warnings  # a killed writer never leaves a bad newest file
            assert os.path.basename(path) == ckpt.checkpoint_name(step)
            assert step >= previous, f"kill {i}: latest went back from {previous} to {step}"
            # no partial file: the bytes are those recorded, and every value is this step's
            assert ckpt.verify(path) is None
            assert state["model"]["w"].shape == (NUMEL,)
            assert torch.equal(state["model"]["w"], torch.full((NUMEL,), float(step)))
            assert state["history"] == [{"step": step}]
            with open(os.path.join(folder, ckpt.POINTER)) as f:
                pointer = json.load(f)
            assert pointer["step"] == step and pointer["sha256"] == _sha256(path)
            previous = step

            stale = _tmp_files(folder)
            seen_stale.update(stale)
            assert all(int(f.rsplit("-", 1)[1]) in dead_pids for f in stale), stale
            if step >= start + 1:
                # this writer finished a write after its first one: that write's pruning
                # removed the temporary files of every writer killed before it
                assert all(f.endswith(f".tmp-{pid}") for f in stale), (pid, stale)
        assert previous > 1000, "no writer ever finished a checkpoint: kills came too early"
    finally:
        if writer is not None:  # a failed assertion must not leave a writer writing for ever
            os.kill(writer, signal.SIGKILL)
        proc.stdin.close()
        proc.kill()
        proc.wait(timeout=30)

    # the last kill was inside a write: its temporary file is still there...
    stale = _tmp_files(folder)
    assert stale and seen_stale
    # ...until the next successful write (by another, live process) cleans it up
    ckpt.write_checkpoint(folder, _state(10**6, NUMEL), keep=3)
    assert _tmp_files(folder) == []
    path, state, warnings = ckpt.load_latest(folder)
    assert state["progress"]["step"] == 10**6 and warnings == []


# ----------------------------------------------------------------------------- 2. corruption

def _flip_middle(path) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        chunk = f.read(64)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))


def _truncate(path) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


@pytest.mark.parametrize("damage", [_flip_middle, _truncate], ids=["flipped", "truncated"])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(tmp_path, damage):
    folder = str(tmp_path)
    for step in (10, 20, 30):
        ckpt.write_checkpoint(folder, _state(step, 50_000), keep=3)
    newest = os.path.join(folder, ckpt.checkpoint_name(30))
    damage(newest)

    path, state, warnings = ckpt.load_latest(folder)
    assert path == os.path.join(folder, ckpt.checkpoint_name(20))
    assert state["progress"]["step"] == 20
    assert torch.equal(state["model"]["w"], torch.full((50_000,), 20.0))
    assert len(warnings) == 1 and newest in warnings[0], warnings

    # with the two newest damaged, the oldest is used and both are named
    damage(os.path.join(folder, ckpt.checkpoint_name(20)))
    path, state, warnings = ckpt.load_latest(folder)
    assert state["progress"]["step"] == 10
    assert len(warnings) == 2 and newest in warnings[0]
    assert os.path.join(folder, ckpt.checkpoint_name(20)) in warnings[1]


def _digits_config(name, **kw):
    return RunConfig(name=name, global_batch=32, steps=30, checkpoint_every=10,
                     keep_checkpoints=3, **kw)


def test_resume_skips_a_corrupted_newest_checkpoint_and_finishes(idle_pool, tmp_path):
    name = unique("corrupt")
    first = TrainingRun(idle_pool, _digits_config(name), source=DIGITS_CELL,
                        workspace=str(tmp_path)).start()
    _wait_finished(first)
    assert [c["step"] for c in first.checkpoints] == [10, 20, 30]
    newest = os.path.join(first.checkpoint_dir, ckpt.checkpoint_name(30))
    previous = os.path.join(first.checkpoint_dir, ckpt.checkpoint_name(20))
    _flip_middle(newest)

    second = TrainingRun(idle_pool, _digits_config(name), source=DIGITS_CELL, resume=True,
                         workspace=str(tmp_path)).start()
    start = next(e for e in second.events if e["kind"] == "start")
    assert start["resumed_from"] == previous
    warnings = [e for e in second.events if e["kind"] == "warning"]
    assert any(newest in e["message"] for e in warnings), second.events
    _wait_finished(second)
    assert [r["step"] for r in second.history] == list(range(1, 31))
    # the final checkpoint replaced the corrupted file
    path, state, skipped = ckpt.load_latest(second.checkpoint_dir)
    assert path == newest and state["progress"]["step"] == 30 and skipped == []


# ----------------------------------------------------------------------------- 3. disk full

# DIGITS_CELL with an unused 800 kB buffer: each checkpoint is ~0.8 MB, so a 2 MB file system
# holds two of them and the third and fourth writes run out of space.
BIG_CELL = DIGITS_CELL + '''
model.register_buffer("pad", torch.zeros(200_000))
'''


def _mount_small_tmpfs(folder) -> bool:
    os.makedirs(folder, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", folder],
                            capture_output=True, text=True)
    return result.returncode == 0


def _unmount(folder) -> None:
    if subprocess.run(["umount", folder], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", folder], capture_output=True)


@pytest.fixture(scope="module")
def full_disk_run(pool, tmp_path_factory):
    """A 40-step run (checkpoints at 10, 20, 30, 40) whose checkpoint folder is a 2 MB tmpfs.

    Fallback where mounting is not permitted: the temporary names that rank 0's writes of
    steps 30 and 40 will use are made symlinks to /dev/full, where every write fails with the
    kernel's ENOSPC (a real "No space left on device", just not from a real full disk).
    """
    for _ in range(2):  # what idle_pool does, for this module-wide fixture
        if pool.run is not None and pool.run.active:
            pool.run.stop()
            pool.run.wait(timeout=60)
    folder = str(tmp_path_factory.mktemp("full") / "ckpts")
    mounted = _mount_small_tmpfs(folder)
    try:
        if not mounted:
            pid = pool.engine_sets.engines[0].pid  # rank 0 writes the checkpoints
            for step in (30, 40):
                tmp = os.path.join(folder, f"{ckpt.checkpoint_name(step)}.tmp-{pid}")
                os.symlink("/dev/full", tmp)
        config = RunConfig(name=unique("full"), global_batch=32, steps=40, checkpoint_every=10,
                           keep_checkpoints=3, checkpoint_dir=folder)
        run = TrainingRun(pool, config, source=BIG_CELL).start()
        state = run.wait(timeout=RUN_TIMEOUT)
        try:
            latest = ckpt.load_latest(folder)
        except ckpt.CheckpointError as e:
            latest = e
        yield {"run": run, "state": state, "folder": folder, "latest": latest, "mounted": mounted,
               "files": sorted(os.listdir(folder)), "logs": run.logs()}
    finally:
        if mounted:
            _unmount(folder)


def test_a_full_disk_fails_checkpoints_but_not_the_run(full_disk_run):
    run, folder = full_disk_run["run"], full_disk_run["folder"]
    assert full_disk_run["state"] == "finished", run.summary() + "\n" + full_disk_run["logs"]
    assert [r["step"] for r in run.history] == list(range(1, 41))
    written = [e["step"] for e in run.events if e["kind"] == "checkpoint"]
    failed = [e["step"] for e in run.events if e["kind"] == "checkpoint_failed"]
    assert written == [10, 20] and failed == [30, 40], run.events
    # no partial file was left behind, and the previous checkpoint still loads and verifies
    files = full_disk_run["files"]
    leftovers = [f for f in files
                 if ".tmp-" in f or f.startswith(("step-00000030", "step-00000040"))]
    assert leftovers == [], files
    latest = full_disk_run["latest"]
    assert not isinstance(latest, Exception), latest
    path, state, warnings = latest
    assert path == os.path.join(folder, ckpt.checkpoint_name(20))
    assert state["progress"]["step"] == 20 and warnings == []
    assert state["model"]["pad"].shape == (200_000,)


def test_a_full_disk_failure_says_no_space_left_and_names_the_file(full_disk_run):
    run, folder = full_disk_run["run"], full_disk_run["folder"]
    failed = [e for e in run.events if e["kind"] == "checkpoint_failed"]
    assert failed
    for event in failed:
        assert "No space left on device" in event["message"], event
        assert os.path.join(folder, ckpt.checkpoint_name(event["step"])) in event["message"], event


# ----------------------------------------------------------------------------- 4. code in a file

class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant_code_checkpoint(folder, step, marker, with_record=True) -> str:
    """A checkpoint file (with a valid record and pointer, like write_checkpoint's) whose
    unpickling would run ``touch marker``."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, ckpt.checkpoint_name(step))
    with open(path, "wb") as f:
        torch.save({"model": _RunsCode(marker), "progress": {"step": step}}, f,
                   pickle_module=pickle)
    if with_record:
        record = json.dumps({"file": os.path.basename(path), "step": step,
                             "sha256": _sha256(path), "bytes": os.path.getsize(path),
                             "time": time.time()})
        for name in (ckpt.checkpoint_name(step)[:-3] + ".json", ckpt.POINTER):
            with open(os.path.join(folder, name), "w") as f:
                f.write(record)
    return path


def test_the_planted_payload_really_runs_code_when_loaded_unsafely(tmp_path):
    """Control for the tests below: without weights_only the file does run its code."""
    marker = tmp_path / "ran"
    path = _plant_code_checkpoint(str(tmp_path / "c"), 5, marker)
    torch.load(path, weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("with_record", [True, False], ids=["recorded", "unrecorded"])
def test_load_latest_refuses_a_checkpoint_that_would_run_code(tmp_path, with_record):
    marker = tmp_path / "pwned"
    folder = str(tmp_path / "c")
    path = _plant_code_checkpoint(folder, 50, marker, with_record)
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.load_latest(folder)
    assert path in str(info.value) and "cannot load checkpoint" in str(info.value)
    assert not marker.exists()

    # beside an older good checkpoint, the planted one is passed over (skipped with a warning
    # naming it when its record makes it the newest) and still never run
    folder = str(tmp_path / "d")
    os.makedirs(folder)
    good = ckpt.write_checkpoint(folder, _state(40), keep=5)["path"]
    path = _plant_code_checkpoint(folder, 50, marker, with_record)
    got, state, warnings = ckpt.load_latest(folder)
    assert got == good and state["progress"]["step"] == 40
    if with_record:
        assert len(warnings) == 1 and path in warnings[0], warnings
    assert not marker.exists()


def test_resume_refuses_a_checkpoint_that_would_run_code(idle_pool, tmp_path):
    marker = tmp_path / "pwned"
    name = unique("evil")
    path = _plant_code_checkpoint(str(tmp_path / "elastic-checkpoints" / name), 10, marker)
    run = TrainingRun(idle_pool, _digits_config(name), source=DIGITS_CELL, resume=True,
                      workspace=str(tmp_path))
    with pytest.raises(RunSetupError) as info:
        run.start()
    message = str(info.value)
    assert "CheckpointError" in message and path in message, message
    assert run.state == "failed"
    assert not marker.exists()
    assert idle_pool.run is None or not idle_pool.run.active


# ----------------------------------------------------------------------------- 5. short reasons

def _torn_without_record(folder, step) -> str:
    """A truncated checkpoint with no record, so that torch itself meets the damage."""
    path = ckpt.write_checkpoint(folder, _state(step), keep=5)["path"]
    _truncate(path)
    os.unlink(path[:-3] + ".json")
    return path


def _assert_short(line: str) -> None:
    assert "\n" not in line and len(line) < 250, line
    assert "Weights only load failed" not in line and "add_safe_globals" not in line, line


def test_skipped_checkpoints_get_one_short_line_each_and_the_detail_in_the_log(tmp_path):
    folder = str(tmp_path / "c")
    os.makedirs(folder)
    good = ckpt.write_checkpoint(folder, _state(10), keep=5)["path"]
    torn = _torn_without_record(folder, 20)
    typed = _plant_code_checkpoint(folder, 30, tmp_path / "pwned")
    details = []
    path, state, warnings = ckpt.load_latest(folder, log=details.append)
    assert path == good and state["progress"]["step"] == 10
    assert len(warnings) == 2, warnings
    for line in warnings:
        _assert_short(line)
    assert warnings[0].startswith(f"skipped checkpoint {typed}: it holds a type the safe load")
    assert "posix.system" in warnings[0] or "os.system" in warnings[0], warnings[0]
    assert warnings[1].startswith(f"skipped checkpoint {torn}: torn or corrupted ("), warnings[1]
    assert len(details) == 2 and "Weights only load failed" in details[0], details

    os.unlink(good)  # none usable: the error says the same, one line per file
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.load_latest(folder)
    lines = str(info.value).splitlines()
    assert lines[0] == f"no usable checkpoint in {folder}" and len(lines) == 3, lines
    for line in lines[1:]:
        _assert_short(line)
    assert typed in lines[1] and torn in lines[2]


def test_a_refused_resume_says_one_short_line_per_file(idle_pool, tmp_path):
    name = unique("refused")
    folder = str(tmp_path / "elastic-checkpoints" / name)
    os.makedirs(folder)
    torn = _torn_without_record(folder, 10)
    typed = _plant_code_checkpoint(folder, 20, tmp_path / "pwned")
    run = TrainingRun(idle_pool, _digits_config(name), source=DIGITS_CELL, resume=True,
                      workspace=str(tmp_path))
    with pytest.raises(RunSetupError) as info:
        run.start()
    message = str(info.value)
    assert message.count(typed) == 1 and message.count(torn) == 1, message
    assert "Weights only load failed" not in message and len(message.splitlines()) <= 4, message
    # torch's full messages are in the engine's log
    logs = "".join(open(os.path.join(folder, "logs", f)).read()
                   for f in os.listdir(os.path.join(folder, "logs")) if f.startswith("engine-"))
    assert "Weights only load failed" in logs and typed in logs and torn in logs
