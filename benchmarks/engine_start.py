"""Engine start on this host: forked from the kernel's zygote against a new process each.

Side by side in one run, alternating (``--rounds`` times each, this machine is noisy):

- **pool start**: ``EnginePool(n=1).start()``, the controller and one engine, to its return;
- **grow 1 -> 3**: ``pool.resize(3)`` on the idle pool, two engines at once;
- **grow after a run**: once a run of the digits cell (which imports scikit-learn) has trained
  on the pool, ``pool.resize(3)`` again and the cell's setup on the new engine, as a run that
  grows would do it (the zygote has the run's installed imports loaded by then).

``ELASTIC_JUPYTER_FORK_ENGINES=0`` gives the new-process figures (ipyparallel's own start:
``python -m ipyparallel.engine``). Ratios are what to compare.

Run: ``python benchmarks/engine_start.py [--rounds N]``; figures in BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from auto_day import CELL

from elastic_jupyter import EnginePool, RunConfig, TrainingRun
from elastic_jupyter.pool import zygote


def one_round(fork: bool, workspace: str, name: str) -> dict[str, float]:
    os.environ[zygote.OFF] = "1" if fork else "0"
    t0 = time.perf_counter()
    pool = EnginePool(n=1, min_size=1, max_size=3, gpus="none").start()
    try:
        started = time.perf_counter()
        pool.resize(3)
        grown = time.perf_counter()
        pool.resize(1)
        run = TrainingRun(pool, RunConfig(name=name, steps=5, global_batch=16,
                                          checkpoint_every=0),
                          source=CELL, workspace=workspace).start()
        assert run.wait(timeout=120) == "finished", run.logs()
        if pool.launcher.zygote is not None:
            pool.launcher.zygote.wait_ready(60)  # the run's imports are loaded
        t1 = time.perf_counter()
        pool.resize(3)
        new = pool.engine_sets.engines[1:]
        pool.engine_sets.client[[e.engine_id for e in new]].execute(CELL, block=True)
        after_run = time.perf_counter() - t1
    finally:
        pool.stop()
    return {"pool start": started - t0, "grow 1 -> 3": grown - started,
            "grow 1 -> 3 after a run, cell included": after_run}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    figures: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as workspace:
        for i in range(rounds):
            for fork in (True, False):
                figures[fork].append(one_round(fork, workspace, f"r{i}-{fork}"))
    print(f"{'seconds (median of ' + str(rounds) + ')':<42}{'forked':>8}{'new process':>13}"
          f"{'ratio':>7}")
    for what in figures[True][0]:
        forked = statistics.median(r[what] for r in figures[True])
        new = statistics.median(r[what] for r in figures[False])
        print(f"{what:<42}{forked:>8.2f}{new:>13.2f}{forked / new:>7.2f}")


if __name__ == "__main__":
    main()
