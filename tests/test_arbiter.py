"""The arbiter as a real process on a real Unix socket: claimants racing, killed and restarted
arbiters, two Unix users, and requests it must refuse."""
from __future__ import annotations

import json
import os
import pathlib
import re
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from elastic_jupyter.arbiter.client import ArbiterClient
from elastic_jupyter.arbiter.location import LOCK, SOCKET
from elastic_jupyter.arbiter.table import ArbiterError


def start_arbiter(folder, config: dict | None = None, shared=False, user=None):
    path = os.path.join(folder, "settings.json")
    with open(path, "w") as f:
        json.dump({"slots": "cpu", "cpu_slots": 4, "hold_s": 0, **(config or {})}, f)
    if os.path.exists(os.path.join(folder, SOCKET)):
        os.unlink(os.path.join(folder, SOCKET))  # a killed arbiter's: wait for the new one's
    args = [sys.executable, "-m", "elastic_jupyter.arbiter", "--dir", folder,
            "--config", path] + (["--shared"] if shared else [])
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, user=user)
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(folder, SOCKET)):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the arbiter did not start"
        time.sleep(0.05)
    return proc


def stop(proc):
    proc.kill()
    proc.wait()


# A claimant: takes one slot, proves it alone holds it with an exclusive flock on the slot's
# file (which the kernel drops when the claimant dies), holds it briefly, gives it back.
CLAIMANT = textwrap.dedent("""
    import fcntl, os, random, sys, time
    from elastic_jupyter.arbiter.client import ArbiterClient
    folder, name, until = sys.argv[1], sys.argv[2], float(sys.argv[3])
    client = ArbiterClient(folder)
    rounds = 0
    while time.time() < until:
        grant = client.register(name, name=name, min=1, max=1, wanted=1)
        while not grant["slots"] and time.time() < until:
            time.sleep(0.05)
            grant = client.poll(name)
        if not grant["slots"]:
            break
        slot = grant["slots"][0]
        fd = os.open(os.path.join(folder, f"slot-{slot}"), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"DOUBLE slot {slot}", flush=True)
            sys.exit(3)
        time.sleep(random.uniform(0, 0.03))
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        client.unregister(name)
        rounds += 1
    print(f"rounds {rounds}", flush=True)
""")


