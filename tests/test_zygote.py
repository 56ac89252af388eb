"""Engines forked from the kernel's zygote (pool/zygote.py, pool/launchers/local.py).

On a real pool: a forked engine is the process a new one would be (its own session, its slot's
environment and thread count, its own numpy random state), and the pool ends it and the zygote
when it stops; after a run, engines start with the run's installed imports loaded but not the
notebook's own modules; a zygote that is gone costs nothing but speed (the next engine is a new
process); an engine started in its pool's folder after a ``chdir``, or after the kernel's
environment changed, is what a new one would be; ``ELASTIC_JUPYTER_FORK_ENGINES=0`` starts every
engine as a new process, even beside another pool's zygote. A zygote whose preload started a
thread refuses to fork from then on.
"""
import os
import time

import psutil

from elastic_jupyter import EnginePool, RunConfig, TrainingRun
from elastic_jupyter.pool import zygote
from test_workdir import CELL as SMALL_CELL

CELL = "import xml.dom.minidom\nimport notebook_helper\n" + SMALL_CELL  # stdlib, notebook


# evaluated on an engine (a builtin and a string: nothing of this module needs importing there)
STATE = """dict(pid=__import__("os").getpid(), sid=__import__("os").getsid(0),
ppid=__import__("os").getppid(), cwd=__import__("os").getcwd(),
slot=__import__("os").environ["ELASTIC_JUPYTER_SLOT"],
late=__import__("os").environ.get("ZYGOTE_TEST_LATE"),
threads=__import__("torch").get_num_threads(),
draw=float(__import__("numpy").random.rand()),
modules=[m for m in ("xml.dom.minidom", "notebook_helper") if m in __import__("sys").modules])"""


def test_forked_engines_are_new_processes_in_all_but_their_imports(tmp_path, monkeypatch):
    (tmp_path / "notebook_helper.py").write_text("VALUE = 1\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    pool = EnginePool(n=2, min_size=1, max_size=4, gpus="none")
    pool.config.threads_per_engine = 2  # not the default here (1): the zygote must be its own
    pool.start()
    try:
        z, client = pool.launcher.zygote, pool.engine_sets.client
        states = client[:].apply_sync(eval, STATE)
        assert sorted(s["slot"] for s in states) == ["0", "1"]
        for s in states:
            assert s["ppid"] == z._proc.pid and s["sid"] == s["pid"] and s["threads"] == 2
        assert states[0]["draw"] != states[1]["draw"]
        run = TrainingRun(pool, RunConfig(name="imports", steps=4, global_batch=8,
                                          checkpoint_every=0), source=CELL,
                          workspace=str(tmp_path)).start()
        assert run.wait(timeout=120) == "finished"
        deadline = time.monotonic() + 30
        while not z.wait_ready(0.1) and time.monotonic() < deadline:  # the preload
            time.sleep(0.1)
        monkeypatch.chdir(tmp_path / "elsewhere")
        pool.resize(3)  # forked after the run: its installed imports loaded
        third = client[pool.engine_sets.engines[-1].engine_id].apply_sync(eval, STATE)
        assert third["ppid"] == z._proc.pid and third["modules"] == ["xml.dom.minidom"]
        monkeypatch.setenv("ZYGOTE_TEST_LATE", "1")  # set after the zygote started
        pool.resize(4)
        fourth = client[pool.engine_sets.engines[-1].engine_id].apply_sync(eval, STATE)
        renewed = pool.launcher.zygote  # one started in the kernel's environment of now
        assert renewed is not z and z._proc.poll() is not None  # the old one released
        assert fourth["ppid"] == renewed._proc.pid and fourth["late"] == "1"
        monkeypatch.setenv(zygote.OFF, "0")  # new processes from now on, to compare with
        pool.resize(3)
        pool.resize(4)
        fifth = client[pool.engine_sets.engines[-1].engine_id].apply_sync(eval, STATE)
        assert third["cwd"] == fifth["cwd"]  # the folder ipyparallel starts engines in
        engine_pids = [e.pid for e in pool.engine_sets.engines]
        zygote_pid = z._proc.pid
    finally:
        pool.stop()
    assert pool.launcher.zygote is None
    assert not [p for p in engine_pids + [zygote_pid] if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_without_a_zygote_the_next_engine_is_a_new_process(monkeypatch, caplog):
    pool = EnginePool(n=1, min_size=1, max_size=2, gpus="none")
    pool.config.threads_per_engine = 3  # a zygote of its own: other pools may share the default
    pool.start()
    other = None
    try:
        z = pool.launcher.zygote
        monkeypatch.setenv(zygote.OFF, "0")  # another pool, the same thread count, no zygote
        other = EnginePool(n=1, gpus="none")
        other.config.threads_per_engine = 3
        other.start()
        assert other.launcher.zygote is None and z.wait_ready()  # while the first one's serves
        assert psutil.Process(other.engine_sets.engines[0].pid).ppid() == os.getpid()
        monkeypatch.delenv(zygote.OFF)  # the first pool's environment again
        assert psutil.Process(pool.engine_sets.engines[0].pid).ppid() == z._proc.pid
        os.kill(z._proc.pid, 9)
        z._proc.wait()
        pool.resize(2)
        assert psutil.Process(pool.engine_sets.engines[1].pid).ppid() == os.getpid()
        assert "engines start as new processes from now on" in caplog.text
        assert pool.engine_sets.client[:].apply_sync(eval, "1") == [1, 1]
    finally:
        pool.stop()
        if other is not None:
            other.stop()


def test_a_zygote_whose_imports_start_a_thread_forks_no_more(tmp_path, caplog):
    installed = tmp_path / "site-packages"  # counts as installed code (engine.workdir)
    installed.mkdir()
    (installed / "starts_a_thread.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    path = os.pathsep.join(p for p in (str(installed), os.environ.get("PYTHONPATH")) if p)
    z = zygote.Zygote(dict(os.environ, PYTHONPATH=path), threads=2)  # BLAS pools would start
    try:
        assert z.wait_ready(60)
        fork = {"argv": ["--help"], "env": dict(os.environ), "cwd": str(tmp_path),
                "output": str(tmp_path / "out")}
        assert z._request(fork)["pid"] > 0  # its atfork handlers ran: the baseline moved
        z.preload(["json", "starts_a_thread"])
        deadline = time.monotonic() + 60
        while "refuses to fork" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "importing the run's modules started 1 thread(s)" in caplog.text
        assert z.fork(**fork) is None
        assert z._request(fork)["pid"] is None  # the zygote itself refuses, too
        assert z._proc.poll() is None  # and goes on reaping the engines it forked
    finally:
        z.close()


def test_pyarrow_loaded_by_a_runs_imports_leaves_the_zygote_forking(tmp_path, caplog):
    """pandas and datasets import pyarrow, whose jemalloc would start a thread: the zygote
    starts it without one, and goes on forking."""
    z = zygote.Zygote(dict(os.environ), threads=1)
    try:
        assert z.wait_ready(60)
        z.preload(["pyarrow"])
        fork = {"argv": ["--help"], "env": dict(os.environ), "cwd": str(tmp_path),
                "output": str(tmp_path / "out")}
        assert z._request(fork)["pid"] > 0  # the preload's reply came before this one
        assert "refuses to fork" not in caplog.text
    finally:
        z.close()
