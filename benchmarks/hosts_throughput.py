"""Throughput across two hosts: a pool of SSH engines against torchrun + DDP, on the same two.

The hosts are network namespaces of this machine (tests/netns_hosts.py: a bridge, a veth pair
each, an sshd each, private /tmp), so every byte between the two ranks crosses TCP over the
veth pairs, as between two machines; both share this machine's 2 cores, as the single-host
benchmark's processes do. World size 2, one rank on each host, one thread each, gloo.

- ours: ``EnginePool(launcher=SSHLauncher("<h1>:1,<h2>:1"))`` training the quick-start cell
  (benchmarks/resize_and_throughput.py's, no sleep), samples/s over 10-epoch windows from
  ``run.history``, after one warm-up epoch;
- torchrun + DistributedDataParallel (benchmarks/ddp_baseline.py): one ``torchrun --nnodes 2
  --nproc_per_node 1`` per host, started over the same ssh, static rendezvous on host 1's
  address; run before and after the pool so the two never share the cores;
- the same for benchmarks/gpt.py's GPT decoder (``--gpt-sizes``, default 5M; global batch 8
  sequences of 64 bytes, 3 warm-up + 20 timed steps, as benchmarks/gpt_throughput.py), ours
  and torchrun alternating ``--pairs`` times.

Needs root (namespaces) and openssh-server (``make test`` installs it). Run with ``make
benchmark``; figures in BENCHMARKS.md ("Across two hosts").
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]

import gpt  # noqa: E402
from netns_hosts import Hosts  # noqa: E402
from resize_and_throughput import (CHUNK_EPOCHS, CHUNKS, GLOBAL_BATCH,  # noqa: E402
                                   QUICKSTART_CELL, SEED, STEPS_PER_EPOCH, TIMEOUT,
                                   TRAIN_SAMPLES, spread, throughput_window, wait_until,
                                   window_throughputs)

PORT = 29561  # torchrun's rendezvous on host 1
GPT_SEQ, GPT_BATCH, GPT_WARMUP, GPT_STEPS = 64, 8, 3, 20  # as gpt_throughput.py's defaults


def torchrun_across(hosts: Hosts, script: list[str]) -> dict:
    """One ``torchrun --nnodes 2 --nproc_per_node 1`` per host (node ranks 0 and 1) running
    `script` (a worker of benchmarks/ and its arguments); rank 0's JSON line."""
    procs = []
    for rank, address in enumerate(hosts.names):
        command = (f"cd {HERE} && env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0"
                   f" PYTHONPATH={HERE} {sys.executable} -m torch.distributed.run --nnodes 2 "
                   f"--nproc_per_node 1 --node_rank {rank} --master_addr {hosts.names[0]} "
                   f"--master_port {PORT} " + " ".join(script))
        procs.append(subprocess.Popen(["ssh", *hosts.ssh_args, address, command],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=TIMEOUT * 5) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"torchrun across hosts failed: {outs}")
    return json.loads([line for line in outs[0][0].splitlines() if line.startswith("{")][-1])


def ddp_quickstart(hosts: Hosts) -> list[float]:
    """torchrun + DDP on the quick-start cell; samples/s of each window."""
    result = torchrun_across(hosts, ["ddp_baseline.py", "--skip-epochs", "1", "--chunks",
                                     str(CHUNKS), "--chunk-epochs", str(CHUNK_EPOCHS)])
    if (result["dataset"], result["steps_per_epoch"]) != (TRAIN_SAMPLES, STEPS_PER_EPOCH):
        raise RuntimeError(f"DDP baseline trained on other data: {result}")
    return result["samples_per_s"]


def ddp_gpt(hosts: Hosts, size: str) -> float:
    """torchrun + DDP on benchmarks/gpt.py's cell; samples/s over the timed steps."""
    return torchrun_across(hosts, ["gpt_ddp.py", "--size", size, "--seq-len", str(GPT_SEQ),
                                   "--global-batch", str(GPT_BATCH), "--warmup",
                                   str(GPT_WARMUP), "--steps", str(GPT_STEPS)])["samples_per_s"]


