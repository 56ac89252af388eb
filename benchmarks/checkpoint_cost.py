"""What a checkpoint costs the training loop: the wall time of the steps a checkpoint's write
overlaps against the same steps without one, as a fraction of writing the same state
synchronously (``torch.save`` + fsync).

One process, one thread, the GPT decoder of benchmarks/gpt.py with AdamW (the state: the
parameters and twice their size in moments), trained by a real Worker at world size 1 as a
generation trains it. A block times each step: ``--plain`` steps, then background work starts
and steps go on until it is done, then ``--plain`` steps more; its cost is the stall to start
it plus the steps it overlapped, less as many steps at the median of the plain ones around
them (a window as short as the write: these machines drift by tens of percent within
minutes). Three kinds of blocks alternate: a checkpoint as the engine writes it (copied into
reused shared buffers, written by the writer process), the same written on the engine's own
writer thread (``--process-min-bytes`` beyond the state), and a plain memcpy of the state's
bytes on another thread (the least any background write of it does: read it once, write it
once), as this machine's floor. A synchronous save of the same state is timed between blocks.
With ``--probes``, five more, each another process at the writer's niceness: one that keeps
a core busy for ``--probe-seconds`` (no memory traffic), one that copies 64 MiB buffers for as
long, and three that handle as many bytes as the state has once: a buffered write + fsync, an
``O_DIRECT`` write, a SHA-256. What a background write can cost a training step that a spare
core does not absorb, and which part of a write costs it.

Usage: ``.venv/bin/python benchmarks/checkpoint_cost.py [--size 50M] [--blocks 12]
[--global-batch 1 --seq-len 32] [--probes]``
"""
from __future__ import annotations

import argparse
import math
import os
import select
import statistics
import subprocess
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
from elastic_jupyter.engine.state.checkpoint_writer import (  # noqa: E402
    PROCESS_MIN_BYTES, CheckpointWriter)
from elastic_jupyter.engine.state.training_state import Staging  # noqa: E402
from elastic_jupyter.engine.entrypoints import _run_setup  # noqa: E402
from elastic_jupyter.engine.worker import Worker  # noqa: E402


# Another process, at the writer process's niceness, doing one thing per "go" line: a loop
# for some seconds, or one write of the state's bytes (its own copy of as many) to a file.
PROBE = """
import hashlib, mmap, os, sys, time, torch
os.nice(10)
a = torch.ones(64 << 20, dtype=torch.uint8)
b = a.clone()
data = memoryview(mmap.mmap(-1, {nbytes} // 4096 * 4096))  # page-aligned, for O_DIRECT
torch.frombuffer(data, dtype=torch.uint8).fill_(1)
path = os.path.join({folder!r}, f"probe-{{os.getpid()}}")
print("ready", flush=True)
for _ in sys.stdin:
    end = time.perf_counter() + {seconds}
    {body}
    print("done", flush=True)
"""
PROBES = {
    "busy core": "while time.perf_counter() < end: pass",
    "busy memory": "while time.perf_counter() < end: b.copy_(a)",
    "buffered write": "with open(path, 'wb', buffering=0) as f:\n"
                      "        for i in range(0, len(data), 1 << 20): f.write(data[i:i + (1 << 20)])\n"
                      "        os.fsync(f.fileno())\n"
                      "    os.unlink(path)",
    "direct write": "fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT)\n"
                    "    for i in range(0, len(data), 8 << 20): os.write(fd, data[i:i + (8 << 20)])\n"
                    "    os.fsync(fd); os.close(fd); os.unlink(path)",
    "sha256": "hashlib.sha256(data)",
}


def sync_save(state: dict, folder: str) -> float:
    start = time.perf_counter()
    path = os.path.join(folder, "sync.pt")
    with open(path, "wb") as f:  # as engine.state.checkpoint writes: without the zip's CRC32
        with torch.utils.serialization.config.patch({"save.compute_crc32": False}):
            torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    os.remove(path)
    return seconds


