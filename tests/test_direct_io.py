"""Checkpoint files written past the page cache hold exactly the bytes given, at every length
around the alignment and buffer boundaries, and a filesystem that refuses O_DIRECT still gets
its file."""
from __future__ import annotations

import errno
import os

import pytest
import torch

from elastic_jupyter.engine.state import checkpoint, direct_io
from elastic_jupyter.engine.state.direct_io import ALIGN, BUFFER, DirectFile, open_for_writing

LENGTHS = [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, BUFFER - 1, BUFFER, BUFFER + 1,
           2 * BUFFER + ALIGN + 7]


@pytest.mark.parametrize("length", LENGTHS)
def test_the_file_holds_exactly_what_was_written(tmp_path, length):
    data = os.urandom(length)
    path = tmp_path / "f"
    with open_for_writing(str(path)) as f:
        if not isinstance(f, DirectFile):
            pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
        for start in range(0, length, 1_000_003):  # pieces that straddle every boundary
            f.flush()  # torch.save may flush mid-way: nothing is cut short
            assert f.write(data[start:start + 1_000_003]) == len(data[start:start + 1_000_003])
        f.finish()
        f.finish()
        with pytest.raises(ValueError, match="write after finish"):
            f.write(b"x")
    assert path.read_bytes() == data


def test_a_filesystem_without_o_direct_gets_a_buffered_file(tmp_path, monkeypatch):
    real_open, refused = os.open, []

    def refusing(path, flags, *args):
        if flags & os.O_DIRECT:
            refused.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)
    monkeypatch.setattr(direct_io.os, "open", refusing)
    state = {"w": torch.randn(300, 300), "progress": {"step": 7}}
    record = checkpoint.write_checkpoint(str(tmp_path), state, keep=2)
    assert len(refused) == 1  # the buffered file wrote it
    assert checkpoint.verify(record["path"]) is None
    assert torch.equal(torch.load(record["path"], weights_only=True)["w"], state["w"])


def test_a_checkpoint_written_direct_loads_and_verifies(tmp_path):
    state = {"w": torch.randn(1000, 1000), "b": [torch.arange(5)], "progress": {"step": 3}}
    record = checkpoint.write_checkpoint(str(tmp_path), state, keep=2)
    assert record["bytes"] == os.path.getsize(record["path"])
    assert checkpoint.verify(record["path"]) is None
    loaded = torch.load(record["path"], weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"][0], state["b"][0])
