"""Mixed precision (``--precision bf16|fp16``): autocast around ``loss_fn``, and for fp16 a
gradient scaler whose skip decision is the same on every rank.

The scaler scales each micro-batch's loss before backward; the scaled gradients are summed
across ranks first and unscaled (and checked for inf/NaN) only after that, so every rank looks
at the same reduced gradients and skips, or takes, the same steps. Its state (scale, growth
tracker) is part of the training state.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class PrecisionError(ValueError):
    """torch cannot autocast to the requested dtype on this device."""


class Precision:
    """How ``loss_fn`` runs and how its gradients are scaled.

    Args:
        precision: None (fp32: no autocast), "bf16" or "fp16".
        device: the rank's torch.device; autocast uses its type ("cpu" or "cuda").
    Raises:
        PrecisionError: torch cannot autocast to that dtype on `device` (checked with a
            2x2 matmul, since torch only warns and runs in fp32 when it cannot).
    """

    def __init__(self, precision: str | None, device: torch.device):
        self.name = precision
        self.dtype = DTYPES[precision] if precision else None
        self.device = device
        if self.dtype is not None:
            self._check_supported()
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    def _check_supported(self) -> None:
        x = torch.ones(2, 2, device=self.device)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # an unsupported dtype only warns
                with self.autocast():
                    supported = (x @ x).dtype == self.dtype
        except Exception:  # autocast itself refuses the device type or dtype
            supported = False
        if not supported:
            raise PrecisionError(
                f"--precision {self.name}: torch {torch.__version__} cannot autocast to "
                f"{self.dtype} on {self.device.type} slots; use --precision bf16 "
                "(or GPU slots for fp16), or leave --precision out for fp32")

    def autocast(self):
        """Context for the forward pass: autocast to the dtype, or nothing in fp32."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss`, scaled by the fp16 scaler when there is one."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer, clip_grad_norm: float | None, parameters, clip=None) -> None:
        """Unscale the (already reduced) gradients, clip their norm to `clip_grad_norm` (if
        given; with `clip(parameters, max_norm)`, default torch's ``clip_grad_norm_``), step. With fp16, a step whose gradients hold inf/NaN is skipped and the scale
        backs off: every rank holds the same reduced gradients, so every rank does the same."""
        if self.scaler is not None:
            # the scaler creates its scale on first use: a rank that scaled no loss this step
            # (no micro-batch, or MeanOver counts of 0) needs it as much as the others
            self.scaler.scale(torch.zeros((), device=self.device))
            self.scaler.unscale_(optimizer)
        if clip_grad_norm:
            (clip or torch.nn.utils.clip_grad_norm_)(parameters, clip_grad_norm)
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()
