"""Frozen weights: what the cell builds on every engine and no step changes stays where it is.

A frozen backbone, or the base model under a LoRA adapter, is never trained: every engine has
it from the cell as surely as a peer could send it. Sending it on a grow and writing it in every
checkpoint moves bytes that did not change (a LoRA fine-tune of a 7B model would move 14 GB per
grow where 100 MB changed). So the training state leaves these tensors out
(engine.state.training_state.capture's ``frozen``), and a digest of each proves instead that

- every engine built the same ones (the owner compares the engines' :meth:`FrozenWeights.manifest`
  at setup, run/cellsetup.py),
- they did not change since (:meth:`FrozenWeights.verify`, before each checkpoint is written),
- a resume goes on from the weights its checkpoint was trained with (the checkpoint records the
  digests; :meth:`FrozenWeights.check`).

Which tensors are frozen: the parameters that do not require gradients when the setup ends, and
the buffers of modules whose parameters are all frozen (a module without parameters takes its
parent's answer), except those of modules that track running statistics (a BatchNorm in a
frozen backbone still updates them in training mode: they are trained state). ``--move-frozen``
moves and writes them as before. PEFT saves an adapter without its base model for the same
reason (``peft.get_peft_model_state_dict``).

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..protocol import TrainingState

CHUNK_BYTES = 64 << 20  # a device tensor is hashed through a host buffer this large
HASH_THREADS = min(8, os.cpu_count() or 1)  # tensors hashed at once


class FrozenWeightsError(RuntimeError):
    """The frozen weights are not the ones the run trains with; the message names the tensor
    and says what to do."""


def digest(t: torch.Tensor) -> str:
    """32 hex digits (BLAKE2b) over `t`'s dtype, shape and bytes. A tensor on a GPU is read in
    chunks of CHUNK_BYTES through a pinned host buffer."""
    h = hashlib.blake2b(digest_size=16)
    t = t.detach()
    if t.is_quantized:
        t = t.int_repr()
    if t.layout != torch.strided:
        t = t.to_dense()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    flat = t.reshape(-1).contiguous()
    if flat.numel() == 0:
        return h.hexdigest()
    raw = flat.view(torch.uint8)
    if raw.device.type != "cuda":
        raw = raw.cpu()  # no copy on the CPU
    if raw.device.type == "cpu":
        h.update(raw.numpy().data)  # hashlib releases the interpreter lock for large buffers
        return h.hexdigest()
    host = torch.empty(min(CHUNK_BYTES, raw.numel()), dtype=torch.uint8, pin_memory=True)
    # a stream of its own, so kernels queued after these copies on the default stream (the
    # writer's thread hashes while training goes on) do not wait for them
    stream = torch.cuda.Stream(raw.device)
    stream.wait_stream(torch.cuda.current_stream(raw.device))  # the tensor's last writes
    with torch.cuda.stream(stream):
        for start in range(0, raw.numel(), CHUNK_BYTES):
            part = raw[start:start + CHUNK_BYTES]
            host[:part.numel()].copy_(part, non_blocking=True)
            stream.synchronize()  # the buffer is read next
            h.update(host[:part.numel()].numpy().data)
    return h.hexdigest()


def frozen_keys(model: torch.nn.Module) -> list[str]:
    """The keys of `model`'s state dict whose tensors are frozen (see the module docstring),
    in the state dict's order."""
    ids = {id(p) for p in model.parameters() if not p.requires_grad}
    _frozen_buffers(model, False, ids)
    return [k for k, v in model.state_dict(keep_vars=True).items()
            if isinstance(v, torch.Tensor) and id(v) in ids]


def _frozen_buffers(module: torch.nn.Module, parent_frozen: bool, ids: set[int]) -> None:
    params = list(module.parameters())
    frozen = not any(p.requires_grad for p in params) if params else parent_frozen
    if frozen and not getattr(module, "track_running_stats", False):
        ids.update(id(b) for b in module.buffers(recurse=False))
    for child in module.children():
        _frozen_buffers(child, frozen, ids)


