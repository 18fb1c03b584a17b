"""Loop kernels of elastic re-planning: which rank each sample of a unit goes to (numba when installed).

Plain Python functions over flat numpy arrays; with numba they are compiled (``cache=True``),
without it they run as Python with identical results (the same arithmetic in the same order),
only slower. A window of units comes flat: unit ``u`` holds samples ``unit_U1[u]..unit_U1[u+1]``
of the ``_P`` arrays. Ties are broken by index, so the output is a pure function of the input and
every rank computing a plan gets the same plan. Greedy list scheduling and local search depend on
the state left by the previous item, so the loop over a unit's samples cannot be vectorized;
units are independent.

Example:
    >>> weight_P, rank_P = np.zeros(3), np.zeros(3, np.int64)
    >>> _ = assign_units(np.array([[3.0], [2.0], [2.0]]), np.array([0, 3]), np.array([1]), 2, 0, weight_P, rank_P)
    >>> rank_P.tolist()
    [0, 1, 1]
"""

from __future__ import annotations

import numpy as np

from balancer_cli._jit import njit

__all__ = ["assign_units"]

#: Slack of the swap search's cost window. Loads and costs are fractions of a step's total (at
#: most about 1), so float rounding is below 1e-15; the window only skips pairs that cannot win.
_TOL = 1e-12


@njit
def assign_units(cost_PK, unit_U1, batches_U, world_size, swap_rounds, weight_P, rank_P):  # pragma: no cover - compiled
    """Per unit: normalize, LPT, swaps, count guard. Writes ``weight_P`` and ``rank_P``.

    1. Each module's cost over the unit's total of that module (``cost * (1 / total)``, 0 for a
       module the unit does not use); a sample's weight is the sum over modules.
    2. LPT: samples by weight, heaviest first (index on ties), each to the rank with the least
       summed cost (lowest rank on ties).
    3. Up to ``swap_rounds`` single swaps between the rank holding the peak module load and
       another rank: the swap that most lowers that pair's peak (the first pair ``(a, b)`` in index
       order on ties), while one lowers it.
    4. A rank with fewer than ``batches_U[u]`` samples takes the lightest sample (first on ties)
       of the rank with the most (first on ties), until none is short.

    A unit of fewer samples than ranks (the end of an epoch after a resume on more ranks) gives
    its ``i``-th sample to rank ``i``.

    Example:
        >>> cost_PK = np.array([[3.0, 0.0], [0.0, 3.0], [2.0, 0.0], [0.0, 2.0]])  # two modules
        >>> weight_P, rank_P = np.zeros(4), np.zeros(4, np.int64)
        >>> _ = assign_units(cost_PK, np.array([0, 4]), np.array([1]), 2, 16, weight_P, rank_P)
        >>> rank_P.tolist()
        [0, 1, 1, 0]
    """
    U = len(unit_U1) - 1
    K = cost_PK.shape[1]
    R = world_size
    n_max = 0
    for u in range(U):
        n_max = max(n_max, unit_U1[u + 1] - unit_U1[u])
    c = np.zeros((n_max, K))
    neg = np.zeros(n_max)
    load = np.zeros((R, K))
    total = np.zeros(R)
    inv = np.zeros(K)
    counts = np.zeros(R, np.int64)
    idx_Kn = np.zeros((K, n_max), np.int64)
    val_Kn = np.zeros((K, n_max))
    for u in range(U):
        o = unit_U1[u]
        n = unit_U1[u + 1] - o
        # Sequential sums, as numpy's cumsum (the former implementation) adds them.
        for k in range(K):
            t = 0.0
            for i in range(n):
                t += cost_PK[o + i, k]
            inv[k] = 1.0 / t if t > 0 else 0.0
        for i in range(n):
            w = 0.0
            for k in range(K):
                c[i, k] = cost_PK[o + i, k] * inv[k]
                w += c[i, k]
            weight_P[o + i] = w
            neg[i] = -w
        rank = rank_P[o:o + n]
        if n < R:
            for i in range(n):
                rank[i] = i
            continue
        order = np.argsort(neg[:n], kind="mergesort")  # stable: index on ties
        load[:, :] = 0.0
        total[:] = 0.0
        for j in range(n):
            i = order[j]
            best = 0
            for r in range(1, R):
                if total[r] < total[best]:
                    best = r
            rank[i] = best
            for k in range(K):
                load[best, k] += c[i, k]
                total[best] += c[i, k]
        if swap_rounds > 0 and R > 1:
            _swap(c, n, K, R, load, rank, swap_rounds, idx_Kn, val_Kn)
        _guard_counts(rank, weight_P[o:o + n], n, R, batches_U[u], counts)
    return rank_P


