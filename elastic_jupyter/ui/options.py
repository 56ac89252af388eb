"""The magics' command lines, derived from the options' declarations (config.Flag).

A line joins the options of one or more dataclasses (``flagged(RunConfig)``, the magic's own);
:func:`add_options` adds them to an argparse parser in their --help order, and :func:`values`
reads one dataclass back from the parsed line.
"""
from __future__ import annotations

import argparse
from dataclasses import MISSING, Field
from typing import Any, NoReturn, Protocol, TypeVar

from ..config import NEEDS_VALUE, Flag, UsageError, flagged

T = TypeVar("T")
Option = tuple[Field, Flag]


class Parser(argparse.ArgumentParser):
    """A magic's parser: a bad line raises UsageError (the message and the usage), --help
    prints the help and raises HelpShown, instead of exiting the kernel."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}\n{self.format_usage()}")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        raise HelpShown()


class HelpShown(Exception):
    """--help was given: the help is printed and the magic does nothing more."""


class _Arguments(Protocol):
    """A parser or one of its argument groups."""

    def add_argument(self, *args: Any, **kwargs: Any) -> Any: ...


def add_options(target: _Arguments, *options: list[Option]) -> None:
    """Adds `options` (lists from config.flagged) to `target`, each after the option its
    Flag.after names, else in the order given."""
    for option, spelled in _ordered([o for group in options for o in group]):
        target.add_argument(spelled.name, **_argparse_terms(option, spelled))


def values(cls: type[T], line: argparse.Namespace) -> T:
    """`cls` with its options' values from a line parsed by a parser with those options."""
    return cls(**{option.name: getattr(line, option.name) for option, _ in flagged(cls)})


def _ordered(options: list[Option]) -> list[Option]:
    ordered = [o for o in options if o[1].after is None]
    for option in options:
        anchor = option[1].after
        if anchor is not None:
            at = [f.name for f, _ in ordered].index(anchor)  # ValueError: a misspelt anchor
            ordered.insert(at + 1, option)
    return ordered


def _argparse_terms(option: Field, spelled: Flag) -> dict[str, Any]:
    """add_argument's keywords for `option`. An optional's value is stored under the field's
    name and shown under the flag's (``--min MIN`` for min_size), as argparse would name it."""
    positional = not spelled.name.startswith("-")
    if positional and spelled.name != option.name:
        raise ValueError(f"positional {spelled.name!r} must be named as its field {option.name!r}")
    terms: dict[str, Any] = {} if spelled.help is None else {"help": spelled.help}
    if not positional:
        terms["dest"] = option.name
    if option.default is False and spelled.bare is NEEDS_VALUE:  # a switch
        return dict(terms, action="store_true")
    if option.default is MISSING:
        terms.update({} if positional else {"required": True})
    else:
        terms.update(default=option.default, **({"nargs": "?"} if positional else {}))
    if spelled.bare is not NEEDS_VALUE:
        terms.update(nargs="?", const=spelled.bare)
    if spelled.parse is not None:
        terms["type"] = spelled.parse
    if spelled.choices is not None:
        terms["choices"] = spelled.choices
    if spelled.metavar is not None or not (positional or spelled.choices):
        terms["metavar"] = spelled.metavar or spelled.name.lstrip("-").replace("-", "_").upper()
    return terms
