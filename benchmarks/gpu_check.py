"""The engine's GPU code paths on one CUDA GPU, and our per-step overhead against plain PyTorch.

Each check is one row of the summary table printed last (name, ok/FAIL/skipped, figure, note);
full details go to ``$OUT/gpu_check.json`` (when the environment variable OUT names a folder),
rewritten after every check so a run cut short keeps what it measured.

  nccl_single_rank     a world-size-1 generation (nccl, cuda) trains a float64 MLP for 8 steps:
                       parameters and losses equal a plain PyTorch loop over the same samples in
                       the same order (engine.data.batching's plan), rtol 1e-6
  sharded_single_rank  the same with shard=True (engine.sharded.lifecycle: FSDP2 on a 1-rank nccl
                       mesh, the rows of a first generation, a partner replica refresh,
                       --clip-grad-norm from the norm the vote summed; the trained parameters on the
                       host until the first mesh): parameters equal a plain loop's, rtol 1e-6
  bf16, fp16           precision "bf16"/"fp16": steps run on cuda under autocast to that dtype,
                       the loss is finite and falls, parameters match a plain autocast loop
                       (fp16: with its GradScaler, whose state is in worker.capture())
  sync_batchnorm       sync_batchnorm True: BatchNorm1d became SyncBatchNorm, its running stats
                       moved, parameters and stats match a plain loop
  gloo_two_ranks_cuda  two spawned processes on the same GPU, gloo on CUDA tensors, rank 1
                       starting from other weights and receiving rank 0's state (broadcast):
                       both end equal to each other and to a world-size-1 run (rtol 1e-9, float64)
  state_transfer       broadcast_state of the 50M GPT's state (AdamW after its steps) in a
                       1-rank nccl group: the sender's state comes back unchanged; timed
  checkpoint           CheckpointWriter writes worker.capture() of the cuda GPT; it loads back
                       equal with torch.load(weights_only=True); capture and write timed
  calibration          the pass cost measured by the 50M GPT's first generation and its
                       micro_batches event
  step_overhead        GPT 50M, bf16, AdamW: run_generation's step time against a plain loop of
                       the same model, optimizer, data and precision, interleaved; the ratio
                       ours/plain is the figure (aim <= 1.03), with peak GPU memory of both
  pinned_memory        engine.data.to_device.to_device's non_blocking copy of a pinned batch arrives
                       equal; whether the engine's batches are pinned at all
  frozen_hash          engine.state.frozen: digests of device tensors (dtypes, a view, one past a
                       hashing chunk) equal their host copies'; a frozen layer is left out of
                       the capture, and a change to it is caught (verify)
  nvml                 the arbiter's NVML slot provider: with 2 GiB held by this process, the
                       GPU shows this pid busy outside when nobody is placed there and not
                       when this pid is; its memory use reads >= 2 GiB (needs nvidia-ml-py)

Training runs only through the engine's public surfaces, ``Worker(objects, config, device)`` and
``run_generation(worker, spec, store)``, on a TCPStore hosted here; before each generation the
script writes ``gen{g}/end_at`` and ``gen{g}/version`` as the owner does
(elastic_jupyter/rendezvous.py). It imports only torch, the standard library and
elastic_jupyter.engine.* (and, for the nvml check, elastic_jupyter.arbiter.providers and NVML), and
downloads nothing: text is benchmarks/gpt.py's StdlibText.

Usage, on the GPU machine (about 1-2 minutes on an H200; no check starts after --budget 210 s):
    python benchmarks/gpu_check.py
Dry run on a CPU-only machine (tiny sizes; the nccl checks run on gloo, CUDA-only ones say
"skipped (no CUDA)"):
    python benchmarks/gpu_check.py --device cpu --quick
One or a few checks:  --only step_overhead calibration
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import default_collate

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import gpt  # noqa: E402  benchmarks/gpt.py: the GPT decoder and StdlibText
from elastic_jupyter.engine.data.batching import BatchPlan, micro_batch_count  # noqa: E402
from elastic_jupyter.engine.state.checkpoint_writer import CheckpointWriter  # noqa: E402
from elastic_jupyter.engine.generation import run_generation  # noqa: E402
from elastic_jupyter.engine.protocol import GenerationSpec  # noqa: E402
from elastic_jupyter.engine.group.state_transfer import broadcast_state  # noqa: E402
from elastic_jupyter.engine.data.to_device import to_device  # noqa: E402
from elastic_jupyter.engine.worker import SetupError, Worker  # noqa: E402

AIM = 1.03  # the project's aim for ours / plain step time
GPT_SIZES = {**gpt.SIZES, "tiny": (2, 64, 2)}  # tiny: the --quick stand-in for 50M
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HOST = "127.0.0.1"
GENERATION_TIMEOUT = 60  # s: a peer that does not come fails the generation instead of hanging
START = time.perf_counter()
_THIS_MODULE = sys.modules[__name__]


def log(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f}s] {message}", flush=True)


# ------------------------------------------------------------------------------ framework


class Skip(Exception):
    """The check cannot run here (no CUDA, a dtype this device lacks): a skipped row."""


@dataclass
class Outcome:
    ok: bool
    figure: str = ""
    note: str = ""
    details: dict = field(default_factory=dict)


@dataclass
class Ctx:
    """What every check shares: the device, sizes, the store the generations form through."""

    device: torch.device
    quick: bool
    pairs: int
    store: dist.TCPStore
    deadline: float  # perf_counter value after which no further check starts
    cache: dict = field(default_factory=dict)
    _generation: int = 0

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def backend(self) -> str:
        # nccl needs CUDA; the CPU dry run runs the same logic on gloo
        return "nccl" if self.cuda else "gloo"

    def need_cuda(self) -> None:
        if not self.cuda:
            raise Skip("no CUDA")

    def new_generation(self) -> int:
        """A fresh generation number, with the owner's keys written (rendezvous.request_end):
        no request to leave, version 1. Each number's store prefix is used once."""
        g = self._generation
        self._generation += 1
        control = dist.PrefixStore(f"gen{g}/", self.store)  # the owner's and the engines' view
        control.set("end_at", "none")
        control.add("version", 1)
        return g


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a clock read after it counts that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ objects


