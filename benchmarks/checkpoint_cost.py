"""What a checkpoint costs the training loop: the wall time of an interval of steps with a
checkpoint against the same interval without one, as a fraction of writing the same state
synchronously (``torch.save`` + fsync).

One process, one thread, the GPT decoder of benchmarks/gpt.py with AdamW (the state: the
parameters and twice their size in moments), trained by a real Worker at world size 1 as a
generation trains it, in blocks of four intervals of ``--interval`` steps: a plain one, one
that ends with a checkpoint (copied into reused buffers and submitted to the Worker's
background writer), the one the write overlaps (it competes for the cores, as in a run), and a
plain one. Blocks whose background work is a plain memcpy of the state's bytes on another
thread (the least any background write of it does: read it once, write it once) alternate with
them, as this machine's floor. Reported: the median over blocks of the extra seconds of the
middle two intervals over the plain two, for checkpoints and for the memcpy; the median of a
synchronous save of the same state and the ratio; and the time the loop itself stops for a
checkpoint (the copy into the buffers, and any wait for the previous write).

Usage: ``.venv/bin/python benchmarks/checkpoint_cost.py [--size 50M] [--intervals 12]
[--global-batch 1 --seq-len 32 --interval 6]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.utils.serialization  # its config is not imported with torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import gpt  # noqa: E402
from elastic_jupyter.engine.entrypoints import _run_setup  # noqa: E402
from elastic_jupyter.engine.worker import Worker  # noqa: E402


def sync_save(state: dict, folder: str) -> float:
    start = time.perf_counter()
    path = os.path.join(folder, "sync.pt")
    with open(path, "wb") as f:  # as engine.checkpoint writes: without the zip's CRC32
        with torch.utils.serialization.config.patch({"save.compute_crc32": False}):
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
    parser.add_argument("--intervals", type=int, default=12, help="checkpointed intervals")
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
        state = worker.capture()
        nbytes = sum(t.numel() * t.element_size() for t in
                     [*state["model"].values(),
                      *(v for s in state["optimizer"]["state"].values() for v in s.values())])
        del state
        source = torch.ones(nbytes, dtype=torch.uint8)
        target = torch.zeros(nbytes, dtype=torch.uint8)

        def interval() -> float:
            start = time.perf_counter()
            for _ in range(args.interval):
                worker.train_step(0, 1)
            return time.perf_counter() - start

        def checkpoint() -> None:  # as engine.generation checkpoints: into reused buffers,
            worker.writer.wait()  # once the previous write is done
            worker.writer.submit(worker.capture(staging=worker.staging),
                                 ready=worker.staging.ready)

        def memcpy() -> None:  # the least a background write of the state does
            threading.Thread(target=target.copy_, args=(source,)).start()

        def block(background) -> tuple[float, float]:
            """Four intervals: plain, one that ends by starting `background`, the one it
            overlaps, plain; returns (extra seconds of the middle two, the stall)."""
            before, middle = interval(), interval()
            stall = time.perf_counter()
            background()
            stall = time.perf_counter() - stall
            after, last = interval(), interval()
            plain.extend([before, last])
            return middle + stall + after - before - last, stall

        # comparing within a block cancels this machine's drift (steps of one size drift by
        # 2x within a minute here); checkpoint and memcpy blocks alternate
        extra, floor, plain, stalls = [], [], [], []
        for _ in range(args.intervals):
            cost, stall = block(checkpoint)
            extra.append(cost)
            stalls.append(stall)
            floor.append(block(memcpy)[0])
        failed = [e for e in worker.writer.drain() if e["kind"] != "checkpoint"]
        assert not failed, failed
        state = worker.capture()
        saves = [sync_save(state, folder) for _ in range(3)]
        worker.writer.close()
    print(f"{args.size}: state {nbytes / 1e9:.2f} GB; interval of {args.interval} steps "
          f"{statistics.median(plain):.2f} s; a checkpoint adds {statistics.median(extra):.3f} s "
          f"(range {min(extra):.3f}..{max(extra):.3f}); a synchronous save + fsync takes "
          f"{statistics.median(saves):.2f} s; ratio "
          f"{statistics.median(extra) / statistics.median(saves):.1%}; a memcpy of the same "
          f"bytes on another thread adds {statistics.median(floor):.3f} s (range "
          f"{min(floor):.3f}..{max(floor):.3f}); the loop itself waits "
          f"{statistics.median(stalls):.3f} s per checkpoint (the copy), "
          f"{statistics.median(stalls) / statistics.median(saves):.1%} of the save")


if __name__ == "__main__":
    main()