def claimant(folder, name, until):
    return subprocess.Popen([sys.executable, "-c", CLAIMANT, folder, name, str(until)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def holders(client) -> dict:
    return {s["slot"]: s["holder"]["name"] for s in client.view()["slots"] if s["holder"]}


def test_racing_claimants_never_share_a_slot_and_the_killed_lose_theirs(tmp_path):
    folder = str(tmp_path)
    arbiter = start_arbiter(folder)
    client = ArbiterClient(folder)
    try:
        until = time.time() + 20
        procs = {f"c{i}": claimant(folder, f"c{i}", until) for i in range(20)}
        killed, reclaim = 0, []
        while time.time() < until - 4:
            time.sleep(1.0)
            held = holders(client)
            if not held:
                continue
            victim = next(iter(held.values()))
            procs[victim].kill()
            procs[victim].wait()
            killed += 1
            start = time.monotonic()
            while victim in holders(client).values():
                assert time.monotonic() - start < 2.0, f"{victim}'s lease outlived it by 2 s"
                time.sleep(0.02)
            reclaim.append(time.monotonic() - start)
            procs[victim] = claimant(folder, victim, until)  # it comes back
        outputs = {name: p.communicate(timeout=60) for name, p in procs.items()}
        for name, (out, err) in outputs.items():
            assert "DOUBLE" not in out, f"{name}: {out}"
            assert procs[name].returncode == 0, f"{name}: {err}"
        rounds = sum(int(out.split()[-1]) for out, _ in outputs.values())
        assert killed >= 5 and rounds > 20, (killed, rounds)
        deadline = time.monotonic() + 2.0  # the last ones exited holding a grant
        while holders(client) or client.view()["runs"]:
            assert time.monotonic() < deadline, client.view()
            time.sleep(0.05)
        print(f"{rounds} claims by 20 claimants, {killed} killed, reclaimed in "
              f"{max(reclaim):.2f} s at most")
    finally:
        stop(arbiter)


def test_a_restarted_arbiter_keeps_every_lease(tmp_path):
    folder = str(tmp_path)
    arbiter = start_arbiter(folder)
    client = ArbiterClient(folder)
    client.register("A", name="a", min=1, max=4, wanted=2)
    sleeper = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from elastic_jupyter.arbiter.client import ArbiterClient
        ArbiterClient(sys.argv[1]).register("B", name="b", min=2, max=2, wanted=2)
        print("held", flush=True)
        time.sleep(600)
    """), folder], stdout=subprocess.PIPE, text=True)
    try:
        assert sleeper.stdout.readline().strip() == "held"
        before = holders(client)
        assert sorted(before.values()) == ["a", "a", "b", "b"]
        stop(arbiter)
        arbiter = start_arbiter(folder)  # SIGKILLed: nothing was saved at exit
        assert holders(client) == before
        # a newcomer gets none of them, and a dead holder's slots are still reclaimed
        assert client.register("C", name="c", min=1, max=1, wanted=1)["queued"] == 1
        sleeper.kill()
        sleeper.wait()
        deadline = time.monotonic() + 2.0
        while "b" in holders(client).values():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert len(client.poll("C")["slots"]) == 1 and len(client.poll("A")["slots"]) == 2
    finally:
        sleeper.kill()
        stop(arbiter)


def test_only_one_arbiter_serves_a_folder_and_a_client_starts_it_on_demand(monkeypatch):
    monkeypatch.delenv("ELASTIC_JUPYTER_ARBITER", raising=False)
    runtime = tempfile.mkdtemp(prefix="ejrt-")  # short: a socket's path has at most 107 bytes
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", runtime)
    clients = [ArbiterClient() for _ in range(2)]  # as two kernels' first calls
    folder = clients[0].folder
    assert folder == os.path.join(runtime, "elastic-jupyter", f"arbiter-{socket.gethostname()}")
    try:
        grants = [c.register(f"r{i}", name=f"r{i}", min=1, max=1, wanted=1)
                  for i, c in enumerate(clients)]
        slots = len(clients[0].view()["slots"])  # the machine's: GPUs, or its cores
        assert len({s for g in grants for s in g["slots"]}) == min(2, slots)
        second = subprocess.run([sys.executable, "-m", "elastic_jupyter.arbiter", "--dir",
                                 folder], capture_output=True, text=True, timeout=60)
        assert second.returncode == 0 and "another arbiter serves" in second.stderr
        assert len(holders(clients[0])) == min(2, slots)
        assert oct(os.stat(folder).st_mode & 0o777) == "0o700"
        assert oct(os.stat(os.path.join(folder, SOCKET)).st_mode & 0o777) == "0o600"
    finally:
        with open(os.path.join(folder, LOCK)) as f:  # the live arbiter's pid
            os.kill(int(f.read()), signal.SIGKILL)
        shutil.rmtree(runtime, ignore_errors=True)


def test_requests_it_cannot_take_are_refused_and_change_nothing(tmp_path):
    folder = str(tmp_path)
    arbiter = start_arbiter(folder)
    client = ArbiterClient(folder)
    try:
        client.register("A", name="a", min=1, max=2, auto=True)
        before = holders(client)
        for op, args, words in (
                ("grab", {}, "unknown op 'grab'"),
                ("register", {"run": "A", "min": 1, "now": 0}, "unknown: now"),
                ("register", {"run": "A", "min": "1"}, "min has the wrong type"),
                ("register", {"run": "A", "min": 3, "max": 2}, "min 3 exceeds max 2"),
                ("poll", {}, "needs the run's id"),
                ("poll", {"run": "nobody"}, "no run 'nobody' is known"),
                ("release", {"run": "A", "slots": [3]}, "slot 3 is not held"),
                ("release", {"run": "A", "slots": ["x"]}, "are integers"),
                ("release", {"run": "A", "slots": [0, 0]}, "name a slot twice"),
                ("register", {"run": "A", "weight": 1e400}, "weight must be a number"),
                ("poll", {"run": "A", "engines": {"0": -1}}, "are integers"),
                ("poll", {"run": "A", "engines": {"\u00b9": 5}}, "are integers")):
            with pytest.raises(ArbiterError, match=words):
                client.call(op, **args)
        assert client._send({"op": "view", "x": 1})["ok"] is False
        assert client._send([1, 2])["error"].startswith("a request is a JSON object")
    finally:
        assert holders(client) == before
        stop(arbiter)


def test_settings_the_arbiter_refuses_name_the_key(tmp_path):
    folder = str(tmp_path)
    path = tmp_path / "bad.json"
    for data, words in (({"caps": {"alice": -1}}, "caps must be"),
                        ({"slot": "cpu"}, "unknown setting.*slot"),
                        ({"slots": "tpu"}, "slots must be")):
        path.write_text(json.dumps(data))
        out = subprocess.run([sys.executable, "-m", "elastic_jupyter.arbiter", "--dir", folder,
                              "--config", str(path)], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode != 0
        assert re.search(words, out.stderr), out.stderr


# ---------------------------------------------------------------------- two Unix users

# A client of another user: plain Python, the wire protocol only (that user may not be able to
# read this checkout). It stays alive: a run's leases are held by the process that registered.
RAW_CLIENT = textwrap.dedent("""
    import json, socket, sys
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(sys.argv[1])
    for line in sys.stdin:
        sock.sendall(line.encode())
        reply = b""
        while not reply.endswith(b"\\n"):
            reply += sock.recv(65536)
        print(reply.decode().strip(), flush=True)
""")


class UserClient:
    def __init__(self, user, socket_path):
        self.proc = subprocess.Popen(["/usr/bin/python3", "-c", RAW_CLIENT, socket_path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     user=user, cwd="/")

    def ask(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self):
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def two_users():
    if os.getuid() != 0:
        pytest.skip("needs root to create two users (CI runs as root)")
    names = ["ejarbitera", "ejarbiterb"]
    for name in names:
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin",
                            name], check=True)
    yield names
    for name in names:
        subprocess.run(["userdel", name], check=False)


def test_two_users_share_the_machine_and_neither_touches_the_others_runs(two_users):
    alice, bob = two_users
    # as /run/elastic-jupyter: a folder every user can reach (pytest's tmp_path is root's own)
    folder = pathlib.Path(tempfile.mkdtemp(prefix="ej-arbiter-"))
    os.chmod(folder, 0o755)
    arbiter = start_arbiter(str(folder), {"caps": {bob: 1}}, shared=True)
    sock = str(folder / SOCKET)
    a, b = UserClient(alice, sock), UserClient(bob, sock)
    try:
        assert oct(os.stat(sock).st_mode & 0o777) == "0o666"
        grant = a.ask(op="register", run="ra", name="a", min=1, max=4, auto=True)
        assert grant["ok"] and grant["slots"] == [0, 1, 2, 3]
        for request in ({"op": "release", "run": "ra", "slots": [0]},
                        {"op": "unregister", "run": "ra"},
                        {"op": "poll", "run": "ra"},
                        {"op": "register", "run": "ra", "min": 1, "max": 4, "auto": True}):
            refused = b.ask(**request)
            assert not refused["ok"] and f"belongs to user {alice}" in refused["error"]
        grant = b.ask(op="register", run="rb", name="b", min=1, max=4, auto=True)
        assert grant["ok"] and grant["target"] == 1  # bob's cap
        assert [r["user"] for r in b.ask(op="view")["runs"]] == [alice, bob]
        grant = a.ask(op="poll", run="ra")
        assert grant["target"] == 3 and grant["give_back"] == [3]
        assert a.ask(op="release", run="ra", slots=[3])["ok"]
        grant = b.ask(op="poll", run="rb")
        assert grant["slots"] == [3] and grant["events"][0]["from"] == "a"
        a.close()  # alice's kernel dies: her slots go to bob, up to his cap
        deadline = time.monotonic() + 2.0
        while b.ask(op="view")["runs"][0]["user"] == alice:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert b.ask(op="poll", run="rb")["slots"] == [3]
    finally:
        a.close()
        b.close()
        stop(arbiter)
        shutil.rmtree(folder, ignore_errors=True)
