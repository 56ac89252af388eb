"""A sharded checkpoint (issue 36): two ranks each write their part of an FSDP2-sharded float64
model and its AdamW state; three new processes read it back at 3 ranks (each reading only the
parts that hold its rows, weights_only), train on, and end where a run fixed at 2 ends (rtol
1e-9); written whole to one torch.save file a tensor at a time, it is the model that wrote
it. A damaged part is refused naming the file; an unfinished folder is never read. Rank 0
commits a checkpoint once every rank's marker is there, and says which did not come; an errored
run's final state is the newest folder of a step its log holds, with that step's loss."""
import os
import shutil
import threading

import pytest
import torch
import torch.distributed as dist
from test_sharding import build, fixed_at_2, sharded_cell, train_step, whole
from torch.distributed.device_mesh import init_device_mesh
from worlds import spawn

from elastic_jupyter.config import UsageError
from elastic_jupyter.engine.sharded.checkpoint_parts import (commit, latest, load_whole,
                                                             model_layout, read_model, read_rows,
                                                             stamp, write_part)
from elastic_jupyter.engine.sharded.part_writer import PartWriter
from elastic_jupyter.engine.sharded.replicas import HostBuffers, PartnerReplicas
from elastic_jupyter.engine.sharded.resizable_model import ShardedModel, Snapshot
from elastic_jupyter.engine.state.checkpoint import CheckpointError
from elastic_jupyter.run.final_state import ShardedFinalState
from elastic_jupyter.run.results import RunResults
from elastic_jupyter.run.runlog import RunLog
from elastic_jupyter.run.streamed_export import write_streamed


def _write(rank: int, folder: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store-w", 2), rank=rank,
                            world_size=2)
    try:
        sharded, optimizer = sharded_cell(2)
        for step in range(3):
            train_step(sharded.module, optimizer, step, rank, 2)
        part = sharded.snapshot(optimizer)
        written = whole(sharded.module)
        write_part(f"{folder}/ckpt", 3, 7, part, rank, 2)  # attempt 7: the generation
        if rank == 0:
            torch.save(written, f"{folder}/written.pt")
            commit(f"{folder}/ckpt", 3, 7, 2, part, sharded.shapes, None, threading.Event(), 60)
    finally:
        dist.destroy_process_group()


def _read(rank: int, folder: str, world_size: int, steps: int) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store-r{world_size}",
                                                         world_size),
                            rank=rank, world_size=world_size)
    try:
        cell = build()
        optimizer = torch.optim.AdamW(cell.parameters(), lr=0.01)
        sharded = ShardedModel(cell)
        path = latest(f"{folder}/ckpt")
        parts, replicated, buffers = read_rows(path, rank, world_size)
        sharded.load(init_device_mesh("cpu", (world_size,)), optimizer, torch.device("cpu"),
                     parts, replicated, buffers)
        for step in range(3, steps):
            train_step(sharded.module, optimizer, step, rank, world_size)
        result = whole(sharded.module)
        if rank == 0:
            torch.save(result, f"{folder}/read{world_size}.pt")
    finally:
        dist.destroy_process_group()


