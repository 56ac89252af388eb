"""A pool of Slurm engine jobs on a real one-machine Slurm (tests/slurm_cluster.py, 4 CPUs):
how long a drain takes and what it costs against a hard kill, and how long a grow takes from
the engine job's start.

Workload: the float64 digits model of tests/kernels.py with SLEEP_S of sleep per
pass (a step takes ~10-20 ms on 2 cores), global batch 64, 2 engine jobs (gloo on loopback).

* drain: ``scancel --signal=TERM`` on rank 1's job, ROUNDS times. Drain time = the signal (as
  the engine received it) to the rank gone from the run (its ``drain`` event), and from the
  ``scancel`` call to that event; steps lost = steps trained twice (0 unless a rollback
  happened: every step's record is checked once in the history). After each drain the run
  waits until the replacement job joined.
* crash, side by side in the same run: SIGKILL of rank 1's engine process (an OOM kill, a
  segfault; Slurm itself never kills without a SIGTERM first: even ``scancel --signal=KILL``
  gave the engine its drain here): from the signal to the first step of the re-formed group,
  and the steps lost (the ``fault`` event).
* grow: ``run.resize(3)`` submits a job; latency from the job's start (Slurm's StartTime,
  1 s resolution) and from the request to the first step at 3, with the engine's registration
  in between; then back to 2.
* auto mode (``--auto-rounds``), on a pool of its own after the others: Slurm as the arbiter
  (elastic_jupyter/arbiter/slurm.py). The pool (min 1, max 4) holds the 4 idle CPUs; another
  user's job asking for 2 arrives: its submission to the run at 2 and to its start; it runs
  10 s; its end to the run's first step at 4 again.

The phases run one after the other: grows, drains, crashes (a slot with 3 faults within a
minute is left out for a cooldown, faults.MAX_SLOT_FAULTS: the crashes come last, with a
spare slot).

Run with ``.venv/bin/python benchmarks/slurm_drain.py`` (as root, with Debian's slurm-wlm and
munge installed: ``make test`` installs them); figures are recorded in BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from slurm_cluster import SlurmCluster  # noqa: E402
from kernels import BODY  # noqa: E402

from elastic_jupyter import EnginePool, RunConfig, TrainingRun  # noqa: E402
from elastic_jupyter.pool.launchers import SlurmLauncher  # noqa: E402

SLEEP_S = 0.005


def wait_for(check, timeout=120.0, what="condition"):
    """Poll `check` until it returns something truthy; returns that."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return value


def signal_rank1(run, pool, signal: str, kind: str) -> dict:
    """TERM: ``scancel --signal=TERM`` on rank 1's job; KILL: SIGKILL of its engine process.
    Returns the event of `kind` it caused, with the time of the signal."""
    seen = len([e for e in run.events if e["kind"] == kind])
    victim = run.members[1]
    sent = time.time()
    if signal == "KILL":
        os.kill(victim.pid, 9)  # the one-machine Slurm runs it here
    else:
        subprocess.run(["scancel", f"--signal={signal}", victim.job_id], check=True)
    wait_for(lambda: len([e for e in run.events if e["kind"] == kind]) > seen, what=kind)
    event = [e for e in run.events if e["kind"] == kind][-1]
    return dict(event, sent=sent)


def first_step_after(run, t: float, world_size: int) -> float:
    wait_for(lambda: any(r["time"] > t and r["world_size"] == world_size for r in run.history),
             what=f"a step at world size {world_size}")
    return min(r["time"] for r in run.history if r["time"] > t and r["world_size"] == world_size)


def slurm_time(job: str, which: str) -> float:
    """`job`'s StartTime or EndTime (Slurm's, 1 s resolution); 0 until it started / ended."""
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True,
                         check=True).stdout
    state = out.split("JobState=")[1].split()[0]
    if state == "PENDING" or (which == "EndTime" and state == "RUNNING"):
        return 0.0
    return datetime.datetime.fromisoformat(out.split(f"{which}=")[1].split()[0]).timestamp()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="drains and kills each (5)")
    parser.add_argument("--auto-rounds", type=int, default=3,
                        help="auto mode: another job's arrivals and ends (3)")
    args = parser.parse_args()
    with SlurmCluster(cpus=4):
        if args.rounds:
            report(*drains_kills_grows(args.rounds))
        if args.auto_rounds:
            report_auto(auto_rounds(args.auto_rounds))


