"""Resize latency and steady-state throughput of an elastic run, on the quick-start model.

The model is the quick-start notebook's: scikit-learn digits (the 75 % training split),
Linear(64, 128) - ReLU - Linear(128, 10), Adam lr 1e-3, cross-entropy, global batch 64.
``loss_fn`` computes the loss and nothing else (no artificial sleep). Engines and torchrun
processes use gloo and one thread each. One invocation measures:

1. Engine start: ``pool.resize`` of an idle pool from 2 to 3 engines (new process, torch
   imported, engine registered); shrunk back to 2 between repeats.
2. Resize latency in one run that keeps training: ``run.resize(3)`` from 2 ranks, then
   ``run.resize(2)`` from 3, repeated. Latency is request to the first completed step at the
   new size, reported twice: the run's own ``resized`` event (``latency_s``), and recomputed
   from the complete ``run.history`` after the run ended (first step after the ``resize``
   event's step). A grow starts its engine while the others train, so it is judged against
   engine start + 1 s. We split a grow into request -> new engine registered (engine start
   while two ranks keep both cores busy), -> membership change (the cell's setup on the new
   engine, store connection, the old group leaving at a step boundary), -> first step (new
   group formed, state broadcast, one step); and time ``run.start()`` on the two idle engines,
   which runs the same cell setup a new engine runs before it can join.
3. Throughput at world size 2 (samples/s), over windows of whole epochs (an epoch ends with a
   short batch, 1347 = 21 * 64 + 3, so whole epochs make both sides count the same samples),
   each after one warm-up epoch: for the elastic run, from the per-step time stamps in
   ``run.history``, once in the first generation and once after the last shrink; for
   ``torchrun --nproc_per_node 2`` + DistributedDataParallel (benchmarks/ddp_baseline.py), in
   one launch before the engine pool exists and one after it stopped, so the two never compete
   for the cores. This machine's speed drifts by tens of percent within a minute, so each side
   gives several windows and the table compares medians.

Run with ``make benchmark``; the figures are recorded in BENCHMARKS.md.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

GLOBAL_BATCH = 64
SEED = 0
REPEATS = 3  # grows, shrinks and idle engine starts, each
CHUNKS = 5  # throughput windows per measurement phase
CHUNK_EPOCHS = 10  # epochs per window (220 steps)
SETTLE_STEPS = 20  # steps trained at each size before the next resize request
TIMEOUT = 120.0  # seconds to wait for anything before declaring the benchmark stuck

# The quick-start notebook's training cell without its evaluation set: it runs on every engine
# and, through ddp_baseline.py, in every torchrun process.
QUICKSTART_CELL = '''
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

X, y = load_digits(return_X_y=True)
X_train, _, y_train, _ = train_test_split(X, y, test_size=0.25, random_state=0, stratify=y)
dataset = torch.utils.data.TensorDataset(torch.tensor(X_train, dtype=torch.float32) / 16,
                                         torch.tensor(y_train))
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)
'''
TRAIN_SAMPLES = 1347  # len(dataset) above; checked against the DDP baseline's
STEPS_PER_EPOCH = math.ceil(TRAIN_SAMPLES / GLOBAL_BATCH)  # 22; the run never resumes, so
# step k (1-based) ends an epoch exactly when k % STEPS_PER_EPOCH == 0


def wait_until(predicate, what: str, timeout: float = TIMEOUT, poll: float = 0.05):
    """Poll `predicate` until it returns something truthy; returns that value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"benchmark stuck: {what} did not happen within {timeout:.0f} s")


# ---------------------------------------------------------------- DDP baseline