def test_written_at_2_read_at_3_and_trained_on_equals_fixed_at_2(tmp_path):
    (tmp_path / "ckpt").mkdir()
    spawn(_write, (str(tmp_path),), 2)
    os.makedirs(tmp_path / "ckpt" / "step-00000009.shards.tmp")  # a crash's leftover
    assert latest(str(tmp_path / "ckpt")).endswith("step-00000003.shards")
    spawn(_read, (str(tmp_path), 3, 6), 3)
    spawn(fixed_at_2, (str(tmp_path), 6), 2)
    fixed = torch.load(tmp_path / "fixed.pt", weights_only=True)
    read = torch.load(tmp_path / "read3.pt", weights_only=True)
    for key, want in fixed.items():
        assert torch.allclose(read[key], want, rtol=1e-9, atol=0), key
    # the model written whole to one torch.save file, a tensor at a time (run.export()):
    # equal to the gathered model that wrote it; a tensor that does not fit leaves no file
    path = latest(str(tmp_path / "ckpt"))
    exported = torch.load(write_streamed(str(tmp_path / "model.pt"), model_layout(path),
                                         read_model(path, copy=False)), weights_only=True)
    written = torch.load(tmp_path / "written.pt", weights_only=True)
    assert exported.keys() == load_whole(path)["model"].keys()
    assert written.keys() - exported.keys() == {"0.0.0.weight"}  # frozen: each rank's own
    for key, got in exported.items():
        assert torch.equal(got, written[key]), key
    wrong = [(k, t[:1] if t.dim() else t) for k, t in read_model(path)]
    with pytest.raises(ValueError, match="the file laid out"):
        write_streamed(str(tmp_path / "bad.pt"), model_layout(path), iter(wrong))
    with pytest.raises(ValueError, match="no tensor came for"):
        write_streamed(str(tmp_path / "bad.pt"), model_layout(path), iter([]))
    assert not [f for f in os.listdir(tmp_path) if f.startswith("bad.pt")]
    # a damaged part is refused, naming it; reading at 1 rank needs both parts
    with open(os.path.join(path, "part-00001.pt"), "r+b") as f:
        f.seek(100)
        f.write(b"\0" * 8)
    with pytest.raises(CheckpointError, match="part-00001.pt is missing or damaged"):
        read_rows(path, 0, 1)
    read_rows(path, 0, 2)  # rank 0 at 2 ranks reads its own part only


def test_a_tied_parameter_is_one_tensor_under_each_of_its_names(tmp_path):
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    assert ShardedModel(model).aliases == {"1.weight": "0.weight"}
    weight = torch.randn(5, 3)
    path = write_streamed(str(tmp_path / "tied.pt"), {"0.weight": ((5, 3), torch.float32),
                                                      "1.weight": "0.weight"},
                          [("0.weight", weight)])
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["1.weight"], weight)
    assert loaded["1.weight"].data_ptr() == loaded["0.weight"].data_ptr()


def test_a_sharded_final_model_loads_a_tensor_at_a_time_into_a_model_that_fits(tmp_path):
    # a tied model's checkpoint as one rank writes it; the run ended with it as its final state
    tied = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    tied[1].weight = tied[0].weight
    sharded, folder = ShardedModel(tied), str(tmp_path / "ckpt")
    part = sharded.snapshot(None)
    write_part(folder, 4, 1, part, 0, 1)
    commit(folder, 4, 1, 1, part, sharded.shapes, {"progress": {"step": 4}}, threading.Event(),
           60, sharded.aliases)
    log = RunLog(str(tmp_path / "logs"))
    final = ShardedFinalState(None, log, folder, keep=3)  # type: ignore[arg-type]
    final.state, final.folder = {"progress": {"step": 4}}, latest(folder)
    final.stamp = stamp(final.folder)
    results = RunResults("r", folder, str(tmp_path / "logs"), log, final)
    untied = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    results.load_into(untied)  # each of the tied parameter's names
    assert torch.equal(untied[0].weight, tied[0].weight)
    assert torch.equal(untied[1].weight, tied[0].weight)
    wider = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False))
    before = wider.state_dict()["1.weight"].clone()
    with pytest.raises(UsageError, match=r"its '0.weight' is \(5, 4\), the run's \(5, 3\)"):
        results.load_into(wider)
    assert torch.equal(wider.state_dict()["1.weight"], before)  # nothing loaded
    shutil.rmtree(final.folder)  # a later run in the same folder pruned it
    with pytest.raises(UsageError, match="pruned or replaced since"):
        results.export(str(tmp_path / "model.pt"))


def _tiny(rank: int) -> Snapshot:
    return Snapshot({("w", None): torch.full((2, 3), float(rank))}, {"w": {}}, {})


