"""One enumeration of the run's event kinds (elastic_jupyter.events): the run's log refuses
any other, no code names a kind by a string of its own, and the front end's chart, run.plot()
and the dashboard's markers draw the kinds the enumeration says."""
import ast
import pathlib
import re

import pytest

from elastic_jupyter.events import DRAWN, MARKED, EventKind
from elastic_jupyter.run.runlog import RunLog
from elastic_jupyter.ui import dashboard, plot

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "elastic_jupyter"
CHART = ROOT / "labextension" / "src" / "chart" / "lossChart.ts"
EVENT_CALLS = {"event", "note_event", "last_event"}


def test_the_run_log_stores_a_kind_as_its_string_and_refuses_an_unknown_one(tmp_path):
    log = RunLog(str(tmp_path))
    event = log.event(EventKind.FAULT, step=3, rolled_back_to=2)
    assert type(event["kind"]) is str and event["kind"] == "fault"
    assert log.last_event("fault") is event
    with pytest.raises(ValueError, match="'faultt' is not a valid EventKind"):
        log.event("faultt")
    assert log.events == [event]


def test_no_code_names_an_event_kind_by_a_string_of_its_own():
    strings = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "arbiter" in path.parts:  # the arbiter's own slot events (grew, gave) are not a run's
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in EVENT_CALLS and node.args \
                    and isinstance(node.args[0], ast.Constant):
                strings.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.args[0].value!r}")
            if isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values):
                    if isinstance(key, ast.Constant) and key.value == "kind" \
                            and isinstance(value, ast.Constant) and value.value in {
                                k.value for k in EventKind}:
                        strings.append(f"{path.relative_to(ROOT)}:{node.lineno} {value.value!r}")
    assert not strings, "\n".join(strings)


def test_the_chart_and_run_plot_draw_the_kinds_the_enumeration_draws():
    source = CHART.read_text()
    styles = re.search(r"const MARKER_STYLE[^=]*= \{(.*?)\n\};", source, re.S).group(1)
    drawn = set(re.findall(r"^\s*(\w+): \{", styles, re.M))
    assert drawn == {k.value for k in DRAWN}
    assert set(plot.MARKER_STYLE) == set(DRAWN)
    labelled = re.search(r"const LABELLED = new Set\(\[(.*?)\]\)", source).group(1)
    assert set(re.findall(r"'(\w+)'", labelled)) <= drawn
    assert dashboard.MARKER_KINDS == {k.value for k in MARKED} and DRAWN <= set(MARKED)


def test_every_event_kind_the_front_end_compares_is_one_of_the_enumeration():
    named = set()
    for path in sorted((ROOT / "labextension" / "src").rglob("*.ts")):
        named |= set(re.findall(r"\b(?:e|m|event)\.kind\s*[!=]==\s*'(\w+)'", path.read_text()))
    assert named, "the pattern no longer finds the front end's comparisons"
    assert named <= {k.value for k in EventKind}, named - {k.value for k in EventKind}
