"""A scripted day on a machine of 4 CPU slots: auto mode against fixed allocations, and how soon
a run trains on a slot that was freed.

**The day.** Runs arrive on a fixed schedule (``DAY``: arrival, steps of work, min, max, how it
scales), each in its own pool and process (a user's kernel), all sharing one real arbiter (4
CPU slots, hold 5 s). Each
trains the digits model for its steps; its ``loss_fn`` sleeps 3 ms per sample of its
micro-batch, a pass whose time falls with the world size as a GPU's would, while the machine's
2 cores stay free for the engines' own work. One run scales poorly: its ``after_step`` also
sleeps 0.25 s per step on every rank (input- or communication-bound, so a second slot adds
little). The policies, each day run in turn (``--rounds`` times, interleaved, since one day
decides nothing on a noisy machine), then ``fixed at max`` once:

- ``auto``: every pool in auto mode between its min and max (weighted fair share, weight 1);
- ``auto by value``: the same with the arbiter's ``"by_value": true`` (runs report speeds);
- ``fixed at min``: every run at its min, waiting in the arbiter's queue when that does not fit;
- ``fixed at max``: every run at its max, waiting until all of it is free.

Reported per policy: slot utilisation (slot-seconds of training steps over 4 slots times the
day, first arrival to last finish), mean and maximum completion time (arrival to last step),
mean and maximum waiting time (arrival to the run's first step; it includes starting and
setting up its engines, the same work under every policy).

**A freed slot.** (1) An auto run trains on 3 slots while a manual pool holds the 4th; that
pool stops; the time from its slot's release (its pool's ``stop()`` returned) to the auto
run's first completed step on 4 ranks: with its warm engine (set up on no slot, the default)
and cold (``--warm 0``: an engine start and the cell). (2) With a standby engine: a run at 3 with
``--standby 1`` holds the 4th slot as standby; ``run.resize(4)``: request to the first step
on 4 ranks (the arbiter turns the standby lease into a training lease, no engine starts).

**A lent slot** (the arbiter's default ``lend_s``, 60 s): an auto run trains on 3 slots while
another notebook's auto pool trains on the 4th; that pool's run stops and the pool stays up.
Reported: from the run's stop to the auto run's first step on 4 ranks (lend_s, then a warm
engine's bind), and the lender's next run, from its ``start()`` to its first step (the borrower's step
boundary, an engine start and the cell's setup).

Run: ``python benchmarks/auto_day.py [--only day|latency|lend] [--rounds N]``; figures in
BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time

SLOTS = 4
DAY = [  # name, arrival (s), steps, min, max, scales well
    ("r1", 0, 600, 1, 4, True),
    ("r2", 10, 300, 1, 4, True),
    ("r5", 15, 150, 1, 4, False),
    ("r3", 20, 300, 2, 4, True),
    ("r4", 30, 150, 1, 2, True),
]
CELL = '''
import time
import torch
from sklearn.datasets import load_digits
X, y = load_digits(return_X_y=True)
dataset = torch.utils.data.TensorDataset(torch.tensor(X, dtype=torch.float32) / 16, torch.tensor(y))
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
def loss_fn(model, batch):
    x, y = batch
    time.sleep(0.003 * len(x))
    return torch.nn.functional.cross_entropy(model(x), y)
'''
POORLY = CELL + '''
def after_step(model, optimizer, step):
    time.sleep(0.25)  # the same on every rank, whatever the world size
'''
POLICIES = {
    "auto": lambda lo, hi: dict(n=lo, min_size=lo, max_size=hi, auto=True),
    "auto by value": lambda lo, hi: dict(n=lo, min_size=lo, max_size=hi, auto=True),
    "fixed at min": lambda lo, hi: dict(n=lo, min_size=lo, max_size=lo),
    "fixed at max": lambda lo, hi: dict(n=hi, min_size=hi, max_size=hi),
}


def start_arbiter(folder: str, by_value: bool = False) -> subprocess.Popen:
    settings = os.path.join(folder, "settings.json")
    with open(settings, "w") as f:
        json.dump({"slots": "cpu", "cpu_slots": SLOTS, "hold_s": 5, "by_value": by_value}, f)
    proc = subprocess.Popen([sys.executable, "-m", "elastic_jupyter.arbiter", "--dir", folder,
                             "--config", settings], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    while not os.path.exists(os.path.join(folder, "arbiter.sock")):
        time.sleep(0.05)
    return proc


def arbiter(fn, by_value: bool = False):
    """Run fn() against a fresh arbiter of SLOTS CPU slots; returns what it returns."""
    folder = tempfile.mkdtemp(prefix="auto-day-")
    os.chmod(folder, 0o700)
    os.environ["ELASTIC_JUPYTER_ARBITER"] = folder
    proc = start_arbiter(folder, by_value)
    try:
        return fn(folder)
    finally:
        proc.kill()
        proc.wait()


def one_run(name, arrival, steps, lo, hi, scales, policy, t0, workspace, out) -> None:
    from elastic_jupyter import EnginePool, RunConfig, TrainingRun
    time.sleep(max(0.0, t0 + arrival - time.time()))
    arrived = time.time()
    pool = EnginePool(gpus="none", **POLICIES[policy](lo, hi)).start()
    try:
        run = TrainingRun(pool, RunConfig(name=name, steps=steps, global_batch=64,
                                          checkpoint_every=0),
                          source=CELL if scales else POORLY,
                          workspace=workspace).start()
        assert run.wait(timeout=1800) == "finished", run.logs()
        history = run.history
    finally:
        pool.stop()
    started = next(e["time"] for e in run.events if e["kind"] == "start")
    times = [started] + [r["time"] for r in history]
    slot_s = sum((b - a) * r["world_size"] for a, b, r in zip(times, times[1:], history))
    changes = [r for a, r in zip([{}] + history, history)
               if a.get("world_size") != r["world_size"]]
    out[name] = {"arrived": arrived, "first_step": history[0]["time"],
                 "finished": history[-1]["time"], "slot_s": slot_s,
                 "sizes": sorted({r["world_size"] for r in history}),
                 "changes": [(r["time"], r["world_size"]) for r in changes]}


def kernel(spec, policy, workspace, ready, start, out) -> None:
    """One notebook kernel of the day: a process of its own, as each user's kernel is (with its
    own engines' zygote, pool/zygote.py), that imports the package before the day starts."""
    import torch  # noqa: F401
    from elastic_jupyter import EnginePool, TrainingRun  # noqa: F401
    ready.put(spec[0])
    result: dict = {}
    one_run(*spec, policy, start.get(), workspace, result)
    out.put(result)


