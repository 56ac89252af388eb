"""Every batch structure a collate function can return reaches loss_fn and metric_fn intact.

``to_device`` is checked against the ``meta`` device (a real move on a CPU-only machine: every
tensor must end up there, every container keep its type); then each structure goes through a
real Worker's training steps and evaluation, with loss_fn and metric_fn checking what they got.
"""
import collections
import dataclasses

import pytest
import torch
from worlds import cell_namespace, config

from elastic_jupyter.engine.data.to_device import to_device
from elastic_jupyter.engine.worker import Worker

STRUCTURES = '''
import collections, dataclasses
import torch

Pair = collections.namedtuple("Pair", "x y")

@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    note: str = "kept"

@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    x: torch.Tensor
    y: torch.Tensor

class Encoding(collections.UserDict):
    """A tokenizer BatchEncoding-like Mapping that is not a dict, with no .to()."""

class Movable:
    """An object that says itself how it moves."""
    def __init__(self, x, y):
        self.x, self.y, self.moved_to = x, y, None
    def to(self, device):
        moved = Movable(self.x.to(device), self.y.to(device))
        moved.moved_to = device
        return moved
'''


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))
    elif isinstance(obj, collections.abc.Mapping):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
    elif hasattr(obj, "x"):
        yield from _tensors([obj.x, obj.y])


def _structures():
    ns = cell_namespace(STRUCTURES, 0)
    x, y = torch.ones(2, 3), torch.zeros(2)
    return ns, {
        "namedtuple": ns["Pair"](x, y),
        "dataclass": ns["Batch"](x, y),
        "frozen dataclass": ns["FrozenBatch"](x, y),
        "UserDict": ns["Encoding"](x=x, y=y),
        "defaultdict": collections.defaultdict(list, x=x, y=y),
        "object with .to()": ns["Movable"](x, y),
        "nested": {"pairs": [ns["Pair"](x, ns["Batch"](x, y))], "enc": ns["Encoding"](ids=(x, y)),
                   "n": 3},
    }


@pytest.mark.parametrize("kind", list(_structures()[1]))
def test_to_device_moves_every_tensor_and_keeps_every_type(kind):
    _, structures = _structures()
    batch = structures[kind]
    moved = to_device(batch, torch.device("meta"))
    assert type(moved) is type(batch)
    tensors = list(_tensors(moved))
    assert len(tensors) == len(list(_tensors(batch))) > 0
    assert all(t.device.type == "meta" for t in tensors), kind
    assert all(t.device.type == "cpu" for t in _tensors(batch))  # the original is untouched
    if kind == "dataclass":
        assert moved.note == "kept"
    if kind == "defaultdict":
        assert moved.default_factory is list
    if kind == "object with .to()":
        assert moved.moved_to == torch.device("meta")
    if kind == "nested":
        assert type(moved["pairs"][0]) is type(batch["pairs"][0])
        assert type(moved["pairs"][0].y) is type(batch["pairs"][0].y)
        assert type(moved["enc"]) is type(batch["enc"]) and moved["n"] == 3


# collate_fn builds STRUCTURE from a list of (x, y) samples; loss_fn and metric_fn read it back
# through UNPACK and check its type, so a structure rebuilt as something else fails the step
CELL = STRUCTURES + '''
dataset = torch.utils.data.TensorDataset(torch.randn(48, 3, dtype=torch.float64),
                                         torch.randn(48, dtype=torch.float64))
eval_dataset = dataset
model = torch.nn.Linear(3, 1).double()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
seen = []
def collate_fn(samples):
    x, y = torch.utils.data.default_collate(samples)
    return STRUCTURE
def unpack(batch):
    seen.append(type(batch).__name__)
    assert type(batch).__name__ == EXPECTED, type(batch)
    return UNPACK
def loss_fn(model, batch):
    x, y = unpack(batch)
    return torch.nn.functional.mse_loss(model(x).squeeze(1), y)
def metric_fn(model, batch):
    x, y = unpack(batch)
    return {"mse": torch.nn.functional.mse_loss(model(x).squeeze(1), y)}
'''
CASES = {
    "namedtuple": ("Pair(x, y)", "Pair", "batch.x, batch.y"),
    "dataclass": ("Batch(x, y)", "Batch", "batch.x, batch.y"),
    "frozen dataclass": ("FrozenBatch(x, y)", "FrozenBatch", "batch.x, batch.y"),
    "UserDict": ("Encoding(input=x, labels=y)", "Encoding", "batch['input'], batch['labels']"),
    "object with .to()": ("Movable(x, y)", "Movable", "batch.x, batch.y"),
    "nested": ("{'inputs': [Pair(x, Batch(y, y))], 'enc': Encoding(ids=(x,))}", "dict",
               "batch['enc']['ids'][0], batch['inputs'][0].y.x"),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_each_structure_trains_and_evaluates(kind):
    structure, expected, unpack = CASES[kind]
    cell = (CELL.replace("STRUCTURE", structure).replace("EXPECTED", repr(expected))
            .replace("UNPACK", unpack))
    cfg = config(global_batch=16, micro_batch=5)
    plain = cell.replace("return " + structure, "return x, y").replace(
        f"type(batch).__name__ == {expected!r}", "True").replace(unpack, "batch")
    worker = Worker(cell_namespace(cell, 3), dict(cfg, steps=3), "cpu")
    reference = Worker(cell_namespace(plain, 3), dict(cfg, steps=3), "cpu")
    for w in (worker, reference):
        for _ in range(3):
            w.history.append(w.train_step(0, 1)[0])
    # 3 steps x 4 micro-batches (5, 5, 5, 1), then evaluation of 48 samples in chunks of 5
    assert worker.evaluate(0, 1)["val_mse"] == reference.evaluate(0, 1)["val_mse"]
    assert worker.objects.loss_fn.__globals__["seen"] == [expected] * (12 + 10)
    assert [r["loss"] for r in worker.history] == [r["loss"] for r in reference.history]
    for p, q in zip(worker.model.parameters(), reference.model.parameters()):
        assert torch.equal(p, q)
