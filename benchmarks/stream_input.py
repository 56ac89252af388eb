"""Streaming input (engine.data.stream_split): its reading against a plain DataLoader, and what
opening the streams costs a new generation.

The data: 8 JSON-lines shard files of 2,000 samples, each 256 token ids (as a tokenised
pre-training corpus), read by ``datasets`` streaming with ``with_format("torch")``. One
invocation measures, in this process (no engines, no model: the input side alone):

1. Reading speed (samples/s) of one epoch (125 steps of a global batch of 128: each file read
   whole by every side), collated by torch's default collate, with 2 loader processes: a plain
   ``DataLoader(dataset, batch_size=16, num_workers=2)`` (datasets splits its files over the
   processes; 16 samples a batch, the size of the run's passes: 8 micro-batches a step), the
   same with ``batch_size=128`` (a step in one batch), and one rank's ``StreamPipeline`` over
   the run's 8 streams (the rank of a world of 1 reads all of them, 4 per process). Rounds
   alternate; median ratios are reported.
2. Opening the 8 streams at step 100 of an epoch (12,800 samples in): from each stream's
   committed state (``load_state_dict``, as a resize does) against reading each again from the
   epoch's start and skipping (a stream without a state), in seconds until the step's first
   batch.

Run: ``python benchmarks/stream_input.py``; the figures are recorded in BENCHMARKS.md.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only
import datasets  # noqa: E402  (after the offline switch)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from elastic_jupyter.engine.data.batching import BatchPlan, Cut  # noqa: E402
from elastic_jupyter.engine.state.training_state import Progress  # noqa: E402
from elastic_jupyter.engine.data.stream_pipeline import StreamPipeline  # noqa: E402
from elastic_jupyter.engine.data.stream_split import Streams  # noqa: E402

SHARDS, PER_SHARD, TOKENS, BATCH, STEPS, WORKERS, PAIRS = 8, 2000, 256, 128, 125, 2, 3


def write_shards(folder: str) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    files = []
    for s in range(SHARDS):
        path = os.path.join(folder, f"part-{s:02d}.jsonl")
        tokens = torch.randint(0, 50000, (PER_SHARD, TOKENS), generator=gen).tolist()
        with open(path, "w") as f:
            for i, row in enumerate(tokens):
                f.write(json.dumps({"id": s * PER_SHARD + i, "tokens": row}) + "\n")
        files.append(path)
    return files


def dataset(files):
    return datasets.load_dataset("json", data_files=files, streaming=True,
                                 split="train").with_format("torch")


def plain_loader(files, batch_size: int) -> float:
    loader = torch.utils.data.DataLoader(dataset(files), batch_size=batch_size,
                                         num_workers=WORKERS)
    start, batches = time.perf_counter(), iter(loader)
    for _ in range(STEPS * BATCH // batch_size):
        next(batches)
    return STEPS * BATCH / (time.perf_counter() - start)


def pipeline(files, progress: Progress, workers: int = WORKERS):
    streams = Streams(dataset(files), SHARDS, SHARDS * PER_SHARD, BATCH)
    streams.check()
    plan = BatchPlan(len(streams), BATCH, 0, Cut(virtual=SHARDS, max_size=SHARDS),
                     shuffle=False)
    pipe = StreamPipeline(streams, plan, 0, workers, torch.utils.data.default_collate, None,
                          False, lambda: progress)
    return plan, pipe


def ours(files) -> float:
    progress = Progress()
    plan, pipe = pipeline(files, progress)
    passes = lambda batch: plan.rank_micro_batches(batch, 0, 1)  # noqa: E731
    start = time.perf_counter()
    epoch, position = 0, 0
    for step in range(STEPS):
        for _ in passes(plan.batch(epoch, position)):
            pipe.next((0, 1, epoch, position), passes, STEPS - step)
        epoch, position = plan.advance(epoch, position)
        pipe.moved_to((0, 1, epoch, position))
    seconds = time.perf_counter() - start
    pipe.stop()
    return STEPS * BATCH / seconds


def opening(files, with_states: bool, at_step: int = 100) -> float:
    """Seconds until the first batch of step `at_step`, each stream opened from its state at
    that step (read once before, untimed) or read again from the epoch's start."""
    progress = Progress()
    plan, pipe = pipeline(files, progress, workers=0)
    passes = lambda batch: plan.rank_micro_batches(batch, 0, 1)  # noqa: E731
    epoch, position = 0, 0
    for step in range(at_step):  # read up to there, keeping the committed states
        for _ in passes(plan.batch(epoch, position)):
            pipe.next((0, 1, epoch, position), passes, at_step + 1 - step)
        epoch, position = plan.advance(epoch, position)
        progress.epoch, progress.position, progress.step = epoch, position, step + 1
        pipe.moved_to((0, 1, epoch, position))
    pipe.stop()
    if not with_states:
        progress.streams["states"] = {}
    plan, fresh = pipeline(files, progress, workers=0)
    start = time.perf_counter()
    fresh.next((0, 1, epoch, position), passes, 1)  # the first pass: stream 0
    for _ in passes(plan.batch(epoch, position))[1:]:
        fresh.next((0, 1, epoch, position), passes, 1)
    return time.perf_counter() - start


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        files = write_shards(folder)
        rows = []
        for _ in range(PAIRS):
            rows.append((plain_loader(files, BATCH // SHARDS), plain_loader(files, BATCH),
                         ours(files)))
        print("reading, samples/s (DataLoader batch 16, DataLoader batch 128, streams):",
              [tuple(round(v) for v in row) for row in rows])
        for k, what in ((0, "batch 16"), (1, "batch 128")):
            ratios = [row[2] / row[k] for row in rows]
            print(f"streams / plain DataLoader ({what}): median {statistics.median(ratios):.2f} "
                  f"x ({min(ratios):.2f}-{max(ratios):.2f})")
        resumed = statistics.median(opening(files, True) for _ in range(3))
        reread = statistics.median(opening(files, False) for _ in range(3))
        print(f"opening 8 streams at step 100 (12,800 samples in): from their states "
              f"{resumed:.3f} s, read again {reread:.3f} s ({reread / resumed:.1f} x)")


if __name__ == "__main__":
    main()
