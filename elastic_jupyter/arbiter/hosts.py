"""Each host's arbiter leases its own slots to an auto pool of SSH hosts.

A pool started with ``--launcher ssh --hosts gpu1:4,gpu2:4 --auto`` is a run on every host's
arbiter, reached through a relay on that host (:mod:`.relay`, over the pool's ssh). Each
host's arbiter decides, with the runs of that host, how many of its slots the pool holds
(weighted fair share, hold times, slots busy outside: docs/arbiter.md); the pool trains on
the sum. :class:`HostArbiters` gives the pool's lease (:class:`~elastic_jupyter.lease.SlotLease`)
the calls of :class:`~.client.ArbiterClient` and combines the hosts' answers.

- Slot numbers: the pool's slot ``offset(host) + s`` is the host's slot ``s`` (its GPU ``s``
  in NVML's order, or CPU slot ``s``); the offsets follow ``--hosts``. In auto mode each host's
  count in ``--hosts`` must be the number of slots its arbiter has.
- Demand: on every host the pool's ``min`` is 1 (it holds at least one slot on each host,
  so ``--min`` is at least the number of hosts), its ``max`` the host's slots, its weight and
  auto flag the pool's; the size asked for (``wanted``) is split in host order, one each
  first.
"""
from __future__ import annotations

import json
import select
import subprocess
import threading
import time

from .table import ArbiterError, UnknownRun

REPLY_TIMEOUT = 30.0  # seconds for a relay's answer (its first starts Python and the arbiter)


