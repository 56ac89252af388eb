"""Summing gradients across the ranks of a generation, the way torch's DDP sums them.

- Dense gradients go in one bucket per (device, dtype): a bf16 body and an fp32 head are each
  reduced in their own dtype, and every parameter gets its gradient back in its own dtype.
- Parameters of ``Embedding``/``EmbeddingBag`` layers with ``sparse=True`` get sparse gradients:
  their indices and values are gathered from every rank and summed as a sparse tensor. As in DDP,
  which parameters are sparse is decided once at setup, so every rank runs the same collectives
  even when some rank has no gradient for a parameter.
- A parameter no rank produced a gradient for keeps ``.grad = None``, as in plain PyTorch (so an
  optimizer does not decay it): a per-parameter "has a gradient" count is summed with the rest.

A few scalars of the step (the leave flag, the sample or item count, loss, extra metrics) and the
has-gradient counts ride in the float64 bucket, else the float32 one, so a plain model still
reduces in one collective per step; a model with neither sends them in a float64 collective of
their own. With one rank nothing is sent and the gradients stay exactly as backward left them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .collective import collective

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


class GradReducer:
    """The reduction layout of one model: dense buckets per (device, dtype), sparse parameters.

    Args:
        model: the module whose trainable parameters (``requires_grad``) are reduced; build the
            reducer after the model reached its device.
        device: the rank's device; the scalars travel there.
    Raises:
        LayoutError: a parameter that is not dense or has a dtype outside SUPPORTED_DTYPES.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.device = device
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        for name, p in named:
            _check_layout(name, p)
        sparse_ids = _sparse_parameters(model)
        self.params = [p for _, p in named]
        self.sparse = [p for p in self.params if id(p) in sparse_ids]
        buckets: dict = {}
        for p in self.params:
            if id(p) not in sparse_ids:
                buckets.setdefault((p.device, p.dtype), []).append(p)
        self.buckets = list(buckets.values())
        carriers = [i for dtype in (torch.float64, torch.float32)
                    for i, b in enumerate(self.buckets)
                    if b[0].dtype == dtype and b[0].device == device]
        self._carrier = carriers[0] if carriers else None

    def reduce(self, scalars: list[float], world_size: int) -> list[float]:
        """Sum every rank's gradients into each parameter's ``.grad``, and `scalars`.

        All ranks of the current process group call it with the same number of scalars.
        Returns the summed scalars. Raises PeerFailure when a peer fails meanwhile.
        """
        if world_size == 1:
            return list(scalars)
        has_grad = [float(p.grad is not None) for p in self.params]
        tail = torch.tensor([*scalars, *has_grad], device=self.device,
                            dtype=torch.float64 if self._carrier is None
                            else self.buckets[self._carrier][0].dtype)
        flats = [self._flatten(b, tail if i == self._carrier else None)
                 for i, b in enumerate(self.buckets)]
        # the first host read is inside too: with nccl a peer's failure can surface there
        with collective("gradient all-reduce"):
            for flat in flats:
                dist.all_reduce(flat)
            if self._carrier is None:
                dist.all_reduce(tail)
            if self._carrier is not None:
                tail = flats[self._carrier][-len(tail):]
            summed = tail.tolist()
        used = {id(p) for p, n in zip(self.params, summed[len(scalars):]) if n > 0}
        for bucket, flat in zip(self.buckets, flats):
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad = flat[offset:offset + n].view_as(p) if id(p) in used else None
                offset += n
        self._reduce_sparse(world_size, used)
        return summed[:len(scalars)]

    @staticmethod
    def _flatten(bucket: list, tail: torch.Tensor | None) -> torch.Tensor:
        """One buffer: each parameter's local gradient (zeros where it has none), then `tail`."""
        sizes = [p.numel() for p in bucket]
        flat = torch.zeros(sum(sizes) + (len(tail) if tail is not None else 0),
                           dtype=bucket[0].dtype, device=bucket[0].device)
        offset = 0
        for p, n in zip(bucket, sizes):
            if p.grad is not None:  # a sparse gradient on a dense parameter is summed densely
                grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
                flat[offset:offset + n].copy_(grad.reshape(-1))
            offset += n
        if tail is not None:
            flat[offset:].copy_(tail)
        return flat

    def _reduce_sparse(self, world_size: int, used: set) -> None:
        """Gather the sparse gradients' indices and values from every rank and sum them."""
        if not self.sparse:
            return
        local = [_local_sparse(p) for p in self.sparse]
        nnz = torch.tensor([len(g.values()) for g in local], dtype=torch.int64,
                           device=self.device)
        every = [torch.empty_like(nnz) for _ in range(world_size)]
        with collective("sparse gradient gather"):
            dist.all_gather(every, nnz)
            counts = torch.stack(every).tolist()  # [rank][parameter]
        for j, (p, grad) in enumerate(zip(self.sparse, local)):
            sizes = [row[j] for row in counts]
            if id(p) not in used:
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
