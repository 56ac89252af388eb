"""run.plot(): the dashboard's picture as a static matplotlib figure (exported notebooks, papers,
the headless quick start)."""
from __future__ import annotations

import os

import numpy as np

from ..events import Event, EventKind
from ..server import series

MARKER_STYLE: dict[str, tuple[str, str, str]] = {  # kind (events.DRAWN): (colour, style, label)
    EventKind.RESIZED: ("tab:green", "--", "resize"),
    EventKind.FAULT: ("tab:red", "-", "fault"),
    EventKind.CHECKPOINT: ("0.55", ":", "checkpoint"),
    EventKind.SLOT: ("tab:purple", ":", "slot moved (the machine's arbiter)"),
    EventKind.DRAIN: ("tab:orange", "-.", "drain (told to go by its scheduler)"),
}


def plot_run(history: list[dict], events: list[Event], title: str = "", save: str | None = None,
             smoothing: float = 0.6, log: bool = False, metric: str | None = None):
    """Draw training loss against step with the world size as a step line and a vertical
    marker at every resize, fault and checkpoint.

    Args:
        history: per-step records (``run.history``); events: ``run.events``.
        smoothing: weight of the debiased moving average drawn over the faint raw loss, in
            [0, 1); 0 draws the raw loss only.
        log: logarithmic loss axis.
        metric: an extra series to draw in a second panel (an extra metric from ``loss_fn`` or a
            ``val_*`` metric); by default a ``val_*`` metric other than val_loss, if any.
        save: write the figure there (format from the extension) as well as returning it.

    Returns a ``matplotlib.figure.Figure``. Raises ValueError for an unknown `metric` or a
    smoothing weight outside [0, 1).
    """
    import matplotlib.pyplot as plt

    cols = series.columns(history, series.column_names(history))
    extra = [n for n in cols if n not in series.BASE_COLUMNS]
    if metric is None:
        metric = next((n for n in extra if n.startswith("val_") and n != "val_loss"), None)
    elif metric not in cols:
        raise ValueError(f"no metric {metric!r} in this run; it has: {', '.join(extra) or 'none'}")
    fig, axes = plt.subplots(2 if metric else 1, 1, sharex=True, squeeze=False,
                             figsize=(9, 6 if metric else 4.2), height_ratios=[3, 1.4][:1 + bool(metric)])
    ax = axes[0][0]
    _draw_loss(ax, cols, smoothing, log)
    _draw_world_size(ax, cols)
    if metric:
        _draw_metric(axes[1][0], cols, metric)
    for row in axes:
        _draw_markers(row[0], cols, events)
    ax.set_title(title or "training loss")
    ax.legend(loc="upper right", fontsize="small", framealpha=0.85)
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    plt.close(fig)  # returned, not left open: Jupyter displays the return value once
    if save:
        fig.savefig(os.path.abspath(save), dpi=120)
    return fig


def _draw_loss(ax, cols: dict, smoothing: float, log: bool) -> None:
    step, loss = cols["step"], cols["loss"]
    if smoothing:
        ax.plot(step, loss, color="tab:blue", alpha=0.25, linewidth=0.8, label="loss (raw)")
        ax.plot(step, series.ema(loss, smoothing), color="tab:blue", linewidth=1.6,
                label=f"loss (smoothed {smoothing:g})")
    else:
        ax.plot(step, loss, color="tab:blue", linewidth=1.2, label="loss")
    if "val_loss" in cols:
        seen = ~np.isnan(cols["val_loss"])
        ax.plot(step[seen], cols["val_loss"][seen], "o", color="tab:orange", markersize=4,
                label="validation loss")
    if log:
        ax.set_yscale("log")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)


def _draw_world_size(ax, cols: dict) -> None:
    if not len(cols["step"]):
        return
    right = ax.twinx()
    right.step(cols["step"], cols["world_size"], where="post", color="tab:purple", alpha=0.7,
               linewidth=1.2)
    top = int(np.nanmax(cols["world_size"]))
    right.set_ylim(0, top + 1)
    right.set_yticks(range(0, top + 2))
    right.set_ylabel("world size", color="tab:purple")


def _draw_metric(ax, cols: dict, name: str) -> None:
    seen = ~np.isnan(cols[name])
    sparse = seen.sum() < 0.5 * len(seen)  # evaluations: points, not a line
    ax.plot(cols["step"][seen], cols[name][seen], "o-" if sparse else "-", color="tab:orange",
            markersize=3, linewidth=1)
    ax.set_ylabel(name)
    ax.grid(alpha=0.3)


def _draw_markers(ax, cols: dict, events: list[Event]) -> None:
    labelled = set()
    for event in events:
        style = MARKER_STYLE.get(event["kind"])
        if style is None:
            continue
        colour, line, label = style
        ax.axvline(event["step"], color=colour, linestyle=line, linewidth=1,
                   label=None if label in labelled else label)
        labelled.add(label)
    starts = np.flatnonzero(np.diff(cols["epoch"]) != 0) + 1
    for i in starts if len(starts) <= series.MAX_EPOCH_LINES else ():  # epoch boundaries: faint
        ax.axvline(cols["step"][i], color="0.85", linewidth=0.5, zorder=0)
