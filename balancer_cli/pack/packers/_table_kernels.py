"""Compiled kernels that build and move the balanced packer's per-group tables.

The packer keeps its groups as a (G, X) member table (-1 padded) with per-group sums; these
kernels build it from dealt rows, renumber its rows for the refinement and back, and take the
suffix minimum first fit needs. Each is one pass over the rows where numpy would gather, sort
and allocate (G, X) and (P, K) temporaries; rows come in random order, so each prefetches the
rows it reads a few iterations ahead (:func:`balancer_cli._jit.prefetch`). Results are what the
numpy versions give, sums included (added in the same order).
"""

from __future__ import annotations

import numpy as np

from balancer_cli._jit import njit, prefetch

__all__ = ["group_tables", "load_sums", "suffix_min", "compact_rows", "expand_rows", "grid_cells", "gather_rows",
           "prefetch_group", "prefetch_rows", "ROWS_AHEAD"]

#: Rows ahead whose table rows the kernels that gather rows in random order prefetch (here and
#: in :mod:`~balancer_cli.pack.packers._fill_kernels`); groups ahead for the compaction.
ROWS_AHEAD = 16
_AHEAD_GROUPS = 4


@njit
def group_tables(queue, gid, G, width, weight_NK, load_NK):  # pragma: no cover - compiled
    """The member table, counts and sums of groups given by a group id per row.

    Args:
        queue: (P,) rows; a group lists its rows in this order.
        gid: (P,) group id (0 .. G-1) of each row of ``queue``.
        G: number of groups.
        width: the table has at least this many columns (more if a group holds more rows).
        weight_NK: (N, KW) balanced weight of every row.
        load_NK: (N, KL) integer load of every row.

    Returns:
        (members_GX, count_G, wsum_GK, lsum_GK): member rows (int64, -1 padded), rows per
        group, weight sums (float64) and load sums (int64) per group.

    Example:
        >>> import numpy as np
        >>> w = np.array([[1.0], [2.0], [4.0]])
        >>> m, c, ws, ls = group_tables(np.array([2, 0, 1]), np.array([1, 0, 1]), 2, 2, w, w.astype(np.int64))
        >>> m.tolist(), c.tolist(), ws.ravel().tolist(), ls.ravel().tolist()
        ([[0, -1], [2, 1]], [1, 2], [1.0, 6.0], [1, 6])
    """
    P = len(queue)
    KW = weight_NK.shape[1]
    KL = load_NK.shape[1]
    count = np.zeros(G, np.int64)
    for p in range(P):
        count[gid[p]] += 1
    X = width
    for g in range(G):
        X = max(X, count[g])
    members = np.full((G, X), -1, np.int64)
    wsum = np.zeros((G, KW))
    lsum = np.zeros((G, KL), np.int64)
    fill = np.zeros(G, np.int64)
    for p in range(P):
        if p + ROWS_AHEAD < P:
            prefetch(weight_NK, queue[p + ROWS_AHEAD] * KW)
            prefetch(load_NK, queue[p + ROWS_AHEAD] * KL)
        g = gid[p]
        i = queue[p]
        members[g, fill[g]] = i
        fill[g] += 1
        for k in range(KW):
            wsum[g, k] += weight_NK[i, k]
        for k in range(KL):
            lsum[g, k] += load_NK[i, k]
    return members, count, wsum, lsum


@njit
def load_sums(gid, rows, load_NK, G):  # pragma: no cover - compiled
    """(G, KL) int64 load sums of ``rows`` by their group id ``gid``.

    Example:
        >>> import numpy as np
        >>> load_sums(np.array([1, 0, 1]), np.array([0, 1, 2]), np.array([[3], [5], [7]]), 2).ravel().tolist()
        [5, 10]
    """
    KL = load_NK.shape[1]
    lsum = np.zeros((G, KL), np.int64)
    for p in range(len(rows)):
        if p + ROWS_AHEAD < len(rows):
            prefetch(load_NK, rows[p + ROWS_AHEAD] * KL)
        for k in range(KL):
            lsum[gid[p], k] += load_NK[rows[p], k]
    return lsum


@njit
def suffix_min(rows, load_NK):  # pragma: no cover - compiled
    """(P, K) per-module minimum load of ``rows[p:]``: what every row still to come needs at least.

    numpy's ``minimum.accumulate`` over a reversed (P, K) gather is strided: it was a third of
    dealing at 1.2M rows.

    Example:
        >>> import numpy as np
        >>> suffix_min(np.array([2, 0, 1]), np.array([[5, 1], [3, 4], [4, 2]])).tolist()
        [[3, 1], [3, 1], [3, 4]]
    """
    P = len(rows)
    K = load_NK.shape[1]
    out = np.empty((P, K), dtype=load_NK.dtype)
    for p in range(P - 1, -1, -1):
        if p >= ROWS_AHEAD:
            prefetch(load_NK, rows[p - ROWS_AHEAD] * K)
        i = rows[p]
        for k in range(K):
            v = load_NK[i, k]
            out[p, k] = v if p == P - 1 or v < out[p + 1, k] else out[p + 1, k]
    return out


