"""Two live runs never share a checkpoint folder: an exclusive lock, held by the kernel process
for the run's life, refuses the second run and names the first; it goes with the run's end or
its process."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import DIGITS_CELL

from elastic_jupyter import RunConfig, TrainingRun, UsageError
from elastic_jupyter.run.checkpoint_folder import FolderLock

# Takes the folder lock at the wall-clock time argv[2] (racing its twin), prints the outcome as
# one JSON line, then holds the lock until its stdin closes.
RACER = r'''
import json, os, sys, time
from elastic_jupyter.run.checkpoint_folder import FolderLock
from elastic_jupyter.config import UsageError
folder, start = sys.argv[1], float(sys.argv[2])
time.sleep(max(0.0, start - time.time()))
try:
    lock = FolderLock(folder, "same-name")
    print(json.dumps({"pid": os.getpid(), "held": True}), flush=True)
except UsageError as e:
    print(json.dumps({"pid": os.getpid(), "held": False, "error": str(e)}), flush=True)
sys.stdin.read()
'''


def _racer(folder, start):
    return subprocess.Popen([sys.executable, "-c", RACER, str(folder), str(start)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _outcome(proc) -> dict:
    return json.loads(proc.stdout.readline())


def test_two_processes_racing_for_one_folder_one_wins_the_other_names_it(tmp_path):
    for round_ in range(3):
        folder = tmp_path / f"round{round_}"
        folder.mkdir()
        start = time.time() + 2.0  # both interpreters are up by then
        procs = [_racer(folder, start) for _ in range(2)]
        try:
            outcomes = [_outcome(p) for p in procs]
        finally:
            for p in procs:
                p.stdin.close()
                p.wait(timeout=30)
        winners = [o for o in outcomes if o["held"]]
        losers = [o for o in outcomes if not o["held"]]
        assert len(winners) == 1 and len(losers) == 1, outcomes
        error = losers[0]["error"]
        assert f"checkpoint folder {folder} is in use by run 'same-name' (process " \
               f"{winners[0]['pid']}" in error
        assert "stop that run first, or choose another --name" in error


def test_the_lock_goes_with_its_process(tmp_path):
    holder = _racer(tmp_path, 0)
    try:
        assert _outcome(holder)["held"]
        with pytest.raises(UsageError, match=f"process {holder.pid}"):
            FolderLock(str(tmp_path), "mine")
    finally:
        holder.send_signal(signal.SIGKILL)  # no clean-up: the kernel drops the lock
        holder.wait(timeout=30)
    lock = FolderLock(str(tmp_path), "mine")
    with open(os.path.join(tmp_path, ".lock")) as f:
        assert json.load(f)["pid"] == os.getpid()
    lock.release()


def test_a_run_is_refused_while_another_process_runs_in_its_folder(idle_pool, tmp_path):
    folder = tmp_path / "elastic-checkpoints" / "shared"
    folder.mkdir(parents=True)
    holder = _racer(folder, 0)
    try:
        assert _outcome(holder)["held"]
        run = TrainingRun(idle_pool, RunConfig(name="shared", steps=5, checkpoint_every=0),
                          source=DIGITS_CELL, workspace=str(tmp_path))
        with pytest.raises(UsageError, match=f"is in use by run 'same-name' \\(process "
                                             f"{holder.pid}"):
            run.start()
        assert idle_pool.run is None or not idle_pool.run.active
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    # the holder is gone: the same run name starts, holds the folder while it trains and
    # lets it go when it ends
    run = TrainingRun(idle_pool, RunConfig(name="shared", steps=400, checkpoint_every=0),
                      source=DIGITS_CELL, workspace=str(tmp_path)).start()
    try:
        with pytest.raises(UsageError, match=f"in use by run 'shared' \\(process {os.getpid()}"):
            FolderLock(str(folder), "other")
    finally:
        run.stop()
        assert run.wait(timeout=120) in ("stopped", "finished")
    FolderLock(str(folder), "other").release()
