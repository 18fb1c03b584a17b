"""Loop kernels of post-balancing's balanced split (compiled with numba when it is installed).

Each kernel is a plain Python function over numpy arrays; when numba is importable it is
compiled (``cache=True``), otherwise it runs as Python with identical results (the same
arithmetic in the same order), only slower. Every tie is broken by index, so the output is a
pure function of the input: all ranks computing a plan from the same costs get the same plan.

These loops cannot be vectorized: greedy list scheduling and local search each depend on the
state left by the previous step. They are made cheap per step instead (a tournament tree for
LPT; for the local search, bins kept sorted by load and each bin's items by cost); the sort
that feeds them is vectorized (:func:`descending_order`). Where the bins go (matching, moves home) is in
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
def _take_out(items, costs, count, bin_of, item):
    """Remove ``item`` from its bin's row (the rest keep their order)."""
    m = count[bin_of]
    i = 0
    while items[bin_of, i] != item:
        i += 1
    for j in range(i, m - 1):
        items[bin_of, j] = items[bin_of, j + 1]
        costs[bin_of, j] = costs[bin_of, j + 1]
    count[bin_of] = m - 1


@njit
def _put_in(items, costs, count, bin_of, item, value):
    """Insert ``item`` of cost ``value`` into its bin's row, kept by ascending cost; the rows grow
    (all of them, copied once) when this one is full. Returns the (maybe new) rows."""
    m = count[bin_of]
    if m == items.shape[1]:
        wider_items = np.empty((items.shape[0], 2 * m), items.dtype)
        wider_costs = np.empty((items.shape[0], 2 * m))
        wider_items[:, :m] = items
        wider_costs[:, :m] = costs
        items, costs = wider_items, wider_costs
    i = m
    while i > 0 and costs[bin_of, i - 1] > value:
        items[bin_of, i] = items[bin_of, i - 1]
        costs[bin_of, i] = costs[bin_of, i - 1]
        i -= 1
    items[bin_of, i] = item
    costs[bin_of, i] = value
    count[bin_of] = m + 1
    return items, costs


@njit
def _first_above(order, load, lo, hi, value, x):
    """The first position in ``order[lo:hi]`` whose ``(load, bin)`` is not below ``(value, x)`` (or ``hi``):
    bin ``x``'s own place while its load is ``value``, else the first bin above it."""
    while lo < hi:
        mid = (lo + hi) >> 1
        y = order[mid]
        if load[y] < value or (load[y] == value and y < x):
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit
def _resort(order, load, x, new):
    """Set bin ``x``'s load to ``new`` and move it to its place in ``order`` (bins by ascending
    ``(load, bin)``): it sits where its old ``(load, x)`` is the first not below itself."""
    i = _first_above(order, load, 0, len(order), load[x], x)
    old = load[x]
    load[x] = new
    if new < old:  # to the left: before every bin above (new, x)
        lo = _first_above(order, load, 0, i, new, x)
        order[lo + 1:i + 1] = order[lo:i]  # numba copies overlapping slices as numpy does
        order[lo] = x
    elif new > old:  # to the right: after every bin below (new, x)
        lo = _first_above(order, load, i + 1, len(order), new, x)
        order[i:lo - 1] = order[i + 1:lo]
        order[lo - 1] = x


