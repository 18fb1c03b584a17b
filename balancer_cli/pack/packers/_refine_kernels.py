"""Local-search kernels of the balanced packer: random-partner and targeted swap passes.

Both passes lower the squared objective ``sum_k ((sum_gk - target_k) / target_k)^2`` of pairs of
groups, within the caps. Compiled by the shared optional-numba decorator
(:func:`balancer_cli._jit.njit`): numba when importable, the same code as plain Python otherwise.
The callers draw all randomness (group order, partners) with numpy, so the passes are deterministic.
"""

from __future__ import annotations

import numpy as np

from balancer_cli._jit import njit

__all__ = ["refine_pass", "targeted_pass"]


@njit
def _penalty(sum_GK, g, delta_K, sign, target_K, inv_t2_K):  # pragma: no cover
    """Group g's objective term after adding ``sign * delta_K`` to its sums."""
    total = 0.0
    for k in range(len(target_K)):
        d = sum_GK[g, k] + sign * delta_K[k] - target_K[k]
        total += d * d * inv_t2_K[k]
    return total


@njit
def refine_pass(order_G, cand_GC, members_GX, count_G, sum_GK, lsum_GK, weight_NK, load_NK, caps_K,
                target_K, inv_t2_K, tol):  # pragma: no cover
    """One pass of random-partner local search, in place.

    For each group g (in ``order_G``) that is off target, every swap of one of its samples with
    one of a candidate partner's, and every move of one sample between the two, that keeps both
    under the caps is tried; the one that most lowers the pair's
    ``sum_k ((sum_gk - target_k) / target_k)^2`` is applied.

    Args:
        order_G: (G,) the order groups are visited in (a seeded permutation).
        cand_GC: (G, C) candidate partner groups of each group.
        members_GX: (G, X) member rows of each group, the first ``count_G[g]`` valid.
        count_G: (G,) members per group; a group keeps 1 to X members.
        sum_GK: (G, K) balanced sums per group; may have more columns than ``load_NK``
            (balance-only terms, e.g. per-source counts).
        lsum_GK: (G, KL) load sums per group, checked against ``caps_K``.
        weight_NK: (N, K) balanced weight of each row (the columns of ``sum_GK``).
        load_NK: (N, KL) capped load of each row.
        caps_K: (KL,) caps of the load columns.
        target_K: (K,) per-group target of each ``sum_GK`` column.
        inv_t2_K: (K,) weight of each squared term (``1 / target^2``, times a mix weight).
        tol: groups whose objective term is at most this are left alone.

    Returns:
        The number of swaps and moves applied.

    Example:
        Two groups of sums 7 and 1 (target 4): one swap evens them out.

        >>> import numpy as np
        >>> members_GX = np.array([[0, 1], [2, 3]]); count_G = np.array([2, 2])
        >>> weight_NK = np.array([[4.0], [3.0], [1.0], [0.0]]); sum_GK = np.array([[7.0], [1.0]])
        >>> refine_pass(np.arange(2), np.array([[1], [0]]), members_GX, count_G, sum_GK, sum_GK.astype(np.int64),
        ...             weight_NK, weight_NK.astype(np.int64), np.array([9]), np.array([4.0]), np.array([1 / 16]),
        ...             1e-12)
        1
        >>> sum_GK.ravel().tolist(), members_GX.tolist()
        ([4.0, 4.0], [[1, 2], [3, 0]])
    """
    G, X = members_GX.shape
    K = len(target_K)
    C = cand_GC.shape[1]
    KL = load_NK.shape[1]
    zero = np.zeros(K)
    delta = np.zeros(K)
    changes = 0
    for idx in range(G):
        g = order_G[idx]
        fg = _penalty(sum_GK, g, zero, 0.0, target_K, inv_t2_K)
        if fg <= tol:
            continue
        best_gain = 1e-15
        best_h = -1
        best_a = -1
        best_b = -1  # a, b: positions in g and h; -1 means "nothing" (a move)
        for c in range(C):
            h = cand_GC[g, c]
            if h == g:
                continue
            fh = _penalty(sum_GK, h, zero, 0.0, target_K, inv_t2_K)
            base = fg + fh
            ng = count_G[g]
            nh = count_G[h]
            for a in range(-1, ng):
                i = members_GX[g, a] if a >= 0 else -1
                for b in range(-1, nh):
                    if a < 0 and b < 0:
                        continue
                    j = members_GX[h, b] if b >= 0 else -1
                    # sizes after the exchange must stay in [1, X] (the member table's width)
                    new_ng = ng - (a >= 0) + (b >= 0)
                    new_nh = nh - (b >= 0) + (a >= 0)
                    if new_ng < 1 or new_nh < 1 or new_ng > X or new_nh > X:
                        continue
                    ok = True
                    for k in range(KL):
                        dl = (load_NK[j, k] if j >= 0 else 0) - (load_NK[i, k] if i >= 0 else 0)
                        if lsum_GK[g, k] + dl > caps_K[k] or lsum_GK[h, k] - dl > caps_K[k]:
                            ok = False
                            break
                    if not ok:
                        continue
                    for k in range(K):
                        delta[k] = (weight_NK[j, k] if j >= 0 else 0.0) - (weight_NK[i, k] if i >= 0 else 0.0)
                    gain = base - _penalty(sum_GK, g, delta, 1.0, target_K, inv_t2_K) - _penalty(
                        sum_GK, h, delta, -1.0, target_K, inv_t2_K)
                    if gain > best_gain:
                        best_gain = gain
                        best_h = h
                        best_a = a
                        best_b = b
        if best_h < 0:
            continue
        h = best_h
        i = members_GX[g, best_a] if best_a >= 0 else -1
        j = members_GX[h, best_b] if best_b >= 0 else -1
        for k in range(K):
            dw = (weight_NK[j, k] if j >= 0 else 0.0) - (weight_NK[i, k] if i >= 0 else 0.0)
            sum_GK[g, k] += dw
            sum_GK[h, k] -= dw
        for k in range(KL):
            dl = (load_NK[j, k] if j >= 0 else 0) - (load_NK[i, k] if i >= 0 else 0)
            lsum_GK[g, k] += dl
            lsum_GK[h, k] -= dl
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
def targeted_pass(order_G, members_GX, count_G, group_of_N, pos_N, sum_GK, lsum_GK, weight_NK, load_NK,
                  caps_K, target_K, inv_t_K, inv_t2_K, cell_of_N, cell_start, cell_rows, width, dims_K, scan,
                  tol):  # pragma: no cover
    """One pass of targeted swaps, in place.

    For each off-target group g and member i, the samples j whose normalized weight is near
    ``w_i - t * dev_g`` (t = 1/2 and 1) are looked up in a grid of normalized weights (``scan``
    of them per cell), and the swap i <-> j that most lowers the pair's objective within the caps
    is applied.

    Args:
        order_G, members_GX, count_G, sum_GK, lsum_GK, weight_NK, load_NK, caps_K, target_K,
            inv_t2_K, tol: as in :func:`refine_pass`.
        group_of_N: (N,) group of each packed row (-1 for rows not packed), updated.
        pos_N: (N,) position of each packed row in its group's member row, updated.
        inv_t_K: (K,) ``1 / target``: normalizes weights for the grid lookup.
        cell_of_N: (N,) grid cell of each row (-1 for rows not packed).
        cell_start: (cells + 1,) offsets of each cell's rows in ``cell_rows``.
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
        >>> grid = (np.array([4, 3, 1, 0]), np.array([0, 1, 2, 2, 3, 4]), np.array([3, 2, 1, 0]), 0.25, np.array([5]))
        >>> targeted_pass(np.arange(2), members_GX, np.array([2, 2]), group_of_N, pos_N, sum_GK,
        ...               sum_GK.astype(np.int64), weight_NK, weight_NK.astype(np.int64), np.array([9]),
        ...               np.array([4.0]), np.array([0.25]), np.array([1 / 16]), *grid, 8, 1e-12)
        1
        >>> sum_GK.ravel().tolist(), members_GX.tolist(), group_of_N.tolist()
        ([4.0, 4.0], [[2, 1], [0, 3]], [1, 0, 0, 1])
    """
    G = members_GX.shape[0]
    K = len(target_K)
    KL = load_NK.shape[1]
    KG = len(dims_K)
    zero = np.zeros(K)
    delta = np.zeros(K)
    changes = 0
    for idx in range(G):
        g = order_G[idx]
        fg = _penalty(sum_GK, g, zero, 0.0, target_K, inv_t2_K)
        if fg <= tol:
            continue
        best_gain = 1e-15
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
                lo = cell_start[cell]
                hi = cell_start[cell + 1]
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
                    for k in range(K):
                        delta[k] = weight_NK[j, k] - weight_NK[i, k]
                    fh = _penalty(sum_GK, h, zero, 0.0, target_K, inv_t2_K)
                    gain = fg + fh - _penalty(sum_GK, g, delta, 1.0, target_K, inv_t2_K) - _penalty(
                        sum_GK, h, delta, -1.0, target_K, inv_t2_K)
                    if gain > best_gain:
                        best_gain = gain
                        best_i = i
                        best_j = j
        if best_i < 0:
            continue
        i = best_i
        j = best_j
        h = group_of_N[j]
        for k in range(K):
            dw = weight_NK[j, k] - weight_NK[i, k]
            sum_GK[g, k] += dw
            sum_GK[h, k] -= dw
        for k in range(KL):
            dl = load_NK[j, k] - load_NK[i, k]
            lsum_GK[g, k] += dl
            lsum_GK[h, k] -= dl
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
