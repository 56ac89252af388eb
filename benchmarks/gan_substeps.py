"""Several optimizers (engine.step.optimizers): what a GAN's step sums across ranks when each
sub-step sums only its own optimizer's buckets, against summing every bucket in every sub-step.

Two ranks (processes, gloo on loopback) run the reduction side of a step as the Worker does
(engine.group.reduce.GradReducer: begin_step, the backward pass, last_pass, finish): an MLP GAN on
28x28 images, generator 64 -> 1024 -> 1024 -> 784 and discriminator 784 -> 1024 -> 1024 -> 1
(about 1.9 M parameters each, float32), a micro-batch of 64 per rank, the discriminator's
sub-step (real against detached fakes), then the generator's (through the discriminator). The
two ways alternate in rounds of 20 steps; the median step time and the elements summed per
step are reported.

Run: ``python benchmarks/gan_substeps.py [--rounds 5]``; the figures are in BENCHMARKS.md.
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from elastic_jupyter.engine.group.reduce import GradReducer  # noqa: E402

STEPS, BATCH = 20, 64


def _mlp(*sizes: int) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.LeakyReLU(0.2)]
    return torch.nn.Sequential(*layers[:-1])


def _round(reducer, g, d, optimizers) -> float:
    """STEPS steps of both sub-steps; returns seconds per step."""
    start = time.perf_counter()
    for _ in range(STEPS):
        z, real = torch.randn(BATCH, 64), torch.rand(BATCH, 784)
        for owner, loss in ((0, lambda: -(d(real).mean() - d(g(z).detach()).mean())),
                            (1, lambda: -d(g(z)).mean())):
            reducer.begin_step(owner)
            reducer.last_pass(True)
            loss().backward()
            reducer.finish(2)
            optimizers[owner].step()
    return (time.perf_counter() - start) / STEPS


def _rank(rank: int, store: str, rounds: int, out: str) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    torch.manual_seed(0)
    g, d = _mlp(64, 1024, 1024, 784), _mlp(784, 1024, 1024, 1)
    model = torch.nn.ModuleDict({"g": g, "d": d})
    optimizers = [torch.optim.Adam(d.parameters(), 1e-4), torch.optim.Adam(g.parameters(), 1e-4)]
    owners = {id(p): k for k, part in enumerate((d, g)) for p in part.parameters()}
    ways = {"own buckets": owners, "every bucket": None}
    sent: list = []
    all_reduce = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        sent.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)
    dist.all_reduce = counted
    times: dict[str, list[float]] = {name: [] for name in ways}
    elements: dict[str, int] = {}
    for r in range(rounds + 1):  # the first round of each is a warm-up
        for name, way in ways.items():
            reducer = GradReducer(model, torch.device("cpu"), owners=way)
            sent.clear()
            seconds = _round(reducer, g, d, optimizers)
            reducer.close()
            if r:
                times[name].append(seconds)
            elements[name] = sum(sent) // STEPS
    if rank == 0:
        torch.save((times, elements), out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "out.pt")
        mp.spawn(_rank, args=(os.path.join(folder, "store"), args.rounds, out), nprocs=2)
        times, elements = torch.load(out)
    for name in times:
        print(f"{name}: {elements[name]:,} elements summed a step, median "
              f"{statistics.median(times[name]) * 1000:.1f} ms a step "
              f"({', '.join(f'{t * 1000:.1f}' for t in times[name])})")
    ratio = statistics.median(a / b for a, b in zip(times["own buckets"], times["every bucket"]))
    print(f"own buckets / every bucket: step time {ratio:.2f} x, elements "
          f"{elements['own buckets'] / elements['every bucket']:.2f} x")


if __name__ == "__main__":
    main()
