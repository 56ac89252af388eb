"""Throughput and memory at real model sizes: an elastic run of the GPT decoder of
benchmarks/gpt.py against the same cell under torchrun + DistributedDataParallel.

Both sides: 2 processes, gloo, one thread each, AdamW, byte-level text from the standard
library, global batch ``--global-batch`` sequences of ``--seq-len`` bytes. The elastic run
trains on a fresh pool of 2 engines (bounds 1..2, so each step is cut for 1 and 2 ranks); its
throughput comes from the per-step time stamps of ``run.history`` after ``--warmup`` steps,
DDP's from its own clock over the same number of steps (benchmarks/gpt_ddp.py). The sides
alternate, ours first, ``--pairs`` times, because this machine's speed drifts by tens of
percent; the table gives the median ratio and the range of the per-pair ratios. Peak resident
memory per rank (VmHWM) is read from the engines after their run and reported by the DDP
ranks themselves.

Usage: ``.venv/bin/python benchmarks/gpt_throughput.py [--sizes 5M 50M] [--pairs 5]``
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gpt  # noqa: E402


def _vm_hwm(pid: int) -> int:
    """Peak resident memory of process `pid` in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


def ours(size: str, args) -> dict:
    from elastic_jupyter import EnginePool, RunConfig, TrainingRun
    pool = EnginePool(n=2, min_size=1, max_size=2, gpus="none").start()
    try:
        with tempfile.TemporaryDirectory() as workspace:
            config = RunConfig(name=f"gpt-{size}", global_batch=args.global_batch,
                               steps=args.warmup + args.steps, checkpoint_every=0,
                               seed=args.seed)
            run = TrainingRun(pool, config, source=gpt.cell(size, args.seq_len),
                              workspace=workspace).start()
            if run.wait(timeout=3600) != "finished":
                raise RuntimeError(run.logs())
            stamps = [r["time"] for r in run.history]
            timed = stamps[args.warmup - 1:]  # the end of the last warm-up step starts the clock
            cut = next(e for e in run.events if e["kind"] == "micro_batches")
            peaks = [_vm_hwm(e.pid) for e in pool.engines]
        return {"samples_per_s": args.steps * args.global_batch / (timed[-1] - timed[0]),
                "peak_rss": peaks, "cut": cut["message"]}
    finally:
        pool.stop()


def ddp(size: str, args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(HERE, "gpt_ddp.py"), "--size", size, "--seq-len", str(args.seq_len),
           "--global-batch", str(args.global_batch), "--warmup", str(args.warmup),
           "--steps", str(args.steps), "--seed", str(args.seed)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"DDP baseline failed:\n{out.stdout}\n{out.stderr}")
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["5M", "50M"], choices=list(gpt.SIZES))
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("| model | ours samples/s | DDP samples/s | ours / DDP (median, range) | "
          "peak RSS per rank ours / DDP |")
    print("|---|---|---|---|---|")
    for size in args.sizes:
        pairs = [(ours(size, args), ddp(size, args)) for _ in range(args.pairs)]
        ratios = [a["samples_per_s"] / b["samples_per_s"] for a, b in pairs]
        rss = statistics.median(max(a["peak_rss"]) / max(b["peak_rss"]) for a, b in pairs)
        print(f"| {size} ({gpt.parameters(size) / 1e6:.1f} M) | "
              f"{statistics.median(a['samples_per_s'] for a, _ in pairs):.1f} | "
              f"{statistics.median(b['samples_per_s'] for _, b in pairs):.1f} | "
              f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
              f"{rss:.2f} |", flush=True)
        print(f"  ours: {pairs[0][0]['cut']}", flush=True)


if __name__ == "__main__":
    main()
