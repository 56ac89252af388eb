"""A dataset's identity across engines: its length and a hash of a few of its items.

Every engine builds the run's dataset itself, by running the cell. If one built another (a
file that changed, a path that resolved elsewhere, an unseeded random split), its samples and
even its number of steps would differ from its peers' without any error; comparing these
fingerprints catches that at setup.

This module imports nothing from IPython or the UI.
"""
from __future__ import annotations

import hashlib
import random

import numpy as np
import torch

from ..state import training_state as state_mod
from .digest import feed
from .stream_split import Streams

SEED = 0  # random augmentations in __getitem__ draw the same on every engine


def dataset_fingerprint(dataset) -> dict:
    """``{"samples": len(dataset), "hash": 16 hex digits}``: the hash covers items 0, n // 2
    and n - 1 (an iterable's first three, engine.data.stream_split; its samples: the declared length
    or None) (the bytes, dtypes and shapes of their tensors and arrays, their numbers and
    strings, inside sequences, mappings and dataclasses). The items are read with every RNG
    seeded, and the RNG states are restored after.
    """
    stream = isinstance(dataset, Streams)
    n = dataset.length if stream else len(dataset)  # a stream's declared one, or None
    digest = hashlib.sha256(str(n).encode())
    saved = state_mod.rng_state()
    try:
        random.seed(SEED)
        np.random.seed(SEED)
        torch.default_generator.manual_seed(SEED)  # the CPU's only: CUDA's is not restored
        # a stream is read forwards: its first items
        for item in dataset.head(3) if stream else (
                dataset[i] for i in sorted({0, n // 2, n - 1})):
            feed(digest, item)
    finally:
        state_mod.set_rng_state(saved)
    return {"samples": n, "hash": digest.hexdigest()[:16]}
