"""The environment variables elastic-jupyter reads, declared once: a user's settings, and the
ones a pool sets in its engines' environment for the engine-side code to read.

Code reads and sets them through these declarations (``FORK_ENGINES.name``, ``SLOT.get()``),
never by a string of its own; docs/options.md lists them (a test holds both).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Variable:
    """One environment variable.

    name: the variable. help: what it does, for docs/options.md. unset: what its absence
    means. set_by: "user" (a setting, read from the kernel's environment) or "pool" (set by
    the pool in an engine's environment; documented so that a user reading an engine's
    environment knows it, never to be set by hand).
    """

    name: str
    help: str
    unset: str
    set_by: Literal["user", "pool"] = "user"

    def get(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable's value in `environ` (default: this process's); None when unset."""
        return (os.environ if environ is None else environ).get(self.name)


FORK_ENGINES = Variable(
    "ELASTIC_JUPYTER_FORK_ENGINES",
    "0: every engine of this host starts as a new Python process instead of a fork of the "
    "pool's zygote, which has imported torch and ipyparallel once (a new process starts "
    "about 1-3 s slower); read when a pool starts", unset="engines are forked")
ARBITER = Variable(
    "ELASTIC_JUPYTER_ARBITER",
    "the folder of the slot arbiter every pool of this kernel takes its slots from "
    "(docs/arbiter.md)", unset="the admin's arbiter where one serves, else none (--auto "
    "starts a private one)")
SLOT = Variable(
    "ELASTIC_JUPYTER_SLOT", "the engine's slot number (empty: a warm engine on no slot)",
    unset="not an elastic-jupyter engine", set_by="pool")
ENGINE_SET = Variable(
    "ELASTIC_JUPYTER_SET", "the id of the ipyparallel engine set that started the engine",
    unset="not an elastic-jupyter engine", set_by="pool")
OWNER_ADDRESS = Variable(
    "ELASTIC_JUPYTER_OWNER_ADDRESS", "the kernel's address on the network the engines reach it "
    "by (ssh and slurm launchers); the engine binds gloo to the interface towards it",
    unset="this host's engines: loopback", set_by="pool")
ZYGOTE = Variable(
    "ELASTIC_JUPYTER_ZYGOTE", "the key of the zygote a forked engine came from",
    unset="a new process", set_by="pool")
ARROW_MALLOC = Variable(
    "JE_ARROW_MALLOC_CONF", "pyarrow's jemalloc settings; the zygote starts with "
    "background_thread:false, since a thread would keep it from forking", unset="the zygote "
    "sets background_thread:false", set_by="pool")

VARIABLES = (FORK_ENGINES, ARBITER, SLOT, ENGINE_SET, OWNER_ADDRESS, ZYGOTE, ARROW_MALLOC)
