"""The state a newcomer receives on a grow: the bucketed tensor broadcast against the pickled one
it replaced, next to what the same bytes cost as a memcpy and as one ``dist.broadcast``.

For each GPT size (benchmarks/gpt.py; AdamW after one step, so the state is the parameters and
twice their size in moments), two processes on one gloo group (one thread each, as engines
run): rank 0 holds the trained state, rank 1 a fresh model. Timed from a barrier to the
receiver having loaded the state (model and optimizer), median of ``--repeats``:

- ``pickled``: rank 0 captures a CPU copy and ``broadcast_object_list`` sends it (what a
  generation start did before engine.group.state_transfer);
- ``buckets``: ``engine.group.state_transfer.broadcast_state`` of the live state, received into the
  receiver's own model tensors (``into``), as a generation's start does;
- ``broadcast``: one ``dist.broadcast`` of a flat tensor of the same bytes (the achievable limit
  on this backend) and ``memcpy``: one copy of those bytes in memory.

Usage: ``.venv/bin/python benchmarks/state_transfer.py [--sizes 5M 50M 200M] [--repeats 3]``
(the pickled path is timed up to 50M: at 200M it needs more than 24 GB of memory).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpt  # noqa: E402
from elastic_jupyter.engine.state import training_state as state_mod  # noqa: E402
from elastic_jupyter.engine.group.state_transfer import broadcast_state  # noqa: E402


def _objects(size: str, rank: int):
    torch.manual_seed(rank)
    model = gpt.GPT(*gpt.SIZES[size], max_seq=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if rank == 0:  # moments exist after a step; a newcomer's optimizer is empty
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def _capture(model, optimizer, copy: bool) -> dict:
    return state_mod.capture(model, optimizer, None, state_mod.Progress(step=1), [], {},
                             copy_tensors=copy)


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _rank(rank: int, size: str, repeats: int, pickled_too: bool, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    model, optimizer = _objects(size, rank)
    nbytes = sum(t.numel() * t.element_size() for t in
                 [*model.state_dict().values(),
                  *(v for s in optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor))]) if rank == 0 else 0
    sizes = [nbytes]
    dist.broadcast_object_list(sizes, src=0)
    receiver = _objects(size, 1) if rank == 1 else None

    def pickled():
        box = [_capture(model, optimizer, True) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        if rank == 1:
            state_mod.restore(box[0], *receiver, None)

    def buckets():  # as a generation's start: a newcomer's model takes the bytes in place
        # (its optimizer is empty: only the model, whatever the earlier repeats left there)
        state = broadcast_state(_capture(model, optimizer, False) if rank == 0 else None, rank,
                                torch.device("cpu"),
                                into={"model": receiver[0].state_dict()} if rank == 1 else None)
        if rank == 1:
            state_mod.restore(state, *receiver, None)

    times = {name: [] for name in ("pickled", "buckets", "broadcast", "memcpy")}
    for _ in range(repeats):
        if pickled_too:
            times["pickled"].append(_timed(pickled))
        times["buckets"].append(_timed(buckets))
    del receiver  # the references' buffers after it: the same memory pressure for all
    flat = torch.ones(sizes[0], dtype=torch.uint8)
    copy = torch.ones_like(flat)
    for _ in range(repeats):
        times["broadcast"].append(_timed(lambda: dist.broadcast(flat, src=0)))
        times["memcpy"].append(_timed(lambda: copy.copy_(flat)))
    if rank == 0:
        torch.save({"bytes": sizes[0], "times": times}, out)
    dist.destroy_process_group()


def measure(size: str, repeats: int, pickled_too: bool) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "result.pt")
        mp.spawn(_rank, args=(size, repeats, pickled_too, os.path.join(folder, "store"), out),
                 nprocs=2)
        return torch.load(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(gpt.SIZES), choices=list(gpt.SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pickled-up-to", default="50M", choices=list(gpt.SIZES),
                        help="largest model to time the pickled path for (it needs 4 copies "
                             "of the state in memory)")
    args = parser.parse_args()
    print("| model | state | pickled | buckets | one broadcast | memcpy | buckets / broadcast |")
    print("|---|---|---|---|---|---|---|")
    for size in args.sizes:
        sizes = list(gpt.SIZES)
        pickled_too = sizes.index(size) <= sizes.index(args.pickled_up_to)
        result = measure(size, args.repeats, pickled_too)
        gb = result["bytes"] / 1e9
        med = {k: statistics.median(v) for k, v in result["times"].items() if v}
        cells = [f"{med[k]:.3f} s ({gb / med[k]:.2f} GB/s)" if k in med else "not run"
                 for k in ("pickled", "buckets", "broadcast", "memcpy")]
        print(f"| {size} | {gb:.2f} GB | " + " | ".join(cells) +
              f" | {med['buckets'] / med['broadcast']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
