"""The training loop that runs inside each engine, one generation at a time.

A generation is a fixed membership with ranks 0..W-1 and its own torch.distributed process
group. The loop runs until the run ends or every rank agrees to leave after the same step:
rank 0 reads the owner's request from the rendezvous store and the flag rides along in the
gradient all-reduce (one extra element), so agreement costs no extra round trip. The model and
optimizer stay in this process between generations; newcomers get them by broadcast from
rank 0, the oldest survivor.

The update is the mean gradient of the global batch B whatever the world size: each rank scales
the mean loss of a micro-batch of m samples by m / B, and gradients are summed across ranks. (The
last step of an epoch has fewer samples than B; there B is that step's sample count.)

This module imports nothing from IPython or the UI: it runs the same way from a script.
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import os
import random
import sys
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist

from . import state as state_mod
from .batching import BatchPlan, micro_batches, rank_share, steps_per_epoch
from .checkpoint import CheckpointWriter, load_latest

REQUIRED = ("model", "optimizer", "dataset", "loss_fn")
PUBLISH_INTERVAL = 0.2  # seconds between live updates to the owner; the client keeps the latest
PUBLISH_WINDOW = 512  # records per update: more than the owner can miss between two polls
FAULT_HOLD = 30.0  # seconds an armed fault point waits for its kill


class SetupError(RuntimeError):
    """The run's cell or setup function did not produce a usable training setup."""


