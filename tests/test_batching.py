"""The data plan: shares, remainders and micro-batches (pure functions, no cluster)."""
import torch

from elastic_jupyter.engine.batching import BatchPlan, micro_batches, rank_share, steps_per_epoch


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
