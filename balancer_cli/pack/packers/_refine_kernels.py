"""Local-search kernels of the balanced packer: random-partner and targeted swap passes.

Both passes lower the squared objective ``sum_k ((sum_gk - target_k) / target_k)^2`` of pairs of
groups, within the caps. Compiled by the shared optional-numba decorator
(:func:`balancer_cli._jit.njit`): numba when importable, the same code as plain Python otherwise.
The callers draw all randomness (group order, partners) with numpy, so the passes are deterministic.
"""

from __future__ import annotations

import numpy as np

from balancer_cli._jit import njit
from balancer_cli.pack.packers._exchange_bounds import SLACK, column_ranges, partner_bound, row_bound, vertices
from balancer_cli.pack.packers._table_kernels import gather_rows, prefetch_group, prefetch_rows

__all__ = ["refine_pass", "targeted_pass"]

#: Groups ahead of the visited one whose data the random-partner pass prefetches, in stages that
#: each need the one before: its partner list, sums and member row; its partners'; the rows of
#: both. Partners are random groups: without it their reads wait in turn (1.2M rows: 2.4x slower).
_AHEAD_OWN = 16
_AHEAD_SUMS = 8
_AHEAD_ROWS = 4


@njit
def _penalty(sum_GK, g, target_K, inv_t2_K):  # pragma: no cover
    """Group g's objective term ``sum_k (sum_gk - target_k)^2 / target_k^2`` (times mix weights)."""
    total = 0.0
    for k in range(len(target_K)):
        d = sum_GK[g, k] - target_K[k]
        total += d * d * inv_t2_K[k]
    return total


@njit
def _pair_weights(sum_GK, g, h, inv_t2_K, e_K):  # pragma: no cover
    """Fill ``e_K`` with ``(sum_gk - sum_hk) * inv_t2_k``: the pair's part of every exchange's gain."""
    for k in range(len(e_K)):
        e_K[k] = (sum_GK[g, k] - sum_GK[h, k]) * inv_t2_K[k]


@njit
def _exchange_cost(weight_NK, code_N, i, j, e_K, inv_t2_K, K, has_sources):  # pragma: no cover
    """Half the objective change of the pair (g, h) when row i leaves g for h and j leaves h for g.

    With ``d = w_j - w_i`` the pair's objective changes by
    ``2 * sum_k d_k * ((sum_gk - sum_hk) + d_k) / t_k^2`` (the targets cancel), so one exchange
    costs K multiply-adds plus at most two source columns: a row's source is one column of ones.
    -1 for i or j means no row (a move). Negative: the exchange helps.
    """
    total = 0.0
    for k in range(K):
        d = (weight_NK[j, k] if j >= 0 else 0.0) - (weight_NK[i, k] if i >= 0 else 0.0)
        total += d * (e_K[k] + d * inv_t2_K[k])
    if has_sources:
        ci = code_N[i] + K if i >= 0 else -1
        cj = code_N[j] + K if j >= 0 else -1
        if ci != cj:
            if cj >= 0:
                total += e_K[cj] + inv_t2_K[cj]
            if ci >= 0:
                total += inv_t2_K[ci] - e_K[ci]
    return total


@njit
def _apply_exchange(sum_GK, lsum_GK, g, h, i, j, weight_NK, code_N, load_NK, K, has_sources):  # pragma: no cover
    """Update both groups' sums for row i moving g -> h and row j moving h -> g (-1: none)."""
    for k in range(K):
        dw = (weight_NK[j, k] if j >= 0 else 0.0) - (weight_NK[i, k] if i >= 0 else 0.0)
        sum_GK[g, k] += dw
        sum_GK[h, k] -= dw
    if has_sources:
        if i >= 0:
            sum_GK[g, K + code_N[i]] -= 1.0
            sum_GK[h, K + code_N[i]] += 1.0
        if j >= 0:
            sum_GK[g, K + code_N[j]] += 1.0
            sum_GK[h, K + code_N[j]] -= 1.0
    for k in range(load_NK.shape[1]):
        dl = (load_NK[j, k] if j >= 0 else 0) - (load_NK[i, k] if i >= 0 else 0)
        lsum_GK[g, k] += dl
        lsum_GK[h, k] -= dl


