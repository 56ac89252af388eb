"""The barrier after local work (engine.group.work_barrier), on a real TCPStore: ranks wait for a
peer's work far past the collective timeout while it lives, fail fast when its process stops
or the owner aborts, and a rank's own error in its work stays its own."""
import datetime
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch.distributed as dist

from elastic_jupyter.engine.group.collective import PeerFailure
from elastic_jupyter.engine.group.work_barrier import work_then_wait

TIMEOUT = 1.0  # the collective timeout these waits get


def control(port: int):
    tcp = dist.TCPStore("127.0.0.1", port, is_master=False,
                        timeout=datetime.timedelta(seconds=30))
    return dist.PrefixStore("gen0/", tcp)


def in_thread(port: int, rank: int, work, out: dict, timeout=TIMEOUT) -> threading.Thread:
    def run():
        started = time.monotonic()
        try:
            work_then_wait(control(port), rank, 2, "the streams", work, timeout)
            out[rank] = ("done", time.monotonic() - started)
        except Exception as e:  # noqa: BLE001 -- reported to the test
            out[rank] = (e, time.monotonic() - started)
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_ranks_wait_for_a_peers_long_work_while_it_lives(store):
    out: dict = {}
    threads = [in_thread(store.port, 0, lambda: None, out),
               in_thread(store.port, 1, lambda: time.sleep(3 * TIMEOUT), out)]
    for thread in threads:
        thread.join(timeout=30)
    assert [out[r][0] for r in (0, 1)] == ["done", "done"], out
    assert out[0][1] >= 3 * TIMEOUT  # it waited the peer's whole work, past the timeout


def working_rank(port: int) -> None:
    work_then_wait(control(port), 1, 2, "the streams", lambda: time.sleep(60), TIMEOUT)


def test_a_peer_whose_process_stops_fails_the_wait_at_the_timeout(store):
    peer = multiprocessing.get_context("spawn").Process(target=working_rank, args=(store.port,))
    peer.start()
    out: dict = {}
    try:
        beats = dist.PrefixStore("gen0/", store)
        deadline = time.monotonic() + 60
        while not beats.check(["the streams/beat/1"]) and time.monotonic() < deadline:
            time.sleep(0.1)  # the spawned rank imports torch, then beats
        waiting = in_thread(store.port, 0, lambda: None, out)
        time.sleep(3 * TIMEOUT)
        assert not out, out  # it waits while the peer beats
        os.kill(peer.pid, signal.SIGSTOP)  # alive, but no longer beating
        stopped = time.monotonic()
        waiting.join(timeout=30)
        error, _ = out[0]
        assert isinstance(error, PeerFailure), error
        assert "rank 1 showed no sign of life for 1 s while it worked on the streams" in str(error)
        assert time.monotonic() - stopped < TIMEOUT + 2
    finally:
        peer.kill()
        peer.join(timeout=10)


def test_the_owners_abort_ends_the_wait_and_a_ranks_own_error_stays_its_own(store):
    out: dict = {}

    def broken():
        raise ValueError("the stream's file is gone")
    waiting = in_thread(store.port, 0, lambda: None, out, timeout=30)
    failing = in_thread(store.port, 1, broken, out, timeout=30)
    failing.join(timeout=30)
    assert isinstance(out[1][0], ValueError), out  # not a peer's failure: the rank's own
    time.sleep(0.2)
    dist.PrefixStore("gen0/", store).set("abort", "1")  # the owner saw rank 1 fail
    waiting.join(timeout=30)
    error, took = out[0]
    assert isinstance(error, PeerFailure) and "a peer died" in str(error), error
    assert took < 5  # the owner's abort, not the timeout


@pytest.fixture(autouse=True)
def _no_leftover_threads():
    yield
    assert not [t for t in threading.enumerate() if t.name == "elastic-work-beats"]
