"""docs/ARCHITECTURE.md stays a map a newcomer reads in ten minutes, and a true one: at most
2,000 words, lines of at most 100 characters, every ``file.py:name`` it names exists, and the
module count it gives for the resize path is the count of the modules that path names."""
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
TEXT = DOC.read_text()
# `run/driver.py:Driver.take_requests`, `labextension/src/common/api.ts:RunsClient.resize`
REFERENCE = re.compile(r"`((?:[\w.-]+/)*[\w-]+\.(?:py|ts)):([\w.]+)`")
FILE = re.compile(r"`((?:[\w.-]+/)+[\w-]+\.(?:py|ts|md))`")


def _path(name: str) -> pathlib.Path:
    if name.startswith(("labextension/", "tests/", "docs/", "benchmarks/")):
        return ROOT / name
    return ROOT / "elastic_jupyter" / name


def _defined(tree: ast.AST, dotted: str) -> bool:
    """Whether `dotted` (a function, a class, a class's method, a module's constant) is
    defined at the top of `tree`, method names inside their class."""
    scope = tree.body  # type: ignore[attr-defined]
    for part in dotted.split("."):
        found = None
        for node in scope:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                    and node.name == part:
                found = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and part in [
                    t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                    if isinstance(t, ast.Name)]:
                found = node
        if found is None:
            return False
        scope = getattr(found, "body", [])
    return True


def test_the_map_is_short_and_wrapped():
    words = len(TEXT.split())
    assert words <= 2000, f"{words} words: the map is read in ten minutes, at most 2,000"
    long = [f"line {i}: {len(line)} characters" for i, line in enumerate(TEXT.splitlines(), 1)
            if len(line) > 100]
    assert not long, "\n".join(long)


def test_every_file_and_function_it_names_exists():
    missing = []
    for name, dotted in REFERENCE.findall(TEXT):
        path = _path(name)
        if not path.exists():
            missing.append(f"{name}: no such file")
        elif path.suffix == ".py":
            if not _defined(ast.parse(path.read_text()), dotted):
                missing.append(f"{name}:{dotted}: not defined there")
        elif not all(re.search(rf"\b{re.escape(part)}\s*[(<{{]|class {re.escape(part)}\b",
                               path.read_text()) for part in dotted.split(".")):
            missing.append(f"{name}:{dotted}: not defined there")
    missing += [f"{name}: no such file" for name in FILE.findall(TEXT)
                if not _path(name).exists()]
    assert REFERENCE.findall(TEXT), "the map names no file:function"
    assert not missing, "\n".join(missing)


def test_the_resize_path_counts_the_modules_it_names():
    section = TEXT.split("## One resize", 1)[1].split("\nUnder `--shard`", 1)[0]
    named = {name for name, _ in REFERENCE.findall(section) if name.endswith(".py")}
    named |= {name for name in FILE.findall(section) if name.endswith(".py")}
    stated = re.search(r"The path crosses (\d+) package modules", section)
    assert stated, "the resize path says how many package modules it crosses"
    assert int(stated.group(1)) == len(named), sorted(named)
