"""Kernel lifecycle: real Jupyter kernels (jupyter_client, kernel "python3") train with the
magics as a notebook would, and are shut down gracefully or killed (SIGKILL) mid-run.

One chain of three lives of the run "lifecycle" in one workspace (a kernel start costs seconds):

1. kernel A: ``%%elastic_train`` from scratch; graceful shutdown (``shutdown_kernel(now=False)``)
   once the run is past step STOP_AFTER. The atexit hook must stop the run, write a final
   checkpoint (at the step reached or later) and stop the pool; no process may linger.
2. kernel B, fresh: the same cell with ``--resume`` continues from A's newest complete checkpoint;
   once it wrote a checkpoint of its own, the kernel is SIGKILLed. The reaper must end the
   engines and the controller within seconds, then exit itself.
3. in-process, Python API on the session pool: ``resume=True`` continues from B's newest complete
   checkpoint to the end. The parameters must equal those of an uninterrupted run of the same
   config, which holds only if both resumes (after the shutdown and after the crash) were exact.

Each kernel's life runs once per module, in a fixture; the tests check its outcome. Processes
the kernels started are recorded by pid and start time, and any still alive at the end are
killed by pid, so a failing test leaves no orphans behind.
"""
import os
import signal
import time

import psutil
import pytest
import torch

from elastic_jupyter import RunConfig, TrainingRun
from elastic_jupyter.engine.state import checkpoint as ckpt
from kernels import BODY, Kernel, describe, process_ident, wait_gone

STEPS = 180
SEED = 5
CKPT_EVERY = 50
STOP_AFTER = 60  # kernel A is shut down once its run passed this step (checkpoint 50 exists)
CRASH_AFTER = 110  # kernel B is killed once its run passed this step (checkpoint 100 exists)
OPTIONS = (f"--name lifecycle --steps {STEPS} --checkpoint-every {CKPT_EVERY} "
           f"--global-batch 64 --seed {SEED}")
POOL_LINE = "%elastic_pool start -n 2 --max 3 --gpus none"

# run in the kernel: wait until the run passed step {step} and its newest complete checkpoint
# (the one latest.json names) is at step {ckpt} or later
WAIT_MID_RUN = '''
import json as _json, os as _os, time as _time
def _latest_step():
    try:
        with open(_os.path.join(run.checkpoint_dir, "latest.json")) as f:
            return _json.load(f)["step"]
    except (OSError, ValueError):
        return -1
_t0 = _time.monotonic()
while run.active and _time.monotonic() - _t0 < 180 and (
        run.step < {step} or _latest_step() < {ckpt}):
    _time.sleep(0.02)
print("@@" + _json.dumps({{"step": run.step, "state": run.state, "latest": _latest_step(),
                          "resumed_from": run.events[0].get("resumed_from")}}))
'''

PIDS = '''
import json as _json, os as _os
_sets = run.pool.engine_sets
print("@@" + _json.dumps({"kernel": _os.getpid(), "engines": [e.pid for e in _sets.engines],
                          "controller": _sets.cluster.controller.pid,
                          "pidfile": _sets.pidfile}))
'''


def config() -> RunConfig:
    """The RunConfig the magic line OPTIONS builds."""
    return RunConfig(name="lifecycle", global_batch=64, steps=STEPS, checkpoint_every=CKPT_EVERY,
                     seed=SEED, collective_timeout=60.0)


# ------------------------------------------------------------------------------ processes


def find_reaper(pidfile: str):
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "elastic_jupyter.pool.reaper" in cmd and cmd[-1:] == [pidfile]:
            return process_ident(p.pid)
    return None


# ------------------------------------------------------------------------------ the kernel


def start_training(kernel: Kernel, resume: bool = False) -> dict:
    """Pool and run of this scenario in `kernel` (OPTIONS, BODY); returns their processes."""
    kernel.execute(f"%load_ext elastic_jupyter\n{POOL_LINE}")
    kernel.execute(f"%%elastic_train {OPTIONS}{' --resume' if resume else ''}\n{BODY}")
    (pids,) = kernel.execute(PIDS)
    pids["reaper"] = find_reaper(pids["pidfile"])
    kernel.descendants()
    return pids


def newest_step(folder: str):
    files = ckpt.list_checkpoints(folder)
    return files[-1]["step"] if files else None


def run_log(folder: str) -> str:
    try:
        with open(os.path.join(folder, "logs", "run.log")) as f:
            return f.read()[-3000:]
    except OSError:
        return "(no run.log)"


# ------------------------------------------------------------------------------ scenarios


@pytest.fixture(scope="module")
def reference(pool, tmp_path_factory):
    """The uninterrupted run of the same config, in-process on the session pool."""
    if pool.run is not None and pool.run.active:
        pool.run.stop()
        pool.run.wait(timeout=60)
    run = TrainingRun(pool, config(), source=BODY, engines=2,
                      workspace=str(tmp_path_factory.mktemp("whole"))).start()
    assert run.wait(timeout=300) == "finished", run.logs()
    return run.state_dict()


