"""Fault recovery cost of an elastic run against torchrun's restart, on the quick-start model.

Workload: the quick-start cell of benchmarks/resize_and_throughput.py (digits,
Linear(64,128)-ReLU-Linear(128,10), Adam, global batch 64) with a ``loss_fn`` that sleeps
SLEEP_S per call (SLOW_LOSS), so that a step takes a realistic ~10 ms and a run lasts long
enough to inject faults into. World size 2, gloo on loopback, one thread per process. Both
sides write a disk checkpoint every K = CHECKPOINT_EVERY steps and use the collective timeout
T = COLLECTIVE_TIMEOUT (5 s, shorter than the library's 30 s default so a hang costs seconds).

Faults are injected from outside, once the run has trained SETTLE_STEPS steps at world size 2,
at a chosen step: fault i of n lands at a random step within the i-th n-th of a checkpoint
interval (stratified sampling), so that a handful of faults covers the interval evenly and the
steps a checkpoint restart loses (on average K/2) are not left to the luck of 3 draws. Ours is
watched through the owner's view of the run, which lags rank 0 by ~0.2 s, so its faults land
10-30 steps after the chosen step, at a random point within a step:

* crash: SIGKILL of rank 1's process (ours: ``run.members[1].pid``, an ipyparallel engine;
  torchrun: the rank-1 worker);
* hang: SIGSTOP of the same process. Ours detects it through the collective timeout T (the
  survivor's all-reduce fails; the owner waits the library's HANG_GRACE for the silent rank)
  or ipyparallel's heartbeat (the controller runs with --ping=500: 10 missed pings), whichever
  comes first; torchrun only through T, after which its agent stops the group (SIGTERM, which
  a stopped process does not act on, then SIGKILL after its fixed 30 s close timeout) and
  restarts it.

Recovery cost = wall time from the signal until the run is back at the furthest step it had
reached at the fault (the first step >= that step trained by the re-formed group; when no step
was lost, the group's first step): detection, re-forming the group and recomputing the lost
steps. Steps lost = furthest step reached minus
the step training resumed from. Ours: both from the run's ``fault`` event (``step``,
``lost_steps``; the survivor keeps its state, since a step is applied only after every rank
voted, loses at most the step in flight, and goes on at world size 1) and the per-step time
stamps in ``run.history``,
read after the run ended, when the history is complete; the lost engine is replaced in the
background and joins later (reported as "replacement joined"). torchrun
(``--nproc_per_node 2 --max-restarts 3``, benchmarks/torchrun_restart_worker.py): the whole
group restarts and resumes from the newest disk checkpoint; both figures come from the step log
rank 0 appends to. torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see
launch_torchrun): with its default, restarted groups failed to connect.

Phases run one after the other, never side by side, so they do not compete for the cores:
ours crash (one run, CRASHES kills), torchrun crash (one launch, TORCHRUN_CRASHES kills), ours
hang (a fresh pool and run: the library leaves a slot out after 3 faults, which would otherwise
shrink the pool), torchrun hang. Before starting, the script waits (up to 10 minutes) until the
1-minute load average is below LOAD_THRESHOLD, because other jobs share this machine.

Run with ``.venv/bin/python benchmarks/fault_recovery.py``; figures are recorded in
BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from resize_and_throughput import GLOBAL_BATCH, QUICKSTART_CELL, SEED, print_table, spread, \
    wait_until

CHECKPOINT_EVERY = 100  # K: disk checkpoints, both sides
COLLECTIVE_TIMEOUT = 5.0  # T, both sides (seconds)
SLEEP_S = 0.005  # per loss_fn call: ~10 ms steps at world size 2
CRASHES, HANGS = 5, 3  # ours
TORCHRUN_CRASHES, TORCHRUN_HANGS = 3, 1  # each a separate launch with --max-restarts 3
SETTLE_STEPS = 30  # steps at world size 2 before the next fault
RECOVERY_TIMEOUT = 120.0  # s; past this a side is reported as "did not recover"
LOAD_THRESHOLD, LOAD_WAIT = 1.5, 600.0

# Appended to the cell (and applied to the torchrun worker's loss_fn): stands in for the
# compute of a bigger model, so steps are ~10 ms rather than ~1 ms.
SLOW_LOSS = f'''
import time as _time
_plain_loss_fn = loss_fn

def loss_fn(model, batch):
    _time.sleep({SLEEP_S})
    return _plain_loss_fn(model, batch)
'''
CELL = QUICKSTART_CELL + SLOW_LOSS
HERE = os.path.dirname(os.path.abspath(__file__))


def load1() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def wait_for_quiet_machine() -> float:
    """Wait until the 1-minute load average drops below LOAD_THRESHOLD (or LOAD_WAIT passes);
    returns the load seen when starting."""
    deadline = time.monotonic() + LOAD_WAIT
    while load1() >= LOAD_THRESHOLD and time.monotonic() < deadline:
        print(f"load average {load1():.2f} >= {LOAD_THRESHOLD}: waiting...", flush=True)
        time.sleep(15)
    return load1()


def fault_offsets(n: int, rng: random.Random) -> list[int]:
    """For n faults, the step after a checkpoint at which each lands: one random step in each
    n-th of the checkpoint interval, in random order."""
    offsets = [int((i + rng.random()) * CHECKPOINT_EVERY / n) for i in range(n)]
    rng.shuffle(offsets)
    return offsets


def wait_for_fault_step(current_step, offset: int) -> None:
    """Wait until `current_step()` is `offset` steps past the next checkpoint step."""
    target = (current_step() // CHECKPOINT_EVERY + 1) * CHECKPOINT_EVERY + offset
    wait_until(lambda: current_step() >= target, f"step {target}", timeout=RECOVERY_TIMEOUT,
               poll=0.01)


def hard_kill(pid: int) -> None:
    """SIGKILL a process this benchmark stopped or started, if it is still there."""
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


# ---------------------------------------------------------------- ours: one run per phase

def elastic_phase(sig: int, repeats: int, rng: random.Random) -> list[dict]:
    """A fresh pool and run; `repeats` faults of rank 1 with `sig`; one result per fault."""
    from elastic_jupyter import EnginePool, RunConfig, TrainingRun
    pool = EnginePool(n=2, max_size=3, gpus="none").start()
    try:
        with tempfile.TemporaryDirectory() as workspace:
            config = RunConfig(name="faults", global_batch=GLOBAL_BATCH, steps=10**6, seed=SEED,
                               checkpoint_every=CHECKPOINT_EVERY,
                               collective_timeout=COLLECTIVE_TIMEOUT)
            run = TrainingRun(pool, config, source=CELL, workspace=workspace).start()
            injected = []
            try:
                settle_elastic(run, since=0.0)
                for offset in fault_offsets(repeats, rng):
                    wait_for_fault_step(lambda: run.step, offset)
                    injected.append(inject_elastic(run, sig))
                    wait_recovered_elastic(run, injected[-1], len(injected))
                    # the replacement joined: the next fault hits a full group again
                    settle_elastic(run, since=injected[-1]["time"])
            except Exception:
                print_failure(run, pool)
                raise
            finally:
                for fault in injected:
                    hard_kill(fault["pid"])  # a stopped engine the run did not end itself
                run.stop()
                run.wait(timeout=RECOVERY_TIMEOUT)
            if run.error:
                raise RuntimeError(run.error)
            return analyse_elastic(run, injected)
    finally:
        pool.stop()


def settle_elastic(run, since: float) -> None:
    """Wait until the run trained SETTLE_STEPS steps at world size 2, all after time `since`
    (the last fault: the owner sees new steps ~0.2 s late, so older records must not count)."""
    def settled():
        records = run.history[-SETTLE_STEPS:]
        return len(records) == SETTLE_STEPS and records[0]["time"] > since and \
            all(r["world_size"] == 2 for r in records)
    wait_until(settled, "training at world size 2", timeout=RECOVERY_TIMEOUT)


def inject_elastic(run, sig: int) -> dict:
    engine = run.members[1]
    fault = {"signal": sig, "pid": engine.pid, "slot": engine.slot, "step_seen": run.step}
    fault["time"] = time.time()
    os.kill(engine.pid, sig)
    return fault


def wait_recovered_elastic(run, fault: dict, faults_so_far: int) -> None:
    """Wait for the run's fault event and for a step >= the step reached, trained after the
    fault."""
    def fault_events():
        return [e for e in run.events if e["kind"] == "fault"]
    wait_until(lambda: len(fault_events()) >= faults_so_far, "fault handled",
               timeout=RECOVERY_TIMEOUT)
    reached = fault_events()[faults_so_far - 1]["step"]

    def back():
        newest = run.history[-1]
        return newest["step"] >= reached and newest["time"] > fault["time"]
    wait_until(back, f"back at step {reached}", timeout=RECOVERY_TIMEOUT)


def print_failure(run, pool) -> None:
    """What the run and the pool looked like when the benchmark gave up (to stderr)."""
    lines = [f"benchmark failed: {run.summary()}", f"pool engines: {pool.status()['engines']}",
             "last events:"] + [f"  {event}" for event in run.events[-8:]]
    print("\n".join(lines) + "\n" + run.logs(tail=20), file=sys.stderr, flush=True)


def analyse_elastic(run, injected: list[dict]) -> list[dict]:
    """Per fault: recovery cost, steps lost and how it was detected, from the ended run."""
    events = [e for e in run.events if e["kind"] == "fault"]
    if len(events) != len(injected):  # e.g. a replacement that failed too: shown, not hidden
        raise RuntimeError(f"{len(injected)} faults injected, {len(events)} fault events: "
                           f"{events}")
    history = run.history
    step_time = {r["step"]: r["time"] for r in history}
    # the first step of each return to 2 ranks, i.e. a replacement's first step
    joins = [step_time[e["step"]] for e in run.events if e["kind"] == "resized" and e["to"] == 2]
    results = []
    for fault, event in zip(injected, events):
        back = first_record_at(history, event["step"], event["time"])
        joined = next((t for t in joins if t > fault["time"]), None)
        results.append({
            "recovery_s": back["time"] - fault["time"],
            "lost_steps": event["lost_steps"],
            "handled_s": event["time"] - fault["time"],  # detection and roll-back done
            "joined_s": joined - fault["time"] if joined else None,
            # hung: still running HANG_GRACE after its peer's collective failed; dead: reported
            # by ipyparallel (its nanny on a crash, its heartbeat on a stopped process)
            "how": "hung" if event["hung_slots"] else "dead",
            "reached": event["step"], "resumed": event["rolled_back_to"],
            "step_seen": fault["step_seen"], "slot": fault["slot"],
            # training speed while one rank waits for its replacement, against before the fault
            "steps_per_s_w1": steps_per_s([r for r in history if r["world_size"] == 1 and
                                           event["time"] < r["time"] < (joined or 0)]),
            "steps_per_s_w2": steps_per_s([r for r in history if r["world_size"] == 2 and
                                           r["step"] <= event["rolled_back_to"]][-50:]),
        })
    return results


def steps_per_s(records: list[dict]) -> float | None:
    if len(records) < 2:
        return None
    return (len(records) - 1) / (records[-1]["time"] - records[0]["time"])


def first_record_at(history: list[dict], step: int, after: float) -> dict:
    """The first record at `step` or later stamped after `after`, the fault event (so trained
    by the re-formed group: rank 0 may finish the step in flight just after the signal).
    A record of exactly `step` when steps were lost and recomputed; the next step when none
    were."""
    return next(r for r in history if r["step"] >= step and r["time"] > after)


# ---------------------------------------------------------------- torchrun: one launch per phase

class StepLog:
    """Incremental reader of the worker's ``kind step time restart`` lines, indexed by (kind,
    restart) so that polling it stays cheap while the file grows."""

    def __init__(self, path: str):
        self.path, self.offset = path, 0
        self.lines: dict[tuple[str, int], list[tuple[int, float]]] = {}

    def of(self, kind: str, restart: int) -> list[tuple[int, float]]:
        """(step, time) of every `kind` line of restart `restart` written so far."""
        if os.path.exists(self.path):
            with open(self.path) as f:
                f.seek(self.offset)
                chunk = f.read()
            complete = chunk[:chunk.rfind("\n") + 1]  # a line still being written waits
            self.offset += len(complete)
            for line in complete.splitlines():
                kind_, step, when, restart_ = line.split()
                key = (kind_, int(restart_))
                self.lines.setdefault(key, []).append((int(step), float(when)))
        return self.lines.get((kind, restart), [])

    def step(self, restart: int) -> int:
        steps = self.of("step", restart)
        return steps[-1][0] if steps else -1


def launch_torchrun(folder: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])),
               # By default the workers share torchrun's rendezvous store across restarts, and
               # restarted groups failed with "connectFullMesh failed ... Connection refused"
               # (a stale address of the previous group: pytorch/pytorch#135712). The issue's
               # workaround: a store of their own for each restart.
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", "2", "--max-restarts", "3",
           os.path.join(HERE, "torchrun_restart_worker.py"), "--dir", folder,
           "--checkpoint-every", str(CHECKPOINT_EVERY), "--timeout", str(COLLECTIVE_TIMEOUT)]
    with open(os.path.join(folder, "torchrun.out"), "w") as output:
        # its own session: the whole launch (agent and workers) can be ended by its group id
        return subprocess.Popen(cmd, env=env, stdout=output, stderr=subprocess.STDOUT,
                                start_new_session=True)


def end_torchrun(proc: subprocess.Popen) -> None:
    """SIGTERM the agent (it ends its workers), SIGKILL the launch's group if that hangs."""
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers, e.g. a worker we stopped
    except OSError:
        pass
    proc.wait()