def day(policy: str) -> dict:
    def go(folder):
        ctx = multiprocessing.get_context("spawn")
        ready, start, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
        kernels = [ctx.Process(target=kernel, args=(spec, policy, folder, ready, start, out))
                   for spec in DAY]
        for k in kernels:
            k.start()
        for _ in kernels:
            ready.get(timeout=120)
        t0 = time.time() + 1.0
        for _ in kernels:
            start.put(t0)
        runs = {}
        for _ in kernels:
            runs.update(out.get(timeout=1800))
        for k in kernels:
            k.join()
        return runs
    runs = arbiter(go, by_value=policy == "auto by value")
    first = min(r["arrived"] for r in runs.values())
    last = max(r["finished"] for r in runs.values())
    done = [r["finished"] - r["arrived"] for r in runs.values()]
    waits = [r["first_step"] - r["arrived"] for r in runs.values()]
    return {"utilisation": sum(r["slot_s"] for r in runs.values()) / (SLOTS * (last - first)),
            "mean_done": statistics.mean(done), "max_done": max(done),
            "mean_wait": statistics.mean(waits), "max_wait": max(waits), "day": last - first,
            "sizes": {n: r["sizes"] for n, r in sorted(runs.items())},
            "timeline": {n: (r["arrived"] - first, r["finished"] - first,
                             [(round(t - first), w) for t, w in r["changes"]])
                         for n, r in sorted(runs.items())}}


def freed_slot(folder, warm: int) -> float:
    """An auto run grows into the slot a stopped pool released: with `warm` 1, by binding its
    warm engine (set up on no slot) there; with 0, cold (an engine start and the cell)."""
    from elastic_jupyter import EnginePool
    holder = EnginePool(n=1, min_size=1, max_size=1, gpus="none").start()
    pool = EnginePool(n=3, min_size=1, max_size=4, gpus="none", auto=True).start()
    try:
        run = endless_run(pool, "grower", folder, warm=warm)
        wait(lambda: run.world_size == 3 and run.step > 20
             and len(run._driver.membership.warm.ready) == warm)  # set up, ready
        holder.stop()
        freed = time.time()
        first = first_step_at(run, 4, freed)
        run.stop()
        run.wait(60)
        return first - freed
    finally:
        pool.stop()


