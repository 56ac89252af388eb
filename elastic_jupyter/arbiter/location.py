"""Where the machine's arbiter lives: its folder, and the files the arbiter keeps in it.

The folder is the first that applies:

1. ``$ELASTIC_JUPYTER_ARBITER``: a folder the user or the admin names;
2. ``/run/elastic-jupyter``, when a system arbiter serves there (``--shared``, started by the
   admin for every user of the machine: docs/arbiter.md);
3. a private folder of this user (``<jupyter runtime dir>/elastic-jupyter/arbiter-<host>``),
   where the first run that needs it starts one (:class:`.client.ArbiterClient`). It
   coordinates this user's kernels; other users' GPU processes are then seen as busy outside.

Both ends read it: the client to connect (and to start a private arbiter), the service to
serve; so it imports neither.
"""
from __future__ import annotations

import os
import socket

from ..config.environment import ARBITER
from ..host import own_folder

SYSTEM_DIR = "/run/elastic-jupyter"
# the files in the folder: the socket, the live arbiter's lock, the saved leases
SOCKET, LOCK, STATE = "arbiter.sock", "arbiter.lock", "state.json"


def arbiter_dir() -> str:
    """The folder of the arbiter this process should use (see the module's docstring)."""
    return locate()[0]


def arbiter_configured() -> bool:
    """Whether this machine has an arbiter every pool should use: one the admin runs for
    everyone, or one ``$ELASTIC_JUPYTER_ARBITER`` names. (A private one serves only pools
    that ask for it: ``--auto``.)"""
    return _configured_dir() is not None


def locate() -> tuple[str, bool]:
    """(the arbiter's folder, whether it is this user's private one, which a client may
    start an arbiter in)."""
    folder = _configured_dir()
    return (folder, False) if folder else (_private_dir(), True)


def _configured_dir() -> str | None:
    """The folder named by ``$ELASTIC_JUPYTER_ARBITER``, else the system arbiter's when it
    serves, else None."""
    named = ARBITER.get()
    if named:
        return named
    return SYSTEM_DIR if os.path.exists(os.path.join(SYSTEM_DIR, SOCKET)) else None


def _private_dir() -> str:
    """This user's arbiter folder, made (mode 0700) and checked to be this user's own, with
    its parent: nobody else may plant a socket for us to talk to."""
    from jupyter_core.paths import jupyter_runtime_dir
    base = os.path.join(jupyter_runtime_dir(), "elastic-jupyter")
    # one per host: a home folder (and so the runtime folder) may be shared between hosts
    name = f"arbiter-{socket.gethostname()}"
    if len(os.fsencode(os.path.join(base, name, SOCKET))) > 107:  # a socket address's limit
        base = f"/tmp/elastic-jupyter-{os.getuid()}"
    own_folder(base, 0o700)
    path = os.path.join(base, name)
    own_folder(path, 0o700)
    return path