class Relay:
    """One host's relay process (``ssh HOST PYTHON -m elastic_jupyter.arbiter.relay``),
    started on the first call and again after it died. Thread-safe."""

    def __init__(self, host: str, command: list[str]):
        self.host, self.command = host, command
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def call(self, op: str, **arguments) -> dict:
        """One request; returns the answer (without ``ok``). Raises ArbiterError (UnknownRun
        when the host's arbiter does not know the pool)."""
        with self._lock:
            reply = self._exchange(json.dumps({"op": op, **arguments}))
        if not reply.pop("ok", False):
            error = UnknownRun if reply.get("code") == UnknownRun.code else ArbiterError
            raise error(f"host {self.host}'s arbiter: {reply.get('error', 'refused')}")
        return reply

    def _exchange(self, request: str) -> dict:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(self.command, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, bufsize=1)
        proc = self._proc
        try:
            proc.stdin.write(request + "\n")
            proc.stdin.flush()
        except OSError:
            return self._failed("could not send to it")
        ready, _, _ = select.select([proc.stdout], [], [], REPLY_TIMEOUT)
        line = proc.stdout.readline() if ready else ""
        if not line:
            return self._failed("no answer" if proc.poll() is None else "its relay exited")
        return json.loads(line)

    def _failed(self, what: str) -> dict:
        """The relay is of no use any more: end it (the next call starts another)."""
        self.close()
        raise ArbiterError(f"host {self.host}'s arbiter: {what} (ssh {self.host}: is the host "
                           "up and elastic-jupyter installed there?)")

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.stdin.close()  # the relay exits at the end of its input
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class HostArbiters:
    """The calls of :class:`~.client.ArbiterClient` for a pool of SSH hosts (see the module's
    docstring). `hosts`: host -> its slots, in ``--hosts`` order; `command(host)`: the ssh
    command line that runs a relay there."""

    def __init__(self, hosts: dict[str, int], command):
        self.hosts = dict(hosts)
        self.offsets, at = {}, 0
        for host, count in self.hosts.items():
            self.offsets[host], at = at, at + count
        self.relays = {host: Relay(host, command(host)) for host in self.hosts}
        self._checked = False

    # ---------------------------------------------------------------- ArbiterClient's calls

    def register(self, run: str, **demand) -> dict:
        self._check(demand["min"])
        engines = self._split_slots(demand.get("engines") or {})
        wanted = _split(demand.get("wanted"), self.hosts)
        standby = _split(demand.get("standby", 0), self.hosts, at_least=0)
        replies = {host: relay.call(
            "register", run=run, **dict(demand, min=1, max=self.hosts[host], wanted=wanted[host],
                                        standby=standby[host], engines=engines[host]))
            for host, relay in self.relays.items()}
        return self._combine(replies)

    def poll(self, run: str, active: bool = True, engines: dict | None = None) -> dict:
        engines = self._split_slots(engines or {})
        return self._combine({host: relay.call("poll", run=run, active=active,
                                               engines=engines[host])
                              for host, relay in self.relays.items()})

    def release(self, run: str, slots: list[int]) -> dict:
        mine = self._split_slots({s: None for s in slots})
        return self._combine({host: relay.call("release", run=run,
                                               slots=[int(s) for s in mine[host]])
                              for host, relay in self.relays.items()})

    def unregister(self, run: str) -> None:
        errors = []
        for relay in self.relays.values():
            try:
                relay.call("unregister", run=run)
            except UnknownRun:  # never registered there (a refused start): nothing to give
                pass
            except ArbiterError as e:  # the host is gone: its arbiter reaps the pool anyway
                errors.append(str(e))
            relay.close()
        if errors:
            raise ArbiterError("; ".join(errors))

    def view(self) -> dict:
        """Every host's slots (numbered as the pool's, with their ``host``) and runs."""
        slots, runs = [], []
        for host, relay in self.relays.items():
            view = relay.call("view")
            for s in view["slots"]:
                slots.append(dict(s, slot=self.offsets[host] + s["slot"], host=host))
            runs += [dict(r, name=f"{r['name']} @ {host}") for r in view["runs"]]
        return {"slots": slots, "runs": runs, "time": time.time(),
                "kind": view.get("kind", "") if self.relays else ""}

    # ---------------------------------------------------------------- the hosts together

    def _check(self, min_size: int) -> None:
        """Once: every host's arbiter has the slots ``--hosts`` gives it; the pool's min
        covers one slot on each host."""
        if len(self.hosts) > min_size:
            raise ArbiterError(f"--auto across {len(self.hosts)} hosts holds at least one slot "
                               f"on each: --min must be at least {len(self.hosts)}")
        if self._checked:
            return
        for host, relay in self.relays.items():
            have = sorted(s["slot"] for s in relay.call("view")["slots"])
            if have != list(range(self.hosts[host])):
                raise ArbiterError(
                    f"host {host}'s arbiter has {len(have)} slot(s) and --hosts gives it "
                    f"{self.hosts[host]}: in auto mode a host's slots are its arbiter's; give "
                    f"--hosts {host}:{len(have)}")
        self._checked = True

    def _split_slots(self, by_slot: dict) -> dict[str, dict[str, object]]:
        """The pool's {slot: value} as each host's {its slot (str): value}."""
        split = {host: {} for host in self.hosts}
        for slot, value in by_slot.items():
            host = self._host_of(int(slot))
            split[host][str(int(slot) - self.offsets[host])] = value
        return split

    def _host_of(self, slot: int) -> str:
        for host, offset in self.offsets.items():
            if offset <= slot < offset + self.hosts[host]:
                return host
        raise ArbiterError(f"slot {slot} is on none of the pool's hosts")

    def _combine(self, replies: dict[str, dict]) -> dict:
        """The hosts' grants as one grant in the pool's slot numbers."""
        def slots(key):
            return sorted(self.offsets[h] + s for h, r in replies.items() for s in r.get(key, []))

        queued = [r["queued"] for r in replies.values() if r.get("queued")]
        events = [dict(e, slot=self.offsets[h] + e["slot"], host=h)
                  for h, r in replies.items() for e in r.get("events", [])]
        return {"target": sum(r.get("target", 0) for r in replies.values()),
                "slots": slots("slots"), "standby": slots("standby"),
                "give_back": slots("give_back"), "revoke": slots("revoke"),
                "queued": max(queued) if queued else None,
                "fair": sum(r.get("fair", 0) for r in replies.values()),
                "grantable": sum(r.get("grantable", 0) for r in replies.values()),
                "events": events}


def _split(total: int | None, hosts: dict[str, int], at_least: int = 1) -> dict[str, int]:
    """`total` over the hosts in order: `at_least` each first, then filling each host."""
    share = {host: min(at_least, n) for host, n in hosts.items()}
    left = max(0, (total or 0) - sum(share.values()))
    for host, n in hosts.items():
        more = min(left, n - share[host])
        share[host] += more
        left -= more
    return share
