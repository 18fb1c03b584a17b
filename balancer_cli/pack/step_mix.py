"""Even out the source mix of the steps: samples of equal loads trade places between steps.

The assigner balances each step's source mix within a cell of similar groups, and the class mix
(:mod:`balancer_cli.pack.packers._class_mix`) the mix across classes of equal encoder sums; what
is left is the cells' own spread, which grows with the groups per step (a step of 256 groups
draws from many cells: 163k samples at ``--dp 128`` x 2 micro-batches left steps 1.30x less mixed
than random batching), and, where sources differ in length, the steps' sample counts (a text-only
mix whose long source holds 30% of the samples: each step's count of it was even, its share was
not, 1.32x). :func:`even_step_mix` trades, between different steps,

1. two groups of equal encoder sums (loads and weights) whose LLM weights differ by at most
   ``tolerance`` x the mean group LLM weight: they swap slots (step, rank, micro);
2. then two samples of different sources with equal encoder loads and weights and LLM weights
   within the same tolerance: they swap groups (within the LLM cap),

each when it brings both steps' source counts closer to their share of the global mix. Every group
keeps its encoder sums and every step its classes of them (so its ranks' encoder balance); the LLM
loads move by at most the tolerance, and no step's LLM spread over its ranks grows past
:data:`SPREAD` (or past its own where that is larger). Deterministic: no random draws. It runs only where the steps
are at least :data:`STEP_MIX_ABOVE` x as far from the mix as random draws (so it costs nothing
where the mix is already good).

**Loose trades** (``loose`` > 0). Equal encoder *weights* are rare where a module's tokens are
continuous (audio clips of 50-1500 tokens: few rows or groups of the same key share them within a
lookahead), and at one LLM tolerance (~24 tokens a group) few such rows are near enough: on a 243k
three-module input at ``--dp 64`` x 2, the audio sources' steps stayed 1.33x less mixed than random
batching (a 5% source's share 2.4x as far from its mean), where dealing the same rows of each key
at random would have mixed them at ~0.95x. Loose trades of ``loose`` = x accept encoder weights
within x times the mean group's (loads stay equal: every cap and class holds), LLM weights within
2x times the mean group's and steps' LLM spreads up to x, and leave the ranks to the stages after
this one (the polish evens each slot's groups): at 0.03 that input's steps mix at 0.26x, at 0.1
at 0.21x, every module's Dist as before. They run as retries of
:func:`~balancer_cli.pack.step_stages.place_steps`, kept only where the window then meets more of
the contract.

Example:
    Steps 0 and 1 hold only source 0 and only source 1; rows 0 and 2 have the same loads, and so
    do groups 0 and 1, which trade steps:

    >>> import numpy as np
    >>> from balancer_cli.pack.types import Assignment, Packing
    >>> p = Packing(np.arange(4), np.array([0, 2, 4]), np.zeros(2, bool), np.array([], np.int64), ())
    >>> a = Assignment(step=np.array([0, 1]), rank=np.array([0, 0]), micro=np.array([0, 0]), num_steps=2)
    >>> load = np.array([[1, 100], [1, 100], [1, 100], [1, 100]])
    >>> q, b = even_step_mix(p, a, load.astype(float), load, np.array([4, 300]), np.array([0, 1, 0, 1]))
    >>> b.step.tolist(), q.order.tolist()  # the groups were already as mixed as can be: nothing moves
    ([0, 1], [0, 1, 2, 3])
    >>> q, b = even_step_mix(p, a, load.astype(float), load, np.array([4, 300]), np.array([0, 0, 1, 1]))
    >>> q.order.tolist()  # a sample of each source trades places
    [2, 1, 0, 3]
"""

from __future__ import annotations

import dataclasses

import numpy as np

