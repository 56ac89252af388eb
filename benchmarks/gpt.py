"""A GPT-style decoder and byte-level text from the Python standard library's own sources: the
real-model workload of the benchmarks (no download; the same text on every machine with the same
Python).

``SIZES`` names three models: ``5M``, ``50M`` and ``200M`` parameters (pre-norm decoder blocks:
causal self-attention through ``scaled_dot_product_attention``, a 4x GELU MLP, tied input and
output embeddings over the 256 byte values), after the GPT-2 layout (Radford et al., 2019).
``cell(size, seq_len, lr, transform_ms)`` is the training cell that runs on every engine and,
unchanged, in every torchrun process of the DDP baseline; ``transform_ms`` > 0 gives its dataset
a per-sample CPU transform of that cost (:class:`StdlibText`), for data-bound comparisons.
"""
from __future__ import annotations

import math
import time

import torch
from torch import nn
from torch.nn import functional as F

SIZES = {  # name: (layers, width, heads)
    "5M": (4, 320, 5),
    "50M": (10, 640, 10),
    "200M": (16, 1024, 16),
}


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Byte-level decoder: ``forward(tokens)`` with tokens (batch, seq) int64 in 0..255 gives
    logits (batch, seq, 256)."""

    def __init__(self, layers: int, width: int, heads: int, max_seq: int = 1024):
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Embedding(max_seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        for name, p in self.named_parameters():  # GPT-2's: residual projections scaled down
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.t()  # tied output embedding


def parameters(size: str) -> int:
    return sum(p.numel() for p in GPT(*SIZES[size]).parameters())


class StdlibText(torch.utils.data.Dataset):
    """Windows of `seq_len` + 1 bytes of the standard library's ``.py`` files, concatenated in
    sorted order (at most `limit` bytes); item i is (input, target), both int64 (seq_len,).

    With `transform_ms` > 0 each item goes through a per-sample CPU transform, as in a real
    input pipeline: a random augmentation, then busy work. The augmentation shifts the window
    by up to `seq_len` - 1 bytes and replaces about 1 input byte in 20 by a random byte; it draws
    with ``torch.randint`` and ``torch.rand``, so from torch's CPU generator, like a real
    augmentation (the elastic run's loader seeds that generator per sample, so its samples are
    repeatable; DDP's DataLoader seeds it per worker). The busy work repeats small torch ops on
    the window (a checksum, thrown away: a stand-in for decoding or tokenising) until the
    thread has used `transform_ms` ms of CPU time, so a sample costs the same CPU time on both
    sides of a comparison however busy the machine is. With 0 (the default) items are the
    plain windows.
    """

    def __init__(self, seq_len: int, limit: int = 8 * 2**20, transform_ms: float = 0.0):
        import pathlib
        import sysconfig
        root = pathlib.Path(sysconfig.get_paths()["stdlib"])
        chunks, total = [], 0
        for path in sorted(root.glob("*.py")):
            data = path.read_bytes()
            chunks.append(data)
            total += len(data)
            if total >= limit:
                break
        self.data = torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8)
        self.seq_len, self.transform_ms = seq_len, transform_ms

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int):
        if self.transform_ms > 0:
            return self._transformed(i)
        window = self.data[i * self.seq_len:(i + 1) * self.seq_len + 1].long()
        return window[:-1], window[1:]

    def _transformed(self, i: int):
        n = self.seq_len
        start = min(i * n + int(torch.randint(n, ())), len(self.data) - n - 1)
        window = self.data[start:start + n + 1].long()
        x, y = window[:-1].clone(), window[1:]
        noise = torch.rand(n) < 0.05
        x[noise] = torch.randint(256, (int(noise.sum()),))
        end, checksum = time.thread_time() + self.transform_ms / 1000, window
        while time.thread_time() < end:
            checksum = (checksum * 31 + window).remainder_(65521)
        return x, y


def cell(size: str, seq_len: int, lr: float = 3e-4, transform_ms: float = 0.0) -> str:
    """The training cell: this module's GPT of `size`, AdamW, next-byte cross-entropy; its
    dataset with a per-sample CPU transform of `transform_ms` ms when > 0 (:class:`StdlibText`)."""
    layers, width, heads = SIZES[size]
    transform = f", transform_ms={transform_ms!r}" if transform_ms else ""  # 0: the cell as before
    return f'''
import sys, torch
sys.path.insert(0, {str(__file__.rsplit("/", 1)[0])!r})
from gpt import GPT, StdlibText
dataset = StdlibText({seq_len}{transform})
model = GPT({layers}, {width}, {heads}, max_seq={seq_len})
optimizer = torch.optim.AdamW(model.parameters(), lr={lr})
def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
'''
