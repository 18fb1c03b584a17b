"""Lower bounds on the number of groups a packing under per-module caps needs.

Example:
    >>> import numpy as np
    >>> groups_lower_bound(np.array([[0, 4000]] * 4 + [[6, 1546]] * 12), np.array([18, 6400]))
    6
"""

from __future__ import annotations

import numpy as np

__all__ = ["groups_lower_bound"]


def groups_lower_bound(load_NK: np.ndarray, caps_K: np.ndarray) -> int:
    """No packing under the caps has fewer groups: ``max_k ceil(sum load_k / cap_k)``, and the
    count of samples over half a cap (no two of them can share a group), and the coupled
    item/token bound of :func:`_coupled_bound` (items that long texts leave unused).

    Example:
        >>> groups_lower_bound(np.array([[5, 100], [5, 100]]), np.array([9, 4096]))
        2
    """
    load = np.asarray(load_NK, dtype=np.int64)
    caps = np.asarray(caps_K, dtype=np.int64)
    if load.size == 0:
        return 1
    by_sum = int((-(-load.sum(axis=0) // caps)).max())
    # Two samples over half a cap can never share a group.
    by_halves = int((2 * load > caps[None, :]).sum(axis=0).max())
    return max(1, by_sum, by_halves, _coupled_bound(load, caps))


def _coupled_bound(load, caps):
    """Encoder items whose LLM tokens leave no room: groups needed when long texts waste items.

    For an encoder k and a slope ``a <= min_i llm_i / items_ik`` (LLM tokens per item, e.g. 256
    per tile), every sample has ``rest_i = llm_i - a * items_ik >= 0`` (its text). A group's
    items are at most ``(Qt - sum rest) / a``, so it leaves at least
    ``(sum rest - (Qt - a * Qv_k)) / a`` of its Qv_k items unused; that waste is superadditive
    in the members, so the groups waste at least ``sum_i max(0, rest_i - (Qt - a Qv_k)) / a``
    items in total, and ``G >= (sum items + waste) / Qv_k``. Samples over a cap are left out
    (they are isolated or dropped).
    """
    K = load.shape[1]
    if K < 2:
        return 0
    fit = (load <= caps).all(axis=1)
    llm = load[fit, -1].astype(np.float64)
    best = 0
    for k in range(K - 1):
        items = load[fit, k].astype(np.float64)
        has = items > 0
        if not has.any():
            continue
        a_max = float((llm[has] / items[has]).min())
        for a in (a_max, 0.9 * a_max, 0.75 * a_max, 0.5 * a_max):
            slack = caps[-1] - a * caps[k]
            if a <= 0 or slack < 0:
                continue
            waste = np.maximum(0.0, llm - a * items - slack).sum() / a
            # floor of the float waste keeps the bound valid against rounding
            best = max(best, int(-(-(int(items.sum()) + int(np.floor(waste * (1 - 1e-9)))) // int(caps[k]))))
    return best
