"""Streaming data on a real cluster: an iterable dataset split into streams
(engine.data.stream_split) trains each sample once per epoch across a resize and a SIGKILL, and to
the parameters of the undisturbed run.

The data: scikit-learn's digits, written by the test as four JSON-lines shard files and read
by ``datasets`` streaming (with ``state_dict``) and by a plain IterableDataset over the files
(without: it resumes by reading again). Both split their files alike, so both give the
undisturbed run's samples.
"""
import collections
import copy
import functools
import glob
import json
import random
import re

import pytest
import torch
from hypothesis import given, settings, strategies as st
from sklearn.datasets import load_digits
from test_faults import kill_in_phase, wait_for

from elastic_jupyter import RunConfig, TrainingRun
from elastic_jupyter.engine.state import checkpoint as ckpt
from elastic_jupyter.engine.data.batching import BatchPlan, Cut
from elastic_jupyter.engine.state.training_state import Progress
from elastic_jupyter.engine.data.stream_pipeline import StreamPipeline
from elastic_jupyter.engine.data.stream_split import Streams
from elastic_jupyter.pool.processes import alive

SHARDS, PER_SHARD, BATCH, EPOCHS = 4, 120, 32, 2  # 15 steps an epoch

COMMON = '''
import json, os, time
import torch
log = open(f"{LOG_PREFIX}-{os.getpid()}.txt", "a", buffering=1)
model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10)).double()
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
dataset_length = SAMPLES
def loss_fn(model, batch):
    # the micro-batch's first random draw names it: the same on whichever rank runs it
    key = int(torch.randint(0, 2**62, ()))
    time.sleep(PAUSE)
    log.write(json.dumps([key, batch["id"].tolist()]) + "\\n")
    return torch.nn.functional.cross_entropy(model(batch["x"].double()), batch["y"])
'''
DATASETS_CELL = '''
import os
os.environ["HF_DATASETS_OFFLINE"] = "1"  # local files only
import datasets
dataset = datasets.load_dataset("json", data_files=SHARD_FILES, streaming=True,
                                split="train").with_format("torch")
''' + COMMON
PLAIN_CELL = '''
import json
import time
import torch

class ShardFiles(torch.utils.data.IterableDataset):
    """The samples of JSON-lines files, in order; shard(n, i) is the i-th of n contiguous
    blocks of files, as datasets splits them."""
    def __init__(self, files):
        self.files = list(files)
    def shard(self, num_shards, index):
        base, extra = divmod(len(self.files), num_shards)
        start = index * base + min(index, extra)
        return ShardFiles(self.files[start:start + base + (index < extra)])
    def __iter__(self):
        for path in self.files:
            with open(path) as f:
                for line in f:
                    time.sleep(SLOW_READ if path == SLOW_FILE else 0.0)
                    row = json.loads(line)
                    yield {"id": row["id"], "x": torch.tensor(row["x"], dtype=torch.float64),
                           "y": row["y"]}

dataset = ShardFiles(SHARD_FILES)
''' + COMMON
CELLS = {"datasets": DATASETS_CELL, "plain": PLAIN_CELL}


@pytest.fixture(scope="module")
def shard_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shards")
    X, y = load_digits(return_X_y=True)
    files = []
    for s in range(SHARDS):
        path = folder / f"part-{s:02d}.jsonl"
        with open(path, "w") as f:
            for i in range(s * PER_SHARD, (s + 1) * PER_SHARD):
                f.write(json.dumps({"id": i, "x": (X[i] / 16).tolist(), "y": int(y[i])}) + "\n")
        files.append(str(path))
    return files


def start(pool, kind, files, tmp_path, name, engines=2, samples=SHARDS * PER_SHARD,
          schedule=None, resume=False, pause=0.0, epochs=EPOCHS, slow_read=0.0, **options):
    fault_dir = tmp_path / "faults"
    fault_dir.mkdir(exist_ok=True)
    config = RunConfig(name=name, global_batch=BATCH, epochs=epochs, seed=11, pass_cost=0.0,
                       collective_timeout=5, fault_dir=str(fault_dir), **options)
    push = {"SHARD_FILES": files, "SAMPLES": samples, "LOG_PREFIX": str(tmp_path / "ids"),
            "PAUSE": pause, "SLOW_READ": slow_read, "SLOW_FILE": files[0]}
    return TrainingRun(pool, config, source=CELLS[kind], push=push, engines=engines,
                       schedule=schedule, workspace=str(tmp_path), resume=resume).start()