def torchrun_phase(sig: int, repeats: int, rng: random.Random) -> list[dict]:
    """One torchrun launch; `repeats` faults of the rank-1 worker with `sig`."""
    with tempfile.TemporaryDirectory() as folder:
        proc = launch_torchrun(folder)
        log = StepLog(os.path.join(folder, "steps.log"))
        results = []
        try:
            for restart, offset in enumerate(fault_offsets(repeats, rng)):
                settle_torchrun(log, proc, restart)
                wait_for_fault_step(lambda: log.step(restart), offset)
                fault = inject_torchrun(folder, restart, sig)
                results.append(wait_recovered_torchrun(log, proc, restart, fault))
                if results[-1]["recovery_s"] is None:
                    break  # it did not come back: nothing left to inject into
        except Exception:
            print(tail(os.path.join(folder, "torchrun.out")), file=sys.stderr)
            raise
        finally:
            end_torchrun(proc)
        return results


def tail(path: str, lines: int = 30) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def settle_torchrun(log: StepLog, proc, restart: int) -> None:
    """Wait until restart `restart` trained SETTLE_STEPS steps."""
    def settled():
        if proc.poll() is not None:
            raise RuntimeError(f"torchrun exited ({proc.returncode}) before the fault")
        resumed = log.of("resume", restart)
        return resumed and log.step(restart) >= resumed[0][0] + SETTLE_STEPS
    wait_until(settled, f"torchrun restart {restart} training", timeout=RECOVERY_TIMEOUT)


