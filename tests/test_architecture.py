"""The architecture, checked rather than only drawn (docs/ARCHITECTURE.md): import-linter's
contracts in pyproject.toml hold (the layers ui -> run -> (server | pool) -> (arbiter | engine),
engine/ apart from the rest, no import cycles), mypy finds no error in elastic_jupyter/, the
engines (and the options and event kinds they read) import only torch, numpy and the standard
library, each of engine/'s wings names its modules in its docstring, engines are called only
from pool/engine_calls.py, no module but the Sizer's writes a Sizer's attribute, run/ enters
the pool by one door (pool/supply.py), and no module reads another object's private state.
Each tool runs as the developer would run it, and its report is the failure's message."""
import ast
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENGINE = ROOT / "elastic_jupyter" / "engine"
BIN = os.path.dirname(sys.executable)  # the test environment's scripts (lint-imports)


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _mypy_cache() -> str:
    """mypy's cache: in the test environment (out of the work tree, gone with `make clean`), so
    that only the first run of a fresh clone checks cold (~20 s against ~1 s)."""
    if os.access(sys.prefix, os.W_OK):
        return os.path.join(sys.prefix, ".mypy_cache")
    return os.path.join(tempfile.gettempdir(), f"elastic-jupyter-mypy-{os.getuid()}")


def test_the_import_contracts_hold():
    # --no-cache: the graph takes a fraction of a second to build, and no cache folder is left
    out = _run([os.path.join(BIN, "lint-imports"), "--no-cache", "--no-logo"])
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_package_type_checks():
    # what to check and how strictly: [tool.mypy] in pyproject.toml
    out = _run([sys.executable, "-m", "mypy", "--cache-dir", _mypy_cache()])
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_engines_import_only_torch_numpy_and_the_standard_library():
    # import-linter forbids the kernel's packages by name (pyproject.toml); this catches any other
    allowed = set(sys.stdlib_module_names) | {"torch", "numpy"}
    outside = []
    # engines read the options and the event kinds too
    shared = sorted((ROOT / "elastic_jupyter" / "config").rglob("*.py")) + [
        ROOT / "elastic_jupyter" / "events.py"]
    for path in sorted(ENGINE.rglob("*.py")) + shared:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue  # relative imports stay in the package: the contracts check where
            outside += [f"{path.relative_to(ROOT)}:{node.lineno} imports {name}" for name in names
                        if name.split(".")[0] not in allowed
                        and not (name + ".").startswith("elastic_jupyter.engine.")]
    assert not outside, "\n".join(outside)