def _to_device(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


def _publish(data: dict) -> None:
    """Stream `data` to the owner when running as an ipyparallel task; no-op elsewhere."""
    try:
        from ipyparallel.datapub import publish_data
        publish_data(data)
    except Exception:  # not inside an engine task (a script or a test calling the loop directly)
        pass


class Worker:
    """One engine's share of a run: the user's objects plus the run's progress.

    Args:
        objects: namespace produced by the cell or setup function; must hold ``model``,
            ``optimizer``, ``dataset`` (map-style) and ``loss_fn(model, batch)``; may hold
            ``lr_scheduler``, ``collate_fn``, ``eval_dataset`` and ``metric_fn(model, batch)``.
        config: the run's plain-data config (global_batch, micro_batch, total_steps, ...).
        device: torch device string this engine trains on ("cpu" or "cuda").
    """

    def __init__(self, objects: dict, config: dict, device: str):
        missing = [name for name in REQUIRED if name not in objects]
        if missing:
            raise SetupError(
                f"the cell did not define {', '.join(missing)}: it must define "
                "model, optimizer, dataset and loss_fn(model, batch)")
        self.config = config
        self.device = torch.device("cuda" if device.startswith("cuda") else "cpu")
        self.model = objects["model"]
        self.optimizer = objects["optimizer"]
        self.dataset = objects["dataset"]
        self.loss_fn = objects["loss_fn"]
        self.lr_scheduler = objects.get("lr_scheduler")
        self.collate_fn = objects.get("collate_fn") or torch.utils.data.default_collate
        self.eval_dataset = objects.get("eval_dataset")
        self.metric_fn = objects.get("metric_fn")
        self._check_objects()
        if config.get("sync_batchnorm"):
            self._convert_batchnorm()
        self.model.to(self.device)
        self.plan = BatchPlan(len(self.dataset), config["global_batch"], config["seed"])
        if not config.get("total_steps"):
            epochs = config.get("epochs") or 1
            config["total_steps"] = config.get("steps") or steps_per_epoch(len(self.dataset), config["global_batch"]) * epochs
        self.progress = state_mod.Progress()
        self.history: list[dict] = []
        self._commits: collections.deque = collections.deque(maxlen=2)  # (step, state, #records)
        self.writer = None
        if config.get("checkpoint_dir"):
            self.writer = CheckpointWriter(config["checkpoint_dir"], config["keep"],
                                           before_write=lambda: fault_point("checkpoint", self))

    def _check_objects(self) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise SetupError(f"model must be a torch.nn.Module, got {type(self.model).__name__}")
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise SetupError(
                f"optimizer must be a torch.optim.Optimizer, got {type(self.optimizer).__name__}")
        if not callable(self.loss_fn):
            raise SetupError("loss_fn must be a function loss_fn(model, batch) -> loss")
        try:
            n = len(self.dataset)
        except TypeError:
            raise SetupError("dataset must be a map-style torch Dataset (with __len__ and "
                             "__getitem__); iterable datasets are not supported") from None
        if n < self.config["global_batch"]:
            raise SetupError(f"dataset has {n} samples, fewer than the global batch "
                             f"{self.config['global_batch']}: lower --global-batch")
        if self.eval_dataset is not None and self.metric_fn is None:
            raise SetupError("eval_dataset is defined but metric_fn(model, batch) -> dict is not")

    def _convert_batchnorm(self) -> None:
        """BatchNorm statistics over the whole global batch instead of each rank's share."""
        if self.device.type != "cuda":
            raise SetupError("--sync-batchnorm needs GPU slots: torch's SyncBatchNorm runs only "
                             "on CUDA. On CPU slots, BatchNorm statistics are per rank, so "
                             "results depend on the world size")
        # the converted layers keep the same Parameter objects, so the optimizer still holds them
        self.model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(self.model)

    # state -------------------------------------------------------------------------------------

    def capture(self) -> dict:
        return state_mod.capture(self.model, self.optimizer, self.lr_scheduler, self.progress,
                                 self.history, self.config)

    def restore(self, state: dict) -> None:
        self.progress, self.history = state_mod.restore(
            state, self.model, self.optimizer, self.lr_scheduler)

    # commit / restore in memory: a fault rolls every survivor back to a commit all reached

    def commit(self) -> None:
        """Keep an in-memory copy of the state at this step (the last two are kept, since
        ranks may be one commit apart when a peer dies inside a collective)."""
        state = state_mod.capture(self.model, self.optimizer, self.lr_scheduler, self.progress,
                                  [], self.config)
        self._commits.append((self.progress.step, state, len(self.history)))

    def commit_steps(self) -> list[int]:
        return [step for step, _, _ in self._commits]

    def rollback(self, step: int) -> None:
        """Restore the commit of `step`; raises KeyError if this rank has none."""
        for commit_step, state, n_records in self._commits:
            if commit_step == step:
                history = self.history[:n_records]
                self.restore(state)
                self.history = history
                while self._commits[-1][0] != step:
                    self._commits.pop()
                return
        raise KeyError(f"no commit at step {step} (have {self.commit_steps()})")

    # one optimizer step ----------------------------------------------------------------------

    def _local_pass(self, indices: torch.Tensor, B: int) -> tuple[float, list[float]]:
        """Forward and backward over this rank's share of a batch of `B` samples; returns
        (loss, extra metrics), each already weighted by the share's fraction of the batch."""
        loss_sum, extras = 0.0, [0.0] * len(self.progress.metric_names)
        for chunk in micro_batches(indices, self.config.get("micro_batch")):
            batch = _to_device(self.collate_fn([self.dataset[int(i)] for i in chunk]), self.device)
            fault_point("forward", self)
            out = self.loss_fn(self.model, batch)
            loss, metrics = out if isinstance(out, tuple) else (out, {})
            weight = len(chunk) / B
            fault_point("backward", self)
            (loss * weight).backward()
            loss_sum += float(loss.detach()) * weight
            if metrics and not self.progress.metric_names:
                self.progress.metric_names = sorted(metrics)
                extras = [0.0] * len(metrics)
            for j, name in enumerate(self.progress.metric_names):
                extras[j] += float(metrics[name]) * weight
        return loss_sum, extras

    def _all_reduce(self, loss: float, extras: list[float], flag: float) -> tuple[float, list, bool]:
        """Sum gradients, loss, extra metrics and the leave flag across ranks in one collective."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        dtype = params[0].dtype if params else torch.float32
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        tail = torch.tensor([flag, loss, *extras], dtype=dtype, device=self.device)
        flat = torch.cat([g.reshape(-1) for g in grads] + [tail])
        if dist.get_world_size() > 1:
            dist.all_reduce(flat)
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n
        flag_sum, loss_sum, *extra_sums = flat[offset:].tolist()
        return loss_sum, extra_sums, flag_sum > 0

    def train_step(self, rank: int, world_size: int, leave_flag: float) -> tuple[dict, bool]:
        """One optimizer step on this rank's share of the global batch; all ranks call it.

        Returns (history record, whether any rank asked to leave after this step).
        """
        t0 = time.perf_counter()
        p = self.progress
        batch = self.plan.batch(p.epoch, p.position)
        self.optimizer.zero_grad(set_to_none=True)
        loss, extras = self._local_pass(batch[rank_share(len(batch), rank, world_size)], len(batch))
        fault_point("allreduce", self)
        loss, extras, leave = self._all_reduce(loss, extras, leave_flag)
        if self.config.get("clip_grad_norm"):
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config["clip_grad_norm"])
        lr = self.optimizer.param_groups[0]["lr"]
        fault_point("optimizer", self)
        self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        epoch = p.epoch
        p.epoch, p.position = self.plan.advance(p.epoch, p.position)
        p.step += 1
        p.samples += len(batch)
        seconds = time.perf_counter() - t0
        record = {"step": p.step, "epoch": epoch, "loss": loss, "lr": lr,
                  "world_size": world_size, "samples_per_s": len(batch) / max(seconds, 1e-9),
                  "time": time.time()}
        record.update(zip(p.metric_names, extras))
        return record, leave

    # evaluation ------------------------------------------------------------------------------

    def evaluate(self, rank: int, world_size: int) -> dict:
        """Mean of ``metric_fn`` over ``eval_dataset``, split across ranks; {} without one."""
        if self.eval_dataset is None:
            return {}
        n = len(self.eval_dataset)
        share = torch.arange(n)[rank_share(n, rank, world_size)]
        sums, count = {}, 0
        self.model.eval()
        with torch.no_grad():
            for chunk in micro_batches(share, self.config.get("micro_batch") or self.config["global_batch"]):
                batch = _to_device(self.collate_fn([self.eval_dataset[int(i)] for i in chunk]), self.device)
                for name, value in self.metric_fn(self.model, batch).items():
                    sums[name] = sums.get(name, 0.0) + float(value) * len(chunk)
                count += len(chunk)
        self.model.train()
        gathered = [None] * world_size
        if world_size > 1:
            dist.all_gather_object(gathered, (sums, count))
        else:
            gathered = [(sums, count)]
        total = sum(c for _, c in gathered)
        names = sorted({k for s, _ in gathered for k in s})
        return {f"val_{k}": sum(s.get(k, 0.0) for s, _ in gathered) / total for k in names}

    # generations -----------------------------------------------------------------------------

    def run_generation(self, spec: dict, store) -> dict:
        """Train as rank ``spec["rank"]`` of generation ``spec["generation"]`` until the run ends
        or the owner asks every rank to leave.

        Args:
            spec: rank, world_size, generation, backend, timeout (s), receive_state (this rank is
                a newcomer), broadcast (some rank is), end_at (leave after this step, or None).
            store: the rendezvous store; keys are read under the generation's prefix.
        Returns:
            {"reason": "finished" | "left", "progress", "records", "events"}; records and
            events are complete only on rank 0.
        """
        rank, world_size, gen = spec["rank"], spec["world_size"], spec["generation"]
        prefix = dist.PrefixStore(f"gen{gen}/", store)
        dist.init_process_group(spec["backend"], store=dist.PrefixStore("pg/", prefix), rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=spec["timeout"]))
        try:
            fault_point("resize", self)
            if spec["broadcast"]:
                self._broadcast_state(rank, spec["receive_state"])
            if self.commit_steps()[-1:] != [self.progress.step]:
                self.commit()
            return self._loop(rank, world_size, gen, prefix, spec.get("end_at"))
        finally:
            # closing this rank's sockets makes peers blocked in a collective fail now
            # instead of at the group timeout
            dist.destroy_process_group()

    def _broadcast_state(self, rank: int, receive: bool) -> None:
        box = [self.capture() if rank == 0 else None]
        device = self.device if self.device.type == "cuda" else None
        dist.broadcast_object_list(box, src=0, device=device)
        if receive:
            self.restore(box[0])

    def _read_end_at(self, control, cache: dict, end_at):
        """Rank 0's read of the owner's request: one store round trip when nothing changed."""
        version = control.add("version", 0)
        if version != cache.get("version"):
            cache["version"] = version
            raw = control.get("end_at").decode()
            cache["end_at"] = None if raw == "none" else int(raw)
        return cache.get("end_at", end_at)

    def _loop(self, rank: int, world_size: int, gen: int, control, end_at) -> dict:
        cfg, p = self.config, self.progress
        events, cache, last_publish = [], {}, 0.0
        published = [p.step, p.step]  # steps of the last two updates: each resends both windows
        first_step = p.step
        reason = "left"
        while p.step < cfg["total_steps"]:
            flag = 0.0
            if rank == 0:
                want = self._read_end_at(control, cache, end_at)
                flag = 1.0 if want is not None and p.step + 1 >= want else 0.0
            record, leave = self.train_step(rank, world_size, flag)
            if cfg.get("eval_every") and p.step % cfg["eval_every"] == 0 and p.step < cfg["total_steps"]:
                record.update(self.evaluate(rank, world_size))
            if p.step >= cfg["total_steps"]:
                record.update(self.evaluate(rank, world_size))
            self.history.append(record)
            if cfg.get("commit_every") and p.step % cfg["commit_every"] == 0:
                self.commit()
            if rank == 0:
                self._maybe_checkpoint(p.step, cfg)
                if self.writer:
                    events += self.writer.take_events()
                now = time.time()
                if now - last_publish >= PUBLISH_INTERVAL:
                    # the owner sees only the newest update: overlapping windows survive one
                    # missed poll, and the generation's result carries every record anyway
                    window = min(p.step - published[0], PUBLISH_WINDOW)
                    _publish({"records": self.history[len(self.history) - window:],
                              "events": events})
                    published = [published[1], p.step]
                    last_publish = now
            if leave:
                break
        else:
            reason = "finished"
        if rank == 0 and self.writer:
            events += self.writer.drain()
        records = self.history[len(self.history) - (p.step - first_step):]
        return {"reason": reason, "progress": p.as_dict(),
                "records": records if rank == 0 else [], "events": events}

    def _maybe_checkpoint(self, step: int, cfg: dict) -> None:
        every = cfg.get("checkpoint_every") or 0
        if self.writer and ((every and step % every == 0) or step >= cfg["total_steps"]):
            self.writer.submit(self.capture())


def fault_point(phase: str, worker: "Worker | None") -> None:
    """Fault-injection hook for tests and benchmarks (off unless the run's config names a
    ``fault_dir``). When ``<fault_dir>/arm.<phase>`` holds this engine's slot, the engine
    claims it, writes ``hit.<phase>.<slot>.<step>`` and stays in this phase until it is killed
    (or for ``FAULT_HOLD`` seconds), so an external SIGKILL lands exactly here."""
    folder = worker.config.get("fault_dir") if worker is not None else None
    if not folder:
        return
    arm = os.path.join(folder, f"arm.{phase}")
    slot = _engine.get("slot")
    try:
        with open(arm) as f:
            if int(f.read().strip() or -1) != slot:
                return
        os.rename(arm, f"{arm}.claimed")  # atomic: one hit per arming
    except (OSError, ValueError):
        return
    with open(os.path.join(folder, f"hit.{phase}.{slot}.{worker.progress.step}"), "w") as f:
        f.write(str(os.getpid()))
    hold = float(worker.config.get("fault_hold", FAULT_HOLD))
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline:
        time.sleep(0.01)


# Entry points called by the owner through ipyparallel. State lives in this module between
# calls, because an engine is a persistent process.

_worker: Worker | None = None
_store = None
_engine: dict = {}


@contextlib.contextmanager
def _logging_to(path: str | None):
    """Send this task's prints, warnings and tracebacks to the engine's log file."""
    if not path:
        yield
        return
    with open(path, "a", buffering=1) as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        yield


def init_engine(slot: int, device: str, threads: int) -> dict:
    """Bind this engine to its slot; returns {"pid", "slot", "device", "host"}."""
    torch.set_num_threads(threads)
    if device.startswith("cuda"):
        torch.cuda.set_device(0)  # CUDA_VISIBLE_DEVICES holds exactly this slot's GPU
    _engine.update(slot=slot, device=device)
    return {"pid": os.getpid(), "slot": slot, "device": device, "host": os.uname().nodename}


def _cell_file(source: str, log_path: str | None) -> str:
    """A real file holding the cell, so tracebacks (formatted by IPython on the engine) show
    the cell's lines; it lands beside the engine logs."""
    if not log_path:
        return "<elastic_train cell>"
    path = os.path.join(os.path.dirname(log_path), "cell.py")
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(source)
    os.replace(tmp, path)
    return path


def setup_run(config: dict, source: str | None, setup_fn: bytes | None, pushed: dict,
              log_path: str | None) -> dict:
    """Run the cell `source` (or the cloudpickled `setup_fn`) and keep the Worker it defines.

    Returns {"samples", "parameters", "eval_samples"}. Raises SetupError or the cell's own
    exception (the owner shows its traceback).
    """
    global _worker
    _worker = None
    with _logging_to(log_path):
        seed = config["seed"]
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        namespace = {"__name__": "__elastic_cell__", **pushed}
        if setup_fn is not None:
            import cloudpickle
            objects = cloudpickle.loads(setup_fn)()
            if not isinstance(objects, dict):
                raise SetupError("the setup function must return a dict with model, optimizer, "
                                 f"dataset and loss_fn; it returned {type(objects).__name__}")
            namespace.update(objects)
        else:
            try:
                exec(compile(source, _cell_file(source, log_path), "exec"), namespace)
            except NameError as e:
                raise NameError(f"{e}. Engines cannot see notebook variables: send them with "
                                "--push NAME (or push={'NAME': value} in the Python API)") from None
        _worker = Worker(namespace, config, _engine.get("device", "cpu"))
    return {"samples": len(_worker.dataset), "total_steps": config["total_steps"],
            "parameters": sum(p.numel() for p in _worker.model.parameters()),
            "eval_samples": len(_worker.eval_dataset) if _worker.eval_dataset is not None else 0}


def load_state(folder: str) -> dict:
    """Restore this engine's Worker from the newest usable checkpoint in `folder`.

    Returns {"path", "warnings", "progress", "config", "history"}; warnings name newer files
    that were skipped as torn or corrupted.
    """
    path, state, warnings = load_latest(folder)
    _worker.restore(state)
    return {"path": path, "warnings": warnings, "progress": _worker.progress.as_dict(),
            "config": state["config"], "history": _worker.history}


def connect_store(host: str, port: int, timeout: float) -> None:
    """Connect to the owner's rendezvous store (kept for the life of the engine's run)."""
    global _store
    _store = dist.TCPStore(host, port, is_master=False,
                           timeout=datetime.timedelta(seconds=timeout))


def train_generation(spec: dict, log_path: str | None) -> dict:
    """Run one generation (see Worker.run_generation); errors carry this engine's traceback."""
    with _logging_to(log_path):
        try:
            return _worker.run_generation(spec, _store)
        except Exception:
            traceback.print_exc(file=sys.stderr)
            raise


def training_state() -> dict:
    """The Worker's full state (plain data, on the CPU)."""
    return _worker.capture()


def drop_run() -> None:
    """Forget the run (the engine stays, ready for the next one)."""
    global _worker
    if _worker is not None and _worker.writer is not None:
        _worker.writer.drain()
    _worker = None


def commit_steps() -> dict:
    """{"commits": steps of the in-memory commits this engine holds, "step": its progress}."""
    return {"commits": _worker.commit_steps(), "step": _worker.progress.step}


def rollback(step: int) -> dict:
    """Roll this engine's Worker back to its commit of `step`; returns the progress."""
    _worker.rollback(step)
    return _worker.progress.as_dict()


def history_since(step: int) -> list[dict]:
    """This engine's history records after `step`."""
    return [r for r in _worker.history if r["step"] > step]
