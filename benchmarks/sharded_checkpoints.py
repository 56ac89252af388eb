"""What a sharded checkpoint costs training: a ``shard=True`` run of the GPT of benchmarks/gpt.py
on a fresh pool, a checkpoint every `--every` steps, each rank's part written beside training
(engine/sharded/part_writer.py) from the host copy of a partner refresh at that step.

Printed: the median step time, each checkpoint step's time above it (the refresh, and what the
write in the background takes from training), and each write's and refresh's own seconds from
the run's events. The first checkpoints' refreshes touch host memory for the first time (their
buffers are reused after: engine/sharded/replicas.py), so the steady cost is that of the later ones.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gpt  # noqa: E402  (benchmarks/ is not a package)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="50M", choices=list(gpt.SIZES))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--steps", type=int, default=41)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--folder", default="/var/tmp",
                        help="where the checkpoints go (a disk, not tmpfs)")
    args = parser.parse_args()
    from elastic_jupyter import EnginePool, RunConfig, TrainingRun
    pool = EnginePool(n=args.world_size, min_size=1, max_size=args.world_size,
                      gpus="none").start()
    try:
        with tempfile.TemporaryDirectory(dir=args.folder) as workspace:
            config = RunConfig(name=f"ckpt-{args.size}", global_batch=args.global_batch,
                               steps=args.steps, checkpoint_every=args.every, seed=0,
                               shard=True, checkpoint_dir=os.path.join(workspace, "ckpt"))
            run = TrainingRun(pool, config, source=gpt.cell(args.size, args.seq_len),
                              workspace=workspace).start()
            if run.wait(timeout=3600) != "finished":
                raise RuntimeError(run.logs())
            stamps = {r["step"]: r["time"] for r in run.history}
            events = run.events
    finally:
        pool.stop()
    # a step's time: from the record of the step before to its own (a checkpoint of step s is
    # taken after s's record: it lands in step s + 1's time)
    took = {s: stamps[s] - stamps[s - 1] for s in stamps if s - 1 in stamps}
    median = statistics.median(took.values())
    refresh = {e["step"]: e["seconds"] for e in events if e["kind"] == "replicas"}
    print(f"{args.size} at {args.world_size} ranks, a checkpoint every {args.every} steps; "
          f"median step {median:.2f} s")
    print("| checkpoint step | step after it, above the median (s) | refresh (s) | "
          "write beside training (s) | bytes |")
    print("|---|---|---|---|---|")
    for e in events:
        if e["kind"] == "checkpoint_failed":
            print(f"| {e['step']} | failed: {e['message']} | | | |")
        elif e["kind"] == "checkpoint" and e["step"] + 1 in took:
            print(f"| {e['step']} | {took[e['step'] + 1] - median:+.2f} | "
                  f"{refresh.get(e['step'], 0):.2f} | {e['seconds']:.2f} | {e['bytes']} |")


if __name__ == "__main__":
    main()
