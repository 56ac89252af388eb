"""The full fault matrix: SIGKILL an engine in every phase, many times, and check the result.

For each phase (forward, backward, allreduce, vote, optimizer, checkpoint, resize, join) one run on a pool
of 3 engines takes KILLS kills, each landing in that phase: the run's ``fault_dir`` arms the
phase's fault point (engine.faultpoints) on one engine, which writes a marker and holds
there until this script SIGKILLs it. Between kills the run recovers and a replacement joins. The
"resize" and "join" kills arm the point and then request a shrink, so they land while the next
generation forms: "join" before the engine joined its process group (its peers wait for it in
the rendezvous until the owner's abort), "resize" just after. Before each kill the run must be
back at full size (after a slot's cooldown, if repeated faults left one out).
After the last kill the run is stopped (at step N, with a checkpoint), and its parameters
are compared with those of a fault-free run of N steps on the same pool (float64, allclose
rtol 1e-7, atol 1e-9). Printed per phase: kills, recoveries, median seconds from the kill until the
run was back at the step it had reached, median steps lost, and whether the result matched.

With ``--shard`` the runs are sharded (FSDP2 per layer, partner replicas every REPLICA_EVERY
steps) and the phases are the sharded mode's: forward, backward, reduce_scatter (as a gradient
lands in the backward that reduce-scatters), vote, optimizer, refresh (the partner replicas'
exchange) and handover (a shrink's hand-over of rows; armed, then a shrink requested). The
survivors go back to their replicas' step, so a kill loses up to REPLICA_EVERY steps (the
rollback events say how many; a fault event's own count says 0-1).

    .venv/bin/python benchmarks/fault_matrix.py [--kills 20] [--shard]
"""
from __future__ import annotations

import argparse
import glob
import os
import signal
import statistics
import sys
import tempfile
import time

import torch

from elastic_jupyter import EnginePool, RunConfig, TrainingRun

CELL = '''
import time
import torch
PACE = 0.004  # seconds a step sleeps, so that kills land at a step rate like a real model's
from sklearn.datasets import load_digits
X, y = load_digits(return_X_y=True)
dataset = torch.utils.data.TensorDataset(torch.tensor(X, dtype=torch.float64) / 16, torch.tensor(y))
model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10)).double()
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
def loss_fn(model, batch):
    time.sleep(PACE)
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)
'''
# The fault-free reference: the sleep only paces the steps, so N steps of it give the same result.
UNPACED = CELL.replace("PACE = 0.004", "PACE = 0")
PHASES = ("forward", "backward", "allreduce", "vote", "optimizer", "checkpoint", "resize", "join")
SHARDED_PHASES = ("forward", "backward", "reduce_scatter", "vote", "optimizer", "refresh",
                  "handover")
FORMING = ("resize", "join", "handover")  # kills that land as a generation ends in a shrink
REPLICA_EVERY = 5
SIZE = 3
STEPS = 10**7  # a run is stopped after its last kill


def config(name: str, workspace: str, steps: int, shard: bool = False) -> RunConfig:
    fault_dir = os.path.join(workspace, "faults")
    os.makedirs(fault_dir, exist_ok=True)
    # one standby engine: the lost rank is replaced at once, the standby in the background
    return RunConfig(name=name, global_batch=64, steps=steps, checkpoint_every=25,
                     collective_timeout=5, seed=3, fault_dir=fault_dir,
                     standby=1, shard=shard, replica_every=REPLICA_EVERY)


def wait_for(predicate, timeout: float = 120.0, what: str = ""):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"fault matrix stuck waiting for {what}")
        time.sleep(0.01)


