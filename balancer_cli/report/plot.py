"""``report.png``: per-step load per rank for each module, and load histograms, ours vs a baseline.

Rendered on matplotlib's Agg canvas through its object API (no display, no pyplot state, the
caller's backend untouched). One row per module: the left panel
shows, for the first steps, the spread of rank loads T(s, r) at each step (min..max band and the
mean) for the manifest and the baseline; the right panel overlays the histograms of T(s, r)
relative to the step mean, where a balanced packing is a narrow spike at 1.

Example:
    >>> import numpy as np, tempfile, pathlib
    >>> out = pathlib.Path(tempfile.mkdtemp()) / "r.png"
    >>> plot_report(out, {"llm": np.ones((4, 2))}, {"llm": np.array([[1., 3.]] * 4)}, baseline_label="random")
    >>> out.stat().st_size > 0
    True
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import BinaryIO

import numpy as np

__all__ = ["plot_report", "preload", "MAX_PLOTTED_STEPS"]

#: Steps drawn in the per-step panels; more would be an unreadable smear.
MAX_PLOTTED_STEPS = 64


def _relative(load_SR: np.ndarray) -> np.ndarray:
    mean_S = load_SR.mean(axis=1, keepdims=True)
    return np.divide(load_SR, mean_S, out=np.ones_like(load_SR), where=mean_S > 0).ravel()


def preload() -> None:
    """Import matplotlib's figure and Agg canvas and load its fonts (draw a tiny figure), so that a
    later :func:`plot_report` only draws (:mod:`balancer_cli.report.plot_worker` calls it first)."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1, 1))
    FigureCanvasAgg(fig)
    fig.subplots().set_title("x")
    fig.savefig(io.BytesIO(), format="png", dpi=10)


def plot_report(path: str | os.PathLike | BinaryIO, ours: Mapping[str, np.ndarray],
                baseline: Mapping[str, np.ndarray] | None, *, ours_label: str = "ours",
                baseline_label: str | None = None) -> None:
    """Draw the per-module panels into a PNG at ``path``.

    Args:
        path: output file (written as PNG whatever its suffix), or a binary file object.
        ours: ``{module: (S, R)}`` summed cost per step and rank of the manifest.
        baseline: the same for one baseline, or None.
        ours_label, baseline_label: legend names.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    modules = list(ours)
    fig = Figure(figsize=(12, 3.2 * len(modules)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(modules), 2, squeeze=False)
    series = [(ours_label, ours, "tab:blue")]
    if baseline is not None:
        series.append((baseline_label or "baseline", baseline, "tab:orange"))
    for row, module in enumerate(modules):
        left, right = axes[row]
        for label, loads, color in series:
            load_SR = np.asarray(loads[module])[:MAX_PLOTTED_STEPS]
            if load_SR.size == 0:
                continue
            steps = np.arange(len(load_SR))
            left.fill_between(steps, load_SR.min(axis=1), load_SR.max(axis=1), color=color, alpha=0.25, step="mid")
            left.plot(steps, load_SR.mean(axis=1), color=color, drawstyle="steps-mid",
                      label=f"{label} (mean, min..max)")
            rel = _relative(np.asarray(loads[module]))
            # np.histogram + stairs: one artist instead of 80 bar patches (10x faster to draw).
            counts, edges = np.histogram(np.clip(rel, 0, 2), bins=np.linspace(0, 2, 81))
            right.stairs(counts, edges, fill=True, color=color, alpha=0.5, label=label)
        left.set_title(f"{module}: load per rank, first {MAX_PLOTTED_STEPS} steps")
        left.set_xlabel("step")
        left.set_ylabel(f"{module} cost per rank")
        left.legend(fontsize=8, loc="upper right")
        right.set_title(f"{module}: rank load / step mean (1 = balanced)")
        right.set_xlabel("relative load")
        right.set_ylabel("rank-steps")
        right.legend(fontsize=8)
    fig.subplots_adjust(left=0.07, right=0.98, top=0.95, bottom=0.08, hspace=0.45, wspace=0.2)
    fig.savefig(path, format="png", dpi=90, metadata={"Software": None})