def median_interval(values: list[float]) -> tuple[float, float]:
    """A distribution-free 95 % confidence interval of the median: the order statistics
    of ranks n/2 - 1.96 sqrt(n)/2 and 1 + n/2 + 1.96 sqrt(n)/2, rounded outwards (the
    binomial's normal approximation; Conover, *Practical Nonparametric Statistics*, 3rd ed.,
    sec. 3.2). Blocks are independent draws with heavy tails here (a neighbour's burst), so
    no normal model of the values."""
    ordered = sorted(values)
    half = 1.96 * len(ordered) ** 0.5 / 2
    low = max(1, math.floor(len(ordered) / 2 - half))
    high = min(len(ordered), math.ceil(1 + len(ordered) / 2 + half))
    return ordered[low - 1], ordered[high - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="50M", choices=list(gpt.SIZES))
    parser.add_argument("--plain", type=int, default=3, help="plain steps before and after")
    parser.add_argument("--blocks", type=int, default=12, help="blocks of each kind")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--global-batch", type=int, default=1)
    parser.add_argument("--probes", action="store_true",
                        help="also time a busy core and a memory-bound copy in another process")
    parser.add_argument("--probe-seconds", type=float, default=2.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        config = {"global_batch": args.global_batch, "seed": 0, "keep_checkpoints": 1,
                  "pass_cost": 0.0, "steps": 10**6}
        worker = Worker(_run_setup(gpt.cell(args.size, args.seq_len), None, {}, None), config,
                        "cpu")
        # rank 0's writer and reused copies, as engine.state.whole_checkpoints pairs them
        writer, staging = CheckpointWriter(folder, keep=1), Staging()
        for _ in range(2):  # warm-up: the optimizer's moments exist from the first step
            worker.train_step(0, 1)
        state = worker.capture()
        nbytes = sum(t.numel() * t.element_size() for t in
                     [*state["model"].values(),
                      *(v for s in state["optimizer"]["state"].values() for v in s.values())])
        del state
        source = torch.ones(nbytes, dtype=torch.uint8)
        target = torch.zeros(nbytes, dtype=torch.uint8)
        events, plain = [], []

        def step() -> float:
            start = time.perf_counter()
            worker.train_step(0, 1)
            return time.perf_counter() - start

        def checkpoint(process: bool):
            submitted = []

            def start():  # as engine.generation checkpoints: into reused buffers
                writer.process_min_bytes = PROCESS_MIN_BYTES if process else nbytes * 2
                submitted.append(worker.progress.step)
                writer.submit(worker.capture(staging=staging),
                              ready=staging.ready, arena=staging.arena)

            def done() -> bool:
                events.extend(writer.take_events())
                return bool(events) and events[-1]["step"] == submitted[-1]
            return start, done

        def memcpy():
            thread = threading.Thread(target=target.copy_, args=(source,))
            return thread.start, lambda: not thread.is_alive()

        def probe(body: str):
            process = subprocess.Popen(
                [sys.executable, "-c", PROBE.format(seconds=args.probe_seconds, body=body,
                                                    nbytes=nbytes, folder=folder)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert process.stdout.readline().strip() == "ready"  # torch imported

            def make():
                def start():
                    process.stdin.write("go\n")
                    process.stdin.flush()

                def done() -> bool:
                    if select.select([process.stdout], [], [], 0)[0]:
                        return process.stdout.readline().strip() == "done"
                    return False
                return start, done
            return make

        def block(kind) -> tuple[float, float]:
            """(extra seconds of the steps the background work overlapped, the stall)."""
            start, done = kind
            before = [step() for _ in range(args.plain)]
            stall = time.perf_counter()
            start()
            stall = time.perf_counter() - stall
            during = [step()]
            while not done():
                during.append(step())
            after = [step() for _ in range(args.plain)]
            base = statistics.median(before + after)
            plain.extend(before + after)
            return stall + sum(during) - base * len(during), stall

        block(checkpoint(True))  # the writer process starts (a torch import), once a run
        kinds = {"process": lambda: checkpoint(True), "thread": lambda: checkpoint(False),
                 "memcpy": memcpy}
        if args.probes:
            kinds.update({name: probe(body) for name, body in PROBES.items()})
        extra = {name: [] for name in kinds}
        stalls, saves = [], []
        for i in range(args.blocks):
            for name, kind in kinds.items():
                cost, stall = block(kind())
                extra[name].append(cost)
                if name in ("process", "thread"):
                    stalls.append(stall)
            if i % 4 == 3:
                state = worker.capture()
                saves.append(sync_save(state, folder))
                del state
        failed = [e for e in events if e["kind"] != "checkpoint"]
        assert not failed, failed
        writer.close()
    save = statistics.median(saves)
    print(f"{args.size}: state {nbytes / 1e9:.2f} GB; step {statistics.median(plain):.3f} s; "
          f"a synchronous save + fsync takes {save:.2f} s (range {min(saves):.2f}.."
          f"{max(saves):.2f}); the loop itself waits {statistics.median(stalls):.3f} s per "
          f"checkpoint ({statistics.median(stalls) / save:.1%} of the save)")
    for name, costs in extra.items():
        low, high = median_interval(costs)
        print(f"  {name}: adds {statistics.median(costs):.3f} s, {statistics.median(costs) / save:.1%}"
              f" of the save (95 % interval of the median {low:.3f}..{high:.3f} s = "
              f"{low / save:.1%}..{high / save:.1%}; blocks range {min(costs):.3f}.."
              f"{max(costs):.3f})")


if __name__ == "__main__":
    main()
