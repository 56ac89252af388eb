"""The Python API beyond the magics: setup functions, export, newest-wins requests, failed writes."""
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from elastic_jupyter import RunConfig, TrainingRun
from elastic_jupyter.config import UsageError

from conftest import DIGITS_CELL


def digits_setup():
    """A setup function defined in a test module: pickled by value, the engines never import it."""
    import torch
    from sklearn.datasets import load_digits
    X, y = load_digits(return_X_y=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.05),
            "dataset": torch.utils.data.TensorDataset(torch.tensor(X, dtype=torch.float32) / 16,
                                                      torch.tensor(y)),
            "loss_fn": lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])}


def test_setup_function_and_export_without_the_package(idle_pool, tmp_path):
    run = TrainingRun(idle_pool, RunConfig(name="fn", steps=30, checkpoint_every=0),
                      setup=digits_setup, workspace=str(tmp_path)).start()
    assert run.wait(timeout=120) == "finished", run.logs()
    path = run.export(str(tmp_path / "model.pt"))
    # a plain state_dict: loads in a process that never imports elastic_jupyter
    code = ("import sys, torch; sd = torch.load(sys.argv[1], weights_only=True); "
            "assert 'elastic_jupyter' not in sys.modules; print(sorted(sd))")
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                         check=True).stdout
    assert "0.weight" in out
    model = run.load_into(digits_setup()["model"])
    assert torch.equal(model.state_dict()["0.weight"], run.state_dict()["0.weight"])
    # a compiled model takes the plain model's weights (compiling waits for its first call)
    compiled = run.load_into(torch.compile(digits_setup()["model"], backend="eager"))
    assert torch.equal(compiled.state_dict()["_orig_mod.0.weight"], run.state_dict()["0.weight"])
    # another architecture is refused, naming a tensor, before anything is loaded
    other = torch.nn.Sequential(torch.nn.Linear(64, 32))
    before = other.state_dict()["0.weight"].clone()
    with pytest.raises(UsageError, match="lacks 2 trained tensor.*'2.bias'.*nothing was loaded"):
        run.load_into(other)
    assert torch.equal(other.state_dict()["0.weight"], before)


SLOW_CELL = DIGITS_CELL.replace("def loss_fn(model, batch):",
                                "import time\ndef loss_fn(model, batch):\n    time.sleep(0.005)")


def test_the_newest_immediate_request_wins(idle_pool, tmp_path):
    run = TrainingRun(idle_pool, RunConfig(name="newest", steps=3000, checkpoint_every=0),
                      source=SLOW_CELL, engines=2, workspace=str(tmp_path)).start()
    try:
        run.resize(3)
        time.sleep(0.005)  # a few ms apart: the overridden 3 must not start an engine
        run.resize(1)
        deadline, largest = time.time() + 30, 0
        while run.world_size != 1 and time.time() < deadline:
            largest = max(largest, idle_pool.size)
            time.sleep(0.01)
        assert run.world_size == 1
        assert largest <= 2 and "engine(s) ready" not in run.logs(), run.logs()
        run.resize(1)  # equal to the current size: nothing happens
        time.sleep(0.5)
    finally:
        run.stop()
        run.wait(timeout=60)
    resizes = [(e["from"], e["to"]) for e in run.events if e["kind"] == "resize"]
    assert resizes == [(2, 1)]
    assert run.state == "stopped" and idle_pool.run is None


def test_a_failed_checkpoint_write_warns_and_training_goes_on(idle_pool, tmp_path):
    folder = tmp_path / "ckpt"
    run = TrainingRun(idle_pool, RunConfig(name="full", steps=400, checkpoint_every=50,
                                           checkpoint_dir=str(folder)),
                      source=SLOW_CELL, engines=2).start()
    while run.step < 60:
        time.sleep(0.02)
    shutil.rmtree(folder)
    folder.write_text("not a folder any more")  # every later write fails
    assert run.wait(timeout=120) == "finished"
    failed = [e for e in run.events if e["kind"] == "checkpoint_failed"]
    assert failed and "could not write checkpoint" in failed[0]["message"]
    assert run.step == 400
    os.unlink(folder)
