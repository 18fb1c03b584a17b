"""Loop kernels of elastic re-planning: each rank's samples of a unit cut into batches (numba when installed).

Inputs and outputs are flat, as in :mod:`balancer_cli.replay.elastic_kernels`. The plan of a
window is written like a manifest's rows: ``perm_P`` lists the window's sample positions by
(unit, rank, batch), each rank's in manifest order, and batch ``b`` of rank ``r`` in unit ``u``
is ``perm_P[bnd_B1[i]:bnd_B1[i + 1]]`` with ``i = base_u + r * batches_U[u] + b`` (``base_u``:
the batches of the units before). Without numba the kernels run as Python, with the same results.

Example:
    >>> rank_P, weight_P = np.array([0, 1, 0, 1]), np.full(4, 0.25)
    >>> perm_P, bnd_B1 = np.zeros(4, np.int64), np.zeros(5, np.int64)
    >>> _ = cut_units(rank_P, weight_P, np.array([0, 4]), np.array([2]), 2, perm_P, bnd_B1)
    >>> perm_P.tolist(), bnd_B1.tolist()
    ([0, 2, 1, 3], [0, 1, 2, 3, 4])
"""

from __future__ import annotations

import numpy as np

from balancer_cli._jit import njit

__all__ = ["cut_units", "cap_units", "rank_batches"]


@njit
def cut_units(rank_P, weight_P, unit_U1, batches_U, world_size, perm_P, bnd_B1):  # pragma: no cover - compiled
    """Every rank's ``k`` batches of each unit, cut at nearly equal weight. Writes ``perm_P``, ``bnd_B1``.

    A rank's samples (in manifest order) are cut where the running weight comes nearest to
    ``j / k`` of the rank's total (the earlier cut on ties), moved right where needed so every
    batch keeps at least one sample; this never changes the rank's load. A rank without samples
    (a unit with fewer samples than ranks) gets one empty batch.
    """
    U = len(unit_U1) - 1
    R = world_size
    n_max = 0
    for u in range(U):
        n_max = max(n_max, unit_U1[u + 1] - unit_U1[u])
    start = np.zeros(R + 1, np.int64)
    fill = np.zeros(R, np.int64)
    cum = np.zeros(n_max + 1)
    B = 0
    bnd_B1[0] = 0
    for u in range(U):
        o = unit_U1[u]
        n = unit_U1[u + 1] - o
        k = batches_U[u]
        start[:] = 0
        for i in range(n):
            start[rank_P[o + i] + 1] += 1
        for r in range(R):
            start[r + 1] += start[r]
            fill[r] = start[r]
        for i in range(n):  # stable: each rank's samples stay in manifest order
            r = rank_P[o + i]
            perm_P[o + fill[r]] = o + i
            fill[r] += 1
        for r in range(R):
            s = o + start[r]
            cnt = start[r + 1] - start[r]
            cum[0] = 0.0
            for t in range(cnt):
                cum[t + 1] = cum[t] + weight_P[perm_P[s + t]]
            total = cum[cnt]
            run = 0
            for j in range(1, k):
                target = total * (float(j) / float(k))
                first = 0  # entries of cum below the target (cum never decreases)
                while first < cnt and cum[first] < target:
                    first += 1
                below = cum[first - 1] if first > 0 else cum[0]
                near = first - 1 if abs(below - target) <= abs(cum[first] - target) else first
                slack = min(max(near - j, 0), cnt - k)
                run = slack if j == 1 else max(run, slack)
                bnd_B1[B + 1] = s + run + j
                B += 1
            bnd_B1[B + 1] = s + cnt
            B += 1
    return bnd_B1


@njit
def cap_units(perm_P, bnd_B1, unit_U1, batches_U, world_size, weight_P, load_PK, caps_K,
              fallback_U):  # pragma: no cover - compiled
    """Keep the packer's caps: recut each rank's batches that break one. Rewrites ``bnd_B1``.

    A batch fits when it is one sample or its summed loads are within ``caps_K``. A rank whose
    equal-weight cut does not fit is recut greedily in manifest order (a new batch when the next
    sample would break a cap or pass the weight target ``total / k`` by more than half its
    weight; failing that, by the caps alone), then split at balanced points up to ``k``
    batches. A unit where some rank cannot fit ``k`` batches gets ``fallback_U[u] = 1`` (the
    caller plans it by whole groups).
    """
    U = len(unit_U1) - 1
    R = world_size
    Kc = len(caps_K)
    n_max = 0
    for u in range(U):
        n_max = max(n_max, unit_U1[u + 1] - unit_U1[u])
    out = np.zeros(n_max + 2, np.int64)
    acc = np.zeros(Kc, np.int64)
    B = 0
    for u in range(U):
        k = batches_U[u]
        for r in range(R):
            b0 = B + r * k
            s, e = bnd_B1[b0], bnd_B1[b0 + k]
            fits = True
            for b in range(k):
                if not _fits(perm_P, bnd_B1[b0 + b], bnd_B1[b0 + b + 1], load_PK, caps_K, acc):
                    fits = False
                    break
            if fits:
                continue
            m = _recut(perm_P, s, e, weight_P, load_PK, caps_K, k, out, acc)
            if m < 0:
                fallback_U[u] = 1
                break
            for b in range(1, k):
                bnd_B1[b0 + b] = s + out[b]
        B += R * k
    return fallback_U


