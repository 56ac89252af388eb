"""Summing gradients across the ranks of a generation, the way torch's DDP sums them.

- Dense gradients live in flat buckets of at most BUCKET_BYTES per (device, dtype), the
  parameters in reverse order (roughly the order backward produces their gradients): each
  parameter's ``.grad`` is a view of its bucket, so backward accumulates into the bucket and a
  bucket is all-reduced in place, with no copy of the gradients (DDP's
  ``gradient_as_bucket_view``). A bf16 body and an fp32 head are each reduced in their own dtype.
- The reduction overlaps the rank's last backward pass of the step: when every parameter of a
  bucket has its gradient (a post-accumulate-grad hook per parameter says so), the bucket's
  all-reduce starts while backward goes on. Buckets start strictly in index order on every
  rank, so ranks issue the same collectives in the same order even when they produce gradients
  in different orders; buckets still waiting when backward ends (a parameter this rank did not
  use) start then. Buckets first follow the reverse order of the parameters; after a
  generation's first step they are rebuilt once in the order rank 0's gradients became ready
  (:meth:`GradReducer.sync_order`, called by ``Worker.start_generation`` and ``train_step``), with
  parameters it did not use last, so a layer the forward skips does not hold back every bucket
  behind it. DDP rebuilds its buckets the same way after its first iteration. This is DDP's reducer
  design (Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB
  2020); it is written here rather than wrapping the model in DDP because a rank may run several
  micro-batches or none in a step, and DDP's reducer needs a forward and backward on every rank.
- Parameters of ``Embedding``/``EmbeddingBag`` layers with ``sparse=True`` get sparse gradients:
  their indices and values are gathered from every rank and summed as a sparse tensor. As in DDP,
  which parameters are sparse is decided once at setup, so every rank runs the same collectives
  even when some rank has no gradient for a parameter.
- A parameter no rank produced a gradient for keeps ``.grad = None``, as in plain PyTorch (so an
  optimizer does not decay it): each rank's per-parameter "has a gradient" flags (from the
  hooks) are summed by the step's commit vote (engine.group.vote), with the step's other scalars.

With one rank nothing is sent; the gradients are what backward accumulated.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from .collective import collective

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb: big enough to amortise a collective

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64,
                    torch.complex64, torch.complex128)


class LayoutError(ValueError):
    """A parameter whose gradient this package cannot reduce (said at setup, not at step 1)."""


def _sparse_parameters(model: torch.nn.Module) -> set[int]:
    """ids of the parameters whose gradients are sparse: DDP's rule, the layers' own flag."""
    return {id(m.weight) for m in model.modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse}


def _check_layout(name: str, p: torch.Tensor) -> None:
    if p.layout != torch.strided:
        raise LayoutError(f"parameter {name} is a {p.layout} tensor: only dense (strided) "
                          "parameters can be trained; sparse gradients come from "
                          "Embedding/EmbeddingBag(sparse=True) over a dense weight")
    if p.dtype not in SUPPORTED_DTYPES:
        raise LayoutError(f"parameter {name} has dtype {p.dtype}: gradients can be reduced in "
                          f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}; keep a master copy "
                          "in one of them")


class _Bucket:
    """Parameters of one device and dtype whose gradients are views of one flat buffer."""

    def __init__(self, params: list):
        self.params = params
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                device=params[0].device)
        self.views = []  # (start, stop) of each parameter's gradient in `flat`
        offset = 0
        for p in params:
            self.views.append((offset, offset + p.numel()))
            offset += p.numel()
        self.ready: set = set()  # ids of the parameters whose gradient of the last pass is in
        self.owner: int | None = None  # the optimizer that steps its parameters (_buckets)

    def attach(self) -> None:
        """Zero the buffer and make each parameter's ``.grad`` its view of it."""
        self.flat.zero_()
        self.ready = set()
        for p, (start, stop) in zip(self.params, self.views):
            p.grad = self.flat[start:stop].view_as(p)

    def gather(self) -> None:
        """Put gradients backward did not accumulate in place into the buffer (a gradient set
        by the user's code, or one autograd replaced): the all-reduce reads the buffer."""
        for p, (start, stop) in zip(self.params, self.views):
            view = self.flat[start:stop]
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr() or p.grad.is_sparse:
                grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
                view.copy_(grad.reshape(-1))
            p.grad = view.view_as(p)