def test_a_commit_waits_for_every_part_and_says_which_did_not_come(tmp_path):
    folder, shapes = str(tmp_path), {"w": torch.Size([4, 3])}
    os.makedirs(tmp_path / "step-00000002.shards.4.tmp")  # a fault's leftover, older
    write_part(folder, 5, 6, _tiny(0), 0, 2)
    with pytest.raises(CheckpointError, match="part-00001.done did not come within 0 s"):
        commit(folder, 5, 6, 2, _tiny(0), shapes, None, threading.Event(), 0.2)
    aborted = threading.Event()
    aborted.set()  # the generation ended in a fault
    with pytest.raises(CheckpointError, match="the generation ended first"):
        commit(folder, 5, 6, 2, _tiny(0), shapes, None, aborted, 60)
    assert latest(folder) is None  # never half a checkpoint
    os.makedirs(tmp_path / "step-00000005.shards.6.tmp" / "part-00001.pt")  # cannot be written
    with pytest.raises(CheckpointError, match="part-00001.pt not written"):
        write_part(folder, 5, 6, _tiny(1), 1, 2)
    with pytest.raises(CheckpointError, match="part-00001.pt"):
        commit(folder, 5, 6, 2, _tiny(0), shapes, None, threading.Event(), 60)
    os.rmdir(tmp_path / "step-00000005.shards.6.tmp" / "part-00001.pt")
    write_part(folder, 5, 6, _tiny(1), 1, 2)  # written again: its marker says so
    path = commit(folder, 5, 6, 2, _tiny(0), shapes, {"note": 1}, threading.Event(), 60)
    assert sorted(os.listdir(path)) == ["manifest.pt", "part-00000.pt", "part-00001.pt"]
    assert sorted(os.listdir(folder)) == ["step-00000005.shards"]  # the leftover went
    parts, _, _ = read_rows(path, 0, 1)
    assert torch.equal(parts[("w", None)], torch.tensor([[0.0] * 3] * 2 + [[1.0] * 3] * 2))


def _checkpoint(folder: str, step: int, loss: float) -> None:
    write_part(folder, step, 1, _tiny(0), 0, 1)
    commit(folder, step, 1, 1, _tiny(0), {"w": torch.Size([2, 3])},
           {"history": [{"step": step, "loss": loss}]}, threading.Event(), 60)


def test_the_final_state_is_the_newest_checkpoint_whose_step_the_run_log_holds(tmp_path):
    folder = str(tmp_path / "ckpt")
    log = RunLog(str(tmp_path / "logs"))
    log.merge({"records": [{"step": s, "loss": 1.0 / s} for s in range(1, 8)]})
    _checkpoint(folder, 5, 1.0 / 5)  # this run's
    _checkpoint(folder, 6, 9.0)  # another training's step 6 (another loss)
    _checkpoint(folder, 9, 1.0 / 9)  # a step the run has not reached (a timeline left)
    final = ShardedFinalState(None, log, folder, keep=3)  # type: ignore[arg-type]
    assert final._newest_sharded() == (5, os.path.join(folder, "step-00000005.shards"))


def test_a_write_in_progress_says_which_copies_it_reads():
    writer, release = PartWriter(), threading.Event()
    copies = _tiny(0)
    writer.submit(3, lambda abort: release.wait() and None, reads=copies)  # not rank 0
    assert writer.reads(copies) and not writer.reads(_tiny(0)) and not writer.reads(None)
    release.set()
    writer.wait()
    assert not writer.reads(copies) and writer.saved_step == 3 and writer.take_events() == []


def test_kept_host_buffers_of_another_layout_go_before_a_new_one_is_made():
    spare, replicas = HostBuffers(), PartnerReplicas()
    replicas.buffers = [torch.empty(10), torch.empty(6)]
    spare.keep(replicas)
    assert spare.nbytes == 64 and spare.take(6, torch.float32, False).numel() == 6
    assert spare.take(7, torch.float32, False).numel() == 7 and spare.nbytes == 0
