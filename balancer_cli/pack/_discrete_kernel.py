"""The compiled swap loops of :mod:`balancer_cli.pack.step_discrete`: quanta from ranks over their
target to ranks under it, directly (:func:`give_quanta`) and through a third rank on target
(:func:`chain_quanta`).

Compiled by the shared optional-numba decorator (:func:`balancer_cli._jit.njit`): numba when
importable, the same code as plain Python otherwise. No randomness: every choice is the first best
in a fixed order, so the result is deterministic, and the same as the array searches they replace
(tests/pack/test_pack_step_discrete_kernels.py), whose per-call overhead made the stage Python-bound:
a three-module 300k at ``--dp 32`` with groups of ~10 made 16,414 searches of a giver's takers a
placement; the stage took 6.8-7.1 s there, 1.7 s compiled (docs/scaling.md).
"""

from __future__ import annotations

import numpy as np

from balancer_cli._jit import njit

__all__ = ["give_quanta"]


@njit(inline=True)
def _fits_after(gload_GK, g, sign, load_NK, sa, sb, other, caps_K):  # pragma: no cover
    """Whether group g's loads plus ``sign`` x (load of sample sa - of sb) less (load of
    other[0] - of other[1]) (where ``other[0] >= 0``) stay within every cap."""
    for k in range(len(caps_K)):
        value = gload_GK[g, k] + sign * (np.int64(load_NK[sa, k]) - np.int64(load_NK[sb, k]))
        if other[0] >= 0:
            value -= np.int64(load_NK[other[0], k]) - np.int64(load_NK[other[1], k])
        if value > caps_K[k]:
            return False
    return True


@njit(inline=True)
def _swap(a, b, order_P, quanta_P, group_P, gload_GK, load_NK):  # pragma: no cover
    """The samples at positions a and b change places (and groups, whose loads follow)."""
    sa, sb = order_P[a], order_P[b]
    for k in range(load_NK.shape[1]):
        delta = np.int64(load_NK[sa, k]) - np.int64(load_NK[sb, k])
        gload_GK[group_P[a], k] -= delta
        gload_GK[group_P[b], k] += delta
    order_P[a], order_P[b] = sb, sa
    quanta_P[a], quanta_P[b] = quanta_P[b], quanta_P[a]


@njit(inline=True)
def _zero(cost_NK, weight_K):  # pragma: no cover
    """0 in the type of ``|cost - cost| * weight``: the gaps add up in it, as numpy's sums of those
    products do (float32 costs: float32 sums; in float64 two near-equal gaps of float32 costs tied
    otherwise, and another chain was taken)."""
    return abs(cost_NK[0, 0] - cost_NK[0, 0]) * (weight_K[0] - weight_K[0])


@njit(inline=True)
def _gap(cost_NK, sa, sb, others_K, weight_K):  # pragma: no cover
    """``sum_k |cost_ak - cost_bk| * weight_k`` over the ``others_K`` modules, in module order and
    in the products' type (:func:`_zero`)."""
    gap = _zero(cost_NK, weight_K)
    for k in range(cost_NK.shape[1]):
        if others_K[k]:
            gap += abs(cost_NK[sa, k] - cost_NK[sb, k]) * weight_K[k]
    return gap


