"""Loop kernels of the post-balancing planner (compiled with numba when it is installed).

Each kernel is a plain Python function over numpy arrays; when numba is importable it is
compiled (``cache=True``), otherwise it runs as Python with identical results (the same
arithmetic in the same order), only slower. Every tie is broken by index, so the output is a
pure function of the input: all ranks computing a plan from the same costs get the same plan.

These loops cannot be vectorized: greedy list scheduling and local search each depend on the
state left by the previous step.
"""

from __future__ import annotations

import numpy as np

from balancer_cli._jit import HAVE_NUMBA, njit

__all__ = [
    "HAVE_NUMBA",
    "lpt_bins",
    "refine_bins",
    "padded_split",
    "match_bins",
    "move_back",
    "repair_from_home",
]


@njit
def _heap_less(load, ident, i, j):
    return load[i] < load[j] or (load[i] == load[j] and ident[i] < ident[j])


@njit
def lpt_bins(cost_sorted, num_bins):
    """Longest-processing-time-first: each item (costs sorted descending) to the least-loaded bin.

    Ties between equally loaded bins go to the lowest bin index.

    Returns:
        ``(bin_n int64, load_R float64)``.
    """
    n = cost_sorted.shape[0]
    heap_load = np.zeros(num_bins)
    heap_bin = np.arange(num_bins)  # all loads 0, ordered by index: already a valid heap
    bin_n = np.empty(n, np.int64)
    for i in range(n):
        bin_n[i] = heap_bin[0]
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
    return bin_n, load


