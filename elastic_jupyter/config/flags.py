"""How an option is spelled on a magic's line: its flag, help, parsing, --help group, and the
spellings it had before.

An option is a dataclass field whose metadata holds a :class:`Flag` (``field(default=...,
metadata=flag(...))``). ui/options.py turns the fields of one or more dataclasses into an
argparse parser and reads a dataclass back from the parsed line; ui/options_page.py writes
docs/options.md from the same fields. Nothing else spells an option, so the parser, the
engines' view, checkpoints and the documentation cannot drift apart.
"""
from __future__ import annotations

import argparse
import enum
from dataclasses import Field, dataclass, fields
from typing import Any, Callable


class UsageError(ValueError):
    """A request that cannot be carried out as given; the message says what to change."""


NEEDS_VALUE: Any = object()  # Flag.bare's default: the flag is not given without a value


class Group(enum.Enum):
    """The sections of ``%%elastic_train --help`` (and of docs/options.md), in their order;
    each value is the section's title."""

    RUN = "run"
    STEPS_AND_DATA = "steps and data"
    OPTIMISATION = "optimisation and evaluation"
    CHECKPOINTS = "checkpoints and logs"
    ELASTICITY = "elasticity"
    SHARDED = "sharded state (--shard)"
    TUNING = "micro-batch tuning"


@dataclass(frozen=True)
class Renamed:
    """An old spelling of a flag, still accepted with a FutureWarning that names the new one
    until release `until`, then removed (CHANGELOG.md lists each)."""

    old: str
    until: str


@dataclass(frozen=True)
class Flag:
    """How a magic's line spells one option.

    name: the flag (``--global-batch``, ``-n``), or a positional's name (its field's).
    help: its --help text; the default it names is ``%(default)s`` (argparse fills it in, and
    so does docs/options.md), never spelled by hand. parse: text -> value; raises
    argparse.ArgumentTypeError saying what was expected (None: the text as given). choices:
    the values allowed. metavar: the value's name in --help (None: argparse's, from the flag).
    bare: the value of the flag given alone, which makes its value optional (NEEDS_VALUE: it
    is not given alone). sets: the value a flag that takes none stores (``--no-lend`` sets
    ``lend=False``; NEEDS_VALUE: the flag takes a value). group: its section of --help (None:
    the parser's own options). renamed: the spellings it had before, still accepted for a
    while. A bool field that defaults to False and has neither ``bare`` nor ``sets`` is a
    switch: the flag alone sets it True.
    """

    name: str
    help: str | None = None
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    bare: Any = NEEDS_VALUE
    sets: Any = NEEDS_VALUE
    group: Group | None = None
    renamed: tuple[Renamed, ...] = ()


@dataclass(frozen=True)
class Removed:
    """An option that no longer exists: a line (flag `name`) or a call (keyword `keyword`) that
    gives it is refused with `why` (what to do instead), not silently ignored. Kept in the
    declarations so the message outlives the option."""

    name: str
    keyword: str
    since: str
    why: str

    def message(self) -> str:
        return f"{self.name} ({self.keyword}=) was removed in {self.since}: {self.why}"


def flag(name: str, text: str | None = None, **spelling: Any) -> dict[str, Flag]:
    """A field's metadata that declares its option: ``field(default=..., metadata=flag(...))``;
    `text`: its help, `spelling`: the other attributes of :class:`Flag`."""
    return {"flag": Flag(name, text, **spelling)}


def flagged(cls: type, *names: str) -> list[tuple[Field, Flag]]:
    """The options `cls` declares (only `names`, when given), in declaration order."""
    options = [(f, f.metadata["flag"]) for f in fields(cls) if "flag" in f.metadata]
    return [(f, spelled) for f, spelled in options if not names or f.name in names]


def flag_of(cls: type, name: str) -> str:
    """How the line spells `cls`'s option `name` (``--global-batch``), for messages."""
    return next(spelled.name for f, spelled in flagged(cls) if f.name == name)


# ---------------------------------------------------------------------- parsing an option's text

def positive_int(text: str) -> int:
    """An option's text as an integer >= 1; argparse.ArgumentTypeError otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def samples_or_measure(text: str) -> float | str:
    """``--pass-cost``'s text: a number of samples, or "measure"."""
    if text == "measure":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of samples or 'measure', got "
                                         f"{text!r}") from None


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def byte_size(text: str) -> int:
    """A size's text in bytes: a number with K, M, G or T (binary units, as Slurm's --mem:
    ``24G`` is 24 GiB; ``GiB``, ``GB`` and ``B`` suffixes read alike), or plain bytes."""
    spelled = str(text).strip().upper().removesuffix("B").removesuffix("I")
    unit = spelled[-1:] if spelled[-1:] in _UNITS else ""
    try:
        value = float(spelled[:len(spelled) - len(unit)]) * _UNITS[unit]
    except ValueError:
        value = 0
    if not 1 <= value < 2**63:  # NaN and infinity too
        raise argparse.ArgumentTypeError(f"expected a size like 24G, 800M or a number of bytes,"
                                         f" got {text!r}")
    return int(value)