@njit
def refine_bins(cost, bin_N, load, max_iters, num_candidates, by_cost, stop_at=0.0):
    """Local search on the most loaded bin: the best single move or pairwise swap per iteration.

    Each iteration takes the most loaded bin ``b`` and, among the ``num_candidates`` least loaded
    bins ``c``, the move of one item b -> c or swap of two items that lowers ``max(load_b,
    load_c)`` the most. Every applied step strictly lowers the sorted load vector, so the maximum
    never rises and the search terminates. ``bin_N`` and ``load`` are updated in place.

    Ties are broken as a scan in index order would (the most loaded bin of lowest index; the
    least loaded by (load, index); moves by candidate rank then item, before swaps by item pair;
    tests/replay/test_post_balance_refine.py checks every step against that scan). The bins are
    kept sorted by (load, index) and each bin's items in a row by ascending cost, so an iteration
    costs O(log bins) for the bins, and one merge-like sweep of b's and a candidate's items per
    candidate for the swaps, where a scan of every bin's load and a sorting of b's and a binary
    search per item of the candidates had cost 2.2x as much (1024 bins of 16 items: ~2.2 us an
    iteration, 1,199 iterations for an LLM phase). Costs are >= 0 (the planner's); items of cost
    0 never move (a move or swap of one changes no load) and are left out of the rows.

    Args:
        cost, bin_N, load: (N,) item costs, (N,) bin of each item (updated), (R,) bin loads (updated).
        max_iters, num_candidates: iterations at most; least loaded bins tried per iteration.
        by_cost: (N,) the items by descending cost (:func:`descending_order`; the caller has it).
        stop_at: stop once the most loaded bin holds at most this (default 0: run to the end).

    Returns:
        The number of moves and swaps applied.

    Example:
        >>> bin_N, load = np.array([0, 0, 0, 1]), np.array([12.0, 2.0])
        >>> cost = np.array([5.0, 4.0, 3.0, 2.0])
        >>> refine_bins(cost, bin_N, load, 10, 1, descending_order(cost)), bin_N.tolist(), load.tolist()
        (1, [1, 0, 0, 1], [7.0, 7.0])
    """
    n = cost.shape[0]
    num_bins = load.shape[0]
    k = min(num_candidates, num_bins - 1)
    applied = 0
    if k <= 0:
        return applied
    # Each bin's items (cost > 0) in a row of their own, by ascending cost: the searches below
    # read them in order and side by side in memory (linked lists made them chase pointers).
    count = np.zeros(num_bins, np.int64)
    for i in range(n):
        if cost[i] > 0.0:
            count[bin_N[i]] += 1
    width = 4
    for r in range(num_bins):
        width = max(width, count[r] + 4)
    items = np.empty((num_bins, width), np.int64)
    costs = np.empty((num_bins, width))
    count[:] = 0
    for j in range(n - 1, -1, -1):  # by ascending cost
        i = by_cost[j]
        if cost[i] > 0.0:
            r = bin_N[i]
            items[r, count[r]] = i
            costs[r, count[r]] = cost[i]
            count[r] += 1
    order = np.argsort(load, kind="mergesort")  # bins by (load, index), kept so as loads change
    cand = np.empty(k, np.int64)
    for _ in range(max_iters):
        # the most loaded bin (lowest index on ties): the first of the last run of equal loads
        peak = load[order[num_bins - 1]]
        if peak <= stop_at:
            break
        b = order[_first_above(order, load, 0, num_bins - 1, peak, -1)]
        w = 0  # the k least loaded bins other than b
        for t in range(k + 1):
            if order[t] != b and w < k:
                cand[w] = order[t]
                w += 1
        nb = count[b]  # the items of b, by ascending cost
        in_b = items[b]
        cost_b = costs[b]
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
            # Every swap with c leaves max(peak - d, low + d) >= (peak + low) / 2 (less a few
            # roundings): past the best so far, no item of c can win.
            if 0.5 * (peak + low) - 1e-12 * peak > best_pair_max:
                continue
            turn_all = 0
            for ic in range(count[c]):  # c's items by ascending cost: the turn below then only moves right
                x = items[c, ic]
                cx = costs[c, ic]
                # For this x, pair(a) = max(peak - d, low + d), d = cost_a - cx, is (in floating
                # point too) falling then rising along b's ascending costs: only the a at the turn,
                # and those tied with them, can win. Valid swaps (d > 0) are those with cost_a > cx.
                # ``low + d >= peak - d`` only turns true along b's costs, later for a costlier x:
                # the turn among all of b's items, found from the last x's, is the turn among the
                # valid ones unless it comes before them.
                while turn_all < nb:  # the turn: the first a with low + d >= peak - d
                    d = cost_b[turn_all] - cx
                    if low + d >= peak - d:
                        break
                    turn_all += 1
                turn = turn_all
                before = turn > 0 and cost_b[turn - 1] > cx  # a valid a just before the turn
                if not before:  # the turn is at or before the first valid a: start there
                    while turn < nb and cost_b[turn] <= cx:
                        turn += 1
                best_here = np.inf
                if before:
                    d = cost_b[turn - 1] - cx
                    best_here = max(peak - d, low + d)
                if turn < nb:
                    d = cost_b[turn] - cx
                    best_here = min(best_here, max(peak - d, low + d))
                if best_here > best_pair_max or (best_here == best_pair_max and not swapped):
                    continue
                for side in range(2):  # the tied run around the turn, each way (valid a only)
                    ia = turn - 1 if side == 0 else turn
                    while 0 <= ia < nb and cost_b[ia] > cx:
                        d = cost_b[ia] - cx
                        pair = max(peak - d, low + d)
                        if pair != best_here:
                            break
                        if pair < best_pair_max or (pair == best_pair_max and swapped and (
                                x < best_x or (x == best_x and in_b[ia] < best_a))):
                            best_pair_max, best_a, best_x, best_c = pair, in_b[ia], x, c
                            swapped = True
                        ia += -1 if side == 0 else 1
        if best_a < 0:
            break
        c = best_c
        if not swapped:
            best_x = -1
        delta = cost[best_a] - (cost[best_x] if best_x >= 0 else 0.0)
        bin_N[best_a] = c
        _take_out(items, costs, count, b, best_a)
        if best_x >= 0:
            bin_N[best_x] = b
            _take_out(items, costs, count, c, best_x)
            items, costs = _put_in(items, costs, count, b, best_x, cost[best_x])
        items, costs = _put_in(items, costs, count, c, best_a, cost[best_a])
        _resort(order, load, b, load[b] - delta)
        _resort(order, load, c, load[c] + delta)
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
