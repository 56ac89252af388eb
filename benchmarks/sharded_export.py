"""``run.export()`` of a sharded run: its model written to one ``torch.save`` file a tensor at a
time (run/streamed_export.py), against gathering it whole and ``torch.save`` (the way before).

A sharded checkpoint of the GPT of benchmarks/gpt.py (``--size``, 200M by default) is written
as ``--world-size`` ranks write one (engine/sharded/checkpoint_parts.py ``write_part`` and
``commit``; each rank's rows of every parameter and AdamW's two moments, from the model's own
tensors cut by rows: no process group needed). Then, alternating, ``--repeats`` times each:

- streamed: ``write_streamed(path, model_layout(folder), read_model(folder))``, what
  ``run.export()`` does for a sharded run;
- whole: ``torch.save(load_whole(folder)["model"])`` after an atomic write, what it did before.

Each in a fresh process (one thread), after the page cache was dropped when this runs as root
(else the parts are read from the cache). Printed: seconds, and the peak of the process's
anonymous resident memory (``RssAnon``, sampled every 5 ms) above where it started; the
model's bytes beside them. The file's own pages (page cache, which the kernel writes back and
evicts as it needs) are not in it. Both files are checked equal.

Run: ``python benchmarks/sharded_export.py [--size 200M]``; figures in BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gpt  # noqa: E402  (benchmarks/ is not a package)

ONE = '''
import json, os, sys, threading, time
import torch
torch.set_num_threads(1)
from elastic_jupyter.engine.state import checkpoint as ckpt
from elastic_jupyter.engine.sharded.checkpoint_parts import load_whole, model_layout, read_model
from elastic_jupyter.run.streamed_export import write_streamed

def anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))

start, peak, done = anon(), [0], threading.Event()
def sample():
    while not done.wait(0.005):
        peak[0] = max(peak[0], anon())
threading.Thread(target=sample, daemon=True).start()
folder, out, how = sys.argv[1:4]
t0 = time.perf_counter()
if how == "streamed":
    write_streamed(out, model_layout(folder), read_model(folder, copy=False))
else:
    weights = load_whole(folder)["model"]
    ckpt.atomic_write(out, lambda f: torch.save(weights, f))
    del weights
seconds = time.perf_counter() - t0
done.set()
print(json.dumps({"seconds": seconds, "peak_anon": max(peak[0], anon()) - start}))
'''


def write_checkpoint(size: str, world_size: int, folder: str) -> int:
    """A sharded checkpoint of `size`'s GPT with AdamW's moments, as `world_size` ranks write
    it; returns the model's bytes."""
    import torch

    from elastic_jupyter.engine.sharded.reshard import chunk_rows
    from elastic_jupyter.engine.sharded.checkpoint_parts import commit, write_part
    from elastic_jupyter.engine.sharded.resizable_model import Snapshot
    layers, width, heads = gpt.SIZES[size]
    model = gpt.GPT(layers, width, heads)
    params = dict(model.named_parameters())
    first = None  # rank 0's part: the manifest takes its names, dtypes and buffers
    for rank in range(world_size):
        parts = {}
        for name, p in params.items():
            a, b = chunk_rows(p.shape[0], world_size, rank)
            rows = p.detach()[a:b]
            parts[name, None] = rows
            parts[name, "exp_avg"] = torch.randn_like(rows)
            parts[name, "exp_avg_sq"] = torch.rand_like(rows)
        part = Snapshot(parts, {n: {"step": torch.tensor(1.0)} for n in params},
                        dict(model.named_buffers()))
        write_part(folder, 1, 0, part, rank, world_size)
        first = first or part
    commit(folder, 1, 0, world_size, first, {n: p.shape for n, p in params.items()},
           {"progress": {"step": 1}}, threading.Event(), 60)
    return sum(p.numel() * p.element_size() for p in params.values())


def drop_cache() -> None:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:  # not root: the parts come from the cache
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="200M", choices=list(gpt.SIZES))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--folder", default="/var/tmp",
                        help="where the checkpoint and the files go (a disk, not tmpfs)")
    args = parser.parse_args()
    import torch
    with tempfile.TemporaryDirectory(dir=args.folder) as work:
        model_bytes = write_checkpoint(args.size, args.world_size, os.path.join(work, "ckpt"))
        folder = os.path.join(work, "ckpt", "step-00000001.shards")
        written = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        print(f"{args.size}: model {model_bytes / 2**30:.2f} GiB, checkpoint "
              f"{written / 2**30:.2f} GiB in {args.world_size} parts", flush=True)
        results: dict[str, list] = {"streamed": [], "whole": []}
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for _ in range(args.repeats):
            for how in results:
                drop_cache()
                out = os.path.join(work, f"{how}.pt")
                done = subprocess.run([sys.executable, "-c", ONE, folder, out, how], env=env,
                                      capture_output=True, text=True, check=True)
                results[how].append(json.loads(done.stdout.splitlines()[-1]))
                print(f"  {how}: {results[how][-1]}", flush=True)
        streamed = torch.load(os.path.join(work, "streamed.pt"), weights_only=True, mmap=True)
        whole = torch.load(os.path.join(work, "whole.pt"), weights_only=True, mmap=True)
        assert streamed.keys() == whole.keys()
        assert all(torch.equal(streamed[k], whole[k]) for k in whole), "the files differ"
    print("| way | seconds (median) | peak anonymous memory (median) | / the model's bytes |")
    print("|---|---|---|---|")
    for how, runs in results.items():
        seconds = sorted(r["seconds"] for r in runs)[len(runs) // 2]
        peak = sorted(r["peak_anon"] for r in runs)[len(runs) // 2]
        print(f"| {how} | {seconds:.2f} | {peak / 2**30:.2f} GiB | {peak / model_bytes:.2f} |")


if __name__ == "__main__":
    main()