def _buckets(params: list, limit: int, owners: dict[int, int]) -> list[_Bucket]:
    """Buckets of at most `limit` bytes per (device, dtype, owner: `owners[id(p)]`, the
    optimizer that steps the parameter), in the order of `params`."""
    groups: dict = {}
    for p in params:
        groups.setdefault((p.device, p.dtype, owners.get(id(p))), []).append(p)
    buckets = []
    for group in groups.values():
        current: list[torch.Tensor] = []
        used = 0
        for p in group:
            nbytes = p.numel() * p.element_size()
            if current and used + nbytes > limit:
                buckets.append(_Bucket(current))
                current, used = [], 0
            current.append(p)
            used += nbytes
        buckets.append(_Bucket(current))
    for bucket in buckets:
        bucket.owner = owners.get(id(bucket.params[0]))
    return buckets


class Reducer(Protocol):
    """The step protocol of a gradient reduction, which both state modes' reducers follow
    (GradReducer here, engine.sharded.reduce_scatter.ShardedReducer): what the Worker and the
    weighting call, so neither asks which reducer it holds."""

    params: list

    def close(self) -> None: ...
    def overlaps(self) -> bool: ...
    def sync_order(self, world_size: int) -> None: ...
    def begin_step(self, owner: int | None = None) -> None: ...
    def last_pass(self, overlap: bool) -> None: ...
    def forget_pass(self) -> None: ...
    def flush(self, world_size: int) -> None: ...
    def finish(self, world_size: int) -> list[float]: ...
    def clip(self, parameters: Any, max_norm: float) -> None: ...
    def drop_unused(self, counts: list[float]) -> None: ...
    def scale(self, factor: float) -> None: ...

    def collective_backward(self, sync_batchnorm: bool) -> tuple[str, str] | None:
        """(the option, the layer) that makes every pass's backward a collective, which a rank
        must then run even for a pass that weighs nothing; None when a backward is local."""

    def backward_at_zero_weight(self, loss: torch.Tensor, backward: Callable[[torch.Tensor],
                                                                              None]) -> None:
        """Run `backward` of `loss` * 0 for the peers' collectives; the pass's parameters do not
        count as used."""