class Pairs(torch.utils.data.Dataset):
    """A noisy linear regression, (x, y) per sample; the same data for any model seed."""

    def __init__(self, n: int, features: int, dtype: torch.dtype):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, features, generator=g, dtype=dtype)
        w = torch.randn(features, 1, generator=g, dtype=dtype)
        self.y = self.x @ w + 0.1 * torch.randn(n, 1, generator=g, dtype=dtype)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def mse_loss(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def mlp_objects(seed: int, dtype=torch.float32, features: int = 16, hidden: int = 64,
                batchnorm: bool = False, lr: float = 1e-2) -> dict:
    """The objects a cell defines (on the CPU, as a cell makes them), seeded like an engine."""
    torch.manual_seed(seed)
    layers = [nn.Linear(features, hidden)] + ([nn.BatchNorm1d(hidden)] if batchnorm else [])
    model = nn.Sequential(*layers, nn.Tanh(), nn.Linear(hidden, 1)).to(dtype)
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=lr),
            "dataset": Pairs(256, features, dtype), "loss_fn": mse_loss}


class RandomBytes(torch.utils.data.Dataset):
    """StdlibText's items from random bytes: the stand-in where the stdlib sources are few."""

    def __init__(self, seq_len: int, n: int):
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, 256, (n * seq_len + 1,), generator=g, dtype=torch.uint8)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int):
        window = self.data[i * self.seq_len:(i + 1) * self.seq_len + 1].long()
        return window[:-1], window[1:]


def text_dataset(seq_len: int, limit: int, need: int) -> torch.utils.data.Dataset:
    """Byte windows of the Python standard library's sources (no download)."""
    try:
        data = gpt.StdlibText(seq_len, limit=limit)
        if len(data) >= need:
            return data
    except OSError:
        pass
    log(f"  (stdlib text too short for {need} samples: random bytes instead)")
    return RandomBytes(seq_len, need)


def gpt_loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def gpt_objects(size: str, seq_len: int, dataset, seed: int = 0) -> dict:
    """benchmarks/gpt.py's training cell as objects: the GPT of `size`, AdamW, cross-entropy."""
    torch.manual_seed(seed)
    model = gpt.GPT(*GPT_SIZES[size], max_seq=seq_len)
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=3e-4),
            "dataset": dataset, "loss_fn": gpt_loss}


def config(**options) -> dict:
    """A Worker config as the tests build one: B=16, seed 3, fp32, a given pass cost of 0 (one
    pass over a rank's share at world size 1, no measuring passes), no checkpoints."""
    base = {"global_batch": 16, "micro_batch": None, "seed": 3, "keep_checkpoints": 1,
            "precision": None, "pass_cost": 0.0}
    return {**base, **options}


# ------------------------------------------------------------------------------ training


def train(ctx: Ctx, worker: Worker, steps: int, backend: str | None = None) -> dict:
    """`steps` more steps of `worker` as the only rank of a fresh generation."""
    worker.total_steps = worker.progress.step + steps
    spec = GenerationSpec(rank=0, world_size=1, generation=ctx.new_generation(),
                          backend=backend or ctx.backend, timeout=GENERATION_TIMEOUT)
    return run_generation(worker, spec, ctx.store)


def _plain_to(batch, device: torch.device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    return type(batch)(_plain_to(b, device) for b in batch)


class Plain:
    """The same objects trained as a user would without this package: the whole global batch in
    one pass, zero_grad / autocast forward / backward / step, the samples in the order of
    engine.data.batching's plan (the Worker's at world size 1 with one micro-batch per step)."""

    def __init__(self, objects: dict, cfg: dict, device: torch.device):
        self.model = objects["model"].to(device)
        self.optimizer, self.data = objects["optimizer"], objects["dataset"]
        self.loss_fn, self.device = objects["loss_fn"], device
        self.plan = BatchPlan(len(self.data), cfg["global_batch"], cfg["seed"])
        self.epoch = self.position = 0
        self.dtype = DTYPES.get(cfg.get("precision"))
        self.scaler = (torch.amp.GradScaler(device.type) if cfg.get("precision") == "fp16"
                       else None)

    def step(self, read_loss: bool = False) -> torch.Tensor:
        """One optimizer step; returns the loss (detached). `read_loss`: read it on the host
        right after backward, as a loop that logs every step's loss does."""
        indices = self.plan.batch(self.epoch, self.position)
        batch = _plain_to(default_collate([self.data[int(i)] for i in indices]), self.device)
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            loss = self.loss_fn(self.model, batch)
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        if read_loss:
            float(loss.detach())
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.epoch, self.position = self.plan.advance(self.epoch, self.position)
        return loss.detach()


# ------------------------------------------------------------------------------ comparisons


def params(model: nn.Module) -> dict:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def float_state(model: nn.Module) -> dict:
    """Parameters and float buffers (BatchNorm's running statistics), on the CPU."""
    return {n: t.detach().cpu().clone() for n, t in model.state_dict().items()
            if t.is_floating_point()}


def max_rel_dev(got: dict, expected: dict) -> float:
    """Largest |got - expected| of any tensor, relative to that tensor's largest |value|."""
    return max(((got[k].double() - expected[k].double()).abs().max()
                / expected[k].double().abs().max().clamp_min(1e-30)).item() for k in expected)


def loss_dev(got: list, expected: list) -> float:
    if len(got) != len(expected):
        return math.inf
    return max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(got, expected))


