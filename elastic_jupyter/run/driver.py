"""The generation driver: forms each generation, watches it, ends it, on the owner loop.

A run is a sequence of generations (see engine.generation). Between two of them the driver
changes the membership: a shrink stops the youngest engines after they left the group; a grow
adds engines that membership started and set up in the background while the others trained, so
training pauses only for forming the new group and one broadcast of the state. A fault ends a
generation too; recovery brings the members back to one state first. A rank its scheduler told
to go (SIGTERM: preemption, a time limit) ends the generation at a step boundary too
(engine.group.drain): it is dropped with nothing lost, and a replacement is started.

The driver is the only writer of the run's state and error, and holds the run's rendezvous
store (rendezvous.py) from the setup to the end. Decisions come from the Sizer (sizing.py),
engines from Membership (membership.py), the membership changes between two generations from
the Boundary (boundary.py); the final state is kept by FinalState (final_state.py), records
and events go to the RunLog (runlog.py).
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING, Callable

from ..events import EventKind
from . import faults
from ..config import UsageError
from ..engine.protocol import GenerationSpec
from ..pool.engine_calls import remote_message, remote_summary
from ..pool.processes import kill
from ..owner import background
from ..server.snapshot import TRAINING_STATES, RunState
from .boundary import Boundary
from .cellsetup import CellSetup
from .generation_end import GenerationEnded, GenerationFaulted
from .membership import Membership
from .recovery import BelowMinimum, Recovery, RepeatedFailure
from .rendezvous import Rendezvous
from .resume import Resume
from .run_mode import RunMode
from .runlog import RunLog
from .sizing import Decision, Look, SizePolicy, Sizer

if TYPE_CHECKING:
    from ..config import RunConfig
    from ..pool.engine_calls import EngineCalls
    from ..pool.pool import EnginePool
    from ..pool.processes import Engine

POLL = 0.05  # seconds between the driver's looks at a running generation


class GenerationError(Exception):
    """The user's code raised on an engine: the run ends with that engine's traceback."""

    def __init__(self, engine, error):
        super().__init__(str(error))
        self.engine, self.error = engine, error


class Driver:
    """Drives one run's generations.

    Args:
        pool, calls, log, sizer, policies: the size policies the sizer is fed from.
        cell: runs the cell on engines. config, checkpoint_dir: the run's.
        on_end: called on the owner loop once the run reached a final state.

    Attributes:
        membership (members, spares), recovery, boundary (the membership changes between
        generations), final (the final state), rendezvous (the run's store, served from the
        setup to the run's end), state, error.
    """

    def __init__(self, pool: EnginePool, calls: EngineCalls, log: RunLog, sizer: Sizer,
                 policies: list[SizePolicy], cell: CellSetup, config: RunConfig,
                 mode: RunMode, checkpoint_dir: str, on_end: Callable[[], None]):
        self.pool, self.calls, self.log = pool, calls, log
        self.sizer, self.policies, self.cell = sizer, policies, cell
        self.config, self.checkpoint_dir, self._on_end = config, checkpoint_dir, on_end
        self.mode = mode  # where the training state lives (run.run_mode)
        self.supply = pool.supply  # the run's door into the pool's engines and slots
        self.membership = Membership(self.supply, log, self.prepare)
        self.recovery = Recovery(self.membership, calls, log, sizer, self.supply,
                                 checkpoint_dir, config.standby, POLL)
        self.final = mode.final_state(calls, log, checkpoint_dir, config.keep_checkpoints)
        self.boundary = Boundary(self.membership, sizer, log, mode, self.recovery, self.final,
                                 calls, config.standby, POLL)
        self.rendezvous: Rendezvous | None = None
        self.state = RunState.CREATED
        self.error: str | None = None
        self._decision: Decision | None = None  # the newest look's (logged when it changes)
        self.done = threading.Event()
        self._task: asyncio.Task | None = None

    @property
    def members(self) -> list:
        return self.membership.members

    def _wanted(self) -> int:
        return self.sizer.engines_wanted(self.config.standby)

    # ---------------------------------------------------------------- lifecycle

    async def setup(self, size: int, resume_from: str | None) -> str | None:
        """Set the run up on the pool's first `size` engines: the cell everywhere, the
        schedule checked against the run's steps, a checkpoint loaded on rank 0 (returns its
        path) and the rendezvous. On failure the engines forget the run and it re-raises."""
        self.state = RunState.STARTING
        supply = self.supply
        if size != len(supply.engines):
            await supply.resize_idle(size)
        self.membership.start_with(supply.engines[:size])
        self.sizer.begin(size, supply.min_size, supply.usable)
        self.look()  # a schedule given up front; how the run grows
        try:
            await self.cell.run_cell(self.members)
            self._check_schedule()
            if resume_from:
                resume_from = await Resume(self.calls, self.log, self.cell.config).load(
                    self.members[0], self.checkpoint_dir, self.cell.dataset)
            # served on the pool's address: loopback on one host
            self.rendezvous = Rendezvous(self.supply.address,
                                         timeout=self.config.collective_timeout)
            await self._connect(self.members)
        except BaseException:
            if supply.running:
                await self.calls.drop_run(self.members)
            self.membership.start_with([])
            raise
        return resume_from

    async def prepare(self, engines: list[Engine]) -> None:
        """Set engines that join the run up: the cell, then the rendezvous connection."""
        await self.cell.run_cell(engines)
        await self._connect(engines)

    async def _connect(self, engines: list[Engine]) -> None:
        if (rdv := self.rendezvous) is not None:
            await self.calls.connect_store(engines, rdv.host, rdv.port,
                                           self.config.collective_timeout)

    def _check_schedule(self) -> None:
        total = self.cell.total_steps
        for at_step, n in self.sizer.schedule:
            self.pool.check_size(n)
            if not 0 < at_step < total:
                raise UsageError(f"scheduled resize at step {at_step} is outside the run's "
                                 f"steps 1..{total - 1}")

    def fail_setup(self, error: BaseException) -> None:
        """The setup raised `error` (already reported to the caller): the run is failed."""
        self.state, self.error = RunState.FAILED, str(error)
        self.done.set()

    def launch(self) -> None:
        """Start driving generations in the background (after the run's setup)."""
        self.state = RunState.TRAINING
        self._task = background(self._drive(), lambda e: self.log.log(f"driver failed: {e}"))
        self.membership.boot(self._wanted())

    async def _drive(self) -> None:
        """The recovery loop: generation after generation until the run ends."""
        generation, broadcast = 0, True  # generation 0: every rank takes rank 0's state
        newcomers = {e.engine_id for e in self.members[1:]}
        try:
            while True:
                end = await self._run_generation(generation, newcomers, broadcast)
                generation += 1
                if isinstance(end, GenerationFaulted):
                    newcomers = await self.recovery.recover(end.outcome)
                else:
                    # a sharded run's rows are saved once every rank left: else one more to stop
                    saved = self.mode.saved_for_stop(len(end.handed_over), len(self.members))
                    await self.boundary.drain(end.drained)  # (drained members leave the list)
                    if end.reason == "finished" or (self.sizer.stop_requested and saved):
                        return await self._finish(
                            RunState.FINISHED if end.reason == "finished"
                            else RunState.STOPPED)
                    newcomers = await (self.boundary.after_drain() if end.drained else
                                       self._change_membership(end.step,
                                                               list(end.handed_over)))
                broadcast = bool(newcomers)
        except BelowMinimum as e:
            await self._end_safely(self._stop_below_minimum(str(e)))
        except Exception as e:
            await self._fail(e)
        finally:
            self.done.set()

    async def _end_safely(self, ending) -> None:
        """Run an ending (stop below --min) that may itself fail: then the run fails."""
        try:
            await ending
        except Exception as e:
            await self._fail(e)

    # ---------------------------------------------------------------- one generation

    async def _run_generation(self, generation: int, newcomers: set, broadcast: bool
                              ) -> GenerationEnded | GenerationFaulted:
        """Run one generation to its end; returns how it ended. The ranks are told when to end
        (and who leaves then) as each look's decision has it."""
        decision = self.look()
        rendezvous = self.rendezvous
        assert rendezvous is not None, "generations run after the setup opened the store"
        end_at, leavers = decision.end_at, decision.leavers
        rendezvous.request_end(generation, end_at, list(leavers))
        acknowledged = self.log.complete_upto
        rendezvous.acknowledge(generation, acknowledged)
        W = len(self.members)
        tasks = [self.calls.train_generation(engine, GenerationSpec(
            rank=rank, world_size=W, generation=generation,
            backend=self.pool.backend, timeout=self.config.collective_timeout,
            receive_state=engine.engine_id in newcomers, broadcast=broadcast,
            end_at=end_at), self.log.engine_log(engine.slot))
            for rank, engine in enumerate(self.members)]
        first_failure, died = None, False
        while not all(t.future.done() for t in tasks):
            await asyncio.sleep(POLL)
            self.log.merge(tasks[0].live_data())
            if self.log.complete_upto != acknowledged:
                acknowledged = self.log.complete_upto
                rendezvous.acknowledge(generation, acknowledged)
            failed = [(e, error) for e, t in zip(self.members, tasks)
                      if (error := t.error()) is not None]
            for engine, error in failed:
                if not self.supply.alive(engine) or faults.is_engine_death(error):
                    kill(engine)  # a zombie's sockets may still hold peers
                    died = True
            if failed and first_failure is None:
                first_failure = time.monotonic()
                rendezvous.abort(generation)  # ranks waiting for a vote stop waiting
            # a rank blocked with a dead peer fails at once (a closed socket, the owner's abort:
            # engine.group.abort) except where it cannot be told (gloo connecting to an address
            # that no longer answers; nccl before torch 2.7): give it the collective timeout
            # before calling it hung
            grace = faults.HANG_GRACE + (self.config.collective_timeout if died else 0)
            if first_failure is not None and time.monotonic() - first_failure > grace:
                break  # the ranks still out are hung
            decision = self.look()  # a request, or spares became ready
            if (decision.end_at, decision.leavers) != (end_at, leavers):
                end_at, leavers = decision.end_at, decision.leavers
                rendezvous.request_end(generation, end_at, list(leavers))
        outcome = faults.classify(self.members, [t.future for t in tasks])
        if outcome.fault:
            return GenerationFaulted(outcome)
        if outcome.errors:
            await self.final.keep_after_error(tasks[0], self.members[0])
            raise GenerationError(*outcome.errors[0])
        self.log.merge(outcome.results[self.members[0].engine_id], complete=True)
        return GenerationEnded.of(self.members, outcome.results)

    def look(self) -> Decision:
        """One look at the run: the size policies' new requests go to the sizer, which decides
        from what the membership shows (sizing.Look); the decision is logged when it changed
        anything, its engines' part carried out by the membership (Membership.follow: boots,
        trims, spares off slots the arbiter wants back, warm engines), and it is returned for
        the generation's end to follow. Call on the owner loop: at every look at a generation,
        at the setup and when a request is queued."""
        now = time.monotonic()
        membership = self.membership
        membership.readmit()  # slots whose cooldown ended: the target grows back
        decision = self.sizer.look(self.policies, Look(
            step=self.log.step, world_size=len(self.members),
            ready_spares=len(membership.spares), usable=self.supply.usable,
            grow_in_parts=membership.in_parts(), gave_up=membership.gave_up,
            swappable=membership.swappable(), training=self.state in TRAINING_STATES,
            now=now), self.config.standby)
        decision = decision.with_leavers(self._leavers(decision))
        for request in decision.requests:
            self.log.log(f"resize request size={request.size} at_step={request.at_step} "
                         f"from {request.source}")
        if decision != self._decision:
            self.log.log(decision.describe())
        self._decision = decision
        membership.follow(decision, self._warm_wanted(), self.supply.max_size)
        return decision

    def _leavers(self, decision: Decision) -> list[int]:
        """The ranks named to go when the generation ends as `decision` has it (run_mode.RunMode
        .leavers: a sharded run's hand their rows to the others first, and exactly those
        leave, :meth:`_change_membership`)."""
        if decision.end_at is None:
            return []
        return self.mode.leavers(len(self.members), decision.stop, lambda: (
            self.membership.leavers(decision.size_after, decision.wanted)))

    def _warm_wanted(self) -> int:
        """An auto run below its max keeps ``--warm`` engines set up on no slot (none with
        ``--sync-batchnorm``, which a Worker built on the host refuses)."""
        auto = self.supply.auto and not self.config.sync_batchnorm
        grows = len(self.members) < self.supply.max_size and self.state in TRAINING_STATES
        return self.config.warm if auto and grows else 0

    async def _change_membership(self, step: int, handed_over: list) -> set:
        """Apply the size due after `step` (boundary.Boundary.plan); returns the engine ids
        that join. The run is RESIZING while a resize is carried out."""
        plan = self.boundary.plan(step, handed_over)
        if plan.resize is None:
            return set(plan.newcomers)
        self.state = RunState.RESIZING
        newcomers = await self.boundary.resize(plan.resize)
        self.state = RunState.TRAINING
        return newcomers

    # ---------------------------------------------------------------- end states

    async def _finish(self, state: RunState) -> None:
        final = await self.final.take(self.members)
        if state == RunState.STOPPED:
            await self.final.write_checkpoint(final)
        self.state = state
        self.log.event(state.value, world_size=len(self.members))
        await self._release()

    async def _stop_below_minimum(self, message: str) -> None:
        written = self.log.last_event(EventKind.CHECKPOINT)
        self.log.event(EventKind.WARNING, message=message)
        if self.members:
            await self.recovery.roll_back()
            await self._finish(RunState.STOPPED)
        elif written is not None and written["step"] == self.log.step:
            await self._finish(RunState.STOPPED)  # every rank drained: the drain wrote this first
        else:
            self.error = message + " (from the newest checkpoint: all engines were lost)"
            self.state = RunState.FAILED
            self.log.event(EventKind.ERROR, message=self.error)
            await self._release()

    async def _fail(self, error: Exception) -> None:
        if isinstance(error, (GenerationError, RepeatedFailure)):
            again = (" (every failed rank reported a peer's failure, twice in a row with no "
                     "engine lost and no step made: most likely an error on a live rank "
                     "inside a collective, so the run stops instead of retrying)"
                     if isinstance(error, RepeatedFailure) else "")
            self.error = (f"training failed on engine slot {error.engine.slot}{again}: "
                          f"{remote_summary(error.error)}\n--- engine traceback ---\n"
                          f"{remote_message(error.error)}")
        else:
            self.error = f"{type(error).__name__}: {error}"
        self.state = RunState.FAILED
        self.log.event(EventKind.ERROR, message=self.error)
        await self._release()

    async def _release(self) -> None:
        await self.membership.release()
        if self.rendezvous is not None:
            self.rendezvous.close()
        self._on_end()
