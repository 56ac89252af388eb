"""torchrun worker for the DDP baseline of benchmarks/resize_and_throughput.py.

Launched as ``python -m torch.distributed.run --standalone --nproc_per_node 2 ddp_baseline.py``.
It trains the quick-start model with plain DistributedDataParallel (gloo), a DistributedSampler
and a DataLoader (default collate, num_workers=0), global batch 64 split over the ranks. The
model, optimizer, dataset and loss come from executing the very cell the elastic run executes,
so both sides train the same thing. Rank 0 prints one JSON line: the throughput (samples/s) of
each of ``--chunks`` windows of ``--chunk-epochs`` whole epochs, after ``--skip-epochs`` warm-up
epochs. Several short windows rather than one long one show how noisy the machine is.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from resize_and_throughput import GLOBAL_BATCH, QUICKSTART_CELL, SEED


def build(rank: int, world: int):
    """The cell's objects, the model wrapped in DDP, and a loader of this rank's share."""
    torch.manual_seed(SEED)  # DDP broadcasts rank 0's weights anyway; this keeps runs alike
    objects = {"__name__": "__ddp_cell__"}
    exec(compile(QUICKSTART_CELL, "<quick-start cell>", "exec"), objects)
    model = DistributedDataParallel(objects["model"])  # the optimizer's parameters, wrapped
    sampler = DistributedSampler(objects["dataset"], num_replicas=world, rank=rank, seed=SEED)
    loader = DataLoader(objects["dataset"], batch_size=GLOBAL_BATCH // world, sampler=sampler,
                        num_workers=0)
    return model, objects["optimizer"], objects["loss_fn"], sampler, loader


def train(skip_epochs: int, chunks: int, chunk_epochs: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer, loss_fn, sampler, loader = build(rank, world)
    # a window's end stamp is the next one's start (as with the elastic run's step stamps)
    stamps = []
    for epoch in range(skip_epochs + chunks * chunk_epochs):
        if epoch >= skip_epochs and (epoch - skip_epochs) % chunk_epochs == 0:
            stamps.append(time.perf_counter())
        sampler.set_epoch(epoch)
        for batch in loader:
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()  # DDP averages the gradients over the ranks
            optimizer.step()
    stamps.append(time.perf_counter())
    # count the dataset's real samples, as the elastic run does (the sampler pads by one)
    samples = chunk_epochs * len(sampler.dataset)
    return {"samples_per_s": [samples / (b - a) for a, b in zip(stamps, stamps[1:])],
            "dataset": len(sampler.dataset), "steps_per_epoch": len(loader),
            "world_size": world, "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--skip-epochs", type=int, default=1)
    parser.add_argument("--chunks", type=int, default=5)
    parser.add_argument("--chunk-epochs", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # as the engines do
    dist.init_process_group("gloo")
    try:
        result = train(args.skip_epochs, args.chunks, args.chunk_epochs)
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