def _life(workspace, resume: bool, step: int, ckpt_step: int, crash: bool) -> dict:
    """One kernel: train (or resume) until `step` with a checkpoint at `ckpt_step` or later,
    then shut the kernel down or kill it; returns what happened."""
    folder = str(workspace / "elastic-checkpoints" / "lifecycle")
    latest_before = ckpt.latest_checkpoint(folder)
    kernel = Kernel(workspace)
    try:
        pids = start_training(kernel, resume=resume)
        (seen,) = kernel.execute(WAIT_MID_RUN.format(step=step, ckpt=ckpt_step))
        tree = kernel.descendants()
        t0 = time.monotonic()
        if crash:
            os.kill(kernel.pid, signal.SIGKILL)
        else:
            kernel.km.shutdown_kernel(now=False)
        ours = ([process_ident(p) for p in pids["engines"] + [pids["controller"]]]
                + [pids["reaper"]])
        left_ours = wait_gone([i for i in ours if i is not None], 30)
        gone_s = time.monotonic() - t0
        # an engine's nanny outlives its engine by up to ~3 s (zmq linger of its farewell)
        left_tree = wait_gone(tree, 8)
        return dict(workspace=workspace, folder=folder, pids=pids, seen=seen, tree=tree,
                    gone_s=gone_s, latest_before=latest_before,
                    left_ours=[describe(i) for i in left_ours],
                    left_tree=[describe(i) for i in left_tree],
                    newest_step=newest_step(folder), log=run_log(folder))
    finally:
        kernel.close()


@pytest.fixture(scope="module")
def graceful(tmp_path_factory):
    """Kernel A: a fresh run, shut down gracefully mid-run."""
    return _life(tmp_path_factory.mktemp("lifecycle"), resume=False, step=STOP_AFTER,
                 ckpt_step=CKPT_EVERY, crash=False)


@pytest.fixture(scope="module")
def crashed(graceful):
    """Kernel B, fresh: resumes A's run with the magic, is killed mid-run."""
    return _life(graceful["workspace"], resume=True, step=CRASH_AFTER,
                 ckpt_step=2 * CKPT_EVERY, crash=True)


def _check_life(life: dict, step: int) -> None:
    """The kernel's processes were seen, and it was acted on mid-run."""
    pids = life["pids"]
    assert len(pids["engines"]) == 2 and pids["reaper"] is not None, pids
    assert life["seen"]["state"] == "training" and step <= life["seen"]["step"] < STEPS, \
        (life["seen"], life["log"])
    tree_pids = {pid for pid, _ in life["tree"]}
    assert {*pids["engines"], pids["controller"], pids["reaper"][0]} <= tree_pids


def _assert_equals_reference(state: dict, reference: dict) -> None:
    assert state.keys() == reference.keys()
    for k in reference:
        assert torch.allclose(state[k], reference[k], rtol=1e-7, atol=1e-9), \
            f"{k}: max diff {(state[k] - reference[k]).abs().max().item():.3e}"


# ------------------------------------------------------------------------------ graceful


def test_graceful_shutdown_leaves_no_process(graceful):
    _check_life(graceful, STOP_AFTER)
    assert not graceful["left_ours"], (
        f"engines/controller/reaper alive {graceful['gone_s']:.1f} s after the shutdown: "
        f"{graceful['left_ours']}")
    assert not graceful["left_tree"], f"processes left: {graceful['left_tree']}"
    assert not os.path.exists(graceful["pids"]["pidfile"])


def test_graceful_shutdown_writes_a_final_checkpoint(graceful):
    _check_life(graceful, STOP_AFTER)
    newest, seen = graceful["newest_step"], graceful["seen"]["step"]
    assert newest is not None and newest >= seen, (
        f"newest checkpoint at step {newest}, but the run was at step {seen} before the "
        f"shutdown; run.log:\n{graceful['log']}")
    assert newest < STEPS, "the run finished before the shutdown: nothing was tested"


# ------------------------------------------------------------------------------ resume, crash


def test_resume_in_a_fresh_kernel_continues_from_the_newest_checkpoint(crashed):
    _check_life(crashed, CRASH_AFTER)
    resumed_from = crashed["latest_before"]
    assert resumed_from is not None
    assert crashed["seen"]["resumed_from"] == resumed_from
    resumed_step = int(os.path.basename(resumed_from)[len("step-"):-len(".pt")])
    # it trained on from there and wrote checkpoints of its own
    assert crashed["seen"]["latest"] >= 2 * CKPT_EVERY > resumed_step, crashed["seen"]


def test_crash_reaper_ends_engines_controller_and_itself(crashed):
    _check_life(crashed, CRASH_AFTER)
    assert not crashed["left_ours"], (
        f"alive {crashed['gone_s']:.1f} s after the kernel was killed: {crashed['left_ours']}")
    assert not os.path.exists(crashed["pids"]["pidfile"])


def test_crash_leaves_no_orphan_process(crashed):
    _check_life(crashed, CRASH_AFTER)
    assert not crashed["left_tree"], f"orphans after the kernel was killed: {crashed['left_tree']}"


def test_resume_after_crash_equals_an_uninterrupted_run(crashed, reference, pool):
    latest = ckpt.latest_checkpoint(crashed["folder"])
    assert latest is not None
    if pool.run is not None and pool.run.active:
        pool.run.stop()
        pool.run.wait(timeout=60)
    run = TrainingRun(pool, config(), source=BODY, resume=True, engines=2,
                      workspace=str(crashed["workspace"])).start()
    assert run.wait(timeout=300) == "finished", run.logs()
    start = next(e for e in run.events if e["kind"] == "start")  # after any resume warning
    assert start["resumed_from"] == latest
    assert [r["step"] for r in run.history] == list(range(1, STEPS + 1))
    # equal only if the resume after the shutdown (kernel B) and this one were both exact
    _assert_equals_reference(run.state_dict(), reference)
