"""Writing a large file past the page cache (``O_DIRECT``), for checkpoints.

A buffered write copies every byte into the page cache and leaves the kernel's writeback
threads to send it to the device later, on whichever core they are scheduled. With
``O_DIRECT`` the device reads the data straight from our buffer and nothing is left for
writeback. (In one probe run, BENCHMARKS.md, a buffered write + fsync of a 0.59 GB state from
another process slowed training as much as our whole checkpoint write did, an ``O_DIRECT``
write a quarter of that; a second run could not separate them. Our checkpoint's median cost
fell from 15 % to 7-8 % of a synchronous save with this file.)

``O_DIRECT`` wants the buffer's address, the length and the file offset aligned to the
device's block; :class:`DirectFile` copies what it is given into an aligned buffer and writes
whole blocks, the last one padded and the file then cut to its true length. Filesystems that
refuse ``O_DIRECT`` (tmpfs, some network filesystems) get an ordinary buffered file instead.
"""
from __future__ import annotations

import errno
import mmap
import os

ALIGN = 4096  # bytes: a multiple of every device's logical block (512 or 4096)
BUFFER = 8 << 20  # bytes copied per O_DIRECT write


class DirectFile:
    """A new file at `path` written sequentially past the page cache.

    The file-like subset ``torch.save`` and :func:`engine.state.checkpoint.atomic_write` use:
    :meth:`write`, :meth:`flush` (nothing: a partial block cannot be written), :meth:`finish`
    (writes the padded tail and cuts the file to its length: the data is complete after it,
    and nothing more may be written), :meth:`fileno`, and use as a context manager (closes).
    Raises OSError as ``os.write`` does (a full disk: ENOSPC).
    """

    def __init__(self, path: str, flags: int):
        self._buffer = mmap.mmap(-1, BUFFER)  # page-aligned, as O_DIRECT needs
        self._view = memoryview(self._buffer)
        try:
            self._fd = os.open(path, flags | os.O_DIRECT, 0o666)
        except BaseException:
            self._view.release()
            self._buffer.close()
            raise
        self._fill = 0  # bytes waiting in the buffer
        self._written = 0  # bytes on the device (a multiple of ALIGN until the tail)
        self._finished = False

    def write(self, data) -> int:
        if self._finished:
            raise ValueError("write after finish: the file is complete")
        data = memoryview(data).cast("B")
        done = 0
        while done < len(data):
            take = min(BUFFER - self._fill, len(data) - done)
            self._view[self._fill:self._fill + take] = data[done:done + take]
            self._fill += take
            done += take
            if self._fill == BUFFER:
                self._write_buffer(BUFFER)
        return done

    def flush(self) -> None:
        """Nothing: whole blocks are written as they fill; the tail waits for :meth:`finish`."""

    def finish(self) -> None:
        if self._finished:
            return
        length = self._written + self._fill
        padded = -(-self._fill // ALIGN) * ALIGN
        self._view[self._fill:padded] = bytes(padded - self._fill)
        self._write_buffer(padded)
        os.ftruncate(self._fd, length)
        self._finished = True

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._view.release()
            self._buffer.close()

    def __enter__(self) -> "DirectFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write_buffer(self, n: int) -> None:
        view, sent = self._view[:n], 0
        try:
            while sent < n:  # a short write ends on a block boundary: go on from there
                sent += os.write(self._fd, view[sent:])
        finally:
            view.release()
        self._written += n
        self._fill = 0


def open_for_writing(path: str):
    """A new file at `path` (truncated if it exists) for one sequential write:
    a :class:`DirectFile` where the filesystem takes ``O_DIRECT``, else a buffered file."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    if hasattr(os, "O_DIRECT"):
        try:
            return DirectFile(path, flags)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return open(path, "wb")
