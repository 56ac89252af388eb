"""Exactly-once data: every sample is used once per epoch across mid-epoch resizes."""
import collections
import glob

import pytest

from elastic_jupyter import RunConfig, TrainingRun

CELL = '''
import os
import torch

class Samples(torch.utils.data.Dataset):
    """100 samples, each with its index."""
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(100, 4, generator=g), torch.randint(0, 2, (100,), generator=g)
    def __len__(self):
        return 100
    def __getitem__(self, i):
        return self.x[i], self.y[i], i

dataset = Samples()
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
log = open(f"{LOG_PREFIX}-{os.getpid()}.txt", "a", buffering=1)
def loss_fn(model, batch):  # every sample a step trains on, appended to a per-engine file
    x, y, i = batch
    log.write("".join(f"{int(k)}\\n" for k in i))
    return torch.nn.functional.cross_entropy(model(x), y)
'''


@pytest.mark.parametrize("workers", [0, 2])
def test_every_sample_once_per_epoch_across_resizes(idle_pool, tmp_path, workers):
    prefix = str(tmp_path / "indices")
    # 100 samples, batch 24: 5 steps per epoch, the last of 4 samples; 3 epochs = 15 steps.
    # Resizes after step 7 (mid-epoch 1) and step 12 (mid-epoch 2); 24 over 3 ranks and the
    # remainder 4 over 3 ranks give uneven shares.
    # a given pass cost: no measuring passes, whose passes over the first step's samples
    # loss_fn would log too. With loader processes, batches fetched ahead for a generation that
    # ends are fetched again by the next: what counts is what the steps trained on
    config = RunConfig(name="once", global_batch=24, epochs=3, checkpoint_every=0,
                       pass_cost=0.0, loader_processes=workers)
    run = TrainingRun(idle_pool, config, source=CELL, push={"LOG_PREFIX": prefix}, engines=2,
                      schedule=[(7, 3), (12, 2)], workspace=str(tmp_path)).start()
    assert run.wait(timeout=240) == "finished", run.logs()
    assert [(e["step"], e["to"]) for e in run.events if e["kind"] == "resize"] == [(7, 3), (12, 2)]

    counts = collections.Counter()
    files = glob.glob(prefix + "-*.txt")
    assert len(files) == 3  # two engines from the start, one joined for steps 8..12
    for path in files:
        counts.update(int(line) for line in open(path))
    assert counts == {i: 3 for i in range(100)}
    assert [r["world_size"] for r in run.history] == [2] * 7 + [3] * 5 + [2] * 3


def test_no_shuffle_keeps_the_datasets_order_across_resizes(idle_pool, tmp_path):
    """--no-shuffle on a real cluster, resized mid-epoch: each pass holds consecutive samples,
    each engine meets them in the dataset's order, and every sample comes once per epoch."""
    prefix = str(tmp_path / "passes")
    cell = CELL.replace('log.write("".join(f"{int(k)}\\n" for k in i))',
                        'log.write(" ".join(str(int(k)) for k in i) + "\\n")')
    config = RunConfig(name="ordered", global_batch=24, epochs=3, checkpoint_every=0,
                       pass_cost=0.0, no_shuffle=True)
    run = TrainingRun(idle_pool, config, source=cell, push={"LOG_PREFIX": prefix}, engines=2,
                      schedule=[(7, 3), (12, 1)], workspace=str(tmp_path)).start()
    assert run.wait(timeout=240) == "finished", run.logs()
    counts = collections.Counter()
    for path in glob.glob(prefix + "-*.txt"):
        passes = [[int(k) for k in line.split()] for line in open(path)]
        assert max(len(ids) for ids in passes) > 1
        for ids in passes:
            assert ids == list(range(ids[0], ids[0] + len(ids))), ids
            counts.update(ids)
        starts = [ids[0] for ids in passes]  # rising, but for each new epoch's start
        assert sum(b < a for a, b in zip(starts, starts[1:])) <= 2, starts
    assert counts == {i: 3 for i in range(100)}
    assert [r["world_size"] for r in run.history] == [2] * 7 + [3] * 5 + [1] * 3