def test_each_engine_wing_names_its_modules_in_its_map():
    # a wing's __init__ docstring is its part of the map (docs/ARCHITECTURE.md): a module it does
    # not name is one a newcomer cannot find from there
    unnamed = []
    for init in sorted(ENGINE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        unnamed += [f"{path.relative_to(ROOT)}: not in its wing's docstring"
                    for path in sorted(init.parent.glob("*.py"))
                    if path.name != "__init__.py" and f"``{path.stem}``" not in doc]
    assert len(list(ENGINE.glob("*/__init__.py"))) == 6  # modes, sharded, step, data, state, group
    assert not unnamed, "\n".join(unnamed)


def _trees():
    for path in sorted((ROOT / "elastic_jupyter").rglob("*.py")):
        yield path.relative_to(ROOT), ast.parse(path.read_text(), str(path))


def test_only_the_engine_calls_module_calls_apply_async():
    calls = [f"{path}:{node.lineno}" for path, tree in _trees()
             if path != pathlib.Path("elastic_jupyter/pool/engine_calls.py")
             for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr == "apply_async"]
    assert not calls, "\n".join(calls)


def _names_a_sizer(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id.lstrip("_") == "sizer") or (
        isinstance(node, ast.Attribute) and node.attr.lstrip("_") == "sizer")


def test_no_code_outside_the_sizing_module_writes_a_sizers_attribute():
    """The Sizer alone writes its state (run/sizing.py): everyone else calls its methods."""
    writes = []
    for path, tree in _trees():
        if path == pathlib.Path("elastic_jupyter/run/sizing.py"):
            continue
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("setattr", "delattr") and node.args:
                targets = [ast.Attribute(value=node.args[0], attr="?")]
            writes += [f"{path}:{node.lineno}" for target in targets
                       if isinstance(target, ast.Attribute) and _names_a_sizer(target.value)]
    assert not writes, "\n".join(writes)


POOL = pathlib.Path("elastic_jupyter/pool/pool.py")


def _pool_parts() -> set[str]:
    """The parts EnginePool.__init__ builds and holds (its public attributes)."""
    tree = ast.parse((ROOT / POOL).read_text())
    pool = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EnginePool")
    init = next(n for n in pool.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {t.attr for node in ast.walk(init) if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Attribute)
            and isinstance(t.value, ast.Name) and t.value.id == "self"
            and not t.attr.startswith("_")}


def _names_a_pool(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "pool") or (
        isinstance(node, ast.Attribute) and node.attr.lstrip("_") == "pool")


def _forwards(member: ast.FunctionDef, parts: set[str]) -> bool:
    """Whether `member`'s body (its docstring aside) only returns or calls an attribute of one
    of the pool's parts (``return self.slots.excluded``, ``self.slots.readmit(slot)``)."""
    body = [s for s in member.body if not (isinstance(s, ast.Expr)
                                           and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], (ast.Return, ast.Expr)) or body[0].value is None:
        return False
    value = body[0].value
    if isinstance(value, ast.Await):
        value = value.value
    if isinstance(value, ast.Call):
        value = value.func
    return (isinstance(value, ast.Attribute) and isinstance(value.value, ast.Attribute)
            and isinstance(value.value.value, ast.Name) and value.value.value.id == "self"
            and value.value.attr in parts)


def test_a_run_goes_through_one_door_into_the_pool_and_the_pool_forwards_nothing_new():
    """run/ never reaches through the pool into its parts (engine sets, slots, launcher,
    lease, owner): it holds the pool's EngineSupply (pool/supply.py), the run's one door,
    and calls it; and EnginePool gains no member that only hands a call on to a part."""
    parts = _pool_parts()
    assert {"engine_sets", "slots", "launcher", "lease", "supply"} <= parts, parts
    reaches = []
    for path, tree in _trees():
        if path.parts[:2] != ("elastic_jupyter", "run"):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            if _names_a_pool(node.value) and node.attr in parts - {"supply"}:
                reaches.append(f"{path}:{node.lineno}: pool.{node.attr}")
            if isinstance(node.value, ast.Attribute) and node.value.attr == "supply" \
                    and _names_a_pool(node.value.value):
                reaches.append(f"{path}:{node.lineno}: pool.supply.{node.attr} (hold the "
                               "supply instead)")
    assert not reaches, "\n".join(reaches)
    pool = next(n for n in ast.parse((ROOT / POOL).read_text()).body
                if isinstance(n, ast.ClassDef) and n.name == "EnginePool")
    members = [m for m in pool.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
    forwarding = {m.name for m in members if _forwards(m, parts)}
    assert not forwarding, sorted(forwarding)
    # the check still sees forwarding where it is: a removed member, as it was written
    removed = ast.parse('''
class EnginePool:
    @property
    def engines(self):
        """The engines, oldest first."""
        return self.engine_sets.engines

    async def resize_idle(self, n):
        await self.engine_sets.resize(n)
''').body[0]
    assert all(_forwards(m, parts) for m in removed.body)


def test_the_owner_side_touches_no_other_objects_private_state():
    out = subprocess.run([sys.executable, "-m", "pylint", "--disable=all",
                          "--enable=protected-access", "elastic_jupyter"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout
