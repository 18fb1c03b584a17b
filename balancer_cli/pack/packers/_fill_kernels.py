"""Greedy kernels that form groups: ISF's sequential close, first fit and round-robin dealing.

Loops that cannot be vectorized, compiled by the shared optional-numba decorator
(:func:`balancer_cli._jit.njit`): numba when importable, the same code as plain Python otherwise.
All randomness is drawn by the callers with numpy and passed in, so the kernels are deterministic.
"""

from __future__ import annotations

import numpy as np

from balancer_cli._jit import njit, prefetch
from balancer_cli._shuffle import shuffled
from balancer_cli._sort import size_order, stable_argsort
from balancer_cli.pack.packers._table_kernels import ROWS_AHEAD

__all__ = ["greedy_close", "first_fit", "first_fit_tree", "deal_rounds", "row_shares", "deal_order",
           "first_fit_orders"]


@njit
def greedy_close(rows, load_NK, caps_K):  # pragma: no cover - compiled
    """Groups formed by walking rows in order, closing a group when the next row would exceed a cap.

    Reads the loads through ``rows`` (prefetched ahead: they come shuffled) instead of a (P, K)
    gathered copy, and sums each group on the way.

    Args:
        rows: (P,) rows in packing order; every row fits the caps on its own.
        load_NK: (N, K) load of every row.
        caps_K: (K,) caps per group.

    Returns:
        (offsets, sums_GK): the (G + 1,) offsets of the groups in ``rows`` order (the trailing
        open group is kept) and their (G, K) int64 load sums.

    Example:
        >>> import numpy as np
        >>> offsets, sums = greedy_close(np.array([2, 0, 1]), np.array([[3, 10], [3, 10], [4, 10]]), np.array([9, 100]))
        >>> offsets.tolist(), sums.tolist()
        ([0, 2, 3], [[7, 20], [3, 10]])
    """
    P, K = len(rows), load_NK.shape[1]
    offsets = np.empty(P + 1, dtype=np.int64)
    sums = np.zeros((P, K), dtype=np.int64)
    offsets[0] = 0
    ng = 0
    for p in range(P):
        if p + ROWS_AHEAD < P:
            prefetch(load_NK, rows[p + ROWS_AHEAD] * K)
        i = rows[p]
        over = False
        for k in range(K):
            if sums[ng, k] + load_NK[i, k] > caps_K[k]:
                over = True
                break
        if over and p > offsets[ng]:
            ng += 1
            offsets[ng] = p
        for k in range(K):
            sums[ng, k] += load_NK[i, k]
    if P > offsets[ng]:
        ng += 1
        offsets[ng] = P
    return offsets[: ng + 1], sums[:ng]