def tensors_in(obj):
    """Every tensor in a nested state (dicts, lists, tuples), in a fixed order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors_in(value)


def first_difference(a, b, path: str = "state") -> str | None:
    """Where nested states `a` and `b` differ (tensors: dtype, shape and values), or None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()))
        return None if same else path
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path} (keys)"
        for key in a:
            found = first_difference(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path} (length)"
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    both_nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return None if a == b or both_nan else path


# ------------------------------------------------------------------------------ 1-3: one rank


def check_nccl_single_rank(ctx: Ctx) -> Outcome:
    steps = 8
    worker = Worker(mlp_objects(1, torch.float64), config(steps=steps), str(ctx.device))
    result = train(ctx, worker, steps)
    plain = Plain(mlp_objects(1, torch.float64), config(), ctx.device)
    plain_losses = [float(plain.step()) for _ in range(steps)]
    ours_losses = [r["loss"] for r in result["records"]]
    dev = max_rel_dev(params(worker.model), params(plain.model))
    ldev = loss_dev(ours_losses, plain_losses)
    on = str(next(worker.model.parameters()).device)
    ok = result["reason"] == "finished" and dev <= 1e-6 and ldev <= 1e-6 \
        and on.startswith(ctx.device.type)
    return Outcome(ok, f"param dev {dev:.1e}",
                   f"{ctx.backend} on {on}, float64, {steps} steps vs plain loop; loss dev "
                   f"{ldev:.1e} (tol 1e-6)",
                   {"param_max_rel_dev": dev, "loss_max_rel_dev": ldev, "ours_losses": ours_losses,
                    "plain_losses": plain_losses, "reason": result["reason"], "device": on})


def check_sharded_single_rank(ctx: Ctx) -> Outcome:
    steps, clip = 8, 0.05
    worker = Worker(mlp_objects(1, torch.float64), config(steps=steps, shard=True,
                                                          clip_grad_norm=clip, replica_every=4),
                    str(ctx.device))
    # the trained parameters wait on the host until the first mesh shards them
    before = sorted({str(p.device) for p in worker.model.parameters()})
    result = train(ctx, worker, steps)
    plain = Plain(mlp_objects(1, torch.float64), config(), ctx.device)
    plain.optimizer.step = _clipped(plain.optimizer, plain.model, clip)  # as torch clips
    plain_losses = [float(plain.step()) for _ in range(steps)]
    got = {n: p.full_tensor().cpu() for n, p in worker.model.named_parameters()}
    dev = max_rel_dev(got, params(plain.model))
    ldev = loss_dev([r["loss"] for r in result["records"]], plain_losses)
    on = str(next(worker.model.parameters()).to_local().device)
    replicas = [e for e in result["events"] if e["kind"] == "replicas"]
    ok = result["reason"] == "finished" and dev <= 1e-6 and ldev <= 1e-6 \
        and on.startswith(ctx.device.type) and len(replicas) == 3 and before == ["cpu"]
    return Outcome(ok, f"param dev {dev:.1e}",
                   f"FSDP2 on a 1-rank {ctx.backend} mesh on {on} (from the host: {before}), "
                   f"float64, {steps} steps, clip {clip}, {len(replicas)} replica refreshes vs a "
                   f"plain loop; loss dev {ldev:.1e}",
                   {"param_max_rel_dev": dev, "loss_max_rel_dev": ldev, "replicas": replicas,
                    "device": on, "before_first_mesh": before})


def _clipped(optimizer, model: nn.Module, clip: float):
    """`optimizer`'s step after torch's clip_grad_norm_ of `model`'s gradients."""
    step = type(optimizer).step

    def clipped_step(*args, **kwargs):
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        return step(optimizer, *args, **kwargs)
    return clipped_step


def check_precision(ctx: Ctx, name: str) -> Outcome:
    steps, seen = 20, []

    def objects():
        made = mlp_objects(2)

        def loss_fn(model, batch):  # records the dtype autocast gives the model's output
            out = model(batch[0])
            seen.append(out.dtype)
            return nn.functional.mse_loss(out.float(), batch[1])
        made["loss_fn"] = loss_fn
        return made

    cfg = config(steps=steps, precision=name, global_batch=32)
    try:
        worker = Worker(objects(), cfg, str(ctx.device))
    except SetupError as e:
        if ctx.cuda:
            raise
        raise Skip(f"{name} on cpu: {str(e)[:50]}") from None
    result = train(ctx, worker, steps)
    ours_dtype = seen[-1]
    losses = [r["loss"] for r in result["records"]]
    scaler = worker.capture()["grad_scaler"]
    plain = Plain(objects(), cfg, ctx.device)
    plain_losses = [float(plain.step()) for _ in range(steps)]
    dev = max_rel_dev(params(worker.model), params(plain.model))
    finite = all(math.isfinite(v) for v in losses)
    falling = statistics.mean(losses[-3:]) < statistics.mean(losses[:3])
    if name == "fp16":
        scaler_ok = isinstance(scaler, dict) and scaler.get("scale", 0) > 0 \
            and scaler.get("scale") == plain.scaler.get_scale()
    else:
        scaler_ok = scaler is None
    ok = finite and falling and scaler_ok and ours_dtype == DTYPES[name] and dev <= 1e-3
    scale_note = f", scaler scale {scaler.get('scale'):g}" if isinstance(scaler, dict) else ""
    return Outcome(ok, f"loss {losses[0]:.3g}->{losses[-1]:.3g}",
                   f"autocast {str(ours_dtype).replace('torch.', '')}{scale_note}; param dev "
                   f"vs plain {dev:.1e} (tol 1e-3)",
                   {"losses": losses, "plain_losses": plain_losses, "param_max_rel_dev": dev,
                    "finite": finite, "falling": falling, "grad_scaler": scaler,
                    "autocast_dtype": str(ours_dtype)})


