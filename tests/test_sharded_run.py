"""``--shard`` through the product: a real pool, the owner's generations, resizes and a resume.

The same float64 cell as tests/test_sharded_step.py (FSDP2 per block, BatchNorm, dropout, a
parameter some steps do not use) trains sharded on the test pool with a schedule 2 -> 3 -> 1 ->
2, and replicated with the same schedule: the results are equal (the replicated mode's are
equal to a plain loop's, tests/test_invariance.py). A sharded run stopped at step 5 and resumed
at 3 ranks ends as the uninterrupted one.
"""
from __future__ import annotations

import time

import pytest
import torch

from elastic_jupyter import RunConfig, RunSetupError, TrainingRun
from test_faults import kill_in_phase
from test_sharded_step import CELL

STEPS, SCHEDULE = 10, [(3, 3), (6, 1), (8, 2)]
# 10 evaluation chunks of 4: 4, 3, 3 at 3 ranks (FSDP2's forward passes padded to 4)
EVALUATED = CELL + """
eval_dataset = torch.utils.data.TensorDataset(x[:40], y[:40], rare[:40])
def metric_fn(model, batch):
    x, y, rare = batch
    return {"mse": torch.nn.functional.mse_loss(model(x, rare), y)}
"""


def _run(pool, tmp_path, name: str, engines: int, schedule=(), resume=False, source=CELL,
         **options) -> TrainingRun:
    config = RunConfig(name=name, global_batch=16, micro_batch=4, seed=3, checkpoint_every=5,
                       **{"steps": STEPS, **options})
    run = TrainingRun(pool, config, source=source, engines=engines, schedule=list(schedule),
                      workspace=str(tmp_path), resume=resume).start()
    assert run.wait(timeout=240) == "finished", run.logs()
    return run


def _model(run: TrainingRun) -> dict:
    return {k: v for k, v in run.state_dict().items() if not k.endswith("num_batches_tracked")}


def test_a_sharded_run_resized_2_3_1_2_equals_the_replicated_run(idle_pool, tmp_path):
    sharded = _run(idle_pool, tmp_path, "sharded", 2, SCHEDULE, source=EVALUATED, eval_every=2,
                   shard=True, replica_every=2)
    replicated = _run(idle_pool, tmp_path, "replicated", 2, SCHEDULE, source=EVALUATED,
                      eval_every=2)
    evaluated = {r["step"]: r["val_mse"] for r in replicated.history if "val_mse" in r}
    assert list(evaluated) == [2, 4, 6, 8, 10]  # at 2, 3, 3, 1 and 2 ranks
    assert {r["step"]: r["val_mse"] for r in sharded.history if "val_mse" in r} == \
        pytest.approx(evaluated, rel=1e-9)
    assert [r["world_size"] for r in sharded.history] == [2] * 3 + [3] * 3 + [1] * 2 + [2] * 2
    expected = _model(replicated)
    got = _model(sharded)
    assert got.keys() == expected.keys()
    for k, value in expected.items():
        assert torch.allclose(got[k], value, rtol=1e-9, atol=1e-12), k
    kinds = [e["kind"] for e in sharded.events]
    assert kinds.count("replicas") >= 4  # after each start, and every 2 steps
    written = [e for e in sharded.events if e["kind"] == "checkpoint"]
    assert [e["step"] for e in written] == [5, 10] and all(e["sharded"] for e in written)
    assert [(c["step"], c["file"]) for c in sharded.checkpoints] == [
        (5, "step-00000005.shards"), (10, "step-00000010.shards")]
    # export() and load_into() read the model a tensor at a time: the same weights
    exported = torch.load(sharded.export(str(tmp_path / "model.pt")), weights_only=True)
    built: dict = {}
    exec(CELL, built)  # pylint: disable=exec-used  # the model as the cell builds it
    loaded = sharded.load_into(built["model"]).state_dict()
    for k, value in sharded.state_dict().items():
        assert torch.equal(exported[k], value) and torch.equal(loaded[k], value), k


def test_a_sharded_run_resumes_at_another_world_size(idle_pool, tmp_path):
    # past the 32 steps after which engines forget what the owner acknowledged: the history
    # comes from the checkpoint folder's file
    whole = _run(idle_pool, tmp_path, "whole", 2, shard=True, steps=44)
    _run(idle_pool, tmp_path, "parts", 2, shard=True, steps=40)  # its last checkpoint: 40
    resumed = _run(idle_pool, tmp_path, "parts", 3, shard=True, resume=True, steps=44)
    assert [r["world_size"] for r in resumed.history] == [2] * 40 + [3] * 4
    expected, got = _model(whole), _model(resumed)
    for k, value in expected.items():
        assert torch.allclose(got[k], value, rtol=1e-9, atol=1e-12), k


