"""A real Jupyter kernel (jupyter_client, kernel "python3") for the tests that drive the magics as a
notebook would, the float64 digits model they train, and the processes a kernel started: followed
by pid and start time, and killed by pid when a test is done, so a failing test leaves no orphans.
"""
import json
import os
import time

import psutil
from jupyter_client import KernelManager

# deterministic float64 model; ~10 ms of sleep per forward pass: the run lasts several seconds
BODY = '''
import time
import torch
from sklearn.datasets import load_digits
X, y = load_digits(return_X_y=True)
dataset = torch.utils.data.TensorDataset(torch.tensor(X, dtype=torch.float64) / 16, torch.tensor(y))
model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10)).double()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
def loss_fn(model, batch):
    time.sleep(0.01)
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)
'''


# ------------------------------------------------------------------------------ processes


def process_ident(pid: int):
    try:
        return (pid, psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def alive(ident) -> bool:
    pid, started = ident
    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - started) < 0.01 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def describe(ident) -> str:
    try:
        return f"{ident[0]} ({' '.join(psutil.Process(ident[0]).cmdline()[:4])})"
    except psutil.Error:
        return str(ident[0])


def wait_gone(idents, timeout: float) -> list:
    """Poll until none of the processes is alive or `timeout` passes; returns those alive."""
    deadline = time.monotonic() + timeout
    while True:
        left = [i for i in idents if alive(i)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def kill_leftovers(idents) -> None:
    """SIGKILL, by pid (start time checked), processes a test's kernel started."""
    for ident in idents:
        if alive(ident):
            try:
                psutil.Process(ident[0]).kill()
            except psutil.Error:
                pass


# ------------------------------------------------------------------------------ the kernel


class Kernel:
    """A real Jupyter kernel in `cwd`, with its own Jupyter runtime folder (pid files, registry)
    and `env` added to its environment."""

    def __init__(self, cwd, env: dict | None = None):
        self.cwd = str(cwd)
        self.km = KernelManager(kernel_name="python3")
        self.km.shutdown_wait_time = 60  # generous: the machine may be loaded
        env = dict(os.environ, JUPYTER_RUNTIME_DIR=os.path.join(self.cwd, "runtime"),
                   **(env or {}))
        self.km.start_kernel(cwd=self.cwd, env=env)
        self.pid = self.km.provisioner.process.pid
        self.ident = process_ident(self.pid)
        self.seen: set = set()  # every process the kernel started, as far as we looked
        self.kc = self.km.client()
        self.kc.start_channels()
        try:
            self.kc.wait_for_ready(timeout=120)
        except BaseException:
            self.close()
            raise

    def execute(self, code: str, timeout: float = 240) -> list:
        """Run a cell; returns the JSON objects it printed on "@@" lines. Fails on an error."""
        out = []

        def hook(msg):
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                out.append("\n".join(msg["content"]["traceback"]))

        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=hook)
        text = "".join(out)
        assert reply["content"]["status"] == "ok", f"cell failed:\n{code}\n---\n{text}"
        return [json.loads(line[2:]) for line in text.splitlines() if line.startswith("@@")]

    def descendants(self) -> list:
        try:
            found = [process_ident(p.pid)
                     for p in psutil.Process(self.pid).children(recursive=True)]
        except psutil.Error:
            found = []
        self.seen.update(i for i in found if i is not None)
        return [i for i in found if i is not None]

    def close(self) -> None:
        """Stop the client; kill the kernel if it still runs, then whatever it left."""
        try:
            self.kc.stop_channels()
        except Exception:
            pass
        if alive(self.ident):
            self.descendants()
        try:
            self.km.shutdown_kernel(now=True)
        except Exception:
            pass
        kill_leftovers(self.seen)  # callers waited for what should end by itself
