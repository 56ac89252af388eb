"""Real models train as they would in plain PyTorch: mixed dtypes, sparse gradients, unused
parameters, losses that are means over tokens.

Each case trains a cell with real Workers on a real gloo group (tests/worlds.py) and compares
with the same cell in a plain single-process loop: the whole global batch in one forward pass.
The checks are on what the user sees (parameters, ``.grad``, logged losses), not on how the
gradients travel, so they hold for any reduction that sums as torch's DDP does.
"""
import dataclasses

import pytest
import torch
from worlds import cell_namespace, config, max_relative_deviation, reference, train

from elastic_jupyter.engine.data.batching import BatchPlan, Cut, rank_share
from elastic_jupyter.engine.worker import SetupError, Worker

# ------------------------------------------------------------------------- mixed dtypes

MIXED_CELL = '''
import torch
g = torch.Generator().manual_seed(0)
dataset = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g),
                                         torch.randn(64, 1, generator=g))
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(8, 8).to(BODY)
        self.head = torch.nn.Linear(8, 1).to(HEAD)
    def forward(self, x):
        return self.head(torch.tanh(self.body(x.to(BODY))).to(HEAD))
model = Model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y.to(HEAD))
'''


@pytest.mark.parametrize("body, head, tolerance", [
    ("torch.bfloat16", "torch.float32", 2e-2),  # bf16 sums round at 3 digits
    ("torch.float64", "torch.float32", 1e-5),
])
def test_parameters_of_several_dtypes(tmp_path, body, head, tolerance):
    cell = MIXED_CELL.replace("BODY", body).replace("HEAD", head)
    expected = reference(cell, config(), steps=6)
    [alone] = train(cell, config(), 1, 6, tmp_path)
    for k in expected.params:  # one rank, one pass: exactly plain PyTorch
        assert torch.equal(alone.params[k], expected.params[k]), k
    ranks = train(cell, config(micro_batch=3), 2, 6, tmp_path)
    for got in ranks:
        assert {k: v.dtype for k, v in got.params.items()} == \
            {k: v.dtype for k, v in expected.params.items()}
        assert {k: v.dtype for k, v in got.grads.items()} == \
            {k: v.dtype for k, v in expected.params.items()}
        assert max_relative_deviation(got.params, expected.params) < tolerance
    for k in expected.params:
        assert torch.equal(ranks[0].params[k], ranks[1].params[k]), k


# ------------------------------------------------------------------------- sparse gradients

SPARSE_CELL = '''
import torch
g = torch.Generator().manual_seed(0)
bags = torch.randint(0, 40, (96, 4), generator=g)  # 40 rows: ranks share many of them
dataset = torch.utils.data.TensorDataset(bags, torch.randn(96, 1, generator=g, dtype=torch.float64))
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(1000, 8, mode="mean", sparse=True).double()
        self.rare = torch.nn.EmbeddingBag(1000, 1, sparse=True).double()
        self.head = torch.nn.Linear(8, 1).double()
    def forward(self, x):
        out = self.head(self.bag(x))
        rare = x[:, 0] < 4  # few samples use the `rare` bag: often none of a rank's share
        if rare.any():
            out = out + torch.where(rare[:, None], self.rare(x), 0)
        return out
model = Model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)
'''


def test_sparse_gradients_are_summed_as_sparse(tmp_path):
    expected = reference(SPARSE_CELL, config(), steps=8)
    ranks = train(SPARSE_CELL, config(micro_batch=5), 2, 8, tmp_path)
    moved = (expected.params["bag.weight"] - cell_namespace(SPARSE_CELL, 3)["model"].bag.weight)
    assert 0 < int((moved.abs().sum(1) > 0).sum()) <= 40  # rows the bags hit, and only those
    for got in ranks:
        assert got.sparse_grads["bag.weight"] and not got.sparse_grads["head.weight"]
        for k in expected.params:
            assert torch.allclose(got.params[k], expected.params[k], rtol=1e-10, atol=1e-12), k
            assert (got.grads[k] is None) == (expected.grads[k] is None), k
            if expected.grads[k] is not None:
                assert torch.allclose(got.grads[k], expected.grads[k], rtol=1e-10, atol=1e-12), k