def ddp_throughputs() -> list[float]:
    """One torchrun launch of ddp_baseline.py with 2 processes; samples/s of each window."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(here, "ddp_baseline.py"), "--skip-epochs", "1",
           "--chunks", str(CHUNKS), "--chunk-epochs", str(CHUNK_EPOCHS)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    printed = [line for line in out.stdout.splitlines() if line.startswith("{")]
    # a gloo process sometimes aborts at interpreter teardown, after its work is done
    # ("terminate called without an active exception": tests/worlds.py); its result stands
    torn_down = printed and "terminate called without an active exception" in out.stderr
    if out.returncode != 0 and not torn_down:
        raise RuntimeError(f"DDP baseline failed:\n{out.stdout}\n{out.stderr}")
    result = json.loads(printed[-1])
    if (result["dataset"], result["steps_per_epoch"]) != (TRAIN_SAMPLES, STEPS_PER_EPOCH):
        raise RuntimeError(f"DDP baseline trained on other data: {result}")
    return result["samples_per_s"]


# ---------------------------------------------------------------- engine start

def engine_start_times(pool) -> list[float]:
    """Seconds for an idle pool to grow from 2 to 3 engines, once per repeat."""
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        pool.resize(3)
        times.append(time.perf_counter() - t0)
        pool.resize(2)  # returns once the engine is gone, so repeats do not overlap
    return times


# ---------------------------------------------------------------- the elastic run

def start_run(pool, workspace: str, standby: int = 0):
    from elastic_jupyter import RunConfig, TrainingRun
    # far more steps than needed: the run is stopped once everything is measured
    config = RunConfig(name=f"benchmark-{standby}", global_batch=GLOBAL_BATCH, steps=10**6,
                       checkpoint_every=0, seed=SEED, standby=standby)
    return TrainingRun(pool, config, source=QUICKSTART_CELL, workspace=workspace).start()


def throughput_window(after_step: int) -> tuple[int, int]:
    """(first, last) step of the throughput windows: from the first epoch boundary at least
    one warm-up epoch after `after_step`, CHUNKS * CHUNK_EPOCHS epochs."""
    first = math.ceil((after_step + STEPS_PER_EPOCH) / STEPS_PER_EPOCH) * STEPS_PER_EPOCH
    return first, first + CHUNKS * CHUNK_EPOCHS * STEPS_PER_EPOCH


def train_through(run, step: int) -> None:
    wait_until(lambda: run.step >= step, f"step {step}")


def request_resize(run, pool, n: int) -> tuple[float, float]:
    """Request size `n` mid-training and wait until the run reports it; returns the request's
    wall time and when the newest engine registered. Then trains a while at `n`, and lets a
    removed engine exit, before returning."""
    done = sum(e["kind"] == "resized" for e in run.events)
    requested = time.time()
    run.resize(n)
    event = wait_until(lambda: [e for e in run.events if e["kind"] == "resized"][done:],
                       f"resize to {n}")[0]
    if event["to"] != n:
        raise RuntimeError(f"expected a resize to {n}, got {event}")
    train_through(run, event["step"] + SETTLE_STEPS)
    wait_until(lambda: len(pool.engine_sets.client.ids) == pool.size, "the removed engine to exit")
    return requested, max(e.started for e in pool.engine_sets.engines)


def elastic_phase(pool, run) -> dict:
    """Throughput window, then grow/shrink cycles, then a second throughput window.

    Returns the raw material (request times, windows); everything is computed from the run's
    events and history once it has ended, when the history is complete.
    """
    windows = [throughput_window(0)]
    train_through(run, windows[0][1])
    requests = []
    for _ in range(REPEATS):
        requests.append(request_resize(run, pool, 3))
        requests.append(request_resize(run, pool, 2))
    windows.append(throughput_window(run.step))
    train_through(run, windows[1][1])
    return {"requests": requests, "windows": windows}


def run_elastic() -> dict:
    """Engine start, resizes and throughput, all on one pool and one run."""
    from elastic_jupyter import EnginePool
    pool = EnginePool(n=2, min_size=2, max_size=3, gpus="none").start()
    try:
        engine_start = engine_start_times(pool)
        with tempfile.TemporaryDirectory() as workspace:
            t0 = time.perf_counter()
            run = start_run(pool, workspace)  # the cell's setup on 2 fresh, idle engines
            run_start = time.perf_counter() - t0
            try:
                raw = elastic_phase(pool, run)
            except Exception:
                print_run_state(run, pool)
                raise
            finally:
                run.stop()
                run.wait(timeout=TIMEOUT)
            if run.error:
                raise RuntimeError(run.error)
            standby = standby_grows(pool, workspace)
        return {"engine_start": engine_start, "run_start": run_start, "standby_grow": standby,
                "threads": pool.config.threads_per_engine,
                **analyse_run(run, raw["requests"], raw["windows"])}
    finally:
        pool.stop()


def standby_grows(pool, workspace: str) -> list[float]:
    """Grow latencies 2->3 with one standby engine set up outside the group (--standby 1):
    after each shrink the engine that left stays set up, so no grow waits for a start."""
    run = start_run(pool, workspace, standby=1)
    try:
        wait_until(lambda: pool.size == 3, "the standby engine to start")
        train_through(run, run.step + SETTLE_STEPS)
        for _ in range(REPEATS):
            request_resize(run, pool, 3)
            request_resize(run, pool, 2)
    finally:
        run.stop()
        run.wait(timeout=TIMEOUT)
    return [e["latency_s"] for e in run.events
            if e["kind"] == "resized" and e["to"] > e["from"]]


def print_run_state(run, pool) -> None:
    """What the run and the pool looked like when the benchmark gave up (to stderr)."""
    lines = [f"benchmark failed: {run.summary()}", f"pool engines: {pool.status()['engines']}",
             f"registered engine ids: {pool.engine_sets.client.ids}", "last events:"]
    lines += [f"  {event}" for event in run.events[-6:]]
    print("\n".join(lines) + "\n" + run.logs(tail=20), file=sys.stderr, flush=True)


def analyse_run(run, requests: list[tuple[float, float]], windows: list[tuple[int, int]]) -> dict:
    """Latencies and throughputs from the ended run's events and complete history."""
    records = {r["step"]: r for r in run.history}
    resizes = [e for e in run.events if e["kind"] == "resize"]
    reported = [e["latency_s"] for e in run.events if e["kind"] == "resized"]
    if len(resizes) != len(requests) or len(reported) != len(requests):
        raise RuntimeError(f"expected {len(requests)} resizes, events: {run.events}")
    latencies = {"grow": [], "shrink": [], "grow_boot": [], "grow_setup": [], "grow_switch": []}
    for event, (requested, registered), latency_s in zip(resizes, requests, reported):
        first = records[event["step"] + 1]  # the first step at the new size
        if first["world_size"] != event["to"]:
            raise RuntimeError(f"step {first['step']} ran at {first['world_size']} ranks, "
                               f"not {event['to']}")
        kind = "grow" if event["to"] > event["from"] else "shrink"
        latencies[kind].append((latency_s, first["time"] - requested))
        if kind == "grow":  # where the time goes: engine start, cell setup, new group
            latencies["grow_boot"].append(registered - requested)
            latencies["grow_setup"].append(event["time"] - registered)
            latencies["grow_switch"].append(first["time"] - event["time"])
    return {"latencies": latencies,
            "samples_per_s": [x for w in windows for x in window_throughputs(records, *w)]}