def check_sync_batchnorm(ctx: Ctx) -> Outcome:
    ctx.need_cuda()  # torch's SyncBatchNorm runs only on CUDA; the Worker refuses it elsewhere
    steps = 6
    objects = mlp_objects(4, batchnorm=True)
    initial_mean = objects["model"][1].running_mean.clone()
    worker = Worker(objects, config(steps=steps, sync_batchnorm=True), str(ctx.device))
    converted = [m for m in worker.model.modules() if isinstance(m, nn.SyncBatchNorm)]
    result = train(ctx, worker, steps)
    plain = Plain(mlp_objects(4, batchnorm=True), config(), ctx.device)
    for _ in range(steps):
        plain.step()
    moved = bool(converted) and not torch.equal(converted[0].running_mean.cpu(), initial_mean)
    dev = max_rel_dev(float_state(worker.model), float_state(plain.model))
    ok = result["reason"] == "finished" and len(converted) == 1 and moved and dev <= 1e-5
    return Outcome(ok, f"state dev {dev:.1e}",
                   f"{len(converted)} SyncBatchNorm, running stats moved: {moved}; params+"
                   "stats vs plain BatchNorm1d loop (tol 1e-5)",
                   {"converted": len(converted), "running_stats_moved": moved,
                    "state_max_rel_dev": dev})


# ------------------------------------------------------------------------------ 4: two ranks


def _wide_mlp(seed: int) -> dict:
    # a 32x4096 float64 weight is 1 MiB: it (and Adam's moments) travels alone in
    # broadcast_state, the biases in a bucket, so both paths of the receiver run
    return mlp_objects(seed, torch.float64, features=32, hidden=4096, lr=1e-3)


def _two_rank_child(rank: int, port: int, generation: int, cfg: dict, device: str,
                    folder: str) -> None:
    """One rank of a 2-rank gloo generation; writes its result, or its traceback, to `folder`
    (never raises: a failure is a finding for the parent to report)."""
    try:
        torch.set_num_threads(1)
        if device == "cuda":
            torch.cuda.set_device(0)
        store = dist.TCPStore(HOST, port, is_master=False,
                              timeout=datetime.timedelta(seconds=GENERATION_TIMEOUT))
        # rank 1 starts from other weights: only the state broadcast can make it equal rank 0
        worker = Worker(_wide_mlp(5 + 100 * rank), dict(cfg), device)
        spec = GenerationSpec(rank=rank, world_size=2, generation=generation, backend="gloo",
                              timeout=GENERATION_TIMEOUT, receive_state=rank == 1,
                              broadcast=True)
        result = run_generation(worker, spec, store)
        torch.save({"params": params(worker.model), "reason": result["reason"],
                    "losses": [r["loss"] for r in result["records"]],
                    "device": str(next(worker.model.parameters()).device)},
                   os.path.join(folder, f"rank{rank}.pt"))
    except Exception:
        with open(os.path.join(folder, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())


def _join(context, seconds: float) -> str | None:
    """Wait for spawned processes; None when all ended, else why not (they are ended here)."""
    deadline = time.monotonic() + seconds
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.terminate()
                return f"ranks still running after {seconds:.0f} s (terminated)"
    except Exception as e:  # a rank died (its own exceptions are caught in the child)
        return f"{type(e).__name__}: {e}"
    return None


def _root_error(errors: dict) -> str:
    """The first line that says why: a rank's own error, not its peer's PeerFailure."""
    texts = sorted(errors.values(), key=lambda t: "PeerFailure" in t.strip().splitlines()[-1])
    return texts[0].strip().splitlines()[-1]


def check_gloo_two_ranks(ctx: Ctx) -> Outcome:
    steps = 6
    # a pool of up to 2: each step is cut so both ranks get micro-batches; the plan, and so
    # the update, is the same at world size 1 (engine.data.batching)
    cfg = config(steps=steps, pool_max_size=2)
    generation = ctx.new_generation()
    # where ipyparallel is installed, run_generation's _publish outside an engine creates an
    # IPython shell (ZMQInteractiveShell.instance()), which swaps sys.modules["__main__"];
    # spawn finds this script, and _two_rank_child in it, through sys.modules["__main__"]
    if __name__ == "__main__":
        sys.modules["__main__"] = _THIS_MODULE
    with tempfile.TemporaryDirectory() as folder:
        context = mp.spawn(_two_rank_child, nprocs=2, join=False,
                           args=(ctx.store.port, generation, cfg, ctx.device.type, folder))
        problem = _join(context, 150)
        errors = {}
        for rank in range(2):
            path = os.path.join(folder, f"rank{rank}.err")
            if os.path.exists(path):
                with open(path) as f:
                    errors[rank] = f.read()
        if errors:
            why = _root_error(errors)
            finding = ("finding: gloo refused CUDA tensors? "
                       if ctx.cuda and ("gloo" in why.lower() or "cuda" in why.lower()) else "")
            return Outcome(False, "ranks failed", f"{finding}{why[:150]}",
                           {"errors": errors, "join": problem, "torch": torch.__version__})
        if problem:
            return Outcome(False, "ranks failed", problem, {"join": problem})
        ranks = [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False)
                 for r in range(2)]
    reference = Worker(_wide_mlp(5), dict(cfg), str(ctx.device))
    single = train(ctx, reference, steps, backend="gloo")
    plain = Plain(_wide_mlp(5), cfg, ctx.device)
    for _ in range(steps):
        plain.step()
    between = max_rel_dev(ranks[1]["params"], ranks[0]["params"])
    vs_single = max_rel_dev(ranks[0]["params"], params(reference.model))
    vs_plain = max_rel_dev(ranks[0]["params"], params(plain.model))
    ldev = loss_dev(ranks[0]["losses"], [r["loss"] for r in single["records"]])
    devices = [r["device"] for r in ranks]
    ok = all(r["reason"] == "finished" for r in ranks) and between <= 1e-9 \
        and vs_single <= 1e-9 and ldev <= 1e-9 and all(d.startswith(ctx.device.type)
                                                       for d in devices)
    return Outcome(ok, f"dev {between:.0e} / {vs_single:.0e}",
                   f"rank1 vs rank0 / vs 1-rank run (tol 1e-9, float64, {devices[0]}); "
                   f"vs plain loop {vs_plain:.0e}",
                   {"rank1_vs_rank0": between, "rank0_vs_world1": vs_single,
                    "rank0_vs_plain": vs_plain, "loss_dev_vs_world1": ldev, "devices": devices,
                    "losses": ranks[0]["losses"]})


