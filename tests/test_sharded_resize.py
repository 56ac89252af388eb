"""A sharded run resized in memory through real generations (engine.generation with
``shard=True``): 2 -> 3 ranks, a rank SIGKILLed, recovery at 2 from partner replicas, 1, 2
again; newcomers sent their rows, leavers handing theirs over before they go, the lost rank's
rows taken from its partner's copy. It ends equal to the run fixed at 2 ranks and to the
replicated mode's (float64).

The test plays the owner: it serves the rendezvous store (run/rendezvous.py), tells each
generation's ranks who they are, when to leave and who leaves, as run/driver.py does; each
engine is a process.
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from elastic_jupyter.engine.group.collective import PeerFailure
from elastic_jupyter.engine.generation import run_generation
from elastic_jupyter.engine.protocol import LEAVERS_KEY, GenerationSpec
from elastic_jupyter.engine.worker import Worker
from elastic_jupyter.run.rendezvous import Rendezvous
from test_sharded_step import CELL
from worlds import cell_namespace, config, train

STEPS = 10
# (engines by rank, leave after this step, ranks that leave then). Engine 2 is killed in
# generation 1's first forward pass (step 4). Generation 2 is the recovery: the survivors go
# back to step 3 (the replicas taken as generation 1 started); engine 1 comes back in
# generation 4 as a new engine (a fresh Worker from the cell), as a replacement does
SCHEDULE = [([0, 1], 3, ""), ([0, 1, 2], None, ""), ([0, 1], 6, "1"), ([0], 8, ""),
            ([0, 1], None, "")]
# Engines 2 and 1 (rank 1 and its partner) killed in generation 1 (at 3 ranks): engine 0 goes
# back to step 4 at 1 rank; engine 3 joins at the end
FALLBACK = [([0, 1], 5, ""), ([0, 1, 2], None, ""), ([0], 8, ""), ([0, 3], None, "")]


def _engine(engine: int, port: int, cfg: dict, out: str, schedule: list) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    worker, events = None, []
    for generation, (members, end_at, _) in enumerate(schedule):
        if engine not in members:
            worker = None  # it left: it holds nothing of the run any more
            continue
        newcomer = worker is None and (generation > 0 or members.index(engine) > 0)
        if worker is None:
            worker = Worker(cell_namespace(CELL, cfg["seed"]), cfg, "cpu", slot=engine)
        spec = GenerationSpec(rank=members.index(engine), world_size=len(members),
                              generation=generation, backend="gloo", timeout=60.0,
                              receive_state=newcomer, end_at=end_at,
                              broadcast=generation == 0 or not set(members) <= set(
                                  schedule[generation - 1][0]))
        try:
            result = run_generation(worker, spec, store)
        except PeerFailure:
            assert generation == 1  # the victims'
            continue
        assert result["reason"] == ("finished" if end_at is None else "left"), result
        events += result["events"]
    rows = {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in worker.model.named_parameters()}
    torch.save({"rank": schedule[-1][0].index(engine), "rows": rows,
                "history": worker.history.records, "events": events},
               f"{out}/engine{engine}.pt")
    sys.stderr.flush()
    os._exit(0)  # gloo's teardown sometimes aborts after the work is done (tests/worlds.spawn)


def _kill_when_it_holds(folder, processes, victims: list[int], phase: str) -> None:
    """SIGKILL the `victims` once the first of them holds at its armed fault point
    (engine.faultpoints)."""
    deadline = time.monotonic() + 120
    while not any(f.startswith(f"hit.{phase}.") for f in os.listdir(folder)):
        assert time.monotonic() < deadline and all(p.exitcode in (None, 0) for p in processes)
        time.sleep(0.05)
    for victim in victims:
        os.kill(processes[victim].pid, signal.SIGKILL)


def _run(tmp_path, schedule: list, victims: list[int], phase: str = "forward",
         **options) -> list[dict]:
    """Engines 0..N-1 through `schedule`, the `victims` killed in generation 1 (the first
    armed at `phase`, the first time it gets there); returns what the last generation's ranks
    hold."""
    faults, out = tmp_path / "faults", tmp_path / "out"
    faults.mkdir(), out.mkdir()
    (faults / f"arm.{phase}").write_text(str(victims[0]))
    cfg = config(micro_batch=4, shard=True, steps=STEPS, fault_dir=str(faults), **options)
    rendezvous = Rendezvous(timeout=60.0)  # the owner's store, as run/driver.py serves it
    for generation, (_, end_at, leavers) in enumerate(schedule):
        rendezvous.request_end(generation, end_at)
        rendezvous.control(generation).set(LEAVERS_KEY, leavers)
    spawn = multiprocessing.get_context("spawn")
    engines = max(e for members, _, _ in schedule for e in members) + 1
    processes = [spawn.Process(target=_engine, args=(e, rendezvous.port, cfg, str(out), schedule))
                 for e in range(engines)]
    for p in processes:
        p.start()
    _kill_when_it_holds(faults, processes, victims, phase)
    for p in processes:
        p.join(180)
    assert [p.exitcode for p in processes] == [
        -signal.SIGKILL if e in victims else 0 for e in range(engines)]
    return sorted((torch.load(f, weights_only=False) for f in out.glob("engine*.pt")),
                  key=lambda e: e["rank"])


def _equal_to_fixed_at_2(ends: list[dict], tmp_path, cfg: dict) -> None:
    params = {n: torch.cat([e["rows"][n] for e in ends]) for n in ends[0]["rows"]}
    expected = config(micro_batch=4, shard=True, steps=STEPS, **cfg)
    for what, options in (("fixed at 2", expected), ("replicated", dict(expected, shard=False))):
        fixed = train(CELL, options, 2, STEPS, tmp_path)[0]
        for k, value in fixed.params.items():
            assert torch.allclose(params[k], value, rtol=1e-9, atol=1e-12), (what, k)


def test_a_sharded_run_resized_with_a_fault_equals_the_run_fixed_at_2(tmp_path):
    ends = _run(tmp_path, SCHEDULE, [2], replica_every=4)
    # steps 1-3 at 2; step 4 at 3 lost with the victim; again from step 3 at 2, 1, 2
    assert [r["world_size"] for r in ends[0]["history"]] == [2] * 6 + [1] * 2 + [2] * 2
    _equal_to_fixed_at_2(ends, tmp_path, {})


@pytest.mark.parametrize("phase, kind", [("optimizer", "fallback"), ("forward", "rollback")])
def test_a_rank_lost_with_its_partner_goes_back_to_the_checkpoint(tmp_path, phase, kind):
    # killed once step 6 committed: the copies of the start at 3 ranks do not cover the lost
    # ranks, and those at 2 ranks were dropped then (engine 0 fails in the refresh after):
    # the checkpoint of step 4, written at 2 ranks, read at 1. Killed in step 6's first pass,
    # before any step committed at 3: engine 0 still holds the copies of step 4 at 2 ranks
    # (its own and rank 1's), kept until then, and goes back to them in memory
    ends = _run(tmp_path, FALLBACK, [2, 1], phase, replica_every=2, checkpoint_every=4,
                checkpoint_dir=str(tmp_path / "checkpoints"))
    assert [r["world_size"] for r in ends[0]["history"]] == [2] * 4 + [1] * 4 + [2] * 2
    back = [e for e in ends[0]["events"] if e["kind"] in ("fallback", "rollback")]
    assert [(e["kind"], e["step"]) for e in back] == [(kind, 4)], ends[0]["events"]
    if kind == "fallback":
        assert "rank(s) [1, 2] were lost with their partner's copy" in back[0]["message"]
    _equal_to_fixed_at_2(ends, tmp_path, {})