def test_a_layout_that_cannot_be_reduced_is_refused_at_setup():
    cell = MIXED_CELL.replace("BODY", "torch.float32").replace("HEAD", "torch.float32")
    for extra, words in (
            ("model.extra = torch.nn.Parameter(torch.zeros(4, 4).to_sparse())", "torch.sparse_coo"),
            ("model.extra = torch.nn.Parameter(torch.zeros(4, dtype=torch.float8_e4m3fn))",
             "torch.float8_e4m3fn")):
        with pytest.raises(SetupError, match=f"parameter extra .*{words}"):
            Worker(cell_namespace(cell + extra, 0), config(steps=1), "cpu")


# ------------------------------------------------------------------------- unused parameters

UNUSED_CELL = '''
import torch
g = torch.Generator().manual_seed(0)
x = torch.randn(64, 4, generator=g, dtype=torch.float64)
rare = torch.zeros(64, dtype=torch.bool)
rare[RARE] = True  # the few samples that use the `rare` layer
y = torch.randn(64, 1, generator=g, dtype=torch.float64)
dataset = torch.utils.data.TensorDataset(x, y, rare)
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(4, 1)
        self.unused = torch.nn.Linear(4, 1)  # forward never uses it
        self.rare = torch.nn.Linear(4, 1)
        torch.nn.init.ones_(self.unused.weight), torch.nn.init.ones_(self.unused.bias)
    def forward(self, x, rare):
        out = self.head(x)
        if rare.any():  # a batch without rare samples gives the layer no gradient at all
            out = out + torch.where(rare[:, None], self.rare(x), 0)
        return out
model = Model().double()
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
def loss_fn(model, batch):
    x, y, rare = batch
    return torch.nn.functional.mse_loss(model(x, rare), y)
'''
RARE = [5, 40]


def _rare_shares(steps: int, world_size: int) -> list[set]:
    """For each step, the ranks whose share holds a rare sample."""
    plan, epoch, position, out = BatchPlan(64, 16, 3), 0, 0, []
    for _ in range(steps):
        batch = plan.batch(epoch, position).tolist()
        out.append({r for r in range(world_size)
                    if set(batch[rank_share(len(batch), r, world_size)]) & set(RARE)})
        epoch, position = plan.advance(epoch, position)
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_parameter_without_gradient_is_left_alone(tmp_path, world_size):
    cell = UNUSED_CELL.replace("RARE", repr(RARE))
    shares = _rare_shares(10, 2)
    # the rare layer has a gradient at some steps, none at others, and at some from one rank only
    assert any(shares) and not all(shares) and ({0} in shares or {1} in shares)
    expected = reference(cell, config(), steps=10)
    for got in train(cell, config(micro_batch=5), world_size, 10, tmp_path):
        for k in ("unused.weight", "unused.bias"):  # AdamW's weight decay never touched them
            assert torch.equal(got.params[k], torch.ones_like(got.params[k])), k
            assert got.grads[k] is None
        for k in expected.params:
            assert (got.grads[k] is None) == (expected.grads[k] is None), k
            assert torch.allclose(got.params[k], expected.params[k], rtol=1e-9, atol=1e-12), k
            if expected.grads[k] is not None:
                assert torch.allclose(got.grads[k], expected.grads[k], rtol=1e-9, atol=1e-12), k


# ------------------------------------------------------------------------- means over tokens

TOKENS_CELL = '''
import torch
from elastic_jupyter import MeanOver
g = torch.Generator().manual_seed(0)
N, T = 48, 6
lengths = torch.randint(-3, T + 1, (N,), generator=g).clamp_min(0)  # 40% hold no token
dataset = torch.utils.data.TensorDataset(torch.randn(N, T, 3, generator=g, dtype=torch.float64),
                                         torch.randn(N, T, generator=g, dtype=torch.float64),
                                         lengths)
model = torch.nn.Linear(3, 1).double()
optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
def loss_fn(model, batch):
    x, y, n = batch
    mask = torch.arange(T)[None, :] < n[:, None]
    error = model(x).squeeze(-1) - y
    return MeanOver((error ** 2)[mask].mean(), mask.sum()), {"abs_error": error.abs()[mask].mean()}
'''


def _token_means(batch_indices, model):
    """(squared error, abs error) as means over the tokens of these samples, and the count."""
    ns = cell_namespace(TOKENS_CELL, 3)
    x, y, n = ns["dataset"][batch_indices]
    mask = torch.arange(6)[None, :] < n[:, None]
    error = model(x).squeeze(-1) - y
    return (error ** 2)[mask].mean(), error.abs()[mask].mean(), int(mask.sum())