def window_throughputs(records: dict, first: int, last: int) -> list[float]:
    """Samples/s of each CHUNK_EPOCHS-epoch window between steps `first` and `last`, from the
    steps' end time stamps (step `first` ends as the window's first step begins)."""
    if any(records[s]["world_size"] != 2 for s in range(first + 1, last + 1)):
        raise RuntimeError(f"steps {first + 1}..{last} were not all trained at world size 2")
    chunk = CHUNK_EPOCHS * STEPS_PER_EPOCH
    return [CHUNK_EPOCHS * TRAIN_SAMPLES / (records[s + chunk]["time"] - records[s]["time"])
            for s in range(first, last, chunk)]


# ---------------------------------------------------------------- report

def spread(values: list[float], digits: int) -> str:
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}"


def table_rows(ddp: list[float], ours: dict) -> list[tuple[str, ...]]:
    med = statistics.median
    engine = med(ours["engine_start"])
    lat = ours["latencies"]
    grow_rep, grow_hist = [a for a, _ in lat["grow"]], [b for _, b in lat["grow"]]
    shrink_rep, shrink_hist = [a for a, _ in lat["shrink"]], [b for _, b in lat["shrink"]]
    ratio = med(ours["samples_per_s"]) / med(ddp)
    n_lat, n_tp = f"n={REPEATS}", f"n={len(ddp)}"
    return [
        ("figure", "median", "range", "runs", "target"),
        ("engine start, idle pool 2->3 (s)", f"{engine:.2f}",
         spread(ours["engine_start"], 2), n_lat, ""),
        ("run.start(): cell setup on 2 idle engines (s)", f"{ours['run_start']:.2f}", "",
         "n=1", ""),
        ("grow 2->3, run.events latency_s (s)", f"{med(grow_rep):.2f}", spread(grow_rep, 2),
         n_lat, f"< {engine + 1:.2f} (engine start + 1 s)"),
        ("grow 2->3, recomputed from history (s)", f"{med(grow_hist):.2f}",
         spread(grow_hist, 2), n_lat, ""),
        ("  request -> new engine registered (s)", f"{med(lat['grow_boot']):.2f}",
         spread(lat["grow_boot"], 2), n_lat, ""),
        ("  -> cell set up, old group left (s)", f"{med(lat['grow_setup']):.2f}",
         spread(lat["grow_setup"], 2), n_lat, ""),
        ("  -> new group formed, first step (s)", f"{med(lat['grow_switch']):.2f}",
         spread(lat["grow_switch"], 2), n_lat, ""),
        ("grow 2->3 with --standby 1 (s)", f"{med(ours['standby_grow']):.2f}",
         spread(ours["standby_grow"], 2), n_lat, f"< {engine + 1:.2f}"),
        ("shrink 3->2, run.events latency_s (s)", f"{med(shrink_rep):.2f}",
         spread(shrink_rep, 2), n_lat, "< 1"),
        ("shrink 3->2, recomputed from history (s)", f"{med(shrink_hist):.2f}",
         spread(shrink_hist, 2), n_lat, "< 1"),
        ("throughput ours, W=2 (samples/s)", f"{med(ours['samples_per_s']):.0f}",
         spread(ours["samples_per_s"], 0), f"n={len(ours['samples_per_s'])}", ""),
        ("throughput torchrun DDP, W=2 (samples/s)", f"{med(ddp):.0f}", spread(ddp, 0), n_tp, ""),
        ("throughput ratio ours/DDP (medians)", f"{ratio:.2f}", "", "", ">= 0.9 (aim)"),
    ]


