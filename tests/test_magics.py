"""The magics, through a real in-process IPython shell, on the real session pool.

The magics resolve the checkpoint folder against the current folder, so every test runs in its
own tmp_path. Errors must reach the user as IPython UsageErrors: a message, no traceback.
"""
import os
import time
import uuid

import pytest
from conftest import DIGITS_CELL
from IPython.core.error import UsageError as IPythonUsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.testing.globalipapp import start_ipython

from elastic_jupyter import TrainingRun
from elastic_jupyter.pool.slots import Exclusion

# DIGITS_CELL with ~5 ms of sleep per forward pass: a run lasts long enough to act on it.
SLOW_CELL = DIGITS_CELL + '''
import time
_loss = loss_fn
def loss_fn(model, batch):
    time.sleep(0.005)
    return _loss(model, batch)
'''

# the notebook variables `lr` and `hidden`, used on the engines
PUSH_CELL = DIGITS_CELL.replace(
    "torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)",
    "torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10)",
).replace("lr=0.05", "lr=lr")

POOL_SIZE = 2  # the session pool's size


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def ip():
    start_ipython()  # once per process; later calls return None
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "elastic_jupyter")
    return shell


@pytest.fixture
def magics(ip, idle_pool, monkeypatch, tmp_path):
    """The ElasticMagics object, on the session pool, in a fresh current folder."""
    monkeypatch.chdir(tmp_path)
    elastic = ip.magics_manager.registry["ElasticMagics"]
    monkeypatch.setattr(elastic, "pool", idle_pool)
    yield elastic
    if idle_pool.run is not None and idle_pool.run.active:
        idle_pool.run.stop()
        idle_pool.run.wait(timeout=60)
    if idle_pool.size != POOL_SIZE:
        idle_pool.resize(POOL_SIZE)


@pytest.fixture
def cell(ip, capsys):
    """Run a cell; returns (result, stdout, stderr)."""
    def run_cell(source):
        result = ip.run_cell(source)
        out, err = capsys.readouterr()
        return result, out, err
    return run_cell


def assert_usage_error(result, err, *fragments) -> str:
    """The cell failed with an IPython UsageError: its message is all that was shown (no
    traceback of the magic; a setup error's message carries the engine's own traceback)."""
    assert isinstance(result.error_in_exec, IPythonUsageError), (result.error_in_exec, err)
    message = str(result.error_in_exec)
    assert err == f"UsageError: {message}\n"
    for fragment in fragments:
        assert fragment in message, message
    return message


def train_cell(line, body=DIGITS_CELL):
    return f"%%elastic_train {line}\n{body}"


