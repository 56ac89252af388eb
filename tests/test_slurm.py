"""Pools of Slurm engine jobs on a real Slurm (tests/slurm_cluster.py: slurmctld, slurmd and
munged of this machine, 3 CPUs, so a third engine job can be made to wait in the queue).

A run grows by submitting a job, which shows as pending while Slurm holds it and joins at a
step boundary once it runs; ``scancel --signal=TERM`` and a preemption by a job of a higher
partition each drain one engine at a step boundary (no lost step, no fault) and a replacement
job is queued. Every run is stopped at the end and its float64 parameters must equal those
of a single-host run of as many steps. An auto pool takes the idle CPUs and makes room for
another user's waiting job. The quick-start notebook runs on a pool of Slurm jobs in a real
kernel, through the magics.
"""
import json
import pathlib
import subprocess
import time

import pytest
import torch

from elastic_jupyter import EnginePool, RunConfig, TrainingRun
from elastic_jupyter.engine.state.checkpoint import list_checkpoints
from elastic_jupyter.pool.launchers import SlurmLauncher
from kernels import BODY as LIFECYCLE_BODY, Kernel
from slurm_cluster import SlurmCluster, available
from test_notebooks import execute

QUICKSTART = pathlib.Path(__file__).parent.parent / "notebooks" / "01_quickstart.ipynb"
BODY = LIFECYCLE_BODY.replace("time.sleep(0.01)", "time.sleep(DELAY)")
assert "DELAY" in BODY
pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))


@pytest.fixture(scope="module")
def slurm():
    with SlurmCluster(cpus=3) as cluster:
        yield cluster


@pytest.fixture
def slurm_pool(slurm):
    pool = EnginePool(n=2, min_size=1, max_size=3, launcher=SlurmLauncher()).start()
    yield pool
    pool.stop()
    wait_for("every engine job to end", lambda: not [
        j for j in slurm.jobs() if j["name"].startswith("ipengine") and j["state"] in (
            "PENDING", "RUNNING")] or slurm.jobs(), timeout=30)


def wait_for(what: str, check, timeout: float = 90.0) -> float:
    t0 = time.monotonic()
    while (seen := check()) is not True:
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout:.0f} s; {seen}"
        time.sleep(0.2)
    return time.monotonic() - t0


def start_run(pool, tmp_path, name: str) -> TrainingRun:
    config = RunConfig(name=name, steps=100_000, global_batch=64, seed=7, checkpoint_every=0)
    return TrainingRun(pool, config, source=BODY, push={"DELAY": 0.01},
                       workspace=str(tmp_path)).start()


def sbatch(*args: str) -> str:
    """Submit a job of someone else's; returns its id."""
    return subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


def events(run, kind: str) -> list[dict]:
    return [e for e in run.events if e["kind"] == kind]


def stop_and_compare(run, pool, tmp_path) -> None:
    """Stop the run; its parameters must be a single-host run's of as many steps."""
    run.stop()
    assert run.wait(timeout=30) == "stopped", run.logs()
    assert not events(run, "fault"), events(run, "fault")
    steps = run.step
    assert [r["step"] for r in run.history] == list(range(1, steps + 1))  # no step lost
    config = RunConfig(name="single-host", steps=steps, global_batch=64, seed=7,
                       checkpoint_every=0)
    fixed = TrainingRun(pool, config, source=BODY, push={"DELAY": 0}, engines=2,
                        workspace=str(tmp_path / "fixed")).start()
    assert fixed.wait(timeout=300) == "finished", fixed.logs()
    for key, value in fixed.state_dict().items():
        got = run.state_dict()[key]
        assert torch.allclose(got, value, rtol=1e-7, atol=1e-9), \
            f"{key}: max diff {(got - value).abs().max().item():.3e}"


