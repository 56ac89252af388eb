"""What a checkpoint costs the training loop: the wall time of an interval of steps with a
checkpoint against the same interval without one, as a fraction of writing the same state
synchronously (``torch.save`` + fsync).

One process, one thread, the GPT decoder of benchmarks/gpt.py with AdamW (the state: the
parameters and twice their size in moments), trained by a real Worker at world size 1 as a
generation trains it: each interval is ``--interval`` steps; every other interval ends with a
checkpoint copied into reused buffers and submitted to the Worker's background writer, which
the next interval's steps overlap (the write competes for the cores, as it does in a run). Reported: the median extra
seconds of a checkpointed interval over its plain neighbours, the median of a synchronous save
of the same state, and their ratio; and the time the loop itself stops for a checkpoint (the
copy into the buffers, and any wait for the previous write).

Usage: ``.venv/bin/python benchmarks/checkpoint_cost.py [--size 50M] [--intervals 6]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import gpt  # noqa: E402
from elastic_jupyter.engine import state as state_mod  # noqa: E402
from elastic_jupyter.engine.entrypoints import _run_setup  # noqa: E402
from elastic_jupyter.engine.worker import Worker  # noqa: E402


def sync_save(state: dict, folder: str) -> float:
    start = time.perf_counter()
    path = os.path.join(folder, "sync.pt")
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    os.remove(path)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="50M", choices=list(gpt.SIZES))
    parser.add_argument("--interval", type=int, default=4, help="steps per interval")
    parser.add_argument("--intervals", type=int, default=6, help="checkpointed intervals")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        config = {"global_batch": args.global_batch, "seed": 0, "keep": 1, "pass_cost": 0.0,
                  "steps": 10**6, "checkpoint_dir": folder}
        worker = Worker(_run_setup(gpt.cell(args.size, args.seq_len), None, {}, None), config,
                        "cpu")
        for _ in range(2):  # warm-up: the optimizer's moments exist from the first step
            worker.train_step(0, 1)
        plain, checkpointed, stalls, staging = [], [], [], state_mod.Staging()
        for i in range(2 * args.intervals + 1):
            start = time.perf_counter()
            for _ in range(args.interval):
                worker.train_step(0, 1)
            if i % 2:  # as engine.generation checkpoints: into reused buffers, once the
                # previous write is done
                stall = time.perf_counter()
                worker.writer.wait()
                worker.writer.submit(worker.capture(staging=staging))
                stalls.append(time.perf_counter() - stall)
            (checkpointed if i % 2 else plain).append(time.perf_counter() - start)
        worker.writer.drain()
        state = worker.capture()
        nbytes = sum(t.numel() * t.element_size() for t in
                     [*state["model"].values(),
                      *(v for s in state["optimizer"]["state"].values() for v in s.values())])
        saves = [sync_save(state, folder) for _ in range(3)]
        worker.writer.close()
    # the write overlaps the interval after the checkpoint: count both against plain ones
    extra = [checkpointed[j] + plain[j + 1] - 2 * statistics.median(plain)
             for j in range(len(checkpointed))]
    print(f"{args.size}: state {nbytes / 1e9:.2f} GB; interval of {args.interval} steps "
          f"{statistics.median(plain):.2f} s; a checkpoint adds {statistics.median(extra):.3f} s "
          f"(range {min(extra):.3f}..{max(extra):.3f}); a synchronous save + fsync takes "
          f"{statistics.median(saves):.2f} s; ratio "
          f"{statistics.median(extra) / statistics.median(saves):.1%}; the loop itself waits "
          f"{statistics.median(stalls):.3f} s per checkpoint (the copy), "
          f"{statistics.median(stalls) / statistics.median(saves):.1%} of the save")


if __name__ == "__main__":
    main()
