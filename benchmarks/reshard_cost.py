"""Resizing a sharded training state in memory against its costs and against a restart.

The 200M GPT of benchmarks/gpt.py, sharded with FSDP2 per block (engine.sharded.resizable_model),
AdamW after one step (its two moments: the state is 2.4 GB in fp32), on gloo processes of this
machine:

- **grow 2 -> 3** with ``ShardedModel.reshard_to`` and **shrink 3 -> 2** as a generation's
  end and the next one's start do it (rank 1 leaves: ``hand_over`` in the old group, then
  ``reshard_to`` from the rows handed over in the new one): the time (every rank from a
  barrier to done; the shrink's two parts added, the new group's rendezvous left out), the bytes
  that travelled (point to point, counted as the plan sends them, plus the pickled structure)
  against the minimum for the new layout (the rows whose owner changes), and against one
  ``all_to_all_single`` of the same bytes between the same ranks in the same processes;
- **the restart path** users have today: the state written with ``torch.distributed.checkpoint``
  (fsync on), the files dropped from the page cache (``posix_fadvise(DONTNEED)``: no root
  needed), new processes started, torch imported, the model built and sharded at the new size,
  and the checkpoint read back, to the moment every process is ready;
- **the partner replica's refresh** (engine.sharded.replicas): its time against a training step's,
  so the step overhead at a refresh every K steps is refresh / (K x step).

Run: ``python benchmarks/reshard_cost.py [--size 200M]``; figures in BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, SIZES  # noqa: E402

from elastic_jupyter.engine.sharded.replicas import PartnerReplicas  # noqa: E402
from elastic_jupyter.engine.sharded.reshard import Layout, moved_bytes, plan  # noqa: E402
from elastic_jupyter.engine.sharded.resizable_model import ShardedModel  # noqa: E402

SEQ = 32


def build(size: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(*SIZES[size], max_seq=SEQ)


def one_step(model, optimizer) -> float:
    start = time.perf_counter()
    tokens = torch.randint(0, 256, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1)).backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - start


def _resize(rank: int, size: str, case: str, folder: str) -> None:
    """3 processes: the old layout trains one step, then every process reshards."""
    dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store-{case}", 3),
                            rank=rank, world_size=3)
    grow = case == "grow"
    old_members, new_members = ([0, 1], [0, 1, 2]) if grow else ([0, 1, 2], [0, 2])
    groups = {tuple(m): dist.new_group(m) for m in (old_members, new_members) if len(m) < 3}
    mesh_of = {tuple(m): DeviceMesh.from_group(groups.get(tuple(m), dist.group.WORLD), "cpu")
               if rank in m else None for m in (old_members, new_members)}
    cell = build(size)
    optimizer = torch.optim.AdamW(cell.parameters(), lr=1e-4)
    sharded = ShardedModel(cell)
    out: dict = {}
    if rank in old_members:
        sharded.shard(mesh_of[tuple(old_members)], optimizer)
        out["step_s"] = one_step(sharded.module, optimizer)
        part = sharded.snapshot(optimizer)
        out["structure"] = len(pickle.dumps((list(part.parts), part.replicated, part.buffers)))
        replicas = PartnerReplicas()
        group = groups.get(tuple(old_members))
        if group is None:  # the refresh runs on the default group: all three old ranks
            dist.barrier()
            start = time.perf_counter()
            out["replica_bytes"] = replicas.refresh(
                1, part, {n: s[0] for n, s in sharded.shapes.items()}, rank, 3)
            out["replica_s"] = time.perf_counter() - start
    del cell
    layout = Layout(tuple(old_members.index(g) if g in old_members else None for g in range(3)),
                    tuple(new_members.index(g) if g in new_members else None for g in range(3)))
    rows = [sharded.shapes[n][0] for n in sharded.names] * 3  # parameters, AdamW's 2 moments
    # first, the same bytes between the same ranks, as one all_to_all_single
    row_bytes = [torch.Size(sharded.shapes[n][1:]).numel() * 4 for n in sharded.names] * 3
    transfers = plan(rows, layout)
    send = [sum((t.end - t.start) * row_bytes[t.tensor] for t in transfers
                if t.src == rank and t.dst == peer and t.src != t.dst) for peer in range(3)]
    recv = [sum((t.end - t.start) * row_bytes[t.tensor] for t in transfers
                if t.dst == rank and t.src == peer and t.src != t.dst) for peer in range(3)]
    data = torch.zeros(sum(send), dtype=torch.uint8)
    into = torch.empty(sum(recv), dtype=torch.uint8)
    dist.barrier()
    start = time.perf_counter()
    dist.all_to_all_single(into, data, recv, send)
    dist.barrier()
    out["all_to_all_s"] = time.perf_counter() - start
    del data, into
    dist.barrier()
    if grow:
        start = time.perf_counter()
        sharded.reshard_to(mesh_of[tuple(new_members)], layout, rank, optimizer,
                           torch.device("cpu"))
        dist.barrier()
        out["reshard_s"] = time.perf_counter() - start
    else:  # as a generation ends and the next starts: the hand-over in the old group (a
        # drain), then the next generation's group, where each stayer builds its module
        start = time.perf_counter()
        parked = sharded.hand_over(layout, rank, optimizer)
        dist.barrier()
        out["hand_over_s"] = time.perf_counter() - start
        dist.destroy_process_group()
        if rank not in new_members:
            out["reshard_s"] = out["hand_over_s"]
            with open(f"{folder}/{case}-{rank}.json", "w") as f:
                json.dump(dict(out, moved=moved_bytes(transfers, row_bytes)), f)
            return
        new_rank = new_members.index(rank)
        dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store-{case}-new", 2),
                                rank=new_rank, world_size=2)
        dist.barrier()
        start = time.perf_counter()
        sharded.reshard_to(DeviceMesh.from_group(dist.group.WORLD, "cpu"),
                           Layout((0, 1), (0, 1)), new_rank, optimizer, torch.device("cpu"),
                           parked, consume=True)
        dist.barrier()
        out["start_s"] = time.perf_counter() - start
        out["reshard_s"] = out["hand_over_s"] + out["start_s"]
    out["moved"] = moved_bytes(transfers, row_bytes)
    with open(f"{folder}/{case}-{rank}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def _save(rank: int, size: str, folder: str) -> None:
    """The old layout (2 ranks) writes its state with torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store-save", 2), rank=rank,
                            world_size=2)
    cell = build(size)
    optimizer = torch.optim.AdamW(cell.parameters(), lr=1e-4)
    sharded = ShardedModel(cell)
    model = sharded.shard(DeviceMesh.from_group(dist.group.WORLD, "cpu"), optimizer)
    one_step(model, optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dist.barrier()
    start = time.perf_counter()
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{folder}/dcp")
    dist.barrier()
    if rank == 0:
        with open(f"{folder}/save.json", "w") as f:
            json.dump({"save_s": time.perf_counter() - start}, f)
    dist.destroy_process_group()


def _restart(rank: int, size: str, folder: str, started: float) -> None:
    """A new process of the new layout (3 ranks): import, build, shard, read the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (_init_optim_state, get_state_dict,
                                                         set_state_dict)
    dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store-restart", 3),
                            rank=rank, world_size=3)
    cell = build(size)
    optimizer = torch.optim.AdamW(cell.parameters(), lr=1e-4)
    model = ShardedModel(cell).shard(DeviceMesh.from_group(dist.group.WORLD, "cpu"), optimizer)
    _init_optim_state(optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=f"{folder}/dcp")
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    dist.barrier()
    if rank == 0:
        with open(f"{folder}/restart.json", "w") as f:
            json.dump({"restart_s": time.time() - started}, f)
    dist.destroy_process_group()


def drop_page_cache(folder: str) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="200M", choices=sorted(SIZES))
    size = parser.parse_args().size
    folder = tempfile.mkdtemp(prefix="reshard-cost-")
    figures = {}
    for case in ("grow", "shrink"):
        mp.spawn(_resize, args=(size, case, folder), nprocs=3)
        ranks = []
        for r in range(3):
            with open(f"{folder}/{case}-{r}.json") as f:
                ranks.append(json.load(f))
        figures[case] = ranks
    mp.spawn(_save, args=(size, folder), nprocs=2)
    drop_page_cache(f"{folder}/dcp")
    started = time.time()
    mp.spawn(_restart, args=(size, folder, started), nprocs=3)
    with open(f"{folder}/save.json") as f:
        save_s = json.load(f)["save_s"]
    with open(f"{folder}/restart.json") as f:
        restart_s = json.load(f)["restart_s"]
    state_bytes = 3 * 4 * sum(p.numel() for p in build(size).parameters())
    print(f"{size} GPT, fp32 parameters and AdamW's two moments: {state_bytes / 1e9:.2f} GB")
    for case, ranks in figures.items():
        moved = ranks[0]["moved"]
        sent = moved + 2 * ranks[0]["structure"]  # rank 0 broadcasts it to the two others
        reshard = max(r["reshard_s"] for r in ranks)
        a2a = max(r["all_to_all_s"] for r in ranks)
        print(f"{case}: moved {sent / 1e6:.0f} MB against a minimum of {moved / 1e6:.0f} MB "
              f"({sent / moved:.4f} x); resharding {reshard:.2f} s, all_to_all of those bytes "
              f"{a2a:.2f} s ({reshard / a2a:.2f} x); restart path {save_s + restart_s:.1f} s "
              f"(write {save_s:.1f} s + new processes to ready {restart_s:.1f} s): "
              f"{(save_s + restart_s) / reshard:.1f} x the resharding")
        if "start_s" in ranks[0]:
            print(f"  {case}: hand-over {max(r['hand_over_s'] for r in ranks):.2f} s, then the "
                  f"next generation's modules {max(r.get('start_s', 0) for r in ranks):.2f} s")
    shrink = figures["shrink"]
    refresh = max(r["replica_s"] for r in shrink if "replica_s" in r)
    step = max(r["step_s"] for r in shrink if "step_s" in r)
    print(f"partner replica refresh at 3 ranks: {refresh:.2f} s, "
          f"{sum(r.get('replica_bytes', 0) for r in shrink) / 1e6:.0f} MB sent; one training "
          f"step (batch 2 x {SEQ}) {step:.2f} s: overhead at K = 10, 50, 100: "
          + ", ".join(f"{refresh / (k * step) * 100:.1f} %" for k in (10, 50, 100)))


if __name__ == "__main__":
    main()