@njit
def give_quanta(slots_S, first_S, end_S, pos_V, dev_X, key_T, pos_T, kind_P, quanta_P, span, slot_P,
                group_P, order_P, load_NK, gload_GK, caps_K, cost_NK, others_K, weight_K, max_swaps,
                swapped):  # pragma: no cover
    """Swap samples a whole number of quanta apart from ranks over their target to ranks under it,
    in place; returns the swaps made in all (``swapped`` the ones before).

    Slots are visited in the order ``slots_S``; while slot s is over its target (``dev_X[s] > 0``
    quanta), each of its giver samples x (positions ``pos_V[first_S[i]:end_S[i]]`` holding a
    quantum or more) finds its best taker: of the taker positions whose key
    ``kind x span + quanta`` lies 1 .. min(dev, quanta of x) under x's (``key_T`` ascending,
    ``pos_T`` their positions), those still holding those quanta, on a slot at least that far
    under its target, whose swap with x keeps both groups within every cap; the least
    ``gap / quanta`` (the gap: ``sum_k |cost_xk - cost_yk| * weight_k`` over the ``others_K``
    modules), then fewer quanta, then less gap, then the earlier taker. The giver of the least
    gap per quantum (the earlier on a tie) swaps with its taker.

    Args:
        slots_S: (S,) slots over their target, in visiting order.
        first_S, end_S: (S,) each slot's giver positions' range in ``pos_V``.
        pos_V: giver positions, slot by slot.
        dev_X: (X,) each slot's quanta over (> 0) or under (< 0) its target (updated).
        key_T, pos_T: (T,) taker positions' keys (ascending) and the positions.
        kind_P, quanta_P: (P,) each position's kind and quanta of the module (quanta updated).
        span: the key's quanta span (largest quanta + 2).
        slot_P, group_P: (P,) each position's slot and group.
        order_P: (P,) the sample at each position (swapped in place).
        load_NK: (N, KL) sample loads; gload_GK: (G, KL) group loads (updated); caps_K: (KL,).
        cost_NK: (N, K) sample costs; others_K: (K,) the modules the gap counts; weight_K: (K,).
        max_swaps: the most swaps in all.
        swapped: the swaps made before.
    """
    none = np.full(2, -1, np.int64)  # no second exchange (_fits_after)
    for i in range(len(slots_S)):
        slot = slots_S[i]
        while dev_X[slot] > 0 and swapped < max_swaps:
            best_score, best_x, best_y, best_step = np.inf, -1, -1, 0
            for v in range(first_S[i], end_S[i]):
                x = pos_V[v]
                qx = quanta_P[x]
                if qx <= 0:
                    continue
                top = min(dev_X[slot], qx)
                key = kind_P[x] * span + qx
                lo = np.searchsorted(key_T, key - top)
                hi = np.searchsorted(key_T, key)
                sx = order_P[x]
                gx = group_P[x]
                # This giver's best taker: (score, quanta, gap), the earliest on a tie.
                c_score, c_y, c_step, c_gap = np.inf, -1, 0, np.inf
                for c in range(lo, hi):
                    step = key - key_T[c]
                    y = pos_T[c]
                    if quanta_P[y] != qx - step or dev_X[slot_P[y]] > -step:
                        continue
                    sy = order_P[y]
                    if not (_fits_after(gload_GK, group_P[y], 1, load_NK, sx, sy, none, caps_K)
                            and _fits_after(gload_GK, gx, -1, load_NK, sx, sy, none, caps_K)):
                        continue
                    gap = _gap(cost_NK, sx, sy, others_K, weight_K)
                    score = gap / step
                    if (score < c_score or (score == c_score and (step < c_step or (step == c_step
                                                                                     and gap < c_gap)))):
                        c_score, c_y, c_step, c_gap = score, y, step, gap
                if c_y >= 0 and (best_x < 0 or c_score < best_score):
                    best_score, best_x, best_y, best_step = c_score, x, c_y, c_step
            if best_x < 0:
                break
            _swap(best_x, best_y, order_P, quanta_P, group_P, gload_GK, load_NK)
            dev_X[slot] -= best_step
            dev_X[slot_P[best_y]] += best_step
            swapped += 1
    return swapped


