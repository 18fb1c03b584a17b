"""Lower bounds on the number of groups a packing under per-module caps needs.

Example:
    >>> import numpy as np
    >>> groups_lower_bound(np.array([[0, 4000]] * 4 + [[6, 1546]] * 12), np.array([18, 6400]))
    6
"""

from __future__ import annotations

import weakref

import numpy as np

from balancer_cli._jit import njit

__all__ = ["groups_lower_bound"]

#: ``(weakref to the loads, caps, bound)`` of the last bound over every row of a read-only
#: array: a pack asks it of the same loads and caps several times (the windows' size and each
#: packer's evaluation; 0.15 s each at 10M). Read-only, so a remembered bound is never stale.
_last_whole: tuple = (None, b"", 0)
#: The dual feasible functions ``u_k`` (Fekete and Schepers) bound each module for k = 1 .. this.
DFF_MAX_K = 32
#: Modules whose cap is over this are bounded without them: they count the loads in cap + 1 bins.
DFF_MAX_CAP = 1 << 20


def groups_lower_bound(load_NK: np.ndarray, caps_K: np.ndarray, rows: np.ndarray | None = None) -> int:
    """No packing under the caps has fewer groups: over the samples that fit, ``max_k ceil(sum
    load_k / cap_k)``, the count of samples over half a cap (no two of them can share a group),
    each module's bound by dual feasible functions (:func:`_dff_groups`: five samples of 5 tiles
    never share a group of 24) and the coupled item/token bound of :func:`_bound_kernel` (items
    that long texts leave unused), plus one group for each sample over a cap (alone in its group,
    isolated).

    Args:
        load_NK: (N, K) integer loads (any integer type).
        caps_K: (K,) caps.
        rows: the rows of ``load_NK`` to bound (default: all), each once; read in place, never copied.

    Example:
        >>> groups_lower_bound(np.array([[5, 100], [5, 100]]), np.array([9, 4096]))
        2
        >>> groups_lower_bound(np.array([[5, 100], [5, 100], [1, 10]]), np.array([9, 4096]), rows=np.array([2]))
        1
    """
    load = np.asarray(load_NK)
    caps = np.asarray(caps_K, dtype=np.int64)
    n = len(load) if rows is None else len(rows)
    if n == 0 or load.size == 0:
        return 1
    if load.dtype.kind not in "iu":
        load = load.astype(np.int64)
    # The bound depends on the set of rows only: a mask read in row order touches the loads
    # sequentially (rows in step order are random reads, 5x slower at 10M).
    mask = np.ones(0, np.bool_)
    if rows is not None:
        mask = np.zeros(len(load), np.bool_)
        mask[np.asarray(rows)] = True
    elif not load.flags.writeable:
        return _whole_bound(load, caps)
    return _bound(load, caps, mask)


def _bound(load: np.ndarray, caps: np.ndarray, mask: np.ndarray) -> int:
    """The bound over the rows in ``mask`` (all when empty): two modules (one encoder and the LLM,
    most packs) by :func:`_two_module_bound`, any other count by :func:`_bound_kernel`."""
    kernel = _two_module_bound if load.ndim == 2 and load.shape[1] == 2 else _bound_kernel
    return int(kernel(load, caps, mask))


def _whole_bound(load: np.ndarray, caps: np.ndarray) -> int:
    """The bound over every row of the read-only ``load``, remembered for the next call."""
    global _last_whole
    ref, key, bound = _last_whole
    if ref is None or ref() is not load or key != caps.tobytes():
        bound = _bound(load, caps, np.ones(0, np.bool_))
        _last_whole = (weakref.ref(load), caps.tobytes(), bound)
    return bound


