"""A pool's life: stopping is quick and complete, no background task fails silently, and an
engine opens no descriptor mid-run when C code first writes to its stderr."""
import os
import subprocess
import sys
import textwrap
import time

import psutil

from elastic_jupyter import EnginePool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A short run that shrinks (the run stops the leaving engine in the background, unawaited), then
# an idle resize and a stop. psutil is made to report every terminated process as gone at its
# status() check: the race of an engine exiting between the liveness check and status().
RACE_SCRIPT = textwrap.dedent('''
    import gc
    import psutil
    from elastic_jupyter import EnginePool, RunConfig, TrainingRun

    real_status, real_terminate = psutil.Process.status, psutil.Process.terminate
    def terminate(self):
        self._terminated = True
        return real_terminate(self)
    def status(self):
        if getattr(self, "_terminated", False):
            raise psutil.NoSuchProcess(self.pid)
        return real_status(self)
    psutil.Process.terminate, psutil.Process.status = terminate, status

    CELL = """
    import torch
    g = torch.Generator().manual_seed(0)
    dataset = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g),
                                             torch.randint(0, 2, (64,), generator=g))
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    def loss_fn(model, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)
    """
    pool = EnginePool(n=2, min_size=1, max_size=3, gpus="none").start()
    run = TrainingRun(pool, RunConfig(name="race", global_batch=8, steps=8, checkpoint_every=0),
                      source=CELL, schedule=[(3, 1)], workspace=WORKSPACE).start()
    print("run", run.wait(timeout=120), flush=True)
    pool.resize(2)
    pool.resize(1)
    pool.stop()
    gc.collect()  # a failed task nobody retrieved is reported when it is collected
    print("done", flush=True)
''')


def test_no_background_task_ends_with_an_unretrieved_exception(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    script = f"WORKSPACE = {str(tmp_path)!r}\n" + RACE_SCRIPT
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert "never retrieved" not in output, output
    assert proc.returncode == 0 and "run finished" in output and "done" in output, output


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_stop_is_quick_and_leaves_no_process_of_the_pool():
    me = psutil.Process()
    before = set(me.children(recursive=True))  # e.g. the session's shared pool
    pool = EnginePool(n=2, min_size=1, max_size=3, gpus="none").start()
    pool.resize(3)
    # controller and schedulers, engines and their nannies, the reaper
    ours = set(me.children(recursive=True)) - before
    assert len(ours) >= 1 + 2 * 3 + 1
    pool.resize(2)  # one engine (and its nanny) stopped before the pool stops
    # one more still stopping
    pool.owner.post(pool.engine_sets.remove, pool.engine_sets.engines[1:])
    t0 = time.monotonic()
    pool.stop()
    took = time.monotonic() - t0
    left = [f"{p.pid} {' '.join(p.cmdline()[1:3])}" for p in ours if _alive(p)]
    assert not left, f"still running after stop: {left}"
    assert took <= 2.0, f"stop took {took:.2f} s"


def _anon_inodes(pid: int) -> int:
    """Its eventfd, epoll and other anon_inode descriptors."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("anon_inode:")
        except OSError:  # closed meanwhile
            pass
    return count


# what torch's c10d does on a store read that timed out: write to fd 2, below Python (then
# ipykernel's thread forwards it)
C_LEVEL_WARNING = "import os, time; os.write(2, b'[W] a warning from C code\\n'); time.sleep(1)"


def test_an_engine_opens_nothing_when_c_code_first_writes_to_stderr(monkeypatch):
    """The soak's check that descriptors stay flat: the first C-level write to stderr must not
    add one (ipykernel's forwarding thread opens its socket when the engine is bound)."""
    monkeypatch.delenv("PYTEST_CURRENT_TEST")  # else ipykernel forwards nothing (pytest's own)
    pool = EnginePool(n=1, gpus="none").start()
    try:
        engine = pool.engine_sets.engines[0]
        before = _anon_inodes(engine.pid)
        pool.engine_sets.client[engine.engine_id].execute(C_LEVEL_WARNING, block=True)
        assert _anon_inodes(engine.pid) == before
    finally:
        pool.stop()
