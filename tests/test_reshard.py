"""Resharding a dim-0 sharded state in memory (issue 36): over real gloo process groups, every
rank of the new layout ends with exactly the rows ``torch.chunk`` gives its new rank (FSDP2's
layout), for grows, shrinks with a leaver in the middle and sizes with empty shards; the bytes
that travel are exactly the rows whose owner changes, counted row by row here."""
import pytest
import torch
import torch.distributed as dist
from worlds import spawn

from elastic_jupyter.engine.sharded import reshard as reshard_mod
from elastic_jupyter.engine.sharded.reshard import (Layout, chunk_rows, empty_like_rows,
                                                    moved_bytes, plan, reshard)

# rows per tensor: fewer rows than ranks, one row, a prime, model-sized ones (the last one's
# pieces are past DIRECT_BYTES: they travel alone, the others in buckets)
ROWS = [0, 1, 2, 5, 7, 64, 1031, 300_000]
DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.float32, torch.bool,
          torch.float16, torch.float32]

LAYOUTS = {  # (old rank, new rank) per group rank
    "grow 2 -> 3": Layout((0, 1, None), (0, 1, 2)),
    "grow 1 -> 4": Layout((0, None, None, None), (0, 1, 2, 3)),
    "shrink 3 -> 2, rank 1 leaves": Layout((0, 1, 2), (0, None, 1)),
    "shrink 3 -> 1": Layout((0, 1, 2), (None, None, 0)),
    "2 -> 2, one replaced": Layout((0, 1, None), (0, None, 1)),
}


def full_tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(n, 3, 2, generator=g) * 100).to(dtype) for n, dtype in zip(ROWS, DTYPES)]


def _rank(rank: int, store: str, name: str, out: str, staged: bool = False) -> None:
    layout = LAYOUTS[name]
    if staged:  # rounds as nccl's: small ones, so the model-sized tensor is cut by rows
        reshard_mod.ROUND_BYTES = 100_000
    dist.init_process_group("gloo", store=dist.FileStore(store, len(layout.old)), rank=rank,
                            world_size=len(layout.old))
    try:
        full = full_tensors()
        old = layout.old[rank]
        shards = [t[slice(*chunk_rows(len(t), layout.old_size, old))].clone() if old is not None
                  else empty_like_rows(t) for t in full]
        new = reshard(shards, ROWS, layout, rank, stage=torch.device("cpu") if staged else None)
        torch.save(new, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name,staged", [(name, False) for name in LAYOUTS] + [
    ("grow 2 -> 3", True), ("shrink 3 -> 2, rank 1 leaves", True)])
def test_every_rank_gets_its_new_rows_and_only_changed_owners_travel(tmp_path, name, staged):
    """`staged`: in rounds, as rows held on the host travel with nccl."""
    layout = LAYOUTS[name]
    spawn(_rank, (str(tmp_path / "store"), name, str(tmp_path), staged), len(layout.old))
    full = full_tensors()
    for g, new in enumerate(layout.new):
        got = torch.load(tmp_path / f"rank{g}.pt", weights_only=True)
        if new is None:
            assert got == [None] * len(ROWS)
            continue
        for t, shard in zip(full, got):
            want = t[slice(*chunk_rows(len(t), layout.new_size, new))]
            assert shard.dtype == t.dtype and torch.equal(shard, want), (name, g)
    # the bytes that travel: each row whose new owner is another process than its old one
    row_bytes = [t[0].numel() * t.element_size() if len(t) else 0 for t in full]
    owner = {}
    for which, size in (("old", layout.old_size), ("new", layout.new_size)):
        ranks = layout.old if which == "old" else layout.new
        for g, r in enumerate(ranks):
            if r is not None:
                for i, n in enumerate(ROWS):
                    for row in range(*chunk_rows(n, size, r)):
                        owner[which, i, row] = g
    changed = sum(row_bytes[i] for (which, i, row), g in owner.items()
                  if which == "new" and owner["old", i, row] != g)
    assert moved_bytes(plan(ROWS, layout), row_bytes) == changed


def test_layouts_are_checked():
    with pytest.raises(ValueError, match="0..W-1"):
        Layout((0, 0), (0, 1))
    with pytest.raises(ValueError, match="every rank"):
        Layout((0, 1), (0,))
    assert chunk_rows(5, 4, 3) == (5, 5) and chunk_rows(5, 4, 2) == (4, 5)  # torch.chunk's
    assert [len(c) for c in torch.arange(5).chunk(4)] == [2, 2, 1]


def test_rounds_cut_the_plan_alike_and_bound_each_round():
    """Every rank cuts the same rounds from the same plan: none holds more than ROUND_BYTES
    (but a row larger than that, alone), and together they are the plan's rows."""
    layout = LAYOUTS["grow 2 -> 3"]
    transfers = plan(ROWS, layout)
    row_bytes = [48, 10**6, 48, 48, 48, 48, 48, 48]  # one tensor's row past the bound
    bound = 100_000
    original = reshard_mod.ROUND_BYTES
    reshard_mod.ROUND_BYTES = bound
    try:
        rounds = reshard_mod._rounds(transfers, row_bytes)
    finally:
        reshard_mod.ROUND_BYTES = original
    for r in rounds:
        size = sum((t.end - t.start) * row_bytes[t.tensor] for t in r)
        assert size <= bound or len(r) == 1, size
    pieces = [(t.tensor, t.src, t.dst, row) for r in rounds for t in r
              for row in range(t.start, t.end)]
    assert sorted(pieces) == sorted((t.tensor, t.src, t.dst, row) for t in transfers
                                    for row in range(t.start, t.end))
    assert len(rounds) > 3
