"""Loop kernels of post-balancing's balanced split (compiled with numba when it is installed).

Each kernel is a plain Python function over numpy arrays; when numba is importable it is
compiled (``cache=True``), otherwise it runs as Python with identical results (the same
arithmetic in the same order), only slower. Every tie is broken by index, so the output is a
pure function of the input: all ranks computing a plan from the same costs get the same plan.

These loops cannot be vectorized: greedy list scheduling and local search each depend on the
state left by the previous step. Where the bins go (matching, moves home) is in
:mod:`balancer_cli.replay.post_balance.placement_kernels`.
"""

from __future__ import annotations

import numpy as np

from balancer_cli._jit import njit

__all__ = ["lpt_bins", "refine_bins", "padded_split"]


@njit
def _heap_less(load, ident, i, j):
    return load[i] < load[j] or (load[i] == load[j] and ident[i] < ident[j])


@njit
def lpt_bins(cost_sorted, num_bins):
    """Longest-processing-time-first: each item (costs sorted descending) to the least-loaded bin.

    Ties between equally loaded bins go to the lowest bin index.

    Returns:
        ``(bin_N int64, load_R float64)``.

    Example:
        >>> bin_N, load_R = lpt_bins(np.array([5.0, 4.0, 3.0, 2.0]), 2)
        >>> bin_N.tolist(), load_R.tolist()
        ([0, 1, 1, 0], [7.0, 7.0])
    """
    n = cost_sorted.shape[0]
    heap_load = np.zeros(num_bins)
    heap_bin = np.arange(num_bins)  # all loads 0, ordered by index: already a valid heap
    bin_N = np.empty(n, np.int64)
    for i in range(n):
        bin_N[i] = heap_bin[0]
        heap_load[0] += cost_sorted[i]
        pos = 0
        while True:  # sift the root down
            left = 2 * pos + 1
            if left >= num_bins:
                break
            child = left
            if left + 1 < num_bins and _heap_less(heap_load, heap_bin, left + 1, left):
                child = left + 1
            if _heap_less(heap_load, heap_bin, child, pos):
                heap_load[pos], heap_load[child] = heap_load[child], heap_load[pos]
                heap_bin[pos], heap_bin[child] = heap_bin[child], heap_bin[pos]
                pos = child
            else:
                break
    load = np.zeros(num_bins)
    for k in range(num_bins):
        load[heap_bin[k]] = heap_load[k]
    return bin_N, load


@njit
def refine_bins(cost, bin_N, load, max_iters, num_candidates):
    """Local search on the most loaded bin: the best single move or pairwise swap per iteration.

    Each iteration takes the most loaded bin ``b`` and, among the ``num_candidates`` least loaded
    bins ``c``, the move of one item b -> c or swap of two items that lowers ``max(load_b,
    load_c)`` the most. Every applied step strictly lowers the sorted load vector, so the maximum
    never rises and the search terminates. ``bin_N`` and ``load`` are updated in place.

    Returns:
        The number of moves and swaps applied.

    Example:
        >>> bin_N, load = np.array([0, 0, 0, 1]), np.array([12.0, 2.0])
        >>> refine_bins(np.array([5.0, 4.0, 3.0, 2.0]), bin_N, load, 10, 1), bin_N.tolist(), load.tolist()
        (1, [1, 0, 0, 1], [7.0, 7.0])
    """
    n = cost.shape[0]
    num_bins = load.shape[0]
    k = min(num_candidates, num_bins - 1)
    applied = 0
    if k <= 0:
        return applied
    cand = np.empty(k, np.int64)
    cand_pos = np.full(num_bins, -1, np.int64)
    for _ in range(max_iters):
        b = 0
        for r in range(1, num_bins):
            if load[r] > load[b]:
                b = r
        peak = load[b]
        if peak <= 0.0:
            break
        # k least loaded bins other than b (selection by repeated scan; k is small)
        taken = np.zeros(num_bins, np.bool_)
        taken[b] = True
        for t in range(k):
            best = -1
            for r in range(num_bins):
                if not taken[r] and (best < 0 or load[r] < load[best]):
                    best = r
            cand[t] = best
            taken[best] = True
            cand_pos[best] = t
        # one scan: the items of b, and the items of the candidate bins
        in_b = np.empty(n, np.int64)
        in_c = np.empty(n, np.int64)
        nb = 0
        nc = 0
        for i in range(n):
            if bin_N[i] == b:
                in_b[nb] = i
                nb += 1
            elif cand_pos[bin_N[i]] >= 0:
                in_c[nc] = i
                nc += 1
        best_pair_max = peak * (1.0 - 1e-12)  # only strict improvements
        best_a, best_x, best_c = -1, -1, -1
        for t in range(k):
            c = cand[t]
            low = load[c]
            for ia in range(nb):
                a = in_b[ia]
                ca = cost[a]
                if ca <= 0.0:
                    continue
                pair = max(peak - ca, low + ca)  # move a to c
                if pair < best_pair_max:
                    best_pair_max, best_a, best_x, best_c = pair, a, -1, c
        for ix in range(nc):
            x = in_c[ix]
            c = bin_N[x]
            low = load[c]
            cx = cost[x]
            for ia in range(nb):
                a = in_b[ia]
                d = cost[a] - cx
                if d <= 0.0:
                    continue
                pair = max(peak - d, low + d)  # swap a <-> x
                if pair < best_pair_max:
                    best_pair_max, best_a, best_x, best_c = pair, a, x, c
        for t in range(k):
            cand_pos[cand[t]] = -1
        if best_a < 0:
            break
        c = best_c
        delta = cost[best_a] - (cost[best_x] if best_x >= 0 else 0.0)
        bin_N[best_a] = c
        if best_x >= 0:
            bin_N[best_x] = b
        load[b] -= delta
        load[c] += delta
        applied += 1
    return applied


@njit
def padded_split(cost_sorted, num_bins, limit):
    """Greedy contiguous split of costs sorted descending into padded micro-batches.

    A batch's load is ``size x its first (largest) cost``; each batch takes as many items as fit
    under ``limit``. For a fixed limit, taking as many as fit is optimal (the next batch then
    starts at a cost no larger), so the split is feasible iff it uses at most ``num_bins``
    batches.

    Returns:
        ``(num_batches_used, achieved_max_load, starts)``; ``starts`` has ``num_bins + 1`` entries
        (unused batches are empty) and is only meaningful when the split is feasible.

    Example:
        >>> used, achieved, starts = padded_split(np.array([4.0, 3.0, 3.0, 1.0]), 2, 9.0)
        >>> used, achieved, starts.tolist()
        (2, 8.0, [0, 2, 4])
    """
    n = cost_sorted.shape[0]
    starts = np.full(num_bins + 1, n, np.int64)
    pos = 0
    used = 0
    achieved = 0.0
    while pos < n:
        if used >= num_bins:
            return used + 1, np.inf, starts
        starts[used] = pos
        head = cost_sorted[pos]
        if head <= 0.0:
            take = n - pos
        else:
            fit = limit / head  # may overflow to inf for tiny costs: compare before int()
            if fit < 1.0:
                return num_bins + 1, np.inf, starts
            take = n - pos if fit >= n - pos else int(fit)
        achieved = max(achieved, take * head)
        pos += take
        used += 1
    for u in range(used, num_bins + 1):
        starts[u] = n
    return used, achieved, starts