@njit
def _fits(perm_P, a, b, load_PK, caps_K, acc):  # pragma: no cover - compiled
    if b - a <= 1:
        return True
    acc[:] = 0
    for t in range(a, b):
        for k in range(len(caps_K)):
            acc[k] += load_PK[perm_P[t], k]
    for k in range(len(caps_K)):
        if acc[k] > caps_K[k]:
            return False
    return True


@njit
def _greedy(perm_P, s, cnt, weight_P, load_PK, caps_K, target, use_target, out, acc):  # pragma: no cover - compiled
    """Cap-aware greedy cuts of one rank's samples into ``out``; returns the number of batches."""
    m = 0
    out[0] = 0
    acc[:] = 0
    acc_w = 0.0
    for i in range(cnt):
        x = perm_P[s + i]
        over = False
        for k in range(len(caps_K)):
            if acc[k] + load_PK[x, k] > caps_K[k]:
                over = True
        if i > out[m] and (over or (use_target and acc_w + 0.5 * weight_P[x] > target)):
            m += 1
            out[m] = i
            acc[:] = 0
            acc_w = 0.0
        for k in range(len(caps_K)):
            acc[k] += load_PK[x, k]
        acc_w += weight_P[x]
    m += 1
    out[m] = cnt
    return m


@njit
def _recut(perm_P, s, e, weight_P, load_PK, caps_K, k, out, acc):  # pragma: no cover - compiled
    """One rank's ``k`` cuts under the caps into ``out[0..k]``, or -1 when ``k`` batches cannot fit."""
    cnt = e - s
    total = 0.0
    for i in range(cnt):
        total += weight_P[perm_P[s + i]]
    m = _greedy(perm_P, s, cnt, weight_P, load_PK, caps_K, total / k, True, out, acc)
    if m > k:
        m = _greedy(perm_P, s, cnt, weight_P, load_PK, caps_K, 0.0, False, out, acc)
        if m > k:
            return -1
    while m < k:  # split the heaviest batch of two or more samples (the first on ties)
        best, best_sum = -1, 0.0
        for i in range(m):
            a, b = out[i], out[i + 1]
            if b - a <= 1:
                continue
            t = 0.0
            for x in range(a, b):
                t += weight_P[perm_P[s + x]]
            if best < 0 or t > best_sum:
                best, best_sum = i, t
        a, b = out[best], out[best + 1]
        whole = 0.0
        for x in range(a, b - 1):
            whole += weight_P[perm_P[s + x]]
        whole += weight_P[perm_P[s + b - 1]]
        part, cut, gap = 0.0, a + 1, np.inf
        for x in range(a, b - 1):  # left part's weight at each cut a+1 .. b-1
            part += weight_P[perm_P[s + x]]
            g = abs(2.0 * part - whole)
            if g < gap:
                cut, gap = x + 1, g
        for i in range(m, best, -1):
            out[i + 1] = out[i]
        out[best + 1] = cut
        m += 1
    return m


@njit
def rank_batches(perm_P, bnd_B1, unit_U1, batches_U, world_size, rank, samples_P):  # pragma: no cover - compiled
    """``rank``'s batches of the window, flat: ``(samples, bounds)``, batch ``i`` at
    ``samples[bounds[i]:bounds[i + 1]]``."""
    U = len(unit_U1) - 1
    total, nb, B = 0, 0, 0
    for u in range(U):
        k = batches_U[u]
        b0 = B + rank * k
        total += bnd_B1[b0 + k] - bnd_B1[b0]
        nb += k
        B += world_size * k
    samples = np.empty(total, np.int64)
    bounds = np.empty(nb + 1, np.int64)
    bounds[0] = 0
    t, i, B = 0, 0, 0
    for u in range(U):
        k = batches_U[u]
        b0 = B + rank * k
        for b in range(k):
            for x in range(bnd_B1[b0 + b], bnd_B1[b0 + b + 1]):
                samples[t] = samples_P[perm_P[x]]
                t += 1
            i += 1
            bounds[i] = t
        B += world_size * k
    return samples, bounds