@njit
def compact_rows(members_GX, count_G, weight_NK, load_NK, source_N, order_G):  # pragma: no cover
    """The groups' rows renumbered in group order (group ``order_G[0]``'s first), with compact
    copies of their tables: the passes then read a group's rows as neighbours in memory.

    Args:
        members_GX: (G, X) member rows of each group, the first ``count_G[g]`` valid.
        count_G: (G,) members per group.
        weight_NK: (N, K) balanced weight of every row.
        load_NK: (N, KL) load of every row.
        source_N: (N,) source of every row, or an empty array (none).
        order_G: (G,) the groups in their new numbering: new group n is group ``order_G[n]``.

    Returns:
        (rows_F, local_GX, weight_FK, load_FK, source_F): the original row of each new number;
        the member table of the new groups in new row numbers (int32, -1 padded); the rows'
        weights, loads and sources (empty without sources).

    Example:
        >>> import numpy as np
        >>> w = np.array([[1.0], [2.0], [3.0]])
        >>> rows, local, wf, lf, sf = compact_rows(np.array([[2, -1], [0, 1]]), np.array([1, 2]), w,
        ...                                        w.astype(np.int64), np.zeros(0, np.int8), np.array([1, 0]))
        >>> rows.tolist(), local.tolist(), wf.ravel().tolist()
        ([0, 1, 2], [[0, 1], [2, -1]], [1.0, 2.0, 3.0])
    """
    G, X = members_GX.shape
    K = weight_NK.shape[1]
    KL = load_NK.shape[1]
    F = 0
    for g in range(G):
        F += count_G[g]
    rows_F = np.empty(F, np.int64)
    local_GX = np.full((G, X), -1, np.int32)
    weight_FK = np.empty((F, K))
    load_FK = np.empty((F, KL), load_NK.dtype)
    source_F = np.empty(F if len(source_N) > 0 else 0, source_N.dtype)
    f = 0
    for n in range(G):
        # Two stages: the member row of a group further ahead (a random group: its own miss), then
        # the rows of the group ahead, which are in dealing order: random rows of the tables and
        # sources (10M in windows of 1.25M rows: 134 -> 93 ms a window).
        if n + 2 * _AHEAD_GROUPS < G:
            far = order_G[n + 2 * _AHEAD_GROUPS]
            prefetch(count_G, far)
            prefetch(members_GX, far * X)
            prefetch(members_GX, far * X + X - 1)
        if n + _AHEAD_GROUPS < G:
            ahead = order_G[n + _AHEAD_GROUPS]
            for a in range(count_G[ahead]):
                i = members_GX[ahead, a]
                prefetch(weight_NK, i * K)
                prefetch(load_NK, i * KL)
                if len(source_F) > 0:
                    prefetch(source_N, i)
        g = order_G[n]
        for a in range(count_G[g]):
            i = members_GX[g, a]
            rows_F[f] = i
            local_GX[n, a] = f
            for k in range(K):
                weight_FK[f, k] = weight_NK[i, k]
            for k in range(KL):
                load_FK[f, k] = load_NK[i, k]
            if len(source_F) > 0:
                source_F[f] = source_N[i]
            f += 1
    return rows_F, local_GX, weight_FK, load_FK, source_F


@njit
def expand_rows(local_GX, count_G, rows_F, members_GX, order_G):  # pragma: no cover
    """Write the member table back in original groups and rows: ``members_GX[order_G[n], a] =
    rows_F[local_GX[n, a]]`` for the first ``count_G[n]`` members of new group n, -1 after them.

    Example:
        >>> import numpy as np
        >>> members = np.zeros((2, 2), np.int64)
        >>> expand_rows(np.array([[1, 0], [2, 7]], np.int32), np.array([2, 1]), np.array([5, 6, 9]), members,
        ...             np.array([1, 0]))
        >>> members.tolist()
        [[9, -1], [6, 5]]
    """
    G, X = local_GX.shape
    for n in range(G):
        g = order_G[n]
        for a in range(X):
            members_GX[g, a] = rows_F[local_GX[n, a]] if a < count_G[n] else -1