@contextlib.contextmanager
def pool_across(hosts: Hosts):
    """A pool of one SSH engine per host, and a workspace the hosts share."""
    from elastic_jupyter import EnginePool
    from elastic_jupyter.pool.launchers import SSHLauncher
    first, second = hosts.names
    launcher = SSHLauncher(f"{first}:1,{second}:1", ssh_args=hosts.ssh_args,
                           interface=hosts.bridge)
    pool = EnginePool(n=2, min_size=1, max_size=2, launcher=launcher).start()
    try:
        if sorted(e.host for e in pool.engine_sets.engines) != sorted(hosts.names):
            raise RuntimeError(f"the engines are not one per host: {pool.status()}")
        yield pool, tempfile.mkdtemp(dir="/var/tmp")  # the hosts' /tmp is their own
    finally:
        pool.stop()


def ours_quickstart(hosts: Hosts) -> list[float]:
    """The quick-start cell; samples/s of each window."""
    from elastic_jupyter import RunConfig, TrainingRun
    with pool_across(hosts) as (pool, workspace):
        config = RunConfig(name="hosts-quickstart", global_batch=GLOBAL_BATCH, steps=10**6,
                           checkpoint_every=0, seed=SEED)
        run = TrainingRun(pool, config, source=QUICKSTART_CELL, workspace=workspace).start()
        first_step, last_step = throughput_window(0)
        wait_until(lambda: run.step >= last_step or run.state not in ("starting", "training"),
                   f"step {last_step}", timeout=TIMEOUT * 5)
        run.stop()
        if run.wait(timeout=60) != "stopped":
            raise RuntimeError(f"the run ended {run.state}: {run.logs()[-2000:]}")
    records = {r["step"]: r for r in run.history}
    return window_throughputs(records, first_step, last_step)


def ours_gpt(hosts: Hosts, size: str) -> float:
    """benchmarks/gpt.py's cell; samples/s over the timed steps (as gpt_throughput.py)."""
    from elastic_jupyter import RunConfig, TrainingRun
    with pool_across(hosts) as (pool, workspace):
        config = RunConfig(name=f"hosts-gpt-{size}", global_batch=GPT_BATCH,
                           steps=GPT_WARMUP + GPT_STEPS, checkpoint_every=0, seed=0)
        run = TrainingRun(pool, config, source=gpt.cell(size, GPT_SEQ),
                          workspace=workspace).start()
        if run.wait(timeout=TIMEOUT * 10) != "finished":
            raise RuntimeError(run.logs()[-2000:])
    stamps = [r["time"] for r in run.history][GPT_WARMUP - 1:]
    return GPT_STEPS * GPT_BATCH / (stamps[-1] - stamps[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpt-sizes", nargs="*", default=["5M"], choices=list(gpt.SIZES))
    parser.add_argument("--pairs", type=int, default=3, help="alternations per GPT size")
    args = parser.parse_args()
    t0 = time.perf_counter()
    rows = []
    with Hosts(2) as hosts:
        print(f"two namespace hosts {hosts.names}, one rank per host, gloo over the veth "
              "pairs, one thread each", flush=True)
        print("quick-start cell: torchrun + DDP, the pool, torchrun + DDP again...", flush=True)
        before = ddp_quickstart(hosts)
        ours = ours_quickstart(hosts)
        after = ddp_quickstart(hosts)
        print(f"  ours {[round(x) for x in ours]}, DDP before {[round(x) for x in before]}, "
              f"after {[round(x) for x in after]} (samples/s)", flush=True)
        ddp = before + after
        rows.append(("quick-start cell (10 k parameters, global batch 64)",
                     f"{statistics.median(ours):.0f} ({spread(ours, 0)})",
                     f"{statistics.median(ddp):.0f} ({spread(ddp, 0)})",
                     f"{statistics.median(ours) / statistics.median(ddp):.2f}"))
        for size in args.gpt_sizes:
            print(f"GPT {size}: {args.pairs} pairs, ours first...", flush=True)
            pairs = [(ours_gpt(hosts, size), ddp_gpt(hosts, size)) for _ in range(args.pairs)]
            ratios = [a / b for a, b in pairs]
            print(f"  pairs (samples/s): {[(round(a, 1), round(b, 1)) for a, b in pairs]}")
            rows.append((f"GPT {size} ({gpt.parameters(size) / 1e6:.1f} M parameters, global "
                         f"batch {GPT_BATCH} x {GPT_SEQ} bytes)",
                         f"{statistics.median(a for a, _ in pairs):.1f}",
                         f"{statistics.median(b for _, b in pairs):.1f}",
                         f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"))
    print("\n| cell | ours samples/s | torchrun + DDP samples/s | ours / DDP |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\ntotal benchmark time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