@njit
def refine_bins(cost, bin_n, load, max_iters, num_candidates):
    """Local search on the most loaded bin: the best single move or pairwise swap per iteration.

    Each iteration takes the most loaded bin ``b`` and, among the ``num_candidates`` least loaded
    bins ``c``, the move of one item b -> c or swap of two items that lowers ``max(load_b,
    load_c)`` the most. Every applied step strictly lowers the sorted load vector, so the maximum
    never rises and the search terminates. ``bin_n`` and ``load`` are updated in place.

    Returns:
        The number of moves and swaps applied.
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
            if bin_n[i] == b:
                in_b[nb] = i
                nb += 1
            elif cand_pos[bin_n[i]] >= 0:
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
            c = bin_n[x]
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
        bin_n[best_a] = c
        if best_x >= 0:
            bin_n[best_x] = b
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


@njit
def match_bins(bin_n, home_n, num_bins, ranks_per_node):
    """Assign bins to ranks (a permutation) so that many items stay on their home rank.

    Greedy maximum-overlap matching: (bin, rank) pairs by descending count of the bin's items
    whose home is that rank; then, for bins still unmatched, (bin, node) pairs by descending
    count of items whose home is in that node, each taking that node's lowest free rank; then the
    remaining bins in index order take the remaining ranks in index order.

    Returns:
        ``rank_of_bin`` (num_bins,) int64.
    """
    n = bin_n.shape[0]
    rank_of_bin = np.full(num_bins, -1, np.int64)
    rank_free = np.ones(num_bins, np.bool_)
    for level in range(2):
        if level == 1 and ranks_per_node <= 1:
            break
        group = 1 if level == 0 else ranks_per_node
        num_groups = (num_bins + group - 1) // group
        key = np.empty(n, np.int64)
        for i in range(n):
            key[i] = bin_n[i] * num_groups + home_n[i] // group
        key.sort()
        # run-length encode -> (count, bin, group) pairs, then sort by (-count, bin, group)
        pair_key = np.empty(n, np.int64)
        m = 0
        i = 0
        while i < n:
            j = i
            while j < n and key[j] == key[i]:
                j += 1
            pair_key[m] = (n - (j - i)) * (num_bins * num_groups) + key[i]
            m += 1
            i = j
        pairs = np.sort(pair_key[:m])
        for p in range(m):
            rest = pairs[p] % (num_bins * num_groups)
            b = rest // num_groups
            g = rest % num_groups
            if rank_of_bin[b] >= 0:
                continue
            for r in range(g * group, min((g + 1) * group, num_bins)):
                if rank_free[r]:
                    rank_of_bin[b] = r
                    rank_free[r] = False
                    break
    r = 0
    for b in range(num_bins):
        if rank_of_bin[b] < 0:
            while not rank_free[r]:
                r += 1
            rank_of_bin[b] = r
            rank_free[r] = False
    return rank_of_bin


@njit
def move_back(cost, dest_n, home_n, order, num_ranks, cap, ranks_per_node, padded):
    """Send moved items home (or into their home node) wherever that keeps every load <= ``cap``.

    Items are visited in ``order``. First pass: an item not on its home rank returns there if the
    home's load stays within ``cap``. Second pass (``ranks_per_node > 1``): an item still on
    another node goes to the least loaded rank of its home node if that fits. Loads are linear
    sums (varlen) or ``count x max cost`` (padded; a donor's max is kept as an upper bound, so
    the check stays conservative). ``dest_n`` is updated in place.

    Returns:
        The number of items relocated.
    """
    count = np.zeros(num_ranks, np.int64)
    total = np.zeros(num_ranks)
    peak = np.zeros(num_ranks)
    for i in range(dest_n.shape[0]):
        d = dest_n[i]
        count[d] += 1
        total[d] += cost[i]
        peak[d] = max(peak[d], cost[i])
    relocated = 0
    passes = 2 if ranks_per_node > 1 else 1
    for p in range(passes):
        for t in range(order.shape[0]):
            i = order[t]
            d = dest_n[i]
            h = home_n[i]
            if p == 0:
                if d == h:
                    continue
                target = h
            else:
                node = h // ranks_per_node
                if d // ranks_per_node == node:
                    continue
                target = node * ranks_per_node
                last = min((node + 1) * ranks_per_node, num_ranks)
                for r in range(target + 1, last):
                    if padded:
                        if (count[r] + 1) * max(peak[r], cost[i]) < (count[target] + 1) * max(peak[target], cost[i]):
                            target = r
                    elif total[r] < total[target]:
                        target = r
            c = cost[i]
            if padded:
                fits = (count[target] + 1) * max(peak[target], c) <= cap
            else:
                fits = total[target] + c <= cap
            if fits:
                dest_n[i] = target
                count[d] -= 1
                total[d] -= c
                count[target] += 1
                total[target] += c
                peak[target] = max(peak[target], c)
                relocated += 1
    return relocated


@njit
def repair_from_home(cost, home_n, num_ranks, limit, ranks_per_node, policy):
    """Keep samples home and move only the excess: shed items from ranks above ``limit`` into
    the ranks with room (summed loads).

    Each overloaded rank sheds items while above ``limit``. ``policy`` 0: the smallest item that
    brings it under ``limit`` if one exists, else its largest item (fewest items). ``policy`` 1:
    the largest item no larger than the excess if one exists, else the smallest that fixes it
    (small items, which fit elsewhere even when the limit is tight). The shed items, largest
    first, go to the fullest rank that still has room (best fit), preferring the item's own
    node; an item that fits nowhere goes to the least loaded rank (the caller's local search
    then repairs it).

    Returns:
        ``(dest_n int64, load_R float64)``.
    """
    n = cost.shape[0]
    dest_n = home_n.copy()
    load = np.zeros(num_ranks)
    for i in range(n):
        load[home_n[i]] += cost[i]
    # items grouped by home rank (home_n is sorted: samples are flattened rank by rank)
    start = np.zeros(num_ranks + 1, np.int64)
    for i in range(n):
        start[home_n[i] + 1] += 1
    for r in range(num_ranks):
        start[r + 1] += start[r]
    pool = np.empty(n, np.int64)
    num_pool = 0
    for r in range(num_ranks):
        while load[r] > limit:
            excess = load[r] - limit
            pick = -1  # smallest item >= excess
            largest = -1
            under = -1  # largest item <= excess
            for i in range(start[r], start[r + 1]):
                if dest_n[i] != r or cost[i] <= 0.0:
                    continue
                if cost[i] >= excess and (pick < 0 or cost[i] < cost[pick]):
                    pick = i
                if largest < 0 or cost[i] > cost[largest]:
                    largest = i
                if cost[i] <= excess and (under < 0 or cost[i] > cost[under]):
                    under = i
            if policy == 1 and under >= 0:
                pick = under
            if pick < 0:
                pick = largest
            if pick < 0:
                break
            dest_n[pick] = -1
            load[r] -= cost[pick]
            pool[num_pool] = pick
            num_pool += 1
    # largest first (stable by index)
    pool_cost = np.empty(num_pool)
    for t in range(num_pool):
        pool_cost[t] = -cost[pool[t]]
    pool = pool[:num_pool][np.argsort(pool_cost, kind="mergesort")]
    group = ranks_per_node if ranks_per_node > 1 else num_ranks
    for t in range(num_pool):
        i = pool[t]
        c = cost[i]
        target = -1
        for level in range(2):
            lo, hi = 0, num_ranks
            if level == 0:
                lo = (home_n[i] // group) * group
                hi = min(lo + group, num_ranks)
            for r in range(lo, hi):
                if load[r] + c <= limit and (target < 0 or load[r] > load[target]):
                    target = r
            if target >= 0 or group == num_ranks:
                break
        if target < 0:
            target = 0
            for r in range(1, num_ranks):
                if load[r] < load[target]:
                    target = r
        dest_n[i] = target
        load[target] += c
    return dest_n, load