@pytest.mark.parametrize("world_size, micro_batch", [(1, None), (1, 5), (2, 1), (2, 3)])
def test_a_mean_over_tokens_is_the_mean_over_the_global_batch(tmp_path, world_size, micro_batch):
    steps = 10
    expected = reference(TOKENS_CELL, config(), steps)
    got = train(TOKENS_CELL, config(micro_batch=micro_batch), world_size, steps, tmp_path)
    for rank in got:
        for k in expected.params:
            assert torch.allclose(rank.params[k], expected.params[k], rtol=1e-10, atol=1e-12), k
    history = got[0].history
    assert [r["loss"] for r in history] == pytest.approx(expected.losses, rel=1e-12)
    # each record says how many tokens its loss is a mean over
    plan, epoch, position, model = BatchPlan(48, 16, 3), 0, 0, cell_namespace(TOKENS_CELL, 3)["model"]
    for record in history[:3]:
        assert record["items"] == _token_means(plan.batch(epoch, position), model)[2]
        epoch, position = plan.advance(epoch, position)
    # extra metrics are weighted like the loss: the step-1 abs error over all its tokens
    model = cell_namespace(TOKENS_CELL, 3)["model"]
    first = BatchPlan(48, 16, 3).batch(0, 0)
    with torch.no_grad():
        _, abs_error, _ = _token_means(first, model)
        # the mean of two halves' token means, weighted by samples, is not the answer
        halves = [_token_means(first[s], model) for s in (slice(0, 8), slice(8, 16))]
    assert history[0]["abs_error"] == pytest.approx(float(abs_error), rel=1e-12)
    assert abs(sum(h[0] for h in halves) / 2 - expected.losses[0]) > 1e-3 * expected.losses[0]


def test_mixing_mean_over_and_plain_losses_is_refused():
    # a plain loss for samples of odd length, MeanOver for the others
    cell = TOKENS_CELL.replace("return MeanOver(",
                               "return (lambda l, c: l if n.sum() % 2 else MeanOver(l, c))(")
    worker = Worker(cell_namespace(cell, 3), config(micro_batch=1, steps=1), "cpu")
    with pytest.raises(TypeError, match="MeanOver.* for some batches and a plain loss for others"):
        worker.train_step(0, 1)


# ------------------------------------------------------------------------- SyncBatchNorm, no items

# PeerStatistics stands in for SyncBatchNorm (which runs only on CUDA): its backward is a
# collective that every rank must join. Samples whose ITEMS flag is 0 hold no item.
SYNC_CELL = '''
import torch
import torch.distributed as dist
from elastic_jupyter import MeanOver
backward_calls = []
class PeerStatistics(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)
    @staticmethod
    def backward(ctx, grad):
        joined = torch.ones(())
        if dist.is_initialized():
            dist.all_reduce(joined)
            if int(joined) != dist.get_world_size():
                raise RuntimeError(f"{int(joined)} ranks joined the backward's collective")
        backward_calls.append(int(joined))
        return grad
g = torch.Generator().manual_seed(0)
N = 32
dataset = torch.utils.data.TensorDataset(torch.randn(N, 3, generator=g, dtype=torch.float64),
                                         torch.randn(N, generator=g, dtype=torch.float64), ITEMS)
model = torch.nn.Linear(3, 1).double()
optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
def loss_fn(model, batch):
    x, y, items = batch
    error = PeerStatistics.apply(model(x)).squeeze(-1) - y
    count = items.sum()
    return MeanOver((error ** 2 * items).sum() / DENOMINATOR, count)
'''


def _sync_cell(items: str, denominator: str = "count.clamp(min=1)") -> str:
    return SYNC_CELL.replace("ITEMS", items).replace("DENOMINATOR", denominator)


def _sync_worker(cell: str) -> tuple[Worker, dict]:
    """A Worker of `cell` with sync_batchnorm on (its setup would refuse it on CPU)."""
    ns = cell_namespace(cell, 3)
    worker = Worker(ns, config(steps=1, micro_batch=8), "cpu")  # 2 micro-batches a step
    worker.config = dataclasses.replace(worker.config, sync_batchnorm=True)
    return worker, ns


def test_sync_batchnorm_runs_the_backward_of_a_pass_without_items():
    worker, ns = _sync_worker(_sync_cell("torch.zeros(N)"))
    worker.reducer.begin_step()
    batch = worker.plan.batch(0, 0)
    assert len(worker.plan.rank_micro_batches(batch, 0, 1)) == 2
    parts = worker._passes(batch, 0, 1)
    loss, extras = worker._local_pass(parts, len(batch), 0, 1, worker.objects.substeps[0], [])
    assert ns["backward_calls"] == [1]  # one pass: the rank's share at once
    assert (loss, extras) == (0.0, [])
    worker.reducer.drop_unused(worker.reducer.finish(1))  # its pass added nothing: no
    # parameter has a gradient
    assert [p.grad for p in worker.model.parameters()] == [None, None]