def test_an_error_right_after_a_checkpoint_keeps_that_checkpoint_as_the_final_state(
        idle_pool, tmp_path):
    # each rank's part of step 5 is written beside step 6, whose loss raises on every rank
    failing = CELL + """
passes = 0
def loss_fn(model, batch):
    global passes
    passes += 1
    if passes > 2 * 5:  # two micro-batches a rank a step: step 6
        raise ValueError("a bad batch at step 6")
    x, y, rare = batch
    return torch.nn.functional.mse_loss(model(x, rare), y)
"""
    config = RunConfig(name="fails", global_batch=16, micro_batch=4, seed=3,
                       checkpoint_every=5, steps=STEPS, shard=True)
    run = TrainingRun(idle_pool, config, source=failing, engines=2,
                      workspace=str(tmp_path)).start()
    assert run.wait(timeout=240) == "failed" and "a bad batch at step 6" in run.error
    assert [c["step"] for c in run.checkpoints] == [5]
    assert run.history[-1]["step"] == 5
    got = _model(run)  # the final state: the checkpoint of step 5, found on disk
    expected = _model(_run(idle_pool, tmp_path, "five", 2, shard=True, steps=5))
    for k, value in expected.items():
        assert torch.equal(got[k], value), k


@pytest.mark.parametrize("phase", ["forward", "reduce_scatter", "refresh"])
def test_a_sharded_run_survives_a_sigkill_through_its_partner_replicas(idle_pool, tmp_path,
                                                                       phase):
    # in a pass; in the backward that reduce-scatters; before the replicas' exchange, whose
    # copies of the step before stand
    faults = tmp_path / "faults"
    faults.mkdir()
    run = TrainingRun(idle_pool, RunConfig(
        name="killed", global_batch=16, micro_batch=4, seed=3, steps=24, checkpoint_every=0,
        shard=True, replica_every=4, fault_dir=str(faults)), source=CELL, engines=3,
        workspace=str(tmp_path)).start()
    victim = run.members[1]
    hit_step, _ = kill_in_phase(run, phase, victim.slot, after_step=9)
    assert run.wait(timeout=240) == "finished", run.logs()
    back = [e for e in run.events if e["kind"] == "rollback"]
    assert len(back) == 1 and back[0]["step"] <= hit_step, run.events
    assert hit_step - back[0]["step"] <= 4  # at most --replica-every steps
    assert [r["step"] for r in run.history] == list(range(1, 25))  # each step once
    expected = _model(_run(idle_pool, tmp_path, "unharmed", 3, steps=24))
    got = _model(run)
    for k, value in expected.items():
        assert torch.allclose(got[k], value, rtol=1e-9, atol=1e-12), k


def test_the_pool_status_and_the_snapshot_say_the_run_is_sharded(idle_pool, tmp_path):
    run = TrainingRun(idle_pool, RunConfig(name="mode", global_batch=16, micro_batch=4, seed=3,
                                           steps=400, shard=True), source=CELL, engines=2,
                      workspace=str(tmp_path)).start()
    try:
        deadline = time.monotonic() + 60
        while run.step < 1:
            assert time.monotonic() < deadline, run.logs()
            time.sleep(0.05)
        assert idle_pool.status()["run_mode"] == "sharded, no memory bound (no --memory-per-rank)"
        snapshot = run.snapshot()
        assert snapshot.state_mode == "sharded" and "world size 2 (sharded)" in snapshot.summary()
    finally:
        run.stop()
        run.wait(timeout=60)


def test_a_resume_in_the_other_mode_says_which_mode_wrote_the_checkpoints(idle_pool, tmp_path):
    _run(idle_pool, tmp_path, "sharded-parts", 2, shard=True, steps=5)
    with pytest.raises(Exception, match="written with --shard; resume with --shard"):
        _run(idle_pool, tmp_path, "sharded-parts", 2, resume=True)
    _run(idle_pool, tmp_path, "plain-files", 2, steps=5)
    with pytest.raises(Exception, match="written without --shard; resume without it"):
        _run(idle_pool, tmp_path, "plain-files", 2, shard=True, resume=True)


def test_a_damaged_newest_sharded_checkpoint_is_skipped_for_the_one_before(idle_pool, tmp_path):
    first = _run(idle_pool, tmp_path, "damaged", 2, shard=True)  # checkpoints at 5 and 10
    newest = first.checkpoints[-1]["path"]
    with open(f"{newest}/part-00001.pt", "r+b") as f:  # a bit flipped on disk
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    resumed = _run(idle_pool, tmp_path, "damaged", 3, shard=True, resume=True, steps=12)
    assert [r["world_size"] for r in resumed.history] == [2] * 5 + [3] * 7
    skipped = [e for e in resumed.events if e["kind"] == "warning" and "skipped" in e["message"]]
    assert skipped and "part-00001.pt is missing or damaged" in skipped[0]["message"]


@pytest.mark.parametrize("more, refused", [
    ("model.scale = torch.nn.Parameter(torch.tensor(1.0, dtype=torch.float64))",
     "FSDP2 could not shard the model: ValueError: fully_shard doesn't support scalar "
     "parameters"),
    ("def shard_fn(model, mesh):\n    torch.distributed.fsdp.fully_shard(model.blocks[7])",
     r"the cell's shard_fn\(model, mesh\) raised IndexError: index 7 is out of range"),
])
def test_a_model_fsdp2_cannot_shard_is_refused_at_setup(idle_pool, tmp_path, more, refused):
    # tried at setup on a copy without storage, before any rank trains or writes
    with pytest.raises(RunSetupError, match=refused):
        _run(idle_pool, tmp_path, "unshardable", 2, source=CELL + more, shard=True)
    assert not list(tmp_path.glob("elastic-checkpoints/unshardable/step-*"))
    _run(idle_pool, tmp_path, "after", 2, shard=True, steps=2)  # the pool trains on
