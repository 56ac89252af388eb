"""The contract between the kernel and its engines: what a generation is told, what the
rendezvous store's keys are called, and the run's options as an engine reads them.

The kernel (run.driver, run.rendezvous, run.cellsetup) and the engine (engine.generation,
engine.vote, engine.abort, engine.worker) both spell these names from here, so neither side
reads a field or a key by a string of its own.

- :class:`GenerationSpec` travels to each rank of a generation (pickled by ipyparallel: owner
  and engines run the same package, which init_engine's versions check).
- The store's keys: the owner writes a generation's requests under ``gen<g>/``
  (:func:`generation_prefix`); the ranks form their process group under ``pg/`` within it and
  vote under ``vote/<round>/<rank>``.
- The run's options are config.RunConfig's: the kernel sends ``RunConfig.as_dict()`` (also
  what checkpoints store) and the engine reads it back with ``RunConfig.from_dict``.

This module imports nothing but the standard library.
"""
from __future__ import annotations

from dataclasses import dataclass

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
    """The key of `rank`'s vote in round `round_` of a generation's commit vote (engine.vote)."""
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