# ------------------------------------------------------------------------------ 5-7: the GPT


def shared_gpt(ctx: Ctx):
    """(worker, first generation's result) of the 50M GPT (tiny with --quick), fp32, trained
    2 steps with its pass cost measured (pool 1..8, so the cut depends on it); built once for
    the calibration, state transfer and checkpoint checks. A failure is kept and re-raised."""
    if "gpt" not in ctx.cache:
        try:
            size, seq, batch = ("tiny", 32, 8) if ctx.quick else ("50M", 256, 16)
            dataset = text_dataset(seq, 2**18 if ctx.quick else 2**22, need=4 * batch)
            cfg = config(steps=2, global_batch=batch, pass_cost="measure", pool_max_size=8)
            worker = Worker(gpt_objects(size, seq, dataset), cfg, str(ctx.device))
            log(f"  shared GPT {size}: measuring its pass cost, 2 steps of {batch} x {seq}")
            ctx.cache["gpt"] = (worker, train(ctx, worker, 2), size)
        except Exception as e:
            ctx.cache["gpt"] = e
    if isinstance(ctx.cache["gpt"], Exception):
        raise RuntimeError(f"the shared GPT worker failed: {ctx.cache['gpt']}")
    return ctx.cache["gpt"]


def check_calibration(ctx: Ctx) -> Outcome:
    worker, result, size = shared_gpt(ctx)
    cost = worker.progress.pass_cost
    events = [e for e in result["events"] if e.get("kind") == "micro_batches"]
    batch = worker.config.global_batch
    cut = micro_batch_count(batch, None, 1, 8, cost) if cost is not None else None
    power_of_two = cost is not None and (cost == 0 or math.log2(cost).is_integer())
    ok = cost is not None and cost >= 0 and power_of_two and len(events) == 1 \
        and events[0]["pass_cost"] == cost
    return Outcome(ok, f"P = {cost:g} samples" if cost is not None else "P = None",
                   f"GPT {size} fp32: a step of {batch} cut into {cut} for pools 1..8; "
                   f"{len(events)} micro_batches event",
                   {"pass_cost": cost, "events": events, "cut": cut})


def check_state_transfer(ctx: Ctx) -> Outcome:
    worker, _, size = shared_gpt(ctx)
    live = worker.capture(copy_tensors=False)
    tensors = list(tensors_in(live))
    before = [t.detach().clone() for t in tensors]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    on_device = sum(t.numel() * t.element_size() for t in tensors
                    if t.device.type == ctx.device.type)
    g = ctx.new_generation()
    dist.init_process_group(ctx.backend, store=dist.PrefixStore(f"gen{g}/pg/", ctx.store),
                            rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=GENERATION_TIMEOUT))
    times = []
    try:
        for _ in range(3):
            sync(worker.device)
            start = time.perf_counter()
            got = broadcast_state(live, 0, worker.device)
            sync(worker.device)
            times.append(time.perf_counter() - start)
    finally:
        dist.destroy_process_group()
    unchanged = all(torch.equal(a, b) for a, b in zip(tensors, before))
    seconds = statistics.median(times)
    ok = got is live and unchanged
    return Outcome(ok, f"{seconds * 1e3:.0f} ms, {nbytes / 1e6:.0f} MB",
                   f"GPT {size}+AdamW, {ctx.backend} 1 rank (sender path; receiver: "
                   f"gloo_two_ranks_cuda), {nbytes / max(seconds, 1e-9) / 1e9:.1f} GB/s",
                   {"seconds": times, "bytes": nbytes, "bytes_on_device": on_device,
                    "unchanged": unchanged, "same_object": got is live})


def check_checkpoint(ctx: Ctx) -> Outcome:
    worker, _, size = shared_gpt(ctx)
    sync(worker.device)
    start = time.perf_counter()
    state = worker.capture()
    captured = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as folder:
        writer = CheckpointWriter(folder, keep=1)
        start = time.perf_counter()
        writer.submit(state)
        events = writer.drain()
        written = time.perf_counter() - start
        writer.close()
        event = events[0] if events else {"kind": "none"}
        if event["kind"] != "checkpoint":
            return Outcome(False, "not written", str(event.get("message", event))[:150],
                           {"events": events})
        start = time.perf_counter()
        loaded = torch.load(event["path"], map_location="cpu", weights_only=True)
        load_s = time.perf_counter() - start
    differs = first_difference(loaded, state)
    live = {k: v.detach().cpu() for k, v in worker.model.state_dict().items()}
    live_equal = all(torch.equal(loaded["model"][k], v) for k, v in live.items())
    ok = differs is None and live_equal
    return Outcome(ok, f"capture {captured:.2f} s, write {written:.2f} s",
                   f"GPT {size}, {event['bytes'] / 1e6:.0f} MB, load {load_s:.2f} s; "
                   + ("loads back equal" if ok else f"differs at {differs}, live {live_equal}"),
                   {"capture_s": captured, "write_s": written, "load_s": load_s,
                    "bytes": event["bytes"], "first_difference": differs,
                    "equals_live_model": live_equal})


