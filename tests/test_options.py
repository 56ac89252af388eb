"""Each option declared once (elastic_jupyter.config): the engines read the kernel's RunConfig
back from its dict, old names warn and still work, a removed option is refused saying why,
--help shows its sections with defaults from the declarations, docs/options.md is generated
from them, and environment variables are read only through their declarations."""
import ast
import pathlib
import re
import warnings
from dataclasses import MISSING

import pytest

from elastic_jupyter.config import (NEEDS_VALUE, REMOVED, VARIABLES, Group, LauncherOptions,
                                    PoolOptions, RunConfig, RunStart, UsageError, flagged)
from elastic_jupyter.ui import magics, options_page

ROOT = pathlib.Path(__file__).resolve().parent.parent
DECLARATIONS = (RunConfig, RunStart, PoolOptions, LauncherOptions, magics._TrainLine,
                magics._PoolLine, magics._ResizeLine)


def test_a_run_config_crosses_as_a_dict_and_reads_back_the_same():
    config = RunConfig("r", global_batch=32, micro_batch=4, sync_batchnorm=True, total_steps=7)
    sent = config.as_dict()
    assert RunConfig.from_dict(sent) == config
    assert RunConfig.from_dict(dict(sent, dataset={"hash": "x"})).global_batch == 32
    # a part of one (tests and benchmarks build a Worker's this way): defaults, no name
    part = RunConfig.from_dict({"global_batch": 8})
    assert (part.name, part.global_batch, part.seed) == ("", 8, 0)


def test_a_checkpoints_config_of_the_release_before_reads_with_the_new_names():
    old = {"name": "r", "workers": 2, "keep": 5, "commit_every": 4, "global_batch": 8}
    config = RunConfig.from_dict(old)
    assert (config.loader_processes, config.keep_checkpoints, config.global_batch) == (2, 5, 8)
    # a dict with both names: the new one wins
    assert RunConfig.from_dict(dict(old, loader_processes=1)).loader_processes == 1


@pytest.mark.parametrize("old, new, field, value", [
    ("--workers", "--loader-processes", "loader_processes", 2),
    ("--keep", "--keep-checkpoints", "keep_checkpoints", 7)])
def test_a_renamed_flag_still_works_for_one_release_and_warns_with_its_new_name(
        old, new, field, value):
    with pytest.warns(FutureWarning, match=f"{old} is now {new}; the old spelling goes in "
                                           r"release 0\.3\.0"):
        line = magics._train_parser().parse_args(["--name", "x", old, str(value)])
    assert getattr(magics.values(RunConfig, line), field) == value
    keyword = old.lstrip("-")
    with pytest.warns(FutureWarning, match=f"RunConfig\\({keyword}=...\\) is now "
                                           f"RunConfig\\({field}=...\\)"):
        assert getattr(RunConfig("x", **{keyword: value}), field) == value
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling says nothing
        assert getattr(magics.values(RunConfig, magics._train_parser().parse_args(
            ["--name", "x", new, str(value)])), field) == value
    # listed under its new name only
    assert not re.search(rf"{old}(?![\w-])", magics._train_parser().format_help())


def test_help_shows_the_sections_in_order_each_default_from_the_declaration():
    text = magics._train_parser().format_help()
    sections = [g.value for g in Group]
    at = [text.index(f"\n{title}:\n") for title in sections]
    assert at == sorted(at), "the sections are out of order"
    assert "(default 64)" in text and "(default 3)" in text and "(default 30.0)" in text
    for cls in DECLARATIONS:
        for option, spelled in flagged(cls):
            helped = re.sub(r"default %\(default\)s", "", spelled.help or "")
            assert "default" not in helped, f"{spelled.name} spells a default by hand: {helped}"
            if option.default is not MISSING and option.default not in (None, False, "") \
                    and spelled.sets is NEEDS_VALUE:  # --no-lend: a flag alone
                assert "%(default)s" in (spelled.help or ""), spelled.name


def test_every_option_of_the_train_line_has_a_section():
    line = flagged(RunConfig) + flagged(RunStart) + flagged(PoolOptions, "auto", "weight") + \
        flagged(magics._TrainLine)
    unsectioned = [s.name for _, s in line if s.group is None and s.name.startswith("-")]
    assert not unsectioned


def test_a_removed_option_is_refused_with_why_in_either_spelling():
    gone = REMOVED[0]
    with pytest.raises(UsageError, match=re.escape(gone.message())):
        magics._train_parser().parse_args(["--name", "x", gone.name, "5"])
    with pytest.raises(UsageError, match=re.escape(gone.message())):
        RunConfig("x", **{gone.keyword: 5})


def test_the_options_page_is_the_declarations():
    committed = (ROOT / "docs" / "options.md").read_text()
    assert committed == options_page.page(), (
        "docs/options.md differs from the declarations: run "
        "`.venv/bin/python -m elastic_jupyter.ui.options_page > docs/options.md`")
    for variable in VARIABLES:
        assert f"`{variable.name}`" in committed


def test_environment_variables_are_named_only_by_their_declarations():
    declared = {v.name for v in VARIABLES}
    named = []
    for path in sorted((ROOT / "elastic_jupyter").rglob("*.py")):
        if path.name == "environment.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in declared:
                named.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value}")
    assert not named, "\n".join(named)


def _keywords(cls) -> dict:
    import inspect
    return {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
            if name != "self"}


def test_the_pool_and_the_run_take_only_declared_keywords_with_their_defaults():
    from dataclasses import fields

    from elastic_jupyter import EnginePool, TrainingRun
    pool = _keywords(EnginePool)
    declared = {f.name: f.default for f in fields(PoolOptions)}
    assert pool.pop("launcher") is None  # LauncherOptions' launcher, as a Launcher object
    assert pool == declared
    run = _keywords(TrainingRun)
    assert list(run)[:2] == ["pool", "config"]
    assert {k: v for k, v in run.items() if k not in ("pool", "config")} == {
        f.name: f.default for f in fields(RunStart)}
