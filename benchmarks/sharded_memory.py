"""A GPT whose replicated training state exceeds a rank's budget, trained with ``shard=True``
at 2 and 3 ranks and resized between them: each rank's peak memory against plain FSDP2's.

The model is benchmarks/gpt.py's (``--size``, 200M by default) with AdamW in fp32: replicated,
every rank holds 16 bytes per parameter N (parameters, gradients, two moments) before
activations. The budget is 0.75 x 16 N per rank, which the replicated mode exceeds and the
sharded one meets from 2 ranks.

Our run goes through the engine's generations (``Worker`` and ``run_generation``; this script
plays the owner, as tests/test_sharded_resize.py does): 2 ranks for 3 steps, 3 ranks (a
newcomer sent its rows) for 3 steps, 2 ranks again (rank 2 named: it hands its rows over) for
2 steps. The baseline is the same model, optimizer and batches in a plain FSDP2 loop
(``fully_shard`` per block, then the root) at 2 and at 3 processes. Every process samples its
resident memory every 20 ms (CPU slots: the host memory is the training memory), tagged with
what it does: setting up, training at W ranks, starting a generation (the resize), handing
over. The partner replicas (its own part and its partner's, host memory) are in the resident
figure; the training memory is the resident less their host bytes (the issue reports them
beside the budget), and its aim is a peak per rank <= 1.15 x FSDP2's + two shards (a resize's
old and new one).

Run: ``python benchmarks/sharded_memory.py [--size 200M]``; figures in BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from typing import Callable

import psutil
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, SIZES, cell, parameters  # noqa: E402

from elastic_jupyter.engine.entrypoints import _run_setup  # noqa: E402
from elastic_jupyter.engine.generation import run_generation  # noqa: E402
from elastic_jupyter.engine.protocol import GenerationSpec  # noqa: E402
from elastic_jupyter.engine.sharded.resizable_model import default_units  # noqa: E402
from elastic_jupyter.engine.worker import Worker  # noqa: E402
from elastic_jupyter.run.rendezvous import Rendezvous  # noqa: E402

SEQ, BATCH, MICRO = 64, 4, 2
# (engines by rank, leave after this step, ranks that go then)
SCHEDULE = [([0, 1], 3, ""), ([0, 1, 2], 6, "2"), ([0, 1], None, "")]
STEPS = 8


class Sampler:
    """Resident memory every 20 ms, the peak kept per phase (what the process does); with
    `beside` (the host bytes the partner replicas hold), the peak of the resident memory less
    them (the training memory) and the peak of them, per phase too."""

    def __init__(self):
        self.phase, self.peaks = "setup", {}
        self.beside: Callable[[], int] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(0.02):
            rss, phase = me.memory_info().rss, self.phase
            replicas = self.beside() if self.beside is not None else 0
            for key, value in ((phase, rss), (f"{phase} (training)", rss - replicas),
                               (f"{phase} (replicas)", replicas)):
                self.peaks[key] = max(self.peaks.get(key, 0), value)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return self.peaks


def _ours(engine: int, port: int, size: str, out: str) -> None:
    sampler = Sampler()
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=600))
    cfg = {"global_batch": BATCH, "micro_batch": MICRO, "seed": 0, "steps": STEPS,
           "shard": True, "replica_every": 10, "keep_checkpoints": 1}
    worker = None
    for generation, (members, end_at, _) in enumerate(SCHEDULE):
        if engine not in members:
            if worker is not None:
                break  # it left
            continue  # it joins later
        newcomer = worker is None and (generation > 0 or members.index(engine) > 0)
        if worker is None:
            sampler.phase = "setup"
            worker = Worker(_run_setup(cell(size, SEQ), None, {}, None), cfg, "cpu")
            _tag(worker, sampler)
            sampler.beside = lambda w=worker: w.mode.sharded.host_bytes
        W = len(members)
        sampler.phase = f"resize to {W}" if generation else f"start at {W}"
        spec = GenerationSpec(rank=members.index(engine), world_size=W, generation=generation,
                              backend="gloo", timeout=600.0, receive_state=newcomer,
                              end_at=end_at, broadcast=generation == 0 or not set(members) <= set(
                                  SCHEDULE[generation - 1][0]))
        run_generation(worker, spec, store)
    with open(f"{out}/ours-{engine}.json", "w") as f:
        json.dump(sampler.stop(), f)
    os._exit(0)  # gloo's teardown sometimes aborts after the work is done


def _tag(worker: Worker, sampler: Sampler) -> None:
    """Phases from the Worker's calls: a step trains at its world size; a leave hands over."""
    step, leave = worker.train_step, worker.mode.sharded.leave

    def train_step(rank, world_size, *args, **kwargs):
        sampler.phase = f"train at {world_size}"
        return step(rank, world_size, *args, **kwargs)

    def hand_over(*args, **kwargs):
        sampler.phase = "hand over"
        return leave(*args, **kwargs)
    worker.train_step, worker.mode.sharded.leave = train_step, hand_over