# ------------------------------------------------------------------------------ 8: overhead


def own_bytes(model: nn.Module, optimizer) -> int:
    """GPU bytes held by one side between steps: parameters, buffers, gradients (a reducer's
    buckets, through the gradients that are views of them) and optimizer state."""
    found = [*model.parameters(), *model.buffers(),
             *(p.grad for p in model.parameters() if p.grad is not None),
             *(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in found if t.device.type == "cuda"}
    return sum(storages.values())


def with_peak_memory(device: torch.device, model: nn.Module, optimizer, run) -> dict:
    """run()'s result plus "peak_bytes": the phase's peak GPU memory less what the other side
    holds meanwhile (everything allocated before the phase that is not this side's own)."""
    if device.type != "cuda":
        return run()
    sync(device)
    others = torch.cuda.memory_allocated(device) - own_bytes(model, optimizer)
    torch.cuda.reset_peak_memory_stats(device)
    out = run()
    sync(device)
    out["peak_bytes"] = torch.cuda.max_memory_allocated(device) - others
    return out


def ours_window(ctx: Ctx, worker: Worker, warmup: int, steps: int) -> dict:
    """One generation of warmup + steps; the time per step from the records' stamps, taken at
    the end of each step, after warm-up. Every step reads its loss on the host after backward,
    so the stamps lag the device by the same optimizer tail at both ends of the window."""
    result = train(ctx, worker, warmup + steps)
    stamps = [r["time"] for r in result["records"]][warmup - 1:]
    diffs = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"mean": (stamps[-1] - stamps[0]) / steps, "median_diff": statistics.median(diffs),
            "loss": result["records"][-1]["loss"]}


def plain_window(plain: Plain, warmup: int, steps: int, read_loss: bool = False) -> dict:
    """warmup + steps plain steps; the time per step over a window the device is synchronized
    at both ends of (a loop that never reads its loss runs ahead of the device)."""
    for _ in range(warmup):
        loss = plain.step(read_loss)
    sync(plain.device)
    stamps = [time.time()]
    for _ in range(steps):
        loss = plain.step(read_loss)
        stamps.append(time.time())
    sync(plain.device)
    end = time.time()
    diffs = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"mean": (end - stamps[0]) / steps, "median_diff": statistics.median(diffs),
            "loss": float(loss)}


def tune_batch(ctx: Ctx, objects: dict, cfg: dict) -> tuple[int, list]:
    """The global batch whose plain step takes 50-150 ms: doubled from 16 (at most 512)."""
    batch, probes = 16, []
    while True:
        plain = Plain(objects, dict(cfg, global_batch=batch), ctx.device)
        try:
            seconds = plain_window(plain, 2, 3)["mean"]
        except torch.cuda.OutOfMemoryError:
            free_memory()
            return max(16, batch // 2), probes
        probes.append({"global_batch": batch, "plain_step_s": seconds})
        log(f"  tuning: global batch {batch}: plain step {seconds * 1e3:.1f} ms")
        if seconds >= 0.05 or batch >= 512:
            return batch, probes
        batch *= 2


def check_step_overhead(ctx: Ctx) -> Outcome:
    size, seq = ("tiny", 64) if ctx.quick else ("50M", 256)
    warmup, steps = (2, 4) if ctx.quick else (3, 12)
    dataset = text_dataset(seq, 2**18 if ctx.quick else 8 * 2**20, need=1024)
    cfg = config(precision="bf16", pass_cost=0.0)
    plain_objects = gpt_objects(size, seq, dataset)
    if ctx.quick:
        batch, probes = 4, []
    else:
        batch, probes = tune_batch(ctx, plain_objects, cfg)
    cfg["global_batch"] = batch
    plain = Plain(plain_objects, cfg, ctx.device)
    worker = Worker(gpt_objects(size, seq, dataset), dict(cfg, steps=1), str(ctx.device))
    # the same with 2 loader processes fetching ahead into pinned memory (engine.data.map_pipeline)
    fed = Worker(gpt_objects(size, seq, dataset), dict(cfg, steps=1, loader_processes=2),
                 str(ctx.device))
    runs = {"ours": [], "plain": [], "plain_item": [], "ours_workers2": []}
    for pair in range(ctx.pairs):  # interleaved: a slow moment of the machine hits every side
        runs["ours"].append(with_peak_memory(ctx.device, worker.model, worker.optimizer,
                                             lambda: ours_window(ctx, worker, warmup, steps)))
        runs["ours_workers2"].append(with_peak_memory(
            ctx.device, fed.model, fed.optimizer, lambda: ours_window(ctx, fed, warmup, steps)))
        runs["plain"].append(with_peak_memory(ctx.device, plain.model, plain.optimizer,
                                              lambda: plain_window(plain, warmup, steps)))
        runs["plain_item"].append(with_peak_memory(
            ctx.device, plain.model, plain.optimizer,
            lambda: plain_window(plain, warmup, steps, read_loss=True)))
        log("  pair {}: ours {:.1f} ms, plain {:.1f} ms, plain+loss.item() {:.1f} ms, "
            "ours --loader-processes 2 {:.1f} ms".format(
            pair + 1, *(runs[k][-1]["mean"] * 1e3 for k in runs)))
    med = {k: statistics.median(r["mean"] for r in v) for k, v in runs.items()}
    ratio, ratio_item = med["ours"] / med["plain"], med["ours"] / med["plain_item"]
    ratio_fed = med["ours_workers2"] / med["plain"]
    pair_ratios = [o["mean"] / p["mean"] for o, p in zip(runs["ours"], runs["plain"])]
    peaks = {k: v[-1].get("peak_bytes") for k, v in runs.items()}  # steady state: the last
    losses_finite = all(math.isfinite(r["loss"]) for v in runs.values() for r in v)
    memory = (f"; peak GPU {peaks['ours'] / 2**30:.2f} vs {peaks['plain'] / 2**30:.2f} GiB"
              if peaks["ours"] is not None else "")
    aim = "quick sizes: no aim" if ctx.quick else (
        f"aim <= {AIM} {'met' if ratio <= AIM else 'NOT met'}")
    ok = losses_finite and (ctx.quick or ratio <= AIM)
    return Outcome(ok, f"ours/plain {ratio:.3f}",
                   f"{med['ours'] * 1e3:.1f} vs {med['plain'] * 1e3:.1f} ms/step "
                   f"(+item {ratio_item:.3f}; --loader-processes 2: {ratio_fed:.3f}), GPT "
                   f"{size} bf16 B={batch}x{seq}; {aim}{memory}",
                   {"median_step_s": med, "ratio": ratio, "ratio_vs_plain_item": ratio_item,
                    "ratio_workers2": ratio_fed,
                    "pair_ratios": pair_ratios, "overhead_ms": (med["ours"] - med["plain"]) * 1e3,
                    "peak_bytes": peaks, "runs": runs, "tuning": probes, "global_batch": batch,
                    "seq_len": seq, "size": size, "warmup": warmup, "timed_steps": steps})


# ------------------------------------------------------------------------------ 9: pinned


def pipeline_pinned(ctx: Ctx) -> bool:
    """Whether the engine's input pipeline hands over pinned batches (engine.data.map_pipeline),
    with a loader process: the batches the engine moves to the device with non_blocking copies."""
    model = nn.Linear(8, 1).to(ctx.device)
    objects = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
               "dataset": Pairs(64, 8, torch.float32), "loss_fn": mse_loss}
    worker = Worker(objects, config(steps=2, loader_processes=1), str(ctx.device))
    try:
        # the next pass's batch, before its copy to the device
        x, _ = worker.pipeline.next((0, 1, 0, 0), lambda b: worker._passes(b, 0, 1),
                                    worker.total_steps)
        return x.is_pinned()
    finally:
        worker.end_generation()