@njit
def first_fit(rows, load_NK, caps_K, min_rest_PK, lookback, lsum0_GK):  # pragma: no cover - compiled
    """First fit over the open groups, in the given row order (decreasing size for FFD).

    Groups ``0 .. len(lsum0_GK) - 1`` start open with the loads ``lsum0_GK`` (rows dealt before:
    the rest fills their room); new groups are numbered after them.

    A group leaves the open list once some module's room is below what every remaining row needs,
    so scans stay short; at most ``lookback`` open groups are tried (circularly, from where the
    last scan stopped) before a new group opens.

    Args:
        rows: (P,) rows in packing order.
        load_NK: (N, K) load of every row.
        caps_K: (K,) caps per group.
        min_rest_PK: (P, K) per-module minimum load of ``rows[p:]``.
        lookback: most open groups tried per row.
        lsum0_GK: (G0, K) loads of the groups open from the start (shape (0, K): none).

    Returns:
        (gid, G): (P,) group id per row, in ``rows`` order, and the number of groups (G0 included).

    Example:
        >>> import numpy as np
        >>> load_NK = np.array([[6], [5], [4], [3]]); rows = np.arange(4)
        >>> from balancer_cli.pack.packers._table_kernels import suffix_min
        >>> min_rest_PK = suffix_min(rows, load_NK)
        >>> gid, G = first_fit(rows, load_NK, np.array([9]), min_rest_PK, 64, np.zeros((0, 1), np.int64))
        >>> gid.tolist(), G
        ([0, 1, 1, 0], 2)
        >>> first_fit(rows[2:], load_NK, np.array([9]), min_rest_PK[2:], 64, np.array([[6], [5]]))[0].tolist()
        [1, 0]
    """
    P = len(rows)
    K = load_NK.shape[1]
    G0 = lsum0_GK.shape[0]
    gid = np.empty(P, dtype=np.int64)
    lsum = np.zeros((G0 + P, K), dtype=np.int64)
    open_ids = np.empty(G0 + P, dtype=np.int64)
    for g in range(G0):
        open_ids[g] = g
        for k in range(K):
            lsum[g, k] = lsum0_GK[g, k]
    n_open = G = G0
    cursor = 0
    for p in range(P):
        if p + ROWS_AHEAD < P:  # rows come by size: random rows of the table (741k: 70 -> 30 ms)
            prefetch(load_NK, rows[p + ROWS_AHEAD] * K)
        i = rows[p]
        placed = -1
        tried = 0
        # Circular scan from where the last one stopped: a group a larger row failed is tried by smaller ones.
        while n_open > 0 and tried < lookback:
            if cursor >= n_open:
                cursor = 0
            b = open_ids[cursor]
            dead = False
            fits = True
            for k in range(K):
                room = caps_K[k] - lsum[b, k]
                if room < min_rest_PK[p, k]:
                    dead = True
                    break
                if load_NK[i, k] > room:
                    fits = False
            if dead:
                n_open -= 1
                open_ids[cursor] = open_ids[n_open]
                continue
            tried += 1
            if fits:
                placed = b
                break
            cursor += 1
        if placed < 0:
            placed = G
            G += 1
            open_ids[n_open] = placed
            n_open += 1
        gid[p] = placed
        for k in range(K):
            lsum[placed, k] += load_NK[i, k]
    return gid, G


@njit
def first_fit_tree(sizes, cap, width):  # pragma: no cover - compiled
    """Exact first fit of one-dimensional ``sizes`` (in order) into bins of ``cap``.

    A max segment tree over ``width`` bins (a power of two, more than first fit can open) holds
    each bin's remaining room, so the leftmost bin with room is found in O(log width).

    Returns:
        (n,) bin index per item.

    Example:
        >>> import numpy as np
        >>> first_fit_tree(np.array([6, 5, 4, 3, 2]), 9, 4).tolist()
        [0, 1, 1, 0, 2]
    """
    tree = np.full(2 * width, cap, dtype=np.int64)  # remaining room; unopened bins are empty bins
    bins = np.empty(len(sizes), dtype=np.int64)
    for i in range(len(sizes)):
        size = sizes[i]
        node = 1
        while node < width:
            node = 2 * node if tree[2 * node] >= size else 2 * node + 1
        bins[i] = node - width
        tree[node] -= size
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return bins


def deal_order(hard_n: np.ndarray, norm_n: np.ndarray, hard_share: float) -> np.ndarray:
    """Dealing's order of rows (:func:`row_shares`' ``hard`` and ``norm``): those over ``hard_share``
    of a cap first, by that share, then the others by normalized size; both decreasing, to 0.05%
    (:func:`~balancer_cli._sort.size_order`), ties by position.

    Example:
        >>> deal_order(np.array([0.2, 0.9, 0.1, 0.6]), np.array([0.5, 0.9, 0.7, 0.6]), 0.5).tolist()
        [1, 3, 2, 0]
    """
    order = size_order(norm_n, descending=True)
    is_hard = hard_n > hard_share
    if not is_hard.any():
        return order
    first = np.flatnonzero(is_hard)
    return np.concatenate([first[size_order(hard_n[first], descending=True)], order[~is_hard[order]]])