class FrozenWeights:
    """A model's frozen tensors, by state-dict key, and their digests.

    Args:
        model: the cell's model, as its setup left it (on the engine's device).
        stay: False (``--move-frozen``) treats every tensor as trained: nothing is left out.
        digests: {key: digest} of these very tensors taken before (a warm engine's Worker
            built again on its slot's device: the bytes are the same), instead of hashing.

    Attributes:
        names: the frozen keys (left out of captured states).
        digests: {key: :func:`digest`} taken at construction.
        nbytes: their size in bytes (a tensor tied under two keys counted once).
        seconds: the time hashing them took.
    """

    def __init__(self, model: torch.nn.Module, stay: bool = True,
                 digests: dict[str, str] | None = None):
        self.model = model
        start = time.perf_counter()
        self.names: frozenset[str] = frozenset(frozen_keys(model) if stay else ())
        # taken once: the writer's thread re-hashes them without calling the model's hooks
        self._tensors = {k: v for k, v in model.state_dict(keep_vars=True).items()
                         if k in self.names}
        known = digests if digests is not None and digests.keys() == self.names else None
        self.digests = known if known is not None else _digests(self._tensors)
        self.nbytes = sum(t.numel() * t.element_size() for t in _unique(self._tensors).values())
        self.seconds = time.perf_counter() - start

    def manifest(self) -> dict:
        """``{"tensors": {key: digest}, "bytes", "seconds"}``: what the owner compares across
        engines and reports."""
        return {"tensors": dict(self.digests), "bytes": self.nbytes,
                "seconds": round(self.seconds, 3)}

    def verify(self) -> None:
        """Hash the frozen tensors again. Raises FrozenWeightsError naming the first that
        changed since setup (a state without it would go on from other weights)."""
        now = _digests(self._tensors)
        for name in self._tensors:
            if now[name] != self.digests[name]:
                kind = ("parameter with requires_grad=False" if isinstance(
                    self._tensors[name], torch.nn.Parameter) else "buffer of a frozen module")
                raise FrozenWeightsError(
                    f"frozen tensor {name!r} (a {kind}) changed during training: frozen "
                    "weights stay out of checkpoints and state transfers, so they must not "
                    "change. Run with --move-frozen to send and checkpoint every tensor (or "
                    "train it: requires_grad=True)")

    def check(self, state: TrainingState) -> None:
        """Before `state` (a checkpoint's or a peer's) is loaded: raise FrozenWeightsError
        unless the weights it was trained with are this model's frozen ones. A state without
        digests (written with ``--move-frozen``, or before frozen weights stayed) holds them:
        they are hashed from it."""
        saved = dict(state.get("frozen") or {})
        held = state.get("model") or {}
        saved.update({k: digest(held[k]) for k in self.names - saved.keys() if k in held})
        own = self.model.state_dict()
        odd: list[tuple[str, str]] = []
        for name in dict.fromkeys([*self.digests, *saved]):  # the model's order first
            if name not in saved:
                odd.append((name, "the state has no such tensor"))
            elif name not in own:
                odd.append((name, "this model has no such tensor"))
            elif saved[name] != (self.digests.get(name) or digest(own[name])):
                odd.append((name, "the cell builds other values for it"))
        if odd:
            name, why = odd[0]
            hint = ("start a new run with another --name" if "frozen" in state else
                    "resume with --move-frozen, which loads the frozen weights this state "
                    "holds")
            raise FrozenWeightsError(
                f"the state was trained with other frozen weights ({len(odd)} tensor(s) "
                f"differ; {name!r}: {why}). Build the frozen weights the run was trained with "
                f"(the same files, the same requires_grad), or {hint}")

    def load(self, model_state: dict, state: TrainingState) -> None:
        """Load `model_state` (`state`'s "model", as restored) into the model once
        :meth:`check` passed; the keys of the state's frozen digests may be missing from it:
        those tensors keep the cell's values. Raises FrozenWeightsError, before anything is
        loaded, naming the keys that do not fit."""
        self.check(state)
        expected = self.model.state_dict().keys()
        missing = [k for k in expected if k not in model_state and k not in
                   (state.get("frozen") or {})]
        unexpected = [k for k in model_state if k not in expected]
        if missing or unexpected:
            raise FrozenWeightsError(
                f"the state does not fit this model: missing {missing[:5]}, unexpected "
                f"{unexpected[:5]} ({len(missing)} and {len(unexpected)} keys)")
        self.model.load_state_dict(model_state, strict=False)


def _unique(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` without a second key for the same tensor (a tied embedding and head)."""
    seen: dict[tuple, str] = {}
    for name, t in tensors.items():
        seen.setdefault((t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()), name)
    return {name: tensors[name] for name in seen.values()}


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """{key: digest} of `tensors`, each tied tensor hashed once, on up to HASH_THREADS threads
    (hashlib releases the interpreter lock while it hashes)."""
    unique = _unique(tensors)
    with ThreadPoolExecutor(max(1, min(HASH_THREADS, len(unique)))) as pool:
        done = dict(zip(unique, pool.map(digest, unique.values())))
    ident = {(t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()): n
             for n, t in unique.items()}
    return {n: done[ident[(t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())]]
            for n, t in tensors.items()}