from balancer_cli._index import sum_rows, take_column, take_rows
from balancer_cli._jit import njit
from balancer_cli._sort import lexsort_order
from balancer_cli.metrics import random_mix_distance
from balancer_cli.pack.assign import MAX_SOURCES, group_source_counts, source_columns, source_deviation
from balancer_cli.pack.packers._class_mix import CLASS_MIX_TOLERANCE
from balancer_cli.pack.types import Assignment, Packing, group_sums, row_ids

__all__ = ["even_step_mix", "STEP_MIX_ABOVE", "LOOKAHEAD", "GROUP_PASSES", "GROUP_LOOKAHEAD", "GROUP_BUDGET",
           "SPREAD"]

#: The swaps run when the steps' mean distance to the global mix is at least this share of a
#: random step's expected distance (the measured step mix ratio is then about this or more).
STEP_MIX_ABOVE = 0.8
#: Rows further on in (key, LLM weight) order tried as a row's partner.
LOOKAHEAD = 64
#: A trade may raise a step's LLM spread over its ranks, ``(max - mean) / max``, up to this (a
#: fifth of what the Dist bound allows), never one already above it.
SPREAD = 1e-3
#: Passes over the groups (a group traded once may trade again once others have moved), and the
#: most groups further on in (key, LLM weight) order tried as a group's partner: fewer where the
#: groups are many, so that the passes try at most ``GROUP_BUDGET`` pairs (a text-only 20k at
#: ``--dp 16``: mix 1.32x -> 1.19x with 64 partners in one pass, 1.10x in four, 0.12x with 1,024 in 8).
GROUP_PASSES = 8
GROUP_LOOKAHEAD = 1024
GROUP_BUDGET = 1 << 25


