"""Throughput of two commits side by side: a refactoring must not slow training down.

Checks out `--base` and `--head` (default: c2f1eda, the commit before issue 51's reshaping,
and HEAD) as git worktrees in a scratch folder and measures each on the same models `--pairs`
times. This machine's speed drifts by tens of percent within minutes, and the second of two
runs in a row reads a few percent slower, so each pair runs base, head, head, base and its
ratio is sqrt(head1 head2 / (base1 base2)): a linear drift and the order cancel. The table
gives the median of the per-pair ratios head / base and their range.

Each measurement is a fresh Python process whose ``elastic_jupyter`` is the worktree's (by
``PYTHONPATH``; the process checks which one it imported): a fresh pool of 2 CPU engines, one
run at world size 2 with no checkpoint and no resize, its throughput read from the per-step
time stamps of ``run.history`` after the warm-up steps. The models:

- ``quickstart``: notebooks/01_quickstart.ipynb's digits MLP (global batch 64), 1,500 steps: a
  step is milliseconds, so the control plane's cost per step (the vote, the driver's looks)
  is what is measured;
- ``50M``: benchmarks/gpt.py's 50.1 M-parameter decoder (global batch 8 sequences of 64
  bytes), 15 steps: the compute and the gradient reductions.

Both sides run this file's child code against their own package, so only the package
differs. Usage: ``.venv/bin/python benchmarks/worktree_throughput.py [--base REV] [--head REV]
[--pairs 5] [--models quickstart 50M]``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

QUICKSTART = """
import torch
from sklearn.datasets import load_digits

X, y = load_digits(return_X_y=True)
dataset = torch.utils.data.TensorDataset(torch.tensor(X, dtype=torch.float32) / 16,
                                         torch.tensor(y))
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)
"""

# model: (global batch, warm-up steps, timed steps)
# (300 quick-start steps, 1.5 s, gave ratios from 0.90 to 1.01 for the same code)
MODELS = {"quickstart": (64, 20, 1500), "50M": (8, 3, 12)}


def child(model: str, tree: str) -> dict:
    """One measurement with the package of `tree` (this process's PYTHONPATH)."""
    import elastic_jupyter
    from elastic_jupyter import EnginePool, RunConfig, TrainingRun
    imported = os.path.realpath(elastic_jupyter.__file__)
    if not imported.startswith(os.path.realpath(tree) + os.sep):
        raise RuntimeError(f"imported {imported}, not the worktree {tree}'s package")
    global_batch, warmup, steps = MODELS[model]
    if model == "quickstart":
        source = QUICKSTART
    else:
        sys.path.insert(0, HERE)
        import gpt
        source = gpt.cell(model, 64)
    pool = EnginePool(n=2, min_size=1, max_size=2, gpus="none").start()
    try:
        with tempfile.TemporaryDirectory() as workspace:
            config = RunConfig(name=f"ab-{model}", global_batch=global_batch,
                               steps=warmup + steps, checkpoint_every=0, seed=0)
            run = TrainingRun(pool, config, source=source, workspace=workspace).start()
            if run.wait(timeout=3600) != "finished":
                raise RuntimeError(run.logs())
            stamps = [r["time"] for r in run.history]
            timed = stamps[warmup - 1:]  # the end of the last warm-up step starts the clock
        return {"samples_per_s": steps * global_batch / (timed[-1] - timed[0])}
    finally:
        pool.stop()


def measure(model: str, tree: str) -> float:
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", model, tree],
                         env=env, capture_output=True, text=True, timeout=3600,
                         cwd=tempfile.gettempdir())
    printed = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not printed:
        raise RuntimeError(f"{model} on {tree} failed:\n{out.stdout}\n{out.stderr}")
    return json.loads(printed[-1])["samples_per_s"]


def worktree(rev: str, scratch: str, name: str) -> str:
    path = os.path.join(scratch, name)
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", path, rev], check=True,
                   capture_output=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="c2f1eda")
    parser.add_argument("--head", default="HEAD")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "TREE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)), flush=True)
        return
    with tempfile.TemporaryDirectory() as scratch:
        trees = {"base": worktree(args.base, scratch, "base"),
                 "head": worktree(args.head, scratch, "head")}
        try:
            rows = []
            for model in args.models:
                speeds: dict[str, list[float]] = {"base": [], "head": []}
                ratios = []
                for pair in range(args.pairs):
                    got = [measure(model, trees[side]) for side in ("base", "head", "head", "base")]
                    speeds["base"] += [got[0], got[3]]
                    speeds["head"] += [got[1], got[2]]
                    ratios.append(math.sqrt(got[1] * got[2] / (got[0] * got[3])))
                    print(f"{model} pair {pair + 1}: base {got[0]:.1f} {got[3]:.1f}, head "
                          f"{got[1]:.1f} {got[2]:.1f} samples/s: {ratios[-1]:.3f}", flush=True)
                rows.append((model, statistics.median(speeds["base"]),
                             statistics.median(speeds["head"]), statistics.median(ratios),
                             min(ratios), max(ratios)))
        finally:
            for path in trees.values():
                subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", path],
                               capture_output=True)
    print(f"\nbase {args.base}, head {args.head}, {args.pairs} pairs, world size 2\n")
    print("| model | base samples/s | head samples/s | head / base (median, range) |")
    print("|---|---|---|---|")
    for model, base, head, median, low, high in rows:
        print(f"| {model} | {base:.1f} | {head:.1f} | {median:.3f} ({low:.3f}-{high:.3f}) |")


if __name__ == "__main__":
    main()