def print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def print_details(ddp_before: list[float], ddp_after: list[float], ours: dict) -> None:
    """Every raw figure, so that noise and outliers are visible."""
    def show(values, digits):
        return " ".join(f"{v:.{digits}f}" for v in values)
    lat = ours["latencies"]
    print(f"engine start (s):                  {show(ours['engine_start'], 3)}")
    for kind in ("grow", "shrink"):
        print(f"{kind} latency_s / recomputed (s):".ljust(35) +
              " ".join(f"{a:.3f}/{b:.3f}" for a, b in lat[kind]))
    for key, label in (("boot", "request -> registered"), ("setup", "-> membership change"),
                       ("switch", "-> first step")):
        print(f"grow, {label}:".ljust(35) + show(lat[f"grow_{key}"], 3))
    half = len(ours["samples_per_s"]) // 2
    print(f"ours samples/s, generation 0:      {show(ours['samples_per_s'][:half], 0)}")
    print(f"ours samples/s, after the resizes: {show(ours['samples_per_s'][half:], 0)}")
    print(f"DDP samples/s, before the pool:    {show(ddp_before, 0)}")
    print(f"DDP samples/s, after the pool:     {show(ddp_after, 0)}")
    # the machine's speed drifts: measurements next to each other in time compare best
    med = statistics.median
    print(f"ratio of medians, adjacent in time: generation 0 / DDP before "
          f"{med(ours['samples_per_s'][:half]) / med(ddp_before):.2f}, after the resizes / "
          f"DDP after {med(ours['samples_per_s'][half:]) / med(ddp_after):.2f}")


def main() -> None:
    import torch
    t0 = time.perf_counter()
    print(f"quick-start model, global batch {GLOBAL_BATCH}, {os.cpu_count()} CPU cores, gloo, "
          f"torch {torch.__version__}", flush=True)
    print("DDP baseline (torchrun, 2 processes), before the pool...", flush=True)
    ddp_before = ddp_throughputs()
    print("elastic pool: engine start, throughput, grow/shrink cycles, throughput...", flush=True)
    ours = run_elastic()
    print("DDP baseline again, after the pool...", flush=True)
    ddp_after = ddp_throughputs()
    print(f"(engines ran with {ours['threads']} thread(s) each)\n")
    print_details(ddp_before, ddp_after, ours)
    print()
    print_table(table_rows(ddp_before + ddp_after, ours))
    print(f"\ntotal benchmark time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
