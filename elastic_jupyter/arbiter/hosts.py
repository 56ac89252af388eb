"""Each host's arbiter leases its own slots to an auto pool of SSH hosts.

A pool started with ``--launcher ssh --hosts gpu1:4,gpu2:4 --auto`` is a run on every host's
arbiter, reached through a relay on that host (:mod:`.relay`, over the pool's ssh). Each
host's arbiter decides, with the runs of that host, how many of its slots the pool holds
(weighted fair share, hold times, slots busy outside: docs/arbiter.md); the pool trains on
the sum. :class:`HostArbiters` gives the pool's lease (:class:`~elastic_jupyter.pool.lease.SlotLease`)
the calls of :class:`~.client.ArbiterClient` and combines the hosts' answers.

- Slot numbers: the pool's slot ``offset(host) + s`` is the host's slot ``s`` (its GPU ``s``
  in NVML's order, or CPU slot ``s``); the offsets follow ``--hosts``. In auto mode each host's
  count in ``--hosts`` must be the number of slots its arbiter has.
- Demand: the pool's ``min``, ``max`` and size asked for (``wanted``) are each split in host
  order, one slot on each host first, then filling each host (so the pool holds at least one
  slot on every host, and ``--min`` is at least the number of hosts); its weight and auto
  flag are the pool's on every host.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import select
import subprocess
import tempfile
import threading
import time
from typing import IO, NoReturn, cast

from .client import answer_of
from .machine_view import MachineView, RunView, SlotView
from .table import ArbiterError, UnknownRun

REPLY_TIMEOUT = 30.0  # seconds for a relay's answer (its first starts Python and the arbiter)
QUIET_S = 30.0  # a host that did not answer is not asked again for this long

log = logging.getLogger(__name__)


class Relay:
    """One host's relay process (``ssh HOST PYTHON -m elastic_jupyter.arbiter.relay``),
    started on the first call and again after it died, until :meth:`close`. Thread-safe.
    Lines on its output that are no answer (a login banner, a shell's start-up output) are
    skipped; what it wrote on its standard error goes into the error of a failed call."""

    def __init__(self, host: str, command: list[str]):
        self.host, self.command = host, command
        self._proc: subprocess.Popen | None = None
        self._stderr: IO[bytes] | None = None  # a temporary file: ssh's and the relay's complaints
        self._buffer = b""  # read from its output, not yet a whole line
        self._closed = False
        self._lock = threading.Lock()

    @property
    def started(self) -> bool:
        return self._proc is not None

    def call(self, op: str, **arguments) -> dict:
        """One request; returns the answer (without ``ok``). Raises ArbiterError (UnknownRun
        when the host's arbiter does not know the pool)."""
        with self._lock:
            if self._closed:
                raise ArbiterError(f"host {self.host}'s arbiter: the pool stopped")
            reply = self._exchange(json.dumps({"op": op, **arguments}))
        return answer_of(reply, f"host {self.host}'s arbiter: ")

    def close(self) -> None:
        """End the relay (its input closes: it exits); no call starts another."""
        with self._lock:
            self._closed = True
            self._end()

    def _exchange(self, request: str) -> dict:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            proc = self._start()
        to_relay, from_relay = _pipes(proc)
        try:
            to_relay.write(request.encode() + b"\n")
            to_relay.flush()
        except OSError:
            self._failed("could not send it a request")
        deadline = time.monotonic() + REPLY_TIMEOUT
        try:
            while (line := self._line(from_relay.fileno(), deadline)) is not None:
                try:
                    reply = json.loads(line)
                except ValueError:
                    continue  # not an answer: a banner, a shell's start-up output
                if isinstance(reply, dict) and "ok" in reply:
                    return reply
        except EOFError:
            self._failed("its relay exited")
        self._failed(f"no answer within {REPLY_TIMEOUT:.0f} s")

    def _line(self, fd: int, deadline: float) -> str | None:
        """The next line of the relay's output `fd` (without its newline); None past
        `deadline`. Raises EOFError at the output's end."""
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode(errors="replace")

    def _start(self) -> subprocess.Popen:
        self._end()
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(self.command, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._stderr)
        return self._proc

    def _failed(self, what: str) -> NoReturn:
        """The relay is of no use any more: end it (the next call starts another) and say
        why, with the tail of what it complained of."""
        said = ""
        if self._stderr is not None:
            self._end(keep_stderr=True, wait=0)
            self._stderr.seek(0)
            said = " | ".join(self._stderr.read()[-2000:].decode(errors="replace")
                              .strip().splitlines()[-3:])
            self._stderr.close()
            self._stderr = None
        raise ArbiterError(f"host {self.host}'s arbiter: {what}" + (f" ({said})" if said else "")
                           + f"; check that `ssh {self.host}` logs in without a password and "
                           "that elastic-jupyter is installed there")

    def _end(self, keep_stderr: bool = False, wait: float = 5.0) -> None:
        """End the relay: its input closes, and after `wait` seconds it is killed."""
        proc, self._proc, self._buffer = self._proc, None, b""
        if proc is not None:
            to_relay, from_relay = _pipes(proc)
            if proc.poll() is None:
                to_relay.close()  # the relay exits at the end of its input
                try:
                    proc.wait(timeout=wait)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            from_relay.close()
        if self._stderr is not None and not keep_stderr:
            self._stderr.close()
            self._stderr = None


def _pipes(proc: subprocess.Popen) -> tuple[IO[bytes], IO[bytes]]:
    """A relay's input and output: it is started with both as pipes (:meth:`Relay._start`)."""
    if proc.stdin is None or proc.stdout is None:
        raise ValueError("a relay is started with pipes for its input and output")
    return proc.stdin, proc.stdout


class HostArbiters:
    """The calls of :class:`~.client.ArbiterClient` for a pool of SSH hosts (see the module's
    docstring). `hosts`: host -> its slots, in ``--hosts`` order; `command(host)`: the ssh
    command line that runs a relay there. The hosts are asked side by side; a host that
    does not answer keeps its last grant and is not asked again for ``QUIET_S`` (the others'
    decisions are still followed, and a lost host does not slow every look down), and a
    call fails only when no host answered."""

    def __init__(self, hosts: dict[str, int], command):
        self.hosts = dict(hosts)
        self.offsets, at = {}, 0
        for host, count in self.hosts.items():
            self.offsets[host], at = at, at + count
        self.relays = {host: Relay(host, command(host)) for host in self.hosts}
        self._last: dict[str, dict] = {}  # host -> its newest grant
        self._quiet: dict[str, float] = {}  # host -> until when it is not asked (monotonic)
        self._checked = False
        self._threads = concurrent.futures.ThreadPoolExecutor(
            len(self.hosts), thread_name_prefix="ej-relay")

    # ---------------------------------------------------------------- ArbiterClient's calls

    def register(self, run: str, **demand) -> dict:
        self._check(demand["min"])
        engines = self._split_slots(demand.get("engines") or {})
        least, most = _split(demand["min"], self.hosts), _split(demand["max"], self.hosts)
        wanted = _split(demand.get("wanted") or demand["min"], self.hosts)
        standby = _split(demand.get("standby", 0), self.hosts, at_least=0)
        return self._each(lambda host, relay: relay.call("register", run=run, **dict(
            demand, min=least[host], max=most[host],
            wanted=min(most[host], max(least[host], wanted[host])), standby=standby[host],
            engines=engines[host])), every_host=True)  # a new demand: every host hears it

    def poll(self, run: str, active: bool = True, engines: dict | None = None,
             speed: list | None = None) -> dict:
        """As the machine's arbiter's; `speed` is not passed on: each host's arbiter sees a
        part of the pool, and the pool's speed by its total size would mislead it."""
        engines = self._split_slots(engines or {})
        return self._each(lambda host, relay: relay.call("poll", run=run, active=active,
                                                         engines=engines[host]))

    def release(self, run: str, slots: list[int]) -> dict:
        mine = self._split_slots({s: None for s in slots})
        return self._each(lambda host, relay: relay.call(
            "release", run=run, slots=[int(s) for s in mine[host]]) if mine[host]
            else self._last[host])

    def unregister(self, run: str) -> None:
        def leave(host, relay):
            try:
                if relay.started:  # a relay never started holds nothing: none is started
                    relay.call("unregister", run=run)
            except UnknownRun:  # never registered there (a refused start): nothing to give
                pass
            finally:
                relay.close()
        errors = [str(e) for e in self._threads.map(self._tried(leave), *zip(
            *self.relays.items())) if isinstance(e, Exception)]
        self._threads.shutdown(wait=False)
        if errors:  # a host that is gone reaps the pool anyway, once the relay's ssh ends
            raise ArbiterError("; ".join(errors))

    def view(self) -> MachineView:
        """Every host's slots (numbered as the pool's, with their ``host``) and runs."""
        slots: list[SlotView] = []
        runs: list[RunView] = []
        kind = ""
        for host, relay in self.relays.items():
            view = relay.call("view")
            kind = view.get("kind", kind)
            slots += [cast(SlotView, dict(s, slot=self.offsets[host] + s["slot"], host=host))
                      for s in view["slots"]]
            runs += [cast(RunView, dict(r, name=f"{r['name']} @ {host}")) for r in view["runs"]]
        return MachineView(slots=slots, runs=runs, time=time.time(), kind=kind)

    # ---------------------------------------------------------------- the hosts together

    def _each(self, ask, every_host: bool = False) -> dict:
        """`ask(host, relay)` on every host side by side (unless `every_host`, not those that
        did not answer lately); their grants combined."""
        now = time.monotonic()
        asked = {h: r for h, r in self.relays.items()
                 if every_host or h not in self._last or self._quiet.get(h, 0) <= now}
        if not asked:
            raise ArbiterError("no host's arbiter answered lately; asking again soon")
        replies = dict(zip(asked, self._threads.map(self._tried(ask), *zip(*asked.items()))))
        failed = {h: r for h, r in replies.items() if isinstance(r, Exception)}
        for host, error in failed.items():
            if not isinstance(error, UnknownRun):  # that one answered: it lost the pool
                self._quiet[host] = time.monotonic() + QUIET_S
        replies.update({h: self._last[h] for h in self.relays if h not in asked})
        if unknown := [e for e in failed.values() if isinstance(e, UnknownRun)]:
            raise unknown[0]  # the pool registers again (lease.SlotLease.poll)
        if failed and (len(failed) == len(asked) or set(failed) - set(self._last)):
            raise ArbiterError("; ".join(str(e) for e in failed.values()))
        for host, error in failed.items():
            log.warning("elastic_jupyter: %s (its last grant stands)", error)
            replies[host] = self._last[host]
        combined = self._combine(replies)
        self._last.update({h: dict(r, events=[]) for h, r in replies.items()})  # told once
        return combined

    @staticmethod
    def _tried(ask):
        def tried(host, relay):
            try:
                return ask(host, relay)
            except Exception as e:  # noqa: BLE001 -- returned: each host's failure is its own
                return e
        return tried

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
        split: dict[str, dict[str, object]] = {host: {} for host in self.hosts}
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
