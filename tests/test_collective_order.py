"""Both state modes issue the same collectives in the same order on every rank: whole
generations (engine.generation.run_generation: the vote, the state broadcast, the sharded
layout, replicas, evaluation, checkpoints due and not due) at world sizes 2 and 3, each rank's
process group wrapped by torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` checker, which fails a
collective whose kind, shapes or sequence number differ between ranks.

One case runs without the checker: a sharded start at world size 3. Its rows go from rank 0
to ranks 1 and 2 point to point (engine.sharded.reshard), two sends against one receive each, and
the checker counts point-to-point operations in its sequence numbers, so the next collective reads
as a mismatch ("Sequence number: 10vs 11") although every rank issues the same collectives
(it read the same at c2f1eda, before the state modes)."""
import datetime
import os

import pytest
import torch
import torch.distributed as dist

from elastic_jupyter.engine.generation import run_generation
from elastic_jupyter.engine.protocol import (END_AT_KEY, VERSION_KEY, GenerationSpec,
                                             encode_end_at, generation_prefix)
from elastic_jupyter.engine.worker import Worker
from test_sharded_step import CELL
from worlds import cell_namespace, config, spawn

EVALUATED = CELL + '''
eval_dataset = torch.utils.data.TensorDataset(x[:20], y[:20], rare[:20])
def metric_fn(model, batch):
    x, y, rare = batch
    return {"mse": torch.nn.functional.mse_loss(model(x, rare), y)}
'''
STEPS = 6  # checkpoints due at 3 and 6, not at the others; evaluations at 2, 4 and 6


def _generations(rank: int, world_size: int, folder: str, shard: bool, checked: bool) -> None:
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL" if checked else "OFF"
    dist.set_debug_level_from_env()  # torch reads it as it is imported: before this function
    store = dist.FileStore(os.path.join(folder, "store"), world_size)
    checkpoints = os.path.join(folder, "checkpoints")
    os.makedirs(checkpoints, exist_ok=True)  # (the run's claim makes it)
    cfg = dict(config(shard=shard, steps=STEPS, checkpoint_every=3, eval_every=2,
                      replica_every=2, micro_batch=4), checkpoint_dir=checkpoints)
    worker = Worker(cell_namespace(EVALUATED, cfg["seed"]), cfg, "cpu")
    if rank == 0:  # the owner's request, as run.rendezvous writes it: train to the end
        control = dist.PrefixStore(generation_prefix(0), store)
        control.set(END_AT_KEY, encode_end_at(None))
        control.add(VERSION_KEY, 1)
    spec = GenerationSpec(rank=rank, world_size=world_size, generation=0, backend="gloo",
                          timeout=60.0, broadcast=True, receive_state=rank > 0)
    result = run_generation(worker, spec, store)
    assert result["reason"] == "finished" and result["progress"]["step"] == STEPS
    if rank == 0:  # both checkpoints written (the last one before and after its evaluation,
        # replicated), none between, none failed
        kinds = {e["kind"] for e in result["events"]}
        written = {e["step"] for e in result["events"] if e["kind"] == "checkpoint"}
        assert written == {3, 6} and "checkpoint_failed" not in kinds, result["events"]
    if not checked:
        return
    # the checker is on: ranks whose collectives differ fail, naming the mismatch
    dist.init_process_group("gloo", store=dist.PrefixStore("planted/", store), rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=30))
    try:
        with pytest.raises(RuntimeError, match="Detected mismatch between collectives"):
            dist.all_reduce(torch.zeros(2 + rank))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("shard, world_size, checked", [
    (False, 2, True), (False, 3, True), (True, 2, True), (True, 3, False)],
    ids=["replicated-2", "replicated-3", "sharded-2", "sharded-3-unchecked"])
def test_both_modes_issue_the_same_collectives_on_every_rank(tmp_path, shard, world_size,
                                                              checked):
    spawn(_generations, (world_size, str(tmp_path), shard, checked), world_size)
