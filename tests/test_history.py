"""A rank's held records and the checkpoint folder's history file (engine.state.history), without a
cluster; the real runs that read a resumed history from the file are in test_resume."""
import json
import os

from elastic_jupyter.engine.state import checkpoint as ckpt
from elastic_jupyter.engine.state.history import HISTORY_FILE, History, append, whole_history


def records(first, last, **fields):
    return [{"step": s, "epoch": s // 10, "loss": 1.0 / s, **fields} for s in range(first, last + 1)]


def state(step, held):
    return {"progress": {"step": step}, "history": held}


def lines(folder):
    with open(os.path.join(folder, HISTORY_FILE)) as f:
        return [json.loads(line)["step"] for line in f]


def test_a_rank_holds_what_it_is_still_asked_for():
    history = History(records(1, 30))
    assert [r["step"] for r in history.since(27)] == [28, 29, 30]
    assert history.epoch_start(2) == 20 and history.epoch_start(7) is None
    history.forget_upto(24)
    assert [r["step"] for r in history] == list(range(25, 31))
    assert history.since(3) == history.records and history.epoch_start(2) == 25
    history.forget_upto(40)
    assert len(history) == 0 and history.since(0) == []


def test_each_write_appends_only_what_the_file_lacks(tmp_path):
    folder = str(tmp_path)
    append(folder, records(1, 20))
    append(folder, records(11, 40))  # the held records overlap the file's
    assert lines(folder) == list(range(1, 41))
    assert whole_history(folder, state(30, records(21, 30))) == records(1, 30)


def test_steps_redone_after_a_rollback_count_by_their_newest_lines(tmp_path):
    folder = str(tmp_path)
    append(folder, records(1, 40))  # written with checkpoint 40, which then could not load
    redone = records(21, 50, world_size=3)  # resumed from checkpoint 20 at another size
    append(folder, redone)
    assert lines(folder)[-30:] == list(range(21, 51))  # all of them: the file's 40 differs
    assert whole_history(folder, state(50, redone[-10:])) == records(1, 20) + redone
    # a checkpoint of the old timeline reads only up to its own step
    assert whole_history(folder, state(20, [])) == records(1, 20)


def test_a_torn_last_line_is_skipped(tmp_path):
    folder = str(tmp_path)
    append(folder, records(1, 10))
    with open(os.path.join(folder, HISTORY_FILE), "a") as f:
        f.write('{"step": 11, "epo')  # a writer killed mid-append
    append(folder, records(5, 12))
    assert whole_history(folder, state(12, [])) == records(1, 12)


def test_a_checkpoint_without_the_file_holds_its_own_history(tmp_path):
    old = records(1, 30)  # written before the file existed: the state holds every record
    assert whole_history(str(tmp_path), state(30, old)) == old


def test_a_checkpoint_write_appends_its_records_first(tmp_path):
    folder = str(tmp_path)
    for step in (10, 20, 30):
        ckpt.write_checkpoint(folder, {"progress": {"step": step},
                                       "history": records(max(1, step - 15), step)}, keep=1)
    path, loaded, _ = ckpt.load_latest(folder)
    assert path.endswith("step-00000030.pt") and len(loaded["history"]) == 16
    assert whole_history(folder, loaded) == records(1, 30)
    assert lines(folder) == list(range(1, 31))
