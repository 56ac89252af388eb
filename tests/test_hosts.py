"""A pool across hosts: engines started over ssh (ipyparallel's SSH launcher) in network
namespaces with their own addresses, hostnames and /tmp (tests/netns_hosts.py), so they talk
TCP across interfaces to the kernel and to each other.

One run trains on 3 engines on 2 hosts; the kernel's side of the pool listens only on the
named interface (and loopback); then one host is lost (every process of its namespace
killed): the survivor trains on, and the stopped run's float64 parameters equal those of a
single-host run of as many steps. A notebook folder the hosts lack runs with a shared
checkpoint folder. An auto pool takes the slots each host's own arbiter grants it.
"""
import os
import sys
import tempfile
import time

import psutil
import pytest
import torch

from elastic_jupyter import EnginePool, RunConfig, RunSetupError, TrainingRun
from elastic_jupyter.arbiter.hosts import Relay
from elastic_jupyter.config import UsageError
from elastic_jupyter.engine.state.checkpoint import list_checkpoints
from elastic_jupyter.engine.group.network_interface import address_of
from elastic_jupyter.pool.launchers import SSHLauncher
from kernels import BODY as LIFECYCLE_BODY
from netns_hosts import Hosts, available

BODY = LIFECYCLE_BODY.replace("time.sleep(0.01)", "time.sleep(DELAY)")
pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))


def wait_for(what: str, check, timeout: float = 90.0) -> None:
    t0 = time.monotonic()
    while (seen := check()) is not True:
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout:.0f} s; {seen}"
        time.sleep(0.2)


def listening(pids: set) -> set:
    return {c.laddr.ip for c in psutil.net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.pid in pids}


def test_a_pool_across_two_hosts_listens_on_one_interface_and_survives_losing_a_host(
        idle_pool):
    # the run's folder must be shared with the hosts: their /tmp is their own
    workspace = tempfile.mkdtemp(dir="/var/tmp")
    with Hosts(2) as hosts:
        first, second = hosts.names
        launcher = SSHLauncher(f"{first}:1,{second}:2", ssh_args=hosts.ssh_args,
                               interface=hosts.bridge)
        pool = EnginePool(n=3, launcher=launcher).start()
        try:
            assert sorted(e.host for e in pool.engine_sets.engines) == [first, second, second]
            assert all(not e.local for e in pool.engine_sets.engines)
            config = RunConfig(name="hosts", steps=100_000, global_batch=64, seed=7,
                               checkpoint_every=0, collective_timeout=10)
            run = TrainingRun(pool, config, source=BODY, push={"DELAY": 0.01},
                              workspace=workspace).start()
            wait_for("training on both hosts", lambda: run.step > 30 or run.state)

            me = psutil.Process()
            ours = {me.pid} | {p.pid for p in me.children(recursive=True)}
            bridge = address_of(hosts.bridge)
            assert launcher.address == bridge
            exposed = {ip for ip in listening(ours) if not ip.startswith("127.")}
            assert exposed == {bridge}, exposed  # the store and the controller, nowhere else

            hosts.kill(second)
            wait_for("the fault of the lost host", lambda: any(
                e["kind"] == "fault" for e in run.events) or run.state)
            (fault,) = [e for e in run.events if e["kind"] == "fault"]
            assert sorted(fault["lost_slots"]) == [1, 2], fault
            step = run.step
            wait_for("the survivor trains on", lambda: run.step > step + 30 or run.state)
            assert run.world_size == 1 and run.members[0].host == first
            run.stop()
            assert run.wait(timeout=60) == "stopped", run.logs()
        finally:
            t0 = time.monotonic()
            pool.stop()
            stopped_in = time.monotonic() - t0
    assert stopped_in < 30  # the lost host's engines do not hold up the stop
    steps = run.step
    assert [r["step"] for r in run.history] == list(range(1, steps + 1))
    fixed = TrainingRun(idle_pool, RunConfig(name="one-host", steps=steps, global_batch=64,
                                             seed=7, checkpoint_every=0),
                        source=BODY, push={"DELAY": 0}, engines=2,
                        workspace=os.path.join(workspace, "fixed")).start()
    assert fixed.wait(timeout=300) == "finished", fixed.logs()
    for key, value in fixed.state_dict().items():
        got = run.state_dict()[key]
        assert torch.allclose(got, value, rtol=1e-7, atol=1e-9), \
            f"{key}: max diff {(got - value).abs().max().item():.3e}"


