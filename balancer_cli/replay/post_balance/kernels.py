"""Loop kernels of post-balancing's balanced split (compiled with numba when it is installed).

Each kernel is a plain Python function over numpy arrays; when numba is importable it is
compiled (``cache=True``), otherwise it runs as Python with identical results (the same
arithmetic in the same order), only slower. Every tie is broken by index, so the output is a
pure function of the input: all ranks computing a plan from the same costs get the same plan.

These loops cannot be vectorized: greedy list scheduling and local search each depend on the
state left by the previous step. They are made cheap per step instead (a tournament tree for
LPT, per-bin item lists for the local search); the sort that feeds them is vectorized
(:func:`descending_order`). Where the bins go (matching, moves home) is in
:mod:`balancer_cli.replay.post_balance.placement_kernels`.
"""

from __future__ import annotations

import numpy as np

from balancer_cli._jit import njit
from balancer_cli._sort import stable_order

__all__ = ["descending_order", "lpt_bins", "padded_split", "refine_bins"]


def descending_order(cost):
    """Indices of ``cost`` by descending cost, ties by index: ``argsort(-cost, kind="stable")``
    (:func:`balancer_cli._sort.stable_order`: one vectorized sort of 64-bit words).

    Example:
        >>> descending_order(np.array([1.0, 3.0, 0.0, 3.0, -0.0, 2.5])).tolist()
        [1, 3, 5, 0, 2, 4]
    """
    return stable_order(cost, descending=True)


@njit
def lpt_bins(cost_sorted, num_bins):
    """Longest-processing-time-first: each item (costs >= 0, sorted descending) to the least-loaded bin.

    Ties between equally loaded bins go to the lowest bin index. The least loaded bin is kept in
    a tournament tree (each node holds the load and bin of the winner of its two children, the
    left one on ties), so an item costs ``log2(num_bins)`` comparisons with the siblings on its
    bin's path; once the costs reach 0 the remaining items all go to the current winner (their
    loads no longer change).

    Returns:
        ``(bin_N int64, load_R float64)``.

    Example:
        >>> bin_N, load_R = lpt_bins(np.array([5.0, 4.0, 3.0, 2.0]), 2)
        >>> bin_N.tolist(), load_R.tolist()
        ([0, 1, 1, 0], [7.0, 7.0])
    """
    n = cost_sorted.shape[0]
    size = 1
    while size < num_bins:
        size *= 2
    # node p holds the winner of its subtree: its load (val) and bin (idx); leaves at size + bin
    val = np.full(2 * size, np.inf)  # padding leaves never win: a real bin ties with them by index
    idx = np.empty(2 * size, np.int64)
    for b in range(size):
        val[size + b] = 0.0 if b < num_bins else np.inf
        idx[size + b] = b
    for p in range(size - 1, 0, -1):
        left = 2 * p if val[2 * p] <= val[2 * p + 1] else 2 * p + 1  # the left subtree: lower bins
        val[p], idx[p] = val[left], idx[left]
    bin_N = np.empty(n, np.int64)
    for i in range(n):
        b = idx[1]
        c = cost_sorted[i]
        if c == 0.0:  # sorted descending: every later item costs 0 and joins the same bin
            bin_N[i:] = b
            break
        bin_N[i] = b
        p = size + b
        v = val[p] + c
        w = b
        val[p] = v
        while p > 1:  # replay the matches on the way up (the siblings' winners do not change)
            s = p ^ 1
            sv = val[s]
            sw = idx[s]
            take = (sv < v) | ((sv == v) & (s < p))  # a tie goes to the left one (lower bins)
            v = sv if take else v  # selects, not branches: the outcome is a coin flip
            w = sw if take else w
            p >>= 1
            val[p] = v
            idx[p] = w
    return bin_N, val[size:size + num_bins].copy()


@njit
def _unlink(item, bin_of, head, nxt, prv):
    if prv[item] >= 0:
        nxt[prv[item]] = nxt[item]
    else:
        head[bin_of] = nxt[item]
    if nxt[item] >= 0:
        prv[nxt[item]] = prv[item]


@njit
def _push(item, bin_of, head, nxt, prv):
    nxt[item] = head[bin_of]
    prv[item] = -1
    if head[bin_of] >= 0:
        prv[head[bin_of]] = item
    head[bin_of] = item


@njit
def _sort_by_cost(item, cost_of, count):
    """Sort ``item[:count]`` and ``cost_of[:count]`` together by ascending cost (insertion sort:
    a bin holds few items; the order of equal costs does not matter to the caller)."""
    if count > 64:
        perm = np.argsort(cost_of[:count])
        item[:count] = item[:count][perm]
        cost_of[:count] = cost_of[:count][perm]
        return
    for i in range(1, count):
        ci, ii = cost_of[i], item[i]
        j = i
        while j > 0 and cost_of[j - 1] > ci:
            cost_of[j] = cost_of[j - 1]
            item[j] = item[j - 1]
            j -= 1
        cost_of[j], item[j] = ci, ii


