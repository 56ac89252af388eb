"""One generation of a run, as seen from one engine.

A generation is a fixed membership with ranks 0..W-1 and its own torch.distributed process
group. The loop runs until the run ends or every rank agrees to leave after the same step:
rank 0 reads the owner's request from the rendezvous store in the same trip as the step's
commit vote (engine.group.vote), and its leave flag rides in its next vote, so agreement costs no
extra round trip. The model and optimizer stay in the engine's Worker between generations;
newcomers get them from rank 0, the oldest survivor (engine.group.state_transfer). After a fault the
survivors hold the same committed step, so a new generation starts from their state as it is.

This module imports nothing from IPython or the UI: it runs the same way from a script.
"""
from __future__ import annotations

import contextlib
import datetime
import sys
import time
from typing import Literal

import torch
import torch.distributed as dist

from ..config.run import RunConfig
from ..events import Event, EventKind
from .faultpoints import fault_point
from .group import drain
from .group.abort import AbortableStore, AbortWatch
from .group.collective import PeerFailure, collective
from .group.state_transfer import broadcast_state
from .group.vote import Vote
from .group.work_barrier import work_then_wait
from .modes.state_mode import Place
from .protocol import (ACKNOWLEDGED_KEY, END_AT_KEY, LEAVERS_KEY, PROCESS_GROUP_PREFIX, VERSION_KEY,
                       GenerationResult, GenerationSpec, decode_end_at, generation_prefix)
from .publish import publish
from .step.schedulers import step_lr_scheduler
from .worker import Worker

PUBLISH_INTERVAL = 0.2  # seconds between live updates to the owner; the client keeps the latest
PUBLISH_WINDOW = 512  # records per update: more than the owner can miss between two polls
ACKNOWLEDGED_EVERY = 32  # steps between two reads of the owner's acknowledged step


def run_generation(worker: Worker, spec: GenerationSpec, store: dist.Store) -> GenerationResult:
    """Train `worker` as rank ``spec.rank`` of generation ``spec.generation`` until the run
    ends or the owner asks every rank to leave.

    Args:
        spec: this rank's part in the generation (engine.protocol.GenerationSpec).
        store: the rendezvous store; keys are read under the generation's prefix.
    Returns:
        this rank's engine.protocol.GenerationResult (records and events complete only on
        rank 0).
    """
    return Generation(worker, spec, store).run()


@contextlib.contextmanager
def _out_of_memory_hint(config: RunConfig):
    """Running out of GPU memory in the user's step is the user's error: say what to change."""
    try:
        yield
    except RuntimeError as e:
        own = isinstance(e, torch.cuda.OutOfMemoryError) or "CUDA out of memory" in str(e)
        if isinstance(e, PeerFailure) or not own:
            raise
        now = config.micro_batch or "none: the default cut of engine.data.batching"
        hint = ("--sync-batchnorm forwards a rank's whole share in one pass: use fewer samples "
                "per rank (a smaller --global-batch or more ranks)"
                if config.sync_batchnorm else
                f"lower --micro-batch (now: {now}) so each forward pass holds fewer samples; "
                "the update stays the same")
        raise torch.cuda.OutOfMemoryError(
            f"{e}\nThe step ran out of GPU memory: {hint}") from e