def drains_kills_grows(rounds: int) -> tuple[list, list, list]:
    drains, kills, grows = [], [], []
    with training("slurm-bench", n=2, min_size=1, max_size=4) as (pool, run):
        wait_for(lambda: run.step > 50, what="training")
        for _ in range(rounds):
            known = {e.job_id for e in pool.engine_sets.engines}
            asked = time.time()
            run.resize(3)
            wait_for(lambda: run.world_size == 3, what="the grow")
            new = ({e.job_id for e in pool.engine_sets.engines} - known).pop()
            started = slurm_time(new, "StartTime")
            at3 = first_step_after(run, asked, 3)
            ready = max(e.started for e in pool.engine_sets.engines)
            grows.append({"from_job_start": at3 - started, "from_request": at3 - asked,
                          "registered_after_request": ready - asked})
            run.resize(2)
            wait_for(lambda: run.world_size == 2 and pool.size == 2, what="the shrink")
        for signal, kind, into in (("TERM", "drain", drains), ("KILL", "fault", kills)):
            for _ in range(rounds):
                event = signal_rank1(run, pool, signal, kind)
                back = first_step_after(run, event["sent"], 1)
                into.append({"to_gone": event["time"] - event["sent"],
                             "engine_s": event.get("drain_s"),
                             "to_training": back - event["sent"],
                             "lost": event.get("lost_steps", 0)})
                wait_for(lambda: run.world_size == 2, what="the replacement")
    return drains, kills, grows


def auto_rounds(rounds: int) -> list[dict]:
    """An auto pool (min 1, max 4) on the idle 4 CPUs; another user's job asking for 2 CPUs
    arrives (its submission to its start, and to the run at 2), runs 10 s, ends (its end to
    the run back at 4)."""
    rows = []
    with training("slurm-auto", n=1, min_size=1, max_size=4, auto=True) as (pool, run):
        for _ in range(rounds):
            wait_for(lambda: run.world_size == 4, what="the pool at 4")
            asked = time.time()
            job = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", "-c", "2",
                                  "--wrap", "sleep 10"], capture_output=True, text=True,
                                 check=True).stdout.strip()
            wait_for(lambda: run.world_size == 2, what="the give-back")
            gave = time.time()
            started = wait_for(lambda: slurm_time(job, "StartTime"), what="its start")
            ended = wait_for(lambda: slurm_time(job, "EndTime"), timeout=60, what="its end")
            wait_for(lambda: run.world_size == 4, what="the pool back at 4")
            rows.append({"to_gave": gave - asked, "to_other_start": started - asked,
                         "to_back": first_step_after(run, ended, 4) - ended})
    return rows


@contextlib.contextmanager
def training(name: str, **pool_options):
    """A pool of Slurm engine jobs and a run of the workload on it, stopped at the end, when
    no step may be missing or repeated."""
    pool = EnginePool(launcher=SlurmLauncher(), **pool_options).start()
    config = RunConfig(name=name, steps=10_000_000, global_batch=64, seed=7,
                       checkpoint_every=0, collective_timeout=5)
    run = TrainingRun(pool, config, source=BODY.replace("time.sleep(0.01)",
                                                         f"time.sleep({SLEEP_S})"),
                      workspace=tempfile.mkdtemp()).start()
    try:
        yield pool, run
        steps = [r["step"] for r in run.history]
        assert steps == list(range(1, len(steps) + 1)), "a step is missing or repeated"
    finally:
        run.stop()
        run.wait(timeout=120)
        pool.stop()


def report(drains, kills, grows) -> None:
    def med(rows, key):
        return statistics.median(r[key] for r in rows)

    print(f"rounds: {len(drains)} drains, {len(kills)} crashes, {len(grows)} grows")
    print("| | signal to rank gone (s) | signal to training again (s) | steps lost |")
    print("|---|---|---|---|")
    print(f"| drain (SIGTERM) | {med(drains, 'to_gone'):.3f} (engine: "
          f"{med(drains, 'engine_s'):.3f}) | {med(drains, 'to_training'):.3f} | "
          f"{max(r['lost'] for r in drains)} |")
    print(f"| crash (SIGKILL) | {med(kills, 'to_gone'):.3f} | "
          f"{med(kills, 'to_training'):.3f} | {statistics.median(r['lost'] for r in kills):g} "
          f"(max {max(r['lost'] for r in kills)}) |")
    print(f"| ratio crash / drain | | {med(kills, 'to_training') / med(drains, 'to_training'):.1f}"
          " | |")
    print(f"grow (median): job start -> first step at 3: {med(grows, 'from_job_start'):.2f} s "
          f"(Slurm's start time has 1 s resolution); request -> first step at 3: "
          f"{med(grows, 'from_request'):.2f} s; request -> engine registered: "
          f"{med(grows, 'registered_after_request'):.2f} s")


def report_auto(rows: list[dict]) -> None:
    def med(key):
        return statistics.median(r[key] for r in rows)

    print(f"auto mode, {len(rows)} rounds (median): another job submitted -> the pool gave 2 "
          f"engines back: {med('to_gave'):.2f} s; -> that job started: "
          f"{med('to_other_start'):.2f} s (Slurm's start time, 1 s resolution); its end -> "
          f"first step at 4 again: {med('to_back'):.2f} s")


if __name__ == "__main__":
    main()
