"""Randomness independent of the world size: a random stream per micro-batch, BatchNorm running
statistics replayed in micro-batch order (engine.randomness, engine.running_stats)."""
import collections
import glob

import pytest
import torch

from elastic_jupyter import RunConfig, TrainingRun
from elastic_jupyter.engine.batching import BatchPlan
from elastic_jupyter.engine.randomness import micro_batch_stream, stream_seed
from elastic_jupyter.engine.running_stats import RunningStats

CPU = torch.device("cpu")


def test_streams_differ_per_micro_batch_and_step_and_restore_the_outer_state():
    seeds = {stream_seed(7, step, k) for step in range(50) for k in range(50)}
    assert len(seeds) == 2500 and stream_seed(7, 3, 4) != stream_seed(8, 3, 4)
    torch.manual_seed(1)
    outer = torch.get_rng_state()
    with micro_batch_stream(7, 3, 4, CPU):
        first = torch.rand(8)
    assert torch.equal(torch.get_rng_state(), outer)
    with micro_batch_stream(7, 3, 4, CPU):
        again = torch.rand(8)
    with micro_batch_stream(7, 3, 5, CPU):
        other = torch.rand(8)
    torch.manual_seed(stream_seed(7, 3, 4))
    assert torch.equal(first, again) and torch.equal(first, torch.rand(8))
    assert not torch.equal(first, other)
    outer = torch.get_rng_state()
    with pytest.raises(ZeroDivisionError), micro_batch_stream(7, 3, 4, CPU):
        torch.rand(3)
        raise ZeroDivisionError
    assert torch.equal(torch.get_rng_state(), outer)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_statistics_replay_the_sequential_updates(momentum):
    """One rank (no process group): recording with momentum 1 and replaying in order gives the
    buffers of plain sequential forward passes; a layer in eval mode is left alone."""
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.BatchNorm1d(3, momentum=momentum),
                                   torch.nn.BatchNorm1d(3)).double()
    x = torch.randn(5, 4, 3, dtype=torch.float64)
    plain, replayed = net(), net()
    plain[1].eval(), replayed[1].eval()
    for micro in x:
        plain(micro)
    stats = RunningStats(replayed)
    stats.begin()
    for k, micro in enumerate(x):
        with stats.micro_batch(k):
            replayed(micro)
    stats.combine(len(x))
    assert replayed[0].momentum == momentum
    for key, value in plain.state_dict().items():
        assert torch.allclose(replayed.state_dict()[key], value, rtol=1e-12, atol=0), key
    assert int(replayed[0].num_batches_tracked) == 5 and int(replayed[1].num_batches_tracked) == 0


def test_a_layer_run_twice_in_one_micro_batch_is_refused():
    model = torch.nn.BatchNorm1d(3)
    stats = RunningStats(model)
    stats.begin()
    with stats.micro_batch(0):
        model(torch.randn(4, 3)), model(torch.randn(4, 3))
    with pytest.raises(RuntimeError, match="ran 2 times"):
        stats.combine(1)


CELL = '''
import os
import torch

LOG = open(f"{LOG_PREFIX}-{os.getpid()}.txt", "a", buffering=1)

class Ones(torch.utils.data.Dataset):
    """192 all-ones samples that carry their index."""
    def __len__(self):
        return 192
    def __getitem__(self, i):
        return i, torch.ones(64, dtype=torch.float64)

dataset = Ones()
model = torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(64, 1)).double()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
def loss_fn(model, batch):
    index, x = batch
    h = model[0](x)  # on all-ones input, the dropout's mask
    bits = "".join("1" if v else "0" for v in (h != 0).flatten().tolist())
    LOG.write(" ".join(map(str, index.tolist())) + ":" + bits + "\\n")
    return model[1](h).pow(2).mean()
'''


def expected_masks(seed: int, steps: int, bounds: tuple) -> dict:
    """(sample indices of a micro-batch) -> (step, k, its mask), drawn as a single process
    would: micro-batch k of step s from the stream of (seed, s, k)."""
    plan, epoch, position, masks = BatchPlan(192, 48, seed, None, *bounds), 0, 0, {}
    for step in range(steps):
        for k, micro in enumerate(plan.micro_batches(plan.batch(epoch, position))):
            torch.manual_seed(stream_seed(seed, step, k))
            ones = torch.ones(len(micro), 64, dtype=torch.float64)
            kept = torch.nn.functional.dropout(ones, 0.5) != 0
            masks[tuple(micro.tolist())] = (step, k, "".join("1" if v else "0"
                                                              for v in kept.flatten().tolist()))
        epoch, position = plan.advance(epoch, position)
    return masks


def test_dropout_masks_follow_the_micro_batch_not_the_rank(idle_pool, tmp_path):
    """2 -> 3 -> 1 ranks: every micro-batch's mask is the single-process one, so masks differ
    across micro-batches of a step and across ranks, and do not depend on the world size."""
    prefix = str(tmp_path / "masks")
    # a free pass, for the cut of the pass-cost-free rule: 11 micro-batches a step
    config = RunConfig(name="masks", global_batch=48, steps=8, checkpoint_every=0, seed=5,
                       pass_cost=0.0)
    run = TrainingRun(idle_pool, config, source=CELL, push={"LOG_PREFIX": prefix}, engines=2,
                      schedule=[(3, 3), (6, 1)], workspace=str(tmp_path)).start()
    assert run.wait(timeout=240) == "finished", run.logs()
    assert [r["world_size"] for r in run.history] == [2] * 3 + [3] * 3 + [1] * 2

    expected = expected_masks(5, 8, (idle_pool.min_size, idle_pool.max_size))
    count = len(BatchPlan(192, 48, 5, None, 1, 4).micro_batches(torch.arange(48)))
    assert len(expected) == 8 * count == 88  # 11 micro-batches of 4-5 samples a step
    drawn = {}  # (step, k) -> (engine log, mask)
    for path in glob.glob(prefix + "-*.txt"):
        for line in open(path):
            key, bits = line.strip().split(":")
            step, k, mask = expected[tuple(int(i) for i in key.split())]
            assert bits == mask, (path, step, k)
            drawn[step, k] = (path, bits)
    assert sorted(drawn) == sorted((step, k) for step, k, _ in expected.values())

    by_step = collections.defaultdict(list)
    for (step, k), (path, bits) in sorted(drawn.items()):
        by_step[step].append((path, bits))
    # at step 0 (2 ranks) rank 0 takes micro-batches 0-5, rank 1 takes 6-10
    assert len({path for path, _ in by_step[0][:6]}) == 1
    assert len({path for path, _ in by_step[0][6:]}) == 1
    assert by_step[0][0][0] != by_step[0][6][0]
    for step, masks in by_step.items():
        first_rows = [bits[:64] for _, bits in masks]  # every micro-batch's first sample
        assert len(set(first_rows)) == count, step