class Generation:
    """One engine's part in one generation: the process group, the state broadcast, the loop."""

    def __init__(self, worker: Worker, spec: GenerationSpec, store: dist.Store):
        self.worker = worker
        self.spec = spec
        self.rank, self.world_size = spec.rank, spec.world_size
        # the owner writes this generation's requests under its own prefix
        self.control = dist.PrefixStore(generation_prefix(spec.generation), store)
        # rank 0 reads the owner's request counter in every vote's trip
        self.vote = Vote(self.control, self.rank, self.world_size, spec.timeout,
                         read=(VERSION_KEY,) if self.rank == 0 else ())
        self._version: int | None = None
        self.end_at = spec.end_at
        self.events: list[Event] = []  # rank 0's, for the owner's run log
        self._acknowledged_step: int | None = None  # read every ACKNOWLEDGED_EVERY steps
        self._went_back_to: int | None = None  # a sharded run's roll back (sharded_mode)
        self.handed_over: list[int] = []  # ranks that left with their rows handed over
        # this rank's place, as the state mode's generation calls take it (engine.modes.state_mode)
        self.place = Place(self.rank, self.world_size, spec.generation, spec.timeout)

    def run(self) -> GenerationResult:
        with drain.training():  # from here a SIGTERM waits for the next step boundary
            return self._run()

    def _run(self) -> GenerationResult:
        spec, w = self.spec, self.worker
        # a rank sent the state holds none until it is loaded (a transfer that fails leaves
        # part of it in the model); the others are the driver's holders
        w.holds_state = not spec.receive_state
        fault_point("join", w)
        with collective("forming the process group"):
            # a peer that dies before it joins must not leave this rank waiting for its key
            store = AbortableStore(dist.PrefixStore(PROCESS_GROUP_PREFIX, self.control),
                                   self.control, spec.timeout)
            dist.init_process_group(spec.backend, store=store,
                                    rank=self.rank, world_size=self.world_size,
                                    timeout=datetime.timedelta(seconds=spec.timeout))
        try:
            # nccl waits for a dead peer until its timeout: the owner's abort ends the wait
            # (ProcessGroup.abort came with torch 2.7; before, the watchdog's timeout does)
            abort = getattr(dist.group.WORLD, "abort", None)
            with (AbortWatch(self.control, abort) if spec.backend == "nccl" and abort
                  else contextlib.nullcontext()):
                return self._train()
        except PeerFailure:
            w.mode.abort_writes()  # a dead peer's checkpoint part never comes
            raise
        finally:
            w.end_generation()
            # closing this rank's sockets makes peers blocked in a collective fail now
            # instead of at the group timeout; its own failure must not hide the first error
            try:
                dist.destroy_process_group()
            except Exception as e:  # noqa: BLE001 -- reported in the engine's log
                print(f"destroying the process group failed: {e}", file=sys.stderr)

    def _train(self) -> GenerationResult:
        w = self.worker
        fault_point("resize", w)
        # where each rank's state comes from (a sharded run's rows may go back to a step)
        event = w.mode.agree(w, self.place, self.spec.receive_state)
        if event is not None:  # the owner's acknowledgements above it are of records
            self._went_back_to = event["step"]  # this generation trains again
            self.events += [event] if self.rank == 0 else []
        if self.spec.broadcast:
            self._broadcast_state(self.spec.receive_state)
        # a stream's newest state may be a peer's (a fault left it on its reader)
        event = w.pipeline.share(self.rank, self.world_size, opening=True)
        self.events += [event] if event else []
        with _out_of_memory_hint(w.config):  # measuring the pass cost runs passes
            event = w.start_generation(self.rank, self.world_size)
        self.events += [event] if event else []
        self._position_input(first=True)
        w.mode.started(w, self.place)  # a sharded run's partner copies of the new layout
        self.events += w.mode.take_events(self.rank, wait=False)
        with _out_of_memory_hint(w.config):
            return self._loop()

    def _position_input(self, first: bool) -> None:
        """Stand the input pipeline at the coming step; together, in a wait, at the
        generation's `first` and where a rank opens a stream mid-epoch
        (engine.data.stream_pipeline.StreamPipeline.opens, the same answer on every rank). Streams
        read again from their epoch's start, or catching up from a state, take as long as they take,
        on some ranks only: the others wait for them here, while they live, instead of in the step's
        first collective, whose timeout would count them hung."""
        w, p = self.worker, self.worker.progress

        def position() -> None:
            w.pipeline.position(*w.input_at(self.rank, self.world_size))
        if w.pipeline.opens(p.epoch, p.position, self.world_size) or first:
            work_then_wait(self.control, self.rank, self.world_size,
                           f"positioning the input of step {p.step + 1}", position,
                           self.spec.timeout)
        else:  # quick: every stream the step reads stands in place already
            position()

    def _broadcast_state(self, receive: bool) -> None:
        w = self.worker
        if self.rank == 0:  # newcomers take the frozen weights their cell built: still ours?
            w.frozen.verify()
        live = w.capture(copy_tensors=False) if self.rank == 0 else None  # read, never kept
        if live is not None:
            live["pending"] = w.pending  # a step whose evaluation a fault interrupted
        # a receiver's model tensors take the bytes in place
        into = w.capture(copy_tensors=False) if receive else None
        fault_point("broadcast", w)
        sent: dict = {}
        start = time.perf_counter()
        # its collectives raise PeerFailure; a local error (a layout it cannot take) is an error
        state = broadcast_state(live, self.rank, w.device, into=into, sent=sent)
        if sent:  # rank 0: what a grow moved (frozen weights stay: engine.state.frozen)
            self.events.append({"kind": EventKind.STATE_SENT.value, "step": w.progress.step,
                                "bytes": sent["bytes"], "tensor_bytes": sent["tensor_bytes"],
                                "seconds": round(time.perf_counter() - start, 3),
                                "frozen_bytes": w.frozen.nbytes if w.frozen.names else 0})
        if receive:
            w.restore(state)  # with the step whose evaluation a fault interrupted

    def _leave_flag(self) -> float:
        """Rank 0's vote to leave after the coming step: the owner's request as read in the
        last vote's trip (the request's text only when its counter moved)."""
        if self.rank != 0:
            return 0.0
        if self.vote.read_values:
            version = int(self.vote.read_values[0])
            if version != self._version:
                self._version = version
                self.end_at = decode_end_at(self.control.get(END_AT_KEY))
        want = self.end_at
        return 1.0 if want is not None and self.worker.progress.step + 1 >= want else 0.0

    def _loop(self) -> GenerationResult:
        w, rank, world_size = self.worker, self.rank, self.world_size
        p = w.progress
        events, last_publish = self.events, 0.0
        # this generation's records: those after `first` (a pending step's too)
        first = p.step - 1 if w.pending is not None else p.step
        published = [first, first]  # newest steps at the last two updates
        reason: Literal["finished", "left"] = "left"
        if rank == 0:  # the key each vote reads: made here if the owner never wrote a request
            self.control.add(VERSION_KEY, 0)
        if w.pending is not None:  # a fault hit the evaluation of the last committed step
            self._finish_step(w.pending)
        positioned = p.step  # the first step's input stands in place (_train)
        while p.step < w.total_steps:
            if p.step != positioned:
                self._position_input(first=False)
            # a rank told to go (SIGTERM) votes to leave like rank 0 does for the owner
            flag = max(self._leave_flag(), float(drain.requested()))
            record, leave = w.train_step(rank, world_size, self.vote, flag)
            self._finish_step(record)
            events += self._writes(wait=False)
            if rank == 0:
                events += w.checkpoints.events()
                now = time.time()
                if now - last_publish >= PUBLISH_INTERVAL:
                    # the owner sees only the newest update: overlapping windows survive one
                    # missed poll, and the generation's result carries what it still lacks
                    publish({"records": w.history.since(max(published[0],
                                                             p.step - PUBLISH_WINDOW)),
                              "events": events})
                    published = [published[1], p.step]
                    last_publish = now
            if leave and p.step < w.total_steps:
                w.pipeline.share(rank, world_size, opening=False)  # a leaver's streams
                # a sharded run's leavers hand their rows over first
                self.handed_over = w.mode.leave(w, self.place, drain.requested(),
                                                self._named_leavers)
                break
        else:
            reason = "finished"
        events += self._writes(wait=True)  # the generation's checkpoints end with it
        if rank == 0:
            events += w.checkpoints.drain()
        acknowledged = self._acknowledged()
        return GenerationResult(
            reason=reason, progress=p.as_dict(),
            records=w.history.since(max(first, acknowledged or 0)) if rank == 0 else [],
            events=events, drained=drain.served(), handed_over=self.handed_over)

    def _named_leavers(self) -> list[int] | None:
        """Rank 0: the ranks the owner named to leave (a sharded run's hand-over), read once
        for all ranks; None when it named none."""
        if not self.control.check([LEAVERS_KEY]):
            return None
        return [int(r) for r in self.control.get(LEAVERS_KEY).decode().split(",") if r]

    def _writes(self, wait: bool) -> list[Event]:
        """Rank 0's events of the state mode since the last call (its copies, the checkpoint
        writes that ended; every write with `wait`)."""
        return self.worker.mode.take_events(self.rank, wait)

    def _acknowledged(self) -> int | None:
        """The newest step up to which the owner's run log holds every record (it writes it
        under ``acknowledged``), or None when no owner writes it (a run driven by a test)."""
        if not self.control.check([ACKNOWLEDGED_KEY]):
            return None
        acknowledged = int(self.control.get(ACKNOWLEDGED_KEY))
        if self._went_back_to is not None:  # until the owner's log went back too
            if acknowledged > self._went_back_to:
                return self._went_back_to
            self._went_back_to = None
        return acknowledged

    def _finish_step(self, record: dict) -> None:
        """After a committed step, on every rank: its evaluation when one is due, its history
        record, the scheduler's step, and its checkpoint when one is due (the state mode's:
        rank 0's, or every rank's part). A fault in the evaluation (a collective) leaves the
        record as ``Worker.pending`` on every survivor (the vote ends an evaluation alike
        everywhere), and the next generation finishes it first.
        Before the final evaluation, rank 0 writes the final state (:meth:`_keep_final_state`):
        an error there (the user's metric_fn) fails the run but loses no training."""
        w, step = self.worker, self.worker.progress.step
        mode = w.mode
        if mode.evaluation_due(step, w.total_steps):
            if step >= w.total_steps and self.rank == 0:
                self._keep_final_state(record)
            try:
                record.update(w.evaluate(self.rank, self.world_size, self.vote))
            except BaseException:
                if self.rank == 0:  # the error is told once that state is written
                    w.checkpoints.wait()
                raise
        w.history.append(record)
        step_lr_scheduler(w, record)
        w.pending = None
        mode.step_finished(w, self.place, step)  # a sharded run's settled and periodic copies
        if step % ACKNOWLEDGED_EVERY == 0 or self._acknowledged_step is None:
            self._acknowledged_step = self._acknowledged()
        w.forget_history(self._acknowledged_step)
        if mode.checkpoint_due(step, w.total_steps):
            # every stream's newest state in the checkpoint (a collective: after the step is
            # finished everywhere, so a peer failing here leaves every survivor alike)
            w.pipeline.share(self.rank, self.world_size, opening=False)
            mode.checkpoint(w, self.place, step)  # by rank 0, or every rank its part

    def _keep_final_state(self, record: dict) -> None:
        """Rank 0, before the final evaluation: write the final state as a checkpoint, its
        last step `record` still to finish (``pending``: its evaluation, history record and
        scheduler step), so that user code failing in that evaluation loses no training:
        ``run.state_dict()`` and ``export()`` read it, and ``--resume`` loads it and finishes
        the step (Worker.restore). Once the evaluation succeeded, the final checkpoint is
        written again as always (the state mode's ``checkpoint``), the step finished. Copied
        as a periodic checkpoint is (the evaluation sets rank 0's buffers again) and written
        while the evaluation runs: the other ranks do not wait for the disk in its
        collectives."""
        w = self.worker
        checkpoints = w.checkpoints
        if not checkpoints.writes or w.eval_dataset is None \
                or checkpoints.saved_step == record["step"]:
            return  # nothing to evaluate; or written already (a generation before a fault)
        checkpoints.write(w.capture, last=False, pending=record)
