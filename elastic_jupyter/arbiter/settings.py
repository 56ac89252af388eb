"""The machine admin's settings for the arbiter: one JSON file users cannot change.

The arbiter reads ``/etc/elastic-jupyter/arbiter.json`` (or the file named by its ``--config``,
which only whoever starts the arbiter chooses) once at start. Every key is optional::

    {
      "slots": "auto",           # "gpu" (NVML), "cpu", or "auto": GPUs when NVML finds any
      "cpu_slots": 4,            # CPU slots on a machine without GPUs (default: its cores)
      "caps": {"alice": 2, "*": 4},       # most slots all of a user's runs hold ("*": anyone)
      "weights": {"alice": 2.0},          # a user's weight in the fair share (default 1)
      "hold_s": 30,              # a slot that moved does not move again for this long
      "idle_s": 1800,            # a pool that has not trained for this long gives its slots back
      "lend_s": 60,              # ... and after this long lends them to auto runs that want more
      "by_value": false,         # give slots by the speeds runs report (arbiter/value.py)
      "outside_memory_mib": 1024,         # a GPU no engine of ours uses, with more memory in use
                                          # than this, is busy outside
      "outside_file": null       # CPU slots: a JSON file {"<slot>": "<who>"} of slots busy
                                 # outside (an admin's script, or a test, keeps it)
    }
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields

SYSTEM_CONFIG = "/etc/elastic-jupyter/arbiter.json"


class SettingsError(ValueError):
    """The settings file is unusable; the message names the key and what it takes."""


@dataclass(frozen=True)
class Settings:
    slots: str = "auto"
    cpu_slots: int = field(default_factory=lambda: os.cpu_count() or 1)
    caps: dict = field(default_factory=dict)
    weights: dict = field(default_factory=dict)
    hold_s: float = 30.0
    idle_s: float = 1800.0
    lend_s: float = 60.0
    by_value: bool = False
    outside_memory_mib: int = 1024
    outside_file: str | None = None

    def cap(self, user: str) -> int | None:
        """The most slots `user`'s runs may hold (None: no cap)."""
        return self.caps.get(user, self.caps.get("*"))

    @classmethod
    def load(cls, path: str | None = None) -> "Settings":
        """The settings in `path` (default: the system file; defaults if it does not exist).
        Raises SettingsError naming a bad key or value."""
        path = path or SYSTEM_CONFIG
        if not os.path.exists(path):
            return cls()
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise SettingsError(f"{path}: cannot read the arbiter's settings: {e}") from None
        if not isinstance(data, dict):
            raise SettingsError(f"{path}: the settings must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SettingsError(f"{path}: unknown setting(s) {', '.join(unknown)}; known: "
                                f"{', '.join(sorted(known))}")
        settings = cls(**data)
        settings._check(path)
        return settings

    def _check(self, path: str) -> None:
        def bad(key, what):
            raise SettingsError(f"{path}: {key} must be {what}, got {getattr(self, key)!r}")
        if self.slots not in ("auto", "gpu", "cpu"):
            bad("slots", '"auto", "gpu" or "cpu"')
        if not _count(self.cpu_slots, 1):
            bad("cpu_slots", "a positive integer")
        if not isinstance(self.caps, dict) or not all(_count(v, 0) for v in self.caps.values()):
            bad("caps", "an object of user names to non-negative integers")
        if not isinstance(self.weights, dict) or not all(
                _number(v) and v > 0 for v in self.weights.values()):
            bad("weights", "an object of user names to positive numbers")
        for key in ("hold_s", "idle_s", "lend_s"):
            if not _number(getattr(self, key)) or getattr(self, key) < 0:
                bad(key, "a non-negative number of seconds")
        if not isinstance(self.by_value, bool):
            bad("by_value", "true or false")
        if not _count(self.outside_memory_mib, 0):
            bad("outside_memory_mib", "a non-negative integer")
        if self.outside_file is not None and not isinstance(self.outside_file, str):
            bad("outside_file", "a path or null")


def _count(v, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