def test_sync_batchnorm_refuses_a_nan_loss_without_items():
    worker, ns = _sync_worker(_sync_cell("torch.zeros(N)", denominator="count"))  # 0 / 0
    with pytest.raises(ValueError) as refused:
        worker.train_step(0, 1)
    assert str(refused.value) == (
        "loss_fn returned a loss of nan with a MeanOver count of 0 at step 1: with "
        "--sync-batchnorm every rank's pass takes part in SyncBatchNorm's backward, so loss_fn "
        "must return a finite loss for a batch with no items (e.g. divide by "
        "count.clamp(min=1))")
    assert ns["backward_calls"] == []


def test_sync_batchnorm_with_a_rank_without_items_matches_its_peers(tmp_path):
    # rank 0's share of every step of the first epoch holds no item, rank 1's only items
    plan, rank1 = BatchPlan(32, 16, 3, Cut("pass_cost", pass_cost=0.0, max_size=2)), []
    for position in (0, 16):
        rank1 += [int(i) for _, part in plan.rank_micro_batches(plan.batch(0, position), 1, 2)
                  for i in part]
    cell = _sync_cell(f"torch.zeros(N).index_fill_(0, torch.tensor({rank1}), 1.0)")
    cfg = config(pool_max_size=2, pass_cost=0.0, late={"sync_batchnorm": True})  # as SyncBN sets
    expected = reference(cell, cfg, 2)
    for rank in train(cell, cfg, 2, 2, tmp_path):
        for k in expected.params:
            assert torch.allclose(rank.params[k], expected.params[k], rtol=1e-10, atol=1e-12), k


# ------------------------------------------------------------------------- all of it, on the pool

REAL_MODEL_CELL = '''
import collections
import torch
from elastic_jupyter import MeanOver
Tokens = collections.namedtuple("Tokens", "ids targets mask")
g = torch.Generator().manual_seed(0)
N, T = 96, 5
ids = torch.randint(0, 50, (N, T), generator=g)
targets = torch.randn(N, T, generator=g)
mask = torch.arange(T)[None, :] < torch.randint(1, T + 1, (N,), generator=g)[:, None]
dataset = torch.utils.data.TensorDataset(ids, targets, mask)
def collate_fn(samples):
    return Tokens(*torch.utils.data.default_collate(samples))
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(1000, 8, sparse=True)
        self.head = torch.nn.Linear(8, 1)
        self.unused = torch.nn.Linear(8, 1)
        torch.nn.init.ones_(self.unused.weight), torch.nn.init.ones_(self.unused.bias)
    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids))).squeeze(-1)
model = Model()
optimizer = torch.optim.SGD([{"params": model.embed.parameters()},  # sparse: no weight decay
                             {"params": [*model.head.parameters(), *model.unused.parameters()],
                              "weight_decay": 0.1}], lr=0.5)
def loss_fn(model, batch):
    assert isinstance(batch, Tokens)
    error = (model(batch.ids) - batch.targets)[batch.mask]
    autocast = float(torch.is_autocast_enabled("cpu"))
    return MeanOver((error ** 2).mean(), batch.mask.sum()), {"autocast": autocast}
'''


def test_a_real_model_trains_on_the_pool_as_in_plain_pytorch(idle_pool, tmp_path):
    """A namedtuple batch, a sparse embedding, an unused layer, a mean over tokens, bf16."""
    from elastic_jupyter import RunConfig, TrainingRun
    options = dict(global_batch=16, micro_batch=3, seed=5, precision="bf16")
    run = TrainingRun(idle_pool, RunConfig(name="real-model", steps=8, checkpoint_every=0,
                                           **options),
                      source=REAL_MODEL_CELL, engines=2, workspace=str(tmp_path)).start()
    assert run.wait(timeout=120) == "finished", run.logs()
    expected = reference(REAL_MODEL_CELL, config(**options), steps=8)
    got = run.state_dict()
    assert torch.equal(got["unused.weight"], torch.ones(1, 8))
    assert max_relative_deviation(got, expected.params) < 2e-2
    assert [r["loss"] for r in run.history] == pytest.approx(expected.losses, rel=2e-2)
    assert [r["autocast"] for r in run.history] == pytest.approx([1.0] * 8)  # token-weighted
