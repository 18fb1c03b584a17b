"""Groups for a binding module of few discrete sizes, from cutting-stock patterns.

Where one module's cap decides the group count and its loads take few values (tiles of images of
a few fixed sizes, one to three clips a sample), dealing and first fit leave part of many groups'
cap empty: ``harsh`` 645 (tiles 2 and 5-9 under a cap of 18) took 9,042 groups, first fit
decreasing's best, where groups of exactly 18 tiles need 8,698, its lower bound. Which multisets
of sizes fill the cap (patterns), and how many groups of each, is the cutting-stock problem
(Gilmore and Gomory, 1961). Its LP relaxation over the maximal patterns p,
``min sum_p x_p  s.t.  sum_p a_sp x_p >= n_s`` (``a_sp`` rows of size s in pattern p, ``n_s`` rows
of size s), is solved by HiGHS' dual simplex (scipy; deterministic), with a term far below one
group in all that prefers, among the solutions with the fewest groups, patterns whose sizes mix
as the data's do. Rounded down, ``x_p`` groups of each pattern take rows of its sizes: within a
size, the rows heaviest on the other modules go to the groups lightest on them so far (the sizes
from the largest); rows over another module's cap go back. The rows without the module are then
dealt, heaviest first, to the group lightest on the other modules, as dealing evens them (first
fit filled the first groups and left the refinement uneven LLM sums, which the assigner then
sorted into steps by their sources: the search's subsample of ``harsh`` 645 mixed 2.70x that way,
0.55x dealt). What is left (the rounding's rows, those sent back, those that did not fit) fills
the room by first fit, in new groups where none has room. The refinement then evens the other
modules out with swaps of equal sizes, which keep every group's binding sum.

Example:
    >>> import numpy as np
    >>> tiles = np.array([9, 9, 6, 6, 6, 8, 8, 2, 5, 5, 8])  # 72 tiles: 4 groups of exactly 18
    >>> load = np.stack([tiles, 100 * tiles, np.ones(11, np.int64)], 1)
    >>> caps = np.array([18, 5000, 8])
    >>> queue, gid = pattern_groups(np.arange(11), load, caps, 0, rng=np.random.default_rng(0))
    >>> sorted(np.bincount(gid, weights=tiles[queue]).astype(int).tolist()), sorted(queue.tolist()) == list(range(11))
    ([18, 18, 18, 18], True)
"""

from __future__ import annotations

import numpy as np

from balancer_cli._jit import njit
from balancer_cli._shuffle import shuffled
from balancer_cli._sort import size_order
from balancer_cli.pack.packers._fill_kernels import first_fit, first_fit_orders
from balancer_cli.pack.packers._table_kernels import suffix_min

__all__ = ["MAX_PATTERNS", "MAX_SIZES", "pattern_groups"]

#: Distinct nonzero loads of the binding module at most (more: no patterns).
MAX_SIZES = 12
#: Maximal patterns at most (more: no patterns). Sizes 1-12 have 1,380 under a cap of 24, 3,655 under 29,
#: and over 20,000 under 40.
MAX_PATTERNS = 20_000
#: Open groups first fit tries per leftover row (as dealing's own fill).
_LOOKBACK = 64
#: Binding loads up to this are counted in a table as long as the largest; past it, by a sort.
_COUNT_TABLE_MAX = 1 << 22


