"""Training a cell with real Workers on a real gloo process group, without ipyparallel, and the
same cell in a plain single-process PyTorch loop (the right answer).

``train(cell, config, world_size, steps, tmp_path)`` runs ``Worker.train_step`` on every rank
(world size 1 in this process; more in spawned processes whose process group and commit vote
go through a FileStore) and returns one
``Result`` per rank; the ranks measure the cost of a pass first, as a generation does.
``reference(cell, config, steps)`` trains the cell the way a user would
without this package: the whole global batch in one forward pass, ``loss.backward()``,
``optimizer.step()``, with the same samples in the same order.
"""
from __future__ import annotations

import datetime
import itertools
import os
import random
import sys
import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from elastic_jupyter.engine.data.batching import BatchPlan
from elastic_jupyter.engine.entrypoints import _run_setup
from elastic_jupyter.engine.step.losses import MeanOver
from elastic_jupyter.engine.modes.state_mode import Place
from elastic_jupyter.engine.group.vote import Vote
from elastic_jupyter.engine.worker import Worker


@dataclass
class Result:
    """One rank's (or the reference's) end state."""

    params: dict  # name -> tensor
    grads: dict  # name -> dense tensor, or None where .grad is None
    sparse_grads: dict = field(default_factory=dict)  # name -> whether .grad was sparse
    history: list = field(default_factory=list)
    losses: list = field(default_factory=list)  # the reference's loss per step
    scaler: dict | None = None
    pass_cost: float | None = None  # the rank's (engine.step.calibration), as its steps were cut
    per_pass: bool = False  # a sharded rank reduce-scattered after each pass (memory bound)


def config(**options) -> dict:
    """A Worker config: B=16, seed 3, no checkpoints, plus `options`; ``late={...}`` is set
    on the config after the Worker's setup (sync_batchnorm, which its setup refuses on CPU)."""
    base = {"global_batch": 16, "micro_batch": None, "seed": 3, "keep_checkpoints": 1,
            "precision": None}
    return {**base, **options}


def cell_namespace(cell: str, seed: int) -> dict:
    """The cell's objects, made as the engines make them: seeded, in a fresh namespace."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return _run_setup(cell, None, {}, None)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor gathered (a collective: every rank calls it), else `t`."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _result(model, history=(), losses=(), scaler=None) -> Result:
    grads = {n: None if p.grad is None else _whole(p.grad.detach()).to_dense().clone()
             for n, p in model.named_parameters()}
    sparse = {n: p.grad is not None and p.grad.is_sparse for n, p in model.named_parameters()}
    params = {n: _whole(p.detach()).clone() for n, p in model.named_parameters()}
    return Result(params, grads, sparse, list(history), list(losses),
                  scaler.state_dict() if scaler is not None else None)


def _train_rank(rank: int, world_size: int, cell: str, cfg: dict, steps: int, store_path: str,
                out: str | None) -> Result:
    vote = None
    if world_size > 1:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=dist.PrefixStore("pg/", store), rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=60))
        vote = Vote(dist.PrefixStore("control/", store), rank, world_size, 60.0)
    try:
        worker = Worker(cell_namespace(cell, cfg["seed"]), dict(cfg, steps=steps), "cpu")
        # options the setup refuses on CPU
        worker.config = dataclasses.replace(worker.config, **cfg.get("late", {}))
        # as the setup, then a generation, do (a sharded run's count and layout)
        worker.mode.memory_need(worker.optimizer, worker.plan.micro_batch_count(
            worker.plan.global_batch), worker.device)
        worker.mode.agree(worker, Place(rank, world_size, 0, 60.0), rank > 0)
        worker.start_generation(rank, world_size)
        for _ in range(steps):
            worker.history.append(worker.train_step(rank, world_size, vote)[0])
        result = _result(worker.model, worker.history, scaler=worker.precision.scaler)
        result.pass_cost = worker.progress.pass_cost
        result.per_pass = bool(getattr(worker.reducer, "per_pass", False))  # sharded only
    finally:
        if world_size > 1:
            dist.destroy_process_group()
    if out:
        torch.save(result, f"{out}/rank{rank}.pt")
    return result


def spawn(fn, args: tuple, nprocs: int) -> None:
    """torch's ``mp.spawn`` of ``fn(rank, *args)``; each process leaves with ``os._exit(0)``
    once `fn` returned. At interpreter teardown, after its work is done, a process that used
    gloo sometimes aborts ("terminate called without an active exception": about once in 60
    processes with torch 2.13 here, with no Python frame on the stack); an exception from
    `fn` still fails the test as before."""
    mp.spawn(_run_and_exit, args=(fn, *args), nprocs=nprocs)


def _run_and_exit(rank: int, fn, *args) -> None:
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def train(cell: str, cfg: dict, world_size: int, steps: int, tmp_path) -> list[Result]:
    """Train `cell` for `steps` optimizer steps at `world_size`; one Result per rank."""
    if world_size == 1:
        return [_train_rank(0, 1, cell, cfg, steps, "", None)]
    folder = tmp_path / f"world{world_size}-{random.getrandbits(32):08x}"
    folder.mkdir()
    spawn(_train_rank, (world_size, cell, cfg, steps, str(folder / "store"), str(folder)),
          world_size)
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def reference(cell: str, cfg: dict, steps: int) -> Result:
    """The same cell in a plain single-process loop: the result this package must give (with
    ``no_shuffle``, over a ``DataLoader(shuffle=False)``'s batches)."""
    ns = cell_namespace(cell, cfg["seed"])
    model, optimizer, data, loss_fn = ns["model"], ns["optimizer"], ns["dataset"], ns["loss_fn"]
    collate = ns.get("collate_fn") or torch.utils.data.default_collate
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.get("precision"))
    scaler = torch.amp.GradScaler("cpu") if cfg.get("precision") == "fp16" else None
    plan, epoch, position, losses = BatchPlan(len(data), cfg["global_batch"], cfg["seed"]), 0, 0, []
    # --no-shuffle: the batches of a DataLoader(shuffle=False), epoch after epoch
    ordered = (b for _ in itertools.count() for b in torch.utils.data.DataLoader(
        data, batch_size=cfg["global_batch"], shuffle=False, collate_fn=collate))
    for _ in range(steps):
        batch = next(ordered) if cfg.get("no_shuffle") else collate(
            [data[int(i)] for i in plan.batch(epoch, position)])
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(model, batch)
        loss = loss[0] if isinstance(loss, tuple) else loss
        loss = loss.loss if isinstance(loss, MeanOver) else loss
        losses.append(float(loss.detach()))
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        epoch, position = plan.advance(epoch, position)
    return _result(model, losses=losses, scaler=scaler)


def max_relative_deviation(got: dict, expected: dict) -> float:
    """Largest |got - expected| of any tensor, relative to that tensor's largest |value|."""
    return max(((got[k].double() - expected[k].double()).abs().max()
                / expected[k].double().abs().max().clamp_min(1e-30)).item() for k in expected)
