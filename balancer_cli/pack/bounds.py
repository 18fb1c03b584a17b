"""Lower bounds on the number of groups a packing under per-module caps needs.

Example:
    >>> import numpy as np
    >>> groups_lower_bound(np.array([[0, 4000]] * 4 + [[6, 1546]] * 12), np.array([18, 6400]))
    6
"""

from __future__ import annotations

import numpy as np

__all__ = ["groups_lower_bound"]


#: Rows converted to int64/float64 at a time: the bound's temporaries stay ~100 MB at any size.
_CHUNK = 1 << 20


def groups_lower_bound(load_NK: np.ndarray, caps_K: np.ndarray, rows: np.ndarray | None = None) -> int:
    """No packing under the caps has fewer groups: ``max_k ceil(sum load_k / cap_k)``, and the
    count of samples over half a cap (no two of them can share a group), and the coupled
    item/token bound of :func:`_coupled_bound` (items that long texts leave unused).

    Args:
        load_NK: (N, K) integer loads (any integer type).
        caps_K: (K,) caps.
        rows: the rows of ``load_NK`` to bound (default: all), read in chunks, never copied whole.

    Example:
        >>> groups_lower_bound(np.array([[5, 100], [5, 100]]), np.array([9, 4096]))
        2
        >>> groups_lower_bound(np.array([[5, 100], [5, 100], [1, 10]]), np.array([9, 4096]), rows=np.array([2]))
        1
    """
    caps = np.asarray(caps_K, dtype=np.int64)
    n = len(load_NK) if rows is None else len(rows)
    if n == 0 or np.asarray(load_NK).size == 0:
        return 1
    K = len(caps)
    sums, halves = np.zeros(K, dtype=np.int64), np.zeros(K, dtype=np.int64)
    for load in _chunks(load_NK, rows):
        sums += load.sum(axis=0)
        # Two samples over half a cap can never share a group.
        halves += (2 * load > caps[None, :]).sum(axis=0)
    by_sum = int((-(-sums // caps)).max())
    return max(1, by_sum, int(halves.max()), _coupled_bound(load_NK, rows, caps))


def _chunks(load_NK, rows):
    """int64 row blocks of ``load_NK[rows]`` (all rows when ``rows`` is None)."""
    n = len(load_NK) if rows is None else len(rows)
    for lo in range(0, n, _CHUNK):
        block = load_NK[lo:lo + _CHUNK] if rows is None else load_NK[rows[lo:lo + _CHUNK]]
        yield np.asarray(block, dtype=np.int64)


def _coupled_bound(load_NK, rows, caps):
    """Encoder items whose LLM tokens leave no room: groups needed when long texts waste items.

    For an encoder k and a slope ``a <= min_i llm_i / items_ik`` (LLM tokens per item, e.g. 256
    per tile), every sample has ``rest_i = llm_i - a * items_ik >= 0`` (its text). A group's
    items are at most ``(Qt - sum rest) / a``, so it leaves at least
    ``(sum rest - (Qt - a * Qv_k)) / a`` of its Qv_k items unused; that waste is superadditive
    in the members, so the groups waste at least ``sum_i max(0, rest_i - (Qt - a Qv_k)) / a``
    items in total, and ``G >= (sum items + waste) / Qv_k``. Samples over a cap are left out
    (they are isolated or dropped). Two passes over the rows: the slopes, then the waste.
    """
    K = len(caps)
    if K < 2:
        return 0
    a_max_k = np.full(K - 1, np.inf)
    items_k = np.zeros(K - 1, dtype=np.int64)
    for load in _chunks(load_NK, rows):
        fit = load[(load <= caps).all(axis=1)]
        llm = fit[:, -1].astype(np.float64)
        for k in range(K - 1):
            has = fit[:, k] > 0
            items_k[k] += int(fit[:, k].sum())
            if has.any():
                a_max_k[k] = min(a_max_k[k], float((llm[has] / fit[has, k]).min()))
    slopes = [(k, a, caps[-1] - a * caps[k]) for k in range(K - 1) if np.isfinite(a_max_k[k])
              for a in (a_max_k[k], 0.9 * a_max_k[k], 0.75 * a_max_k[k], 0.5 * a_max_k[k])]
    slopes = [(k, a, slack) for k, a, slack in slopes if a > 0 and slack >= 0]
    if not slopes:
        return 0
    waste = np.zeros(len(slopes))
    for load in _chunks(load_NK, rows):
        fit = load[(load <= caps).all(axis=1)]
        llm = fit[:, -1].astype(np.float64)
        for s, (k, a, slack) in enumerate(slopes):
            waste[s] += np.maximum(0.0, llm - a * fit[:, k] - slack).sum() / a
    # floor of the float waste keeps the bound valid against rounding
    return max(int(-(-(int(items_k[k]) + int(np.floor(w * (1 - 1e-9)))) // int(caps[k])))
               for (k, _, _), w in zip(slopes, waste))
