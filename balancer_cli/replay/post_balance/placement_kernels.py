"""Loop kernels of post-balancing's placement: bins to ranks, samples back home, only the excess moved.

Compiled with numba when it is installed, else run as Python with identical results (the same
arithmetic in the same order), only slower. Every tie is broken by index, so the output is a pure
function of the input: all ranks computing a plan from the same costs get the same plan. Each
loop depends on the state left by the previous item, so none can be vectorized. The balanced
split itself is in :mod:`balancer_cli.replay.post_balance.kernels`.
"""

from __future__ import annotations

import numpy as np

from balancer_cli._jit import njit
from balancer_cli._sort import counting_order

__all__ = ["match_bins", "move_back", "place_shed", "repair_from_home", "shed_from_home"]


@njit
def match_bins(bin_N, home_N, num_bins, ranks_per_node):
    """Assign bins to ranks (a permutation) so that many items stay on their home rank.

    Greedy maximum-overlap matching: (bin, rank) pairs by descending count of the bin's items
    whose home is that rank; then, for bins still unmatched, (bin, node) pairs by descending
    count of items whose home is in that node, each taking that node's lowest free rank; then the
    remaining bins in index order take the remaining ranks in index order. Ties between pairs of
    equal count go to the lower (bin, rank or node); the pairs are ordered by counting sorts, in
    O(items + bins).

    Returns:
        ``rank_of_bin`` (num_bins,) int64.

    Example:
        >>> match_bins(np.array([1, 1, 0]), np.array([0, 0, 1]), 2, 1).tolist()  # bin 1 holds rank 0's items
        [1, 0]
    """
    n = bin_N.shape[0]
    rank_of_bin = np.full(num_bins, -1, np.int64)
    rank_free = np.ones(num_bins, np.bool_)
    group_N = np.empty(n, np.int64)
    by_group = np.empty(n, np.int64)
    sorted_group = np.empty(n, np.int64)
    pair_bin = np.empty(n, np.int64)
    pair_group = np.empty(n, np.int64)
    pair_count = np.empty(n, np.int64)
    pairs = np.empty(n, np.int64)
    for level in range(2):
        if level == 1 and ranks_per_node <= 1:
            break
        group = 1 if level == 0 else ranks_per_node
        num_groups = (num_bins + group - 1) // group
        grouped = True  # homes in order (the planner's flattening): items already by group
        for i in range(n):
            group_N[i] = home_N[i] // group
            if i and group_N[i] < group_N[i - 1]:
                grouped = False
        # items by (bin, group): stable by group, then by bin (keeping the sorted groups)
        if grouped:
            by_group[:] = np.arange(n)
        else:
            counting_order(group_N, np.arange(n), num_groups, by_group)
        start = np.zeros(num_bins + 1, np.int64)
        for i in range(n):
            start[bin_N[i] + 1] += 1
        for b in range(num_bins):
            start[b + 1] += start[b]
        bin_start = start[:-1].copy()
        for t in range(n):
            i = by_group[t]
            sorted_group[start[bin_N[i]]] = group_N[i]
            start[bin_N[i]] += 1
        # run-length encode -> (count, bin, group) pairs in (bin, group) order ...
        m = 0
        most = 0
        for b in range(num_bins):
            i = bin_start[b]
            end = start[b]
            while i < end:
                g = sorted_group[i]
                j = i + 1
                while j < end and sorted_group[j] == g:
                    j += 1
                pair_bin[m], pair_group[m], pair_count[m] = b, g, j - i
                most = max(most, j - i)
                m += 1
                i = j
        # ... then stably by descending count: (-count, bin, group) order
        for p in range(m):
            pair_count[p] = most - pair_count[p]
        counting_order(pair_count, np.arange(m), most, pairs)
        for p in range(m):
            b = pair_bin[pairs[p]]
            g = pair_group[pairs[p]]
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
def move_back(cost, dest_N, home_N, order, num_ranks, cap, ranks_per_node, padded):
    """Send moved items home (or into their home node) wherever that keeps every load <= ``cap``.

    Items are visited in ``order``. First pass: an item not on its home rank returns there if the
    home's load stays within ``cap``. Second pass (``ranks_per_node > 1``): an item still on
    another node goes to the least loaded rank of its home node if that fits. Loads are linear
    sums (varlen) or ``count x max cost`` (padded; a donor's max is kept as an upper bound, so
    the check stays conservative). ``dest_N`` is updated in place.

    Returns:
        The number of items relocated.

    Example:
        >>> dest_N = np.array([1, 1])
        >>> move_back(np.array([2.0, 1.0]), dest_N, np.array([0, 1]), np.array([1, 0]), 2, 3.0, 1, False), dest_N.tolist()
        (1, [0, 1])
    """
    count = np.zeros(num_ranks, np.int64)
    total = np.zeros(num_ranks)
    peak = np.zeros(num_ranks)
    for i in range(dest_N.shape[0]):
        d = dest_N[i]
        count[d] += 1
        total[d] += cost[i]
        peak[d] = max(peak[d], cost[i])
    relocated = 0
    passes = 2 if ranks_per_node > 1 else 1
    num_nodes = (num_ranks + ranks_per_node - 1) // ranks_per_node
    node_min = np.empty(num_nodes)  # pass 2, varlen: least load per node, kept exact
    for p in range(passes):
        if p == 1 and not padded:
            node_min[:] = np.inf
            for r in range(num_ranks):
                node_min[r // ranks_per_node] = min(node_min[r // ranks_per_node], total[r])
        for t in range(order.shape[0]):
            i = order[t]
            d = dest_N[i]
            h = home_N[i]
            if p == 0:
                if d == h:
                    continue
                target = h
            else:
                node = h // ranks_per_node
                if d // ranks_per_node == node:
                    continue
                if not padded and not node_min[node] + cost[i] <= cap:
                    continue  # not even the node's least loaded rank (the one tried) has room
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
                dest_N[i] = target
                count[d] -= 1
                total[d] -= c
                count[target] += 1
                total[target] += c
                peak[target] = max(peak[target], c)
                relocated += 1
                if p == 1 and not padded:
                    node_min[d // ranks_per_node] = min(node_min[d // ranks_per_node], total[d])
                    node = target // ranks_per_node
                    node_min[node] = np.inf
                    for r in range(node * ranks_per_node, min((node + 1) * ranks_per_node, num_ranks)):
                        node_min[node] = min(node_min[node], total[r])
    return relocated


@njit
def _rank_position(by_load, load, r, lo, hi):
    """Where rank ``r`` belongs in ``by_load[lo:hi]`` (ranks sorted by (load, -index)): binary search."""
    while lo < hi:
        mid = (lo + hi) >> 1
        q = by_load[mid]
        if load[q] < load[r] or (load[q] == load[r] and q > r):
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit
def repair_from_home(cost, home_N, num_ranks, limit, ranks_per_node, policy):
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
        ``(dest_N int64, load_R float64)``.

    Example:
        >>> dest_N, load_R = repair_from_home(np.array([4.0, 3.0, 1.0]), np.array([0, 0, 0]), 2, 5.0, 1, 0)
        >>> dest_N.tolist(), load_R.tolist()
        ([0, 1, 0], [5.0, 3.0])
    """
    dest_N, load, pool = shed_from_home(cost, home_N, num_ranks, limit, policy)
    place_shed(cost, home_N, dest_N, load, pool, limit, ranks_per_node)
    return dest_N, load


@njit
def shed_from_home(cost, home_N, num_ranks, limit, policy):
    """The shedding half of :func:`repair_from_home` (it does not depend on ``ranks_per_node``).

    Returns:
        ``(dest_N int64, load_R float64, pool int64)``: shed items have ``dest_N = -1``;
        ``pool`` lists them largest first (ties by index); ``load_R`` is without them.

    Example:
        >>> dest_N, load_R, pool = shed_from_home(np.array([4.0, 3.0, 1.0]), np.array([0, 0, 0]), 2, 5.0, 0)
        >>> dest_N.tolist(), load_R.tolist(), pool.tolist()
        ([0, -1, 0], [5.0, 0.0], [1])
    """
    n = cost.shape[0]
    dest_N = home_N.copy()
    load = np.zeros(num_ranks)
    for i in range(n):
        load[home_N[i]] += cost[i]
    # items grouped by home rank (home_N is sorted: samples are flattened rank by rank)
    start = np.zeros(num_ranks + 1, np.int64)
    for i in range(n):
        start[home_N[i] + 1] += 1
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
                if dest_N[i] != r or cost[i] <= 0.0:
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
            dest_N[pick] = -1
            load[r] -= cost[pick]
            pool[num_pool] = pick
            num_pool += 1
    # largest first (stable by index)
    pool_cost = np.empty(num_pool)
    for t in range(num_pool):
        pool_cost[t] = -cost[pool[t]]
    pool = pool[:num_pool][np.argsort(pool_cost, kind="mergesort")]
    return dest_N, load, pool


@njit
def place_shed(cost, home_N, dest_N, load, pool, limit, ranks_per_node):
    """The placing half of :func:`repair_from_home`: ``pool`` (largest first) to the fullest
    rank with room, the item's own node first; ``dest_N`` and ``load`` are updated in place.

    Example:
        >>> dest_N, load_R = np.array([0, -1, 0]), np.array([5.0, 0.0])
        >>> place_shed(np.array([4.0, 3.0, 1.0]), np.array([0, 0, 0]), dest_N, load_R, np.array([1]), 5.0, 1)
        >>> dest_N.tolist(), load_R.tolist()
        ([0, 1, 0], [5.0, 3.0])
    """
    num_ranks = load.shape[0]
    num_pool = pool.shape[0]
    # Ranks ordered by (load, -index): the ranks where an item fits are a prefix (fl(load + c)
    # rises with load), and the last of that prefix is the fullest, lowest-index one among them.
    by_load = (num_ranks - 1) - np.argsort(load[::-1], kind="mergesort")
    group = ranks_per_node if ranks_per_node > 1 else num_ranks
    for t in range(num_pool):
        i = pool[t]
        c = cost[i]
        target = -1
        if group < num_ranks:  # the item's own node first
            lo = (home_N[i] // group) * group
            for r in range(lo, min(lo + group, num_ranks)):
                if load[r] + c <= limit and (target < 0 or load[r] > load[target]):
                    target = r
        if target >= 0:
            p = _rank_position(by_load, load, target, 0, by_load.shape[0])
        else:  # best fit over all ranks: binary search for the end of the prefix
            lo, hi = 0, num_ranks  # by_load[:lo] fit, by_load[hi:] do not
            while lo < hi:
                mid = (lo + hi) >> 1
                if load[by_load[mid]] + c <= limit:
                    lo = mid + 1
                else:
                    hi = mid
            if lo > 0:
                p = lo - 1
            else:  # fits nowhere: the least loaded rank, lowest index (the end of the first run)
                lo, hi = 0, num_ranks
                while lo < hi:
                    mid = (lo + hi) >> 1
                    if load[by_load[mid]] <= load[by_load[0]]:
                        lo = mid + 1
                    else:
                        hi = mid
                p = lo - 1
            target = by_load[p]
        dest_N[i] = target
        load[target] += c
        # the load rose: the rank moves up past those now before it in (load, -index) order
        lo = _rank_position(by_load, load, target, p + 1, num_ranks)
        dst, src = by_load[p:lo - 1], by_load[p + 1:lo]  # a forward copy over views (vectorized)
        for q in range(lo - 1 - p):
            dst[q] = src[q]
        by_load[lo - 1] = target

