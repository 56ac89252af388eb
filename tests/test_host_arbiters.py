"""An auto pool of SSH hosts as a run on every host's arbiter (elastic_jupyter/arbiter/hosts.py),
here with two real arbiters of this machine standing for two hosts, each reached through a
real relay process (tests/test_hosts.py runs the relays over ssh in namespace hosts)."""
import sys
import time

import pytest

from elastic_jupyter.arbiter.hosts import HostArbiters, _split
from elastic_jupyter.arbiter.table import ArbiterError
from test_arbiter import start_arbiter


@pytest.fixture
def two_hosts(tmp_path):
    folders = {}
    procs = []
    for host, slots in (("a", 2), ("b", 3)):
        folder = tmp_path / host
        folder.mkdir()
        procs.append(start_arbiter(str(folder), {"cpu_slots": slots}))
        folders[host] = str(folder)
    yield folders
    for proc in procs:
        proc.terminate()
        proc.wait()


def relays(folders):
    """Each host's relay, after a login banner (an answer is told from such noise)."""
    return lambda host: ["sh", "-c", f"echo 'Welcome to {host}'; exec env "
                         f"ELASTIC_JUPYTER_ARBITER={folders[host]} {sys.executable} -m "
                         "elastic_jupyter.arbiter.relay"]


def test_each_hosts_arbiter_leases_its_slots_in_the_pools_numbers(two_hosts):
    arbiters = HostArbiters({"a": 2, "b": 3}, relays(two_hosts))
    demand = dict(name="p", notebook="", min=2, max=5, weight=1.0, auto=True, wanted=2,
                  standby=0)
    try:
        grant = arbiters.register("pool-1", **demand)
        assert grant["slots"] == [0, 1, 2, 3, 4] and grant["target"] == 5, grant
        view = arbiters.view()
        assert [(s["slot"], s["host"]) for s in view["slots"]] == [
            (0, "a"), (1, "a"), (2, "b"), (3, "b"), (4, "b")]
        # auto off, 3 wanted: one on each host first, then a filled: b gives 2 back
        grant = arbiters.register("pool-1", **dict(demand, auto=False, wanted=3))
        assert grant["give_back"] == [3, 4] and grant["target"] == 3, grant
        grant = arbiters.release("pool-1", [3, 4])
        assert grant["slots"] == [0, 1, 2] and grant["give_back"] == [], grant
        assert arbiters.poll("pool-1", engines={0: 10, 2: 12})["slots"] == [0, 1, 2]
    finally:
        arbiters.unregister("pool-1")


def test_the_pools_min_and_max_are_split_over_the_hosts(two_hosts):
    arbiters = HostArbiters({"a": 2, "b": 3}, relays(two_hosts))
    try:  # max 3: two on a, one on b; min 3 as well: nothing else to grow into
        grant = arbiters.register("pool-3", name="p", notebook="", min=3, max=3, weight=1.0,
                                  auto=True, wanted=3, standby=0)
        assert grant["slots"] == [0, 1, 2] and grant["target"] == 3, grant
    finally:
        arbiters.unregister("pool-3")


def test_a_host_that_stops_answering_keeps_its_last_grant_and_is_not_asked_for_a_while(
        two_hosts, tmp_path, monkeypatch):
    monkeypatch.setattr("elastic_jupyter.arbiter.hosts.REPLY_TIMEOUT", 1.0)
    down = tmp_path / "b-is-down"
    relay = relays(two_hosts)

    def command(host):  # b hangs once `down` exists (a lost host: its ssh still connects)
        hang = f"[ -e {down} ] && exec sleep 60; " if host == "b" else ""
        return ["sh", "-c", hang + relay(host)[2]]

    arbiters = HostArbiters({"a": 2, "b": 3}, command)
    try:
        assert arbiters.register("pool-5", name="p", notebook="", min=2, max=5, weight=1.0,
                                 auto=True, wanted=2, standby=0)["slots"] == [0, 1, 2, 3, 4]
        down.touch()
        arbiters.relays["b"]._proc.kill()
        t0 = time.monotonic()
        for _ in range(3):  # b's last grant stands
            assert arbiters.poll("pool-5", engines={})["slots"] == [0, 1, 2, 3, 4]
        assert time.monotonic() - t0 < 3  # b was asked once (1 s), then left alone
    finally:
        for r in arbiters.relays.values():
            r.close()


def test_a_relay_that_cannot_start_says_why():
    arbiters = HostArbiters({"nowhere": 1}, lambda host: [
        "sh", "-c", "read line; echo 'ssh: Could not resolve hostname nowhere' >&2; exit 255"])
    with pytest.raises(ArbiterError, match=r"host nowhere's arbiter: its relay exited \(ssh: "
                       r"Could not resolve hostname nowhere\); check that `ssh nowhere` logs"):
        arbiters.register("pool-4", name="p", notebook="", min=1, max=1, weight=1.0,
                          auto=True, wanted=1, standby=0)
    arbiters.unregister("pool-4")  # nothing was held: nothing to hand back


def test_a_host_count_other_than_its_arbiters_or_a_min_below_the_hosts_is_refused(two_hosts):
    arbiters = HostArbiters({"a": 2, "b": 2}, relays(two_hosts))
    demand = dict(name="p", notebook="", min=2, max=4, weight=1.0, auto=True, wanted=2,
                  standby=0)
    try:
        with pytest.raises(ArbiterError, match="--min must be at least 2"):
            arbiters.register("pool-2", **dict(demand, min=1))
        with pytest.raises(ArbiterError, match="host b's arbiter has 3 slot.* give --hosts b:3"):
            arbiters.register("pool-2", **demand)
    finally:
        for relay in arbiters.relays.values():
            relay.close()


def test_the_size_asked_for_is_split_one_each_first_then_in_host_order():
    hosts = {"a": 2, "b": 3, "c": 1}
    assert _split(3, hosts) == {"a": 1, "b": 1, "c": 1}
    assert _split(5, hosts) == {"a": 2, "b": 2, "c": 1}
    assert _split(9, hosts) == {"a": 2, "b": 3, "c": 1}
    assert _split(0, hosts, at_least=0) == {"a": 0, "b": 0, "c": 0}
    assert _split(2, hosts, at_least=0) == {"a": 2, "b": 0, "c": 0}
