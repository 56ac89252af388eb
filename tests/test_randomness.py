"""Randomness independent of the world size: a random stream per micro-batch, BatchNorm running
statistics replayed in micro-batch order (engine.data.randomness, engine.step.running_stats)."""
import collections
import copy
import glob
import random

import numpy as np
import pytest
import torch
from worlds import cell_namespace, config

from elastic_jupyter import RunConfig, TrainingRun
from elastic_jupyter.engine.data.batching import BatchPlan, Cut
from elastic_jupyter.engine.data.map_pipeline import SeededSamples
from elastic_jupyter.engine.data.randomness import (host_generators_kept, micro_batch_stream,
                                                    sample_seed, seed_host_generators, stream_seed)
from elastic_jupyter.engine.step.running_stats import RunningStats
from elastic_jupyter.engine.worker import Worker

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


def host_draws():
    """What timm's Mixup draws (its mixing ratio from numpy), and a draw from Python's random."""
    return float(np.random.beta(1.0, 1.0)), random.random()


def host_states():
    return random.getstate(), np.random.get_state()


def same_host_states(a, b) -> bool:
    return a[0] == b[0] and all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))


def test_python_and_numpy_draw_from_the_micro_batchs_stream_whatever_ran_before():
    """A micro-batch's draws from Python's random and numpy's global generator depend on
    (seed, step, micro-batch) alone; the outer states are restored, also on an exception, and
    by a loop that keeps them once for all its micro-batches."""
    draws = []
    for outer in range(3):  # whatever drew before
        random.seed(outer), np.random.seed(outer), np.random.standard_normal(outer)
        before = host_states()
        with micro_batch_stream(7, 3, 4, CPU):
            draws.append(host_draws())
        assert same_host_states(host_states(), before)
    assert draws[0] == draws[1] == draws[2]
    seed_host_generators(stream_seed(7, 3, 4))  # what a single process seeds
    assert host_draws() == draws[0]
    lam, py = draws[0]
    assert lam != py  # Python's and numpy's generators are not seeded alike
    with micro_batch_stream(7, 3, 5, CPU):
        assert host_draws() != draws[0]
    with micro_batch_stream(7, 4, 4, CPU):
        assert host_draws() != draws[0]

    before = host_states()
    with pytest.raises(ZeroDivisionError), micro_batch_stream(7, 3, 4, CPU):
        host_draws()
        raise ZeroDivisionError
    assert same_host_states(host_states(), before)
    kept = []
    for k in host_generators_kept([4, 5]):
        with micro_batch_stream(7, 3, k, CPU):
            kept.append(host_draws())
    assert kept[0] == draws[0] and same_host_states(host_states(), before)
    with pytest.raises(ZeroDivisionError):
        for k in host_generators_kept([4, 5]):
            with micro_batch_stream(7, 3, k, CPU):
                host_draws()
                raise ZeroDivisionError
    assert same_host_states(host_states(), before)


def test_samples_draw_from_pythons_and_numpys_generators_seeded_per_sample():
    class Drawn(torch.utils.data.Dataset):
        def __len__(self):
            return 8
        def __getitem__(self, i):
            return host_draws()
    samples = SeededSamples(Drawn(), 5)
    before = host_states()
    got = samples.__getitems__([(0, 3), (1, 3), (0, 3)])
    assert same_host_states(host_states(), before)
    assert got[0] == got[2] != got[1]
    seed_host_generators(sample_seed(5, 1, 3))
    assert host_draws() == got[1]


