"""This host's launcher: engines are processes of this host, as this user."""
from __future__ import annotations

from typing import Callable

from .base import Launcher


class LocalLauncher(Launcher):
    """Engines are processes of this host (ipyparallel's ``LocalEngineSetLauncher``)."""

    kind, local = "local", True

    def arbiter(self, own_jobs: Callable[[], list[str]]) -> None:
        return None