def even_step_mix(packing: Packing, assignment: Assignment, weight_nK: np.ndarray, load_nK: np.ndarray,
                  caps_K: np.ndarray, source_n: np.ndarray, *, mix_GO: np.ndarray | None = None,
                  max_sources: int = MAX_SOURCES, tolerance: float = CLASS_MIX_TOLERANCE,
                  loose: float = 0.0) -> tuple[Packing, Assignment]:
    """The packing and assignment with groups and rows traded between steps (see the module docstring).

    Args:
        packing: groups of the window's rows 0..n-1 (order and offsets).
        assignment: the slot of every group.
        weight_nK, load_nK: (n, K) balanced weights and capped loads (LLM last).
        caps_K: (K,) caps; only the LLM's can be approached.
        source_n: (n,) source code of every row.
        mix_GO: the groups' source counts, :func:`~balancer_cli.pack.assign.group_source_counts`
            with ``max_sources`` (what the assigner was given); computed when None.
        max_sources: sources tracked: the ``max_sources - 1`` most frequent, the rest as one.
        tolerance: largest LLM weight difference of two traded groups or rows, as a share of the
            mean group LLM weight.
        loose: above 0, the loose trades' share (the module docstring): encoder weights within
            it of the mean group's need not be equal.

    Returns:
        ``(packing, assignment)``: the same objects where nothing moved, else copies.
    """
    G, K = packing.num_groups, np.asarray(load_nK).shape[1]
    order = np.asarray(packing.order, dtype=np.int64)
    S = int(assignment.num_steps)
    if K < 1 or G < 2 or S < 2 or len(order) == 0:
        return packing, assignment
    if mix_GO is None:
        mix_GO = group_source_counts(packing, source_n, max_sources)
    mix_GO = np.asarray(mix_GO, dtype=np.float64)
    O = mix_GO.shape[1]
    if O < 2:
        return packing, assignment
    dev_GO = source_deviation(mix_GO, G)  # what a group adds to its step's excess
    step_G = np.asarray(assignment.step, dtype=np.int64).copy()
    excess_SO = sum_rows(step_G, dev_GO, S)
    if not _biased(excess_SO, np.bincount(step_G, weights=mix_GO.sum(axis=1), minlength=S),
                   mix_GO.sum(axis=0) / mix_GO.sum()):
        return packing, assignment
    gid_P = packing.group_ids()
    weight = np.asarray(weight_nK, dtype=np.float64)
    wsum_GK = group_sums(packing, weight)
    limit = max(tolerance, 2.0 * loose) * float(wsum_GK[:, -1].mean())
    enc_limit_E = loose * wsum_GK[:, :-1].mean(axis=0)  # 0: equal weights
    spread = max(SPREAD, loose)
    # 1. Groups of equal encoder sums, neighbours in (encoder sums, LLM weight) order, trade slots.
    key_G = row_ids(group_sums(packing, np.asarray(load_nK)[:, :-1])) if K > 1 else np.zeros(G, np.int64)
    slot_G = np.stack([step_G, np.asarray(assignment.rank, np.int64), np.asarray(assignment.micro, np.int64)], 1)
    lookahead = int(np.clip(GROUP_BUDGET // (G * GROUP_PASSES), 8, GROUP_LOOKAHEAD))
    R = int(np.asarray(assignment.rank).max()) + 1
    load_SR = np.bincount(step_G * R + slot_G[:, 1], weights=wsum_GK[:, -1], minlength=S * R).reshape(S, R)
    # The walks read the groups' tables copied in (key, LLM weight) order, sequentially; the slots
    # they trade are put back in group order after the passes.
    by_G = lexsort_order(wsum_GK[:, -1], key_G)
    sorted_G = (np.take(key_G, by_G), take_rows(wsum_GK[:, :-1], by_G), np.take(wsum_GK[:, -1], by_G),
                take_rows(dev_GO, by_G), take_rows(slot_G, by_G))
    stat_S4 = _step_stats(load_SR)
    moved = 0
    for _ in range(GROUP_PASSES):  # a group traded once may trade again once others have moved
        done = _swap_groups(*sorted_G, excess_SO, load_SR, stat_S4, limit, lookahead, enc_limit_E, spread)
        moved += done
        if not done:
            break
    if moved:
        slot_G[by_G] = sorted_G[-1]
        dtype = np.asarray(assignment.step).dtype
        assignment = Assignment(step=slot_G[:, 0].astype(dtype), rank=slot_G[:, 1].astype(dtype),
                                micro=slot_G[:, 2].astype(dtype), num_steps=S)
    # 2. Rows of equal encoder loads trade groups.
    weight_PK = take_rows(weight, order)
    load_PK = take_rows(np.asarray(load_nK), order)
    lsum_G = group_sums(packing, np.asarray(load_nK)[:, -1].astype(np.int64))
    key_P = row_ids(load_PK[:, :-1]) if K > 1 else np.zeros(len(order), np.int64)
    src_P = source_columns(packing, source_n, max_sources)[0]
    rows = order.copy()
    # The walk reads the rows' tables copied once in (key, LLM weight) order, sequentially.
    by_P = lexsort_order(weight_PK[:, -1], key_P)
    gid_by = np.take(gid_P, by_P)
    swaps = _swap_rows(by_P, take_rows(weight_PK[:, :-1], by_P), np.take(key_P, by_P), np.take(weight_PK[:, -1], by_P),
                       np.take(load_PK[:, -1], by_P).astype(np.int64), gid_by, take_column(slot_G, gid_by, 0),
                       take_column(slot_G, gid_by, 1), np.take(src_P, by_P).astype(np.int64), rows, excess_SO, lsum_G,
                       load_SR, stat_S4, int(np.asarray(caps_K)[-1]), limit, LOOKAHEAD, enc_limit_E, spread)
    if swaps:
        packing = dataclasses.replace(packing, order=rows.astype(np.asarray(packing.order).dtype, copy=False))
    return packing, assignment


def _biased(excess_SO: np.ndarray, size_S: np.ndarray, share_O: np.ndarray) -> bool:
    """Whether the steps' mean distance to the global mix is at least :data:`STEP_MIX_ABOVE` x
    a random step's (:func:`~balancer_cli.metrics.random_mix_distance`)."""
    sizes = np.maximum(size_S, 1.0)
    distance = 0.5 * float((np.abs(excess_SO).sum(axis=1) / sizes).mean())
    return distance >= STEP_MIX_ABOVE * float(random_mix_distance(share_O, sizes).mean())


@njit
def _swap_groups(key_G, enc_GE, wllm_G, dev_GO, slot_G, excess_SO, load_SR, stat_S4, limit,
                 lookahead, enc_limit_E, spread):  # pragma: no cover - compiled
    """Walk the groups, their tables in (key, LLM weight) order; swap the slots (``slot_G``, updated)
    of each untaken one with the first of the next ``lookahead`` (same key, encoder weights within
    ``enc_limit_E``, LLM weight within ``limit``, another step) whose swap lowers the two steps'
    summed |excess| and keeps their spreads over the ranks of ``load_SR`` (the ranks' LLM weight per
    step; :func:`_spread_kept` with ``spread``)."""
    n = len(key_G)
    O = dev_GO.shape[1]
    taken = np.zeros(n, np.bool_)
    swaps = 0
    for g in range(n):
        if taken[g]:
            continue
        s = slot_G[g, 0]
        for h in range(g + 1, min(n, g + 1 + lookahead)):
            if key_G[h] != key_G[g] or wllm_G[h] - wllm_G[g] > limit:
                break
            t = slot_G[h, 0]
            if taken[h] or t == s:
                continue
            change = 0.0  # s trades g for h, t the reverse
            for o in range(O):
                d = dev_GO[h, o] - dev_GO[g, o]
                change += (abs(excess_SO[s, o] + d) - abs(excess_SO[s, o])
                           + abs(excess_SO[t, o] - d) - abs(excess_SO[t, o]))
            if change >= -1e-9:
                continue
            same = True
            for e in range(enc_GE.shape[1]):
                same = same and abs(enc_GE[g, e] - enc_GE[h, e]) <= enc_limit_E[e]
            dw = wllm_G[h] - wllm_G[g]  # g's rank in s gains dw, h's rank in t loses it
            rg, rh = slot_G[g, 1], slot_G[h, 1]
            if not same or not (_spread_kept(load_SR, stat_S4, s, rg, dw, spread)
                                and _spread_kept(load_SR, stat_S4, t, rh, -dw, spread)):
                continue
            load_SR[s, rg] += dw
            load_SR[t, rh] -= dw
            _refresh(load_SR, stat_S4, s)
            _refresh(load_SR, stat_S4, t)
            for o in range(O):
                d = dev_GO[h, o] - dev_GO[g, o]
                excess_SO[s, o] += d
                excess_SO[t, o] -= d
            for c in range(3):
                slot_G[g, c], slot_G[h, c] = slot_G[h, c], slot_G[g, c]
            taken[g] = True
            taken[h] = True
            swaps += 1
            break
    return swaps


@njit
def _step_stats(load_SR):  # pragma: no cover - compiled
    """(S, 4) per step: its ranks' largest load (at least 0), that rank, the largest of the other
    ranks' (at least 0) and the total: what :func:`_spread_kept` reads instead of the R loads."""
    stat_S4 = np.zeros((load_SR.shape[0], 4))
    for s in range(load_SR.shape[0]):
        _refresh(load_SR, stat_S4, s)
    return stat_S4


@njit
def _refresh(load_SR, stat_S4, s):  # pragma: no cover - compiled
    """Step s's row of :func:`_step_stats`, after its loads changed."""
    top, arg, second, total = 0.0, 0, 0.0, 0.0
    for q in range(load_SR.shape[1]):
        v = load_SR[s, q]
        if v > top:
            top, arg, second = v, q, top
        elif v > second:
            second = v
        total += v
    stat_S4[s, 0], stat_S4[s, 1], stat_S4[s, 2], stat_S4[s, 3] = top, arg, second, total


@njit
def _spread_kept(load_SR, stat_S4, s, r, delta, spread):  # pragma: no cover - compiled
    """Whether step s's spread ``(max - mean) / max`` over its ranks, when rank r's load changes by
    ``delta``, stays within ``spread`` (:data:`SPREAD`) or its current one. From the step's largest loads and
    total (:func:`_step_stats`): O(1), where summing the ranks cost O(R) a candidate pair (at
    ``--dp 1024`` most of the trades' time)."""
    R = load_SR.shape[1]
    top, total = stat_S4[s, 0], stat_S4[s, 3]
    now = (top - total / R) / top if top > 0 else 0.0
    other = stat_S4[s, 2] if int(stat_S4[s, 1]) == r else top
    new_top = max(other, load_SR[s, r] + delta)
    new = (new_top - (total + delta) / R) / new_top if new_top > 0 else 0.0
    return new <= max(spread, now)


@njit
def _swap_rows(by_P, enc_PE, key_P, wtok_P, tok_P, gid_P, step_P, rank_P, src_P, rows_P, excess_SO, lsum_G, load_SR,
               stat_S4, cap, limit, lookahead, enc_limit_E, spread):  # pragma: no cover - compiled
    """Walk the positions in (key, LLM weight) order (``by_P``; the other (P,) tables but ``rows_P``
    in that order too); swap each untaken one with the first of the next ``lookahead`` (same key,
    encoder weights within ``enc_limit_E``, LLM weight within ``limit``, another step and source,
    both groups within ``cap``) whose swap lowers both steps' summed |excess| and keeps their
    spreads (:func:`_spread_kept` with ``spread``): their rows trade places in ``rows_P`` (in the
    original order)."""
    n = len(by_P)
    taken = np.zeros(n, np.bool_)
    swaps = 0
    for x in range(n):
        if taken[x]:
            continue
        s, a = step_P[x], src_P[x]
        if excess_SO[s, a] < 0.5:  # x's step has no surplus of x's source to give
            continue
        for y in range(x + 1, min(n, x + 1 + lookahead)):
            if key_P[y] != key_P[x] or wtok_P[y] - wtok_P[x] > limit:
                break
            t, b = step_P[y], src_P[y]
            if taken[y] or t == s or b == a:
                continue
            # |e| summed over the four entries the swap changes: s loses a, gains b; t the reverse.
            before = (abs(excess_SO[s, a]) + abs(excess_SO[s, b]) + abs(excess_SO[t, a]) + abs(excess_SO[t, b]))
            after = (abs(excess_SO[s, a] - 1) + abs(excess_SO[s, b] + 1) + abs(excess_SO[t, a] + 1)
                     + abs(excess_SO[t, b] - 1))
            if after >= before - 1e-9:
                continue
            same = True
            for e in range(enc_PE.shape[1]):
                same = same and abs(enc_PE[x, e] - enc_PE[y, e]) <= enc_limit_E[e]
            g, h = gid_P[x], gid_P[y]
            d = tok_P[y] - tok_P[x]
            if not same or lsum_G[g] + d > cap or lsum_G[h] - d > cap:
                continue
            dw = wtok_P[y] - wtok_P[x]  # g's rank in s gains dw, h's rank in t loses it
            rg, rh = rank_P[x], rank_P[y]
            if not (_spread_kept(load_SR, stat_S4, s, rg, dw, spread)
                    and _spread_kept(load_SR, stat_S4, t, rh, -dw, spread)):
                continue
            load_SR[s, rg] += dw
            load_SR[t, rh] -= dw
            _refresh(load_SR, stat_S4, s)
            _refresh(load_SR, stat_S4, t)
            px, py = by_P[x], by_P[y]
            rows_P[px], rows_P[py] = rows_P[py], rows_P[px]
            lsum_G[g] += d
            lsum_G[h] -= d
            excess_SO[s, a] -= 1
            excess_SO[s, b] += 1
            excess_SO[t, a] += 1
            excess_SO[t, b] -= 1
            taken[x] = True
            taken[y] = True
            swaps += 1
            break
    return swaps
