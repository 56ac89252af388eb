"""The contract between the kernel and its engines: what a generation is told, what the
rendezvous store's keys are called, and the run's options as an engine reads them.

The kernel (run.driver, run.rendezvous, run.cellsetup) and the engine (engine.generation,
engine.group.vote, engine.group.abort, engine.worker) both spell these names from here, so neither
side reads a field or a key by a string of its own.

- :class:`GenerationSpec` travels to each rank of a generation (pickled by ipyparallel: owner
  and engines run the same package, which init_engine's versions check).
- The store's keys: the owner writes a generation's requests under ``gen<g>/``
  (:func:`generation_prefix`); the ranks form their process group under ``pg/`` within it and
  vote under ``vote/<round>/<rank>``.
- :class:`GenerationResult` comes back from each rank when its generation ends; its
  ``progress`` is a :class:`ProgressState`, as in every checkpoint (:class:`TrainingState`).
- The run's options are config.RunConfig's: the kernel sends ``RunConfig.as_dict()`` (also
  what checkpoints store) and the engine reads it back with ``RunConfig.from_dict``.

This module imports the standard library and the shared event kinds only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from ..events import Event

# ---------------------------------------------------------------- the rendezvous store's keys

END_AT_KEY = "end_at"  # the owner's request: leave after this step ("none": keep training)
VERSION_KEY = "version"  # counts the owner's requests: rank 0 reads end_at only when it moved
ACKNOWLEDGED_KEY = "acknowledged"  # the newest step the owner's run log holds every record to
ABORT_KEY = "abort"  # set by the owner once a rank died: waits on its peers end now
LEAVERS_KEY = "leavers"  # ranks the owner stops after end_at, "0,2" (a sharded run's hand-over)
PROCESS_GROUP_PREFIX = "pg/"  # the process group's own keys, within the generation's prefix
END_AT_NONE = "none"  # END_AT_KEY's value for "no request"


def generation_prefix(generation: int) -> str:
    """The key prefix of generation `generation`'s store: no key of an old generation is ever
    read by a new one."""
    return f"gen{generation}/"


def vote_key(round_: int, rank: int) -> str:
    """The key of `rank`'s vote in round `round_` of a generation's commit vote
    (engine.group.vote)."""
    return f"vote/{round_}/{rank}"


def encode_end_at(end_at: int | None) -> str:
    """END_AT_KEY's value for a request to leave after step `end_at` (None: keep training)."""
    return END_AT_NONE if end_at is None else str(end_at)


def decode_end_at(raw: bytes) -> int | None:
    """The step END_AT_KEY's stored value `raw` asks to leave after; None: no request."""
    text = raw.decode()
    return None if text == END_AT_NONE else int(text)


# ---------------------------------------------------------------- one generation, one rank


@dataclass(frozen=True)
class GenerationSpec:
    """What one rank of a generation is told at its start (engine.generation.run_generation).

    Attributes:
        rank, world_size: this rank and the generation's size.
        generation: the generation's number (its store prefix, :func:`generation_prefix`).
        backend: torch.distributed's backend, "gloo" or "nccl".
        timeout: seconds a collective (and a missing vote) waits at most.
        receive_state: this rank is a newcomer, sent the state by rank 0.
        broadcast: some rank of the generation is a newcomer (every rank joins the broadcast).
        end_at: leave after this step; None: keep training (the owner may ask later).
    """

    rank: int
    world_size: int
    generation: int
    backend: str
    timeout: float
    receive_state: bool = False
    broadcast: bool = False
    end_at: int | None = None


# ---------------------------------------------------------------- what comes back, what is kept


class ProgressState(TypedDict):
    """Where the run stands, as plain data (engine.state.training_state.Progress.as_dict): in every
    checkpoint's ``progress``, in a generation's result, in the owner's recovery."""

    step: int  # optimizer steps done
    epoch: int
    position: int  # samples of `epoch` used
    samples: int  # samples trained on, all epochs
    metric_names: list[str]  # the extra metrics loss_fn returns, in order
    pass_cost: float | None
    # engine.data.batching.Cut as a dict; None until a generation fixes it
    cut: dict[str, Any] | None
    streams: dict[str, Any] | None  # an iterable dataset's streams (engine.data.stream_split)
    substep: int  # several optimizers: the sub-steps of step + 1 already committed
    losses: dict[str, list[float]]  # their [loss, *extras] by optimizer name


class GenerationResult(TypedDict):
    """What one rank returns when its generation ends (engine.generation.run_generation).

    reason: "finished" (the run's last step is done) or "left" (the owner asked the ranks to
    leave after a step). records and events: complete only on rank 0 (the records are the
    history's dicts: step, loss, lr, ... and extra metrics). drained: the wall time of the
    SIGTERM this rank left for (engine.group.drain), else None. handed_over: the ranks of a sharded
    run that left with their rows handed over (engine.sharded.lifecycle).
    """

    reason: Literal["finished", "left"]
    progress: ProgressState
    records: list[dict[str, Any]]
    events: list[Event]
    drained: float | None
    handed_over: list[int]


class _TrainingStateCore(TypedDict):

    format: int
    model: dict[str, Any]
    optimizer: dict[str, Any]
    lr_scheduler: dict[str, Any] | None
    extra: dict[str, Any]  # the cell's extra_state, {name: state_dict}
    progress: ProgressState
    rng: dict[str, Any]  # python, numpy and torch generators (training_state.rng_state)
    history: list[dict[str, Any]]  # the newest records (the folder's history.jsonl the rest)
    config: dict[str, Any]  # RunConfig.as_dict() and the dataset's fingerprint
    numpy_types: list[Any]
    grad_scaler: dict[str, Any] | None


class TrainingState(_TrainingStateCore, total=False):
    """A checkpoint, and the training state a survivor sends or keeps
    (engine.state.training_state.capture): plain data only, so ``torch.load(weights_only=True)``
    reads it. The tensors' dicts are the model's and the optimizer's ``state_dict()`` with numpy
    values made tensors (their types in ``numpy_types``); ``model`` is empty for a sharded run,
    whose rows travel apart. ``frozen``: {key: digest} of the frozen weights each engine keeps
    (engine.state.frozen), when they are left out of ``model``."""

    frozen: dict[str, str]
    pending: dict[str, Any] | None  # the record of a step whose evaluation a fault interrupted
