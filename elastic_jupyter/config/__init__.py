"""Every option of elastic-jupyter, declared once, with its default, help and validation.

- flags.py: how an option is spelled on a magic's line (:class:`Flag`, its --help group, its
  old spellings), and what a bad value raises (:class:`UsageError`);
- run.py: a run's options (:class:`RunConfig`): ``%%elastic_train``'s line, the engines' view,
  every checkpoint's ``config``;
- pool.py: a pool's options and where its engines run (``%elastic_pool start``);
- environment.py: the environment variables elastic-jupyter reads.

ui/options.py derives the magics' parsers from these declarations and ui/options_page.py
writes docs/options.md from them. The package imports only the standard library: engines
read it too.
"""
from .environment import VARIABLES, Variable
from .flags import (NEEDS_VALUE, Flag, Group, Removed, Renamed, UsageError, byte_size, flag,
                    flag_of, flagged, positive_int, samples_or_measure)
from .pool import DEFAULT_CPU_MAX, DEFAULT_CPU_SLOTS, LauncherOptions, PoolConfig, PoolOptions
from .run import (ALIASES_UNTIL, MAX_NAME_BYTES, PRECISIONS, REMOVED, RESUME_KEYS,
                  RunConfig, RunStart)

__all__ = ["NEEDS_VALUE", "Flag", "Group", "Removed", "Renamed", "UsageError", "byte_size",
           "flag", "flag_of", "flagged", "positive_int", "samples_or_measure",
           "DEFAULT_CPU_MAX", "DEFAULT_CPU_SLOTS", "LauncherOptions", "PoolConfig",
           "PoolOptions", "ALIASES_UNTIL", "MAX_NAME_BYTES", "PRECISIONS", "REMOVED",
           "RESUME_KEYS", "RunConfig", "RunStart", "VARIABLES", "Variable"]