def check_pinned_memory(ctx: Ctx) -> Outcome:
    ctx.need_cuda()  # pinned (page-locked) memory is a CUDA host allocation
    x = torch.randn(512, 1024).pin_memory()
    tokens = torch.randint(0, 256, (64, 257)).pin_memory()
    batch = {"x": x, "pair": (tokens, [x[:3]])}
    moved = to_device(batch, ctx.device)
    sync(ctx.device)  # a non_blocking copy is complete only once the stream is
    equal = (torch.equal(moved["x"].cpu(), x) and torch.equal(moved["pair"][0].cpu(), tokens)
             and torch.equal(moved["pair"][1][0].cpu(), x[:3]))
    on_device = moved["x"].device.type == "cuda" and moved["pair"][0].device.type == "cuda"
    pinned = pipeline_pinned(ctx)
    ok = equal and on_device
    return Outcome(ok, "equal" if equal else "DIFFERS",
                   f"to_device non_blocking from pinned memory; input pipeline's batches pinned: "
                   f"{pinned} ({'async copies' if pinned else 'so the copies are synchronous'})",
                   {"equal": equal, "on_device": on_device, "pipeline_batches_pinned": pinned})


def check_frozen_hash(ctx: Ctx) -> Outcome:
    """engine.state.frozen on the device: digests of device tensors (several dtypes, a view, one
    larger than a hashing chunk) equal the host copies'; a model's frozen part is left out of
    its capture and a change to it is caught."""
    from elastic_jupyter.engine.state import frozen
    tensors = [torch.randn(1000, 37, device=ctx.device).t(),
               torch.randn(4096, dtype=torch.float64, device=ctx.device)[::3],
               torch.randn(64, 64, device=ctx.device).to(torch.bfloat16),
               torch.arange(7, device=ctx.device) > 3,
               torch.randn((frozen.CHUNK_BYTES // 4) + 1000, device=ctx.device)]
    start = time.perf_counter()
    same = [frozen.digest(t) == frozen.digest(t.cpu()) for t in tensors]
    seconds = time.perf_counter() - start
    objects = mlp_objects(1, torch.float64)
    objects["model"][0].requires_grad_(False)
    worker = Worker(objects, config(steps=2), str(ctx.device))
    left_out = not any(k.startswith("0.") for k in worker.capture(copy_tensors=False)["model"])
    with torch.no_grad():
        worker.model[0].weight.add_(1.0)
    try:
        worker.frozen.verify()
        caught = False
    except frozen.FrozenWeightsError:
        caught = True
    on = str(worker.model[0].weight.device)
    ok = all(same) and left_out and caught and on.startswith(ctx.device.type)
    return Outcome(ok, "equal" if all(same) else "DIFFERS",
                   f"{len(tensors)} tensors on {on} hashed in {seconds:.2f} s; frozen layer "
                   f"left out of the capture: {left_out}; a change caught: {caught}",
                   {"same": same, "left_out": left_out, "caught": caught, "seconds": seconds})


# ------------------------------------------------------------------------------ driver

def check_nvml(ctx: Ctx) -> Outcome:
    ctx.need_cuda()
    try:
        from elastic_jupyter.arbiter.providers import NvmlSlots
        slots = NvmlSlots(memory_mib=1024)
    except ImportError as e:  # nvidia-ml-py missing
        raise Skip(f"no NVML ({e})") from None
    me = os.getpid()
    held = torch.empty(2 << 30, dtype=torch.uint8, device=ctx.device)  # 2 GiB in use by us
    sync(ctx.device)
    seen = slots.outside({})  # nobody placed: our own process is foreign
    ours = [s for s, who in seen.items() if f"pid {me} " in who or who.startswith(f"pid {me}")]
    placed = slots.outside({s: {me} for s in ours})  # placed where it runs: not busy outside
    usage = slots.usage()
    del held
    memory = usage.get(ours[0], {}).get("memory_mib", 0) if ours else 0
    ok = len(ours) == 1 and ours[0] not in placed and memory >= 2048
    return Outcome(ok, f"{len(slots.slots())} GPU(s)",
                   f"our pid seen on GPU {ours} as outside; placed there: "
                   f"{'busy' if ours and ours[0] in placed else 'not busy'}; {memory} MiB used",
                   {"outside_unplaced": seen, "outside_placed": placed, "usage": usage})


CHECKS = {  # summary order
    "nccl_single_rank": check_nccl_single_rank,
    "sharded_single_rank": check_sharded_single_rank,
    "bf16": lambda ctx: check_precision(ctx, "bf16"),
    "fp16": lambda ctx: check_precision(ctx, "fp16"),
    "sync_batchnorm": check_sync_batchnorm,
    "gloo_two_ranks_cuda": check_gloo_two_ranks,
    "state_transfer": check_state_transfer,
    "checkpoint": check_checkpoint,
    "calibration": check_calibration,
    "step_overhead": check_step_overhead,
    "pinned_memory": check_pinned_memory,
    "frozen_hash": check_frozen_hash,
    "nvml": check_nvml,
}
# the important figure early, the slow spawned check last: a cut-short run keeps the most
RUN_ORDER = ["nccl_single_rank", "sharded_single_rank", "bf16", "fp16", "sync_batchnorm", "step_overhead",
             "calibration", "state_transfer", "checkpoint", "pinned_memory", "frozen_hash", "nvml",
             "gloo_two_ranks_cuda"]


def run_check(ctx: Ctx, name: str) -> dict:
    """One check, whatever happens in it, as a row: status, figure, note, details, seconds."""
    start = time.perf_counter()
    log(f"{name}: start")
    try:
        out = CHECKS[name](ctx)
        row = {"status": "ok" if out.ok else "FAIL", "figure": out.figure, "note": out.note,
               "details": out.details}
    except Skip as e:
        row = {"status": f"skipped ({e})", "figure": "", "note": "", "details": {}}
    except Exception as e:
        text = traceback.format_exc()
        print(text, file=sys.stderr, flush=True)
        row = {"status": "FAIL", "figure": "error", "note": f"{type(e).__name__}: {e}"[:200],
               "details": {"traceback": text}}
    row["seconds"] = time.perf_counter() - start
    log(f"{name}: {row['status']} {row['figure']} ({row['seconds']:.1f} s)")
    return row


def host_store() -> dist.TCPStore:
    """The rendezvous store the owner would host, on a free port (the OS's choice)."""
    timeout = datetime.timedelta(seconds=GENERATION_TIMEOUT)
    try:
        return dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timeout)
    except (RuntimeError, ValueError):  # a torch without port 0: ask the OS for one first
        import socket
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        return dist.TCPStore(HOST, port, is_master=True, wait_for_workers=False,
                             timeout=timeout)


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(),
           "host": platform.node(), "device": str(device), "argv": sys.argv}
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   capability=list(torch.cuda.get_device_capability(device)),
                   gpu_memory_bytes=torch.cuda.get_device_properties(device).total_memory)
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 -- informational only
            pass
    return env


