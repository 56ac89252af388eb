"""The sharded mode's step (``shard=True``: engine.sharded.lifecycle, engine.sharded.reduce_scatter)
against the replicated mode's and a plain loop: FSDP2 per block over real gloo groups, float64.

What must hold at any world size and micro-batch cut: the update is the mean gradient of the
global batch (ranks with fewer micro-batches, or none, run zero-weight passes that add nothing),
BatchNorm statistics and dropout as in a single process, a parameter no rank used keeps
``.grad = None`` (AdamW does not decay it), and --clip-grad-norm clips the whole model's norm.
"""
from __future__ import annotations

import math

import pytest
import torch

from elastic_jupyter.engine.step.objects import SetupError
from elastic_jupyter.engine.worker import Worker
from test_gradients import TOKENS_CELL
from worlds import cell_namespace, config, reference, train

CELL = '''
import torch
g = torch.Generator().manual_seed(0)
x = torch.randn(64, 6, generator=g, dtype=torch.float64)
y = torch.randn(64, 1, generator=g, dtype=torch.float64)
rare = torch.zeros(64, dtype=torch.bool)
rare[[5, 40]] = True
min_micro_batch = 2  # BatchNorm over 2 samples and more (the default floor is 8)
dataset = torch.utils.data.TensorDataset(x, y, rare)
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        # no bias before BatchNorm: its gradient is round-off, which AdamW would scale up
        self.linear, self.norm = torch.nn.Linear(6, 6, bias=False), torch.nn.BatchNorm1d(6)
    def forward(self, x):
        return x + torch.nn.functional.dropout(torch.tanh(self.norm(self.linear(x))), 0.2)
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        self.head = torch.nn.Linear(6, 1)
        self.unused = torch.nn.Linear(6, 1)  # forward never uses it
        self.rare = torch.nn.Linear(6, 1)  # used by the steps whose batch holds a rare sample
        torch.nn.init.ones_(self.unused.weight), torch.nn.init.ones_(self.unused.bias)
    def forward(self, x, rare):
        for block in self.blocks:
            x = block(x)
        out = self.head(x)
        if rare.any():
            out = out + torch.where(rare[:, None], self.rare(x), 0)
        return out
model = Model().double()
optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.5)
def loss_fn(model, batch):
    x, y, rare = batch
    return torch.nn.functional.mse_loss(model(x, rare), y)
'''


def _close(got, expected, what: str) -> None:
    for k, value in expected.params.items():
        assert torch.allclose(got.params[k], value, rtol=1e-9, atol=1e-12), (what, k)
        assert (got.grads[k] is None) == (expected.grads[k] is None), (what, k)
    for k in ("unused.weight", "unused.bias"):  # AdamW's weight decay never touched them
        assert torch.equal(got.params[k], torch.ones_like(got.params[k])), (what, k)


@pytest.mark.parametrize("world_size, micro_batch", [(2, 3), (3, 5), (3, 8)])
def test_a_sharded_step_equals_the_replicated_one_at_any_cut(tmp_path, world_size, micro_batch):
    # 6 micro-batches over 2 ranks (3 each); 4 over 3 (2, 1, 1: padded); 2 over 3 (1, 1, 0)
    options = config(micro_batch=micro_batch, clip_grad_norm=0.5)
    replicated = train(CELL, options, world_size, 8, tmp_path)[0]
    sharded = train(CELL, dict(options, shard=True), world_size, 8, tmp_path)
    assert any(replicated.grads[k] is not None for k in ("rare.weight",))  # some steps use it
    for rank, got in enumerate(sharded):
        _close(got, replicated, f"rank {rank}")
        assert [r["loss"] for r in got.history] == pytest.approx(
            [r["loss"] for r in replicated.history], rel=1e-9)


@pytest.mark.parametrize("no_shuffle", [False, True], ids=["shuffled", "--no-shuffle"])
def test_a_sharded_run_equals_a_plain_loop(tmp_path, no_shuffle):
    # the whole batch in one pass, as the loop's (BatchNorm's statistics over 16 samples), on
    # rank 0; rank 1 runs a zero-weight pass only. No dropout: the loop has no random streams.
    # --no-shuffle: the loop reads a DataLoader(shuffle=False)
    cell = CELL.replace("0.2)", "0.0)")
    expected = reference(cell, config(no_shuffle=no_shuffle), 6)
    got = train(cell, config(micro_batch=16, shard=True, no_shuffle=no_shuffle), 2, 6, tmp_path)
    for rank, result in enumerate(got):
        for k, value in expected.params.items():
            assert torch.allclose(result.params[k], value, rtol=1e-9, atol=1e-12), (rank, k)


@pytest.mark.parametrize("more, options, refused", [
    ("", {"precision": "fp16"}, "--precision fp16 is not supported with shard=True yet"),
    ("def after_step(model, optimizer, step): pass", {},
     "extra_state and after_step are not supported with shard=True yet"),
    ("model.embed = torch.nn.Embedding(4, 6, sparse=True).double()", {},
     "sparse gradients .an Embedding with sparse=True. are not supported with --shard"),
    ("model.blocks[0] = torch.compile(model.blocks[0])", {},
     "a torch.compile'd model is not supported with --shard yet"),
])
def test_what_the_sharded_mode_does_not_do_yet_is_refused_at_setup(more, options, refused):
    with pytest.raises(SetupError, match=refused):
        Worker(cell_namespace(CELL + more, 3), dict(config(shard=True), **options), "cpu")


def test_micro_batches_without_items_take_part_in_fsdp2s_collectives(tmp_path):
    # MeanOver losses over token counts, 40% of the samples without a token: some micro-batches
    # of 2 hold none, and their rank still runs FSDP2's backward (at weight 0, so the loss of
    # an empty mean must be finite, as with --sync-batchnorm)
    cell = TOKENS_CELL.replace("(error ** 2)[mask].mean()",
                               "(error ** 2)[mask].sum() / mask.sum().clamp(min=1)")
    options = config(micro_batch=2)
    replicated = train(cell, options, 2, 6, tmp_path)[0]
    for got in train(cell, dict(options, shard=True), 2, 6, tmp_path):
        for k, value in replicated.params.items():
            assert torch.allclose(got.params[k], value, rtol=1e-9, atol=1e-12), k


def test_bf16_trains_as_the_replicated_bf16_run(tmp_path):
    # float32 weights, the forward under bf16 autocast as the replicated mode's: the same
    # training to bf16 noise
    cell = CELL.replace(".double()", "").replace("torch.float64", "torch.float32")
    options = config(micro_batch=4, precision="bf16")
    replicated = train(cell, options, 2, 8, tmp_path)[0]
    for got in train(cell, dict(options, shard=True), 2, 8, tmp_path):
        losses = [r["loss"] for r in got.history]
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
        assert losses == pytest.approx([r["loss"] for r in replicated.history], rel=0.05)
        for k, value in replicated.params.items():
            assert got.params[k].dtype == torch.float32
            assert torch.allclose(got.params[k], value, rtol=0.05, atol=0.02), k
