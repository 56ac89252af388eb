"""The engine's working folder: the notebook's, so the cell sees what the notebook sees.

A pool's engines outlive cells and may have started in another folder, so each run's setup
moves them into the folder the notebook was in when the cell ran: relative paths in the cell
open the notebook's files, ``import helper`` finds the notebook's ``helper.py``, and a module
edited since the previous run on this pool is imported afresh, as the edited code.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import functools
import importlib
import importlib.machinery
import os
import site
import sys

_PACKAGE = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # elastic_jupyter/


@functools.lru_cache(maxsize=1)
def _installed_roots() -> tuple[str, ...]:
    """Folders whose modules are installed code, never the notebook's own: the interpreter's
    prefixes, site-packages, and this package (the engines run its entry points)."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, _PACKAGE, site.getusersitepackages(),
             *site.getsitepackages()}
    return tuple(os.path.join(os.path.realpath(r), "") for r in roots if r)


def installed_file(path: str | None) -> bool:
    """Whether the module file `path` is installed code (under :func:`_installed_roots`, or a
    site-packages folder); None, a module without a file (built into the interpreter), is."""
    if path is None:
        return True
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    return (path.startswith(_installed_roots())
            or "site-packages" in parts or "dist-packages" in parts)


def notebook_modules(folder: str) -> list[str]:
    """Names of the imported modules whose source file lies under `folder`, leaving out
    installed code (see :func:`_installed_roots`, or a ``site-packages`` folder anywhere below
    `folder`, such as a virtual environment) and compiled extensions, which cannot be
    imported twice."""
    folder = os.path.join(os.path.realpath(folder), "")  # "/" stays "/"
    extensions = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    names = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        # a relative __file__ is no file (torch.ops says "_ops.py"); the program stays
        if (not isinstance(path, str) or not os.path.isabs(path) or path.endswith(extensions)
                or name in ("__main__", "__mp_main__")):
            continue
        if os.path.realpath(path).startswith(folder) and not installed_file(path):
            names.append(name)
    return names


def enter(folder: str, added_before: str | None) -> tuple[str | None, list[str]]:
    """Make `folder` the engine's working folder and put it on the import path (taking off the
    entry an earlier run added, `added_before`), then drop the modules under it from
    ``sys.modules`` so the cell imports their current code.

    Returns (the import path entry added, or None when `folder` was on the path already;
    the names of the dropped modules). Raises OSError when `folder` does not exist here.
    """
    os.chdir(folder)
    if added_before is not None and added_before in sys.path:
        sys.path.remove(added_before)
    added = None
    if folder not in sys.path:
        sys.path.insert(0, folder)
        added = folder
    dropped = notebook_modules(folder)
    for name in dropped:
        del sys.modules[name]
    importlib.invalidate_caches()  # files created since the last import are found
    return added, dropped