def inject_torchrun(folder: str, restart: int, sig: int) -> dict:
    with open(os.path.join(folder, "pid.1")) as f:
        pid, written_by = map(int, f.read().split())
    if written_by != restart:
        raise RuntimeError(f"pid.1 is from restart {written_by}, expected {restart}")
    fault = {"signal": sig, "pid": pid, "time": time.time()}
    os.kill(pid, sig)
    return fault


def wait_recovered_torchrun(log: StepLog, proc, restart: int, fault: dict) -> dict:
    """Wait until the next restart is back at the step reached before the fault (or
    RECOVERY_TIMEOUT passes); returns the fault's figures (recovery_s None if it never did)."""
    new = restart + 1

    def back():
        if proc.poll() is not None:
            return "exited"
        # once the new group logs, the old one is gone: its last step is the step reached
        return bool(log.of("resume", new)) and log.step(new) >= log.step(restart)
    try:
        outcome = wait_until(back, f"torchrun restart {new} back", timeout=RECOVERY_TIMEOUT)
    except TimeoutError:
        outcome = "timed out"
    reached = log.step(restart)
    if outcome is not True:
        hard_kill(fault["pid"])
        return {"recovery_s": None, "lost_steps": None, "reached": reached, "note": outcome}
    (_, started), (resumed, resumed_at) = log.of("start", new)[0], log.of("resume", new)[0]
    back_at = next(t for s, t in log.of("step", new) if s >= reached and t > fault["time"])
    return {"recovery_s": back_at - fault["time"], "lost_steps": reached - resumed,
            "restarted_s": started - fault["time"],  # detected, old group torn down
            "resumed_s": resumed_at - fault["time"],  # new group formed, checkpoint loaded
            "reached": reached, "resumed": resumed}