class GradReducer:
    """The reduction of one model's gradients: dense buckets, sparse parameters, usage.

    Per step, on every rank of the generation: :meth:`begin_step` (instead of
    ``optimizer.zero_grad``), the backward passes of the rank's micro-batches with
    :meth:`last_pass` called before the last one's backward, then :meth:`finish`, the commit
    vote, and :meth:`drop_unused` with the vote's sums.

    Args:
        model: the module whose trainable parameters (``requires_grad``) are reduced; build the
            reducer after the model reached its device.
        device: the rank's device; the sparse gradients' sizes travel there.
        bucket_bytes: the most bytes of gradients in one bucket.
        owners: with several optimizers (engine.step.optimizers), the index of the one that steps
            each parameter, by ``id``: a bucket holds one optimizer's parameters, and a
            sub-step (``begin_step(owner)``) sums only its optimizer's buckets.
    Raises:
        LayoutError: a parameter that is not dense or has a dtype outside SUPPORTED_DTYPES.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device,
                 bucket_bytes: int = BUCKET_BYTES, owners: dict[int, int] | None = None):
        self.device = device
        self._owners = owners or {}
        self._owner: int | None = None  # the sub-step's optimizer (begin_step)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        for name, p in named:
            _check_layout(name, p)
        sparse_ids = _sparse_parameters(model)
        self.params = [p for _, p in named]
        self.sparse = [p for p in self.params if id(p) in sparse_ids]
        self._bucket_bytes = bucket_bytes
        self._build([i for i in reversed(range(len(self.params)))
                     if id(self.params[i]) not in sparse_ids])
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._names = {id(p): n for n, p in named}
        self._ready_order: list[int] = []  # parameter indices, as the last pass produced them
        self._used: set = set()  # ids of parameters that got a gradient this step
        self._in_last = False  # the rank's last backward of the step is running
        self._fired: set = set()  # ids of the parameters whose gradient came in that pass
        self._overlap = False  # ... and ready buckets start during it
        # whether each gradient comes once per backward (None: not seen yet); reentrant
        # activation checkpointing runs a layer's backward twice, and a bucket started after
        # the first would send half a gradient
        self._once: bool | None = None
        self._late: str | None = None  # a parameter whose bucket started before its gradient
        self._next = 0  # the next bucket to start; buckets start in index order only
        self._works: list = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient)
                       for p in self.params]

    def close(self) -> None:
        """Remove the hooks from the parameters: a model that outlives its run (a notebook
        variable pushed to the engines) must not keep this reducer's buckets alive."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _build(self, order: list[int]) -> None:
        """Buckets of the dense parameters, in `order` (indices into ``self.params``)."""
        self._order = order
        self.buckets = _buckets([self.params[i] for i in order], self._bucket_bytes,
                                self._owners)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}

    @property
    def overlaps(self) -> bool:
        """Whether buckets start during backward: once a step showed each gradient comes once
        per backward pass (not with reentrant activation checkpointing)."""
        return self._once is True

    @property
    def started(self) -> int:
        """Buckets whose all-reduce has started in this step (they start in index order)."""
        return self._next

    def sync_order(self, world_size: int) -> None:
        """Rebuild the buckets in the order rank 0's gradients became ready in its last pass
        (parameters it did not use last; without a pass yet, the reverse order of the
        parameters). All ranks call it between the same two steps: at a generation's start,
        where newcomers' buckets must match the survivors', and after its first step. With
        one rank it does nothing. Raises PeerFailure when a peer fails meanwhile."""
        if world_size == 1:
            return
        dense = set(self._order)
        box = [[i for i in self._ready_order if i in dense]]
        with collective("gradient bucket order"):
            dist.broadcast_object_list(box, src=0)
        seen = set(box[0])
        order = box[0] + [i for i in reversed(range(len(self.params)))
                          if i in dense and i not in seen]
        if order != self._order:  # new buckets cost memory while the old gradients live
            self._build(order)

    def begin_step(self, owner: int | None = None) -> None:
        """Start a step: every dense gradient a zeroed view of its bucket, sparse ones None.
        With `owner`, a sub-step of optimizer `owner` (every rank runs the same): the buckets
        of another optimizer's parameters are not summed, and :meth:`finish` leaves their
        gradients None (that optimizer does not step now: in a GAN's generator step, the
        discriminator's gradients are not needed)."""
        self._owner = owner
        # all-reduces a failed step left behind belong to a destroyed process group, whose
        # destruction waited for them: nothing writes into the buckets any more
        self._works = []
        self._in_last, self._late = False, None
        for bucket in self.buckets:
            bucket.attach()
        for p in self.sparse:
            p.grad = None
        self._used.clear()
        self._overlap, self._next = False, 0

    def last_pass(self, overlap: bool) -> None:
        """The rank's last backward of the step comes next; with `overlap` (peers to sum with,
        and no other collective inside backward, as SyncBatchNorm's) buckets start as they
        fill, once a step has shown that each gradient comes once per backward."""
        self._in_last, self._fired = True, set()
        self._overlap = overlap and self._once is True
        self._ready_order = []

    def forget_pass(self) -> None:
        """The backward that just ran, the step's only one and run without overlap, added
        nothing (a zero-weight backward run so that collectives inside it match): its
        gradients are zeroed (0 * inf is NaN) and its parameters count as unused."""
        for bucket in self.buckets[self._next:]:
            bucket.flat.zero_()
        self._used.clear()


    def collective_backward(self, sync_batchnorm: bool) -> tuple[str, str] | None:
        """A pass's backward is local, unless SyncBatchNorm's backward gathers statistics."""
        return ("--sync-batchnorm", "SyncBatchNorm") if sync_batchnorm else None

    def backward_at_zero_weight(self, loss: torch.Tensor,
                                backward: Callable[[torch.Tensor], None]) -> None:
        """The backward of a pass without items under --sync-batchnorm: it adds zeros, and
        forgets which parameters it reached (:meth:`forget_pass`)."""
        backward(loss * 0.0)
        self.forget_pass()
    def _on_gradient(self, p: torch.Tensor) -> None:
        self._used.add(id(p))
        if not self._in_last:
            return
        bucket = self._bucket_of.get(id(p))
        if id(p) in self._fired:  # a second gradient in one backward
            self._once = False
            if bucket is not None and self.buckets.index(bucket) < self._next:
                self._late = self._names[id(p)]
            return
        self._fired.add(id(p))
        self._ready_order.append(self._index[id(p)])
        if bucket is None:
            return
        bucket.ready.add(id(p))
        while self._overlap and self._next < len(self.buckets) and (
                self._skipped(self.buckets[self._next])
                or len(self.buckets[self._next].ready) == len(self.buckets[self._next].params)):
            self._start(self._next)

    def _skipped(self, bucket: _Bucket) -> bool:
        """Whether `bucket` holds another optimizer's parameters than the sub-step's."""
        return self._owner is not None and bucket.owner not in (None, self._owner)

    def flush(self, world_size: int) -> None:
        """Start every bucket not started yet. Call it after the rank's backward passes and
        before any other collective of the step: ranks start buckets during backward as their
        gradients come in, so only then do all ranks have the same collectives in flight.

        Raises RuntimeError when a parameter got a second gradient in one backward after its
        bucket had started (a graph that changed to run a layer's backward twice)."""
        if self._in_last and self._once is None:
            self._once = True  # this pass had each gradient once (a repeat set it False)
        self._in_last = self._overlap = False
        late, self._late = self._late, None
        if late is not None:
            raise RuntimeError(
                f"parameter {late} got a second gradient in one backward pass after its "
                "gradients were being summed across ranks (a layer's backward run twice, as "
                "reentrant activation checkpointing does, in a step after others that did "
                "not): use torch.utils.checkpoint with use_reentrant=False")
        if world_size > 1:
            while self._next < len(self.buckets):
                self._start(self._next)

    def _start(self, index: int) -> None:
        bucket = self.buckets[index]
        if not self._skipped(bucket):
            bucket.gather()
            with collective("gradient all-reduce"):
                self._works.append(dist.all_reduce(bucket.flat, async_op=True))
        self._next = index + 1


    def finish(self, world_size: int) -> list[float]:
        """Complete the sum of every rank's gradients: start the buckets not started yet, wait
        for all of them, gather the sparse gradients. All ranks of the group call it after
        their backward passes.

        Returns this rank's "has a gradient" flag (1.0 or 0.0) per trainable parameter, in
        ``self.params`` order: the step's vote sums them across ranks (engine.group.vote), and
        :meth:`drop_unused` takes the sums. Raises PeerFailure when a peer fails meanwhile.
        """
        self.flush(world_size)
        if world_size == 1:
            for bucket in self.buckets:
                bucket.gather()
        else:
            # the first host read is inside too: with nccl a peer's failure can surface there
            with collective("gradient all-reduce"):
                works, self._works = self._works, []
                for work in works:
                    work.wait()
            self._reduce_sparse(world_size)
        for bucket in self.buckets:
            if self._skipped(bucket):  # this rank's own sums: no one may read them
                for p in bucket.params:
                    p.grad = None
        return [float(id(p) in self._used) for p in self.params]

    def clip(self, parameters, max_norm: float) -> None:
        """Clip the summed gradients of `parameters` to the norm `max_norm`
        (``torch.nn.utils.clip_grad_norm_``: every rank holds the same gradients)."""
        torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def drop_unused(self, counts: list[float]) -> None:
        """``.grad = None`` for each dense parameter that no rank produced a gradient for;
        `counts` are the ranks' flags from :meth:`finish`, summed."""
        for p, n in zip(self.params, counts):
            if not n and id(p) in self._bucket_of:
                p.grad = None

    def _reduce_sparse(self, world_size: int) -> None:
        """Gather the sparse gradients' indices and values from every rank and sum them; a
        parameter no rank produced a gradient for gets ``.grad = None``."""
        if not self.sparse:
            return
        local = [_local_sparse(p) for p in self.sparse]
        k = len(local)  # per parameter: its nonzero count, then whether it had a gradient
        meta = torch.tensor([len(g.values()) for g in local] +
                            [int(id(p) in self._used) for p in self.sparse],
                            dtype=torch.int64, device=self.device)
        every = [torch.empty_like(meta) for _ in range(world_size)]
        with collective("sparse gradient gather"):
            dist.all_gather(every, meta)
            rows = torch.stack(every).tolist()  # [rank][nonzero counts..., flags...]
        for j, (p, grad) in enumerate(zip(self.sparse, local)):
            sizes = [row[j] for row in rows]
            if not any(row[k + j] for row in rows):
                p.grad = None
                continue
            if not max(sizes):  # every rank's gradient is empty: so is the sum
                p.grad = grad
                continue
            indices = _gather_padded(grad.indices(), 1, sizes)
            values = _gather_padded(grad.values(), 0, sizes)
            p.grad = torch.sparse_coo_tensor(torch.cat(indices, 1), torch.cat(values),
                                             p.shape).coalesce()

    def scale(self, factor: float) -> None:
        """Multiply every gradient by `factor` (a mean over items: divide after the sum)."""
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(factor)


def _local_sparse(p: torch.Tensor) -> torch.Tensor:
    """This rank's gradient of the sparse parameter `p`, coalesced (empty when it has none)."""
    if p.grad is None:
        grad = torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.int64, device=p.device),
                                       torch.empty(0, *p.shape[1:], dtype=p.dtype,
                                                   device=p.device), p.shape)
    else:
        grad = p.grad if p.grad.is_sparse else p.grad.to_sparse(1)
    return grad.coalesce()


def _gather_padded(t: torch.Tensor, dim: int, sizes: list[int]) -> list[torch.Tensor]:
    """Every rank's `t`, of `sizes[r]` entries along `dim` (padded to the largest to gather)."""
    shape = list(t.shape)
    shape[dim] = max(sizes)
    padded = t.new_zeros(shape)
    padded.narrow(dim, 0, t.shape[dim]).copy_(t)
    out = [torch.empty_like(padded) for _ in sizes]
    with collective("sparse gradient gather"):
        dist.all_gather(out, padded)
    return [o.narrow(dim, 0, n) for o, n in zip(out, sizes)]
