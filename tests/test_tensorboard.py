"""--tensorboard: a real run's TensorBoard event files, read back with TensorBoard's own reader.

The run resizes, loses its only engine after its first checkpoint (so the newest checkpoint is
loaded and the steps after it are redone), finishes, and is resumed for more steps: TensorBoard
must show every step once, with the values the run kept, and the run's events as text.
"""
import os
import signal

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util.tensor_util import make_ndarray

from elastic_jupyter import RunConfig, TrainingRun, UsageError
from test_faults import CELL, wait_for

METRIC = '''
eval_dataset = dataset
def metric_fn(model, batch):
    x, y = batch
    return {"accuracy": (model(x).argmax(1) == y).float().mean()}
'''


HOLD = '''
import os
def after_step(model, optimizer, step):  # holds step 30 once, so the kill lands between checkpoints
    if step == 30 and not os.path.exists({flag!r}):
        open({flag!r}, "w").close()
        time.sleep(600)
'''


def _config(steps, **extra):
    return RunConfig(name="tb", global_batch=64, steps=steps, checkpoint_every=20, eval_every=25,
                     collective_timeout=5, seed=4, tensorboard=True, **extra)


def _read(folder):
    events = EventAccumulator(folder, size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()  # purges what a writer's purge_step hides, as TensorBoard's UI does
    return events


def test_tensorboard_logs_each_step_once_through_a_rollback_and_a_resume(idle_pool, tmp_path):
    held = tmp_path / "held-at-30"
    run = TrainingRun(idle_pool, _config(70), source=CELL + METRIC + HOLD.format(flag=str(held)),
                      engines=1, workspace=str(tmp_path), schedule=[(45, 2)]).start()
    wait_for(held.exists, what="step 30")
    os.kill(run.members[0].pid, signal.SIGKILL)  # the only holder of the state: back to step 20
    assert run.wait(timeout=240) == "finished", run.logs()
    fault = next(e for e in run.events if e["kind"] == "fault")
    assert fault["rolled_back_to"] == 20 and fault["step"] > 20, fault
    kept = {r["step"]: r for r in run.history}

    resumed = TrainingRun(idle_pool, _config(90), source=CELL + METRIC, engines=2,
                          workspace=str(tmp_path), resume=True).start()
    assert resumed.wait(timeout=240) == "finished", resumed.logs()
    kept.update({r["step"]: r for r in resumed.history})
    assert resumed.tensorboard_dir == str(tmp_path / "elastic-checkpoints" / "tb" / "tensorboard")

    events = _read(resumed.tensorboard_dir)
    loss = events.Scalars("train/loss")
    assert [s.step for s in loss] == list(range(1, 91))  # each step once, in order
    assert [s.value for s in loss] == pytest.approx([kept[s]["loss"] for s in range(1, 91)],
                                                    rel=1e-6)
    assert [s.wall_time for s in loss] == pytest.approx([kept[s]["time"] for s in range(1, 91)])
    sizes = {s.step: s.value for s in events.Scalars("elastic/world_size")}
    assert sizes[45] == 1 and sizes[46] == 2 and sizes[71] == 2
    assert [s.step for s in events.Scalars("val/accuracy")] == [25, 50, 70, 75, 90]  # and at the end
    assert {"train/lr", "elastic/samples_per_s"} <= set(events.Tags()["scalars"])

    texts = [make_ndarray(t.tensor_proto).item().decode()
             for t in events.Tensors("events/text_summary")]
    assert any("fault: engines slot" in t and "rolled back to step 20" in t for t in texts), texts
    assert any("resize 1 -> 2 (scheduled)" in t for t in texts), texts
    assert any("checkpoint" in t for t in texts) and any("finished" in t for t in texts)


def test_tensorboard_option_is_checked_before_anything_starts(idle_pool, tmp_path):
    with pytest.raises(UsageError, match="tensorboard takes True"):
        TrainingRun(idle_pool, RunConfig(name="bad", steps=5, tensorboard=""), source=CELL,
                    workspace=str(tmp_path))
    assert not (tmp_path / "elastic-checkpoints").exists()


def _record(step, loss):
    return {"step": step, "epoch": 0, "loss": loss, "lr": 0.1, "lr_1": 0.2, "world_size": 2,
            "samples_per_s": 100.0, "time": 1_000_000.0 + step}


def test_the_log_waits_for_a_missing_step_hides_a_rollback_and_ends_at_close(tmp_path):
    from elastic_jupyter.run.runlog import RunLog
    from elastic_jupyter.run.tensorboard import TensorBoardLog
    log = RunLog(str(tmp_path / "logs"))
    log.tensorboard = TensorBoardLog(str(tmp_path / "tb"))
    log.merge({"records": [_record(1, 1.0), _record(2, 2.0), _record(4, 4.0)]})  # 3 skipped
    assert log.complete_upto == 2
    log.merge({"records": [_record(3, 3.0)]}, complete=True)  # delivered later
    assert log.complete_upto == 4
    log.roll_back(2)  # 3 and 4 are void: redone with other values
    log.merge({"records": [_record(s, 10.0 + s) for s in (3, 4, 5)]}, complete=True)
    log.event("fault", step=5, rolled_back_to=2, lost_steps=3, lost_slots=[1], hung_slots=[],
              world_size=2)
    log.tensorboard.close()
    log.event("warning", message="after the end")  # dropped: the log is closed
    events = _read(str(tmp_path / "tb"))
    assert [(s.step, s.value) for s in events.Scalars("train/loss")] == [
        (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]
    assert [s.step for s in events.Scalars("train/lr_1")] == [1, 2, 3, 4, 5]  # param group 1
    texts = [make_ndarray(t.tensor_proto).item().decode()
             for t in events.Tensors("events/text_summary")]
    assert len(texts) == 1 and "rolled back to step 2" in texts[0], texts
    assert len(os.listdir(tmp_path / "tb")) == 2  # one file a writer: none opened after close
