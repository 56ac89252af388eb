"""Replicated and sharded state are two implementations of one interface on each side
(engine.modes.state_mode.StateMode, run.run_mode.RunMode): no code outside them and their factories
branches on the mode, the interfaces have no flag for callers to read, and every refusal of
``--shard`` is a method of the sharded mode."""
import ast
import inspect
import pathlib

import pytest
import torch

from elastic_jupyter.config import RunConfig
from elastic_jupyter.engine.modes.factory import state_mode
from elastic_jupyter.engine.step.objects import CellObjects, SetupError
from elastic_jupyter.engine.modes.replicated import Replicated
from elastic_jupyter.engine.modes.sharded import Sharded
from elastic_jupyter.engine.modes.state_mode import StateMode
from elastic_jupyter.run.run_mode import ReplicatedRun, RunMode, ShardedRun, run_mode

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "elastic_jupyter"
# the modes, their machinery, the one factory on each side, and the option's own validation
ALLOWED = {"engine/modes/state_mode.py", "engine/modes/replicated.py", "engine/modes/sharded.py",
           "engine/sharded/lifecycle.py", "engine/modes/factory.py", "run/run_mode.py",
           "config/run.py"}
MODE_CLASSES = {"Replicated", "Sharded", "ReplicatedRun", "ShardedRun", "WholeFinalState",
                "ShardedFinalState", "GradReducer", "ShardedReducer"}


def _mode_reads(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "sharded":
            found.append((node.lineno, ".sharded"))
        if isinstance(node, ast.Attribute) and node.attr == "shard" and (
                isinstance(node.value, ast.Name) and node.value.id in ("config", "spec")
                or isinstance(node.value, ast.Attribute) and node.value.attr in ("config",
                                                                                  "spec")):
            found.append((node.lineno, "config.shard"))
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                and node.slice.value == "shard":
            found.append((node.lineno, "['shard']"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "get" and node.args \
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == "shard":
            found.append((node.lineno, ".get('shard')"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "isinstance" and len(node.args) == 2:
            named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            if named & MODE_CLASSES:
                found.append((node.lineno, f"isinstance(..., {sorted(named & MODE_CLASSES)})"))
    return found


def test_no_code_outside_the_modes_branches_on_the_mode():
    branches = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        if rel in ALLOWED:
            continue
        tree = ast.parse(path.read_text(), str(path))
        branches += [f"elastic_jupyter/{rel}:{line} reads {what}"
                     for line, what in _mode_reads(tree)]
    assert not branches, "\n".join(branches)


@pytest.mark.parametrize("interface", [StateMode, RunMode])
def test_the_interfaces_have_no_flag_for_callers_to_read(interface):
    flags = []
    for name, member in vars(interface).items():
        if name.startswith("_"):
            continue
        if isinstance(member, bool) or isinstance(member, property):
            flags.append(name)
        elif callable(member):
            sig = inspect.signature(member)
            if len(sig.parameters) == 1 and sig.return_annotation in (bool, "bool"):
                flags.append(name)
    assert not flags, flags


def test_each_side_has_both_implementations_of_every_method():
    for interface, impls in ((StateMode, (Replicated, Sharded)),
                             (RunMode, (ReplicatedRun, ShardedRun))):
        for impl in impls:
            assert not getattr(impl, "__abstractmethods__", None), impl
            assert issubclass(impl, interface)
    options = RunConfig("m").as_dict()
    assert type(state_mode(RunConfig.from_dict(options))) is Replicated
    assert type(state_mode(RunConfig.from_dict(dict(options, shard=True)))) is Sharded
    assert type(run_mode(RunConfig("m", shard=True))) is ShardedRun


def test_the_sharded_modes_refusals_are_its_methods_in_one_class():
    checked = inspect.getsource(Sharded.check)
    refusals = [name for name in vars(Sharded) if name.startswith("_")
                and not name.startswith("__") and f"self.{name}" in checked]
    assert len(refusals) >= 8, refusals  # each refusal is a method the check calls
    model = torch.nn.Linear(2, 2)
    cell = CellObjects.of({"model": model, "optimizer": torch.optim.SGD(model.parameters(), 0.1),
                           "dataset": [torch.zeros(2)] * 64,
                           "loss_fn": lambda model, batch: model(batch).sum()}, RunConfig("m"))
    with pytest.raises(SetupError, match="--sync-batchnorm is not supported with shard=True"):
        state_mode(RunConfig("m", shard=True, sync_batchnorm=True)).check(
            cell, torch.device("cpu"))
    state_mode(RunConfig("m", sync_batchnorm=True)).check(cell, torch.device("cpu"))
    # one optimizer, but named: the dict form is several optimizers' (engine.step.optimizers)
    named = CellObjects.of({"model": model,
                            "optimizer": {"main": torch.optim.SGD(model.parameters(), 0.1)},
                            "dataset": [torch.zeros(2)] * 64,
                            "loss_fn": {"main": lambda model, batch: model(batch).sum()}},
                           RunConfig("m"))
    with pytest.raises(SetupError, match="--shard trains one optimizer"):
        state_mode(RunConfig("m", shard=True)).check(named, torch.device("cpu"))
