"""The threshold search as data (JSON), a ranked table and a heat map PNG.

:func:`search_data` turns a :class:`~balancer_cli.pack.search.SearchResult` into plain JSON:
the best caps and bounds, every candidate ranked with its metrics on the subsample, and the
objective on the grid. :func:`plot_search` draws that grid as a heat map (the first encoder's
cap against the LLM cap; other modules at their best value), marking the winner.

Example:
    >>> import numpy as np
    >>> from types import SimpleNamespace as NS
    >>> cand = NS(caps_K=(12, 4096), bounds_K=(12, 4096), objective=0.2, dist_ratio_K=(0.01, 0.02),
    ...           utilization_K=(0.99, 0.98), pad_ratio=0.1, excluded_share=0.0, steps_over_lower_bound=1.02,
    ...           mean_group_size=4.4)
    >>> res = NS(candidates=(cand,), best_caps_K=np.array([12, 4096]), best_bounds_K=np.array([12, 4096]),
    ...          grid_axes=(np.array([12]), np.array([4096])), grid_objective=np.array([[0.2]]), sample_size=100,
    ...          algorithm="balanced", params={})
    >>> data = search_data(res, ("vision", "llm"))
    >>> data["best"]["caps"], data["candidates"][0]["rank"]
    ({'vision': 12, 'llm': 4096}, 1)
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["search_data", "search_table", "plot_search"]


def _r(x: float) -> float:
    return round(float(x), 6)


def _finite(x: float | None) -> float | None:
    return _r(x) if x is not None and np.isfinite(x) else None


def search_data(result: Any, modules: Sequence[str], *, extra: Mapping[str, Any] | None = None) -> dict:
    """JSON-ready dict of a search result (candidates best first)."""
    by_module = lambda values, cast=int: {m: cast(v) for m, v in zip(modules, values)}  # noqa: E731
    candidates = []
    for rank, c in enumerate(result.candidates, start=1):
        pruned = bool(getattr(c, "pruned", False))  # not measured: its objective is a lower bound
        candidates.append({
            "rank": rank,
            "caps": by_module(c.caps_K),
            "bounds": by_module(c.bounds_K),
            "objective": _r(c.objective),
            "dist_ratio": None if pruned else by_module(c.dist_ratio_K, _r),
            "utilization": None if pruned else by_module(c.utilization_K, _r),
            "pad_ratio": None if pruned else _r(c.pad_ratio),
            # against random batching of the same steps; unknown (null) where pruning did not measure it
            "mix_vs_random": _finite(getattr(c, "mix_vs_random", None)),
            "excluded_share": _r(c.excluded_share),
            "steps_over_lower_bound": _r(c.steps_over_lower_bound),
            "mean_group_size": _r(c.mean_group_size),
            **({"pruned": True} if pruned else {}),
            # evaluated on the whole input and within every bound: ranked before the others
            **({"within_bounds": True} if getattr(c, "within_bounds", False) else {}),
        })
    objective = np.asarray(result.grid_objective, dtype=np.float64)
    return {
        **dict(extra or {}),
        "algorithm": result.algorithm,
        "modules": list(modules),
        "sample_size": int(result.sample_size),
        "params": {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in dict(result.params).items()},
        "best": {"caps": by_module(result.best_caps_K), "bounds": by_module(result.best_bounds_K),
                 **_tail_raised(result, modules)},
        "grid": {
            "axes": {m: [int(v) for v in axis] for m, axis in zip(modules, result.grid_axes)},
            # JSON has no infinity: grid points with no feasible candidate are null.
            "objective": np.where(np.isfinite(objective), np.round(objective, 6), None).tolist(),
        },
        "candidates": candidates,
    }


def _tail_raised(result: Any, modules: Sequence[str]) -> dict:
    """``{"tail_raised": ...}`` where the longest samples raised the best caps
    (:func:`~balancer_cli.pack.search.tail_raised`), else ``{}``."""
    from balancer_cli.pack.search import (
        tail_raised,  # the search's module: loaded by whoever ran it
    )

    typical = dict(result.params).get("typical_caps")
    return {} if typical is None else tail_raised(result.best_caps_K, typical, modules)


def search_table(data: Mapping[str, Any], top: int = 10) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the ranked candidate table (the ``top`` best)."""
    modules = data["modules"]
    header = ["#"] + [f"cap {m}" for m in modules]
    if data["algorithm"] == "isf":
        header += [f"bound {m}" for m in modules]
    header += ["objective"] + [f"util {m}" for m in modules] + ["pad", "mix", "excluded", "steps/bound", "group size"]
    rows = []
    for c in data["candidates"][:top]:
        row = [str(c["rank"])] + [str(c["caps"][m]) for m in modules]
        if data["algorithm"] == "isf":
            row += [str(c["bounds"][m]) for m in modules]
        if c.get("pruned"):  # only the terms its packing decides were measured
            row += [f">{c['objective']:.4f}"] + ["-" for _ in modules] + ["-"]
        else:
            row += [f"{c['objective']:.4f}"] + [f"{c['utilization'][m]:.3f}" for m in modules]
            row += [f"{c['pad_ratio']:.3f}"]
        mix = c.get("mix_vs_random")
        row += ["-" if mix is None else f"{mix:.2f}x", f"{100 * c['excluded_share']:.2f}%",
                f"{c['steps_over_lower_bound']:.3f}", f"{c['mean_group_size']:.2f}"]
        rows.append(row)
    return header, rows


