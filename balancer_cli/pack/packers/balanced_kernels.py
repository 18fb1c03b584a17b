"""Loops that cannot be vectorized: sequential greedy packing and local-search refinement.

They are compiled with numba (``cache=True``) when it is importable and run as plain Python
otherwise (same results, slower), so numba stays an accelerator, not a correctness dependency.
All randomness is drawn by the callers with numpy and passed in: the kernels are deterministic.

Example:
    >>> import numpy as np
    >>> greedy_close(np.array([[3, 10], [3, 10], [4, 10]]), np.array([9, 100])).tolist()
    [0, 2, 3]
"""

from __future__ import annotations

import numpy as np

from balancer_cli._jit import HAVE_NUMBA, njit

__all__ = ["HAVE_NUMBA", "greedy_close", "first_fit", "refine_pass", "targeted_pass"]


@njit
def greedy_close(load_PK, caps_K):  # pragma: no cover - compiled
    """Offsets of groups formed by walking rows in order, closing a group when the next row would
    exceed a cap. Every row must fit the caps on its own. The trailing open group is kept."""
    P, K = load_PK.shape
    offsets = np.empty(P + 1, dtype=np.int64)
    offsets[0] = 0
    ng = 0
    acc = np.zeros(K, dtype=np.int64)
    for p in range(P):
        over = False
        for k in range(K):
            if acc[k] + load_PK[p, k] > caps_K[k]:
                over = True
                break
        if over and p > offsets[ng]:
            ng += 1
            offsets[ng] = p
            for k in range(K):
                acc[k] = 0
        for k in range(K):
            acc[k] += load_PK[p, k]
    if P > offsets[ng]:
        ng += 1
        offsets[ng] = P
    return offsets[: ng + 1]


@njit
def first_fit(rows, load_NK, caps_K, min_rest_PK, lookback):  # pragma: no cover - compiled
    """First fit over the open groups, in the given row order (decreasing size for FFD).

    A group leaves the open list once some module's room is below what every remaining row
    needs (``min_rest_PK[p]``: per-module minimum load of rows p..end), so scans stay short;
    at most ``lookback`` open groups are tried (circularly, from where the last scan stopped)
    before a new group opens.

    Returns:
        (P,) group id per row, in ``rows`` order, and the number of groups."""
    P = len(rows)
    K = load_NK.shape[1]
    gid = np.empty(P, dtype=np.int64)
    lsum = np.zeros((P, K), dtype=np.int64)
    open_ids = np.empty(P, dtype=np.int64)
    n_open = 0
    G = 0
    cursor = 0
    for p in range(P):
        i = rows[p]
        placed = -1
        tried = 0
        # Circular scan from where the last one stopped: a group that failed a larger row gets
        # revisited when smaller rows come (rows arrive in decreasing size).
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
def _penalty(sum_GK, g, delta_K, sign, target_K, inv_t2_K):  # pragma: no cover
    total = 0.0
    for k in range(len(target_K)):
        d = sum_GK[g, k] + sign * delta_K[k] - target_K[k]
        total += d * d * inv_t2_K[k]
    return total


@njit
def refine_pass(order_G, cand_GC, members_GS, count_G, sum_GK, lsum_GK, weight_NK, load_NK, caps_K,
                target_K, inv_t2_K, tol):  # pragma: no cover
    """One pass of local search: for each group (in ``order_G``), try every swap of one sample
    with one of a candidate partner's samples, and every move of one sample between the two,
    that keeps both under the caps; apply the one that most lowers
    ``sum_k ((sum_gk - target_k) / target_k)^2`` over the pair. ``weight_NK`` / ``sum_GK`` may
    have more columns than ``load_NK`` (balance-only terms, e.g. per-source counts); caps apply
    to the load columns. Returns the number of changes."""
    G, S = members_GS.shape
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
                i = members_GS[g, a] if a >= 0 else -1
                for b in range(-1, nh):
                    if a < 0 and b < 0:
                        continue
                    j = members_GS[h, b] if b >= 0 else -1
                    # sizes after the exchange must stay in [1, S]
                    new_ng = ng - (a >= 0) + (b >= 0)
                    new_nh = nh - (b >= 0) + (a >= 0)
                    if new_ng < 1 or new_nh < 1 or new_ng > S or new_nh > S:
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
        i = members_GS[g, best_a] if best_a >= 0 else -1
        j = members_GS[h, best_b] if best_b >= 0 else -1
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
            members_GS[g, best_a] = members_GS[g, count_G[g]]
        if best_b >= 0:
            count_G[h] -= 1
            members_GS[h, best_b] = members_GS[h, count_G[h]]
        if j >= 0:
            members_GS[g, count_G[g]] = j
            count_G[g] += 1
        if i >= 0:
            members_GS[h, count_G[h]] = i
            count_G[h] += 1
        changes += 1
    return changes


@njit
def targeted_pass(order_G, members_GS, count_G, group_of_N, pos_N, sum_GK, lsum_GK, weight_NK, load_NK,
                  caps_K, target_K, inv_t_K, inv_t2_K, cell_of_N, cell_start, cell_rows, width, dims_K, scan,
                  tol):  # pragma: no cover
    """One pass of targeted swaps: for each off-target group g and member i, look up samples j
    whose weight is near ``w_i - t * dev_g`` (t = 1/2 and 1) in a grid of normalized weights,
    and apply the swap (i <-> j) that most lowers the pair's penalty within the caps.

    ``cell_of_N``/``cell_start``/``cell_rows``: rows bucketed by ``floor(w * inv_t / width)``
    per module (``dims_K`` cells each, row-major). Returns the number of swaps."""
    G, S = members_GS.shape
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
            i = members_GS[g, a]
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
        members_GS[g, pi] = j
        members_GS[h, pj] = i
        group_of_N[j] = g
        pos_N[j] = pi
        group_of_N[i] = h
        pos_N[i] = pj
        changes += 1
    return changes


@njit
def _norm_order(wsum_GK, inv_t_K):  # pragma: no cover - compiled
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
    for k in range(len(caps_K)):
        if lsum_GK[g, k] + load_NK[i, k] > caps_K[k]:
            return False
    return True


@njit
def deal_rounds(queue, load_NK, weight_NK, caps_K, G, inv_t_K, max_stragglers):  # pragma: no cover
    """Deal ``queue`` (rows, biggest first) in rounds of G, each row of a round to the next
    lightest group (normalized weight ``sum_k w_k * inv_t_k``, stable ties); a row that breaks a
    cap gets a second chance on the unused groups with the most room in their fullest module,
    then waits for the next round. When no row of a round fits, up to ``max_stragglers`` left
    rows go one by one to the lightest group with room.

    Returns:
        (n,) group id per queue position, or an empty array when some row found no room.
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
        order = np.argsort(_norm_order(wsum, inv_t_K), kind="mergesort")
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
            spare = spare_ids[np.argsort(fill[:n_spare], kind="mergesort")]
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
            # The lightest groups are full in some module: place the few stragglers in the
            # lightest group that still has room, or give up (first fit takes over).
            if m + (n - pos) > max_stragglers:
                return np.empty(0, dtype=np.int64)
            for c in range(m + (n - pos)):
                p = chunk[c] if c < m else pos + (c - m)
                i = queue[p]
                key = _norm_order(wsum, inv_t_K)
                b = -1
                for g in range(G):
                    if _fits(lsum, g, load_NK, i, caps_K) and (b < 0 or key[g] < key[b]):
                        b = g
                if b < 0:
                    return np.empty(0, dtype=np.int64)
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
