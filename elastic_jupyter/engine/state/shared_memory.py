"""Staging memory that another process on this host maps too: CPU tensors in shared chunks.

A checkpoint's copies land here (engine.state.training_state.Staging), so the writer process
(engine.state.checkpoint_process) reads them in place: no copy through a pipe, and its serialization
never takes this process's interpreter lock. torch.distributed.checkpoint's process-based
asynchronous save stages into shared (and pinned) memory for the same reason.

Memory comes in chunks of at least :data:`CHUNK` bytes, each an anonymous file (``memfd``)
mapped shared; a tensor handed out is a slice of one, with a storage of its own (so
``torch.save`` writes each as its own record). The chunk's file descriptor stays open so it can
be sent to the writer (``socket.send_fds``). Linux only: :func:`available` says whether.
"""
from __future__ import annotations

import math
import mmap
import os
import weakref

import torch

CHUNK = 256 << 20  # bytes: few chunks (few descriptors) for any model, little slack
ALIGN = 64  # bytes, as torch aligns its own CPU allocations


def available() -> bool:
    return hasattr(os, "memfd_create")


class _Chunk:
    def __init__(self, size: int):
        self.size, self.used, self.pinned = size, 0, 0  # pinned: bytes page-locked from base
        fd = os.memfd_create("elastic-jupyter-staging", os.MFD_CLOEXEC)
        self._close_fd = weakref.finalize(self, os.close, fd)  # also when dropped unclosed
        self.fd = fd
        os.ftruncate(fd, size)
        self.map = mmap.mmap(fd, size)
        self.base = torch.frombuffer(self.map, dtype=torch.uint8).data_ptr()

    def take(self, nbytes: int) -> int | None:
        """Byte offset of `nbytes` more, or None when this chunk has no room left."""
        offset = -(-self.used // ALIGN) * ALIGN
        if offset + nbytes > self.size:
            return None
        self.used = offset + nbytes
        return offset

    def pin_used(self) -> None:
        """Page-lock the part in use (portable: for every device's copies), as
        ``pin_memory=True`` would. Raises RuntimeError when CUDA refuses."""
        need = -(-self.used // mmap.PAGESIZE) * mmap.PAGESIZE
        if self.pinned >= need:
            return
        self._unpin()
        error = int(torch.cuda.cudart().cudaHostRegister(self.base, need, 1))
        if error != 0:
            raise RuntimeError(f"cudaHostRegister of {need} bytes failed ({error})")
        self.pinned = need

    def _unpin(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.base)
            self.pinned = 0

    def close(self) -> None:
        """Unpin and close the descriptor; the memory goes with the last tensor that uses it."""
        self._unpin()
        self._close_fd()


class Arena:
    """Chunks of shared memory handed out as tensors, on the side that fills them.

    Space is never reused within a chunk: a chunk is dropped (:meth:`keep_only`) once none of
    the tensors still in use lies in it. Staging hands out the same tensors capture after
    capture, so in a steady run the arena holds exactly the state once.
    """

    def __init__(self):
        self._chunks: dict[int, _Chunk] = {}
        self._next_id = 0

    def tensor(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of `shape` and `dtype` in shared memory.
        Raises OSError when no shared memory can be made (out of memory or descriptors, or
        refused by a sandbox)."""
        numel = math.prod(shape)
        chunk_id, offset = self._room(numel * dtype.itemsize)
        chunk = self._chunks[chunk_id]
        return torch.frombuffer(chunk.map, dtype=dtype, count=numel, offset=offset).view(shape)

    def pin_used(self) -> None:
        """Page-lock what is in use, for asynchronous copies from a GPU: called once copies
        are done (a copy into memory not yet locked is synchronous, and as correct), it locks
        no more than the state, and again only when the state outgrew it. Raises RuntimeError
        when CUDA refuses."""
        for chunk in self._chunks.values():
            chunk.pin_used()

    def _room(self, nbytes: int) -> tuple[int, int]:
        for chunk_id, chunk in self._chunks.items():
            offset = chunk.take(nbytes)
            if offset is not None:
                return chunk_id, offset
        size = -(-max(CHUNK, nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE
        chunk_id, self._next_id = self._next_id, self._next_id + 1
        chunk = self._chunks[chunk_id] = _Chunk(size)
        offset = chunk.take(nbytes)
        assert offset is not None  # a new chunk holds at least nbytes
        return chunk_id, offset

    def locate(self, t: torch.Tensor) -> tuple[int, int] | None:
        """(chunk id, byte offset) of a tensor handed out here, None for any other tensor."""
        if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
            return None
        address = t.data_ptr()
        for chunk_id, chunk in self._chunks.items():
            if chunk.base <= address < chunk.base + chunk.size:
                return chunk_id, address - chunk.base
        return None

    def nbytes(self) -> int:
        """Bytes handed out (the staged state's size, as chunks are not reused)."""
        return sum(c.used for c in self._chunks.values())

    def chunks(self) -> dict[int, tuple[int, int]]:
        """{chunk id: (file descriptor, bytes in use rounded up to a page)}: what a reader
        maps (no more: mapping a chunk's untouched tail could allocate it)."""
        page = mmap.PAGESIZE
        return {i: (c.fd, -(-c.used // page) * page) for i, c in self._chunks.items()}

    def keep_only(self, tensors) -> None:
        """Drop the chunks that none of `tensors` lies in."""
        used = {where[0] for where in map(self.locate, tensors) if where is not None}
        for chunk_id in [i for i in self._chunks if i not in used]:
            self._chunks.pop(chunk_id).close()


class Mapped:
    """The same chunks, mapped on the side that reads them (the writer process), for one
    write: nothing of them stays mapped once this and its tensors are gone, so memory the
    filling side frees is free."""

    def __init__(self, chunks: list[tuple[int, int]], fds: list[int]):
        """Map `chunks` ([(chunk id, bytes)]) received as `fds` (all closed here)."""
        self._maps: dict[int, mmap.mmap] = {}
        try:
            for (chunk_id, size), fd in zip(chunks, fds, strict=True):
                self._maps[chunk_id] = mmap.mmap(fd, size, flags=_MAP_FLAGS)
        finally:
            for fd in fds:
                os.close(fd)

    def tensor(self, chunk_id: int, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
        return torch.frombuffer(self._maps[chunk_id], dtype=dtype, count=math.prod(shape),
                                offset=offset).view(shape)


# the whole chunk is read: map its pages at once rather than one fault at a time
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