@njit
def _swap(c, n, K, R, load, rank, rounds, idx_Kn, val_Kn):  # pragma: no cover - compiled
    """The swap rounds of :func:`assign_units`, searched exactly but only where a pair can win.

    A pair ``(a on p, b on q)`` scores ``max_k max(load[p,k] - d_k, load[q,k] + d_k)`` with
    ``d = cost_a - cost_b``; it beats the best so far only if, in the peak module ``kp``,
    ``cost_b`` lies in ``[min_q load[q,kp] + cost_a - best, best - peak + cost_a]``. The unit's
    samples are sorted once per module; ``a`` goes from the heaviest in ``kp`` down (good pairs
    come first and shrink the window; once ``cost_a < peak - best`` no lighter ``a`` can win) and
    scans only its window. Every pair in it is scored as the full search scores it, and ties go to
    the first pair in index order, so the swaps are those of the search over every pair.
    """
    for k in range(K):
        order = np.argsort(c[:n, k])
        for j in range(n):
            idx_Kn[k, j] = order[j]
            val_Kn[k, j] = c[order[j], k]
    for _ in range(rounds):
        p, kp, peak = 0, 0, -1.0
        for r in range(R):
            for k in range(K):
                if load[r, k] > peak:
                    p, kp, peak = r, k, load[r, k]
        best, best_a, best_b = peak * (1.0 - 1e-9), -1, -1
        lmin = np.inf
        for r in range(R):
            if r != p and load[r, kp] < lmin:
                lmin = load[r, kp]
        vals = val_Kn[kp]
        for ja in range(n - 1, -1, -1):
            a = idx_Kn[kp, ja]
            if rank[a] != p:
                continue
            ca = vals[ja]
            hi = best - peak + ca + _TOL
            if hi < 0.0:
                break  # costs are >= 0: neither this a nor a lighter one has a partner
            lo = lmin + ca - best - _TOL
            left, right = 0, n  # first j with vals[j] >= lo
            while left < right:
                mid = (left + right) // 2
                if vals[mid] < lo:
                    left = mid + 1
                else:
                    right = mid
            j = left
            while j < n and vals[j] <= hi:
                b = idx_Kn[kp, j]
                j += 1
                q = rank[b]
                if q == p:
                    continue
                score = 0.0
                for k in range(K):
                    d = c[a, k] - c[b, k]
                    score = max(score, load[p, k] - d, load[q, k] + d)
                if score < best or (score == best and best_a >= 0 and (a < best_a or (a == best_a and b < best_b))):
                    best, best_a, best_b = score, a, b
                    hi = best - peak + ca + _TOL
        if best_a < 0:
            break
        q = rank[best_b]
        for k in range(K):
            d = c[best_a, k] - c[best_b, k]
            load[p, k] -= d
            load[q, k] += d
        rank[best_a], rank[best_b] = q, p


@njit
def _guard_counts(rank, weight, n, R, k, counts):  # pragma: no cover - compiled
    """Step 4 of :func:`assign_units`: at least ``k`` samples per rank (rare: heavy samples can
    leave a rank short)."""
    counts[:] = 0
    for i in range(n):
        counts[rank[i]] += 1
    while True:
        short, rich = 0, 0
        for r in range(1, R):
            if counts[r] < counts[short]:
                short = r
            if counts[r] > counts[rich]:
                rich = r
        if counts[short] >= k:
            return
        light = -1
        for i in range(n):
            if rank[i] == rich and (light < 0 or weight[i] < weight[light]):
                light = i
        rank[light] = short
        counts[short] += 1
        counts[rich] -= 1