def pattern_groups(rows: np.ndarray, load_NK: np.ndarray, caps_K: np.ndarray, binding: int, *,
                   rng: np.random.Generator, max_items: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """``(queue, gid)``: every row of ``rows`` in placement order and its group, groups built
    from the patterns of module ``binding`` (module docstring); None where they do not apply (too
    many sizes or patterns, no module load, scipy missing, the LP not solved).

    Args:
        rows: (P,) the rows to place (each load within the caps).
        load_NK: (N, K) integer loads.
        caps_K: (K,) caps.
        binding: the module whose cap the patterns fill.
        rng: breaks ties between equal rows (a seeded order).
        max_items: rows a group holds at most (None: no bound), so rows a pattern holds too.
    """
    load_b = load_NK[rows, binding]
    cap = int(caps_K[binding])
    if load_b.max(initial=0) <= _COUNT_TABLE_MAX:
        per_size = np.bincount(load_b)  # as long as the largest load (within the cap), not the cap
        sizes = np.flatnonzero(per_size[1:]) + 1
        count_S = per_size[sizes]
    else:  # loads up to int32's top: a table as long as the largest would take gigabytes; sort instead
        sizes, count_S = np.unique(load_b[load_b > 0], return_counts=True)
    if not 0 < len(sizes) <= MAX_SIZES:
        return None
    patterns_SP = _maximal_patterns(sizes, cap, cap if max_items is None else min(int(max_items), cap))
    x_P = None if patterns_SP is None else _lp_counts(patterns_SP, count_S)
    if x_P is None or x_P.sum() == 0:
        return None
    slots_SG = patterns_SP[:, np.repeat(np.arange(len(x_P)), x_P)]
    # The rows of each size (the largest first), the heaviest on the other modules first within
    # it, ties in a seeded order: what the slots are filled with.
    sized = rows[load_b > 0]
    sized = shuffled(rng, sized)
    other = np.arange(load_NK.shape[1]) != binding
    share_N = (load_NK[:, other] / np.maximum(caps_K[other], 1)).sum(axis=1)
    sized = sized[size_order(share_N[sized], descending=True)]
    code = (len(sizes) - 1) - np.searchsorted(sizes, load_NK[sized, binding])  # the largest size first: 0
    by_code = np.argsort(code, kind="stable")
    sized, code = sized[by_code], code[by_code]
    starts = np.searchsorted(code, np.arange(len(sizes) + 1))
    gid = _fill_slots(sized, starts, np.ascontiguousarray(slots_SG[::-1]), share_N)
    placed = gid >= 0
    queue, gid = sized[placed], gid[placed]
    G = slots_SG.shape[1]
    keep, lsum_GK = _send_back(queue, gid, load_NK, caps_K, G)  # rows over another module's cap
    queue, gid, sent_back = queue[keep], gid[keep], queue[~keep]
    # Rows without the module, heaviest first, each to the group lightest on the other modules (as
    # dealing evens them); what does not fit there, and the rows of the module left over, then
    # fill by first fit (rows without the module first: until their last the full groups stay open).
    free = first_fit_orders(rows[load_b == 0], load_NK, caps_K, rng)[0]
    dealt = _fill_lightest(free, share_N, load_NK, caps_K, lsum_GK, np.bincount(gid, share_N[queue], minlength=G))
    queue, gid = np.concatenate([queue, free[dealt >= 0]]), np.concatenate([gid, dealt[dealt >= 0]])
    left = first_fit_orders(np.concatenate([sized[~placed], sent_back]), load_NK, caps_K, rng)[0]
    rest = np.concatenate([free[dealt < 0], left])
    if len(rest):
        rest_gid, _ = first_fit(rest, load_NK, caps_K, suffix_min(rest, load_NK), _LOOKBACK, lsum_GK)
        queue, gid = np.concatenate([queue, rest]), np.concatenate([gid, rest_gid])
    used = np.flatnonzero(np.bincount(gid))  # groups whose slots got no row (the LP covers a size twice) drop out
    if len(used) < gid.max() + 1:
        gid = np.searchsorted(used, gid)
    return queue, gid


@njit
def _tree(leaf_G):  # pragma: no cover - compiled
    """A tournament tree over ``leaf_G`` (padded to a power of two with infinities): ``(val, idx)``,
    node p holding the least value of its subtree and its leaf (the lower leaf on ties), node 1 the
    least of all. A changed leaf is replayed to the root by :func:`_replay`."""
    size = 1
    while size < len(leaf_G):
        size *= 2
    val = np.full(2 * size, np.inf)
    idx = np.empty(2 * size, np.int64)
    val[size:size + len(leaf_G)] = leaf_G
    idx[size:] = np.arange(size)
    for p in range(size - 1, 0, -1):
        left = 2 * p if val[2 * p] <= val[2 * p + 1] else 2 * p + 1
        val[p], idx[p] = val[left], idx[left]
    return val, idx


@njit
def _replay(val, idx, leaf, value):  # pragma: no cover - compiled
    """Set ``leaf`` of the tree to ``value`` and replay its matches up to the root."""
    p = len(val) // 2 + leaf
    val[p] = value
    while p > 1:
        p >>= 1
        left = 2 * p if val[2 * p] <= val[2 * p + 1] else 2 * p + 1
        val[p], idx[p] = val[left], idx[left]


@njit
def _fill_slots(rows, starts, slots_SG, share_N):  # pragma: no cover - compiled
    """(P,) group of each of ``rows`` (-1: no slot left): the rows of size s (``rows[starts[s]:
    starts[s + 1]]``, heaviest first) each to the group with a free slot of their size that is
    lightest on ``share_N`` so far (lowest group on ties), sizes in turn. The lightest group is
    kept in a tournament tree (as post-balancing's LPT): a row costs one match per level.

    Example:
        >>> import numpy as np
        >>> slots_SG, share_N = np.array([[1, 1], [1, 0]]), np.array([3.0, 2.0, 1.0, 1.0])
        >>> _fill_slots(np.arange(4), np.array([0, 2, 4]), slots_SG, share_N).tolist()  # row 3: no slot left
        [0, 1, 0, -1]
    """
    S, G = slots_SG.shape
    gid = np.full(len(rows), -1, np.int64)
    load = np.zeros(G)
    for s in range(S):
        free = slots_SG[s].copy()
        val, idx = _tree(np.where(free > 0, load, np.inf))  # groups without a slot of this size never win
        for r in range(starts[s], starts[s + 1]):
            if val[1] == np.inf:
                break
            g = idx[1]
            gid[r] = g
            load[g] += share_N[rows[r]]
            free[g] -= 1
            _replay(val, idx, g, load[g] if free[g] > 0 else np.inf)
    return gid


@njit
def _fill_lightest(rows, share_N, load_NK, caps_K, lsum_GK, share_G):  # pragma: no cover - compiled
    """(P,) group of each of ``rows`` (-1: it does not fit there): each row, in order, to the group
    lightest on ``share_N`` so far (``share_G`` to start, lowest group on ties), if within every
    cap of ``lsum_GK`` (updated). A tournament tree finds the lightest (as :func:`_fill_slots`).

    Example:
        >>> import numpy as np
        >>> load_NK = np.array([[5], [4], [3]]); lsum_GK = np.array([[2], [0]])
        >>> _fill_lightest(np.arange(3), np.array([5.0, 4.0, 3.0]), load_NK, np.array([7]), lsum_GK,
        ...                np.array([2.0, 0.0])).tolist(), lsum_GK.ravel().tolist()  # row 2: 5 + 3 > 7
        ([1, 0, -1], [6, 5])
    """
    val, idx = _tree(share_G.astype(np.float64))
    gid = np.full(len(rows), -1, np.int64)
    for r in range(len(rows)):
        g, i = idx[1], rows[r]
        fits = True
        for k in range(load_NK.shape[1]):
            fits = fits and lsum_GK[g, k] + load_NK[i, k] <= caps_K[k]
        if not fits:
            continue
        gid[r] = g
        for k in range(load_NK.shape[1]):
            lsum_GK[g, k] += load_NK[i, k]
        _replay(val, idx, g, val[len(val) // 2 + g] + share_N[i])
    return gid


@njit
def _send_back(queue, gid, load_NK, caps_K, G):  # pragma: no cover - compiled
    """``(keep_P, lsum_GK)``: whether each row stays, and the groups' load sums of the rows that
    stay. From each group over a cap, its rows with the largest load on the module most over its
    cap leave until it fits (the first such row on ties).

    Example:
        >>> import numpy as np
        >>> load_NK = np.array([[5], [4], [3]])
        >>> keep, lsum_GK = _send_back(np.arange(3), np.array([0, 0, 1]), load_NK, np.array([8]), 2)
        >>> keep.tolist(), lsum_GK.ravel().tolist()
        ([False, True, True], [4, 3])
    """
    P = len(queue)
    K = load_NK.shape[1]
    lsum = np.zeros((G, K), np.int64)
    count = np.zeros(G + 1, np.int64)
    for p in range(P):
        count[gid[p] + 1] += 1
        for k in range(K):
            lsum[gid[p], k] += load_NK[queue[p], k]
    for g in range(G):
        count[g + 1] += count[g]
    at = np.empty(P, np.int64)  # positions of each group's rows, group by group
    fill = count[:-1].copy()
    for p in range(P):
        at[fill[gid[p]]] = p
        fill[gid[p]] += 1
    keep = np.ones(P, np.bool_)
    for g in range(G):
        while True:
            worst, over = -1, 0.0
            for k in range(K):
                if lsum[g, k] > caps_K[k] and lsum[g, k] / max(caps_K[k], 1) > over:
                    worst, over = k, lsum[g, k] / max(caps_K[k], 1)
            if worst < 0:
                break
            out = -1
            for j in range(count[g], count[g + 1]):
                p = at[j]
                if keep[p] and (out < 0 or load_NK[queue[p], worst] > load_NK[queue[out], worst]):
                    out = p
            keep[out] = False
            for k in range(K):
                lsum[g, k] -= load_NK[queue[out], k]
    return keep, lsum


def _maximal_patterns(sizes: np.ndarray, cap: int, max_items: int) -> np.ndarray | None:
    """(S, P) counts of each size in every maximal pattern: a multiset of sizes within ``cap`` and
    ``max_items`` to which no size can be added; None past :data:`MAX_PATTERNS`."""
    S = len(sizes)
    found: list[list[int]] = []
    counts = [0] * S
    smallest = int(sizes[0])

    def extend(i: int, room: int, items: int) -> bool:  # sizes from the largest down
        if i < 0:
            if (room < smallest or items == max_items) and items > 0:
                found.append(counts.copy())
            return len(found) <= MAX_PATTERNS
        size = int(sizes[i])
        most = min(room // size, max_items - items)
        # The smallest size takes all it can: fewer leaves room for it, not a maximal pattern. So
        # every leaf is a pattern, and the work stops with MAX_PATTERNS whatever the cap.
        for c in range(most, -1 if i > 0 else most - 1, -1):
            counts[i] = c
            if not extend(i - 1, room - c * size, items + c):
                return False
        counts[i] = 0
        return True

    if not extend(S - 1, cap, 0):
        return None
    return np.array(found, dtype=np.int64).T.reshape(S, -1)


def _lp_counts(patterns_SP: np.ndarray, counts_S: np.ndarray) -> np.ndarray | None:
    """(P,) groups of each pattern: the cutting-stock LP's solution rounded down (None: no scipy,
    or no solution)."""
    try:
        from scipy.optimize import linprog
    except ImportError:  # pragma: no cover - scipy is a dependency
        return None
    # Among the solutions with the fewest groups (the LP's are rarely one), those of patterns whose
    # sizes are mixed as the data's are: a group's sizes are its sources where sources have sizes of
    # their own, and groups of one kind gather in steps. The term is far below one group in all.
    share_S = counts_S / counts_S.sum()
    spread_P = np.abs(patterns_SP / patterns_SP.sum(axis=0) - share_S[:, None]).sum(axis=0)
    res = linprog(1.0 + 1e-7 * spread_P, A_ub=-patterns_SP.astype(np.float64), b_ub=-counts_S.astype(np.float64),
                  bounds=(0, None), method="highs-ds")
    if res.status != 0:
        return None
    return np.floor(res.x + 1e-7).astype(np.int64)