# ---------------------------------------------------------------- report

def med(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def show(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def figure_row(label: str, ours: list, theirs: list, digits: int) -> tuple[str, ...]:
    """Medians, ranges and counts of both sides (None: a fault it did not recover from)."""
    def columns(values):
        done = [v for v in values if v is not None]
        runs = f"n={len(values)}" + (f", {len(values) - len(done)} not back" if
                                     len(done) < len(values) else "")
        return show(med(done), digits), spread(done, digits) if done else "-", runs
    a, b = med(ours), med(theirs)
    ratio = f"{b / a:.1f}" if a and b is not None else "-"
    return (label, *columns(ours), *columns(theirs), ratio)


def table_rows(results: dict) -> list[tuple[str, ...]]:
    rows = [("figure", "ours", "range", "runs", "torchrun", "range", "runs", "torchrun/ours")]
    for kind in ("crash", "hang"):
        ours, theirs = results[f"ours_{kind}"], results[f"torchrun_{kind}"]
        rows.append(figure_row(f"{kind}: recovery cost (s)", [r["recovery_s"] for r in ours],
                               [r["recovery_s"] for r in theirs], 2))
        rows.append(figure_row(f"{kind}: steps lost", [r["lost_steps"] for r in ours],
                               [r["lost_steps"] for r in theirs], 0))
    return rows


def print_details(results: dict) -> None:
    """Every fault's figures, so noise and outliers are visible."""
    for key, rows in results.items():
        print(f"{key}:")
        for r in rows:
            print("  " + "  ".join(f"{k}={show(v, 3) if isinstance(v, float) else v}"
                                   for k, v in r.items()))


# ---------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-wait", action="store_true",
                        help="start even if the machine is busy")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault moments")
    args = parser.parse_args()
    import torch
    load_before = load1() if args.no_wait else wait_for_quiet_machine()
    t0 = time.perf_counter()
    print(f"quick-start model + {SLEEP_S * 1000:.0f} ms sleep per loss_fn call, global batch "
          f"{GLOBAL_BATCH}, world size 2, K={CHECKPOINT_EVERY}, T={COLLECTIVE_TIMEOUT:.0f} s, "
          f"{os.cpu_count()} CPU cores, torch {torch.__version__}; load average "
          f"{load_before:.2f} at start", flush=True)
    rng = random.Random(args.seed)
    phases = [("ours_crash", elastic_phase, signal.SIGKILL, CRASHES),
              ("torchrun_crash", torchrun_phase, signal.SIGKILL, TORCHRUN_CRASHES),
              ("ours_hang", elastic_phase, signal.SIGSTOP, HANGS),
              ("torchrun_hang", torchrun_phase, signal.SIGSTOP, TORCHRUN_HANGS)]
    results, loads = {}, []
    for key, phase, sig, repeats in phases:
        started = time.perf_counter()
        print(f"{key}: {repeats} x {signal.Signals(sig).name}...", flush=True)
        results[key] = phase(sig, repeats, rng)
        loads.append(load1())
        print(f"  {time.perf_counter() - started:.0f} s, load average {loads[-1]:.2f}",
              flush=True)
    print()
    print_details(results)
    print()
    print_table(table_rows(results))
    print(f"\nload average: {load_before:.2f} at start, {' / '.join(f'{x:.2f}' for x in loads)} "
          f"after each phase; total benchmark time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