def wait_until(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# ----------------------------------------------------------------------------- --help

@pytest.mark.parametrize("source, usage", [
    ("%elastic_pool --help", "usage: %elastic_pool"),
    ("%%elastic_train --help\n# the cell\n", "usage: %%elastic_train"),
    ("%elastic_resize --help", "usage: %elastic_resize"),
    ("%elastic_stop --help", "usage: %elastic_stop"),
], ids=["pool", "train", "resize", "stop"])
def test_help_prints_the_usage(magics, cell, source, usage):
    result, out, err = cell(source)
    assert result.success, (result.error_in_exec, err)
    assert out.startswith(usage)
    assert "--help" in out and "options:" in out
    assert err == ""


def test_train_help_without_a_cell_body(magics, cell):
    # IPython refuses a cell magic with an empty body and points to the line form, which
    # prints the usage
    _, _, err = cell("%%elastic_train --help")
    assert "%elastic_train" in err
    result, out, err = cell("%elastic_train --help")
    assert result.success, err
    assert out.startswith("usage: %%elastic_train")
    result, _, err = cell("%elastic_train --name x")
    assert "is a cell magic: put the training code in the cell" in err


def test_help_of_train_names_every_option(magics, cell):
    _, out, _ = cell("%%elastic_train --help\n# the cell\n")
    for option in ("--name", "--global-batch", "--steps", "--push", "--schedule", "--resume",
                   "--checkpoint-dir", "--wait"):
        assert option in out


# ----------------------------------------------------------------------------- bad options

@pytest.mark.parametrize("source, fragments", [
    ("%elastic_pool status --bogus", ["unrecognized arguments: --bogus", "usage: %elastic_pool"]),
    ("%elastic_resize 2 --bogus", ["unrecognized arguments: --bogus"]),
    ("%elastic_stop --bogus", ["unrecognized arguments: --bogus"]),
    (train_cell("--name x --bogus"), ["unrecognized arguments: --bogus",
                                      "usage: %%elastic_train"]),
    (train_cell("--name x --global-batch abc"),
     ["argument --global-batch: expected a positive integer, got 'abc'"]),
    (train_cell("--name x --global-batch 0"),
     ["argument --global-batch: expected a positive integer, got 0"]),
    (train_cell("--name x --schedule 10-3"),
     ["--schedule takes STEP:SIZE pairs like 100:3,300:1; got '10-3'"]),
    (train_cell("--steps 10"), ["the following arguments are required: --name"]),
    (train_cell("--name 'unclosed"), ["cannot parse options", "No closing quotation"]),
    (train_cell("'my run' --name x"), ["'my run' is not a valid variable name"]),
    ("%elastic_pool grow", ["argument action: invalid choice: 'grow'"]),
], ids=["pool_bogus", "resize_bogus", "stop_bogus", "train_bogus", "global_batch_abc",
        "global_batch_0", "schedule_10-3", "no_name", "unclosed_quote", "bad_variable",
        "pool_bad_action"])
def test_bad_options(magics, cell, source, fragments):
    result, out, err = cell(source)
    assert_usage_error(result, err, *fragments)
    assert magics.pool.run is None  # nothing started


# ----------------------------------------------------------------------------- %%elastic_train

def test_train_binds_the_handle_to_run_by_default(ip, magics, cell):
    ip.user_ns.pop("run", None)
    name = unique("default")
    result, out, err = cell(train_cell(f"--name {name} --steps 10"))
    assert result.success, err
    run = ip.user_ns["run"]
    assert isinstance(run, TrainingRun) and run.name == name
    assert f"Run {name!r} training on {POOL_SIZE} engine(s)" in out and "handle: run." in out
    assert run.wait(timeout=120) == "finished"


def test_train_binds_the_handle_to_the_first_word(ip, magics, cell, tmp_path):
    ip.user_ns.pop("my_run", None)
    before = ip.user_ns.get("run")
    name = unique("named")
    result, out, err = cell(train_cell(f"my_run --name {name} --steps 10 --tensorboard tb"))
    assert result.success, err
    run = ip.user_ns["my_run"]
    assert run.name == name and "handle: my_run." in out
    assert f"TensorBoard: tensorboard --logdir {tmp_path / 'tb' / name}" in out  # DIR/NAME
    assert ip.user_ns.get("run") is before  # `run` untouched
    assert run.wait(timeout=120) == "finished"
    # checkpoints beside the notebook: ./elastic-checkpoints/NAME/
    assert run.checkpoint_dir == str(tmp_path / "elastic-checkpoints" / name)
    assert [c["step"] for c in run.checkpoints] == [10]
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb" / name))


def test_train_wait_prints_progress(ip, magics, cell):
    name = unique("waited")
    result, out, err = cell(train_cell(f"--name {name} --steps 10 --wait"))
    assert result.success, err
    assert ip.user_ns["run"].state == "finished"
    assert "[step 10] finished: world size 2" in out
    assert f"run {name!r}: finished, step 10/10" in out


def test_push_sends_notebook_variables(ip, magics, cell):
    ip.user_ns.update(lr=0.02, hidden=17)
    result, out, err = cell(train_cell(f"--name {unique('push')} --steps 10 --push lr,hidden",
                                       PUSH_CELL))
    assert result.success, err
    run = ip.user_ns["run"]
    assert run.wait(timeout=120) == "finished"
    assert run.history[0]["lr"] == pytest.approx(0.02)
    assert tuple(run.state_dict()["0.weight"].shape) == (17, 64)


def test_push_of_a_missing_variable(ip, magics, cell):
    ip.user_ns.pop("not_defined_anywhere", None)
    result, out, err = cell(train_cell(f"--name {unique('push')} --steps 10 "
                                       "--push lr,not_defined_anywhere"))
    assert_usage_error(result, err, "--push not_defined_anywhere: no variable "
                                    "'not_defined_anywhere' in the notebook")
    assert magics.pool.run is None


def test_cell_without_push_says_to_push(ip, magics, cell):
    ip.user_ns.update(lr=0.02, hidden=17)  # defined in the notebook but not pushed
    result, out, err = cell(train_cell(f"--name {unique('nopush')} --steps 10", PUSH_CELL))
    message = assert_usage_error(result, err, "is not defined", "--push NAME")
    assert message.startswith("the cell failed on engine slot")
    assert magics.pool.run is None


# ----------------------------------------------------------------------------- resize, stop

def test_resize_during_a_run(ip, magics, cell):
    result, out, err = cell(train_cell(f"--name {unique('grow')} --steps 5000 "
                                       "--checkpoint-every 0", SLOW_CELL))
    assert result.success, err
    run = ip.user_ns["run"]
    wait_until(lambda: run.step >= 2)
    result, out, err = cell("%elastic_resize 3")
    assert result.success, err
    assert f"Resize of {run.name!r} to 3 requested (at the next step boundary)." in out
    wait_until(lambda: any(e["kind"] == "resized" for e in run.events) or not run.active,
               timeout=120)
    resized = [e for e in run.events if e["kind"] == "resized"]
    assert resized and resized[0]["from"] == 2 and resized[0]["to"] == 3, run.events
    assert run.world_size == 3 and run.history[-1]["world_size"] == 3
    assert magics.pool.size == 3
    result, out, err = cell("%elastic_stop")
    assert result.success, err
    assert run.state == "stopped"


def test_stop_during_a_run(ip, magics, cell):
    result, out, err = cell(train_cell(f"--name {unique('halt')} --steps 5000 "
                                       "--checkpoint-every 0", SLOW_CELL))
    assert result.success, err
    run = ip.user_ns["run"]
    wait_until(lambda: run.step >= 5)
    # a size outside the bounds is refused and changes nothing
    result, out, err = cell("%elastic_resize 9")
    assert_usage_error(result, err, "pool size 9 is outside this pool's bounds [1, 4]",
                       "choose a size in range")
    assert run.requested_size == POOL_SIZE and run.state == "training"
    # the size it already has: said so, and no resize happens
    result, out, err = cell(f"%elastic_resize {POOL_SIZE}")
    assert result.success, err
    assert f"already trains at world size {POOL_SIZE}: nothing to do" in out
    assert not [e for e in run.events if e["kind"] == "resize"]
    result, out, err = cell("%elastic_stop")
    assert result.success, err
    assert run.state == "stopped"
    assert 5 <= run.step < 5000
    assert f"Run {run.name!r} stopped at step {run.step}." in out
    # a checkpoint at the stop step, though --checkpoint-every 0 writes only at the end
    assert run.checkpoints[-1]["step"] == run.step
    assert any(e["kind"] == "checkpoint" and e["step"] == run.step for e in run.events)
    assert magics.pool.run is None and magics.pool.size == POOL_SIZE


@pytest.mark.parametrize("source, fragments", [
    ("%elastic_resize 2", ["no run is training", "start one with %%elastic_train"]),
    ("%elastic_stop", ["no run is training", "nothing to stop"]),
])
def test_resize_or_stop_with_no_run(magics, cell, source, fragments):
    result, out, err = cell(source)
    assert_usage_error(result, err, *fragments)
    assert magics.pool.size == POOL_SIZE


# ----------------------------------------------------------------------------- %elastic_pool

def test_pool_status(ip, magics):
    status = ip.run_line_magic("elastic_pool", "status")
    assert status["running"] is True
    assert (status["size"], status["min"], status["max"]) == (POOL_SIZE, 1, 4)
    assert status["run"] is None
    assert len(status["engines"]) == POOL_SIZE


def test_pool_status_prints_a_table_wherever_it_is_in_the_cell(ip, magics, cell, monkeypatch):
    monkeypatch.setitem(magics.pool.slots._exclusions, 3, Exclusion("its engine failed to start"))
    monkeypatch.setitem(magics.pool.slots._exclusions, 2,
                        Exclusion("3 faults within 60 s", time.time() + 30.4))
    result, out, err = cell("%elastic_pool status\nx = 1")  # not the cell's last line
    assert result.success, err
    lines = out.splitlines()
    assert lines[0] == (f"Pool: {POOL_SIZE} engine(s), bounds [1, 4], backend gloo, on this "
                        "host, run: none")
    assert lines[1].split() == ["slot", "host", "device", "pid", "engine", "id"]
    for line, engine in zip(lines[2:], magics.pool.engine_sets.engines):
        assert line.split() == [str(engine.slot), os.uname().nodename, engine.device,
                                str(engine.pid), str(engine.engine_id)]
    assert lines[2 + POOL_SIZE:] == [
        "Excluded slot 2: 3 faults within 60 s; back in 30 s",
        "Excluded slot 3: its engine failed to start; stays out"]
    # as the last line: the same table once, not followed by the raw dict (a terminal shell
    # still writes its bare output prompt; a notebook shows nothing more)
    result, last, err = cell("%elastic_pool status")
    assert result.success and last.startswith(out) and "'engines'" not in last, (last, err)
    assert result.result["size"] == POOL_SIZE  # still the dict


def test_a_pool_a_schedule_left_smaller_says_so_and_so_does_a_run_without_engines(
        ip, magics, cell):
    name = unique("shrunk")
    result, out, err = cell(train_cell(f"--name {name} --steps 4 --schedule 2:1 --wait "
                                       "--no-dashboard"))
    assert result.success and ip.user_ns["run"].state == "finished", err
    note = f"the pool stands at 1 engine, where run {name!r} left it (it started with 2)"
    assert magics.pool.size == 1 and magics.pool.status()["size_note"] == note
    result, out, err = cell("%elastic_pool status")
    assert f"The{note[3:]}: a run without --engines starts at 1; %elastic_pool resize 2 goes " \
           "back." in out.splitlines(), out
    result, out, err = cell(train_cell(f"--name {unique('after')} --steps 2 --no-dashboard"))
    assert result.success, err
    run = ip.user_ns["run"]
    assert f"{note}: training starts at 1; give --engines N (engines=N) to choose" in out
    assert run.wait(timeout=120) == "finished" and run.history[0]["world_size"] == 1
    assert note.replace(name, run.name) == magics.pool.size_note()
    result, out, err = cell(train_cell(f"--name {unique('chosen')} --steps 2 --engines 1 "
                                       "--no-dashboard"))
    assert result.success and "training starts at" not in out, err
    assert ip.user_ns["run"].wait(timeout=120) == "finished"


def test_pool_resize_with_no_run(ip, magics, cell):
    result, out, err = cell("%elastic_pool resize 3")
    assert result.success, err
    assert "<EnginePool size=3 bounds=[1, 4]" in out
    assert ip.run_line_magic("elastic_pool", "status")["size"] == 3
    result, out, err = cell("%elastic_pool resize 2")
    assert result.success, err
    assert magics.pool.size == 2


@pytest.mark.parametrize("source, fragments", [
    ("%elastic_pool resize 9", ["pool size 9 is outside this pool's bounds [1, 4]"]),
    ("%elastic_pool resize", ["needs a size", "%elastic_pool resize 3"]),
    ("%elastic_pool start", ["a pool is already running", "%elastic_pool stop it first"]),
])
def test_pool_misuse(magics, cell, source, fragments):
    result, out, err = cell(source)
    assert_usage_error(result, err, *fragments)
    assert magics.pool.engine_sets.running and magics.pool.size == POOL_SIZE
