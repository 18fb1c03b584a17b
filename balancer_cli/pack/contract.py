"""The pack contract's bounds, checked on a placed manifest.

A packing meets the contract when every dense module's Dist Ratio is at most
:data:`MAX_DIST_RATIO`, every sparse module (one a real share of the groups lack) keeps at least
:data:`MIN_SPARSE_UTILIZATION` of its rank-time busy, the steps are at most ``MAX_STEP_EXCESS``
x their lower bound and the steps are as mixed as random batching or better (``vs_random`` <=
:data:`MAX_STEP_MIX`). The search ranks candidates by these bounds on a subsample; the pipeline
checks its pick on the whole input with :func:`broken_bounds` (a subsample's few steps can
hide a bias or an extra step that the full run shows) and falls back to the next candidates.

Example:
    >>> import numpy as np
    >>> from balancer_cli.manifest import ManifestRows
    >>> rows = ManifestRows(np.array([0, 0]), np.array([0, 1]), np.array([0, 0]), np.array([0, 1]))
    >>> metrics = {"modules": {"llm": {"dist_ratio": 0.0, "utilization": 1.0}},
    ...            "steps": {"vs_lower_bound": 1.0}, "step_mix": {"vs_random": 1.2}}
    >>> broken_bounds(metrics, ("llm",), np.array([[10.0], [10.0]]), rows)
    ('mix',)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from balancer_cli._index import take_column
from balancer_cli.manifest import is_slot_sorted
from balancer_cli.pack._blocks import sparse_modules
from balancer_cli.pack.packers.balanced import MAX_STEP_EXCESS

__all__ = ["CHECK_FALLBACKS", "MAX_DIST_RATIO", "MAX_STEP_MIX", "MIN_SPARSE_UTILIZATION", "broken_bounds",
           "placed_sparse_modules"]

#: Dist Ratio of every dense module.
MAX_DIST_RATIO = 0.005
#: Utilization of every sparse module (Dist Ratio of a module most ranks lack is not balance).
MIN_SPARSE_UTILIZATION = 0.9
#: Step mix against random batching of the same steps (1.0: as mixed as random batching).
MAX_STEP_MIX = 1.0
#: How many more candidates the pipeline packs in full when its pick breaks a bound (one pack
#: each); a pruning search of the whole input measures that many after its best for sure.
CHECK_FALLBACKS = 2


def placed_sparse_modules(cost_NK: np.ndarray, rows: Any) -> np.ndarray:
    """(K,) bool: the modules the packer treats as sparse, from the placed groups' cost sums.

    Args:
        cost_NK: (N, K) per-sample costs, encoders first, LLM last.
        rows: :class:`~balancer_cli.manifest.ManifestRows` (step, rank, micro, sample).
    """
    if len(rows.sample) == 0:
        return np.zeros(cost_NK.shape[1], bool)
    if is_slot_sorted(rows):  # as placed: groups are runs of rows (no (P,) int64 keys to sort, ~40 B a row)
        step, rank, micro = rows.step, rows.rank, rows.micro
        starts = np.flatnonzero(np.concatenate([[True], (step[1:] != step[:-1]) | (rank[1:] != rank[:-1])
                                                | (micro[1:] != micro[:-1])]))
        return sparse_modules(np.stack([np.add.reduceat(take_column(cost_NK, rows.sample, k).astype(np.float64),
                                                        starts) for k in range(cost_NK.shape[1])], axis=1))
    micro = int(rows.micro.max()) + 1
    key = (rows.step.astype(np.int64) * (int(rows.rank.max()) + 1) + rows.rank) * micro + rows.micro
    _, group = np.unique(key, return_inverse=True)
    cost_GK = np.stack([np.bincount(group, take_column(cost_NK, rows.sample, k)) for k in range(cost_NK.shape[1])], axis=1)
    return sparse_modules(cost_GK)


def broken_bounds(metrics: dict, modules: Sequence[str], cost_NK: np.ndarray, rows: Any) -> tuple[str, ...]:
    """The contract's bounds a placed manifest breaks, in a fixed order (empty: it meets them all).

    Args:
        metrics: :attr:`~balancer_cli.pack.evaluate.Evaluation.metrics` of the manifest.
        modules: module names in column order (encoders first, LLM last).
        cost_NK: (N, K) per-sample costs.
        rows: the manifest's rows.

    Returns:
        ``"dist:<module>"`` / ``"util:<module>"`` per module out of bounds, then ``"steps"`` and
        ``"mix"``.
    """
    sparse_K = placed_sparse_modules(cost_NK, rows)
    broken = []
    for module, sparse in zip(modules, sparse_K):
        m = metrics["modules"][module]
        if sparse and m["utilization"] < MIN_SPARSE_UTILIZATION:
            broken.append(f"util:{module}")
        elif not sparse and m["dist_ratio"] > MAX_DIST_RATIO:
            broken.append(f"dist:{module}")
    if metrics["steps"]["vs_lower_bound"] > MAX_STEP_EXCESS:
        broken.append("steps")
    mix = metrics.get("step_mix", {}).get("vs_random")
    if mix is not None and mix > MAX_STEP_MIX:
        broken.append("mix")
    return tuple(broken)
