"""Random streams per micro-batch: randomness that does not depend on the world size.

In plain data-parallel training each rank draws from its own generator, so the dropout mask a
sample gets depends on which rank processes it and on how many ranks there are (and here, where
every engine is seeded alike, all ranks drew the same masks). Following EasyScale (Li et al.,
"EasyScale: Accuracy-consistent Elastic Training for Deep Learning", SC'23), which runs a fixed
number of virtual workers ("EasyScaleThreads"), each with its own RNG state, on however many
GPUs are present, the unit of randomness here is the micro-batch (engine.batching): micro-batch
k of step s draws from a stream seeded by (seed, s, k) alone, whichever rank processes it at
whatever world size. A model with dropout therefore ends with the same parameters at any world
size and across resizes.

Covered: torch's CPU generator and, on a GPU rank, its CUDA device's generator, for a
micro-batch's forward and backward. Its samples are fetched ahead, maybe in other processes
(engine.loader), each under torch's CPU generator seeded by (seed, epoch, sample index)
(:func:`sample_seed`), so a random transform gives the same sample at any world size and any
number of loader processes. Python's ``random`` and numpy's global generator are not
reseeded: draws from them stay per rank.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import struct

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
    (engine.loader), so a sample's random transform is the same whichever rank, pass or loader
    process fetches it: the epoch's hash (BLAKE2b, as :func:`stream_seed`) mixed with the index
    by SplitMix64's finaliser (Steele et al., "Fast Splittable Pseudorandom Number
    Generators", OOPSLA 2014), a few integer operations per sample."""
    x = (_epoch_seed(seed, epoch) ^ index) + 0x9E3779B97F4A7C15 & _MASK64
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


@contextlib.contextmanager
def micro_batch_stream(seed: int, step: int, index: int, device: torch.device):
    """Run the block with torch's generators seeded by :func:`stream_seed`: the CPU one, and
    the current CUDA device's when `device` is a CUDA device. The outer generator states are
    restored afterwards (also on an exception), so code outside micro-batches is unaffected."""
    cuda = device.type == "cuda"
    devices = [torch.cuda.current_device()] if cuda else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        value = stream_seed(seed, step, index)
        torch.default_generator.manual_seed(value)
        if cuda:
            torch.cuda.manual_seed(value)
        yield
