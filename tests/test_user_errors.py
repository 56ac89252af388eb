"""A fault is told from the user's error by signals, never by the words of a message.

A dataset raising ``TimeoutError("... read timed out")`` is the user's error: the run fails within
seconds with that engine's traceback instead of looping through fault recoveries. Only a failure
inside our own collectives (``PeerFailure``), a dead engine or a rank that never returned is a
fault. Checked at three levels: the owner's classification, a real gloo generation without
ipyparallel, and a run on the session pool.
"""
import concurrent.futures
import datetime
import os
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from ipyparallel.error import EngineError, RemoteError
from worlds import cell_namespace, config, spawn

from elastic_jupyter import RunConfig, TrainingRun
from elastic_jupyter.run import faults
from elastic_jupyter.engine.group.collective import PeerFailure, collective
from elastic_jupyter.run.recovery import Recovery, RepeatedFailure
from elastic_jupyter.engine.generation import run_generation
from elastic_jupyter.engine.protocol import GenerationSpec
from elastic_jupyter.engine.worker import Worker

# ------------------------------------------------------------------------- the owner's view


@dataclass
class FakeEngine:
    engine_id: int
    slot: int
    pid: int = os.getpid()  # alive
    local: bool = True


def finished_with(error):
    future = concurrent.futures.Future()
    future.set_exception(error)
    return future


def remote(ename, evalue):
    return RemoteError(ename, evalue, f"Traceback ...\n{ename}: {evalue}")


def test_words_in_a_user_error_do_not_make_it_a_fault():
    members = [FakeEngine(0, 0), FakeEngine(1, 1)]
    user = remote("TimeoutError", "fetching sample 77: read timed out")
    peer = remote("PeerFailure", "gradient all-reduce failed: Connection closed by peer")
    outcome = faults.classify(members, [finished_with(peer), finished_with(user)])
    assert [e.slot for e, _ in outcome.errors] == [1] and not outcome.fault
    assert [e.slot for e, _ in outcome.collective] == [0]
    # gloo's and NCCL's words raised by the user's own code are still the user's
    words = [remote("RuntimeError", "[gloo/pair.cc] Connection closed by peer"),
             remote("DistBackendError", "NCCL error: Timed out")]
    outcome = faults.classify(members, [finished_with(w) for w in words])
    assert len(outcome.errors) == 2 and not outcome.fault


def test_our_collectives_failing_or_an_engine_dying_is_a_fault():
    members = [FakeEngine(0, 0), FakeEngine(1, 1)]
    peer = remote("PeerFailure", "forming the process group failed: Wait timeout")
    assert faults.classify(members, [finished_with(peer), finished_with(peer)]).fault
    outcome = faults.classify(members, [finished_with(peer), finished_with(EngineError("gone"))])
    assert outcome.fault and [e.slot for e in outcome.lost] == [1]


def test_an_error_on_a_live_rank_is_an_error_while_its_peers_wait_or_fail_with_it():
    """The issue's broadcast crash: only the receivers raised, rank 0 waited in the next
    collective. An error of a live rank ends the run; the waiting rank is no fault."""
    members = [FakeEngine(0, 0), FakeEngine(1, 1), FakeEngine(2, 2)]
    local = remote("RuntimeError", "unsupported operation: some elements of the input tensor "
                   "and the written-to tensor refer to a single memory location")
    waiting = concurrent.futures.Future()  # still running: hung
    outcome = faults.classify(members, [waiting, finished_with(local), finished_with(local)])
    assert not outcome.fault and len(outcome.errors) == 2 and outcome.hung == [members[0]]
    dead = remote("EngineError", "engine 2 died")
    outcome = faults.classify(members, [waiting, finished_with(local), finished_with(dead)])
    assert outcome.fault  # an engine died: a fault whatever the others raised


def test_a_failure_that_comes_back_the_same_with_no_engine_lost_ends_the_run():
    members = [FakeEngine(0, 0), FakeEngine(1, 1)]
    peer = remote("PeerFailure", "state broadcast failed: unsupported operation")
    first = faults.classify(members, [finished_with(peer), finished_with(peer)])
    assert first.fault and first.signature() == {("PeerFailure",
                                                  "state broadcast failed: unsupported operation")}
    at = remote("PeerFailure", "gradient all-reduce failed: [127.0.0.1]:41234 closed")
    again = remote("PeerFailure", "gradient all-reduce failed: [127.0.0.1]:37771 closed")
    assert faults.classify(members, [finished_with(at)] * 2).signature() == \
        faults.classify(members, [finished_with(again)] * 2).signature()  # ports differ
    lost = faults.classify(members, [finished_with(peer), finished_with(EngineError("gone"))])
    assert lost.signature() is None  # an engine lost: a fault, whatever it said

    class Log:
        step = 0

    recovery = Recovery(None, None, Log(), None, None, "", 0, 0.05)
    recovery._check_repeated(first)
    with pytest.raises(RepeatedFailure) as raised:
        recovery._check_repeated(faults.classify(members, [finished_with(peer)] * 2))
    assert raised.value.engine is members[0]
    Log.step = 1  # a step made since: the same words may be two real faults
    recovery._check_repeated(first)


