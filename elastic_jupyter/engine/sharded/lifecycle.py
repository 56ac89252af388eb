"""What ``shard=True`` changes in a Worker: the model sharded over each generation, equal passes.

In the sharded mode (engine.sharded.resizable_model) the Worker's step is the replicated mode's,
with three differences this module owns:

- the model is sharded with FSDP2 over the generation's process group when the generation
  starts, and its gradients are reduce-scattered (engine.sharded.reduce_scatter) instead of
  all-reduced;
- every rank runs the same number of forward and backward passes in a step, because FSDP2's
  all-gathers and reduce-scatters are collectives: a rank with fewer micro-batches than rank 0
  first runs zero-weight passes over rank 0's first micro-batch (its gradients are zeros; its
  BatchNorm statistics and random draws are not kept);
- what the sharded mode does not support yet is refused at setup (engine.modes.sharded).

At each generation's start the ranks tell each other which rows they hold and move them to
the generation's layout in memory (engine.sharded.resizable_model's ``reshard_to``): newcomers
receive theirs from the holders. Where ranks leave at a generation's end, they first hand their rows
to those that stay (:meth:`ShardedMode.leave`: a shrink is a drain). Each rank's part is also kept
by its partner in host memory every ``replica_every`` steps and after each resize
(engine.sharded.replicas): after a fault the survivors go back to that step and take the lost rows
from the copies. Checkpoints are written one part per rank (engine.sharded.checkpoint_parts), beside
training, from the host copy of a refresh at the same step (engine.sharded.part_writer); a run
resumes from one at any world size, and goes back to the newest when a rank was lost with its
partner. At setup each rank counts the memory it needs at every world size
(engine.sharded.memory_need): the owner derives the run's memory bound from it, and each generation
whether its passes must reduce-scatter one by one.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ...config.run import RunConfig
from ...events import Event, EventKind
from ..data.batching import BatchPlan
from ..data.randomness import host_generator_state, set_host_generator_state
from ..data.to_device import to_device
from ..group.collective import collective
from ..protocol import TrainingState
from ..state import history
from ..step.objects import CellObjects, SetupError
from .checkpoint_parts import commit, folder_bytes, latest, prune, read_rows, read_state, write_part
from .memory_need import MemoryNeed, activation_bytes
from .part_writer import PartWriter
from .reduce_scatter import ShardedReducer
from .replicas import HostBuffers, PartnerReplicas
from .reshard import Layout
from .resizable_model import ShardedModel, ShardingError, Snapshot


def is_pad(index: int) -> bool:
    """Whether pass `index` (from :meth:`ShardedMode.padded`) is a zero-weight pass."""
    return index < 0


def pad_source(index: int) -> int:
    """The micro-batch a zero-weight pass `index` reads (its random stream too)."""
    return -index - 1


class ShardedMode:
    """The sharded mode of one Worker.

    Args:
        objects: the cell's objects; ``shard_fn(model, mesh)`` when the cell defines one.
        config: the run's options.
        device: the engine's (on a GPU, the cell's trained parameters stay on the host until
            the first mesh shards them: engine.worker).
    Raises SetupError for a model it cannot lay out. What the sharded mode does not support
    yet is refused before, by engine.modes.sharded.Sharded.check: build this through it.

    Attributes:
        held: the layout of the rows this rank holds, (world size, rank), or None (a newcomer,
            a leaver). Before the first generation every engine holds the cell's whole model:
            rank 0 of one; at the first generation only rank 0's counts (the others are sent
            the state, as in the replicated mode).
        parked: rows handed over at the last generation's end (:meth:`leave`), not yet in a
            module (their mesh is the next generation's).
        replicas: partner replicas (engine.sharded.replicas), refreshed by :meth:`refresh`.
    """

    def __init__(self, objects: CellObjects, config: RunConfig,
                 device: torch.device = torch.device("cpu")):
        # what this mode refuses was refused before (engine.modes.sharded.Sharded.check)
        # bf16: the forward under autocast, as in the replicated mode (FSDP2's bf16 gathers,
        # MixedPrecisionPolicy(param_dtype=bf16), would meet BatchNorm's fp32 buffers)
        self.objects, self.global_batch = objects, config.global_batch  # (activations)
        self.model = ShardedModel(objects.model, objects.shard_fn,
                                  frozen_stay=not config.move_frozen)
        try:
            self.model.check()
        except ShardingError as e:
            raise SetupError(str(e)) from None
        self.reducer = ShardedReducer(clips=config.clip_grad_norm is not None)
        self.held: tuple[int, int] | None = (1, 0)
        self.parked: Snapshot | None = None
        self.replicas = PartnerReplicas()  # this rank's and its partner's parts, host memory
        # the rest of the state at the replicas' step
        self.replica_state: TrainingState | None = None
        # the copies before the last refresh and their state, until a step commits after it
        # (every rank then finished that refresh): a fault in between may find a rank with
        # the new copies and one without them, and both hold these
        self.previous: tuple[PartnerReplicas, TrainingState | None] | None = None
        self.spare = HostBuffers()  # the buffers of settled copies, for the next refresh
        self._refreshing: PartnerReplicas | None = None  # the copies a refresh is making
        self.disk: str | None = None  # a checkpoint to resume from (:meth:`resume`)
        self.folder = config.checkpoint_dir  # sharded checkpoints go there
        self.writer = PartWriter()  # this rank's checkpoint parts, written beside training
        self.need: MemoryNeed | None = None  # what a rank needs (:meth:`count_memory`)
        self.budget = config.memory_per_rank  # what it may use (bytes; None: no bound)
        self._plan = _Plan()  # agreed at the generation's start

    def count_memory(self, optimizer: torch.optim.Optimizer | None, micro_batches: int | None,
                     device: torch.device) -> dict:
        """At setup, before the first generation: count the memory a rank needs at each world
        size (engine.sharded.memory_need; `micro_batches` in a full step), with one micro-batch's
        activations where there is a budget (``loss_fn`` then runs once on the meta device).
        The budget is
        ``memory_per_rank``, else a GPU's memory. Returns {"need", "budget", "given"} for
        the owner (run.memory_bound)."""
        given = self.budget is not None
        if not given and device.type == "cuda":
            self.budget = torch.cuda.get_device_properties(device).total_memory
        activations = self._activations(micro_batches) if self.budget is not None \
            else (0, "activations not counted: no memory bound")
        self.need = self.model.memory_need(optimizer, micro_batches, activations)
        return {"need": self.need.as_dict(), "budget": self.budget, "given": given}

    def _activations(self, micro_batches: int | None) -> tuple[int, str]:
        """One micro-batch's activations (engine.sharded.memory_need's ``activation_bytes``), on the
        dataset's first samples; the random generators as they were."""
        if not micro_batches:
            return 0, "activations not counted: the cut is measured at the start"
        cell = self.objects
        samples = -(-min(self.global_batch, len(cell.dataset)) // micro_batches)
        host = host_generator_state()
        try:
            with torch.random.fork_rng(devices=[]):
                batch = cell.collate_fn([cell.dataset[i] for i in range(samples)])
                return activation_bytes(self.model.skeleton, cell.substeps[0].loss_fn,
                                        to_device(batch, torch.device("meta")))
        except Exception as e:  # pylint: disable=broad-except  # the trials report it
            return 0, f"activations not counted: reading a micro-batch failed ({e})"
        finally:
            set_host_generator_state(host)

    def resume(self, path: str) -> None:
        """Start from the sharded checkpoint folder `path` (engine.sharded.checkpoint_parts) at the
        next generation, at its world size, whatever the world size that wrote it."""
        self.disk = path

    def agree(self, world_size: int, newcomer: bool, step: int,
              roll_back: Callable[[TrainingState], None]) -> Event | None:
        """At a generation's start, before the rest of the state is broadcast, on every rank
        (a collective): the ranks say which rows they hold and agree where each new rank's
        rows come from: the ranks that hold them, or a checkpoint a rank resumes from.
        `newcomer`: this rank is sent the state; `step`: the committed step it holds.

        When some rank's rows were lost (a fault), the survivors go back to their partner
        replicas' step (Gemini, SOSP'23): `roll_back(state)` loads the rest of the state as
        it was there (progress, history, scheduler), and the lost rows come from their
        partners' copies. When a rank was lost with its partner (or at W = 1), every rank
        goes back to the newest sharded checkpoint in ``checkpoint_dir`` instead. Returns
        the event that says where the run went back to ("rollback", "fallback"), else None.
        Raises ShardingError when there is nowhere, PeerFailure when a peer fails."""
        self.writer.wait()  # the last write ended (or gave up) before the disk is read
        if newcomer:
            self.held, self.parked, self.replicas, self.replica_state = None, None, \
                PartnerReplicas(), None
            self.previous = None
        if self.parked is None and not self.model.holds_rows:
            self.held = None  # its rows went elsewhere (or a start failed after a hand-over)
        copies = [c for c in (self.replicas, self.previous and self.previous[0])
                  if c is not None and c.step is not None]
        # each copy as (step, world size, generation, rank); the count of rank 0 decides
        mine = (self.held, step, [(c.step, c.world_size, c.generation, c.rank) for c in copies],
                self.disk, self.budget, self.need)
        box: list = [None] * world_size
        with collective("the sharded layout"):
            dist.all_gather_object(box, mine)
        budgets = [b[4] for b in box if b[4] is not None]  # one decision on every rank
        self.reducer.per_pass = box[0][5] is not None and box[0][5].per_pass(
            world_size, min(budgets) if budgets else None)
        held, disks = [b[0] for b in box], {b[3] for b in box} - {None}
        if disks:  # a resume: every rank reads its rows
            return self._from_disk(disks.pop() if len(disks) == 1 else None, roll_back)
        if _complete(held) and len({b[1] for b in box if b[0] is not None}) == 1:
            self._plan = _Plan(layout=_layout(held, world_size))
            return None
        lost = self._recovery(box, world_size)
        if lost is not None:  # rows nowhere in memory
            return self._from_disk(latest(self.folder) if self.folder else None, roll_back,
                                   f"rank(s) {lost} were lost with their partner's copy")
        # back to the replicas' step, every rank: a rank that holds none of those copies (a
        # newcomer whose first refresh a fault cut short) takes their holders' state and rows
        holder = self._plan.holds
        state = [self.replica_state if holder else None]
        with collective("the sharded layout"):
            dist.broadcast_object_list(state, src=self._plan.source)
        assert state[0] is not None, "the holders keep the rest of the state with replicas"
        roll_back(state[0])
        self.held = (self.replicas.world_size, self.replicas.rank) if holder else None
        back = state[0]["progress"]["step"]
        return {"kind": EventKind.ROLLBACK.value, "step": back,
                "message": f"ranks were lost at step {step}: the run goes back to step {back}, "
                           "where the partner replicas stand"}

    def _from_disk(self, path: str | None, roll_back: Callable[[TrainingState], None],
                   why: str | None = None) -> Event | None:
        """Plan to read every rank's rows from the checkpoint folder `path` and load the rest
        of its state (`why`: the fault that sends the run there, for its event)."""
        if path is None:
            raise ShardingError(
                f"{why}: their rows are nowhere in memory, and the run has no sharded "
                "checkpoint to go back to (give it a checkpoint folder)" if why else
                "the ranks were told to resume from different checkpoints")
        state = read_state(path)
        assert state is not None
        roll_back(state)
        # until a start read its rows, the claim stays: a fault meanwhile comes back here
        self._plan, self.disk, self.parked = _Plan(path=path), path, None
        if why is None:
            return None
        return {"kind": EventKind.FALLBACK.value, "step": state["progress"]["step"], "path": path,
                "message": f"{why}: the run goes back to its checkpoint of step "
                           f"{state['progress']['step']}"}

    def _recovery(self, box: list, world_size: int) -> list[int] | None:
        """Plan the layout from the partner replicas, once every rank said what it holds
        (`box`); returns the lost ranks when some rows are nowhere in memory (else None):
        lost with their partner's copy, or the survivors hold no replicas of one step."""
        chosen, rank_in = _newest_whole(box)
        if chosen is None:  # no copies of one step cover every rank: rows to find on disk
            sizes = {h[0] for h in (b[0] for b in box) if h is not None}
            return sorted(set(range(max(sizes, default=1))) - {
                b[0][1] for b in box if b[0] is not None})
        me, r = dist.get_rank(), self.replicas
        if me in rank_in and (r.step, r.world_size, r.generation) != chosen:
            assert self.previous is not None  # a refresh cut short: the copies before it
            self.replicas, self.replica_state = self.previous
            self.previous = None  # (a settle must not give the copies in use to the next refresh)
        if me not in rank_in:  # its rows, copies and any rows handed over are of no use now
            self.parked, self.replicas, self.replica_state = None, PartnerReplicas(), None
            self.previous = None
        lost = set(range(chosen[1])) - set(rank_in.values())  # ranks of the replicas' layout
        found = self.replicas.recovery(lost) if me in rank_in else ((), {})
        gathered: list = [None] * world_size
        with collective("the sharded layout"):
            dist.all_gather_object(gathered, None if found is None else found[0])
        if any(gathered[i] is None for i in rank_in):
            return sorted(lost)
        old = tuple(rank_in.get(i) for i in range(world_size))
        self._plan = _Plan(Layout(old, tuple(range(world_size)), tuple(g or () for g in gathered)),
                           self.replicas.own if me in rank_in else Snapshot({}, {}, {}),
                           found[1] if found else {}, source=min(rank_in),
                           holds=me in rank_in)
        return None

    def start(self, rank: int, world_size: int, optimizer: torch.optim.Optimizer,
              device: torch.device) -> nn.Module:
        """After :meth:`agree` and the broadcast, on every rank (a collective): the rows move
        to this generation's layout (engine.sharded.reshard: only rows whose owner changes, point to
        point; or read from the checkpoint) and the module is built on the generation's
        mesh, `optimizer` pointed at it. Returns the module. Raises PeerFailure when a peer
        fails, CheckpointError when a part cannot be read."""
        plan = self._plan
        group = dist.group.WORLD
        assert group is not None, "a generation's process group is formed first"
        mesh = DeviceMesh.from_group(group, device.type)
        module: nn.Module | None
        if plan.path is not None:
            module = self.model.load(mesh, optimizer, device,
                                     *read_rows(plan.path, rank, world_size))
            self.disk = None
        else:
            assert plan.layout is not None
            held = plan.own if plan.own is not None else self.parked
            module = self.model.reshard_to(mesh, plan.layout, rank, optimizer, device, held,
                                           plan.copies,
                                           consume=held is not None and held is self.parked)
        self.parked = None  # only now: a start that fails keeps them for the next one
        assert module is not None
        self.reducer.attach(module)
        self.held = (world_size, rank)
        return module

    def checkpoint(self, step: int, rank: int, world_size: int,
                   capture: Callable[[], TrainingState],
                   keep: int, attempt: int, timeout: float) -> None:
        """At committed step `step`, on every rank, right after a refresh at that step
        (:meth:`refresh`: this rank's part is on the host): start writing this rank's part of
        the checkpoint into ``checkpoint_dir`` beside training (engine.sharded.part_writer); rank 0
        then commits it with `capture()`, the rest of the state, and keeps the newest `keep`.
        `attempt`: the generation; `timeout`: how long rank 0 waits for the other parts.
        Failures come back as ``checkpoint_failed`` events (:attr:`writer`)."""
        assert self.folder is not None and self.replicas.step == step
        part, folder, shapes = self.replicas.own, self.folder, self.model.shapes
        aliases = self.model.aliases
        assert part is not None
        state = capture() if rank == 0 else None
        if state is not None:  # the run's history file gets the records it lacks first
            try:
                os.makedirs(folder, exist_ok=True)
                history.append(folder, state.get("history") or [])
            except OSError as e:  # the parts are still written: every rank takes part
                print(f"the run's history file was not appended: {e}", file=sys.stderr)

        def write(abort: threading.Event) -> Event | None:
            write_part(folder, step, attempt, part, rank, world_size)
            if rank != 0:
                return None
            path = commit(folder, step, attempt, world_size, part, shapes, state, abort,
                          timeout, aliases)
            prune(folder, keep)
            return {"kind": EventKind.CHECKPOINT.value, "step": step, "path": path,
                    "sharded": True, "bytes": folder_bytes(path)}
        self.writer.submit(step, write, reads=part)

    def refresh(self, step: int, rank: int, world_size: int, optimizer: torch.optim.Optimizer,
                capture: Callable[[], TrainingState], generation: int = 0) -> int:
        """At committed step `step`, on every rank (a collective): this rank's part copied
        to host memory and sent to its partner (engine.sharded.replicas), with `capture()`, the rest
        of the state (engine.state.training_state's capture without rows). Returns the bytes
        sent."""
        part = self.model.snapshot(optimizer)
        fresh = PartnerReplicas()  # the copies held stay as they are until these are whole
        self._refreshing = fresh  # its buffers count in host_bytes while they fill
        try:
            sent = fresh.refresh(step, part, {n: s[0] for n, s in self.model.shapes.items()},
                                 rank, world_size, generation, self.spare)
            state = capture()
            self.previous = (self.replicas, self.replica_state) \
                if self.replicas.step is not None else None
            self.replicas, self.replica_state = fresh, state
        finally:
            self._refreshing = None
        return sent

    @property
    def host_bytes(self) -> int:
        """The host memory the partner replicas hold on this rank: the newest copies, those
        before them until they settle, those of a refresh under way and the buffers kept for
        the next refresh. Read from other threads (a memory sampler) too."""
        replicas, previous, fresh = self.replicas, self.previous, self._refreshing
        return replicas.nbytes + self.spare.nbytes + \
            (previous[0].nbytes if previous is not None else 0) + \
            (fresh.nbytes if fresh is not None and fresh is not replicas else 0)

    def settle(self) -> None:
        """After a step committed (every rank finished the refresh before it): the copies
        from before that refresh are dropped; their buffers wait for the next refresh when
        it can reuse them (the same layout) and no checkpoint is being written from them."""
        old, new = self.previous[0] if self.previous is not None else None, self.replicas
        if old is not None and (old.world_size, old.rank) == (new.world_size, new.rank) \
                and not self.writer.reads(old.own):
            self.spare.keep(old)
        self.previous = None

    def leave(self, rank: int, world_size: int, drained: bool, named: list[int] | None,
              optimizer: torch.optim.Optimizer) -> list[int]:
        """At the generation's end, on every rank (a collective): the ranks that go are those
        told to go (`drained`: this one) and those the owner named (`named`, as rank 0 read
        them: one list for every rank). When some go, every rank hands its rows to the layout
        of those that stay, in rank order; a leaver then holds nothing. Returns the ranks that
        go; when all of them do, their rows stay where they are (the caller writes a
        checkpoint). Raises PeerFailure."""
        box: list = [None] * world_size
        with collective("the ranks that leave"):
            dist.all_gather_object(box, (drained, named))
        going = sorted({r for r, (told, _) in enumerate(box) if told} | set(box[0][1] or ()))
        if not going or len(going) == world_size:
            return going
        stay = [r for r in range(world_size) if r not in going]
        new = tuple(stay.index(r) if r in stay else None for r in range(world_size))
        layout = Layout(tuple(range(world_size)), new)
        self.parked = self.model.hand_over(layout, rank, optimizer)
        self.reducer.close()
        self.held = None if rank in going else (len(stay), stay.index(rank))
        return going

    @staticmethod
    def padded(plan: BatchPlan, batch: torch.Tensor, parts: list[tuple[int, torch.Tensor]],
               world_size: int) -> list[tuple[int, torch.Tensor]]:
        """`parts`, a rank's (index, sample indices) passes of a step over `batch`, with as
        many zero-weight passes in front as make them rank 0's count (the most any rank
        has); a zero-weight pass's index is negative (:func:`is_pad`)."""
        first = plan.rank_micro_batches(batch, 0, world_size)
        index, chunk = first[0]
        return [(-index - 1, chunk)] * (len(first) - len(parts)) + parts


@dataclass
class _Plan:
    """Where this generation's rows come from: the holders' `layout` (with this rank's `own`
    part and `copies` of lost ranks' parts after a fault), or the checkpoint at `path`."""

    layout: Layout | None = None
    own: Snapshot | None = None
    copies: dict | None = None
    path: str | None = None
    source: int = 0  # after a fault: a group rank that holds the replicas' state
    holds: bool = True  # after a fault: this rank holds copies of that step


def _newest_whole(box: list) -> tuple[tuple[int, int, int] | None, dict[int, int]]:
    """After a fault, from what every rank said it holds (`box`): the newest replicas'
    (step, world size, generation) whose copies on the survivors cover every rank of that
    layout (each rank's own, else its partner's), and {group rank: its rank there} of their
    holders; (None, {}) when none does. A survivor without them (a newcomer whose first
    refresh a fault cut short) is sent their rows and state as a newcomer is."""
    survivors = [i for i, b in enumerate(box) if b[0] is not None]
    for chosen in sorted({c[:3] for i in survivors for c in box[i][2]}, reverse=True):
        rank_in = {i: c[3] for i in survivors for c in box[i][2] if c[:3] == chosen}
        lost = set(range(chosen[1])) - set(rank_in.values())
        if chosen[1] > 1 and not any((r + 1) % chosen[1] in lost for r in lost):
            return chosen, rank_in
    return None, {}


def _complete(held: list) -> bool:
    """Whether the (size, rank) layouts the ranks hold (None: nothing) are of one size and
    hold each of its ranks once."""
    sizes = {h[0] for h in held if h is not None}
    ranks = sorted(h[1] for h in held if h is not None)
    return len(sizes) == 1 and ranks == list(range(*sizes))


def _layout(held: list, world_size: int) -> Layout:
    """The resharding from the complete layout the group's ranks hold rows in (`held`: (size,
    rank) or None per group rank) to ranks 0..world_size-1."""
    return Layout(tuple(h[1] if h is not None else None for h in held), tuple(range(world_size)))