def write_json(report: dict) -> str | None:
    folder = os.environ.get("OUT")
    if not folder:
        return None
    path = os.path.join(folder, "gpu_check.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
    return path


def print_summary(rows: dict, path: str | None, elapsed: float) -> None:
    widths = [max(len(name) for name in rows), 22, 34]
    print(f"\n=== gpu_check summary ({elapsed:.0f} s; details: {path or 'set OUT to keep them'})",
          flush=True)
    print(f"{'check':<{widths[0]}}  {'status':<{widths[1]}}  {'figure':<{widths[2]}}  note")
    for name, row in rows.items():
        print(f"{name:<{widths[0]}}  {row['status']:<{widths[1]}}  "
              f"{row['figure']:<{widths[2]}}  {row['note']}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the CPU dry run)")
    parser.add_argument("--only", nargs="+", choices=list(CHECKS), metavar="NAME",
                        help=f"run only these checks: {', '.join(CHECKS)}")
    parser.add_argument("--pairs", type=int, default=3,
                        help="interleaved ours/plain timing pairs of step_overhead")
    parser.add_argument("--budget", type=float, default=210.0,
                        help="seconds after which no further check starts")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device here: run with --device cpu --quick", flush=True)
            return 2
        torch.cuda.set_device(0)  # as entrypoints.init_engine does
        device = torch.device("cuda", 0)
    store = host_store()
    ctx = Ctx(device, args.quick, args.pairs, store, START + args.budget)
    report = {"environment": environment(device), "checks": {}}
    log(f"gpu_check on {report['environment'].get('gpu', device)}, torch {torch.__version__}"
        f"{', quick sizes' if args.quick else ''}")
    selected = [name for name in RUN_ORDER if not args.only or name in args.only]
    path = None
    for name in selected:
        if time.perf_counter() > ctx.deadline:
            row = {"status": "skipped (time budget)", "figure": "", "note": "", "seconds": 0}
        else:
            row = run_check(ctx, name)
        report["checks"][name] = row
        report["elapsed_s"] = time.perf_counter() - START
        path = write_json(report)
        free_memory()
    rows = {name: report["checks"][name] for name in CHECKS if name in report["checks"]}
    print_summary(rows, path, time.perf_counter() - START)
    return 1 if any(row["status"] == "FAIL" for row in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
