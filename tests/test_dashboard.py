"""The dashboard widget's traits and messages without a browser: a recorder stands in for the
front end on the widget's comm (messages in, messages out), against real runs on the pool."""
import math
import time

import numpy as np
import pytest

from conftest import DIGITS_CELL
from elastic_jupyter import RunConfig, TrainingRun, UsageError
from elastic_jupyter.server import series
from elastic_jupyter.ui.dashboard import SNAPSHOT_POINTS, Dashboard


class FrontEnd:
    """Records what the widget sends on its comm and sends it front-end messages."""

    def __init__(self, widget: Dashboard):
        self.widget, self.sent = widget, []
        widget.comm.kernel = True  # ipywidgets only sends on a comm that has a kernel
        widget.comm.publish_msg = self._record

    def _record(self, msg_type, data=None, metadata=None, buffers=None, **keys):
        self.sent.append((data, buffers or []))

    def send(self, **content) -> None:
        self.widget.comm.handle_msg({"content": {"data": {"method": "custom", "content": content}},
                                     "buffers": []})

    def custom(self, kind: str) -> list[tuple[dict, list]]:
        return [(d["content"], b) for d, b in self.sent
                if d.get("method") == "custom" and d["content"]["type"] == kind]

    def rows(self, kind: str = "append") -> dict[str, np.ndarray]:
        """The binary rows of every `kind` message, concatenated by column."""
        out = {}
        for content, buffers in self.custom(kind):
            for name, buf in zip(content["columns"], buffers):
                out.setdefault(name, []).append(np.frombuffer(buf, dtype=np.float64))
        return {k: np.concatenate(v) for k, v in out.items()}


def start(pool, tmp_path, name, steps, **kw):
    config = RunConfig(name=name, global_batch=64, steps=steps, checkpoint_every=0, **kw)
    return TrainingRun(pool, config, source=DIGITS_CELL, workspace=str(tmp_path)).start()


def test_appends_carry_each_step_once_as_binary_columns(idle_pool, tmp_path):
    run = start(idle_pool, tmp_path, "dash-append", 400)
    widget = Dashboard(run, feed=False)
    first = widget._sent_upto  # steps up to here came in the first snapshot
    fe = FrontEnd(widget)
    while run.active:
        widget.tick()
        time.sleep(0.05)
    widget.tick()
    rows = fe.rows()
    assert np.array_equal(rows["step"], np.arange(first + 1, 401))  # every step once, in order
    losses = [r["loss"] for r in run.history]
    assert np.array_equal(rows["loss"], np.array(losses[first:]))
    appends = fe.custom("append")
    assert len(appends) < 400 - first  # batched, not one message per step
    assert all(isinstance(b, memoryview) and b.nbytes == 8 * c["rows"] for c, bs in appends for b in bs)
    # each append names the step a view must hold: the last step of the append before it
    ends = [first] + [int(np.frombuffer(bs[0], dtype=np.float64)[-1]) for _, bs in appends]
    assert [c["after"] for c, _ in appends] == ends[:-1]
    status = widget.status
    assert status["state"] == "finished" and status["step"] == 400
    assert status["world_size"] == run.world_size


def test_a_late_view_gets_a_snapshot_not_the_whole_history_again(idle_pool, tmp_path):
    run = start(idle_pool, tmp_path, "dash-late", 300)
    run.wait(timeout=60)
    widget = Dashboard(run, feed=False)
    fe = FrontEnd(widget)
    widget.tick()
    assert not fe.custom("append") and not fe.custom("truncate")
    steps = widget.history["data"][widget.history["columns"].index("step")]
    assert steps == list(range(1, 301))  # short runs are not decimated


def test_snapshot_is_decimated_and_hello_fills_the_gap(idle_pool, tmp_path):
    run = start(idle_pool, tmp_path, "dash-snapshot", SNAPSHOT_POINTS * 2)
    run.wait(timeout=120)
    widget = Dashboard(run, feed=False)  # a view opened late: the snapshot covers the run
    snapshot = widget.history
    steps = snapshot["data"][snapshot["columns"].index("step")]
    assert len(steps) <= SNAPSHOT_POINTS * 1.2
    assert steps[-1] == run.step and steps == sorted(steps)
    fe = FrontEnd(widget)
    fe.send(type="hello", after=steps[-1] - 5)  # a view that lags five steps gets them
    assert list(fe.rows()["step"]) == list(range(run.step - 4, run.step + 1))
    [(reply, _)] = fe.custom("append")
    assert reply["reply"] and reply["after"] == steps[-1] - 5
    fe.send(type="range", **{"from": 100, "to": 150})  # zoom: full resolution
    assert list(fe.rows("range")["step"]) == list(range(100, 151))


