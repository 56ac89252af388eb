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
import json
import os
import signal
import time

import psutil
import pytest
import torch
from jupyter_client import KernelManager

from elastic_jupyter import RunConfig, TrainingRun
from elastic_jupyter.engine import checkpoint as ckpt

STEPS = 180
SEED = 5
CKPT_EVERY = 50
STOP_AFTER = 60  # kernel A is shut down once its run passed this step (checkpoint 50 exists)
CRASH_AFTER = 110  # kernel B is killed once its run passed this step (checkpoint 100 exists)
OPTIONS = (f"--name lifecycle --steps {STEPS} --checkpoint-every {CKPT_EVERY} "
           f"--global-batch 64 --seed {SEED}")
POOL_LINE = "%elastic_pool start -n 2 --max 3 --gpus none"

# deterministic float64 model; ~10 ms of sleep per forward pass: the run lasts several seconds
BODY = '''
import time
import torch
from sklearn.datasets import load_digits
X, y = load_digits(return_X_y=True)
dataset = torch.utils.data.TensorDataset(torch.tensor(X, dtype=torch.float64) / 16, torch.tensor(y))
model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10)).double()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
def loss_fn(model, batch):
    time.sleep(0.01)
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)
'''

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
print("@@" + _json.dumps({"kernel": _os.getpid(), "engines": [e.pid for e in run.pool.engines],
                          "controller": run.pool.cluster.controller.pid,
                          "pidfile": run.pool._pidfile}))
'''


def config() -> RunConfig:
    """The RunConfig the magic line OPTIONS builds."""
    return RunConfig(name="lifecycle", global_batch=64, steps=STEPS, checkpoint_every=CKPT_EVERY,
                     seed=SEED, collective_timeout=60.0)


# ------------------------------------------------------------------------------ processes


def _ident(pid: int):
    try:
        return (pid, psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def _alive(ident) -> bool:
    pid, started = ident
    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - started) < 0.01 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _describe(ident) -> str:
    try:
        return f"{ident[0]} ({' '.join(psutil.Process(ident[0]).cmdline()[:4])})"
    except psutil.Error:
        return str(ident[0])


def wait_gone(idents, timeout: float) -> list:
    """Poll until none of the processes is alive or `timeout` passes; returns those alive."""
    deadline = time.monotonic() + timeout
    while True:
        left = [i for i in idents if _alive(i)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def kill_leftovers(idents) -> None:
    """SIGKILL, by pid (start time checked), processes a test's kernel started."""
    for ident in idents:
        if _alive(ident):
            try:
                psutil.Process(ident[0]).kill()
            except psutil.Error:
                pass


def find_reaper(pidfile: str):
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "elastic_jupyter.pool.reaper" in cmd and cmd[-1:] == [pidfile]:
            return _ident(p.pid)
    return None


# ------------------------------------------------------------------------------ the kernel


class Kernel:
    """A real Jupyter kernel in `cwd`, with its own Jupyter runtime folder (pid files, registry)
    and `env` added to its environment."""

    def __init__(self, cwd, env: dict | None = None):
        self.cwd = str(cwd)
        self.km = KernelManager(kernel_name="python3")
        self.km.shutdown_wait_time = 60  # generous: the machine may be loaded
        env = dict(os.environ, JUPYTER_RUNTIME_DIR=os.path.join(self.cwd, "runtime"),
                   **(env or {}))
        self.km.start_kernel(cwd=self.cwd, env=env)
        self.pid = self.km.provisioner.process.pid
        self.ident = _ident(self.pid)
        self.seen: set = set()  # every process the kernel started, as far as we looked
        self.kc = self.km.client()
        self.kc.start_channels()
        try:
            self.kc.wait_for_ready(timeout=120)
        except BaseException:
            self.close()
            raise

    def execute(self, code: str, timeout: float = 240) -> list:
        """Run a cell; returns the JSON objects it printed on "@@" lines. Fails on an error."""
        out = []

        def hook(msg):
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                out.append("\n".join(msg["content"]["traceback"]))

        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=hook)
        text = "".join(out)
        assert reply["content"]["status"] == "ok", f"cell failed:\n{code}\n---\n{text}"
        return [json.loads(line[2:]) for line in text.splitlines() if line.startswith("@@")]

    def descendants(self) -> list:
        try:
            found = [_ident(p.pid) for p in psutil.Process(self.pid).children(recursive=True)]
        except psutil.Error:
            found = []
        self.seen.update(i for i in found if i is not None)
        return [i for i in found if i is not None]

    def start_training(self, resume: bool = False) -> dict:
        self.execute(f"%load_ext elastic_jupyter\n{POOL_LINE}")
        self.execute(f"%%elastic_train {OPTIONS}{' --resume' if resume else ''}\n{BODY}")
        (pids,) = self.execute(PIDS)
        pids["reaper"] = find_reaper(pids["pidfile"])
        self.descendants()
        return pids

    def close(self) -> None:
        """Stop the client; kill the kernel if it still runs, then whatever it left."""
        try:
            self.kc.stop_channels()
        except Exception:
            pass
        if _alive(self.ident):
            self.descendants()
        try:
            self.km.shutdown_kernel(now=True)
        except Exception:
            pass
        kill_leftovers(self.seen)  # callers waited for what should end by itself


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
        pids = kernel.start_training(resume=resume)
        (seen,) = kernel.execute(WAIT_MID_RUN.format(step=step, ckpt=ckpt_step))
        tree = kernel.descendants()
        t0 = time.monotonic()
        if crash:
            os.kill(kernel.pid, signal.SIGKILL)
        else:
            kernel.km.shutdown_kernel(now=False)
        ours = [_ident(p) for p in pids["engines"] + [pids["controller"]]] + [pids["reaper"]]
        left_ours = wait_gone([i for i in ours if i is not None], 30)
        gone_s = time.monotonic() - t0
        # an engine's nanny outlives its engine by up to ~3 s (zmq linger of its farewell)
        left_tree = wait_gone(tree, 8)
        return dict(workspace=workspace, folder=folder, pids=pids, seen=seen, tree=tree,
                    gone_s=gone_s, latest_before=latest_before,
                    left_ours=[_describe(i) for i in left_ours],
                    left_tree=[_describe(i) for i in left_tree],
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
