"""The gradient reduction itself (engine.group.reduce), on a real gloo group of 3 processes: buckets
start while the last backward runs, in the same order on every rank even when ranks produce
gradients in different orders, and the result is the sum of every rank's gradients."""
import torch
import torch.distributed as dist
from worlds import spawn

from elastic_jupyter.engine.group.reduce import GradReducer
from elastic_jupyter.engine.group.vote import Vote


def _reduce(reducer: GradReducer, scalars: list[float], world_size: int, vote=None) -> list:
    """A step's reduction as Worker.train_step runs it: finish, the vote's sums, unused ones
    dropped; returns the summed scalars."""
    flags = reducer.finish(world_size)
    summed = vote.sum([*scalars, *flags]) if vote else [*scalars, *flags]
    reducer.drop_unused(summed[len(scalars):])
    return summed[:len(scalars)]


class Model(torch.nn.Module):
    """float64 layers, a bfloat16 one, a head only rank 1 uses, a layer nobody uses."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4).double() for _ in range(4))
        self.low = torch.nn.Linear(4, 4).to(torch.bfloat16)
        self.rank1_head = torch.nn.Linear(4, 1).double()
        self.unused = torch.nn.Linear(4, 1).double()

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        order = self.layers if rank != 2 else list(reversed(self.layers))  # other orders
        for layer in order:
            x = torch.tanh(layer(x))
        x = self.low(x.to(torch.bfloat16)).double()
        out = x.pow(2).mean()
        return out + self.rank1_head(x).mean() if rank == 1 else out


def _backward(model, rank, micro_batch):
    torch.manual_seed(100 * rank + micro_batch)
    model(torch.randn(3, 4, dtype=torch.float64), rank).backward()


def _rank(rank: int, store: str, out: str) -> None:
    files = dist.FileStore(store, 3)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg/", files), rank=rank,
                            world_size=3)
    vote = Vote(dist.PrefixStore("control/", files), rank, 3, 60.0)
    try:
        torch.manual_seed(0)
        model = Model()
        torch.manual_seed(0)
        plain = Model()  # the same values, reduced the plain way
        reducer = GradReducer(model, torch.device("cpu"), bucket_bytes=48)  # 1-2 tensors each
        started = []
        for step in range(2):  # the second step runs in buckets rebuilt in rank 0's order
            reducer.begin_step()
            _backward(model, rank, 0)
            reducer.last_pass(True)
            _backward(model, rank, 1)
            started.append(reducer.started)
            summed = _reduce(reducer, [float(rank)], 3, vote)
            if step == 0:
                reducer.sync_order(3)
        for p in plain.parameters():
            p.grad = None
        _backward(plain, rank, 0)
        _backward(plain, rank, 1)
        expected = {}
        for name, p in plain.named_parameters():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad)
            expected[name] = grad
        got = {n: p.grad for n, p in model.named_parameters()}
        # a newcomer joins: at the generation's start it takes rank 0's bucket layout
        names = {id(p): n for n, p in model.named_parameters()}
        if rank == 2:
            model = Model()
            names = {id(p): n for n, p in model.named_parameters()}
            reducer = GradReducer(model, torch.device("cpu"), bucket_bytes=48)
        reducer.sync_order(3)
        layouts = [None] * 3
        dist.all_gather_object(layouts, [[names[id(p)] for p in b.params] for b in reducer.buckets])
        torch.save((started, len(reducer.buckets), summed, got, expected, layouts),
                   f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_buckets_start_during_backward_and_sum_every_rank(tmp_path):
    spawn(_rank, (str(tmp_path / "store"), str(tmp_path)), 3)
    for rank in range(3):
        started, buckets, summed, got, expected, layouts = torch.load(tmp_path / f"rank{rank}.pt")
        assert layouts[0] == layouts[1] == layouts[2]  # the newcomer's too
        assert summed == [3.0]  # the scalars: 0 + 1 + 2
        # first the unused layer, registered last, holds back every bucket behind it; once
        # rebuilt in rank 0's order, the buckets start during backward (the unused one waits)
        assert buckets >= 6 and started[0] == 0 and 0 < started[1] < buckets, started
        assert got["unused.weight"] is None and got["unused.bias"] is None
        for name, grad in expected.items():
            if not name.startswith("unused"):
                tolerance = 1e-2 if name.startswith("low") else 1e-12
                assert torch.allclose(got[name], grad, rtol=tolerance, atol=tolerance), name
        assert got["rank1_head.weight"].abs().sum() > 0  # rank 1's alone, summed in


def test_a_closed_reducer_lets_go_of_the_model():
    """A model that outlives its run (a pushed notebook variable) holds no reducer after it."""
    import gc
    import weakref
    model = torch.nn.Linear(3, 1)
    reducer = GradReducer(model, torch.device("cpu"))
    reducer.begin_step()
    model(torch.ones(2, 3)).sum().backward()
    assert _reduce(reducer, [], 1) == [] and model.weight.grad is not None
    gone = weakref.ref(reducer)
    reducer.close()
    del reducer
    gc.collect()
    assert gone() is None
    model(torch.ones(2, 3)).sum().backward()  # plain PyTorch again: no hook left to call


def _checkpointed_step(reentrant: bool) -> GradReducer:
    """One step of a model whose shared layer runs in two checkpointed segments."""
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    shared, head = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    model = torch.nn.ModuleList([shared, head])
    reducer = GradReducer(model, torch.device("cpu"))
    reducer.begin_step()
    reducer.last_pass(True)
    x = torch.ones(2, 3, requires_grad=True)
    h = checkpoint(shared, x, use_reentrant=reentrant)
    h = checkpoint(shared, h, use_reentrant=reentrant)
    head(h).sum().backward()
    _reduce(reducer, [], 1)
    return reducer


def test_a_gradient_that_comes_twice_in_one_backward_turns_overlap_off():
    """Reentrant checkpointing runs the shared layer's backward twice: a bucket started after
    the first would carry half its gradient, so buckets then start only after backward."""
    assert _checkpointed_step(reentrant=True).overlaps is False
    assert _checkpointed_step(reentrant=False).overlaps is True


def _gan_rank(rank: int, store: str, out: str) -> None:
    """Two sub-steps of a GAN (discriminator, then generator through it) on 2 ranks, with
    each optimizer's parameters in buckets of their own; every all-reduce's elements counted."""
    files = dist.FileStore(store, 2)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg/", files), rank=rank,
                            world_size=2)
    try:
        torch.manual_seed(0)
        g, d = torch.nn.Linear(3, 4).double(), torch.nn.Linear(4, 1).double()
        model = torch.nn.ModuleDict({"g": g, "d": d})
        owners = {id(p): k for k, part in enumerate((d, g)) for p in part.parameters()}
        reducer = GradReducer(model, torch.device("cpu"), owners=owners)
        sent, all_reduce = [], dist.all_reduce

        def counted(tensor, *args, **kwargs):
            sent.append(tensor.numel())
            return all_reduce(tensor, *args, **kwargs)
        dist.all_reduce = counted
        torch.manual_seed(rank)
        z, real = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
        got = []
        for owner, loss in ((0, lambda: d(real).mean() - d(g(z).detach()).mean()),
                            (1, lambda: d(g(z)).mean())):
            reducer.begin_step(owner)
            reducer.last_pass(True)
            loss().backward()
            _reduce(reducer, [], 2)
            got.append({n: None if p.grad is None else p.grad.clone()
                        for n, p in model.named_parameters()})
        expected = []  # the plain way: every gradient summed
        for loss in (lambda: d(real).mean() - d(g(z).detach()).mean(), lambda: d(g(z)).mean()):
            model.zero_grad(set_to_none=True)
            loss().backward()
            sums = {}
            for name, p in model.named_parameters():
                sums[name] = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                all_reduce(sums[name])
            expected.append(sums)
        torch.save((sent, got, expected, [b.owner for b in reducer.buckets]),
                   f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_a_sub_step_sums_only_its_optimizers_buckets(tmp_path):
    spawn(_gan_rank, (str(tmp_path / "store"), str(tmp_path)), 2)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for sent, got, expected, owners in results:
        assert sorted(owners) == [0, 1]  # a bucket per optimizer: d's, g's
        # the discriminator's step sums its 5 gradients, the generator's its 16: not all 21
        assert sent == [5, 16], sent
        for step, own in ((0, "d."), (1, "g.")):
            for name, grad in got[step].items():
                if name.startswith(own):  # the sum a plain all-reduce gives
                    assert torch.allclose(grad, expected[step][name], rtol=1e-12), name
                else:  # the other optimizer's: not summed, so left None
                    assert grad is None, name
