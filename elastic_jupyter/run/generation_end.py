"""How a generation ended, as the driver decides on it: every rank left at one step
(:class:`GenerationEnded`), or ranks were lost (:class:`GenerationFaulted`).

The engines' own results (engine.protocol.GenerationResult, plain data) name ranks; these
name the pool's engines, so the driver acts on them without rewriting what the engines sent.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ..engine.protocol import GenerationResult
from .faults import Outcome

if TYPE_CHECKING:
    from ..pool.processes import Engine


@dataclass(frozen=True)
class GenerationEnded:
    """Every rank left after step `step`.

    reason: "finished" (the run's last step is done) or "left" (the owner asked them to).
    drained: (engine, wall time of its SIGTERM) of the ranks that left because their
    scheduler told them to go (engine.group.drain). handed_over: the engines of a sharded run that
    left with their rows handed over to the others (engine.sharded.lifecycle).
    """

    reason: Literal["finished", "left"]
    step: int
    drained: tuple[tuple[Engine, float], ...]
    handed_over: tuple[Engine, ...]

    @classmethod
    def of(cls, members: list[Engine], results: dict[int, GenerationResult]
           ) -> GenerationEnded:
        """The end `results` (engine id -> its rank's result) describe; rank 0's
        (``members[0]``) speaks for the generation."""
        first = results[members[0].engine_id]
        drained = tuple((e, asked) for e in members
                        if (asked := results[e.engine_id]["drained"]))
        return cls(first["reason"], first["progress"]["step"], drained,
                   tuple(members[r] for r in first["handed_over"]))


@dataclass(frozen=True)
class GenerationFaulted:
    """Ranks were lost or hung before the generation's end (run.faults.classify)."""

    outcome: Outcome
