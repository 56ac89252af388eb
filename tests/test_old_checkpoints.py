"""Checkpoints written by the release before the options were renamed (commit c2f1eda, whose
configs say ``workers``, ``keep`` and ``commit_every``) resume with today's code, replicated
and sharded, and end where an uninterrupted run of today's code ends. The folders were written
by tests/data/write_old_checkpoints.py (its docstring says how)."""
import pathlib
import shutil
import sys

import pytest
import torch

from elastic_jupyter import RunConfig, TrainingRun

DATA = pathlib.Path(__file__).resolve().parent / "data"
sys.path.insert(0, str(DATA))
from write_old_checkpoints import CELL, STEPS  # noqa: E402  (the cell the folders were written by)


def _config(name: str, **options) -> RunConfig:
    return RunConfig(name=name, global_batch=50, steps=2 * STEPS, checkpoint_every=STEPS,
                     seed=5, keep_checkpoints=1, **options)


@pytest.fixture(scope="module")
def uninterrupted(pool, tmp_path_factory):
    run = TrainingRun(pool, _config("replicated"), source=CELL, engines=2,
                      workspace=str(tmp_path_factory.mktemp("whole"))).start()
    assert run.wait(timeout=300) == "finished", run.logs()
    return run.state_dict()


@pytest.mark.parametrize("mode, options", [("replicated", {}), ("sharded", {"shard": True})])
def test_a_checkpoint_of_the_release_before_resumes_and_ends_as_an_uninterrupted_run(
        idle_pool, tmp_path, uninterrupted, mode, options):
    shutil.copytree(DATA / "c2f1eda" / mode, tmp_path / "elastic-checkpoints" / mode)
    run = TrainingRun(idle_pool, _config(mode, **options), source=CELL, engines=2, resume=True,
                      workspace=str(tmp_path)).start()
    assert run.wait(timeout=300) == "finished", run.logs()
    assert [r["step"] for r in run.history] == list(range(1, 2 * STEPS + 1))
    assert [e["resumed_from"] for e in run.events if e["kind"] == "start"][0] is not None
    got = run.state_dict()
    assert got.keys() == uninterrupted.keys()
    for k, expected in uninterrupted.items():
        assert torch.allclose(got[k], expected, rtol=1e-7, atol=1e-9), k