def micro_batches(tmp_path) -> dict:
    """{key: sample ids} of every micro-batch any engine ran, checked to be the same
    whichever engine ran it (a step a fault interrupted runs again)."""
    seen: dict = {}
    for path in glob.glob(str(tmp_path / "ids-*.txt")):
        for line in open(path):
            key, ids = json.loads(line)
            assert seen.setdefault(key, ids) == ids, (key, ids, seen[key])
    return seen


@pytest.fixture(scope="module")
def undisturbed(pool, shard_files, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("undisturbed")
    run = start(pool, "datasets", shard_files, tmp, "stream-whole", checkpoint_every=0)
    assert run.wait(timeout=240) == "finished", run.logs()
    return run.state_dict(), micro_batches(tmp)


@pytest.mark.parametrize("kind", ["datasets", "plain"])
def test_a_stream_resized_and_killed_mid_epoch_trains_each_sample_once(
        idle_pool, shard_files, tmp_path, undisturbed, kind):
    expected, clean_batches = undisturbed
    # a grow after step 5 (mid-epoch 0), a SIGKILL of rank 1 in epoch 1; loader processes
    # read the streams ahead
    run = start(idle_pool, kind, shard_files, tmp_path, f"stream-{kind}", schedule=[(5, 3)],
                loader_processes=2, checkpoint_every=4)
    victim = run.members[1]
    kill_in_phase(run, "forward", victim.slot, after_step=19)
    wait_for(lambda: not alive(victim), timeout=10, what="the kill")
    assert run.wait(timeout=240) == "finished", run.logs()
    assert [r["step"] for r in run.history] == list(range(1, EPOCHS * 15 + 1))
    assert [e["lost_slots"] for e in run.events if e["kind"] == "fault"] == [[victim.slot]]

    got = run.state_dict()
    for k in expected:  # float64: the same sums in the same order
        assert torch.allclose(got[k], expected[k], rtol=1e-9, atol=0), k
    batches = micro_batches(tmp_path)
    assert batches == clean_batches  # each micro-batch the undisturbed run's, by its key
    counts = collections.Counter(i for ids in batches.values() for i in ids)
    assert counts == {i: EPOCHS for i in range(SHARDS * PER_SHARD)}

    opened = [e for e in run.events if e["kind"] == "streams"]
    assert len(opened) >= 2, run.events  # the grow's generation, the one after the fault
    grow = opened[0]
    assert grow["step"] == 5 and grow["streams"] == SHARDS
    if kind == "datasets":  # every stream resumes from the state its reader reached
        assert grow["resumed"] == list(range(SHARDS)) and grow["reread"] == [0] * SHARDS, grow
    else:  # read again: 5 steps of 8 samples from each stream
        assert grow["resumed"] == [] and grow["reread"] == [40] * SHARDS, grow


def test_a_long_reread_positions_the_streams_before_the_first_collective(
        idle_pool, shard_files, tmp_path, undisturbed):
    _, clean_batches = undisturbed
    # stream 0 reads a sample in 60 ms: after the grow at step 12 its rank reads its 96
    # samples again (5.8 s), longer than the collective timeout (5 s) the others would wait
    run = start(idle_pool, "plain", shard_files, tmp_path, "stream-reread", epochs=1,
                schedule=[(12, 3)], checkpoint_every=0, slow_read=0.06, loader_processes=2)
    assert run.wait(timeout=180) == "finished", run.logs()
    assert not [e for e in run.events if e["kind"] == "fault"], run.events
    grow = [e for e in run.events if e["kind"] == "streams"][0]
    assert grow["step"] == 12 and grow["reread"] == [96] * SHARDS, grow
    batches = micro_batches(tmp_path)
    assert all(clean_batches[key] == ids for key, ids in batches.items())
    assert sorted(i for ids in batches.values() for i in ids) == list(range(SHARDS * PER_SHARD))


def test_a_stream_shorter_than_declared_fails_at_its_step_and_keeps_the_checkpoints(
        idle_pool, shard_files, tmp_path):
    # 512 declared, 480 written: each of the 4 streams gives 120 of the 128 an epoch takes
    run = start(idle_pool, "plain", shard_files, tmp_path, "stream-short", samples=512,
                checkpoint_every=4)
    assert run.wait(timeout=120) == "failed"
    assert re.search(r"stream (\d) \(dataset.shard\(num_shards=4, index=\1\)\) ended after 120 "
                     r"samples in epoch 0, but the declared length 512 takes 128 samples from "
                     r"it each epoch", run.error), run.error
    # 16 steps an epoch: the 16th reads past the streams' ends. The checkpoints stay, and the
    # run's final state is written as one (step 15)
    assert run.step == 15 and [c["step"] for c in run.checkpoints][-2:] == [12, 15]
    for written in run.checkpoints:
        assert ckpt.load_checkpoint(written["path"])["progress"]["step"] == written["step"]
    assert idle_pool.run is None


def _objects(source: str, **options):
    from elastic_jupyter.engine.step.objects import CellObjects
    from elastic_jupyter.config import RunConfig
    from worlds import cell_namespace
    from elastic_jupyter.engine.modes.factory import state_mode
    config = RunConfig.from_dict({"name": "streams", "global_batch": 8, "pool_max_size": 4,
                                  **options})
    cell = CellObjects.of(cell_namespace(source, 0), config)
    state_mode(config).check(cell, torch.device("cpu"))  # what --shard refuses
    return cell


BARE_ITERABLE = '''
import torch
class Lines(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from (torch.zeros(2) for _ in range(100))
dataset = Lines()
model = torch.nn.Linear(2, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
def loss_fn(model, batch):
    return model(batch).sum()
'''
SHARDED_ITERABLE = BARE_ITERABLE.replace("class Lines(torch.utils.data.IterableDataset):", '''
class Lines(torch.utils.data.IterableDataset):
    def shard(self, num_shards, index):
        return self''')


@pytest.mark.parametrize("source, options, message", [
    (BARE_ITERABLE, {"steps": 10}, "dataset is an iterable Lines without a shard protocol: a "
     "run reads an iterable dataset as disjoint streams, stream i of n being "
     "dataset.shard(num_shards=n, index=i)"),
    (SHARDED_ITERABLE, {"epochs": 2}, "dataset is an iterable Lines of unknown length: give "
     "--steps N, or declare dataset_length = the samples of one epoch in the cell"),
    (SHARDED_ITERABLE + "dataset_length = 2.5\n", {}, "dataset_length must be a positive "
     "integer (the samples of one epoch), got 2.5"),
    (SHARDED_ITERABLE, {"steps": 10, "shard": True}, "--shard does not read iterable "
     "datasets yet"),
    (SHARDED_ITERABLE + "eval_dataset = dataset\nmetric_fn = loss_fn\n", {"steps": 10},
     "eval_dataset must be map-style"),
])
def test_an_iterable_dataset_that_cannot_stream_is_refused_at_setup(source, options, message):
    from elastic_jupyter.engine.step.objects import SetupError
    with pytest.raises(SetupError) as excinfo:
        _objects(source, **options)
    assert message in str(excinfo.value), str(excinfo.value)


def test_a_stopped_stream_resumes_from_its_checkpoint_exactly(
        idle_pool, shard_files, tmp_path, undisturbed):
    expected, _ = undisturbed
    first = start(idle_pool, "datasets", shard_files, tmp_path, "stream-resume",
                  checkpoint_every=5, pause=0.02)  # slow enough to stop mid-run
    wait_for(lambda: first.step >= 18, timeout=120, what="step 18")
    first.stop()
    assert first.wait(timeout=60) == "stopped"
    stopped_at = first.step
    assert 18 <= stopped_at < EPOCHS * 15 and first.checkpoints[-1]["step"] == stopped_at
    second = start(idle_pool, "datasets", shard_files, tmp_path, "stream-resume", engines=3,
                   resume=True, checkpoint_every=5)
    assert second.wait(timeout=240) == "finished", second.logs()
    got = second.state_dict()
    for k in expected:
        assert torch.allclose(got[k], expected[k], rtol=1e-9, atol=0), k
    opened = [e for e in second.events if e["kind"] == "streams"][0]
    # every stream's state was in the checkpoint: nothing is read again
    assert opened["step"] == stopped_at and opened["resumed"] == list(range(SHARDS)), opened
    assert opened["reread"] == [0] * SHARDS, opened


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(1, 9), st.integers(1, 300), st.booleans())
def test_an_epoch_reads_each_stream_in_order_once(batch, count, length, drop_last):
    """The epoch's samples map one to one onto each stream's first ``needs`` offsets, each
    stream read forwards, the streams' counts within one of each other (equal shards end
    together, whatever divides what); a step's share of a stream ends where ``step_end``
    says."""
    streams = Streams(None, count, max(length, batch), batch, drop_last)
    n = len(streams)
    read = n - n % batch if drop_last else n
    at = [0] * count
    for index in range(read):
        stream, offset = streams.locate(index)
        assert offset == at[stream]  # the next of its stream: read forwards, none skipped
        assert streams.index(stream, offset) == index
        at[stream] += 1
        if index % batch == batch - 1 or index == read - 1:  # the step's last sample
            start = index - index % batch
            assert [streams.step_end(s, start) for s in range(count)] == at
    assert at == [streams.needs(s) for s in range(count)]
    assert max(at) - min(at) <= 1