@njit
def grid_cells(weight_FK, inv_t_K, width, dims_K, sparse):  # pragma: no cover - compiled
    """Rows bucketed by normalized weight: cell ``floor(w_k * inv_t_k / width)`` per module (at
    most ``dims_k - 1``), cells numbered row-major.

    Dense (``sparse`` false), the offsets cover every cell of the grid: a counting sort, one pass
    where numpy's stable argsort of the cells took half of it (770k rows: ~40 ms), and a lookup
    is one read. Sparse, they cover only the occupied cells, listed in ``keys_U`` (a lookup
    searches them): a grid of many more cells than rows (three modules of 12k rows: ~1M cells,
    2 ms to clear and sum, a table of 8 MB read at random) costs what its rows do. Both give
    every cell the same rows in the same order.

    Returns:
        (keys_U, cell_start, order_F): the occupied cells in ascending order (sparse; empty when
        dense); the offsets of each cell's rows in ``order_F`` (cells + 1, or U + 1); the rows by
        cell, ascending within a cell.

    Example:
        >>> import numpy as np
        >>> weight = np.array([[3.0], [0.5], [2.0], [3.2]])
        >>> keys, start, order = grid_cells(weight, np.array([0.5]), 0.5, np.array([4]), False)
        >>> keys.tolist(), start.tolist(), order.tolist()
        ([], [0, 1, 1, 2, 4], [1, 2, 0, 3])
        >>> keys, start, order = grid_cells(weight, np.array([0.5]), 0.5, np.array([4]), True)
        >>> keys.tolist(), start.tolist(), order.tolist()
        ([0, 2, 3], [0, 1, 2, 4], [1, 2, 0, 3])
    """
    F, K = weight_FK.shape
    cells = 1
    for k in range(K):
        cells *= dims_K[k]
    cell_F = np.empty(F, np.int64)
    cell_start = np.zeros(1 if sparse else cells + 1, np.int64)  # dense: counted as the cells are found
    for f in range(F):
        c = 0
        for k in range(K):
            ck = min(int(np.floor(weight_FK[f, k] * inv_t_K[k] / width)), dims_K[k] - 1)
            if ck < 0:
                raise ValueError("negative weights have no grid cell")
            c = c * dims_K[k] + ck
        cell_F[f] = c
        if not sparse:
            cell_start[c + 1] += 1
    order_F = np.empty(F, np.int64)
    if sparse:
        # (cell, row) words sorted: the rows by cell, ascending within a cell (rows < 2^bits)
        bits = 1
        while (1 << bits) < F:
            bits += 1
        word = np.empty(F, np.int64)
        for f in range(F):
            word[f] = (cell_F[f] << bits) | f
        word.sort()
        keys = np.empty(F, np.int64)
        cell_start = np.empty(F + 1, np.int64)
        used = 0
        for i in range(F):
            order_F[i] = word[i] & ((1 << bits) - 1)
            c = word[i] >> bits
            if used == 0 or keys[used - 1] != c:
                keys[used] = c
                cell_start[used] = i
                used += 1
        cell_start[used] = F
        return keys[:used].copy(), cell_start[:used + 1].copy(), order_F
    for c in range(cells):
        cell_start[c + 1] += cell_start[c]
    fill = cell_start[:cells].copy()
    for f in range(F):
        order_F[fill[cell_F[f]]] = f
        fill[cell_F[f]] += 1
    return np.zeros(0, np.int64), cell_start, order_F


@njit
def gather_rows(members_GX, g, n, weight_NK, load_NK, code_N, O, w_XK, l_XK, c_X):  # pragma: no cover - compiled
    """Copy group g's n rows' weights, loads and source columns into rows 0 .. n-1 of the local
    tables, and "no row" (zeros, source column O) into row n: the refinement then reads a pair's
    rows from small tables side by side, branch-free."""
    for a in range(n):
        i = members_GX[g, a]
        for k in range(w_XK.shape[1]):
            w_XK[a, k] = weight_NK[i, k]
        for k in range(l_XK.shape[1]):
            l_XK[a, k] = load_NK[i, k]
        c_X[a] = code_N[i] if O > 0 else O
    for k in range(w_XK.shape[1]):
        w_XK[n, k] = 0.0
    for k in range(l_XK.shape[1]):
        l_XK[n, k] = 0
    c_X[n] = O


@njit
def prefetch_group(g, cand_GC, members_GX, count_G, sum_GK, lsum_GK, own):  # pragma: no cover
    """Prefetch group g's partner list, sums, count and member row (``own``), else its partners'."""
    C = cand_GC.shape[1]
    if own:
        prefetch(cand_GC, g * C)
    for c in range(1 if own else C):
        h = g if own else cand_GC[g, c]
        prefetch(sum_GK, h * sum_GK.shape[1])
        prefetch(lsum_GK, h * lsum_GK.shape[1])
        prefetch(count_G, h)
        prefetch(members_GX, h * members_GX.shape[1])


@njit
def prefetch_rows(g, cand_GC, members_GX, count_G, weight_NK, load_NK, code_N):  # pragma: no cover
    """Prefetch the weights, loads and sources of group g's and its partners' members."""
    for c in range(-1, cand_GC.shape[1]):
        h = g if c < 0 else cand_GC[g, c]
        for a in range(count_G[h]):
            i = members_GX[h, a]
            prefetch(weight_NK, i * weight_NK.shape[1])
            prefetch(load_NK, i * load_NK.shape[1])
            if len(code_N) > 0:
                prefetch(code_N, i)
