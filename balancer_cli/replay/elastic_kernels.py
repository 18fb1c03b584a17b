"""Loop kernel of elastic re-planning (compiled with numba when it is installed).

A plain Python function over numpy arrays; with numba it is compiled (``cache=True``), without
it runs as Python with identical results (the same arithmetic in the same order), only slower.
Ties are broken by index, so the output is a pure function of the input and every rank computing
a plan gets the same plan. Greedy list scheduling and local search depend on the state left by
the previous item, so the loop over a step's samples cannot be vectorized; steps are independent.

Example:
    >>> rank_of_Un = np.full((1, 3), -1)
    >>> lpt_swap(np.array([[[3.0], [2.0], [2.0]]]), np.array([3]), np.array([[0, 1, 2]]), 2, 0, rank_of_Un).tolist()
    [[0, 1, 1]]
"""

from __future__ import annotations

import numpy as np

from balancer_cli._jit import njit

__all__ = ["lpt_swap"]


@njit
def lpt_swap(cost_UnK, sizes_U, order_Un, world_size, swap_rounds, rank_of_Un):  # pragma: no cover - compiled
    """Per step: LPT of the samples (``order_Un``, heaviest first) by summed cost, then up to
    ``swap_rounds`` single swaps between the rank holding the peak module load and another rank,
    the swap that most lowers that pair's peak (first on ties). Writes ``rank_of_Un``.

    Example:
        >>> cost_UnK = np.array([[[3.0, 0.0], [0.0, 3.0], [2.0, 0.0], [0.0, 2.0]]])  # two modules
        >>> lpt_swap(cost_UnK, np.array([4]), np.array([[0, 1, 2, 3]]), 2, 16, np.full((1, 4), -1)).tolist()
        [[1, 0, 0, 1]]
    """
    U, _, K = cost_UnK.shape
    R = world_size
    load = np.zeros((R, K))
    total = np.zeros(R)
    for u in range(U):
        n = sizes_U[u]
        load[:, :] = 0.0
        total[:] = 0.0
        for j in range(n):
            i = order_Un[u, j]
            best = 0
            for r in range(1, R):
                if total[r] < total[best]:
                    best = r
            rank_of_Un[u, i] = best
            for k in range(K):
                load[best, k] += cost_UnK[u, i, k]
                total[best] += cost_UnK[u, i, k]
        for _ in range(swap_rounds):
            p, peak = 0, -1.0
            for r in range(R):
                for k in range(K):
                    if load[r, k] > peak:
                        p, peak = r, load[r, k]
            best_score, best_a, best_b = peak * (1.0 - 1e-9), -1, -1
            for a in range(n):
                if rank_of_Un[u, a] != p:
                    continue
                for b in range(n):
                    q = rank_of_Un[u, b]
                    if q == p:
                        continue
                    score = 0.0
                    for k in range(K):
                        d = cost_UnK[u, a, k] - cost_UnK[u, b, k]
                        score = max(score, load[p, k] - d, load[q, k] + d)
                    if score < best_score:
                        best_score, best_a, best_b = score, a, b
            if best_a < 0:
                break
            q = rank_of_Un[u, best_b]
            for k in range(K):
                d = cost_UnK[u, best_a, k] - cost_UnK[u, best_b, k]
                load[p, k] -= d
                load[q, k] += d
                total[p] -= d
                total[q] += d
            rank_of_Un[u, best_a], rank_of_Un[u, best_b] = q, p
    return rank_of_Un
