"""The data plan: shares, remainders and micro-batches (pure functions, no cluster)."""
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_jupyter.engine.data.batching import (BatchPlan, Cut, busiest_rank, choose_cut,
                                                  epoch_permutation, micro_batch_bounds,
                                                  micro_batch_count, micro_batches, rank_share,
                                                  steps_per_epoch)


def test_shares_cover_the_batch_and_differ_by_at_most_one():
    for size in (1, 5, 63, 64, 65):
        for world in (1, 2, 3, 4):
            shares = [rank_share(size, r, world) for r in range(world)]
            lengths = [s.stop - s.start for s in shares]
            assert sum(lengths) == size
            assert max(lengths) - min(lengths) <= 1
            assert [s.start for s in shares[1:]] == [s.stop for s in shares[:-1]]


def test_every_sample_once_per_epoch_with_the_remainder_last():
    plan = BatchPlan(n=100, global_batch=32, seed=3)
    epoch, position, sizes, seen = 0, 0, [], []
    while epoch == 0:
        batch = plan.batch(epoch, position)
        sizes.append(len(batch))
        seen += batch.tolist()
        epoch, position = plan.advance(epoch, position)
    assert sizes == [32, 32, 32, 4] and steps_per_epoch(100, 32) == 4
    assert sorted(seen) == list(range(100))


def test_epochs_have_different_orders_from_the_seed():
    plan = BatchPlan(n=50, global_batch=50, seed=0)
    assert not torch.equal(plan.batch(0, 0), plan.batch(1, 0))
    assert torch.equal(plan.batch(1, 0), BatchPlan(50, 50, 0).batch(1, 0))


def test_micro_batches_split_a_share():
    chunks = micro_batches(torch.arange(22), 8)
    assert [len(c) for c in chunks] == [8, 8, 6]
    assert micro_batches(torch.arange(0), 8) == []
    assert len(micro_batches(torch.arange(5), None)) == 1


# micro-batches -------------------------------------------------------------------------------

LIMIT = Fraction(11, 10)  # a step within 1.1 x an even split's time

def slowdown(b, count, world_size, pass_cost=0):
    """The slowest rank's time over an even split's (exact; `pass_cost` an int): its samples
    plus pass_cost per micro-batch, over b / world_size samples in one pass."""
    bounds = micro_batch_bounds(b, count)
    slowest = max(bounds[s.stop] - bounds[s.start] + (s.stop - s.start) * pass_cost
                  for s in (rank_share(count, r, world_size) for r in range(world_size)))
    return Fraction(slowest * world_size, b + pass_cost * world_size)


def worst_slowdown(b, count, lo, hi, pass_cost=0):
    return max(slowdown(b, count, w, pass_cost) for w in range(lo, hi + 1))


def test_default_micro_batch_counts():
    # 64 samples on 1..4 ranks: 12 micro-batches of 5-6; at 3 ranks the busiest takes 22
    # samples, 22 / (64/3) = 1.031; 11 micro-batches would put 18 on one of 4 ranks (1.125)
    assert micro_batch_count(64, None, 1, 4) == 12
    assert [busiest_rank(micro_batch_bounds(64, 12), w) for w in (1, 2, 3, 4)] == [64, 32, 22, 16]
    assert worst_slowdown(64, 11, 1, 4) == 1.125
    # 256 samples on 1..8 ranks: 39 micro-batches of 6-7, worst at 7 ranks: 40 / (256/7) = 1.094
    assert micro_batch_count(256, None, 1, 8) == 39
    assert worst_slowdown(256, 39, 1, 8) == 40 * 7 / 256
    # a fixed pool size needs one micro-batch per rank
    assert micro_batch_count(64, None, 2, 2) == 2
    # --micro-batch caps the size: 64 / 4 needs at least 16, and 16 is too uneven at 3 ranks
    assert micro_batch_count(64, 4, 1, 4) == 19
    bounds = micro_batch_bounds(64, 19)
    assert max(b - a for a, b in zip(bounds, bounds[1:])) == 4
    # tiny batches cannot reach 1.1: 8 samples on 1..8 ranks, one per micro-batch (7 ranks: 1.75)
    assert micro_batch_count(8, None, 1, 8) == 8
    assert worst_slowdown(8, 8, 1, 8) == 1.75