def kill_once(run, phase: str, kills_so_far: int) -> tuple[float, int]:
    """One kill landing in `phase`; returns (seconds until back at the step reached, steps
    lost)."""
    start, began = run.step, time.monotonic()
    wait_for(lambda: (run.world_size == SIZE and run.state == "training" and run.step > start + 20)
             or not run.active, what="the run to be back at full size")
    victim = run.members[0 if phase == "checkpoint" else 1]
    with open(os.path.join(run.config.fault_dir, f"arm.{phase}"), "w") as f:
        f.write(str(victim.slot))
    if phase in FORMING:
        run.resize(SIZE - 1)  # the next generation forms with the armed engine in it
    pattern = os.path.join(run.config.fault_dir, f"hit.{phase}.{victim.slot}.*")
    wait_for(lambda: glob.glob(pattern), what=f"{pattern} ({os.listdir(run.config.fault_dir)}, "
             f"{run.summary()}, members {[e.slot for e in run.members]})")
    marker = glob.glob(pattern)[0]
    waited = time.monotonic() - began
    seen = len(run.events)
    os.kill(int(open(marker).read()), signal.SIGKILL)
    killed = time.monotonic()
    os.rename(marker, os.path.join(os.path.dirname(marker), f"done{kills_so_far}." +
                                   os.path.basename(marker)))
    faults = lambda: [e for e in run.events if e["kind"] == "fault"]  # noqa: E731
    wait_for(lambda: len(faults()) > kills_so_far or not run.active)
    fault = faults()[kills_so_far]
    # a sharded run goes back to its replicas' step (or a checkpoint): back there first
    back = lambda: [e for e in run.events[seen:]  # noqa: E731
                    if e["kind"] in ("rollback", "fallback")]
    wait_for(lambda: back() or not run.config.shard or not run.active)
    wait_for(lambda: run.step >= fault["step"] or not run.active)
    recovered = time.monotonic() - killed
    lost = fault["step"] - min(e["step"] for e in back()) if back() else fault["lost_steps"]
    if phase in FORMING:
        run.resize(SIZE)
    print(f"  {phase} kill {kills_so_far + 1}: {waited:.1f} s until armed and hit, recovered in "
          f"{recovered:.2f} s, {lost} steps lost", file=sys.stderr, flush=True)
    return recovered, lost


def matrix_row(pool, phase: str, kills: int, workspace: str, shard: bool) -> dict:
    run = TrainingRun(pool, config(phase, workspace, STEPS, shard), source=CELL, engines=SIZE,
                      workspace=workspace).start()
    costs, lost = [], []
    for k in range(kills):
        if not run.active:
            break
        cost, steps_lost = kill_once(run, phase, k)
        costs.append(cost)
        lost.append(steps_lost)
    run.stop()
    run.wait(timeout=600)
    got, expected = run.state_dict(), reference(pool, workspace, phase, run.step, shard)
    same = all(torch.allclose(got[k], expected[k], rtol=1e-7, atol=1e-9) for k in expected)
    return {"phase": phase, "kills": len(costs), "state": run.state, "steps": run.step,
            "recoveries": sum(e["kind"] == "fault" for e in run.events),
            "left_out": sum(e["kind"] == "slot" and "left out" in e["message"]
                            for e in run.events),
            "cost": statistics.median(costs or [0]), "max_cost": max(costs or [0]),
            "lost": statistics.median(lost or [0]), "max_lost": max(lost or [0]), "same": same}


def reference(pool, workspace: str, phase: str, steps: int, shard: bool) -> dict:
    run = TrainingRun(pool, config(f"clean-{phase}", workspace, steps, shard), source=UNPACED,
                      engines=SIZE, workspace=workspace).start()
    assert run.wait(timeout=600) == "finished", run.logs()
    return run.state_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20, help="kills per phase (default 20)")
    parser.add_argument("--phases", help="comma-separated (default: every phase of the mode)")
    parser.add_argument("--shard", action="store_true", help="sharded runs, the sharded phases")
    args = parser.parse_args()
    phases = args.phases or ",".join(SHARDED_PHASES if args.shard else PHASES)
    t0 = time.perf_counter()
    pool = EnginePool(n=SIZE, max_size=SIZE + 1, gpus="none").start()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as workspace:
            for phase in phases.split(","):
                row = matrix_row(pool, phase, args.kills, workspace, args.shard)
                rows.append(row)
                print(row, flush=True)
    finally:
        pool.stop()
    print("\nphase       kills  recoveries  recovery s (median/max)  steps lost (median/max)  "
          "slots left out  steps  same result")
    for r in rows:
        print(f"{r['phase']:<11} {r['kills']:>5}  {r['recoveries']:>10}  "
              f"{r['cost']:>10.2f} / {r['max_cost']:<5.2f}        {r['lost']:>6.0f} / "
              f"{r['max_lost']:<4}            {r['left_out']:>14}  {r['steps']:>5}  {r['same']}")
    passed = all(r["kills"] == r["recoveries"] == args.kills and r["same"]
                 and r["state"] == "stopped" for r in rows)
    print("PASS" if passed else "FAIL")
    print(f"total {time.perf_counter() - t0:.0f} s")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
