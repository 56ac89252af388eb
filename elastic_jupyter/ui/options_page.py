"""docs/options.md, written from the options' declarations: every magic's flags with their
defaults and help, the old spellings still accepted, the removed options, the environment
variables and the side panel's settings.

``python -m elastic_jupyter.ui.options_page > docs/options.md`` writes the page;
tests/test_options.py fails when the committed page differs from a fresh one, so the page
cannot drift from the code.
"""
from __future__ import annotations

import json
import pathlib
import sys
from dataclasses import MISSING, Field
from typing import Any

from ..config import (NEEDS_VALUE, REMOVED, VARIABLES, Flag, Group, LauncherOptions,
                      PoolOptions, RunConfig, RunStart, flagged)
from .magics import _PoolLine, _ResizeLine, _TrainLine

# the side panel's settings, as JupyterLab's settings editor shows them
PANEL_SCHEMA = pathlib.Path(__file__).parents[2] / "labextension" / "schema" / "plugin.json"

Option = tuple[Field, Flag]


def page(schema: pathlib.Path = PANEL_SCHEMA) -> str:
    """The whole page, as Markdown."""
    train = (flagged(RunConfig) + flagged(RunStart) + flagged(PoolOptions, "auto", "weight")
             + flagged(_TrainLine))
    parts = [_HEADER, "## `%%elastic_train`\n",
             "The cell's line; `%%elastic_train --help` shows the same sections.\n"]
    parts += [_table(f"### {group.value.capitalize()}", [o for o in train if o[1].group is group])
              for group in Group if any(o[1].group is group for o in train)]
    parts.append(_table("### The handle's name", [o for o in train if o[1].group is None]))
    parts.append(_table("## `%elastic_pool`", flagged(_PoolLine) + flagged(PoolOptions)))
    parts.append(_table("### Where the engines run (`%elastic_pool start`)",
                        flagged(LauncherOptions)))
    parts.append(_table("## `%elastic_resize`", flagged(_ResizeLine)))
    parts.append(_changes(train))
    parts.append(_environment())
    parts.append(_panel(schema))
    return "\n".join(parts)


_HEADER = """\
# Options

Every option of the magics, with its default and what it does. This page is generated from
the options' declarations (`elastic_jupyter/config/`) by
`python -m elastic_jupyter.ui.options_page > docs/options.md`; a test fails when it differs
from them. The Python API takes the same options as keywords of `RunConfig` (its field names:
`--global-batch` is `global_batch=`) and of `EnginePool`.
"""


def _table(title: str, options: list[Option]) -> str:
    rows = [f"| `{spelled.name}` | {_default(option, spelled)} | {_help(option, spelled)} |"
            for option, spelled in options]
    return "\n".join([title, "", "| option | default | what it does |", "|---|---|---|", *rows,
                      ""])


def _default(option: Field, spelled: Flag) -> str:
    if option.default is MISSING:
        return "required"
    if spelled.sets is not NEEDS_VALUE:  # a flag alone that stores its value: off until given
        return "off"
    if option.default is None:
        return "unset"
    if option.default is False:
        return "off"
    if option.default == "":
        return "none"
    return f"`{option.default}`"


def _help(option: Field, spelled: Flag) -> str:
    text = (spelled.help or "") % {"default": option.default}
    if spelled.choices:
        text += f" (one of {', '.join(f'`{c}`' for c in spelled.choices)})"
    return text.replace("|", "\\|")


def _changes(train: list[Option]) -> str:
    rows = [f"| `{old.old}` | `{spelled.name}` (`{option.name}=`) | renamed; the old spelling "
            f"warns until {old.until} |" for option, spelled in train for old in spelled.renamed]
    rows += [f"| `{gone.name}` (`{gone.keyword}=`) | - | removed in {gone.since}: {gone.why} |"
             for gone in REMOVED]
    return "\n".join(["## Renamed and removed", "", "CHANGELOG.md says when and why.", "",
                      "| spelling | now | |", "|---|---|---|", *rows, ""])


def _environment() -> str:
    rows = [f"| `{v.name}` | {v.set_by} | {v.unset} | {v.help} |" for v in VARIABLES]
    return "\n".join(["## Environment variables", "",
                      "Those set by the pool are in each engine's environment; never set them "
                      "by hand.", "", "| variable | set by | unset | what it does |",
                      "|---|---|---|---|", *rows, ""])


def _panel(schema: pathlib.Path) -> str:
    settings: dict[str, Any] = json.loads(schema.read_text())["properties"]
    rows = [f"| `{name}` | `{s['default']}` | {s['title']}: {s['description']} |"
            for name, s in settings.items()]
    return "\n".join(["## Side panel settings", "",
                      "JupyterLab's Settings Editor, under *Elastic training*.", "",
                      "| setting | default | what it does |", "|---|---|---|", *rows, ""])


if __name__ == "__main__":
    sys.stdout.write(page())