class Numbers(torch.utils.data.IterableDataset):
    """Numbers start..end-1, each plus a random fraction below 1/2 (a random transform),
    written by torch's documented pattern (``__iter__`` returns an iterator and splits itself
    over a DataLoader's processes); with `state`, a hand-written state_dict() that returns its
    live dict."""

    def __init__(self, start=0, end=100, state=False):
        self.start, self.end, self.stateful, self.pos = start, end, state, {"pos": 0}
        if state:
            self.state_dict = lambda: self.pos
            self.load_state_dict = lambda s: self.pos.update(s)

    def shard(self, num_shards, index):
        per = (self.end - self.start) // num_shards
        return Numbers(self.start + index * per, self.start + (index + 1) * per, self.stateful)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start = self.start + self.pos["pos"]
        if info is not None:  # torch's pattern: each loader process takes a part
            per = -(-(self.end - start) // info.num_workers)
            start += info.id * per
            return iter(range(start, min(start + per, self.end)))
        return self._counting(start)

    def _counting(self, start):
        for i in range(start, self.end):
            self.pos["pos"] += 1
            READS[PHASE[0]] += 1
            yield i + float(torch.rand(())) / 2  # a random transform: the sample's own draw


READS: collections.Counter = collections.Counter()  # samples Numbers gave, by PHASE[0]
PHASE = ["step"]  # "position" while the pipelines stand in place, else "step"


def _simulate(sizes, workers, stateful, total=17, n=100, batch=14, count=4, inside=None,
              cut=None):
    """Train-free run of `total` steps: per generation (until step, world size), a
    StreamPipeline per rank from the shared progress, its passes' batches by (step, k); the
    ranks' stream states merged at each generation's end, as share() does. Each step is
    positioned first, as engine.generation does (where ``opens`` says so or at a generation's
    first, that is where a stream may be read again); with `inside` (no loader processes),
    ``inside[(step, rank)]`` counts the samples the rank's streams gave in the rest of the
    step beyond its own."""
    out, progress, epoch, position = {}, Progress(), 0, 0
    for until, world_size in sizes:
        ranks = []
        for rank in range(world_size):
            streams = Streams(Numbers(0, n, stateful), count, n, batch)
            streams.check()
            plan = BatchPlan(n, batch, 0, cut or Cut(virtual=count, max_size=count),
                             shuffle=False)
            mine = copy.deepcopy(progress)
            ranks.append((plan, StreamPipeline(streams, plan, 0, workers, list, None, False,
                                               lambda mine=mine: mine), mine))
        first = True
        while progress.step < until:
            opens = {pipe.opens(epoch, position, world_size) for _, pipe, _ in ranks}
            assert len(opens) == 1  # every rank's answer alike
            for rank, (plan, pipe, mine) in enumerate(ranks):
                passes = functools.partial(plan.rank_micro_batches, rank=rank,
                                           world_size=world_size)
                PHASE[0] = "position" if first or opens == {True} else "step"
                before = READS["step"]
                pipe.position((rank, world_size, epoch, position), passes, total - progress.step)
                PHASE[0], own = "step", 0
                for k, chunk in passes(plan.batch(epoch, position)):
                    out[(progress.step, k)] = pipe.next((rank, world_size, epoch, position),
                                                        passes, total - progress.step)
                    own += len(chunk)
                if inside is not None:
                    inside[(progress.step, rank)] = READS["step"] - before - own
            first = False
            epoch, position = ranks[0][0].advance(epoch, position)
            progress.step += 1
            for rank, (plan, pipe, mine) in enumerate(ranks):
                mine.step, mine.epoch, mine.position = progress.step, epoch, position
                pipe.moved_to((rank, world_size, epoch, position))
        merged = {}
        for _, pipe, mine in ranks:
            pipe.stop()
            for stream, state in (mine.streams or {"states": {}})["states"].items():
                if stream not in merged or state["offset"] > merged[stream]["offset"]:
                    merged[stream] = state
        progress = copy.deepcopy(ranks[0][2])
        progress.streams["states"] = merged
    return out


@pytest.mark.parametrize("stateful", [False, True], ids=["re-read", "live state_dict"])
def test_stream_pipelines_read_alike_at_any_world_size_and_number_of_loader_processes(
        stateful):
    """A global batch of 14 over 4 streams (shares of 3 and 4, an epoch's last step of 2),
    resized 2 -> 3 -> 1 -> 4, with 0 and 2 loader processes: the batches of a run at one rank,
    and every number once per epoch."""
    expected = _simulate([(17, 1)], 0, stateful)
    ids = sorted(int(i) for (step, _), b in expected.items() if step < 8 for i in b)
    assert ids == list(range(100))  # 8 steps an epoch (7 of 14, one of 2)
    for workers in (0, 2):
        assert _simulate([(3, 2), (7, 3), (11, 1), (17, 4)], workers, stateful) == expected


@pytest.mark.parametrize("n, batch, count, cut", [
    (160, 14, 4, None),  # shares of 3 and 4 that move between ranks; a last step of 6
    (82, 16, 2, Cut(virtual=4, max_size=4)),  # a last step of 2: a rank without a pass
    (88, 3, 4, Cut(virtual=1, max_size=1)),  # B < S: each step skips a stream
])
def test_a_rank_opens_streams_mid_epoch_only_before_a_step(n, batch, count, cut):
    """Streams that move between ranks are opened, and read again from their epoch's start,
    only where the ranks stand their input in place together before a step (``opens``);
    elsewhere a rank reads beyond its own samples only what other ranks took from a stream it
    holds since its last read of it, less than a global batch."""
    inside: dict = {}
    total = 40
    expected = _simulate([(total, 1)], 0, False, total, n, batch, count, cut=cut)
    resized = _simulate([(5, 2), (13, 3), (26, 2), (total, 3)], 0, False, total, n, batch,
                        count, inside=inside, cut=cut)
    assert resized == expected
    assert max(inside.values()) < batch, sorted(inside.items(), key=lambda kv: -kv[1])[:5]


def test_a_generation_with_no_step_left_positions_nothing():
    """A generation that only finishes the final evaluation (a fault hit it) stands its input
    in place for no step: nothing is read, nothing waits for a reading process."""
    streams = Streams(Numbers(0, 64), 4, 64, 16)
    streams.check()
    plan = BatchPlan(64, 16, 0, Cut(virtual=4, max_size=4), shuffle=False)
    progress = Progress()
    progress.step, progress.epoch = 4, 1
    pipe = StreamPipeline(streams, plan, 0, 0, list, None, False, lambda: progress)
    passes = functools.partial(plan.rank_micro_batches, rank=0, world_size=2)
    READS.clear()
    pipe.position((0, 2, 1, 0), passes, 0)
    assert not READS


def test_a_datasets_stream_with_a_shuffle_buffer_is_read_again_not_resumed(shard_files):
    """datasets does not save a shuffle buffer in its state: the setup's trial finds that the
    stream does not resume where its state was taken, so it is re-read instead."""
    import datasets  # pylint: disable=import-outside-toplevel
    plain = datasets.load_dataset("json", data_files=shard_files, streaming=True,
                                  split="train")
    streams = Streams(plain, 4, 480, 32)
    streams.check()
    assert streams.resumable and streams.resume_note == ""
    shuffled = Streams(plain.shuffle(seed=0, buffer_size=16), 4, 480, 32)
    shuffled.check()
    assert not shuffled.resumable
    assert shuffled.resume_note == "its shuffle buffer is not part of its state_dict()"
    unseeded = Streams(Shuffled(random.Random), 4, 480, 32)
    with pytest.raises(ValueError, match="gives other samples each time it is read"):
        unseeded.check()
    # shuffled by the global generators as it starts: the run's seeds make it read alike
    Streams(Shuffled(lambda: torch.default_generator), 4, 480, 32).check()


class Shuffled(torch.utils.data.IterableDataset):
    """Numbers 0..99, shuffled as iteration starts by the generator `make()` gives."""

    def __init__(self, make):
        self.make = make

    def shard(self, num_shards, index):
        return self

    def __iter__(self):
        generator = self.make()
        if isinstance(generator, torch.Generator):
            return iter(torch.randperm(100, generator=generator).tolist())
        numbers = list(range(100))
        generator.shuffle(numbers)
        return iter(numbers)
