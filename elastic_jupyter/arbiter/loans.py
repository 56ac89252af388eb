"""Which slot an idle pool lent to which run: the slot table's record of loans, so the lender
can be told where its slots are and the machine's view can mark them (:mod:`.lending` decides
how many; this only remembers which)."""
from __future__ import annotations

from typing import Callable


class Loans:
    """slot -> the lender whose slot another run (the borrower) holds. Written only by the
    :class:`~.table.SlotTable` (arbiter thread)."""

    def __init__(self, saved: dict | None = None):
        self._lender: dict[int, str] = {int(k): v for k, v in (saved or {}).items()}

    def lent(self, slot: int, lender: str) -> None:
        """`slot`, freed by `lender`, went to a borrower."""
        self._lender[slot] = lender

    def returned(self, lender: str, slot: int) -> None:
        """`lender` got `slot`: one of its loans came back (the slot itself, or another one the
        borrower gave back first)."""
        mine = [s for s, x in self._lender.items() if x == lender]
        if mine:
            self._lender.pop(slot if slot in mine else mine[0])

    def forget(self, slots: list[int] | None = None, run: str | None = None) -> None:
        """The borrower released `slots`, or `run` (lender or not) is gone."""
        for slot in slots or []:
            self._lender.pop(slot, None)
        if run is not None:
            self._lender = {s: x for s, x in self._lender.items() if x != run}

    def keep(self, valid: Callable[[int, str], bool]) -> None:
        """Drop the loans for which ``valid(slot, lender)`` is false."""
        self._lender = {s: x for s, x in self._lender.items() if valid(s, x)}

    def lender(self, slot: int) -> str | None:
        return self._lender.get(slot)

    def of(self, lender: str) -> list[int]:
        """The slots `lender` lent, that borrowers hold."""
        return sorted(s for s, x in self._lender.items() if x == lender)

    def saved(self) -> dict:
        """For the state file (JSON keys are strings)."""
        return {str(s): x for s, x in self._lender.items()}
