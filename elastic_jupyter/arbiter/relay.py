"""A host's arbiter for a kernel on another host: one request per line on stdin, one reply per
line on stdout, until stdin closes.

A pool of SSH hosts in auto mode starts one relay on each host (``ssh HOST python -m
elastic_jupyter.arbiter.relay``, :mod:`.hosts`): the relay asks that host's arbiter (its
shared one, or this user's private one, started on demand) with :class:`.client.ArbiterClient`.
The arbiter knows the pool by the relay's process (``SO_PEERCRED``): when the kernel goes, ssh
closes the relay's stdin, the relay exits and the arbiter frees the pool's slots within 2 s,
as it does for a kernel of its own host that dies.

Wire: a request is ``{"op": ..., **arguments}`` as the arbiter's own socket takes it; a reply
is ``{"ok": true, **answer}`` or ``{"ok": false, "error": ..., "code": ...}``.
"""
from __future__ import annotations

import json
import sys

from .client import ArbiterClient
from .table import ArbiterError, UnknownRun


def answer(client: ArbiterClient, line: str) -> dict:
    """The reply to one request line."""
    try:
        request = json.loads(line)
        op = request.pop("op")
        return {"ok": True, **client.call(op, **request)}
    except UnknownRun as e:
        return {"ok": False, "error": str(e), "code": UnknownRun.code}
    except ArbiterError as e:
        return {"ok": False, "error": str(e)}
    except (ValueError, KeyError, TypeError) as e:  # not a request
        return {"ok": False, "error": f"bad request: {type(e).__name__}: {e}"}


def main() -> int:
    client = ArbiterClient()
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(answer(client, line)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
