"""Fault injection for tests and benchmarks: make an engine stop at a chosen phase of a step.

Off unless the run's config names a ``fault_dir``. A test arms a phase by writing the slot of
the engine that should stop into ``<fault_dir>/arm.<phase>``; that engine, on reaching the
phase, claims the file and holds there until it is killed, so a SIGKILL sent from outside lands
exactly in that phase instead of wherever the engine happened to be.
"""
from __future__ import annotations

import os
import time
from typing import Protocol

from ..config.run import RunConfig

FAULT_HOLD = 30.0  # seconds an armed fault point waits for its kill


class Progress(Protocol):
    """Where the engine's run stands (engine.state.training_state.Progress)."""

    @property
    def step(self) -> int: ...


class Engine(Protocol):
    """What a fault point reads of the engine's Worker."""

    @property
    def config(self) -> RunConfig: ...
    @property
    def slot(self) -> int | None: ...
    @property
    def progress(self) -> Progress: ...


def fault_point(phase: str, worker: Engine | None) -> None:
    """Fault-injection hook (off unless the run's config names a ``fault_dir``).

    When ``<fault_dir>/arm.<phase>`` holds this engine's slot (``worker.slot``), the engine
    claims it, writes ``hit.<phase>.<slot>.<step>`` (holding its pid) and stays in this phase
    until it is killed (or for ``FAULT_HOLD`` seconds).

    Args:
        phase: "join" (before the process group forms), "resize" (just after), "broadcast",
            "forward", "backward", "allreduce", "vote", "optimizer", "evaluate",
            "checkpoint", or "substep" (with several optimizers, before a sub-step that
            follows a committed one); under --shard also "reduce_scatter" (as a gradient lands in
            the backward that reduce-scatters), "refresh" (before the partner replicas' exchange)
            and "handover" (at a generation's end, before the rows go to the ranks that stay).
        worker: the engine's Worker (its config, slot and progress), or None.
    """
    folder = worker.config.fault_dir if worker is not None else None
    if worker is None or not folder:
        return
    arm = os.path.join(folder, f"arm.{phase}")
    slot = worker.slot
    try:
        with open(arm) as f:
            if int(f.read().strip() or -1) != slot:
                return
        os.rename(arm, f"{arm}.claimed")  # atomic: one hit per arming
    except (OSError, ValueError):
        return
    hit = f"hit.{phase}.{slot}.{worker.progress.step}"
    # Written under a hidden name, then renamed: a watcher globbing hit.* never reads it empty.
    with open(os.path.join(folder, f".{hit}"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(folder, f".{hit}"), os.path.join(folder, hit))
    deadline = time.monotonic() + FAULT_HOLD
    while time.monotonic() < deadline:
        time.sleep(0.01)