@njit
def refine_pass(order_G, cand_GC, members_GX, count_G, sum_GK, lsum_GK, weight_NK, code_N, load_NK, caps_K,
                target_K, inv_t2_K, tol):  # pragma: no cover
    """One pass of random-partner local search, in place.

    For each group g (in ``order_G``) that is off target, every swap of one of its samples with
    one of a candidate partner's, and every move of one sample between the two, that keeps both
    under the caps is tried; the one that most lowers the pair's
    ``sum_k ((sum_gk - target_k) / target_k)^2`` is applied.

    Args:
        order_G: (V,) the groups to visit, in order (a seeded permutation of all G or of a subset).
        cand_GC: (G, C) candidate partner groups of each group.
        members_GX: (G, X) member rows of each group, the first ``count_G[g]`` valid.
        count_G: (G,) members per group; a group keeps 1 to X members.
        sum_GK: (G, K + O) balanced sums per group: K weight columns, then O per-source sample
            counts (O may be 0).
        lsum_GK: (G, KL) load sums per group, checked against ``caps_K``.
        weight_NK: (N, K) balanced weight of each row.
        code_N: (N,) source column (0 .. O-1) of each row; ignored (any length) when O is 0.
        load_NK: (N, KL) capped load of each row.
        caps_K: (KL,) caps of the load columns.
        target_K: (K + O,) per-group target of each ``sum_GK`` column.
        inv_t2_K: (K + O,) weight of each squared term (``1 / target^2``, times a mix weight).
        tol: groups whose objective term is at most this are left alone.

    Returns:
        The number of swaps and moves applied.

    Example:
        Two groups of sums 7 and 1 (target 4): one swap evens them out.

        >>> import numpy as np
        >>> members_GX = np.array([[0, 1], [2, 3]]); count_G = np.array([2, 2])
        >>> weight_NK = np.array([[4.0], [3.0], [1.0], [0.0]]); sum_GK = np.array([[7.0], [1.0]])
        >>> refine_pass(np.arange(2), np.array([[1], [0]]), members_GX, count_G, sum_GK, sum_GK.astype(np.int64),
        ...             weight_NK, np.zeros(0, np.int64), weight_NK.astype(np.int64), np.array([9]),
        ...             np.array([4.0]), np.array([1 / 16]), 1e-12)
        1
        >>> sum_GK.ravel().tolist(), members_GX.tolist()
        ([4.0, 4.0], [[1, 2], [3, 0]])
    """
    G, X = members_GX.shape
    K = weight_NK.shape[1]
    KS = sum_GK.shape[1]
    O = KS - K
    C = cand_GC.shape[1]
    KL = load_NK.shape[1]
    e = np.zeros(KS)
    # Per source column: the cost of the pair's g gaining one row of it (gain_O) and losing one
    # (lose_O); index O stands for "no row", so exchanges need no branch on it.
    gain_O = np.zeros(O + 1)
    lose_O = np.zeros(O + 1)
    # Both groups' rows copied side by side (row X: "no row", zeros): the (ng + 1) x (nh + 1)
    # exchanges then read small local tables, branch-free (1.6x faster than reading the row tables).
    wg = np.zeros((X + 1, K))
    lg = np.zeros((X + 1, KL), np.int64)
    cg = np.full(X + 1, O, np.int64)
    wh = np.zeros((X + 1, K))
    lh = np.zeros((X + 1, KL), np.int64)
    ch = np.full(X + 1, O, np.int64)
    room_g = np.zeros(KL, np.int64)
    room_h = np.zeros(KL, np.int64)
    glo, ghi, hlo, hhi = np.zeros(K), np.zeros(K), np.zeros(K), np.zeros(K)  # the rows' weight ranges
    vertex_K = np.zeros(K)  # where each module's term of the pair is lowest (the bounds')
    changes = 0
    V = len(order_G)  # the groups visited: all G, or a subset (the polish's one micro-batch)
    for idx in range(V):
        if idx + _AHEAD_OWN < V:
            prefetch_group(order_G[idx + _AHEAD_OWN], cand_GC, members_GX, count_G, sum_GK, lsum_GK, True)
        if idx + _AHEAD_SUMS < V:
            prefetch_group(order_G[idx + _AHEAD_SUMS], cand_GC, members_GX, count_G, sum_GK, lsum_GK, False)
        if idx + _AHEAD_ROWS < V:
            prefetch_rows(order_G[idx + _AHEAD_ROWS], cand_GC, members_GX, count_G, weight_NK, load_NK, code_N)
        g = order_G[idx]
        if _penalty(sum_GK, g, target_K, inv_t2_K) <= tol:
            continue
        best = -5e-16  # an exchange must lower the objective by more than rounding
        best_h = -1
        best_a = -1
        best_b = -1  # a, b: positions in g and h; -1 means "nothing" (a move)
        ng = count_G[g]
        gather_rows(members_GX, g, ng, weight_NK, load_NK, code_N, O, wg, lg, cg)
        column_ranges(wg, ng, glo, ghi)
        for k in range(KL):
            room_g[k] = caps_K[k] - lsum_GK[g, k]
        for c in range(C):
            h = cand_GC[g, c]
            if h == g:
                continue
            nh = count_G[h]
            gather_rows(members_GX, h, nh, weight_NK, load_NK, code_N, O, wh, lh, ch)
            for k in range(KL):
                room_h[k] = caps_K[k] - lsum_GK[h, k]
            # With d = w_j - w_i the pair's objective changes by 2 * sum_k d_k (s_gk - s_hk + d_k) / t_k^2
            # (the targets cancel); a source column changes by +-1 only where i and j differ.
            for k in range(KS):
                e[k] = (sum_GK[g, k] - sum_GK[h, k]) * inv_t2_K[k]
            gain_low = 0.0
            lose_low = 0.0
            for o in range(O):
                gain_O[o] = e[K + o] + inv_t2_K[K + o]
                lose_O[o] = inv_t2_K[K + o] - e[K + o]
                gain_low = min(gain_low, gain_O[o])
                lose_low = min(lose_low, lose_O[o])
            # No exchange with h can beat the best so far: skip it (exact, _exchange_bounds).
            column_ranges(wh, nh, hlo, hhi)
            vertices(e, inv_t2_K, vertex_K)
            bound = partner_bound(vertex_K, e, inv_t2_K, glo, ghi, hlo, hhi, gain_low + lose_low)
            if bound - SLACK * abs(bound) >= best:
                continue
            # The first two modules' terms spelled out (20% of a pass), added in module order.
            e0 = e[0]
            i0 = inv_t2_K[0]
            e1 = e[1] if K > 1 else 0.0
            i1 = inv_t2_K[1] if K > 1 else 0.0
            for a in range(ng + 1):
                out_g = 1 if a < ng else 0
                wa0 = wg[a, 0]
                wa1 = wg[a, 1] if K > 1 else 0.0
                ci = cg[a]
                lose = lose_O[ci]
                bound = row_bound(vertex_K, e, inv_t2_K, wg, a, hlo, hhi, gain_low + min(0.0, lose))
                if bound - SLACK * abs(bound) >= best:
                    continue
                for b in range(nh + 1):
                    d = wh[b, 0] - wa0
                    cost = 0.0
                    cost += d * (e0 + d * i0)
                    if K > 1:
                        d = wh[b, 1] - wa1
                        cost += d * (e1 + d * i1)
                    for k in range(2, K):
                        d = wh[b, k] - wg[a, k]
                        cost += d * (e[k] + d * inv_t2_K[k])
                    cj = ch[b]
                    cost += (gain_O[cj] + lose) * (ci != cj)
                    # Few exchanges beat the best so far: only those are checked against the caps
                    # and sizes (checking every one first was 20% of a pass).
                    if not cost < best:
                        continue
                    out_h = 1 if b < nh else 0
                    # sizes after the exchange must stay in [1, X] (the member table's width)
                    new_ng = ng - out_g + out_h
                    new_nh = nh - out_h + out_g
                    ok = (new_ng >= 1) & (new_nh >= 1) & (new_ng <= X) & (new_nh <= X)
                    for k in range(KL):
                        dl = lh[b, k] - lg[a, k]
                        ok = ok & (dl <= room_g[k]) & (-dl <= room_h[k])
                    if ok:
                        best = cost
                        best_h = h
                        best_a = a if a < ng else -1
                        best_b = b if b < nh else -1
        if best_h < 0:
            continue
        h = best_h
        i = members_GX[g, best_a] if best_a >= 0 else -1
        j = members_GX[h, best_b] if best_b >= 0 else -1
        _apply_exchange(sum_GK, lsum_GK, g, h, i, j, weight_NK, code_N, load_NK, K, O > 0)
        # remove i from g / j from h (swap with the last member), then append the other.
        if best_a >= 0:
            count_G[g] -= 1
            members_GX[g, best_a] = members_GX[g, count_G[g]]
        if best_b >= 0:
            count_G[h] -= 1
            members_GX[h, best_b] = members_GX[h, count_G[h]]
        if j >= 0:
            members_GX[g, count_G[g]] = j
            count_G[g] += 1
        if i >= 0:
            members_GX[h, count_G[h]] = i
            count_G[h] += 1
        changes += 1
    return changes


