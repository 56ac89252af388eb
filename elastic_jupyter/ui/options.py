"""The magics' command lines, derived from the options' declarations (config.Flag).

A line joins the options of one or more dataclasses (``flagged(RunConfig)``, the magic's own);
:func:`add_options` adds them to an argparse parser, each in its --help group (config.Group),
with its old spellings (they warn) and the removed options (they are refused, saying why);
:func:`values` reads one dataclass back from the parsed line.
"""
from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence
from dataclasses import MISSING, Field
from typing import Any, NoReturn, Protocol, TypeVar

from ..config import NEEDS_VALUE, Flag, Group, Removed, Renamed, UsageError, flagged

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


def add_options(parser: argparse.ArgumentParser, *options: list[Option],
                removed: Sequence[Removed] = (), grouped: bool = True) -> None:
    """Adds `options` (lists from config.flagged) to `parser` in the order given: with
    `grouped`, an option whose Flag has a group goes to that argument group (the groups in
    config.Group's order), the others to `parser` itself; without, all to `parser` (a line
    whose options need no sections). Each old spelling (Flag.renamed) is added unlisted and
    warns; each of `removed` is added unlisted and raises UsageError saying why."""
    sections: dict[Group, _Arguments] = {}
    chosen = [o for group in options for o in group]
    if grouped:
        used = {spelled.group for _, spelled in chosen}
        sections = {g: parser.add_argument_group(g.value) for g in Group if g in used}
    for option, spelled in chosen:
        target = sections.get(spelled.group, parser) if spelled.group else parser
        add_option(target, option, spelled)
    for gone in removed:
        parser.add_argument(gone.name, nargs="?", help=argparse.SUPPRESS, action=_Refused,
                            default=argparse.SUPPRESS, removed=gone)


def add_option(target: _Arguments, option: Field, spelled: Flag) -> None:
    """Adds one option, and its old spellings, to `target` (a parser or an argument group)."""
    terms = _argparse_terms(option, spelled)
    target.add_argument(spelled.name, **terms)
    for old in spelled.renamed:
        if terms.get("action") == "store_true":
            raise ValueError(f"{old.old}: a renamed switch needs an action of its own")
        alias = {k: v for k, v in terms.items() if k not in ("help", "required", "metavar")}
        target.add_argument(old.old, **dict(alias, help=argparse.SUPPRESS,
                                            default=argparse.SUPPRESS, action=_Renamed,
                                            renamed=old, new=spelled.name))


class _Renamed(argparse.Action):
    """An old spelling: stores the value as the new one would, with a FutureWarning."""

    def __init__(self, *args: Any, renamed: Renamed, new: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.renamed, self.new = renamed, new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        warnings.warn(f"{self.renamed.old} is now {self.new}; the old spelling goes in "
                      f"release {self.renamed.until}", FutureWarning, stacklevel=2)
        setattr(namespace, self.dest, values)


class _Refused(argparse.Action):
    """A removed option: the line is refused, saying why and what to do."""

    def __init__(self, *args: Any, removed: Removed, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.removed = removed

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        raise UsageError(self.removed.message())


def values(cls: type[T], line: argparse.Namespace) -> T:
    """`cls` with its options' values from a line parsed by a parser with those options."""
    return cls(**{option.name: getattr(line, option.name) for option, _ in flagged(cls)})


def _argparse_terms(option: Field, spelled: Flag) -> dict[str, Any]:
    """add_argument's keywords for `option`. An optional's value is stored under the field's
    name and shown under the flag's (``--min MIN`` for min_size), as argparse would name it."""
    positional = not spelled.name.startswith("-")
    if positional and spelled.name != option.name:
        raise ValueError(f"positional {spelled.name!r} must be named as its field {option.name!r}")
    terms: dict[str, Any] = {} if spelled.help is None else {"help": spelled.help}
    if not positional:
        terms["dest"] = option.name
    if spelled.sets is not NEEDS_VALUE:  # a flag alone that stores a value of its own
        return dict(terms, action="store_const", const=spelled.sets, default=option.default)
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