def test_a_costly_pass_gives_fewer_micro_batches():
    # a pass costing 16 samples' time (the quick start's small network on a CPU): 64 samples on
    # 1..4 ranks in 4 micro-batches of 16, worst at 3 ranks: 2 passes and 32 samples against
    # one pass of 21.3, (2*16 + 32) / (16 + 64/3) = 1.71; the 12 of a free pass would take
    # (12*16 + 64) / (16 + 64) = 3.2 x at one rank
    assert micro_batch_count(64, None, 1, 4, 16.0) == 4
    assert worst_slowdown(64, 4, 1, 4, 16) == Fraction(12, 7)
    assert worst_slowdown(64, 12, 1, 4, 16) == Fraction(16, 5)
    # 256 samples on 1..8: with a pass costing 1 no count reaches 1.1 (one rank pays for every
    # extra pass, 7 ranks need many micro-batches to be even): 40 has the lowest worst ratio;
    # a costly pass gets the floor of one micro-batch per rank at 8
    counts = [micro_batch_count(256, None, 1, 8, cost) for cost in (0.0, 1.0, 4.0, 64.0)]
    assert counts == [39, 40, 12, 8]
    assert LIMIT < worst_slowdown(256, 40, 1, 8, 1) < worst_slowdown(256, 39, 1, 8, 1)
    assert busiest_rank(micro_batch_bounds(64, 4), 3, 16.0) == 64


def test_a_rank_without_micro_batches():
    # the last step of an epoch may hold fewer samples than ranks: 2 samples on 3 ranks
    plan = BatchPlan(n=10, global_batch=8, seed=0, cut=Cut(virtual=3, max_size=3))
    batch = plan.batch(0, 8)
    assert len(batch) == 2 and plan.micro_batch_count(2) == 2
    parts = [plan.rank_micro_batches(batch, r, 3) for r in range(3)]
    assert [[k for k, _ in p] for p in parts] == [[0], [1], []]


def test_the_default_cut_is_one_micro_batch_per_virtual_worker_and_never_below_the_floor():
    """The issue's numbers: 32 samples on a pool of --max 4 are 4 micro-batches of 8, whatever
    a clock says; digits' short last step (1797 % 32 = 5) is one micro-batch under BatchNorm."""
    bn = choose_cut(32, None, None, 1, 4, 8, "BatchNorm")
    assert [bn.count(b) for b in (32, 5, 16, 17)] == [4, 1, 2, 2]
    assert "4 micro-batches of 8" in bn.describe(32) and "floor 8: BatchNorm" in bn.describe(32)
    plain = choose_cut(32, None, None, 1, 4, 1, "")
    assert [plain.count(b) for b in (32, 5, 3)] == [4, 4, 3]
    assert choose_cut(30, 7, None, 1, 4, 1, "").count(30) == 5  # --micro-batch: ceil(b / N)
    assert choose_cut(32, None, 16.0, 1, 4, 1, "").count(32) == micro_batch_count(32, None, 1, 4,
                                                                                   16.0)
    with pytest.raises(ValueError, match=r"micro-batches of 4 samples, below the floor of 8 "
                       r"\(BatchNorm\): raise --global-batch to 32 or more, start the pool "
                       r"with --max 2 or fewer, or declare min_micro_batch = 4"):
        choose_cut(16, None, None, 1, 4, 8, "BatchNorm")
    with pytest.raises(ValueError, match=r"of 0 samples, below the floor of 8 \(BatchNorm\): "
                       r"raise --global-batch to 32 or more$"):  # nothing else can help
        choose_cut(3, None, None, 1, 4, 8, "BatchNorm", lowest=2)
    with pytest.raises(ValueError, match="--micro-batch 3 is below the floor of 4"):
        choose_cut(32, 3, None, 1, 4, 4, "the cell's min_micro_batch")


def test_drop_last_leaves_out_the_short_step_as_a_dataloader_does():
    plan = BatchPlan(n=10, global_batch=4, seed=1, drop_last=True)
    assert steps_per_epoch(10, 4, drop_last=True) == 2
    epoch, position, seen = 0, 0, []
    for _ in range(2):
        seen.append(plan.batch(epoch, position))
        epoch, position = plan.advance(epoch, position)
    assert (epoch, position) == (1, 0)
    assert sorted(torch.cat(seen).tolist()) == sorted(epoch_permutation(1, 0, 10)[:8].tolist())


def test_micro_batch_count_rejects_bad_plans():
    for args in ((0, None, 1, 2), (8, 0, 1, 2), (8, None, 0, 2), (8, None, 3, 2),
                 (8, None, 1, 2, -1.0)):
        with pytest.raises(ValueError):
            micro_batch_count(*args)