@njit
def _dff_groups(count_V, cap, max_k):  # pragma: no cover - compiled
    """``max_k ceil(sum_i u_k(load_i / cap))`` over the loads counted in ``count_V`` (``count_V[v]``
    samples of load v, v = 0 .. cap), k = 1 .. ``max_k``: ``u_k(x) = floor((k + 1) x) / k``, or ``x``
    where ``(k + 1) x`` is whole, maps the loads of any one group to at most 1 (Fekete and Schepers'
    dual feasible functions), so no packing has fewer groups. It sees what the sum does not: at a
    cap of 24 tiles, samples of 5 or 6 count 1/4 each (no group holds five), where their sum counts
    them 5/24 and 6/24 (`harsh` 646: 67k such samples, 16,626 -> 17,780 groups, and the packer's
    1.10x the bound was 1.03x what any packing needs). Exact in integers: each sum is scaled by
    ``k * cap``, and a threshold's count is read off the suffix sums of ``count_V``."""
    at_least = np.zeros(cap + 2, np.int64)  # samples of load >= v
    for v in range(cap, -1, -1):
        at_least[v] = at_least[v + 1] + count_V[v]
    best = 0
    for k in range(1, max_k + 1):
        total = np.int64(0)
        for j in range(1, k + 2):  # samples with floor((k + 1) v / cap) >= j add cap each
            total += at_least[(j * cap + k) // (k + 1)] * cap
            if (j * cap) % (k + 1) == 0:  # v = j cap / (k + 1) exactly: u_k is v / cap, k v scaled
                v = j * cap // (k + 1)
                total += count_V[v] * (k * v - j * cap)
        best = max(best, (total + k * cap - 1) // (k * cap))
    return best


@njit
def _two_module_bound(load_NK, caps_K, mask_N):  # pragma: no cover - compiled
    """:func:`_bound_kernel` for two columns (an encoder and the LLM), the same bound to the bit:
    every sum a scalar and the four slopes' waste in four registers: 791k rows 15 -> 4 ms in cache,
    1.25M int64 rows out of it (a window's, as a pack reads them) 22 -> 16 ms, and ~2 ms more for
    the per-load counts of :func:`_dff_groups`; a pack bounds every window, every probe and every
    search candidate."""
    every = len(mask_N) == 0
    c0 = np.int64(caps_K[0])
    c1 = np.int64(caps_K[1])
    h0 = c0 // 2  # 2 v > c  <=>  v > c // 2 for integers
    h1 = c1 // 2
    s0 = np.int64(0)
    s1 = np.int64(0)
    n0 = np.int64(0)
    n1 = np.int64(0)
    over = 0
    a_max = np.inf
    count0 = np.zeros(c0 + 1 if c0 <= DFF_MAX_CAP else 0, np.int64)  # samples of each load (dual functions)
    count1 = np.zeros(c1 + 1 if c1 <= DFF_MAX_CAP else 0, np.int64)
    for i in range(len(load_NK)):
        if not every and not mask_N[i]:
            continue
        x = np.int64(load_NK[i, 0])
        y = np.int64(load_NK[i, 1])
        if x > c0 or y > c1:
            over += 1
            continue
        s0 += x
        s1 += y
        n0 += x > h0
        n1 += y > h1
        if len(count0):
            count0[x] += 1
        if len(count1):
            count1[y] += 1
        if x > 0:
            a_max = min(a_max, np.float64(y) / x)
    best = max(1, (s0 + c0 - 1) // c0 + over, n0 + over, (s1 + c1 - 1) // c1 + over, n1 + over)
    if len(count0):
        best = max(best, _dff_groups(count0, c0, DFF_MAX_K) + over)
    if len(count1):
        best = max(best, _dff_groups(count1, c1, DFF_MAX_K) + over)
    if not np.isfinite(a_max):
        return best
    a = np.array([1.0, 0.9, 0.75, 0.5]) * a_max  # the slopes of _bound_kernel
    slack = c1 - a * c0
    a0, a1, a2, a3 = a[0], a[1], a[2], a[3]
    k0, k1, k2, k3 = slack[0], slack[1], slack[2], slack[3]
    w0 = w1 = w2 = w3 = 0.0
    for i in range(len(load_NK)):
        if not every and not mask_N[i]:
            continue
        x = load_NK[i, 0]
        y = load_NK[i, 1]
        if x > c0 or y > c1:
            continue
        llm = np.float64(y)
        w0 += max(0.0, llm - a0 * x - k0)
        w1 += max(0.0, llm - a1 * x - k1)
        w2 += max(0.0, llm - a2 * x - k2)
        w3 += max(0.0, llm - a3 * x - k3)
    waste = np.array([w0, w1, w2, w3])
    for s in range(4):
        if a[s] > 0 and slack[s] >= 0:
            total = s0 + np.int64(np.floor(waste[s] / a[s] * (1 - 1e-9)))
            best = max(best, (total + c0 - 1) // c0 + over)
    return best


@njit
def _bound_kernel(load_NK, caps_K, mask_N):  # pragma: no cover - compiled
    """The bound of :func:`groups_lower_bound` over the rows in ``mask_N`` (all rows when it is
    empty), in two passes without copies.

    Coupled bound: for an encoder k and a slope ``a <= min_i llm_i / items_ik`` (LLM tokens per
    item, e.g. 256 per tile), every sample has ``rest_i = llm_i - a * items_ik >= 0`` (its text).
    A group's items are at most ``(Qt - sum rest) / a``, so it leaves at least
    ``(sum rest - (Qt - a * Qv_k)) / a`` of its Qv_k items unused; that waste is superadditive in
    the members, so the groups waste at least ``sum_i max(0, rest_i - (Qt - a Qv_k)) / a`` items in
    total, and ``G >= (sum items + waste) / Qv_k``. A sample over a cap is alone in its group
    (isolated): it adds one group to each bound, not its load (summed, a 3x-cap sample counted three
    groups, and steps came out at 0.98x the bound). Pass 1 sums the loads of the rows that fit,
    counts those over half a cap (and the rows that do not fit) and the rows of each load (for
    :func:`_dff_groups`), and finds each encoder's steepest slope; pass 2 sums the waste at four
    slopes per encoder.
    """
    K = len(caps_K)
    every = len(mask_N) == 0
    sums = np.zeros(K, np.int64)  # loads of the rows that fit, per module
    halves = np.zeros(K, np.int64)
    items = np.zeros(K, np.int64)  # items of the rows that fit, per encoder
    a_max = np.full(K, np.inf)
    over = 0  # rows over a cap: each alone in a group (isolated), whatever its load
    start = np.zeros(K + 1, np.int64)  # module k counts the samples of each load in count[start[k]:start[k + 1]]
    for k in range(K):
        start[k + 1] = start[k] + (caps_K[k] + 1 if caps_K[k] <= DFF_MAX_CAP else 0)
    count = np.zeros(start[K], np.int64)
    for i in range(len(load_NK)):
        if not every and not mask_N[i]:
            continue
        fit = True
        for k in range(K):
            if load_NK[i, k] > caps_K[k]:
                fit = False
        if not fit:
            over += 1
            continue
        for k in range(K):
            v = np.int64(load_NK[i, k])
            sums[k] += v
            if 2 * v > caps_K[k]:
                halves[k] += 1
            if start[k + 1] > start[k]:
                count[start[k] + v] += 1
        if K > 1:
            llm = np.float64(load_NK[i, K - 1])
            for k in range(K - 1):
                v = np.int64(load_NK[i, k])
                items[k] += v
                if v > 0:
                    a_max[k] = min(a_max[k], llm / v)
    best = 1
    for k in range(K):
        best = max(best, (sums[k] + caps_K[k] - 1) // caps_K[k] + over, halves[k] + over)
        if start[k + 1] > start[k]:
            best = max(best, _dff_groups(count[start[k]:start[k + 1]], np.int64(caps_K[k]), DFF_MAX_K) + over)
    if K < 2:
        return best
    shares = np.array([1.0, 0.9, 0.75, 0.5])
    waste = np.zeros((K - 1, 4))
    for i in range(len(load_NK)):
        if not every and not mask_N[i]:
            continue
        fit = True
        for k in range(K):
            if load_NK[i, k] > caps_K[k]:
                fit = False
        if not fit:
            continue
        llm = np.float64(load_NK[i, K - 1])
        for k in range(K - 1):
            if not np.isfinite(a_max[k]):
                continue
            for s in range(4):
                a = shares[s] * a_max[k]
                slack = caps_K[K - 1] - a * caps_K[k]
                if a > 0 and slack >= 0:
                    waste[k, s] += max(0.0, llm - a * load_NK[i, k] - slack)
    for k in range(K - 1):
        if not np.isfinite(a_max[k]):
            continue
        for s in range(4):
            a = shares[s] * a_max[k]
            if a > 0 and caps_K[K - 1] - a * caps_K[k] >= 0:
                # floor of the float waste keeps the bound valid against rounding
                total = items[k] + np.int64(np.floor(waste[k, s] / a * (1 - 1e-9)))
                best = max(best, (total + caps_K[k] - 1) // caps_K[k] + over)
    return best