def test_a_notebook_folder_the_hosts_lack_trains_with_a_shared_checkpoint_folder(monkeypatch):
    """The notebook's folder is the kernel host's own (under its /tmp, which the hosts do not
    see): without a shared run folder the setup says what to do; with --checkpoint-dir on a
    shared file system the cell runs in the engine's folder and rank 0, on the other host,
    writes its checkpoints where the kernel reads them."""
    notebook = tempfile.mkdtemp(dir="/tmp")
    shared = tempfile.mkdtemp(dir="/var/tmp")
    monkeypatch.chdir(notebook)
    with Hosts(1) as hosts:
        (host,) = hosts.names
        launcher = SSHLauncher(f"{host}:1", ssh_args=hosts.ssh_args, interface=hosts.bridge)
        pool = EnginePool(n=1, launcher=launcher).start()
        try:
            config = RunConfig(name="elsewhere", steps=40, global_batch=64, seed=7,
                               checkpoint_every=20)
            with pytest.raises(RunSetupError, match=r"does not exist on host ejhost1: .*name a "
                               r"folder the hosts share with --checkpoint-dir"):
                TrainingRun(pool, config, source=BODY, push={"DELAY": 0}).start()
            config.checkpoint_dir = os.path.join(shared, "elsewhere")
            run = TrainingRun(pool, config, source=BODY, push={"DELAY": 0}).start()
            assert run.wait(timeout=120) == "finished", run.logs()
        finally:
            pool.stop()
    warnings = [e["message"] for e in run.events if e["kind"] == "warning"]
    assert [m for m in warnings if f"host {host} has no folder {notebook}" in m], warnings
    assert [c["step"] for c in list_checkpoints(config.checkpoint_dir)] == [20, 40]


def test_an_auto_pool_across_hosts_takes_the_slots_each_hosts_arbiter_grants():
    """Auto mode over ssh: each host's own arbiter (reached through a relay on that host)
    leases its slots. Another run holds one of the second host's two CPU slots: the run
    grows into the three others, and into the fourth once that run is gone."""
    workspace = tempfile.mkdtemp(dir="/var/tmp")
    with Hosts(2) as hosts:
        first, second = hosts.names
        other = Relay(second, ["ssh", *hosts.ssh_args, second, sys.executable, "-m",
                               "elastic_jupyter.arbiter.relay"])
        assert other.call("register", run="other", name="other", min=1, max=1,
                          wanted=1)["slots"] == [0]
        launcher = SSHLauncher(f"{first}:2,{second}:2", ssh_args=hosts.ssh_args,
                               interface=hosts.bridge)
        with pytest.raises(UsageError, match="--min must be at least 2"):
            EnginePool(min_size=1, max_size=4, auto=True, launcher=launcher).start()
        pool = EnginePool(min_size=2, max_size=4, auto=True, launcher=launcher).start()
        try:  # idle, an auto pool holds its min: one slot on each host
            hosts = sorted(e.host for e in pool.engine_sets.engines)
            assert hosts == [first, second], pool.status()
            config = RunConfig(name="auto-hosts", steps=100_000, global_batch=64, seed=7,
                               checkpoint_every=0)
            run = TrainingRun(pool, config, source=BODY, push={"DELAY": 0.01},
                              workspace=workspace).start()
            wait_for("training on the 3 free slots", lambda: run.world_size == 3 or (
                run.state, run.world_size))
            assert sorted((e.host, e.slot) for e in pool.engine_sets.engines) == [
                (first, 0), (first, 1), (second, 3)], pool.status()
            other.call("unregister", run="other")
            wait_for("the grow into the freed slot", lambda: run.world_size == 4 or (
                run.world_size, pool.status()))
            grew = [e["message"] for e in run.events if e["kind"] == "slot"]
            assert any("grew into slot 2" in m for m in grew), grew
            run.stop()
            assert run.wait(timeout=60) == "stopped", run.logs()
        finally:
            other.close()
            pool.stop()