def first_fit_orders(rows, load_NK, caps_K, rng, binding=None):
    """First fit's orders of ``rows`` (one seeded shuffle breaks ties): by decreasing normalized size,
    then, with a ``binding`` column, by its cap's share (size breaks ties); both to 0.05%.

    Example:
        >>> load_NK, rng = np.array([[1, 10], [4, 20], [2, 40]]), np.random.default_rng(0)
        >>> [o.tolist() for o in first_fit_orders(np.arange(3), load_NK, np.array([8, 40]), rng, 0)]
        [[2, 1, 0], [1, 2, 0]]
    """
    shuffled_rows = shuffled(rng, rows)
    size = row_shares(shuffled_rows, load_NK, caps_K, load_NK, np.zeros(0))[1]
    keys = [size] + ([] if binding is None else [load_NK[shuffled_rows, binding] / caps_K[binding] + 0.1 * size])
    return [shuffled_rows[size_order(key, descending=True)] for key in keys]


@njit
def row_shares(rows, load_NK, caps_K, weight_NK, inv_t_K):  # pragma: no cover - compiled
    """Per row of ``rows``: its largest share of a cap, its summed shares, its normalized weight.

    One pass instead of numpy's (P, K) gathers and temporaries (a third of dealing at 1M rows).

    Returns:
        (hard_P, size_P, norm_P): ``max_k load/cap``, ``sum_k load/cap``, ``sum_k weight * inv_t``.

    Example:
        >>> import numpy as np
        >>> load_NK = np.array([[1, 10], [4, 20]]); weight_NK = load_NK.astype(float)
        >>> [a.tolist() for a in row_shares(np.array([1, 0]), load_NK, np.array([8, 40]), weight_NK, np.array([0.5, 0.1]))]
        [[0.5, 0.25], [1.0, 0.375], [4.0, 1.5]]
    """
    P = len(rows)
    hard = np.empty(P)
    size = np.empty(P)
    norm = np.empty(P)
    for p in range(P):
        if p + ROWS_AHEAD < P:
            prefetch(load_NK, rows[p + ROWS_AHEAD] * load_NK.shape[1])
            prefetch(weight_NK, rows[p + ROWS_AHEAD] * weight_NK.shape[1])
        i = rows[p]
        h = 0.0
        s = 0.0
        for k in range(len(caps_K)):
            share = load_NK[i, k] / caps_K[k]
            s += share
            h = max(h, share)
        w = 0.0
        for k in range(len(inv_t_K)):
            w += weight_NK[i, k] * inv_t_K[k]
        hard[p] = h
        size[p] = s
        norm[p] = w
    return hard, size, norm


@njit
def _norm_order(wsum_GK, inv_t_K):  # pragma: no cover - compiled
    """(G,) normalized weight ``sum_k wsum_gk * inv_t_k`` of each group: the dealing order."""
    G, K = wsum_GK.shape
    key = np.zeros(G)
    for g in range(G):
        s = 0.0
        for k in range(K):
            s += wsum_GK[g, k] * inv_t_K[k]
        key[g] = s
    return key


@njit
def _fits(lsum_GK, g, load_NK, i, caps_K):  # pragma: no cover - compiled
    """Whether row i fits group g under every cap."""
    for k in range(len(caps_K)):
        if lsum_GK[g, k] + load_NK[i, k] > caps_K[k]:
            return False
    return True


