"""Resume: a run stopped after a checkpoint continues in a fresh pool of another size and ends
with the parameters of an uninterrupted run; a resume whose cell builds another dataset is
refused."""
import hashlib
import os
import re
import time

import pytest
import torch
from conftest import DIGITS_CELL

from elastic_jupyter import EnginePool, RunConfig, TrainingRun, UsageError
from elastic_jupyter.engine.state import checkpoint as ckpt
from elastic_jupyter.engine.state.history import whole_history

CELL = '''
import time
import torch
from sklearn.datasets import load_digits
X, y = load_digits(return_X_y=True)
dataset = torch.utils.data.TensorDataset(torch.tensor(X, dtype=torch.float64) / 16, torch.tensor(y))
model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10)).double()
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.5)
def loss_fn(model, batch):
    time.sleep(0.005)  # slow enough to stop mid-run
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)
'''
STEPS = 150


def _config():
    return RunConfig(name="resumable", global_batch=50, steps=STEPS, checkpoint_every=20, seed=3)


def test_resume_in_another_pool_equals_an_uninterrupted_run(idle_pool, tmp_path):
    whole = TrainingRun(idle_pool, _config(), source=CELL, engines=2,
                        workspace=str(tmp_path / "whole")).start()
    assert whole.wait(timeout=240) == "finished"

    first = TrainingRun(idle_pool, _config(), source=CELL, engines=2,
                        workspace=str(tmp_path / "cut")).start()
    while first.step < 30:
        time.sleep(0.02)
    first.stop()
    assert first.wait(timeout=60) == "stopped"
    stopped_at = first.step
    assert stopped_at < STEPS and first.checkpoints[-1]["step"] == stopped_at

    fresh = EnginePool(n=3, max_size=3, gpus="none").start()
    try:
        second = TrainingRun(fresh, _config(), source=CELL, resume=True,
                             workspace=str(tmp_path / "cut")).start()
        assert second.wait(timeout=240) == "finished", second.logs()
    finally:
        fresh.stop()
    assert [r["step"] for r in second.history] == list(range(1, STEPS + 1))
    # a checkpoint carries only its newest records: the folder's history file holds the rest
    for written in second.checkpoints:
        held = ckpt.load_checkpoint(written["path"])["history"]
        assert held[-1]["step"] == written["step"] and len(held) < written["step"], written
    _, newest, _ = ckpt.load_latest(second.checkpoint_dir)
    assert whole_history(second.checkpoint_dir, newest) == second.history
    # a pool of 1..3 instead of 1..4: the resume keeps the cut its checkpoint recorded
    cut = [e["message"] for e in second.events if e["kind"] == "micro_batches"]
    assert cut == ["the checkpoint's steps were cut for a pool of 1..4; this run keeps that cut "
                   "(one run, one cut), not a pool of 1..3"], cut
    assert {r["world_size"] for r in second.history if r["step"] > stopped_at} == {3}
    expected, got = whole.state_dict(), second.state_dict()
    for k in expected:
        assert torch.allclose(got[k], expected[k], rtol=1e-7, atol=1e-9), k


def test_resume_with_another_dataset_is_refused(idle_pool, tmp_path):
    config = RunConfig(name="redata", global_batch=64, steps=10, checkpoint_every=5)
    first = TrainingRun(idle_pool, config, source=DIGITS_CELL, workspace=str(tmp_path)).start()
    assert first.wait(timeout=120) == "finished", first.logs()
    folder = first.checkpoint_dir
    files = _checkpoint_files(folder)  # the checkpoints, their records and the pointer
    assert [c["step"] for c in first.checkpoints] == [5, 10]

    # the same number of samples, other values: only the fingerprint's hash differs
    other = DIGITS_CELL.replace("/ 16", "/ 8")
    refused = TrainingRun(idle_pool, RunConfig(name="redata", global_batch=64, steps=20),
                          source=other, workspace=str(tmp_path), resume=True)
    with pytest.raises(UsageError) as excinfo:
        refused.start()
    message = str(excinfo.value)
    assert re.search(r"cannot resume with a different dataset \(1797 samples, items hash "
                     r"[0-9a-f]{16} in the checkpoint, 1797 samples, items hash [0-9a-f]{16} "
                     r"now\): resume with the same dataset, or start a new run with another "
                     r"--name", message), message
    assert idle_pool.run is None
    assert _checkpoint_files(folder) == files

    resumed = TrainingRun(idle_pool, RunConfig(name="redata", global_batch=64, steps=20,
                                               checkpoint_every=0),
                          source=DIGITS_CELL, workspace=str(tmp_path), resume=True)
    assert resumed.start().wait(timeout=120) == "finished", resumed.logs()
    assert resumed.history[0]["step"] == 1 and resumed.step == 20


def _checkpoint_files(folder) -> dict:
    """{name: sha256} of the folder's files but its lock (which each run's setup rewrites)."""
    out = {}
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and name != ".lock":
            with open(path, "rb") as f:
                out[name] = hashlib.sha256(f.read()).hexdigest()
    return out
