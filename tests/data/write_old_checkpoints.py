"""Writes tests/data/c2f1eda/: the checkpoint folders of two short runs of the digits model,
replicated and --shard, as the release before the options were renamed (commit c2f1eda) wrote
them. tests/test_old_checkpoints.py resumes each with today's code.

Run it from a worktree of c2f1eda, with that worktree first on the path:
``git worktree add /tmp/old c2f1eda && cd /tmp/old && PYTHONPATH=/tmp/old
/path/to/.venv/bin/python /path/to/tests/data/write_old_checkpoints.py /path/to/tests/data``.
"""
import os
import shutil
import sys

from elastic_jupyter import EnginePool, RunConfig, TrainingRun

CELL = '''
import torch
from sklearn.datasets import load_digits
X, y = load_digits(return_X_y=True)
dataset = torch.utils.data.TensorDataset(torch.tensor(X, dtype=torch.float64) / 16, torch.tensor(y))
model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10),
                            torch.nn.Tanh(), torch.nn.Linear(10, 10)).double()
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)
'''
STEPS = 12  # written at step 12; the test resumes to 24


def config(name: str, **options) -> RunConfig:
    return RunConfig(name=name, global_batch=50, steps=STEPS, checkpoint_every=STEPS, seed=5,
                     keep=1, **options)


if __name__ == "__main__":
    out = os.path.join(os.path.abspath(sys.argv[1]), "c2f1eda")
    shutil.rmtree(out, ignore_errors=True)
    pool = EnginePool(n=2, min_size=1, max_size=4, gpus="none").start()
    try:
        for name, options in (("replicated", {}), ("sharded", {"shard": True})):
            run = TrainingRun(pool, config(name, **options), source=CELL, engines=2,
                              workspace=out).start()
            assert run.wait(timeout=300) == "finished", run.logs()
    finally:
        pool.stop()
    for name in ("replicated", "sharded"):  # only the checkpoints: the logs are the run's
        shutil.move(os.path.join(out, "elastic-checkpoints", name), os.path.join(out, name))
        shutil.rmtree(os.path.join(out, name, "logs"), ignore_errors=True)
    shutil.rmtree(os.path.join(out, "elastic-checkpoints"))
