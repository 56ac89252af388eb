"""One generation of a run, as seen from one engine.

A generation is a fixed membership with ranks 0..W-1 and its own torch.distributed process
group. The loop runs until the run ends or every rank agrees to leave after the same step:
rank 0 reads the owner's request from the rendezvous store and the flag rides along in the
step's all-reduce of its scalars (one extra element, see Worker.train_step), so agreement costs
no extra round trip. The model and optimizer stay in the engine's Worker between generations;
newcomers get them from rank 0, the oldest survivor (engine.state_transfer).

This module imports nothing from IPython or the UI: it runs the same way from a script.
"""
from __future__ import annotations

import contextlib
import datetime
import sys
import time

import torch
import torch.distributed as dist

from .collective import PeerFailure, collective
from .faultpoints import fault_point
from .schedulers import step_lr_scheduler
from .state_transfer import broadcast_state
from .worker import Worker

PUBLISH_INTERVAL = 0.2  # seconds between live updates to the owner; the client keeps the latest
PUBLISH_WINDOW = 512  # records per update: more than the owner can miss between two polls


def _publish(data: dict) -> None:
    """Stream `data` to the owner when running as an ipyparallel task; no-op elsewhere."""
    try:
        from ipyparallel.datapub import publish_data  # here: engine/ never needs ipyparallel
        publish_data(data)
    except Exception:  # not inside an engine task (a script or a test calling the loop directly)
        pass


def run_generation(worker: Worker, spec: dict, store) -> dict:
    """Train `worker` as rank ``spec["rank"]`` of generation ``spec["generation"]`` until the
    run ends or the owner asks every rank to leave.

    Args:
        spec: rank, world_size, generation, backend, timeout (s), receive_state (this rank is
            a newcomer), broadcast (some rank is), end_at (leave after this step, or None).
        store: the rendezvous store; keys are read under the generation's prefix.
    Returns:
        {"reason": "finished" | "left", "progress", "records", "events"}; records and
        events are complete only on rank 0.
    """
    return Generation(worker, spec, store).run()


@contextlib.contextmanager
def _out_of_memory_hint(config: dict):
    """Running out of GPU memory in the user's step is the user's error: say what to change."""
    try:
        yield
    except RuntimeError as e:
        own = isinstance(e, torch.cuda.OutOfMemoryError) or "CUDA out of memory" in str(e)
        if isinstance(e, PeerFailure) or not own:
            raise
        now = config.get("micro_batch") or "none: the default cut of engine.batching"
        hint = ("--sync-batchnorm forwards a rank's whole share in one pass: use fewer samples "
                "per rank (a smaller --global-batch or more ranks)"
                if config.get("sync_batchnorm") else
                f"lower --micro-batch (now: {now}) so each forward pass holds fewer samples; "
                "the update stays the same")
        raise torch.cuda.OutOfMemoryError(
            f"{e}\nThe step ran out of GPU memory: {hint}") from e


class Generation:
    """One engine's part in one generation: the process group, the state broadcast, the loop."""

    def __init__(self, worker: Worker, spec: dict, store):
        self.worker = worker
        self.spec = spec
        self.rank, self.world_size = spec["rank"], spec["world_size"]
        # the owner writes this generation's requests under its own prefix
        self.control = dist.PrefixStore(f"gen{spec['generation']}/", store)
        self._end_at_cache: dict = {}
        self.events: list[dict] = []  # rank 0's, for the owner's run log

    def run(self) -> dict:
        spec, w = self.spec, self.worker
        with collective("forming the process group"):
            dist.init_process_group(spec["backend"], store=dist.PrefixStore("pg/", self.control),
                                    rank=self.rank, world_size=self.world_size,
                                    timeout=datetime.timedelta(seconds=spec["timeout"]))
        try:
            fault_point("resize", w)
            if spec["broadcast"]:
                self._broadcast_state(spec["receive_state"])
            with _out_of_memory_hint(w.config):  # measuring the pass cost runs passes
                event = w.start_generation(self.rank, self.world_size)
            self.events += [event] if event else []
            if w.commit_steps()[-1:] != [w.progress.step]:
                w.commit()
            with _out_of_memory_hint(w.config):
                return self._loop(spec.get("end_at"))
        finally:
            # closing this rank's sockets makes peers blocked in a collective fail now
            # instead of at the group timeout; its own failure must not hide the first error
            try:
                dist.destroy_process_group()
            except Exception as e:  # noqa: BLE001 -- reported in the engine's log
                print(f"destroying the process group failed: {e}", file=sys.stderr)

    def _broadcast_state(self, receive: bool) -> None:
        w = self.worker
        live = w.capture(copy_tensors=False) if self.rank == 0 else None  # read, never kept
        with collective("state broadcast"):
            state = broadcast_state(live, self.rank, w.device)
        if receive:
            w.restore(state)

    def _read_end_at(self, end_at):
        """Rank 0's read of the owner's request: one store round trip when nothing changed."""
        cache = self._end_at_cache
        version = self.control.add("version", 0)
        if version != cache.get("version"):
            cache["version"] = version
            raw = self.control.get("end_at").decode()
            cache["end_at"] = None if raw == "none" else int(raw)
        return cache.get("end_at", end_at)

    def _loop(self, end_at) -> dict:
        w, rank, world_size = self.worker, self.rank, self.world_size
        cfg, p = w.config, w.progress
        events, last_publish = self.events, 0.0
        published = [p.step, p.step]  # steps of the last two updates: each resends both windows
        first_step = p.step
        reason = "left"
        while p.step < cfg["total_steps"]:
            flag = 0.0
            if rank == 0:
                want = self._read_end_at(end_at)
                flag = 1.0 if want is not None and p.step + 1 >= want else 0.0
            record, leave = w.train_step(rank, world_size, flag)
            if cfg.get("eval_every") and p.step % cfg["eval_every"] == 0 and p.step < cfg["total_steps"]:
                record.update(w.evaluate(rank, world_size))
            if p.step >= cfg["total_steps"]:
                record.update(w.evaluate(rank, world_size))
            w.history.append(record)
            step_lr_scheduler(w, record)
            if cfg.get("commit_every") and p.step % cfg["commit_every"] == 0:
                w.commit()
            if rank == 0:
                self._maybe_checkpoint(p.step, cfg)
                if w.writer:
                    events += w.writer.take_events()
                now = time.time()
                if now - last_publish >= PUBLISH_INTERVAL:
                    # the owner sees only the newest update: overlapping windows survive one
                    # missed poll, and the generation's result carries every record anyway
                    window = min(p.step - published[0], PUBLISH_WINDOW)
                    _publish({"records": w.history[len(w.history) - window:],
                              "events": events})
                    published = [published[1], p.step]
                    last_publish = now
            if leave:
                break
        else:
            reason = "finished"
        if rank == 0 and w.writer:
            events += w.writer.drain()
        records = w.history[len(w.history) - (p.step - first_step):]
        return {"reason": reason, "progress": p.as_dict(),
                "records": records if rank == 0 else [], "events": events}

    def _maybe_checkpoint(self, step: int, cfg: dict) -> None:
        every = cfg.get("checkpoint_every") or 0
        w = self.worker
        if w.writer and ((every and step % every == 0) or step >= cfg["total_steps"]):
            w.writer.submit(w.capture())