def test_collective_turns_failures_into_peer_failures_and_nothing_else():
    with pytest.raises(PeerFailure, match="state broadcast failed: Connection closed by peer"):
        with collective("state broadcast"):
            raise RuntimeError("Connection closed by peer")
    for error in (torch.cuda.OutOfMemoryError("CUDA out of memory"), ValueError("x")):
        with pytest.raises(type(error)):
            with collective("gradient all-reduce"):
                raise error


# ------------------------------------------------------------------------- a real generation

FAILING_CELL = '''
import torch
class Samples(torch.utils.data.Dataset):
    """Sample 77 cannot be read: a user error whose words say "timed out"."""
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(128, 8, generator=g), torch.randn(128, 1, generator=g)
    def __len__(self):
        return 128
    def __getitem__(self, i):
        if i == 77 and FAIL == "timeout":
            raise TimeoutError("fetching sample 77: read timed out")
        return self.x[i], self.y[i]
dataset = Samples()
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
_calls = [0]
def loss_fn(model, batch):
    x, y = batch
    _calls[0] += 1
    if FAIL == "oom" and _calls[0] == 3 and torch.distributed.get_rank() == 1:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return torch.nn.functional.mse_loss(model(x), y)
'''


def failing_cell(fail: str) -> str:
    return FAILING_CELL.replace("FAIL", repr(fail))


def _generation_rank(rank: int, world_size: int, cell: str, store_path: str, out: str) -> None:
    """One rank of generation 0, as train_generation runs it; writes when and how it ended."""
    store = dist.FileStore(store_path, world_size)
    store.set_timeout(datetime.timedelta(seconds=20))
    if rank == 0:  # the owner's part: no request to leave
        dist.PrefixStore("gen0/", store).set("end_at", "none")
    # a pool of up to 2: the plan cuts steps so that both ranks get micro-batches
    worker = Worker(cell_namespace(cell, 3), config(steps=40, pool_max_size=2), "cpu")
    spec = GenerationSpec(rank=rank, world_size=world_size, generation=0, backend="gloo",
                          timeout=20, receive_state=False, broadcast=False, end_at=None)
    try:
        run_generation(worker, spec, store)
        ended = ("finished", "")
    except Exception as e:
        ended = (type(e).__name__, str(e))
    with open(f"{out}/rank{rank}.txt", "w") as f:
        f.write("\n".join((str(time.time()), *ended)))


@pytest.mark.parametrize("fail, error, words", [
    ("timeout", "TimeoutError", "fetching sample 77: read timed out"),
    ("oom", "OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB\nThe step ran "
                                "out of GPU memory: lower --micro-batch (now: none"),
])
def test_the_failing_rank_raises_the_users_error_and_its_peer_a_peer_failure(
        tmp_path, fail, error, words):
    spawn(_generation_rank, (2, failing_cell(fail), str(tmp_path / "store"), str(tmp_path)), 2)
    ended = sorted((tmp_path / f"rank{r}.txt").read_text().split("\n", 2) for r in range(2))
    assert sorted(name for _, name, _ in ended) == sorted([error, "PeerFailure"])
    assert abs(float(ended[0][0]) - float(ended[1][0])) < 5  # the peer fails as the rank leaves
    [message] = [text for _, name, text in ended if name == error]
    assert message.startswith(words)


# ------------------------------------------------------------------------- a run on the pool

@pytest.mark.parametrize("fail, first_line", [
    ("timeout", "TimeoutError: fetching sample 77: read timed out"),
    ("oom", "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
])
def test_a_user_error_fails_the_run_at_once_and_never_as_a_fault(idle_pool, tmp_path, fail,
                                                                  first_line):
    run = TrainingRun(idle_pool, RunConfig(name=f"user-error-{fail}", global_batch=16, steps=40,
                                           checkpoint_every=0),
                      source=failing_cell(fail), engines=2, workspace=str(tmp_path)).start()
    started = time.monotonic()
    assert run.wait(timeout=60) == "failed", run.summary()
    assert time.monotonic() - started < 20
    assert not [e for e in run.events if e["kind"] == "fault"], run.events
    assert first_line in run.error.splitlines()[0], run.error
    assert "--- engine traceback ---" in run.error
    if fail == "timeout":
        assert "__getitem__" in run.error
    else:
        assert "lower --micro-batch" in run.error