def plot_search(path: str | os.PathLike, data: Mapping[str, Any]) -> None:
    """Heat map of the search objective: first module's cap (rows) x LLM cap (columns).

    With more than two modules, the other axes are reduced to their best (minimum) objective;
    with one module (text only) the map is a single row.
    """
    # Matplotlib's object API on an Agg canvas: no pyplot state, and a notebook's backend stays.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    modules = list(data["modules"])
    axes = [data["grid"]["axes"][m] for m in modules]
    grid = np.array(data["grid"]["objective"], dtype=np.float64).reshape([len(a) for a in axes])
    if len(modules) == 1:
        mat, y_mod = grid[None, :], None
    else:
        others = tuple(range(1, len(modules) - 1))
        mat = np.nanmin(grid, axis=others) if others and np.isfinite(grid).any() else grid
        mat = mat.reshape(len(axes[0]), len(axes[-1]))
        y_mod = modules[0]
    fig = Figure(figsize=(1.2 * mat.shape[1] + 3, 0.9 * mat.shape[0] + 2.2))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    image = ax.imshow(np.ma.masked_invalid(mat), cmap="viridis_r", aspect="auto", origin="lower")
    fig.colorbar(image, ax=ax, label="objective (lower is better)")
    ax.set_xticks(range(len(axes[-1])), [str(v) for v in axes[-1]])
    ax.set_xlabel(f"{modules[-1]} cap (tokens)")
    if y_mod is not None:
        ax.set_yticks(range(len(axes[0])), [str(v) for v in axes[0]])
        ax.set_ylabel(f"{y_mod} cap (items)")
    else:
        ax.set_yticks([])
    finite = mat[np.isfinite(mat)]
    middle = (finite.min() + finite.max()) / 2 if len(finite) else 0.0
    for (i, j), value in np.ndenumerate(mat):
        if np.isfinite(value):  # dark text on the light (low, good) end of viridis_r
            ax.text(j, i, f"{value:.3f}", ha="center", va="center", fontsize=7,
                    color="black" if value < middle else "white")
    best = data["best"]["caps"]
    if best[modules[-1]] in axes[-1] and (y_mod is None or best[y_mod] in axes[0]):
        col = axes[-1].index(best[modules[-1]])
        row = 0 if y_mod is None else axes[0].index(best[y_mod])
        ax.scatter([col], [row], marker="s", s=900, facecolors="none", edgecolors="red", linewidths=2, label="best")
        ax.legend(loc="upper left", fontsize=8)
    ax.set_title(f"threshold search ({data['algorithm']}, {data['sample_size']} samples)")
    fig.subplots_adjust(left=0.15, right=0.95, top=0.9, bottom=0.15)
    fig.savefig(path, format="png", dpi=90, metadata={"Software": None})
