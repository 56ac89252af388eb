"""Engines forked from the kernel's zygote (pool/zygote.py, pool/launchers/local.py).

On a real pool: a forked engine is the process a new one would be (its own session, its slot's
environment and thread count, its own numpy random state), and the pool ends it and the zygote
when it stops; after a run, engines start with the run's installed imports loaded but not the
notebook's own modules; a zygote that is gone costs nothing but speed (the next engine is a new
process); ``ELASTIC_JUPYTER_FORK_ENGINES=0`` starts every engine as a new process. In a process
of its own: the zygote refuses to fork once an import started a thread.
"""
import os
import subprocess
import sys
import textwrap
import time

import psutil

from elastic_jupyter import EnginePool, RunConfig, TrainingRun
from elastic_jupyter.pool import zygote

CELL = '''
import xml.dom.minidom
import notebook_helper
import torch
dataset = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
def loss_fn(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
'''


# evaluated on an engine (a builtin and a string: nothing of this module needs importing there)
STATE = """dict(pid=__import__("os").getpid(), sid=__import__("os").getsid(0),
slot=__import__("os").environ["ELASTIC_JUPYTER_SLOT"],
threads=__import__("torch").get_num_threads(),
draw=float(__import__("numpy").random.rand()),
modules=[m for m in ("xml.dom.minidom", "notebook_helper") if m in __import__("sys").modules])"""


def _forked(pid):
    return "elastic_jupyter.pool.zygote" in " ".join(psutil.Process(pid).cmdline())


def test_forked_engines_are_new_processes_in_all_but_their_imports(tmp_path, monkeypatch):
    (tmp_path / "notebook_helper.py").write_text("VALUE = 1\n")
    monkeypatch.chdir(tmp_path)
    pool = EnginePool(n=2, min_size=1, max_size=3, gpus="none")
    pool.config.threads_per_engine = 2  # not the default here (1): the zygote must be its own
    pool.start()
    try:
        z = zygote.running(2)
        assert z is not None
        states = pool.client[:].apply_sync(eval, STATE)
        assert sorted(s["slot"] for s in states) == ["0", "1"]
        for s in states:
            assert s["sid"] == s["pid"] and s["threads"] == 2 and _forked(s["pid"])
        assert states[0]["draw"] != states[1]["draw"]
        run = TrainingRun(pool, RunConfig(name="imports", steps=4, global_batch=8,
                                          checkpoint_every=0), source=CELL,
                          workspace=str(tmp_path)).start()
        assert run.wait(timeout=120) == "finished"
        deadline = time.monotonic() + 30
        while not z.wait_ready(0.1) and time.monotonic() < deadline:  # the preload
            time.sleep(0.1)
        pool.resize(3)  # forked after the run: the run's installed imports are loaded
        third = pool.client[pool.engines[-1].engine_id].apply_sync(eval, STATE)
        assert _forked(third["pid"]) and third["modules"] == ["xml.dom.minidom"]
        engine_pids = [e.pid for e in pool.engines]
        zygote_pid = z._proc.pid
    finally:
        pool.stop()
    assert zygote.running(2) is None
    assert not [p for p in engine_pids + [zygote_pid] if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_without_a_zygote_the_next_engine_is_a_new_process(monkeypatch, caplog):
    pool = EnginePool(n=1, min_size=1, max_size=2, gpus="none")
    pool.config.threads_per_engine = 3  # a zygote of its own: other pools may share the default
    pool.start()
    try:
        z = zygote.running(3)
        os.kill(z._proc.pid, 9)
        z._proc.wait()
        pool.resize(2)
        pids = [e.pid for e in pool.engines]
        assert _forked(pids[0]) and not _forked(pids[1])
        assert "engines start as new processes from now on" in caplog.text
        assert pool.client[:].apply_sync(eval, "1") == [1, 1]
    finally:
        pool.stop()
    assert zygote.running(3) is None  # its pool stopped
    monkeypatch.setenv(zygote.OFF, "0")
    pool = EnginePool(n=1, gpus="none")
    pool.config.threads_per_engine = 3
    pool.start()
    try:
        assert zygote.running(3) is None
        assert not _forked(pool.engines[0].pid)
    finally:
        pool.stop()


def test_a_zygote_whose_imports_started_a_thread_forks_no_more():
    script = textwrap.dedent("""
        import threading, time
        from elastic_jupyter.pool import zygote
        baseline = zygote._threads()
        print(zygote._preload(["json"], baseline))
        threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
        print(zygote._preload([], baseline))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split("\n")
    assert out[0] == "None"
    assert out[1] == "importing the run's modules started 1 thread(s)"