@st.composite
def runs(draw):
    """A dataset, a global batch, a cut (each rule, a floor), drop_last, a world size per step."""
    n = draw(st.integers(1, 300))
    global_batch = draw(st.integers(1, n))
    lo = draw(st.integers(1, 6))
    hi = draw(st.integers(lo, 8))
    floor = draw(st.integers(1, max(1, global_batch // hi)))
    rule = draw(st.sampled_from(["virtual workers", "micro_batch", "pass_cost"]))
    cut = Cut(rule, virtual=hi, micro_batch=draw(st.integers(floor, global_batch)),
              pass_cost=float(draw(st.sampled_from([0, 1, 4, 16, 256]))), min_size=lo,
              max_size=hi, floor=floor, floor_why="a test")
    drop_last = draw(st.booleans())
    steps = 2 * steps_per_epoch(n, global_batch, drop_last)
    sizes = draw(st.lists(st.integers(lo, hi), min_size=steps, max_size=steps))
    return n, global_batch, cut, drop_last, sizes


@settings(max_examples=150, deadline=None)
@given(runs(), st.integers(0, 2**32))
def test_plan_properties(run, seed):
    """Every sample once per epoch at any resize schedule (all but the short step's with
    drop_last); micro-batches as documented."""
    n, global_batch, cut, drop_last, sizes = run
    plan = BatchPlan(n, global_batch, seed, cut, drop_last)
    epoch, position, seen = 0, 0, {0: [], 1: []}
    for world_size in sizes:
        batch = plan.batch(epoch, position)
        b = len(batch)
        assert b == global_batch or not drop_last
        micro = plan.micro_batches(batch)
        count = len(micro)
        lengths = [len(m) for m in micro]
        # boundaries: consecutive slices, sizes differing by at most one, none below the floor
        assert torch.equal(torch.cat(micro), batch)
        assert max(lengths) - min(lengths) <= 1 and min(lengths) >= 1
        assert count == 1 or min(lengths) >= cut.floor
        # the count is the rule's, never the world size's
        wanted = {"virtual workers": cut.virtual, "micro_batch": -(-b // cut.micro_batch),
                  "pass_cost": micro_batch_count(b, None, cut.min_size, cut.max_size,
                                                 cut.pass_cost)}[cut.rule]
        assert count == max(1, min(wanted, b // cut.floor))
        # each rank: a contiguous run of whole micro-batches, the plan's own (independent of W)
        parts = [plan.rank_micro_batches(batch, r, world_size) for r in range(world_size)]
        indices = [[k for k, _ in part] for part in parts]
        assert sum(indices, []) == list(range(count))
        assert all(torch.equal(chunk, micro[k]) for part in parts for k, chunk in part)
        counts = [len(i) for i in indices]
        assert max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)
        seen[epoch] += [int(i) for part in parts for _, chunk in part for i in chunk]
        epoch, position = plan.advance(epoch, position)
    used = n - n % global_batch if drop_last else n
    for e in (0, 1):
        assert len(seen[e]) == len(set(seen[e])) == used
        assert sorted(seen[e]) == sorted(epoch_permutation(seed, e, n)[:used].tolist())


@pytest.mark.parametrize("drop_last", [False, True])
def test_no_shuffle_reads_a_dataloaders_order_at_any_world_size_and_across_a_resize(drop_last):
    """--no-shuffle: the ranks' micro-batches of each step, in rank order, are the batch a
    DataLoader(shuffle=False) gives, whatever the world size and when it changes mid-epoch."""
    n, B = 100, 24
    loader = torch.utils.data.DataLoader(range(n), batch_size=B, shuffle=False,
                                         drop_last=drop_last)
    expected = [b.tolist() for b in loader] * 3  # three epochs
    plan = BatchPlan(n, B, seed=5, cut=Cut("virtual workers", virtual=4, max_size=4),
                     drop_last=drop_last, shuffle=False)
    epoch, position, got = 0, 0, []
    for step in range(len(expected)):
        world_size = [1, 3, 4, 2][step % 4]  # a resize at every step
        batch = plan.batch(epoch, position)
        got.append([i for r in range(world_size)
                    for _, chunk in plan.rank_micro_batches(batch, r, world_size)
                    for i in chunk.tolist()])
        epoch, position = plan.advance(epoch, position)
    assert got == expected
