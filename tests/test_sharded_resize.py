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
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from elastic_jupyter.engine.collective import PeerFailure
from elastic_jupyter.engine.generation import run_generation
from elastic_jupyter.engine.protocol import LEAVERS_KEY, GenerationSpec
from elastic_jupyter.engine.worker import Worker
from elastic_jupyter.run.rendezvous import Rendezvous
from test_sharded_step import CELL
from worlds import cell_namespace, config, train

STEPS = 10
VICTIM = 2  # killed in generation 1's first forward pass (step 4)
# (engines by rank, leave after this step, ranks that leave then). Generation 2 is the
# recovery: the survivors go back to step 3 (the replicas taken as generation 1 started);
# engine 1 comes back in generation 4 as a new engine (a fresh Worker from the cell)
SCHEDULE = [([0, 1], 3, ""), ([0, 1, 2], None, ""), ([0, 1], 6, "1"), ([0], 8, ""),
            ([0, 1], None, "")]


def _engine(engine: int, port: int, cfg: dict, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    worker = None
    for generation, (members, end_at, _) in enumerate(SCHEDULE):
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
                                  SCHEDULE[generation - 1][0]))
        try:
            result = run_generation(worker, spec, store)
        except PeerFailure:
            assert generation == 1  # the victim's
            continue
        assert result["reason"] == ("finished" if end_at is None else "left"), result
    rows = {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in worker.model.named_parameters()}
    torch.save({"rank": SCHEDULE[-1][0].index(engine), "rows": rows,
                "history": worker.history.records}, f"{out}/engine{engine}.pt")


def _kill_when_it_holds(folder, processes) -> None:
    """SIGKILL the victim once it holds at its armed fault point (engine.faultpoints)."""
    deadline = time.monotonic() + 120
    while not (hits := [f for f in os.listdir(folder) if f.startswith("hit.forward.")]):
        assert time.monotonic() < deadline and all(p.exitcode in (None, 0) for p in processes)
        time.sleep(0.05)
    with open(os.path.join(folder, hits[0])) as f:
        os.kill(int(f.read()), signal.SIGKILL)


def test_a_sharded_run_resized_with_a_fault_equals_the_run_fixed_at_2(tmp_path):
    faults, out = tmp_path / "faults", tmp_path / "out"
    faults.mkdir(), out.mkdir()
    (faults / "arm.forward").write_text(str(VICTIM))
    cfg = config(micro_batch=4, shard=True, steps=STEPS, replica_every=4, fault_dir=str(faults))
    rendezvous = Rendezvous(timeout=60.0)  # the owner's store, as run/driver.py serves it
    for generation, (_, end_at, leavers) in enumerate(SCHEDULE):
        rendezvous.request_end(generation, end_at)
        rendezvous.control(generation).set(LEAVERS_KEY, leavers)
    spawn = multiprocessing.get_context("spawn")
    processes = [spawn.Process(target=_engine, args=(e, rendezvous.port, cfg, str(out)))
                 for e in range(3)]
    for p in processes:
        p.start()
    _kill_when_it_holds(faults, processes)
    for p in processes:
        p.join(180)
    assert [p.exitcode for p in processes] == [0, 0, -signal.SIGKILL]
    ends = sorted((torch.load(f, weights_only=False) for f in out.glob("engine*.pt")),
                  key=lambda e: e["rank"])
    params = {n: torch.cat([e["rows"][n] for e in ends]) for n in ends[0]["rows"]}
    # steps 1-3 at 2; step 4 at 3 lost with the victim; again from step 3 at 2, 1, 2
    assert [r["world_size"] for r in ends[0]["history"]] == [2] * 6 + [1] * 2 + [2] * 2
    expected = dict(cfg, fault_dir=None)
    for what, options in (("fixed at 2", expected), ("replicated", dict(expected, shard=False))):
        fixed = train(CELL, options, 2, STEPS, tmp_path)[0]
        for k, value in fixed.params.items():
            assert torch.allclose(params[k], value, rtol=1e-9, atol=1e-12), (what, k)
