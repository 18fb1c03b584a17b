"""Loop kernel of elastic re-planning (compiled with numba when it is installed).

A plain Python function over numpy arrays; with numba it is compiled (``cache=True``), without
it runs as Python with identical results (the same arithmetic in the same order), only slower.
Ties are broken by index, so the output is a pure function of the input and every rank computing
a plan gets the same plan. Greedy list scheduling and local search depend on the state left by
the previous item, so the loop over a step's samples cannot be vectorized; steps are independent.
"""

from __future__ import annotations

import numpy as np

from balancer_cli._jit import HAVE_NUMBA, njit

__all__ = ["HAVE_NUMBA", "lpt_swap"]


@njit
def lpt_swap(cost_ULm, sizes_U, order_UL, world_size, swap_rounds, rank_of_UL):  # pragma: no cover - compiled
    """Per step: LPT of the samples (``order_UL``, heaviest first) by summed cost, then up to
    ``swap_rounds`` single swaps between the rank holding the peak module load and another rank,
    the swap that most lowers that pair's peak (first on ties). Writes ``rank_of_UL``."""
    U, _, m = cost_ULm.shape
    R = world_size
    load = np.zeros((R, m))
    total = np.zeros(R)
    for u in range(U):
        n = sizes_U[u]
        load[:, :] = 0.0
        total[:] = 0.0
        for j in range(n):
            i = order_UL[u, j]
            best = 0
            for r in range(1, R):
                if total[r] < total[best]:
                    best = r
            rank_of_UL[u, i] = best
            for mm in range(m):
                load[best, mm] += cost_ULm[u, i, mm]
                total[best] += cost_ULm[u, i, mm]
        for _ in range(swap_rounds):
            p, peak = 0, -1.0
            for r in range(R):
                for mm in range(m):
                    if load[r, mm] > peak:
                        p, peak = r, load[r, mm]
            best_score, best_a, best_b = peak * (1.0 - 1e-9), -1, -1
            for a in range(n):
                if rank_of_UL[u, a] != p:
                    continue
                for b in range(n):
                    q = rank_of_UL[u, b]
                    if q == p:
                        continue
                    score = 0.0
                    for mm in range(m):
                        d = cost_ULm[u, a, mm] - cost_ULm[u, b, mm]
                        score = max(score, load[p, mm] - d, load[q, mm] + d)
                    if score < best_score:
                        best_score, best_a, best_b = score, a, b
            if best_a < 0:
                break
            q = rank_of_UL[u, best_b]
            for mm in range(m):
                d = cost_ULm[u, best_a, mm] - cost_ULm[u, best_b, mm]
                load[p, mm] -= d
                load[q, mm] += d
                total[p] -= d
                total[q] += d
            rank_of_UL[u, best_a], rank_of_UL[u, best_b] = q, p
    return rank_of_UL