def _fsdp2(rank: int, world_size: int, port: int, size: str, out: str) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    sampler = Sampler()
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=600))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"fsdp{world_size}/", store),
                            rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = GPT(*SIZES[size], max_seq=SEQ)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for unit in default_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    sampler.phase = f"train at {world_size}"
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        for _ in range(BATCH // MICRO // world_size or 1):  # this rank's micro-batches
            tokens = torch.randint(0, 256, (MICRO, SEQ + 1), generator=generator)
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                              tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    with open(f"{out}/fsdp{world_size}-{rank}.json", "w") as f:
        json.dump(sampler.stop(), f)
    dist.destroy_process_group()
    os._exit(0)


def _processes(target, args_of, n: int) -> None:
    spawn = multiprocessing.get_context("spawn")
    processes = [spawn.Process(target=target, args=args_of(i)) for i in range(n)]
    for p in processes:
        p.start()
    for p in processes:
        p.join()
    assert all(p.exitcode == 0 for p in processes), [p.exitcode for p in processes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="200M", choices=sorted(SIZES))
    size = parser.parse_args().size
    out = tempfile.mkdtemp(prefix="sharded-memory-")
    rendezvous = Rendezvous(timeout=600.0)
    for generation, (_, end_at, leavers) in enumerate(SCHEDULE):
        rendezvous.request_end(generation, end_at, [int(r) for r in leavers.split(",") if r])
    started = time.time()
    _processes(_ours, lambda e: (e, rendezvous.port, size, out), 3)
    ours_s = time.time() - started
    for world_size in (2, 3):
        _processes(_fsdp2, lambda r, w=world_size: (r, w, rendezvous.port, size, out), world_size)
    n = parameters(size)
    # a replica holds a rank's part: its rows of the parameters and of AdamW's two moments
    budget, shard = 0.75 * 16 * n, {w: 12 * n / w for w in (2, 3)}
    fsdp = {w: max(json.load(open(f"{out}/fsdp{w}-{r}.json"))[f"train at {w}"]
                   for r in range(w)) for w in (2, 3)}
    print(f"{size} GPT: N = {n / 1e6:.0f} M parameters; replicated training state 16 N = "
          f"{16 * n / 2**30:.2f} GiB; budget 0.75 x 16 N = {budget / 2**30:.2f} GiB per rank; "
          f"our run {ours_s:.0f} s")
    print("plain FSDP2 peak per rank: " + ", ".join(
        f"{fsdp[w] / 2**30:.2f} GiB at {w}" for w in (2, 3)))
    print("per engine and phase: resident (GiB), training = resident less the replicas' host "
          "copies (x FSDP2's at that world size; aim 1.15 x FSDP2's + two shards, the old and "
          "the new one of a resize), the replicas beside")
    for engine in range(3):
        peaks = json.load(open(f"{out}/ours-{engine}.json"))
        for phase, peak in sorted(p for p in peaks.items() if "(" not in p[0]):
            w = 3 if "3" in phase else 2
            aim = 1.15 * fsdp[w] + 2 * shard[w]
            training, replicas = peaks[f"{phase} (training)"], peaks[f"{phase} (replicas)"]
            print(f"engine {engine} {phase}: resident {peak / 2**30:.2f}, training "
                  f"{training / 2**30:.2f} ({training / fsdp[w]:.2f} x; aim "
                  f"{aim / 2**30:.2f}: {'met' if training <= aim else 'NOT met'}), replicas "
                  f"{replicas / 2**30:.2f}")


if __name__ == "__main__":
    main()
