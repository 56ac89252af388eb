"""Throughput and memory at real model sizes: an elastic run of the GPT decoder of
benchmarks/gpt.py against the same cell under torchrun + DistributedDataParallel.

Both sides: ``--world-size`` processes (2 by default), gloo, one thread each, AdamW, byte-level text from the standard
library, global batch ``--global-batch`` sequences of ``--seq-len`` bytes; with
``--transform-ms`` each sample costs that much CPU time to fetch (benchmarks/gpt.py
``StdlibText``: a data-bound run), read through ``--workers`` loader processes per rank
(ours: ``RunConfig(loader_processes=N)``; DDP: ``DataLoader(num_workers=N)``). The elastic run
trains on a fresh pool of that many engines (bounds 1..``--pool-max``, by default the world
size; the default cut is one micro-batch per slot of ``--pool-max``, ``--cut measured`` the
tuned one of ``--pass-cost measure``); its
throughput comes from the per-step time stamps of ``run.history`` after ``--warmup`` steps,
DDP's from its own clock over the same number of steps (benchmarks/gpt_ddp.py). The sides
alternate, ours first, ``--pairs`` times, because this machine's speed drifts by tens of
percent; the table gives the median ratio and the range of the per-pair ratios. Peak resident
memory per rank (VmHWM) is read from the engines after their run and reported by the DDP
ranks themselves; both sides' rank 0 writes a final checkpoint, so the table gives the ratio
for rank 0 and rank 1 apart.

With ``--shard`` our run is sharded (``RunConfig(shard=True)``: FSDP2 per block, the partner
replicas refreshed every 20 steps, the default) and the baseline is torchrun + FSDP2 with the
same wrapping (gpt_ddp.py ``--fsdp2``); a third side, ours with ``--replica-every`` beyond the
run's length (replicas only after the start), gives the replicas' cost.

Usage: ``.venv/bin/python benchmarks/gpt_throughput.py [--sizes 5M 50M] [--pairs 5]
[--transform-ms MS --workers N] [--shard [--no-replica-cost]]``
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


def ours(size: str, args, replica_every: int | None = None) -> dict:
    from elastic_jupyter import EnginePool, RunConfig, TrainingRun
    pool = EnginePool(n=args.world_size, min_size=1, max_size=args.pool_max or args.world_size,
                      gpus="none").start()
    try:
        with tempfile.TemporaryDirectory() as workspace:
            config = RunConfig(name=f"gpt-{size}", global_batch=args.global_batch,
                               steps=args.warmup + args.steps, checkpoint_every=0,
                               seed=args.seed, loader_processes=args.workers,
                               pass_cost="measure" if args.cut == "measured" else None,
                               shard=args.shard,
                               **({"replica_every": replica_every} if replica_every else {}))
            source = gpt.cell(size, args.seq_len, transform_ms=args.transform_ms)
            run = TrainingRun(pool, config, source=source, workspace=workspace).start()
            ranks = run.members  # rank order (no resizes here): rank 0 writes the checkpoint
            if run.wait(timeout=3600) != "finished":
                raise RuntimeError(run.logs())
            stamps = [r["time"] for r in run.history]
            timed = stamps[args.warmup - 1:]  # the end of the last warm-up step starts the clock
            cut = next(e for e in run.events if e["kind"] == "micro_batches")
            peaks = [_vm_hwm(e.pid) for e in ranks]
        return {"samples_per_s": args.steps * args.global_batch / (timed[-1] - timed[0]),
                "peak_rss": peaks, "cut": cut["message"],
                "step_s": [b - a for a, b in zip(stamps, stamps[1:])]}
    finally:
        pool.stop()


def ddp(size: str, args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(args.world_size),
           os.path.join(HERE, "gpt_ddp.py"), "--size", size, "--seq-len", str(args.seq_len),
           "--global-batch", str(args.global_batch), "--warmup", str(args.warmup),
           "--steps", str(args.steps), "--seed", str(args.seed),
           "--transform-ms", str(args.transform_ms), "--workers", str(args.workers)] + \
        ["--fsdp2"] * args.shard
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    printed = [line for line in out.stdout.splitlines() if line.startswith("{")]
    # a gloo process sometimes aborts at interpreter teardown, after its work is done
    # ("terminate called without an active exception": tests/worlds.py); its result stands
    torn_down = printed and "terminate called without an active exception" in out.stderr
    if out.returncode != 0 and not torn_down:
        raise RuntimeError(f"DDP baseline failed:\n{out.stdout}\n{out.stderr}")
    return json.loads(printed[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["5M", "50M"], choices=list(gpt.SIZES))
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transform-ms", type=float, default=0.0,
                        help="CPU time of each sample's transform (0: plain byte windows)")
    parser.add_argument("--workers", type=int, default=0,
                        help="loader processes per rank, both sides (0: in the training process)")
    parser.add_argument("--world-size", type=int, default=2,
                        help="ranks on both sides (ours: a pool of that many engines)")
    parser.add_argument("--pool-max", type=int, default=None,
                        help="our pool's --max (default: the world size), which sets the "
                             "default cut: one micro-batch per slot")
    parser.add_argument("--cut", choices=("default", "measured"), default="default",
                        help="ours: the default cut, or the tuned one (--pass-cost measure)")
    parser.add_argument("--shard", action="store_true",
                        help="ours sharded against torchrun + FSDP2 (and ours without refreshes)")
    parser.add_argument("--show-steps", action="store_true",
                        help="with --shard: print each side's step times, pair by pair")
    parser.add_argument("--no-replica-cost", action="store_true",
                        help="with --shard: leave out the third side (ours without refreshes)")
    args = parser.parse_args()
    print(f"world size {args.world_size}, our pool's --max {args.pool_max or args.world_size}, "
          f"{args.cut} cut; "
          f"seq-len {args.seq_len}, global batch {args.global_batch}, {args.warmup} warm-up + "
          f"{args.steps} timed steps, {args.pairs} pairs; per-sample transform "
          f"{args.transform_ms:g} ms CPU, {args.workers} loader workers per rank")
    if args.shard:
        return sharded(args)
    print("| model | ours samples/s | DDP samples/s | ours / DDP (median, range) | "
          "peak RSS ours / DDP (median) |")
    print("|---|---|---|---|---|")
    for size in args.sizes:
        pairs = [(ours(size, args), ddp(size, args)) for _ in range(args.pairs)]
        ratios = [a["samples_per_s"] / b["samples_per_s"] for a, b in pairs]
        rss = [statistics.median(a["peak_rss"][r] / b["peak_rss"][r] for a, b in pairs)
               for r in range(2)]
        print(f"| {size} ({gpt.parameters(size) / 1e6:.1f} M) | "
              f"{statistics.median(a['samples_per_s'] for a, _ in pairs):.1f} | "
              f"{statistics.median(b['samples_per_s'] for _, b in pairs):.1f} | "
              f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
              f"rank0 {rss[0]:.2f} / rank1 {rss[1]:.2f} |", flush=True)
        print(f"  ours: {pairs[0][0]['cut']}", flush=True)


def sharded(args) -> None:
    """The --shard table: ours, FSDP2 and (unless --no-replica-cost) ours without replica
    refreshes, interleaved; each pair's ratio is printed as it comes."""
    print("| model | ours samples/s | FSDP2 samples/s | ours / FSDP2 (median, range) | "
          "without refreshes / with (median, range) | peak RSS ours / FSDP2 (median) |")
    print("|---|---|---|---|---|---|")
    never = args.warmup + args.steps + 1  # replicas only after the start
    for size in args.sizes:
        rows = []
        for _ in range(args.pairs):
            a, b = ours(size, args), ddp(size, args)
            c = a if args.no_replica_cost else ours(size, args, never)
            rows.append((a, b, c))
            print(f"  {size} pair {len(rows)}: ours / FSDP2 "
                  f"{a['samples_per_s'] / b['samples_per_s']:.3f}", flush=True)
            if args.show_steps:  # from the second step: where the warm-up ends
                for side, result in (("ours", a), ("FSDP2", b)):
                    print(f"    {side} step seconds: "
                          f"{' '.join(f'{t:.2f}' for t in result['step_s'])}", flush=True)
        ratios = [a["samples_per_s"] / b["samples_per_s"] for a, b, _ in rows]
        costs = [c["samples_per_s"] / a["samples_per_s"] for a, _, c in rows]
        rss = [statistics.median(a["peak_rss"][r] / b["peak_rss"][r] for a, b, _ in rows)
               for r in range(2)]
        print(f"| {size} ({gpt.parameters(size) / 1e6:.1f} M) | "
              f"{statistics.median(a['samples_per_s'] for a, _, _ in rows):.2f} | "
              f"{statistics.median(b['samples_per_s'] for _, b, _ in rows):.2f} | "
              f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
              f"{statistics.median(costs):.3f} ({min(costs):.3f}-{max(costs):.3f}) | "
              f"rank0 {rss[0]:.2f} / rank1 {rss[1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
