"""The owner's abort as a rank sees it (engine.group.abort), on a real TCPStore: forming a gloo
group with a peer that never comes ends when the owner sets ``abort``, not at the timeout; the nccl
watch calls the group's abort once the key is set, and never otherwise."""
import datetime
import multiprocessing
import threading
import time

import pytest
import torch.distributed as dist

from elastic_jupyter.engine.group.abort import AbortableStore, AbortWatch, GenerationAborted


def control(server):
    tcp = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                        timeout=datetime.timedelta(seconds=30))
    return dist.PrefixStore("gen0/", tcp)


def form_group(port: int, out) -> None:
    """Rank 0 of 2 forms a gloo group; rank 1 never comes. Puts (error type, seconds)."""
    tcp = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    gen = dist.PrefixStore("gen0/", tcp)
    started = time.monotonic()
    try:
        dist.init_process_group("gloo", store=AbortableStore(dist.PrefixStore("pg/", gen), gen, 30),
                                rank=0, world_size=2, timeout=datetime.timedelta(seconds=30))
        out.put(("formed", time.monotonic() - started))
    except Exception as e:  # noqa: BLE001 -- reported to the test
        out.put((str(e), time.monotonic() - started))


def test_forming_a_group_with_a_peer_that_never_comes_ends_at_the_owners_abort(store):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    rank0 = ctx.Process(target=form_group, args=(store.port, out))
    rank0.start()
    try:
        time.sleep(3)  # rank 0 waits for rank 1's address
        assert out.empty()
        dist.PrefixStore("gen0/", store).set("abort", "1")  # as Rendezvous.abort does
        message, took = out.get(timeout=10)
        assert "aborted the generation" in message and "a peer died" in message, message
        assert took < 3 + 2, took  # not the 30 s timeout
    finally:
        rank0.join(timeout=10)
        rank0.kill()


def test_a_wait_for_a_key_that_comes_returns_it_and_one_past_its_timeout_raises(store):
    gen = control(store)
    waiting = AbortableStore(dist.PrefixStore("pg/", gen), gen, timeout=0.3)
    threading.Timer(0.1, lambda: dist.PrefixStore("pg/", gen).set("k", "v")).start()
    assert waiting.get("k") == b"v"
    with pytest.raises(dist.DistStoreError):
        waiting.get("never")
    gen.set("abort", "1")
    with pytest.raises(GenerationAborted):
        waiting.wait(["never"])


def test_the_watch_aborts_once_the_key_is_set_and_never_otherwise(store):
    calls = []
    with AbortWatch(control(store), lambda: calls.append(time.monotonic())) as quiet:
        time.sleep(0.3)
    assert calls == [] and not quiet.fired
    gen = control(store)
    with AbortWatch(gen, lambda: calls.append(time.monotonic())) as watch:
        set_at = time.monotonic()
        dist.PrefixStore("gen0/", store).set("abort", "1")
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
    assert watch.fired and len(calls) == 1 and calls[0] - set_at < 1.0