@njit
def refine_bins(cost, bin_N, load, max_iters, num_candidates):
    """Local search on the most loaded bin: the best single move or pairwise swap per iteration.

    Each iteration takes the most loaded bin ``b`` and, among the ``num_candidates`` least loaded
    bins ``c``, the move of one item b -> c or swap of two items that lowers ``max(load_b,
    load_c)`` the most. Every applied step strictly lowers the sorted load vector, so the maximum
    never rises and the search terminates. ``bin_N`` and ``load`` are updated in place.

    Ties are broken as a scan in index order would (moves by candidate rank then item, before
    swaps by item pair): the bins' items are kept in linked lists, so an iteration costs
    O(bins + items of the candidates x log(items of b)), not a pass over all items. Costs are
    >= 0 (the planner's); items of cost 0 never move (a move or swap of one changes no load) and
    are left out of the lists.

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
    head = np.full(num_bins, -1, np.int64)
    nxt = np.empty(n, np.int64)
    prv = np.empty(n, np.int64)
    for i in range(n - 1, -1, -1):  # each bin's list in index order (any order gives the same result)
        if cost[i] > 0.0:
            first = head[bin_N[i]]
            nxt[i] = first
            prv[i] = -1
            if first >= 0:
                prv[first] = i
            head[bin_N[i]] = i
    cand = np.empty(k + 1, np.int64)
    in_b = np.empty(n, np.int64)
    cost_b = np.empty(n)
    for _ in range(max_iters):
        # one pass: the most loaded bin (lowest index on ties) and the k + 1 least loaded bins
        # by (load, index); the k least other than b are then the first k of those without b
        b = 0
        peak = load[0]
        m = 0
        kth = np.inf  # load of the (k + 1)-th least loaded bin so far, once there are k + 1
        for r in range(num_bins):
            lr = load[r]
            if lr > peak:
                b, peak = r, lr
            if m <= k:
                m += 1
            elif lr >= kth:
                continue
            j = m - 1
            while j > 0 and load[cand[j - 1]] > lr:
                cand[j] = cand[j - 1]
                j -= 1
            cand[j] = r
            if m > k:
                kth = load[cand[k]]
        if peak <= 0.0:
            break
        w = 0
        for t in range(m):
            if cand[t] != b and w < k:
                cand[w] = cand[t]
                w += 1
        nb = 0  # the items of b, gathered by ascending cost (for the swaps' searches)
        a = head[b]
        while a >= 0:
            in_b[nb] = a
            cost_b[nb] = cost[a]
            nb += 1
            a = nxt[a]
        _sort_by_cost(in_b, cost_b, nb)
        best_pair_max = peak * (1.0 - 1e-12)  # only strict improvements
        best_a, best_x, best_c, best_t = -1, -1, -1, -1
        for t in range(k):  # moves a -> c: the first (candidate rank, item) of the minimum
            c = cand[t]
            low = load[c]
            for ia in range(nb):
                ca = cost_b[ia]
                pair = max(peak - ca, low + ca)
                if pair < best_pair_max or (pair == best_pair_max and best_t == t and in_b[ia] < best_a):
                    best_pair_max, best_a, best_c, best_t = pair, in_b[ia], c, t
        swapped = False
        for t in range(k):  # swaps a <-> x: the first (x, a) pair of the minimum, after every move
            c = cand[t]
            low = load[c]
            x = head[c]
            while x >= 0:
                cx = cost[x]
                x_next = nxt[x]
                # For this x, pair(a) = max(peak - d, low + d), d = cost_a - cx, is (in floating
                # point too) falling then rising along b's ascending costs: only the a at the turn,
                # and those tied with them, can win. Valid swaps (d > 0) are those past ``lo``.
                lo, hi = 0, nb
                while lo < hi:
                    mid = (lo + hi) >> 1
                    if cost_b[mid] > cx:
                        hi = mid
                    else:
                        lo = mid + 1
                first = lo
                hi = nb
                while lo < hi:  # the turn: the first a with low + d >= peak - d
                    mid = (lo + hi) >> 1
                    d = cost_b[mid] - cx
                    if low + d >= peak - d:
                        hi = mid
                    else:
                        lo = mid + 1
                turn = lo
                best_here = np.inf
                if turn > first:
                    d = cost_b[turn - 1] - cx
                    best_here = max(peak - d, low + d)
                if turn < nb:
                    d = cost_b[turn] - cx
                    best_here = min(best_here, max(peak - d, low + d))
                if best_here > best_pair_max or (best_here == best_pair_max and not swapped):
                    x = x_next
                    continue
                for side in range(2):  # the tied run around the turn, each way
                    ia = turn - 1 if side == 0 else turn
                    while first <= ia < nb:
                        d = cost_b[ia] - cx
                        pair = max(peak - d, low + d)
                        if pair != best_here:
                            break
                        if pair < best_pair_max or (pair == best_pair_max and swapped and (
                                x < best_x or (x == best_x and in_b[ia] < best_a))):
                            best_pair_max, best_a, best_x, best_c = pair, in_b[ia], x, c
                            swapped = True
                        ia += -1 if side == 0 else 1
                x = x_next
        if best_a < 0:
            break
        c = best_c
        if not swapped:
            best_x = -1
        delta = cost[best_a] - (cost[best_x] if best_x >= 0 else 0.0)
        bin_N[best_a] = c
        _unlink(best_a, b, head, nxt, prv)
        _push(best_a, c, head, nxt, prv)
        if best_x >= 0:
            bin_N[best_x] = b
            _unlink(best_x, c, head, nxt, prv)
            _push(best_x, b, head, nxt, prv)
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
