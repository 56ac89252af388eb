"""The pool as views read it: ``EnginePool.status()`` (``%elastic_pool status``, the magics'
table) and its lease's part (also in every run's snapshot). Plain data, JSON as it is."""
from __future__ import annotations

from typing import TypedDict


class EngineStatus(TypedDict):
    """One engine (pool.processes.Engine's fields)."""

    slot: int | None  # None: a warm engine on no slot
    device: str  # "cpu" or "cuda:<physical GPU id>"
    engine_id: int
    set_id: str
    pid: int
    started: float  # wall time it registered
    host: str
    local: bool
    job_id: str  # a scheduler's job ("" elsewhere)


class ExclusionStatus(TypedDict):
    """Why a slot is left out of engine starts (pool.slots.Exclusion's fields)."""

    reason: str
    until: float | None  # wall time it comes back; None: it stays out


class WarmStatus(TypedDict):
    """An auto run's warm engine, set up on no slot."""

    pid: int
    rss_mib: float


class LentStatus(TypedDict):
    slot: int
    to: str  # the borrowing run's name
    user: str


class LeaseStatus(TypedDict):
    """The pool's lease from the machine's arbiter (None outside lease mode)."""

    auto: bool
    weight: float
    slots: list[int]  # training slots
    standby: list[int]
    target: int
    queued: int | None  # place in the machine's queue
    grantable: int
    lend: bool
    lent: list[LentStatus]


class PoolStatus(TypedDict):
    """``EnginePool.status()``: sizes, engines, exclusions, the run on it, the lease."""

    running: bool
    size: int
    start_size: int  # the -n it started with
    size_note: str | None  # a run left the pool at another size than it started with
    min: int
    max: int
    backend: str  # "gloo" or "nccl"
    excluded_slots: dict[int, ExclusionStatus]
    engines: list[EngineStatus]
    warm: list[WarmStatus]
    launcher: str  # where the engines run, in words
    run: str | None  # the active run's name
    queued: dict[int, str]  # slot -> the scheduler's job waiting for it
    run_mode: str | None  # the active run's memory mode
    lease: LeaseStatus | None