def test_many_slider_moves_become_one_resize_request(idle_pool, tmp_path):
    run = start(idle_pool, tmp_path, "dash-coalesce", 100_000)
    try:
        widget = Dashboard(run, feed=False)
        fe = FrontEnd(widget)
        for value in [3, 4, 1, 4, 2, 4, 1, 3, 2, 3, 4, 1, 3]:  # a quick drag, last value 3
            fe.send(type="resize", world_size=value)
        deadline = time.monotonic() + 60
        while run.world_size != 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1)  # any further request would have been applied by now
        resizes = [e for e in run.events if e["kind"] == "resize"]
        assert [(e["from"], e["to"]) for e in resizes] == [(2, 3)]
        widget.tick()
        assert widget.status["world_size"] == 3 and widget.status["resize"]["to"] == 3
        assert any(m["kind"] == "resized" for m in widget.events)
    finally:
        run.stop()
        run.wait(timeout=60)


def test_bad_requests_are_refused_with_the_reason(idle_pool, tmp_path):
    run = start(idle_pool, tmp_path, "dash-bad", 100_000)
    widget = Dashboard(run, feed=False)
    fe = FrontEnd(widget)
    try:
        with pytest.raises(UsageError, match=r"outside this pool's bounds \[1, 4\]"):
            run.resize(9)
        fe.send(type="resize", world_size=9)
        assert "bounds [1, 4]" in widget.notice
        assert widget.notice.startswith("resize to 9 refused: "), widget.notice
        fe.send(type="resize", world_size="many")
        assert "integer" in widget.notice
    finally:
        run.stop()
        run.wait(timeout=60)
    widget.tick()
    assert widget.status["state"] == "stopped"
    fe.send(type="resize", world_size=2)
    time.sleep(0.5)  # the coalescing window
    assert "stopped" in widget.notice
    assert run.state == "stopped"


def test_plain_text_front_end_shows_the_summary(idle_pool, tmp_path):
    run = start(idle_pool, tmp_path, "dash-text", 50)
    run.wait(timeout=60)
    widget = run.dashboard()
    bundle = widget._repr_mimebundle_()
    text = bundle[0]["text/plain"] if isinstance(bundle, tuple) else bundle["text/plain"]
    assert text == run.summary() and "finished, step 50/50" in text


def test_plot_draws_the_run_and_saves_a_png(idle_pool, tmp_path):
    run = start(idle_pool, tmp_path, "dash-plot", 120)
    run.wait(timeout=60)
    path = tmp_path / "loss.png"
    fig = run.plot(save=str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = fig.axes[0]
    assert len(ax.lines[0].get_xdata()) == 120  # raw loss, one point per step
    with pytest.raises(ValueError, match="no metric 'accuracy'"):
        run.plot(metric="accuracy")
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        run.plot(smoothing=1.0)


def test_decimation_keeps_extremes_epoch_starts_and_evaluations():
    n = 100_000
    steps = np.arange(1, n + 1, dtype=float)
    loss = np.exp(-steps / 20_000) + 0.01 * np.sin(steps)
    loss[54_321] = 50.0  # a spike
    val = np.full(n, np.nan)
    val[::5000] = 0.5
    cols = {"step": steps, "epoch": np.floor(steps / 2500), "loss": loss, "val_loss": val}
    keep = series.decimate(cols, 2000)
    assert len(keep) <= 2000 + 40 + 20 + 1
    assert 54_321 in keep and n - 1 in keep
    assert set(np.flatnonzero(~np.isnan(val))) <= set(keep)
    assert set(np.flatnonzero(np.diff(cols["epoch"])) + 1) <= set(keep)
    # short epochs and an evaluation every step: neither may defeat the decimation
    cols.update(epoch=np.floor(steps / 3), val_loss=loss.copy())
    assert len(series.decimate(cols, 2000)) <= 2001


def test_ema_is_debiased_and_skips_gaps():
    values = np.array([2.0, math.nan, 2.0, 2.0])
    smoothed = series.ema(values, 0.9)
    assert smoothed[0] == pytest.approx(2.0) and math.isnan(smoothed[1])
    assert smoothed[3] == pytest.approx(2.0)  # a constant stays constant: no pull to zero
    assert np.array_equal(series.ema(values, 0.0)[[0, 2, 3]], values[[0, 2, 3]])
