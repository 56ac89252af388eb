"""Notes added to the user's errors: where in the run the cell's code failed, and what to change.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .data.batching import Cut
from .group.collective import PeerFailure


def add_note(error: BaseException, text: str) -> None:
    """Add `text` to `error`'s traceback (PEP 678's notes, Python 3.11; on 3.10 the note goes
    into its message instead)."""
    if hasattr(error, "add_note"):
        error.add_note(text)
    elif error.args and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]}\n{text}", *error.args[1:])


@contextlib.contextmanager
def micro_batch_note(samples: int, step: int, B: int, cut: Cut,
                     global_batch: int) -> Iterator[None]:
    """The user's code failing in a pass of `samples` samples at step `step` (a step of `B`
    samples; the run's steps hold `global_batch`): its error says how large the micro-batch
    was, what cut it (`cut`) and how to change it (code such as Mixup asserts an even batch).
    A PeerFailure is not the user's: it passes without a note."""
    try:
        yield
    except Exception as e:
        if not isinstance(e, PeerFailure):
            K = cut.count(global_batch)
            add_note(e, f"(elastic-jupyter: this pass ran a micro-batch of {samples} samples "
                        f"at step {step}, a step of {B}: {cut.describe(global_batch)}. Change "
                        f"it with --micro-batch N, min_micro_batch = N in the cell, a "
                        f"--global-batch that {K} micro-batches divide evenly (a multiple of "
                        f"{2 * K} for even ones), or --drop-last for an epoch's short last "
                        "step)")
        raise


@contextlib.contextmanager
def after_step_note(step: int) -> Iterator[None]:
    """The cell's ``after_step`` hook failing after committed step `step`: its error says the
    step is kept (an error here fails the run with the step trained; a state the hook half
    updated is as it left it)."""
    try:
        yield
    except Exception as e:
        add_note(e, f"(elastic-jupyter: raised by the cell's after_step after step {step}, "
                    "which is committed and kept)")
        raise
