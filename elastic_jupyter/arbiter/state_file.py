"""The slot table's state file: written aside and renamed, so a reader (a restarted arbiter)
finds the old state or the new one, never half of one."""
from __future__ import annotations

import json
import logging
import os
import time

log = logging.getLogger("elastic_jupyter.arbiter")


class StateFile:
    """`path` (None: no file; nothing is saved or loaded)."""

    def __init__(self, path: str | None):
        self.path = path

    def save(self, state: dict) -> None:
        """Write `state` (JSON). A full disk is logged: serving goes on, and a restart would
        lose this change."""
        if not self.path:
            return
        tmp = f"{self.path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(state, f)
            os.replace(tmp, self.path)
        except OSError as e:
            log.error("arbiter: could not save %s: %s", self.path, e)

    def load(self, parse):
        """``parse(state)`` of the saved state, or None when there is none; a file that does
        not parse (`parse` raises ValueError, KeyError or TypeError) is moved aside and logged:
        the arbiter starts without leases rather than not at all."""
        if not self.path or not os.path.exists(self.path):
            return None
        try:
            with open(self.path) as f:
                return parse(json.load(f))
        except (OSError, ValueError, KeyError, TypeError) as e:
            aside = f"{self.path}.unreadable-{int(time.time())}"
            os.replace(self.path, aside)
            log.error("arbiter: %s is unreadable (%s: %s); moved to %s, starting without "
                      "leases", self.path, type(e).__name__, e, aside)
            return None
