"""torchrun worker for the restart baseline of benchmarks/fault_recovery.py.

Launched as ``python -m torch.distributed.run --standalone --nproc_per_node 2 --max-restarts 3
torchrun_restart_worker.py --dir D --checkpoint-every K --timeout T``. It follows the standard
torchrun elastic pattern: every (re)started rank loads ``D/checkpoint.pt`` if it exists and goes
on from its step; rank 0 writes that file every K steps (to a temporary name, then renamed, so a
kill never leaves a torn file). A failed worker makes torchrun stop the whole group and start a
new one, which resumes from the checkpoint.

The model, data and DDP wrapping come from ddp_baseline.build (the quick-start cell), with the
same slow ``loss_fn`` the elastic run uses (fault_recovery.SLOW_LOSS). The process group's
timeout is T, so a hung peer makes the other rank's collective fail after T seconds.

For the benchmark's bookkeeping, rank 0 appends ``kind step time restart`` lines to
``D/steps.log``: ``start`` when the process starts (before importing torch), ``resume`` once the
group is formed and the checkpoint loaded, and ``step`` after every optimizer step. Each rank
writes ``pid restart`` to ``D/pid.<rank>`` so the benchmark knows whom to kill.
"""
from __future__ import annotations

import time

STARTED = time.time()  # before the imports below: a restart's cost includes importing torch

import argparse  # noqa: E402
import datetime  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ddp_baseline import build  # noqa: E402
from fault_recovery import SLOW_LOSS  # noqa: E402

RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class StepLog:
    """Rank 0's line-buffered log of the run's progress (other ranks write nothing)."""

    def __init__(self, path: str, rank: int):
        self.file = open(path, "a", buffering=1) if rank == 0 else None

    def write(self, kind: str, step: int, when: float | None = None) -> None:
        if self.file:
            self.file.write(f"{kind} {step} {time.time() if when is None else when:.6f} "
                            f"{RESTART}\n")


def slow(loss_fn):
    """The elastic run's loss_fn wrapper (a ~5 ms sleep per call), from the same source."""
    namespace = {"loss_fn": loss_fn}
    exec(SLOW_LOSS, namespace)
    return namespace["loss_fn"]


def load_checkpoint(path: str, model, optimizer) -> int:
    """Restore model and optimizer from `path` if it exists; returns the step to go on from."""
    if not os.path.exists(path):
        return 0
    state = torch.load(path, map_location="cpu")
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"]


def save_checkpoint(path: str, model, optimizer, step: int) -> None:
    tmp = f"{path}.tmp"
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "step": step}, tmp)
    os.replace(tmp, path)


def train(folder: str, every: int, log: StepLog) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer, loss_fn, sampler, loader = build(rank, world)
    loss_fn = slow(loss_fn)
    path = os.path.join(folder, "checkpoint.pt")
    step = load_checkpoint(path, model, optimizer)
    log.write("resume", step)
    while True:  # until the benchmark ends the launch
        epoch, skip = divmod(step, len(loader))  # resume mid-epoch in the same data order
        sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            if i < skip:
                continue
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()  # DDP's all-reduce; fails after the timeout
            optimizer.step()
            step += 1
            log.write("step", step)
            if rank == 0 and step % every == 0:
                save_checkpoint(path, model, optimizer, step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--checkpoint-every", type=int, required=True)
    parser.add_argument("--timeout", type=float, required=True)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    with open(os.path.join(args.dir, f"pid.{rank}"), "w") as f:
        f.write(f"{os.getpid()} {RESTART}")
    log = StepLog(os.path.join(args.dir, "steps.log"), rank)
    log.write("start", -1, when=STARTED)
    train(args.dir, args.checkpoint_every, log)


if __name__ == "__main__":
    main()
