"""The compiled loop of :mod:`balancer_cli.pack.step_peaks`: a step's heaviest rank gives load away.

Compiled by the shared optional-numba decorator (:func:`balancer_cli._jit.njit`): numba when
importable, the same code as plain Python otherwise. No randomness: every choice is the first
best in a fixed order, so the result is deterministic.
"""

from __future__ import annotations

import numpy as np

from balancer_cli._jit import njit

__all__ = ["shave_steps"]


@njit
def _peak(load_X, base, R):  # pragma: no cover
    """(rank, load) of the heaviest of ranks ``base .. base + R - 1`` (the first of equal ones)."""
    best = 0
    for r in range(1, R):
        if load_X[base + r] > load_X[base + best]:
            best = r
    return best, load_X[base + best]


@njit
def shave_steps(steps, R, load_X, sum_S, peak_S, norm_S, slot_first_X, slot_pos_P, kind_first, pool_F, value_F, slot_F,
                step_F, valid_F, pool_at_P, kind_P, value_P, order_P, group_P, slot_P, gload_GK, load_NK, caps_K,
                goal, near, max_swaps, guard_P, guard_X, guard_peak_S, guard_room, budget_1):  # pragma: no cover
    """Swap samples of one kind from each step's heaviest rank to lighter ranks, in place.

    Steps are visited in the order ``steps``; while a step's idle share ``(max - mean) / max`` is
    above ``goal``, its heaviest rank p gives: each of its samples x is paired with the ``near``
    pool samples y of x's kind whose value is nearest to ``value(x) - (L_p - mean)`` (less than
    x's), and of the pairs that keep every cap, raise no step's maximum (nor a guarded module's
    past ``guard_room`` x its step's maximum: the LLM, whose tokens an audio swap changes too)
    and lower the squared spread ``sum_s sum_r (L_sr - mean_s)^2 / norm_s^2`` (the exact change,
    step means included), the one that lowers it most swaps. A step whose heaviest rank finds none is left.

    Args:
        steps: (V,) steps to visit, in order.
        R: ranks per step; slot ``s * R + r``.
        load_X: (S * R,) each slot's load of the module (isolated groups' included).
        sum_S: (S,) each step's total load.
        peak_S: (S,) each step's heaviest rank's load.
        norm_S: (S,) each step's normalization (its mean rank load before the pass, > 0).
        slot_first_X: (S * R + 1,) each slot's first entry in ``slot_pos_P``.
        slot_pos_P: positions of the samples that may move, slot by slot.
        kind_first: (kinds + 1,) each kind's first entry in the pool.
        pool_F: positions that may take (on ranks below their step's mean), by kind then value.
        value_F: the pool entries' values (ascending within a kind).
        slot_F, step_F: the pool entries' slots (``slot_P[pool_F]``) and their steps (``slot_F //
            R``): the scan reads them and ``value_F`` in order, not through ``pool_F`` (a position
            keeps its slot and a valid entry its value), and divides nothing.
        valid_F: whether an entry still holds the value it was sorted by (a swap clears it).
        pool_at_P: (P,) each position's pool entry, -1 for none.
        kind_P: (P,) each position's kind (equal on every other module and source), -1: fixed.
        value_P: (P,) the module's cost of the sample at each position.
        order_P: (P,) the sample at each position (swapped in place).
        group_P: (P,) each position's group.
        slot_P: (P,) each position's slot.
        gload_GK: (G, KL) each group's load, checked against ``caps_K``.
        load_NK: (N, KL) each sample's load.
        caps_K: (KL,) caps per group.
        goal: a step at or below this idle share is done.
        near: pool candidates per sample.
        max_swaps: swaps at most.
        guard_P: (P,) the guarded module's cost of the sample at each position (swapped in place),
            or empty for none: no rank's load of it may pass its step's maximum.
        guard_X: (S * R,) each slot's load of the guarded module (updated in place).
        guard_peak_S: (S,) each step's maximum of it (updated in place).
        guard_room: the most a rank's guarded load may reach, as a multiple of its step's maximum
            (1: not past it; ``inf``: the guard only tracks the loads).
        budget_1: (1,) int64 pool entries the searches may still read (lowered by those read): a
            heaviest rank's search starts only while it is above 0, and runs to its end, so a
            budget never reached changes nothing.

    Returns:
        The number of swaps made.
    """
    KL = len(caps_K)
    guarded = len(guard_P) > 0
    swaps = 0
    for s in steps:
        base = s * R
        while swaps < max_swaps:
            if budget_1[0] <= 0:
                return swaps
            p, top = _peak(load_X, base, R)
            mean_s = sum_S[s] / R
            if top <= 0 or (top - mean_s) / top <= goal:
                break
            excess = top - mean_s
            best, best_x, best_y = -1e-12, -1, -1
            inv_s = 1.0 / (norm_S[s] * norm_S[s])
            for i in range(slot_first_X[base + p], slot_first_X[base + p + 1]):
                x = slot_pos_P[i]
                kind = kind_P[x]
                if kind < 0:
                    continue
                lo, hi = kind_first[kind], kind_first[kind + 1]
                vx = value_P[x]
                end = lo + np.searchsorted(value_F[lo:hi], vx)  # values below x's only
                mid = lo + np.searchsorted(value_F[lo:end], vx - excess)
                start = max(lo, min(mid - near // 2, end - near))
                budget_1[0] -= max(0, min(end, start + near) - start)
                for f in range(start, min(end, start + near)):
                    if not valid_F[f]:
                        continue
                    q = slot_F[f]
                    t = step_F[f]
                    d = vx - value_F[f]
                    lq = load_X[q]
                    if t == s:
                        if lq + d >= top:
                            continue
                        change = 2.0 * d * (d + lq - top) * inv_s
                    else:
                        if lq + d > peak_S[t]:
                            continue
                        mean_t = sum_S[t] / R
                        change = ((d * d - 2.0 * d * (top - mean_s) - d * d / R) * inv_s
                                  + (d * d + 2.0 * d * (lq - mean_t) - d * d / R) / (norm_S[t] * norm_S[t]))
                    if change >= best:
                        continue
                    y = pool_F[f]
                    if guarded:
                        d2 = guard_P[x] - guard_P[y]
                        if (guard_X[base + p] - d2 > guard_peak_S[s] * guard_room
                                or guard_X[q] + d2 > guard_peak_S[t] * guard_room):
                            continue
                    fits = True
                    gx, gy = group_P[x], group_P[y]
                    sx, sy = order_P[x], order_P[y]
                    for k in range(KL):
                        delta = load_NK[sx, k] - load_NK[sy, k]
                        if gload_GK[gy, k] + delta > caps_K[k] or gload_GK[gx, k] - delta > caps_K[k]:
                            fits = False
                            break
                    if fits:
                        best, best_x, best_y = change, x, y
            if best_x < 0:
                break
            x, y = best_x, best_y
            sx, sy = order_P[x], order_P[y]
            for k in range(KL):
                delta = load_NK[sx, k] - load_NK[sy, k]
                gload_GK[group_P[x], k] -= delta
                gload_GK[group_P[y], k] += delta
            d = value_P[x] - value_P[y]
            order_P[x], order_P[y] = sy, sx
            value_P[x], value_P[y] = value_P[y], value_P[x]
            load_X[slot_P[x]] -= d
            load_X[slot_P[y]] += d
            sum_S[s] -= d
            sum_S[slot_P[y] // R] += d
            peak_S[s] = _peak(load_X, base, R)[1]  # another step's peak stays: its rank took no more
            if guarded:
                d2 = guard_P[x] - guard_P[y]
                guard_P[x], guard_P[y] = guard_P[y], guard_P[x]
                guard_X[slot_P[x]] -= d2
                guard_X[slot_P[y]] += d2
                for u in (s, slot_P[y] // R):
                    guard_peak_S[u] = _peak(guard_X, u * R, R)[1]
            for z in (x, y):  # their values changed: no longer where the pool sorted them
                if pool_at_P[z] >= 0:
                    valid_F[pool_at_P[z]] = False
            swaps += 1
    return swaps
