"""Lower bounds on the cost of a pair's exchanges, which let the random-partner pass skip work.

:func:`~balancer_cli.pack.packers._refine_kernels.refine_pass` tries every exchange of a group g
with a partner h and keeps the cheapest. An exchange's cost is
``sum_k d_k (e_k + d_k w_k) + source term`` with ``d = w_j - w_i``; each module's quadratic is at
least its minimum over the range ``d_k`` can take between the two groups' rows, and the source
term at least the most negative gain and loss of a source column. When that bound is no better
than the best exchange found so far, no exchange with h (:func:`partner_bound`) or with g's row i
(:func:`row_bound`) can be chosen, so skipping them leaves the pass's result exactly the same
(1.2M rows: ~30% of the partners and ~25% of the remaining rows are skipped).

Example:
    >>> import numpy as np
    >>> float(quadratic_min(-2.0, 1.0, -5.0, 5.0))  # d (d - 2) is lowest at d = 1
    -1.0
"""

from __future__ import annotations

from balancer_cli._jit import njit

__all__ = ["quadratic_min", "vertex", "vertex_min", "vertices", "column_ranges", "partner_bound", "row_bound", "SLACK"]

#: Relative slack on a bound before it skips anything: far above the rounding of the costs
#: (~10 floating-point operations), so a skip never depends on it.
SLACK = 1e-9


@njit(inline=True)
def quadratic_min(e, w, lo, hi):  # pragma: no cover - compiled
    """The minimum of ``d (e + d w)`` over ``lo <= d <= hi`` (``w >= 0``)."""
    return vertex_min(vertex(e, w), e, w, lo, hi)


@njit(inline=True)
def vertex(e, w):  # pragma: no cover - compiled
    """Where ``d (e + d w)`` is lowest, ``-e / 2w`` (0 where ``w = 0``, which :func:`vertex_min` ignores)."""
    return -e / (2.0 * w) if w > 0 else 0.0


@njit(inline=True)
def vertex_min(v, e, w, lo, hi):  # pragma: no cover - compiled
    """:func:`quadratic_min` given its vertex ``v = -e / 2w`` (any value where ``w = 0``): the
    bounds of a pair share e and w, so the pass divides once a pair (:func:`vertices`), not per row."""
    if w > 0:
        d = min(max(v, lo), hi)
    else:
        d = lo if e > 0 else hi
    return d * (e + d * w)


@njit(inline=True)
def vertices(e_K, inv_t2_K, v_K):  # pragma: no cover - compiled
    """Fill ``v_K`` with each module's :func:`vertex`."""
    for k in range(v_K.shape[0]):
        v_K[k] = vertex(e_K[k], inv_t2_K[k])


@njit(inline=True)
def column_ranges(w_XK, n, lo_K, hi_K):  # pragma: no cover - compiled
    """Fill ``lo_K``/``hi_K`` with the min/max of rows 0 .. n of ``w_XK`` (row n: "no row", zeros)."""
    for k in range(lo_K.shape[0]):
        lo = w_XK[n, k]
        hi = lo
        for a in range(n):
            v = w_XK[a, k]
            lo = min(lo, v)
            hi = max(hi, v)
        lo_K[k] = lo
        hi_K[k] = hi


@njit(inline=True)
def partner_bound(v_K, e_K, inv_t2_K, glo_K, ghi_K, hlo_K, hhi_K, src_low):  # pragma: no cover - compiled
    """A lower bound on every exchange's cost between g and h: ``d_k`` lies in
    ``[min_h - max_g, max_h - min_g]``; ``src_low`` bounds the source term; ``v_K``: :func:`vertices`."""
    total = src_low
    for k in range(glo_K.shape[0]):
        total += vertex_min(v_K[k], e_K[k], inv_t2_K[k], hlo_K[k] - ghi_K[k], hhi_K[k] - glo_K[k])
    return total


@njit(inline=True)
def row_bound(v_K, e_K, inv_t2_K, w_XK, a, hlo_K, hhi_K, src_low):  # pragma: no cover - compiled
    """A lower bound on the cost of every exchange of g's row ``a`` (of ``w_XK``) with h's rows."""
    total = src_low
    for k in range(hlo_K.shape[0]):
        total += vertex_min(v_K[k], e_K[k], inv_t2_K[k], hlo_K[k] - w_XK[a, k], hhi_K[k] - w_XK[a, k])
    return total