@njit
def deal_rounds(queue, load_NK, weight_NK, caps_K, G, inv_t_K, max_stragglers):  # pragma: no cover
    """Deal ``queue`` in rounds of G, each row of a round to the next lightest group.

    Groups are ordered by normalized weight ``sum_k w_k * inv_t_k`` (stable ties); a row that
    breaks a cap gets a second chance on the unused groups with the most room in their fullest
    module, then waits for the next round. When no row of a round fits, up to
    ``max_stragglers`` left rows go one by one to the lightest group with room; the rows that
    still find none are *stranded* (group id -1): the caller places them (dealing spreads room
    evenly, so under tight caps the last rows may find only fragments of it).

    Args:
        queue: (n,) rows, biggest first.
        load_NK: (N, K) capped load of every row.
        weight_NK: (N, KW) balanced weight of every row.
        caps_K: (K,) caps per group.
        G: number of groups.
        inv_t_K: (KW,) ``1 / target`` per weight column (normalizes the groups' order).
        max_stragglers: most rows placed one by one when a round places none.

    Returns:
        (n,) group id per queue position, -1 for a stranded row.

    Example:
        >>> import numpy as np
        >>> load_NK = np.array([[6], [5], [4], [3]]); weight_NK = load_NK.astype(float)
        >>> deal_rounds(np.arange(4), load_NK, weight_NK, np.array([9]), 2, np.array([1 / 9]), 64).tolist()
        [0, 1, 1, 0]
        >>> deal_rounds(np.arange(4), load_NK, weight_NK, np.array([8]), 2, np.array([1 / 9]), 64).tolist()
        [0, 1, -1, 1]
    """
    n = len(queue)
    K = load_NK.shape[1]
    KW = weight_NK.shape[1]
    gid = np.full(n, -1, dtype=np.int64)
    wsum = np.zeros((G, KW))
    lsum = np.zeros((G, K), dtype=np.int64)
    carry = np.empty(G, dtype=np.int64)
    n_carry = 0
    chunk = np.empty(G, dtype=np.int64)
    bins = np.empty(G, dtype=np.int64)
    fits = np.zeros(G, dtype=np.bool_)
    used = np.zeros(G, dtype=np.bool_)
    fill = np.zeros(G)
    pos = 0
    while pos < n or n_carry > 0:
        take = max(0, G - n_carry)
        m = 0
        for c in range(n_carry):
            chunk[m] = carry[c]
            m += 1
        end = min(pos + take, n)
        for p in range(pos, end):
            chunk[m] = p
            m += 1
        pos = end
        order = stable_argsort(_norm_order(wsum, inv_t_K))
        n_fit = 0
        for c in range(m):
            bins[c] = order[c]
            fits[c] = _fits(lsum, bins[c], load_NK, queue[chunk[c]], caps_K)
            n_fit += fits[c]
        if n_fit < m:
            # Second chance: the unused groups with the most room in their fullest module.
            used[:] = False
            for c in range(m):
                if fits[c]:
                    used[bins[c]] = True
            n_spare = 0
            for g in range(G):
                if not used[g]:
                    f = 0.0
                    for k in range(K):
                        f = max(f, lsum[g, k] / caps_K[k])
                    fill[n_spare] = f
                    n_spare += 1
            spare_ids = np.flatnonzero(~used)
            spare = spare_ids[stable_argsort(fill[:n_spare])]
            t = 0
            for c in range(m):
                if t >= n_spare:
                    break
                if fits[c]:
                    continue
                alt = spare[t]
                t += 1
                if _fits(lsum, alt, load_NK, queue[chunk[c]], caps_K):
                    bins[c] = alt
                    fits[c] = True
                    n_fit += 1
        if n_fit == 0:
            # The lightest groups are full in some module: place a few stragglers in the
            # lightest group that still has room; the rest are stranded (the caller places them).
            for c in range(min(m + (n - pos), max_stragglers)):
                p = chunk[c] if c < m else pos + (c - m)
                i = queue[p]
                key = _norm_order(wsum, inv_t_K)
                b = -1
                for g in range(G):
                    if _fits(lsum, g, load_NK, i, caps_K) and (b < 0 or key[g] < key[b]):
                        b = g
                if b < 0:
                    continue  # stranded: gid stays -1
                gid[p] = b
                for k in range(KW):
                    wsum[b, k] += weight_NK[i, k]
                for k in range(K):
                    lsum[b, k] += load_NK[i, k]
            break
        n_carry = 0
        for c in range(m):
            p = chunk[c]
            if fits[c]:
                b = bins[c]
                i = queue[p]
                gid[p] = b
                for k in range(KW):
                    wsum[b, k] += weight_NK[i, k]
                for k in range(K):
                    lsum[b, k] += load_NK[i, k]
            else:
                carry[n_carry] = p
                n_carry += 1
    return gid