def standby_grow(folder) -> dict:
    """With a standby engine: the standby lease turns into a training lease."""
    from elastic_jupyter import EnginePool
    pool = EnginePool(n=3, min_size=1, max_size=4, gpus="none", arbiter=True).start()
    try:
        run = endless_run(pool, "standby", folder, standby=1)
        wait(lambda: run.step > 20 and len(run._driver.membership.spares) == 1)  # set up, ready
        asked = time.time()
        run.resize(4)
        first = first_step_at(run, 4, asked)
        run.stop()
        run.wait(60)
        return {"standby": first - asked}
    finally:
        pool.stop()


def lent_slot(folder) -> dict:
    """An idle pool lends its slot to an auto run and gets it back for its next run."""
    from elastic_jupyter import EnginePool
    lender = EnginePool(n=1, min_size=1, max_size=1, gpus="none", auto=True).start()
    pool = EnginePool(n=3, min_size=1, max_size=4, gpus="none", auto=True).start()
    try:
        run = endless_run(pool, "borrower", folder)
        first = endless_run(lender, "lender", folder)
        wait(lambda: run.world_size == 3 and run.step > 20 and first.step > 5)
        first.stop()
        first.wait(60)
        stopped = time.time()
        grown = first_step_at(run, 4, stopped, timeout=240)
        asked = time.time()
        again = endless_run(lender, "lender-again", folder)
        wait(lambda: again.history)
        back = again.history[0]["time"]
        again.stop()
        again.wait(60)
        run.stop()
        run.wait(60)
        return {"lent": grown - stopped, "back": back - asked}
    finally:
        pool.stop()
        lender.stop()


def endless_run(pool, name: str, folder: str, **options):
    """A run of CELL on `pool` that trains until stopped."""
    from elastic_jupyter import RunConfig, TrainingRun
    config = RunConfig(name=name, steps=100000, global_batch=64, checkpoint_every=0, **options)
    return TrainingRun(pool, config, source=CELL, workspace=folder).start()


def first_step_at(run, size: int, since: float, timeout: float = 180.0) -> float:
    """When the run's first step on `size` ranks after wall time `since` ended."""
    def found():
        return next((r["time"] for r in run.history
                     if r["world_size"] == size and r["time"] > since), None)
    wait(lambda: found() is not None, timeout)
    return found()


def wait(condition, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the benchmark is stuck")
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["day", "latency", "lend"], help="one part only")
    parser.add_argument("--rounds", type=int, default=2,
                        help="days of each policy but fixed at max, interleaved (default 2)")
    args = parser.parse_args()
    parts = args.only or "day latency lend"
    if "latency" in parts:
        latency()
    if "lend" in parts:
        lent = arbiter(lent_slot)
        print(f"lent slot (lend_s 60): run stopped -> borrower's first step at 4: "
              f"{lent['lent']:.1f} s; the lender's next run, start() -> first step: "
              f"{lent['back']:.1f} s", flush=True)
    if "day" in parts:
        days(args.rounds)


def latency() -> None:
    figures = {}
    for _ in range(3):
        figures.setdefault("cold (--warm 0)", []).append(
            arbiter(lambda folder: freed_slot(folder, 0)))
        figures.setdefault("warm engine", []).append(arbiter(lambda folder: freed_slot(folder, 1)))
        figures.setdefault("standby", []).append(arbiter(standby_grow)["standby"])
    for kind, values in figures.items():
        print(f"freed slot -> training ({kind}): median {statistics.median(values):.2f} s, "
              f"runs {', '.join(f'{v:.2f}' for v in values)}", flush=True)


def days(rounds: int) -> None:
    order = [p for _ in range(rounds) for p in POLICIES if p != "fixed at max"]
    print(f"A scripted day on {SLOTS} CPU slots: {DAY}")
    print(f"{'policy':<15}{'utilisation':>12}{'mean done':>11}{'max done':>10}"
          f"{'mean wait':>11}{'max wait':>10}{'day':>8}  sizes", flush=True)
    timeline = []
    for policy in order + ["fixed at max"]:
        r = day(policy)
        print(f"{policy:<15}{r['utilisation']:>11.0%}{r['mean_done']:>10.1f}s"
              f"{r['max_done']:>9.1f}s{r['mean_wait']:>10.1f}s{r['max_wait']:>9.1f}s"
              f"{r['day']:>7.0f}s  {r['sizes']}", flush=True)
        timeline.append((policy, r["timeline"]))
    print("Timelines (s from the first arrival: arrival, last step, [(time, world size)]):")
    for policy, runs in timeline:
        print(f"  {policy}: " + "; ".join(f"{n} {a:.0f}-{f:.0f} {c}" for n, (a, f, c)
                                          in runs.items()))


if __name__ == "__main__":
    main()
