"""Engines see what the notebook sees: the cell runs in the notebook's working folder (engines
started before or after alike), re-running an edited cell on the same pool imports the edited
modules and frees the previous run's objects, and engines that build different datasets are
named (a replacement that does is refused, so a run's steps never change)."""
import gc
import os
import re
import sys
import uuid
import weakref

import psutil
import pytest
import torch

from elastic_jupyter import RunConfig, RunSetupError, TrainingRun
from elastic_jupyter.engine import entrypoints

# reads its data by a relative path and takes its learning rate from a module beside it
RELATIVE_CELL = '''
import torch
import {module} as settings
x, y = torch.load("data.pt")
dataset = torch.utils.data.TensorDataset(x, y)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=settings.LR)
def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)
'''


@pytest.fixture
def notebook_folder(tmp_path, monkeypatch):
    """tmp_path as the notebook's folder: data.pt and a settings module in it, and the
    kernel's working folder (the session pool's engines started elsewhere)."""
    torch.save((torch.randn(96, 4), torch.randint(0, 2, (96,))), tmp_path / "data.pt")
    module = f"settings_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text("LR = 0.125\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path, module


def test_the_cell_runs_in_the_notebooks_folder_and_imports_edited_modules_afresh(
        idle_pool, notebook_folder):
    folder, module = notebook_folder
    assert all(psutil.Process(e.pid).cwd() != str(folder) for e in idle_pool.engine_sets.engines)
    cell = RELATIVE_CELL.format(module=module)
    first = TrainingRun(idle_pool, RunConfig(name="relative", global_batch=16, steps=8,
                                             checkpoint_every=0),
                        source=cell, engines=2, workspace=str(folder / "a"),
                        schedule=[(3, 3)]).start()  # the third engine starts during the run
    try:
        assert first.wait(timeout=180) == "finished", first.logs()
    finally:
        idle_pool.resize(2)
    assert {r["world_size"] for r in first.history} == {2, 3}
    assert {r["lr"] for r in first.history} == {0.125}

    (folder / f"{module}.py").write_text("LR = 0.25\n")  # edited between the two runs
    second = TrainingRun(idle_pool, RunConfig(name="relative", global_batch=16, steps=4,
                                              checkpoint_every=0),
                         source=cell, engines=2, workspace=str(folder / "b")).start()
    assert second.wait(timeout=180) == "finished", second.logs()
    assert {r["lr"] for r in second.history} == {0.25}
    assert all(psutil.Process(e.pid).cwd() == str(folder) for e in idle_pool.engine_sets.engines)


def test_engines_that_build_different_datasets_are_named(idle_pool, tmp_path):
    idle_pool.resize(2)  # the run's engines: the pool's first two (earlier tests vary the slots)
    first, second = (e.slot for e in idle_pool.engine_sets.engines[:2])
    cell = '''
import os
import torch
slot = int(os.environ["ELASTIC_JUPYTER_SLOT"])
n = {n}
torch.manual_seed({seed})
dataset = torch.utils.data.TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,)))
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
def loss_fn(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
'''
    for n, seed, differ in ((f"100 + (slot == {second})", "0", "101 samples"),  # one more
                            ("100", "slot", "items hash")):  # the same length, other samples
        run = TrainingRun(idle_pool, RunConfig(name=f"differ-{uuid.uuid4().hex[:6]}", steps=5),
                          source=cell.format(n=n, seed=seed), engines=2,
                          workspace=str(tmp_path))
        with pytest.raises(RunSetupError) as refused:
            run.start()
        message = str(refused.value)
        assert message.startswith(f"the engines built different datasets (engine slot "
                                  f"{second} differs from slot {first}): slot {first}: 100 "
                                  "samples"), message
        assert differ in message and f"each runs it in {os.getcwd()}" in message


def test_a_replacement_engine_with_another_dataset_is_refused(idle_pool, tmp_path):
    # engines on other slots than the run's first two build a longer dataset: with it the run
    # would have more steps
    idle_pool.resize(2)
    first_two = sorted(e.slot for e in idle_pool.engine_sets.engines[:2])
    cell = '''
import os, time
import torch
n = 256 if int(os.environ["ELASTIC_JUPYTER_SLOT"]) in FIRST_TWO else 320
torch.manual_seed(0)
dataset = torch.utils.data.TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,)))
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
def loss_fn(model, batch):
    time.sleep(0.01)
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
'''
    run = TrainingRun(idle_pool, RunConfig(name="replaced", global_batch=32, epochs=1,
                                           checkpoint_every=0),
                      source=cell.replace("FIRST_TWO", repr(first_two)), engines=2,
                      workspace=str(tmp_path), schedule=[(3, 3)]).start()
    try:
        assert run.wait(timeout=240) == "finished", run.logs()
    finally:
        idle_pool.resize(2)
    assert run.total_steps == 8 and [r["step"] for r in run.history] == list(range(1, 9))
    assert {r["world_size"] for r in run.history} == {2}
    warnings = [e["message"] for e in run.events if e["kind"] == "warning"]
    assert any(re.search(r"engine slot \d+ built another dataset than the run's \(320 samples", w)
               and "the run's: 256 samples" in w and "refused" in w for w in warnings), warnings


CELL = '''
import torch
dataset = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
def loss_fn(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
'''


def test_a_new_run_on_an_engine_frees_the_previous_runs_objects(tmp_path, monkeypatch):
    """The engine's entry points, called in this process: after the next setup (or the end
    of the run) nothing holds the previous run's model, not even its checkpoint writer."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    config = RunConfig(name="t", steps=3, checkpoint_dir=str(tmp_path)).as_dict()
    entrypoints.setup_run(dict(config), CELL, None, {}, None, str(tmp_path))
    first = weakref.ref(entrypoints._state.worker.model)
    entrypoints.setup_run(dict(config), CELL, None, {}, None, str(tmp_path))
    assert first() is None
    second = weakref.ref(entrypoints._state.worker.model)
    entrypoints.drop_run()
    gc.collect()
    assert second() is None and entrypoints._state.worker is None
