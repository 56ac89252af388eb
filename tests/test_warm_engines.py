"""Warm growth: an auto run keeps an engine set up on no slot and binds it to the slot it is
granted (run/warm_engines.py, engine.entrypoints.bind_slot).

On a real arbiter and real pools: the warm engine shows in the pool's status with its memory,
one that dies is replaced, a freed slot is trained on by the warm engine (no engine starts),
and a run at its max or at its end keeps none; none starts while every core is busy. The
engine side's bind is called in this process: a CPU bind moves the run's Worker to the slot;
a GPU bind that CUDA cannot honour is refused and leaves the engine as it was; a sharded run's
warm engine holds none of its rows.
"""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from elastic_jupyter import EnginePool, RunConfig, TrainingRun
from elastic_jupyter.engine import entrypoints
from elastic_jupyter.engine.worker import SetupError
from elastic_jupyter.run.warm_engines import IdleCores, MiB, room_for
from test_arbiter import start_arbiter, stop
from test_workdir import CELL as SMALL_CELL

BODY = '''
import time
import torch
torch.manual_seed(0)
dataset = torch.utils.data.TensorDataset(torch.randn(512, 8), torch.randint(0, 2, (512,)))
model = torch.nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
def loss_fn(model, batch):
    time.sleep(0.02)
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
'''


def wait_for(what, check, timeout=90.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_an_auto_run_grows_into_a_freed_slot_with_its_warm_engine(tmp_path, monkeypatch):
    folder = tmp_path / "arbiter"
    folder.mkdir(mode=0o700)
    arbiter = start_arbiter(str(folder))
    monkeypatch.setenv("ELASTIC_JUPYTER_ARBITER", str(folder))
    holder = EnginePool(n=1, min_size=1, max_size=1, gpus="none").start()  # manual: 1 slot
    pool = EnginePool(min_size=1, max_size=4, gpus="none", auto=True).start()
    try:
        run = TrainingRun(pool, RunConfig(name="warm", steps=100000, global_batch=32,
                                          checkpoint_every=0), source=BODY,
                          workspace=str(tmp_path)).start()
        warm = run._driver.membership.warm
        wait_for("3 ranks and a warm engine", lambda: run.world_size == 3 and warm.ready)
        (first,) = warm.ready
        (shown,) = pool.status()["warm"]
        assert shown["pid"] == first.pid and shown["rss_mib"] > 50, shown
        assert first.pid not in {m.pid for m in run.members} and first.slot is None

        os.kill(first.pid, signal.SIGKILL)  # a warm engine that dies is set up again
        wait_for("another warm engine", lambda: warm.ready and warm.ready[0].pid != first.pid)
        (second,) = warm.ready

        holder.stop()  # its slot is free: the arbiter grants it, the warm engine is bound
        wait_for("4 ranks", lambda: run.world_size == 4)
        member = next(m for m in run.members if m.pid == second.pid)
        assert member.slot is not None and member not in pool.engine_sets.warm
        assert "1 warm engine(s) bound" in run.logs()
        wait_for("none kept at the max", lambda: not pool.engine_sets.warm)
        assert not [e for e in run.events if e["kind"] == "warning"], run.events

        run.stop()
        assert run.wait(60) == "stopped"
        assert pool.status()["warm"] == []
    finally:
        pool.stop()
        holder.stop()
        stop(arbiter)


@pytest.fixture
def engine_state(tmp_path, monkeypatch):
    """This process as a warm engine with a run set up (its slot, threads, environment
    restored afterwards)."""
    monkeypatch.chdir(tmp_path)
    for name in ("ELASTIC_JUPYTER_SLOT", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.setenv(name, "")
    threads = torch.get_num_threads()
    config = RunConfig(name="t", steps=3).as_dict()
    entrypoints.setup_run(config, SMALL_CELL, None, {}, None, str(tmp_path))
    yield entrypoints._state
    entrypoints.drop_run()
    entrypoints._state.slot, entrypoints._state.device = None, "cpu"
    torch.set_num_threads(threads)


def test_a_cpu_bind_moves_the_warm_engines_run_to_its_slot(engine_state):
    assert engine_state.slot is None and engine_state.worker.slot is None
    info = entrypoints.bind_slot(3, None, 1)
    assert info["slot"] == 3 and info["device"] == "cpu"
    assert engine_state.slot == 3 and engine_state.worker.slot == 3  # fault points match it
    assert os.environ["ELASTIC_JUPYTER_SLOT"] == "3" and torch.get_num_threads() == 1


def test_a_sharded_runs_warm_engine_holds_no_rows_until_it_joins(tmp_path, monkeypatch):
    # its trained parameters' storage is freed after the setup's checks; its join sends
    # it its rows (tests/test_sharding.py: a released newcomer resizes as any other)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(entrypoints._state, "warm", True)
    threads = torch.get_num_threads()
    config = RunConfig(name="t", steps=3, shard=True).as_dict()
    try:
        reply = entrypoints.setup_run(config, SMALL_CELL, None, {}, None, str(tmp_path))
        worker = entrypoints._state.worker
        assert reply["parameters"] == 10 and reply["memory"]["need"]  # counted before
        assert all(p.untyped_storage().nbytes() == 0 for p in worker.model.parameters())
        assert not worker.mode.sharded.model.holds_rows
        assert entrypoints.bind_slot(3, None, 1)["slot"] == 3 and not entrypoints._state.warm
    finally:
        entrypoints.drop_run()
        entrypoints._state.slot, entrypoints._state.device = None, "cpu"
        torch.set_num_threads(threads)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA could honour the bind here")
def test_a_gpu_bind_cuda_cannot_honour_is_refused_and_changes_nothing(engine_state):
    worker = engine_state.worker
    with pytest.raises(SetupError, match=r"GPU 0 could not be bound on this warm engine "
                                         r"\(CUDA sees 0 devices\)"):
        entrypoints.bind_slot(0, 0, 1)
    assert engine_state.slot is None and engine_state.worker is worker
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_a_warm_engine_is_kept_only_where_the_host_has_twice_its_memory():
    assert room_for(100 * MiB, 200 * MiB) is None
    why = room_for(100 * MiB, 150 * MiB)
    assert why is not None and "about 100 MiB" in why and "150 MiB are available" in why


def test_a_warm_engine_waits_while_every_core_is_busy():
    idle = IdleCores(window=1.0)
    assert not idle.enough()  # no window measured yet: counted busy
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(psutil.cpu_count())]
    try:
        time.sleep(0.3)
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            busy = idle()
            time.sleep(0.1)
        assert busy < 0.5 and not idle.enough(), busy
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    deadline = time.monotonic() + 1.2  # until the window spans the host idle again
    while time.monotonic() < deadline:
        after = idle()
        time.sleep(0.1)
    assert after > busy, (after, busy)