MIXUP_CELL = '''
import random
import numpy as np
import torch
X = torch.randn(96, 8, dtype=torch.float64)
class Jittered(torch.utils.data.Dataset):
    """A random transform drawing from numpy's and Python's generators."""
    def __len__(self):
        return 96
    def __getitem__(self, i):
        x = X[i] * (1 + 0.1 * np.random.standard_normal() * random.random())
        return i, x, X[i].sum(0, keepdim=True)
dataset = Jittered()
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(),
                            torch.nn.Linear(8, 1)).double()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
drawn = []
def loss_fn(model, batch):
    """Mixup as timm draws it: the ratio from numpy's global generator, here also a draw from
    Python's random, mixing the batch with its flipped self."""
    index, x, y = batch
    lam, coin = np.random.beta(1.0, 1.0), random.random()
    drawn.append((int(index[0]), float(lam), coin))
    x, y = lam * x + (1 - lam) * x.flip(0), lam * y + (1 - lam) * y.flip(0)
    return torch.nn.functional.mse_loss(model(x), y) * (1 + coin)
'''


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loss_fns_numpy_draws_follow_the_micro_batch_whatever_ran_before(workers):
    """One rank: the loss_fn's draws in micro-batch k of step s are those of the stream of
    (seed, s, k), also after the cell drew from numpy between steps and after the samples'
    transform drew (in this process or in loader processes), and the cell's own draws outside
    micro-batches go on as if no micro-batch had drawn."""
    ns = cell_namespace(MIXUP_CELL, 3)
    worker = Worker(ns, config(global_batch=16, micro_batch=4, steps=3,
                               loader_processes=workers), "cpu")
    expected = []
    for step in range(3):
        first = len(ns["drawn"])
        np.random.seed(100 + step), random.seed(100 + step)  # whatever the cell drew before
        worker.train_step(0, 1)
        after = host_draws()
        np.random.seed(100 + step), random.seed(100 + step)
        assert host_draws() == after  # the step's draws left the outer streams alone
        batch = worker.plan.batch(0, 16 * step)
        cut = worker.plan.micro_batches(batch)
        assert len(cut) >= 2
        for k, micro in enumerate(cut):
            seed_host_generators(stream_seed(3, step, k))
            expected.append((int(micro[0]), *host_draws()))
        assert ns["drawn"][first:] == expected[first:]
    assert len({lam for _, lam, _ in ns["drawn"]}) == len(ns["drawn"])


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


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_called_twice_a_micro_batch_keeps_a_plain_loops_running_statistics(momentum):
    """A GAN's discriminator normalises the real batch, then the fake one, in one micro-batch:
    the running statistics after a step are those of a plain loop over the micro-batches in
    order (engine.step.running_stats folds the two updates); without a momentum (a cumulative
    average) that is refused, on every rank."""
    torch.manual_seed(0)
    model = torch.nn.BatchNorm1d(4, momentum=momentum).double()
    plain = copy.deepcopy(model)
    parts = [torch.randn(8, 4, dtype=torch.float64) for _ in range(3)]
    for x in parts:
        plain(x)
        plain(2 * x + 1)
    stats = RunningStats(model)
    stats.begin()
    for k, x in enumerate(parts):
        with stats.micro_batch(k):
            model(x)
            model(2 * x + 1)
    if momentum is None:
        with pytest.raises(RuntimeError, match="ran 2 times in training mode in one micro-batch"):
            stats.combine(len(parts))
        return
    stats.combine(len(parts))
    assert torch.allclose(model.running_mean, plain.running_mean, rtol=1e-12, atol=0)
    assert torch.allclose(model.running_var, plain.running_var, rtol=1e-12, atol=0)
    assert int(model.num_batches_tracked) == int(plain.num_batches_tracked) == 6


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
    cut = Cut("pass_cost", pass_cost=0.0, min_size=bounds[0], max_size=bounds[1])
    plan, epoch, position, masks = BatchPlan(192, 48, seed, cut), 0, 0, {}
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

    expected = expected_masks(5, 8, (idle_pool.config.min_size, idle_pool.config.max_size))
    count = len(BatchPlan(192, 48, 5, Cut("pass_cost", pass_cost=0.0, max_size=4))
                .micro_batches(torch.arange(48)))
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