def test_a_slurm_pool_grows_through_the_queue_drains_and_learns_what_one_host_learns(
        slurm, slurm_pool, idle_pool, tmp_path):
    pool = slurm_pool
    jobs = {j["id"]: j for j in slurm.jobs("running")}
    assert {e.job_id for e in pool.engine_sets.engines} <= set(jobs), jobs
    assert all(not e.local for e in pool.engine_sets.engines) and pool.backend == "gloo"
    blocker = sbatch("-n", "1", "--wrap", "sleep 600")
    run = start_run(pool, tmp_path, "grow")
    try:
        wait_for("the run to train", lambda: run.step > 20 or run.state)
        run.resize(3)  # Slurm has 3 CPUs, the blocker holds one: the third job waits
        # Slurm's reason is "None" until its scheduler looked at the job
        wait_for("the grow's job pending in the queue", lambda: "pending (Resources)" in str(
            pool.status()["queued"]) or pool.status())
        step = run.step
        time.sleep(2)
        assert run.world_size == 2 and run.step > step  # the run trains on meanwhile
        subprocess.run(["scancel", blocker], check=True)
        wait_for("the job to start and join", lambda: run.world_size == 3 or run.world_size)
        assert not pool.status()["queued"]

        victim = run.members[1]
        job, drained_at = victim.job_id, time.time()
        subprocess.run(["scancel", "--signal=TERM", job], check=True)
        wait_for("the drain", lambda: bool(events(run, "drain")) or run.world_size)
        (drain,) = events(run, "drain")
        assert drain["slot"] == victim.slot and drain["world_size"] == 2, drain
        assert drain["drain_s"] < 2.0 and drain["time"] - drained_at < 3.0, drain
        wait_for("the replacement job to join", lambda: run.world_size == 3 or run.world_size)
        assert job not in {e.job_id for e in pool.engine_sets.engines}
        wait_for("the drained job to end", lambda: job not in {
            j["id"] for j in slurm.jobs("running")} or slurm.jobs())
    finally:
        subprocess.run(["scancel", blocker], check=False)
    stop_and_compare(run, idle_pool, tmp_path)


def test_a_preempted_engine_job_drains_at_a_step_boundary(slurm, slurm_pool, idle_pool,
                                                          tmp_path):
    pool = slurm_pool
    run = start_run(pool, tmp_path, "preempted")
    run.resize(3)
    wait_for("the run at 3 engines, every CPU of Slurm used", lambda: run.world_size == 3 or
             run.world_size)
    urgent = sbatch("-p", "urgent", "-n", "1", "--wrap", "sleep 600")
    try:
        wait_for("a preempted engine to drain", lambda: bool(events(run, "drain")) or
                 slurm.jobs())
        (drain,) = events(run, "drain")
        assert drain["world_size"] == 2 and drain["drain_s"] < 2.0, drain
        # the replacement waits behind the urgent job; the run trains on at 2
        wait_for("the replacement pending", lambda: "pending (Resources)" in str(
            pool.status()["queued"]) or (pool.status(), slurm.jobs()))
        assert run.world_size == 2
        stop_and_compare(run, idle_pool, tmp_path)  # stops at once: never waits for the queue
        assert not [j for j in slurm.jobs("pending") if j["name"].startswith("ipengine")], \
            slurm.jobs()
    finally:
        subprocess.run(["scancel", urgent], check=False)


def test_a_run_whose_every_rank_drained_stops_at_once_while_the_replacement_waits(
        slurm, tmp_path):
    """The only engine is preempted: the run checkpoints, its replacement waits behind the
    urgent job, and a stop then ends the run "stopped" at once (not after the 120 s wait for
    replacements below --min), from that checkpoint, with no job left in the queue."""
    pool = EnginePool(n=1, min_size=1, max_size=1, launcher=SlurmLauncher()).start()
    blocker = sbatch("-p", "urgent", "-n", "2", "--wrap", "sleep 600")  # the 2 other CPUs
    urgent = ""
    try:
        run = start_run(pool, tmp_path, "all-drained")
        wait_for("the run to train", lambda: run.step > 20 or run.state)
        urgent = sbatch("-p", "urgent", "-n", "1", "--wrap", "sleep 600")
        wait_for("the replacement pending", lambda: "pending" in str(
            pool.status()["queued"]) or (run.state, pool.status(), slurm.jobs()))
        (drain,) = events(run, "drain")
        assert run.world_size == 0 or run.state == "resizing", run.state
        t0 = time.monotonic()
        run.stop()
        assert run.wait(timeout=30) == "stopped", run.logs()
        assert time.monotonic() - t0 < 10
        assert list_checkpoints(run.checkpoint_dir)[-1]["step"] == run.step == drain["step"]
        assert not [j for j in slurm.jobs("pending") if j["name"].startswith("ipengine")]
    finally:
        subprocess.run(["scancel", blocker, urgent], check=False)
        pool.stop()


