"""Shared fixtures: one real ipyparallel pool for the whole session (starting one costs seconds)."""
import datetime
import os
import tempfile

import pytest
import torch.distributed as dist

# The tests' runs, kernels and servers register in a runtime dir of their own, not in the
# user's (where the side panel would list them as lost runs forever).
os.environ["JUPYTER_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="elastic-jupyter-tests-")

from elastic_jupyter import EnginePool

DIGITS_CELL = '''
import torch
from sklearn.datasets import load_digits
X, y = load_digits(return_X_y=True)
dataset = torch.utils.data.TensorDataset(torch.tensor(X, dtype=torch.float32) / 16, torch.tensor(y))
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)
'''


@pytest.fixture(scope="session")
def pool():
    p = EnginePool(n=2, min_size=1, max_size=4, gpus="none").start()
    yield p
    p.stop()


@pytest.fixture
def idle_pool(pool):
    """The shared pool, with no run left active by an earlier test, at its start size (2
    engines): a run that leaves it at another size (its resizes, a fault's lost engine)
    would otherwise start the next test's run at that size."""
    if pool.run is not None and pool.run.active:
        pool.run.stop()
        pool.run.wait(timeout=60)
    if pool.size != pool.config.n:
        pool.resize(pool.config.n)
    yield pool
    if pool.run is not None and pool.run.active:
        pool.run.stop()
        pool.run.wait(timeout=60)


@pytest.fixture
def store():
    """A rendezvous TCPStore server in this process (clients connect to its port)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    yield server
    del server
