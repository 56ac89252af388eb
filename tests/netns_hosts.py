"""Other hosts for tests: network namespaces on a bridge of their own, each running an sshd.

Each host is a network namespace with a veth pair onto the bridge ``ejbr<N>`` (a private
192.168.X.0/24 that the tests make and remove), a UTS namespace (its own hostname) and a mount
namespace with a private ``/tmp`` (and so a private Jupyter runtime folder): engines started
there talk TCP across interfaces to the kernel's side of the bridge and share no temporary
files with it. The rest of the file system (this checkout, its virtual environment, $HOME) is
shared, as a cluster's home folders are: a checkout or environment that lies under /tmp is
bound back into the hosts' private /tmp. Logins use a key made for the test.

Killing every process of a namespace (:meth:`Hosts.kill`) is the loss of that host.
Needs root and openssh-server (``make test`` installs it).
"""
from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from service import Service

SSHD = "/usr/sbin/sshd"
_made = itertools.count()  # Hosts made by this process


def available() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


def _in(ns: str, *args: str) -> None:
    _run("ip", "netns", "exec", ns, *args)


class Hosts(Service):
    """``with Hosts(2) as hosts:`` -- `hosts.names` are the hosts' addresses, `hosts.bridge`
    the interface of this side, `hosts.ssh_args` what ssh needs to log in."""

    def __init__(self, count: int = 2):
        self.count = count
        # what the hosts must see although it lies in /tmp: this checkout (its venv) and Python
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.shared = sorted({p for p in (here, sys.prefix) if p.startswith("/tmp/")})
        # a subnet of our own: parallel test sessions differ, and so do this session's
        # successive hosts (a namespace's links go away asynchronously once it is deleted)
        tag = (os.getpid() + 37 * next(_made)) % 200 + 20
        self.prefix = f"192.168.{tag}"
        self.bridge = f"ejbr{tag}"
        self.namespaces = [f"ej{tag}h{i}" for i in range(1, count + 1)]
        self.names = [f"{self.prefix}.{i + 1}" for i in range(1, count + 1)]
        self.hostnames = [f"ejhost{i}" for i in range(1, count + 1)]
        # under /run: the hosts' private /tmp must not hide their sshd's files
        self.dir = tempfile.mkdtemp(prefix="ej-hosts-", dir="/run")
        self.key = os.path.join(self.dir, "id_ed25519")
        self.ssh_args = ["-i", self.key, "-o", "StrictHostKeyChecking=no", "-o",
                         "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o",
                         "LogLevel=ERROR", "-o", "ConnectTimeout=5"]
        self._sshd: list[subprocess.Popen] = []

    def start(self) -> None:
        if not os.path.exists(SSHD):
            raise RuntimeError("openssh-server is not installed (apt-get install openssh-server"
                               "; make test does)")
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation folder
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self.key)
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{self.dir}/host_key")
        shutil.copy(f"{self.key}.pub", f"{self.dir}/authorized_keys")
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.prefix}.1/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i, (ns, address, hostname) in enumerate(
                zip(self.namespaces, self.names, self.hostnames), start=1):
            _run("ip", "netns", "add", ns)
            outside = f"{self.bridge}v{i}"
            _run("ip", "link", "add", outside, "type", "veth", "peer", "name", "eth0",
                 "netns", ns)
            _run("ip", "link", "set", outside, "master", self.bridge, "up")
            _in(ns, "ip", "addr", "add", f"{address}/24", "dev", "eth0")
            _in(ns, "ip", "link", "set", "eth0", "up")
            _in(ns, "ip", "link", "set", "lo", "up")
            self._sshd.append(self._start_sshd(ns, address, hostname))
        for address in self.names:
            self._wait_for_ssh(address)

    def _start_sshd(self, ns: str, address: str, hostname: str) -> subprocess.Popen:
        """sshd in the namespace, with a private /tmp and its own hostname."""
        config = os.path.join(self.dir, f"sshd-{ns}.conf")
        with open(config, "w") as f:
            f.write(f"ListenAddress {address}\nPort 22\nHostKey {self.dir}/host_key\n"
                    f"AuthorizedKeysFile {self.dir}/authorized_keys\nPermitRootLogin "
                    "prohibit-password\nPasswordAuthentication no\nUsePAM no\n"
                    f"PidFile {self.dir}/sshd-{ns}.pid\nSubsystem sftp internal-sftp\n"
                    # the home folder is shared: the host's runtime folder is its own
                    "SetEnv JUPYTER_RUNTIME_DIR=/tmp/jupyter-runtime\n")
        keep = [f"{self.dir}/keep-{ns}-{i}" for i in range(len(self.shared))]
        binds = [f"mkdir -p {k} && mount --bind {p} {k}" for p, k in zip(self.shared, keep)]
        back = [f"mkdir -p {p} && mount --bind {k} {p}" for p, k in zip(self.shared, keep)]
        script = " && ".join(binds + ["mount -t tmpfs tmpfs /tmp"] + back + [
            f"hostname {hostname}", f"exec {SSHD} -D -e -f {config}"])
        return subprocess.Popen(
            ["ip", "netns", "exec", ns, "unshare", "--mount", "--uts", "--propagation",
             "private", "sh", "-c", script],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.dir, f"{ns}.log"), "w"))

    def _wait_for_ssh(self, address: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((address, 22), timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"sshd on {address} did not come up; logs in {self.dir}")

    def ssh(self, address: str, command: str) -> str:
        return subprocess.run(["ssh", *self.ssh_args, address, command], check=True,
                              capture_output=True, text=True, timeout=30).stdout

    def pids(self, address: str) -> list[int]:
        ns = self.namespaces[self.names.index(address)]
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def kill(self, address: str) -> None:
        """Lose the host: SIGKILL every process of its namespace, sshd included."""
        for pid in self.pids(address):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        for address in self.names:
            try:
                self.kill(address)
            except (ValueError, OSError):
                pass
        for proc in self._sshd:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for i, ns in enumerate(self.namespaces, start=1):
            subprocess.run(["ip", "link", "del", f"{self.bridge}v{i}"], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)