def test_an_auto_slurm_pool_grows_into_an_idle_partition_and_makes_room_for_waiting_jobs(
        slurm, tmp_path):
    """Slurm as the arbiter: a run on an auto pool takes every idle CPU, gives back (down to
    its min, at a step boundary) what another user's waiting job needs, and grows again once
    that job ended."""
    pool = EnginePool(n=1, min_size=1, max_size=3, auto=True, launcher=SlurmLauncher()).start()
    try:
        assert pool.size == 1, pool.status()  # idle, an auto pool holds its min
        run = start_run(pool, tmp_path, "auto")
        wait_for("the run at 3: every idle CPU", lambda: run.world_size == 3 or run.world_size)
        other = sbatch("-c", "2", "--wrap", "sleep 8")
        wait_for("the other job to run", lambda: other in {
            j["id"] for j in slurm.jobs("running")} or (run.world_size, slurm.jobs()))
        assert run.world_size == 1, run.world_size
        gave = [e["message"] for e in events(run, "slot") if "gave back" in e["message"]]
        assert len(gave) == 2 and all(f"job(s) {other} wait" in m for m in gave), gave
        wait_for("the pool grown back after the other job", lambda: run.world_size == 3 or (
            run.world_size, slurm.jobs()), timeout=120)
        assert not events(run, "drain") and not events(run, "fault")
        run.stop()
        assert run.wait(timeout=30) == "stopped", run.logs()
        assert [r["step"] for r in run.history] == list(range(1, run.step + 1))
    finally:
        pool.stop()


def test_the_quick_start_notebook_trains_on_slurm_engine_jobs(slurm, tmp_path):
    """The README's main job, its pool line swapped for a pool of Slurm jobs, in a real kernel:
    its own checks (accuracy, the scheduled 2 -> 3 -> 1) pass."""
    notebook = json.loads(QUICKSTART.read_text())
    cells = ["".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code"]
    start = "%elastic_pool start -n 2 --max 4"
    assert start in cells[0]
    cells[0] = cells[0].replace(start, "%elastic_pool start --launcher slurm -n 2 --max 3")
    kernel = Kernel(tmp_path)
    try:
        for source in cells[:-1]:
            kernel.execute(source)
        (status,) = kernel.execute('import json; s = run.pool.status(); print("@@" + json.dumps('
                                   '{"launcher": s["launcher"], "hosts": [e["host"] for e in '
                                   's["engines"]], "drained": [e for e in run.events if '
                                   'e["kind"] in ("drain", "fault")]}))')
        assert status["launcher"] == "Slurm jobs in the default partition", status
        assert not status["drained"], status
        kernel.execute(cells[-1])  # %elastic_pool stop
    finally:
        kernel.close()
    wait_for("every engine job to end", lambda: not [
        j for j in slurm.jobs() if j["state"] in ("PENDING", "RUNNING")] or slurm.jobs())


def test_the_slurm_notebook_drains_a_preempted_engine_job(slurm, tmp_path):
    """Teaching notebook 6 in a real kernel on this Slurm: its engine jobs train, one is sent
    Slurm's SIGTERM and drains, a replacement job joins; its own last cells assert it."""
    text = execute("06_slurm_cluster.ipynb", tmp_path)
    assert "ipengine" in text  # squeue listed the engine jobs
    assert "the preempted engine drained without a fault" in text
    wait_for("every engine job to end", lambda: not [
        j for j in slurm.jobs() if j["state"] in ("PENDING", "RUNNING")] or slurm.jobs())
