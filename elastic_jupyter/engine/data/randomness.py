"""Random streams per micro-batch: randomness that does not depend on the world size.

In plain data-parallel training each rank draws from its own generator, so the dropout mask a
sample gets depends on which rank processes it and on how many ranks there are (and here, where
every engine is seeded alike, all ranks drew the same masks). Following EasyScale (Li et al.,
"EasyScale: Accuracy-consistent Elastic Training for Deep Learning", SC'23), which runs a fixed
number of virtual workers ("EasyScaleThreads"), each with its own RNG state, on however many
GPUs are present, the unit of randomness here is the micro-batch (engine.data.batching): micro-batch
k of step s draws from a stream seeded by (seed, s, k) alone, whichever rank processes it at
whatever world size. A model with dropout therefore ends with the same parameters at any world
size and across resizes.

Covered: torch's CPU generator and, on a GPU rank, its CUDA device's generator, Python's
``random`` and numpy's global generator (``np.random.*``, as timm's Mixup draws its mixing
ratio), for a micro-batch's forward and backward. Its samples are fetched ahead, maybe in other
processes (engine.data.map_pipeline), each under the same generators seeded by (seed, epoch, sample
index) (:func:`sample_seed`), so a random transform gives the same sample at any world size and any
number of loader processes. Python's and numpy's generators get seeds of their own derived from
torch's (:func:`host_seeds`): seeded alike, Python's ``random.random()`` and numpy's
``np.random.random()`` would return the same numbers. Not covered: generators the cell makes
itself (``np.random.default_rng()``, ``torch.Generator()``), which draw as the cell seeds them.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import random
import struct
from collections.abc import Iterator

import numpy as np
import torch


def stream_seed(seed: int, step: int, index: int) -> int:
    """The 64-bit seed of micro-batch `index` of step `step` (both counted from 0) of a run
    seeded `seed` (any int; taken mod 2**64).

    A hash (BLAKE2b) of the three numbers, so neighbouring micro-batches and steps get
    unrelated streams; a seed of (seed, step) alone would give every micro-batch of a step the
    same mask. Raises struct.error for a negative step or index, or one of 2**64 or more.
    """
    data = struct.pack("<QQQ", seed % 2**64, step, index)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=b"ej-micro").digest(),
                          "little")


_MASK64 = 2**64 - 1


@functools.lru_cache(maxsize=16)
def _epoch_seed(seed: int, epoch: int) -> int:
    data = struct.pack("<QQ", seed % 2**64, epoch)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=b"ej-sample").digest(),
                          "little")


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The 64-bit seed under which sample `index` of the dataset is fetched in epoch `epoch`
    (engine.data.map_pipeline), so a sample's random transform is the same whichever rank, pass or
    loader process fetches it: the epoch's hash (BLAKE2b, as :func:`stream_seed`) mixed with the
    index by SplitMix64's finaliser (Steele et al., "Fast Splittable Pseudorandom Number
    Generators", OOPSLA 2014), a few integer operations per sample."""
    return _splitmix64(_epoch_seed(seed, epoch) ^ index)


def _splitmix64(x: int) -> int:
    x = x + 0x9E3779B97F4A7C15 & _MASK64
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


# mixed into a torch seed to give Python's and numpy's generators seeds of their own
_PYTHON_SALT, _NUMPY_SALT = 0x6A09E667F3BCC908, 0xBB67AE8584CAA73B


def host_seeds(value: int) -> tuple[int, int]:
    """The seeds of Python's ``random`` (64-bit) and of numpy's global generator (32-bit) that
    go with torch's seed `value`: `value` mixed with a constant of each by SplitMix64's
    finaliser. Each needs a seed of its own: torch's CPU generator and numpy's are Mersenne
    Twisters initialised alike from a 32-bit seed, so one seed for both would give
    ``np.random`` the very words torch draws. numpy's takes 32 bits (``np.random.seed(n)``,
    a few microseconds; 64 bits go through its slower array seeding), enough for its draws,
    which are what differs between micro-batches and samples."""
    return _splitmix64(value ^ _PYTHON_SALT), _splitmix64(value ^ _NUMPY_SALT) >> 32


def seed_host_generators(value: int) -> None:
    """Seed Python's ``random`` and numpy's global generator from torch's seed `value`
    (:func:`host_seeds`); about 7 us."""
    python, numpy = host_seeds(value)
    random.seed(python)
    np.random.seed(numpy)