@njit
def chain_quanta(slots_S, first_S, end_S, uneven_U, slot_U, code_T, index_P, kind_P, quanta_P, span, pool_F, key_F,
                 llm_P, top, near, slot_P, group_P, offsets_G, order_P, load_NK, gload_GK, caps_K, cost_NK, others_K,
                 weight_K, dev_X, max_swaps, swapped):  # pragma: no cover
    """Quanta through a third rank on target, in place (step_discrete's ``_chain``): returns the
    swaps made in all (``swapped`` the ones before).

    While slot s (``slots_S``; its uneven positions ``uneven_U[first_S[i]:end_S[i]]``) is over
    its target: of the chains x -> y (a giver's sample x with y of the pool, a quantum less: the
    ``near`` pool entries of y's kind and quanta nearest x's LLM cost in ``key_F`` order, still
    holding those quanta, within x's group's caps), then x' -> y' (any x' of y's group with a
    taker's y' of its kind, a quantum less: the first ``near`` of the takers' sorted ``code_T``
    = ``(kind x span + quanta) x U + index``), those within every cap of y's and y''s groups and
    with x' not y, the least ``gap(x, y) + gap(x', y')`` (the first in that order on a tie) swaps
    both pairs; the taker's code moves up a key. ``code_T`` keeps the takers still under their
    target in its first entries (compacted in place).
    """
    U = len(uneven_U)
    n_T = len(code_T)
    none = np.full(2, -1, np.int64)
    pair = np.empty(2, np.int64)
    for i in range(len(slots_S)):
        slot = slots_S[i]
        while dev_X[slot] > 0 and swapped + 2 <= max_swaps:
            givers = 0
            for u in range(first_S[i], end_S[i]):
                givers += quanta_P[uneven_U[u]] > 0
            kept = 0
            for t in range(n_T):  # takers still under their target
                if dev_X[slot_U[code_T[t] % U]] < 0:
                    code_T[kept] = code_T[t]
                    kept += 1
            n_T = kept
            if givers == 0 or n_T == 0:
                break
            best, bx, by, bxp, byp, legs = np.inf, -1, -1, -1, -1, 0
            for u in range(first_S[i], end_S[i]):
                x = uneven_U[u]
                if quanta_P[x] <= 0:
                    continue
                want = np.float64(kind_P[x] * span + quanta_P[x] - 1)
                lo = np.searchsorted(key_F, want * top)
                hi = np.searchsorted(key_F, (want + 1) * top)
                mid = np.searchsorted(key_F, want * top + llm_P[x])
                start = min(max(mid - near // 2, lo), max(hi - near, lo))
                for at in range(start, min(start + near, hi)):
                    y = pool_F[at]
                    if quanta_P[y] != quanta_P[x] - 1:
                        continue  # stale: its sample moved
                    sx, sy = order_P[x], order_P[y]
                    if not _fits_after(gload_GK, group_P[x], -1, load_NK, sx, sy, none, caps_K):
                        continue
                    legs += 1
                    gap_xy = _gap(cost_NK, sx, sy, others_K, weight_K)
                    if not gap_xy < best:  # every chain through (x, y) scores at least this
                        continue
                    n = group_P[y]
                    for xp in range(offsets_G[n], offsets_G[n + 1]):
                        if quanta_P[xp] <= 0 or xp == y:
                            continue
                        wanted = kind_P[xp] * span + quanta_P[xp] - 1
                        lo2 = np.searchsorted(code_T[:n_T], wanted * U)
                        hi2 = min(np.searchsorted(code_T[:n_T], (wanted + 1) * U), lo2 + near)
                        for t in range(lo2, hi2):
                            yp = uneven_U[code_T[t] % U]
                            sxp, syp = order_P[xp], order_P[yp]
                            pair[0], pair[1] = sxp, syp
                            if not _fits_after(gload_GK, n, 1, load_NK, sx, sy, pair, caps_K):
                                continue
                            if not _fits_after(gload_GK, group_P[yp], 1, load_NK, sxp, syp, none, caps_K):
                                continue
                            score = gap_xy + _gap(cost_NK, sxp, syp, others_K, weight_K)
                            if score < best:
                                best, bx, by, bxp, byp = score, x, y, xp, yp
            if legs == 0 or bx < 0:
                break
            _swap(bx, by, order_P, quanta_P, group_P, gload_GK, load_NK)
            _swap(bxp, byp, order_P, quanta_P, group_P, gload_GK, load_NK)
            swapped += 2
            dev_X[slot] -= 1
            dev_X[slot_P[byp]] += 1
            # The taker's quanta one more: its code moves up one key, the codes between down a place.
            code = (kind_P[byp] * span + quanta_P[byp] - 1) * U + index_P[byp]
            lo3 = np.searchsorted(code_T[:n_T], code)
            hi3 = np.searchsorted(code_T[:n_T], code + U)
            for t in range(lo3, hi3 - 1):
                code_T[t] = code_T[t + 1]
            code_T[hi3 - 1] = code + U
    return swapped