@njit
def targeted_pass(order_G, members_GX, count_G, group_of_N, pos_N, sum_GK, lsum_GK, weight_NK, code_N, load_NK,
                  caps_K, target_K, inv_t_K, inv_t2_K, cell_keys, cell_start, cell_rows, width, dims_K, scan,
                  tol):  # pragma: no cover
    """One pass of targeted swaps, in place.

    For each off-target group g and member i, the samples j whose normalized weight is near
    ``w_i - t * dev_g`` (t = 1/2 and 1) are looked up in a grid of normalized weights (``scan``
    of them per cell), and the swap i <-> j that most lowers the pair's objective within the caps
    is applied.

    Args:
        order_G, members_GX, count_G, sum_GK, lsum_GK, weight_NK, code_N, load_NK, caps_K, target_K,
            inv_t2_K, tol: as in :func:`refine_pass`.
        group_of_N: (N,) group of each packed row (-1 for rows not packed), updated.
        pos_N: (N,) position of each packed row in its group's member row, updated.
        inv_t_K: (K,) ``1 / target``: normalizes weights for the grid lookup.
        cell_keys: the grid's occupied cells, ascending, where ``cell_start`` covers only them
            (a sparse grid: one offset more than keys, none for a grid of no rows); empty where it
            covers every cell (:func:`~balancer_cli.pack.packers._table_kernels.grid_cells`).
        cell_start: offsets of each cell's rows in ``cell_rows`` (cells + 1, or occupied cells + 1).
        cell_rows: rows bucketed by cell, ``floor(w * inv_t / width)`` per module (row-major).
        width: grid cell size, as a share of a group's target.
        dims_K: cells per module of the grid (its first ``len(dims_K)`` weight columns).
        scan: most rows tried per cell lookup.

    Returns:
        The number of swaps applied.

    Example:
        Group 0 (sum 7, target 4) looks up a row of weight 4 - 3 = 1 in the grid (cells of a
        quarter target): row 2 of group 1, and swaps it for its row 0.

        >>> import numpy as np
        >>> members_GX = np.array([[0, 1], [2, 3]]); group_of_N = np.array([0, 0, 1, 1]); pos_N = np.array([0, 1, 0, 1])
        >>> weight_NK = np.array([[4.0], [3.0], [1.0], [0.0]]); sum_GK = np.array([[7.0], [1.0]])
        >>> grid = (np.zeros(0, np.int64), np.array([0, 1, 2, 2, 3, 4]), np.array([3, 2, 1, 0]), 0.25, np.array([5]))
        >>> targeted_pass(np.arange(2), members_GX, np.array([2, 2]), group_of_N, pos_N, sum_GK,
        ...               sum_GK.astype(np.int64), weight_NK, np.zeros(0, np.int64), weight_NK.astype(np.int64), np.array([9]),
        ...               np.array([4.0]), np.array([0.25]), np.array([1 / 16]), *grid, 8, 1e-12)
        1
        >>> sum_GK.ravel().tolist(), members_GX.tolist(), group_of_N.tolist()
        ([4.0, 4.0], [[2, 1], [0, 3]], [1, 0, 0, 1])
    """
    G = members_GX.shape[0]
    K = weight_NK.shape[1]
    has_sources = sum_GK.shape[1] > K
    KL = load_NK.shape[1]
    KG = len(dims_K)
    e = np.zeros(sum_GK.shape[1])
    changes = 0
    for idx in range(G):
        g = order_G[idx]
        if _penalty(sum_GK, g, target_K, inv_t2_K) <= tol:
            continue
        best = -5e-16
        best_i = -1
        best_j = -1
        for a in range(count_G[g]):
            i = members_GX[g, a]
            for half in range(2):
                t = 0.5 if half == 0 else 1.0
                cell = 0
                inside = True
                for k in range(KG):
                    u = (weight_NK[i, k] - t * (sum_GK[g, k] - target_K[k])) * inv_t_K[k]
                    c = int(np.floor(u / width)) if u >= 0 else -1
                    if c < 0 or c >= dims_K[k]:
                        inside = False
                        break
                    cell = cell * dims_K[k] + c
                if not inside:
                    continue
                if len(cell_start) != len(cell_keys) + 1:  # dense: offsets for every cell, none listed
                    lo = cell_start[cell]
                    hi = cell_start[cell + 1]
                else:  # sparse: an unoccupied cell has no rows
                    u = np.searchsorted(cell_keys, cell)
                    if u == len(cell_keys) or cell_keys[u] != cell:
                        continue
                    lo = cell_start[u]
                    hi = cell_start[u + 1]
                n = hi - lo
                if n == 0:
                    continue
                off = (i * 2654435761 + idx) % n
                for s in range(min(scan, n)):
                    j = cell_rows[lo + (off + s) % n]
                    h = group_of_N[j]
                    if h < 0 or h == g:
                        continue
                    ok = True
                    for k in range(KL):
                        dl = load_NK[j, k] - load_NK[i, k]
                        if lsum_GK[g, k] + dl > caps_K[k] or lsum_GK[h, k] - dl > caps_K[k]:
                            ok = False
                            break
                    if not ok:
                        continue
                    _pair_weights(sum_GK, g, h, inv_t2_K, e)
                    cost = _exchange_cost(weight_NK, code_N, i, j, e, inv_t2_K, K, has_sources)
                    if cost < best:
                        best = cost
                        best_i = i
                        best_j = j
        if best_i < 0:
            continue
        i = best_i
        j = best_j
        h = group_of_N[j]
        _apply_exchange(sum_GK, lsum_GK, g, h, i, j, weight_NK, code_N, load_NK, K, has_sources)
        pi = pos_N[i]
        pj = pos_N[j]
        members_GX[g, pi] = j
        members_GX[h, pj] = i
        group_of_N[j] = g
        pos_N[j] = pi
        group_of_N[i] = h
        pos_N[i] = pj
        changes += 1
    return changes

