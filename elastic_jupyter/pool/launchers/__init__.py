"""Launchers: where a pool's engines run — this host (local.py), other hosts over SSH (ssh.py)
or Slurm jobs (slurm.py), each behind the :class:`Launcher` base (base.py)."""
from __future__ import annotations

import inspect
from typing import Any

from ...config import UsageError
from .base import LOOPBACK, Arbiter, Job, Launcher, StartWithdrawn, listen_address
from .local import LocalLauncher
from .slurm import SLURM_TEMPLATE, SlurmLauncher
from .ssh import SSHLauncher

__all__ = ["Launcher", "LocalLauncher", "SSHLauncher", "SlurmLauncher", "make_launcher", "Job",
           "StartWithdrawn", "SLURM_TEMPLATE", "LOOPBACK", "Arbiter", "listen_address"]


def make_launcher(kind: str = "local", **options: Any) -> Launcher:
    """The launcher ``--launcher KIND`` names, with its options (see each class). Raises
    UsageError for an unknown kind or options a kind does not take."""
    classes = {"local": LocalLauncher, "ssh": SSHLauncher, "slurm": SlurmLauncher}
    if kind not in classes:
        raise UsageError(f"--launcher takes local, ssh or slurm, got {kind!r}")
    given = {k: v for k, v in options.items() if v is not None}
    unknown = set(given) - set(inspect.signature(classes[kind]).parameters)
    if unknown:
        raise UsageError(f"--launcher {kind} takes none of "
                         f"{', '.join('--' + k.replace('_', '-') for k in sorted(unknown))}")
    return classes[kind](**given)
