"""torchrun worker for the DDP (or FSDP2) side of benchmarks/gpt_throughput.py.

Launched as ``python -m torch.distributed.run --standalone --nproc_per_node 2 gpt_ddp.py
--size 50M --seq-len 64 --global-batch 8 --warmup 3 --steps 20 [--transform-ms 0] [--workers 0]``.
It executes the same cell the elastic run executes (benchmarks/gpt.py ``cell``, with the same
``--transform-ms``), wraps the model in DistributedDataParallel (gloo) and reads its share of
each step through a DistributedSampler and a DataLoader with ``--workers`` processes (persistent;
0: in the training process). After the timed steps rank 0 writes a final checkpoint (model and
optimizer, fsynced, into a temporary folder), as the elastic run does. Rank 0 prints one JSON
line: samples/s over the timed steps, and every rank's peak resident memory (VmHWM, bytes), the
checkpoint's included. With ``--fsdp2`` the model is sharded with FSDP2 as ``--shard`` shards
it (``fully_shard`` on each block, then the root; the optimizer made again over the sharded
parameters) instead of wrapped in DDP, and each rank writes its own part of the checkpoint.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import gpt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", choices=list(gpt.SIZES), required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transform-ms", type=float, default=0.0)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--fsdp2", action="store_true", help="FSDP2 per block instead of DDP")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # as the engines do
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    objects = {"__name__": "__ddp_cell__"}
    source = gpt.cell(args.size, args.seq_len, transform_ms=args.transform_ms)
    exec(compile(source, "<gpt cell>", "exec"), objects)
    model, optimizer = objects["model"], objects["optimizer"]
    if args.fsdp2:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        accepted = inspect.signature(type(optimizer)).parameters  # `defaults` may hold more
        optimizer = type(optimizer)(model.parameters(), **{
            k: v for k, v in optimizer.defaults.items() if k in accepted})
    else:
        model = DistributedDataParallel(model)
    sampler = DistributedSampler(objects["dataset"], num_replicas=world, rank=rank,
                                 seed=args.seed)
    loader = iter(DataLoader(objects["dataset"], batch_size=args.global_batch // world,
                             sampler=sampler, num_workers=args.workers,
                             persistent_workers=args.workers > 0))
    loss_fn = objects["loss_fn"]
    ends = []  # each step's end, rank 0's clock (the per-step times, as ours are read)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dist.barrier()
            start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model, next(loader)).backward()
        optimizer.step()
        ends.append(time.perf_counter())
    dist.barrier()
    seconds = time.perf_counter() - start
    if rank == 0 or args.fsdp2:  # the final checkpoint, as the elastic run writes one
        with tempfile.TemporaryDirectory() as folder, \
                open(os.path.join(folder, "final.pt"), "wb") as f:
            torch.save({"model": (model if args.fsdp2 else model.module).state_dict(),
                        "optimizer": optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
    peaks = [None] * world
    dist.all_gather_object(peaks, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if rank == 0:
        print(json.dumps({"samples_per_s": args.steps * args.global_batch / seconds,
                          "peak_rss": peaks, "parameters": gpt.parameters(args.size),
                          "step_s": [b - a for a, b in zip(ends, ends[1:])]}),
              flush=True)
    dist.destroy_process_group()
    # skip the interpreter's teardown, where a process that used gloo sometimes aborts
    # ("terminate called without an active exception") after its work is done
    os._exit(0)


if __name__ == "__main__":
    main()
