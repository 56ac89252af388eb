"""Bad input, through the Python API, on the real session pool.

Every case checks that the error names the problem and says what to do, then that a short good
run still finishes on the same pool: a mistake must never leave the pool unusable.
"""
import _thread
import re
import signal
import threading
import time
import uuid

import pytest
from conftest import DIGITS_CELL

from elastic_jupyter import RunConfig, RunSetupError, TrainingRun, UsageError

# DIGITS_CELL with ~5 ms of sleep per forward pass: a run lasts long enough to act on it.
SLOW_CELL = DIGITS_CELL + '''
import time
_loss = loss_fn
def loss_fn(model, batch):
    time.sleep(0.005)
    return _loss(model, batch)
'''

# rank 1 raises on its 4th batch (ranks otherwise train normally)
FAILING_LOSS_CELL = DIGITS_CELL + '''
import torch.distributed as dist
_loss, _calls = loss_fn, [0]
def loss_fn(model, batch):
    _calls[0] += 1
    if _calls[0] == 4 and dist.get_rank() == 1:
        raise ValueError("bad sample in batch 4")
    return _loss(model, batch)
'''

POOL_SIZE = 2  # the session pool's size; tests that change it are put back by _restore_pool


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def plain(text: str) -> str:
    """`text` without ANSI colour codes."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def assert_pool_still_trains(pool, workspace) -> None:
    """A short good run on the same pool finishes: the bad input left the pool usable."""
    run = TrainingRun(pool, RunConfig(name=unique("good"), steps=10, checkpoint_every=0),
                      source=DIGITS_CELL, workspace=workspace)
    assert run.start().wait(timeout=120) == "finished", run.summary()
    assert pool.run is None


def start_slow_run(pool, workspace, steps=5000, **config) -> TrainingRun:
    """A run that trains for many seconds; tests stop it once they are done with it."""
    run = TrainingRun(pool, RunConfig(name=unique("slow"), steps=steps, checkpoint_every=0,
                                      **config), source=SLOW_CELL, workspace=workspace).start()
    deadline = time.monotonic() + 30
    while run.step < 2 and run.active and time.monotonic() < deadline:
        time.sleep(0.02)
    assert run.state == "training", run.summary()
    return run


def stop_and_wait(run) -> str:
    run.stop()
    return run.wait(timeout=60)


@pytest.fixture(autouse=True)
def _restore_pool(pool):
    """Leave the shared pool idle and at its original size, whatever the test did."""
    yield
    if pool.run is not None and pool.run.active:
        stop_and_wait(pool.run)
    if pool.size != POOL_SIZE:
        pool.resize(POOL_SIZE)


# ----------------------------------------------------------------------------- the cell

@pytest.mark.parametrize("name", ["model", "optimizer", "dataset", "loss_fn"])
def test_cell_missing_a_required_name(idle_pool, tmp_path, name):
    run = TrainingRun(idle_pool, RunConfig(name=unique("missing"), steps=10),
                      source=DIGITS_CELL + f"\ndel {name}\n", workspace=tmp_path)
    with pytest.raises(RunSetupError) as excinfo:
        run.start()
    first_line = str(excinfo.value).splitlines()[0]
    assert f"did not define {name}" in first_line
    assert "must define model, optimizer, dataset and loss_fn(model, batch)" in first_line
    assert idle_pool.run is None
    assert_pool_still_trains(idle_pool, tmp_path)


DIVIDE_BY_ZERO_CELL = DIGITS_CELL + "\nscale = 1 / 0\n"
DIVIDE_BY_ZERO_LINE = DIVIDE_BY_ZERO_CELL.splitlines().index("scale = 1 / 0") + 1


def _setup_error(pool, workspace) -> str:
    run = TrainingRun(pool, RunConfig(name=unique("raises"), steps=10),
                      source=DIVIDE_BY_ZERO_CELL, workspace=workspace)
    with pytest.raises(RunSetupError) as excinfo:
        run.start()
    return str(excinfo.value)


def test_cell_raising_at_setup_shows_the_engine_traceback(idle_pool, tmp_path):
    message = _setup_error(idle_pool, tmp_path)
    assert message.splitlines()[0].endswith("ZeroDivisionError: division by zero")
    assert "engine slot" in message.splitlines()[0]
    text = plain(message)
    assert "--- engine traceback ---" in text
    # where in the cell it failed
    assert (f"cell.py:{DIVIDE_BY_ZERO_LINE}" in text
            or f'cell.py", line {DIVIDE_BY_ZERO_LINE}' in text), text
    assert idle_pool.run is None
    assert_pool_still_trains(idle_pool, tmp_path)


def test_setup_traceback_shows_the_failing_source_line(idle_pool, tmp_path):
    text = plain(_setup_error(idle_pool, tmp_path))
    assert "scale = 1 / 0" in text
    assert "Could not get source" not in text


def test_setup_traceback_is_plain_text(idle_pool, tmp_path):
    assert "\x1b[" not in _setup_error(idle_pool, tmp_path)


def test_loss_fn_raising_during_training_fails_the_run(idle_pool, tmp_path, capsys):
    run = TrainingRun(idle_pool, RunConfig(name=unique("lossfail"), steps=50,
                                           collective_timeout=30),
                      source=FAILING_LOSS_CELL, workspace=tmp_path).start()
    capsys.readouterr()
    assert run.wait(timeout=90) == "failed"
    assert not run.active
    # a plain wait says why, once
    shown = capsys.readouterr()
    assert shown.err == f"run {run.name!r} failed: {run.error}\n" and not shown.out
    assert run.wait() == "failed" and capsys.readouterr() == ("", "")
    first_line = run.error.splitlines()[0]
    # the cause, not the peer's broken collective
    assert "ValueError: bad sample in batch 4" in first_line, run.error
    assert "engine slot" in first_line
    text = plain(run.error)
    assert "--- engine traceback ---" in text
    assert "in loss_fn" in text or "loss_fn(" in text
    assert run.step < 50
    assert idle_pool.run is None
    assert_pool_still_trains(idle_pool, tmp_path)


NAME_ERROR_CELL = DIGITS_CELL.replace("lr=0.05", "lr=notebook_lr")


def _name_error(pool, workspace) -> str:
    run = TrainingRun(pool, RunConfig(name=unique("nameerror"), steps=10),
                      source=NAME_ERROR_CELL, workspace=workspace)
    with pytest.raises(RunSetupError) as excinfo:
        run.start()
    return str(excinfo.value).splitlines()[0]


def test_notebook_variable_missing_on_the_engines(idle_pool, tmp_path):
    first_line = _name_error(idle_pool, tmp_path)
    assert "name 'notebook_lr' is not defined" in first_line
    assert "--push" in first_line
    # and pushing it is the fix
    run = TrainingRun(idle_pool, RunConfig(name=unique("pushed"), steps=10, checkpoint_every=0),
                      source=NAME_ERROR_CELL, push={"notebook_lr": 0.01}, workspace=tmp_path)
    assert run.start().wait(timeout=120) == "finished"
    assert run.history[0]["lr"] == pytest.approx(0.01)
    assert_pool_still_trains(idle_pool, tmp_path)


def test_push_hint_matches_the_python_api(idle_pool, tmp_path):
    assert "push=[" not in _name_error(idle_pool, tmp_path)


# ----------------------------------------------------------------------------- resizes

@pytest.mark.parametrize("size", [0, -1, 5, 9], ids=["zero", "below_min", "above_max", "nine"])
def test_resize_outside_the_bounds(idle_pool, tmp_path, size):
    run = start_slow_run(idle_pool, tmp_path)
    with pytest.raises(UsageError) as excinfo:
        run.resize(size)
    message = str(excinfo.value)
    assert f"pool size {size} is outside this pool's bounds [1, 4]" in message
    assert "choose a size in range" in message
    assert run.state == "training" and run.requested_size == POOL_SIZE
    assert stop_and_wait(run) == "stopped"
    assert run.world_size == POOL_SIZE
    assert_pool_still_trains(idle_pool, tmp_path)


@pytest.mark.parametrize("size", ["three", 2.5])
def test_resize_to_a_non_integer(idle_pool, tmp_path, size):
    run = start_slow_run(idle_pool, tmp_path)
    try:
        with pytest.raises(UsageError) as excinfo:
            run.resize(size)
        message = str(excinfo.value)
        assert "integer" in message and repr(size) in message
        assert run.state == "training" and run.requested_size == POOL_SIZE
        assert "[1, 4]" in message
    finally:
        stop_and_wait(run)
    assert_pool_still_trains(idle_pool, tmp_path)


def test_resize_at_a_step_that_is_not_ahead(idle_pool, tmp_path):
    run = start_slow_run(idle_pool, tmp_path, steps=3000)
    for at_step in (1, 3000):
        with pytest.raises(UsageError) as excinfo:
            run.resize(3, at_step=at_step)
        assert f"at_step={at_step} must be after the current step" in str(excinfo.value)
        assert "before the last step 3000" in str(excinfo.value)
    assert stop_and_wait(run) == "stopped"
    assert_pool_still_trains(idle_pool, tmp_path)


def test_resize_or_stop_a_finished_run(idle_pool, tmp_path):
    run = TrainingRun(idle_pool, RunConfig(name=unique("done"), steps=10, checkpoint_every=0),
                      source=DIGITS_CELL, workspace=tmp_path)
    assert run.start().wait(timeout=120) == "finished"
    with pytest.raises(UsageError) as excinfo:
        run.resize(3)
    assert f"run {run.name!r} is finished" in str(excinfo.value)
    run.stop()  # a no-op
    assert run.state == "finished" and idle_pool.size == POOL_SIZE
    # with no run, a pool resize cannot be scheduled at a step
    with pytest.raises(UsageError, match="at_step needs a running training run"):
        idle_pool.resize(3, at_step=5)
    assert idle_pool.size == POOL_SIZE
    assert_pool_still_trains(idle_pool, tmp_path)


@pytest.mark.parametrize("rejected", [False, True], ids=["never_started", "start_rejected"])
def test_a_run_that_is_not_running_is_not_active(idle_pool, tmp_path, rejected):
    run = TrainingRun(idle_pool, RunConfig(name=unique("unstarted"), steps=10,
                                           global_batch=1 if rejected else 64),
                      source=DIGITS_CELL, workspace=tmp_path)
    if rejected:
        with pytest.raises(UsageError, match="smaller than the world size"):
            run.start()
    # checked first: on the buggy code, calling resize() below would start engines
    assert not run.active, run.state
    with pytest.raises(UsageError):
        run.resize(2)
    if rejected:
        assert run.wait(timeout=1) == "failed" and "smaller than the world size" in run.error
    else:
        with pytest.raises(UsageError, match=r"call run.start\(\) first"):
            run.wait(timeout=1)
    assert idle_pool.size == POOL_SIZE
    assert_pool_still_trains(idle_pool, tmp_path)


# ----------------------------------------------------------------------------- starting a run

def test_second_run_on_a_busy_pool(idle_pool, tmp_path):
    busy = start_slow_run(idle_pool, tmp_path)
    second = TrainingRun(idle_pool, RunConfig(name=unique("second"), steps=10),
                         source=DIGITS_CELL, workspace=tmp_path)
    with pytest.raises(UsageError) as excinfo:
        second.start()
    message = str(excinfo.value)
    assert f"the pool is busy with run {busy.name!r}" in message
    assert "stop it" in message and "wait for it to finish" in message
    assert busy.state == "training" and idle_pool.run is busy
    assert stop_and_wait(busy) == "stopped"
    assert_pool_still_trains(idle_pool, tmp_path)


def test_global_batch_smaller_than_the_world_size(idle_pool, tmp_path):
    run = TrainingRun(idle_pool, RunConfig(name=unique("tinybatch"), steps=10, global_batch=1),
                      source=DIGITS_CELL, workspace=tmp_path)
    with pytest.raises(UsageError) as excinfo:
        run.start()
    message = str(excinfo.value)
    assert f"--global-batch 1 is smaller than the world size {POOL_SIZE}" in message
    assert "every rank needs at least one sample" in message
    assert idle_pool.run is None
    assert_pool_still_trains(idle_pool, tmp_path)


def test_a_rejected_start_leaves_the_pool_size_alone(idle_pool, tmp_path):
    run = TrainingRun(idle_pool, RunConfig(name=unique("tinybatch"), steps=10, global_batch=2),
                      engines=3, source=DIGITS_CELL, workspace=tmp_path)
    with pytest.raises(UsageError, match="smaller than the world size 3"):
        run.start()
    assert idle_pool.size == POOL_SIZE


def test_unwritable_checkpoint_folder(idle_pool, tmp_path):
    # tests run as root, so chmod would not stop writes: put a regular file in the path
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    folder = blocker / "checkpoints"
    run = TrainingRun(idle_pool, RunConfig(name=unique("nowrite"), steps=10,
                                           checkpoint_dir=str(folder)),
                      source=DIGITS_CELL, workspace=tmp_path)
    with pytest.raises(UsageError) as excinfo:
        run.start()
    message = str(excinfo.value)
    assert f"checkpoint folder {folder} is not writable" in message
    assert "--checkpoint-dir (checkpoint_dir=) with a writable folder" in message
    assert idle_pool.run is None
    assert_pool_still_trains(idle_pool, tmp_path)


def test_reused_run_name_needs_resume(idle_pool, tmp_path):
    name = unique("reused")
    first = TrainingRun(idle_pool, RunConfig(name=name, steps=10, checkpoint_every=0),
                        source=DIGITS_CELL, workspace=tmp_path)
    assert first.start().wait(timeout=120) == "finished"
    again = TrainingRun(idle_pool, RunConfig(name=name, steps=10), source=DIGITS_CELL,
                        workspace=tmp_path)
    with pytest.raises(UsageError) as excinfo:
        again.start()
    message = str(excinfo.value)
    assert f"run name {name!r} already has checkpoints" in message
    assert "pass --resume (resume=True) to continue it, or choose another --name" in message
    assert idle_pool.run is None
    assert first.checkpoints[-1]["step"] == 10  # untouched
    assert_pool_still_trains(idle_pool, tmp_path)


def test_resume_with_another_global_batch(idle_pool, tmp_path):
    name = unique("resume")
    first = TrainingRun(idle_pool, RunConfig(name=name, steps=10, checkpoint_every=0),
                        source=DIGITS_CELL, workspace=tmp_path)
    assert first.start().wait(timeout=120) == "finished"
    changed = TrainingRun(idle_pool, RunConfig(name=name, steps=20, global_batch=32),
                          source=DIGITS_CELL, workspace=tmp_path, resume=True)
    with pytest.raises(UsageError) as excinfo:
        changed.start()
    message = str(excinfo.value)
    assert "global_batch: 64 in the checkpoint, 32 now" in message
    assert "use the checkpoint's values, or start a new run with another --name" in message
    assert idle_pool.run is None
    # doing what it says works: resume with the checkpoint's global batch
    resumed = TrainingRun(idle_pool, RunConfig(name=name, steps=20, checkpoint_every=0),
                          source=DIGITS_CELL, workspace=tmp_path, resume=True)
    assert resumed.start().wait(timeout=120) == "finished"
    assert resumed.step == 20 and resumed.history[0]["step"] == 1
    assert_pool_still_trains(idle_pool, tmp_path)


@pytest.mark.parametrize("options, expected", [
    ({"global_batch": 0}, "--global-batch must be a positive integer, got 0"),
    ({"epochs": 1, "steps": 10}, "give --epochs or --steps, not both"),
    ({"steps": -3}, "--steps must be a positive integer, got -3"),
    ({"checkpoint_every": -1}, "--checkpoint-every must be >= 0 (0: only at the end)"),
    ({"name": "a/b"}, "--name must be a plain name (no slashes), got 'a/b'"),
], ids=["global_batch_0", "epochs_and_steps", "negative_steps", "negative_checkpoint_every",
        "name_with_slash"])
def test_bad_run_config(idle_pool, tmp_path, options, expected):
    config = RunConfig(**{"name": unique("badconfig"), **options})
    with pytest.raises(UsageError) as excinfo:
        TrainingRun(idle_pool, config, source=DIGITS_CELL, workspace=tmp_path)
    assert str(excinfo.value) == expected
    assert not (tmp_path / "elastic-checkpoints" / config.name).exists()
    assert_pool_still_trains(idle_pool, tmp_path)


# ----------------------------------------------------------------------------- waiting

def test_interrupting_wait_keeps_the_run_training(idle_pool, tmp_path):
    run = TrainingRun(idle_pool, RunConfig(name=unique("interrupted"), steps=1500,
                                           checkpoint_every=0),
                      source=SLOW_CELL, workspace=tmp_path).start()
    # a shell's background job starts with SIGINT ignored, which would swallow the interrupt
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.5, _thread.interrupt_main)  # the kernel's stop button
    timer.start()
    try:
        state = run.wait(timeout=60)
    except KeyboardInterrupt:
        pytest.fail("run.wait() let the KeyboardInterrupt through")
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert state == "training"
    assert run.active
    assert 0 < run.step < 1500
    assert run.wait(timeout=120) == "finished"
    assert run.step == 1500
    assert_pool_still_trains(idle_pool, tmp_path)



def test_commit_every_was_removed_and_saying_it_says_why(idle_pool, tmp_path):
    """--commit-every went with transactional steps: a call or a line that gives it is refused
    with the reason, and the pool trains on."""
    why = r"--commit-every \(commit_every=\) was removed in 0\.2\.0: every step is committed"
    with pytest.raises(UsageError, match=why):
        RunConfig(name=unique("commit"), steps=10, checkpoint_every=0, commit_every=5)
    from elastic_jupyter.ui.magics import _train_parser
    with pytest.raises(UsageError, match=why):
        _train_parser().parse_args(["--name", "x", "--commit-every", "5"])
    assert idle_pool.run is None
    assert_pool_still_trains(idle_pool, tmp_path)