def host_generator_state() -> tuple:
    """Python's ``random`` and numpy's global generator states, for
    :func:`set_host_generator_state` (both ways about 0.1 ms: numpy's 2.5 KB state passes
    through Python objects)."""
    return random.getstate(), np.random.get_state()


def set_host_generator_state(state: tuple) -> None:
    python, numpy = state
    random.setstate(python)
    np.random.set_state(numpy)


def seed_sample(seed: int, epoch: int, index: int, host: bool = True) -> None:
    """Seed torch's CPU generator for sample `index` of epoch `epoch` (:func:`sample_seed`),
    and with `host` Python's and numpy's from it: what each sample is read under
    (engine.data.map_pipeline, engine.data.stream_split), inside :func:`caller_generators_kept`."""
    value = sample_seed(seed, epoch, index)
    torch.default_generator.manual_seed(value)
    if host:
        seed_host_generators(value)


@contextlib.contextmanager
def caller_generators_kept(host: bool = True) -> Iterator[None]:
    """Run the block (a pass's samples read, each under :func:`seed_sample`) and give torch's
    CPU generator back the state it had, once for the block rather than per sample; with
    `host`, Python's and numpy's too, outside a loader process (in one they are seeded again
    by the next sample, and not worth 0.1 ms a pass, so collate_fn draws from them as the
    pass's last sample left them)."""
    generator = torch.default_generator
    saved = generator.get_state()
    in_loader = torch.utils.data.get_worker_info() is not None
    restore_host = host_generators_restorer() if host and not in_loader else None
    try:
        yield
    finally:
        generator.set_state(saved)
        if restore_host is not None:
            restore_host()


# how many host_generators_kept loops are running: their micro-batch streams leave restoring
# Python's and numpy's generators to the loop, once for all its micro-batches
_kept = 0
# inside such a loop, the seed of the micro-batch stream just entered, until something takes
# it (host_generators_restorer): the stream's generators are as freshly seeded
_fresh: int | None = None


def host_generators_kept(items):
    """Yield `items` (a rank's micro-batches of a step), keeping Python's and numpy's generator
    states for the whole loop: saved before the first item, restored once the loop is done or
    left (an exception in its body closes this generator as the loop's frame lets go of it).
    Meanwhile :func:`micro_batch_stream` only seeds them, rather than saving and restoring them
    for each micro-batch (about 0.1 ms each time). The loop's body must run its user code
    inside the streams (between them the generators hold the last stream's state), and fetch
    its micro-batch's samples (engine.data.map_pipeline) before anything draws from the stream: the
    fetch puts the stream back by seeding it again (:func:`host_generators_restorer`)."""
    global _kept, _fresh
    saved = host_generator_state()
    _kept += 1
    try:
        yield from items
    finally:
        _kept -= 1
        _fresh = None
        set_host_generator_state(saved)


def host_generators_restorer():
    """A function that gives Python's ``random`` and numpy's global generator back the states
    they hold now: by seeding them again when they are a :func:`host_generators_kept` loop's
    micro-batch stream that nothing has drawn from yet (a few microseconds), else from their
    saved states (about 0.1 ms)."""
    global _fresh
    value, _fresh = _fresh, None
    if value is not None:
        return lambda: seed_host_generators(value)
    saved = host_generator_state()
    return lambda: set_host_generator_state(saved)


@contextlib.contextmanager
def micro_batch_stream(seed: int, step: int, index: int, device: torch.device):
    """Run the block with torch's generators seeded by :func:`stream_seed`: the CPU one, and
    the current CUDA device's when `device` is a CUDA device; and with Python's ``random`` and
    numpy's global generator seeded from the same value (:func:`seed_host_generators`). The
    outer generator states are restored afterwards (also on an exception), so code outside
    micro-batches is unaffected (Python's and numpy's by the enclosing
    :func:`host_generators_kept` loop when there is one)."""
    global _fresh
    cuda = device.type == "cuda"
    devices = [torch.cuda.current_device()] if cuda else []
    host = None if _kept else host_generator_state()
    try:
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            value = stream_seed(seed, step, index)
            torch.default_generator.manual_seed(value)
            if cuda:
                torch.cuda.manual_seed(value)
            seed_host_generators(value)
            if _kept:
                _fresh = value
            yield
    finally:
        _fresh = None
        if host is not None:
            set_host_generator_state(host)
