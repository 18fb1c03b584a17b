"""The elastic re-planning as it was before its kernels (a copy of its all-ranks path, kept as the test oracle).

The compiled kernels of :mod:`balancer_cli.replay.replan` must plan every step bit-identically to
this numpy implementation (tests/replay/test_replay_replan_kernels.py compares them).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from balancer_cli._jit import njit
from balancer_cli.replay.group_plan import adjust_group_count, assign_groups

__all__ = ["plan_window"]

_SWAP_ROUNDS = 16


@njit
def lpt_swap(cost_UnK, sizes_U, order_Un, world_size, swap_rounds, rank_of_Un):
    U, _, K = cost_UnK.shape
    R = world_size
    load = np.zeros((R, K))
    total = np.zeros(R)
    for u in range(U):
        n = sizes_U[u]
        load[:, :] = 0.0
        total[:] = 0.0
        for j in range(n):
            i = order_Un[u, j]
            best = 0
            for r in range(1, R):
                if total[r] < total[best]:
                    best = r
            rank_of_Un[u, i] = best
            for k in range(K):
                load[best, k] += cost_UnK[u, i, k]
                total[best] += cost_UnK[u, i, k]
        for _ in range(swap_rounds):
            p, peak = 0, -1.0
            for r in range(R):
                for k in range(K):
                    if load[r, k] > peak:
                        p, peak = r, load[r, k]
            best_score, best_a, best_b = peak * (1.0 - 1e-9), -1, -1
            for a in range(n):
                if rank_of_Un[u, a] != p:
                    continue
                for b in range(n):
                    q = rank_of_Un[u, b]
                    if q == p:
                        continue
                    score = 0.0
                    for k in range(K):
                        d = cost_UnK[u, a, k] - cost_UnK[u, b, k]
                        score = max(score, load[p, k] - d, load[q, k] + d)
                    if score < best_score:
                        best_score, best_a, best_b = score, a, b
            if best_a < 0:
                break
            q = rank_of_Un[u, best_b]
            for k in range(K):
                d = cost_UnK[u, best_a, k] - cost_UnK[u, best_b, k]
                load[p, k] -= d
                load[q, k] += d
                total[p] -= d
                total[q] += d
            rank_of_Un[u, best_a], rank_of_Un[u, best_b] = q, p
    return rank_of_Un


def _normalized_costs(samples_U: Sequence[np.ndarray], cost_NK: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(U, n, K) per-sample cost of each module over its step total (0 past a step's end) and
    (U,) step sizes."""
    U = len(samples_U)
    sizes = np.fromiter((len(s) for s in samples_U), dtype=np.int64, count=U)
    n = int(sizes.max(initial=0))
    K = 1 if cost_NK is None else cost_NK.shape[1]
    cost = np.zeros((U, n, K), dtype=np.float64)
    valid = np.arange(n)[None, :] < sizes[:, None]
    if cost_NK is None:
        cost[valid] = 1.0
    elif U:
        cost[valid] = cost_NK[np.concatenate(list(samples_U))]
    # Sequential sums along a row (cumsum) so a step's numbers do not depend on the window's
    # padding (pairwise summation would regroup with the row length).
    total = np.cumsum(cost, axis=1)[:, -1, :] if n else np.zeros((U, K))
    cost *= np.divide(1.0, total, out=np.zeros_like(total), where=total > 0)[:, None, :]
    return cost, sizes


def assign_ranks(cost_UnK: np.ndarray, sizes_U: np.ndarray, world_size: int, swap_rounds: int = _SWAP_ROUNDS) -> np.ndarray:
    U, n, K = cost_UnK.shape
    sizes = np.asarray(sizes_U, dtype=np.int64)
    valid = np.arange(n)[None, :] < sizes[:, None]
    weight = cost_UnK.sum(axis=2)
    order = np.argsort(np.where(valid, -weight, np.inf), axis=1, kind="stable").astype(np.int64)
    rank_of = np.full((U, n), -1, dtype=np.int64)
    lpt_swap(np.ascontiguousarray(cost_UnK), sizes, order, int(world_size), int(swap_rounds if K > 1 else 0), rank_of)
    return rank_of


def _ensure_counts(rank_of_Un: np.ndarray, weight_Un: np.ndarray, world_size: int, batches_U: np.ndarray) -> None:
    """Give every rank at least ``k`` samples: a rank short of them takes the lightest sample of
    the rank with the most, until none is short (rare: heavy samples can leave a rank short)."""
    k = np.asarray(batches_U, dtype=np.int64)
    counts = np.stack([(rank_of_Un == r).sum(axis=1) for r in range(world_size)], axis=1)
    for u in np.flatnonzero((counts < k[:, None]).any(axis=1)).tolist():
        c = counts[u].copy()
        while c.min() < k[u]:
            short, rich = int(np.argmin(c)), int(np.argmax(c))
            mine = np.flatnonzero(rank_of_Un[u] == rich)
            rank_of_Un[u, mine[np.argmin(weight_Un[u, mine])]] = short
            c[short] += 1
            c[rich] -= 1


def _rank_batches(rank_of_Un: np.ndarray, weight_Un: np.ndarray, rank: int,
                  batches_U: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One rank's samples as positions (manifest order per step) and its batches.

    Returns:
        ``(unit_U, pos, cuts)``: per selected sample its step and position, and the ``sum(batches_U) + 1``
        cuts into them, ``batches_U[u]`` batches per step of nearly equal cost (at least one sample each).
    """
    unit, pos = np.nonzero(rank_of_Un == rank)  # row-major: steps in order, positions ascending
    U = rank_of_Un.shape[0]
    k = np.asarray(batches_U, dtype=np.int64)
    counts = np.bincount(unit, minlength=U)
    starts = np.concatenate([[0], np.cumsum(counts)])
    n = int(counts.max(initial=0))  # the most samples the rank has in a step
    w = np.zeros((U, n), dtype=np.float64)
    slot = np.arange(len(unit)) - starts[unit]
    w[unit, slot] = weight_Un[unit, pos]
    cum = np.zeros((U, n + 1), dtype=np.float64)
    np.cumsum(w, axis=1, out=cum[:, 1:])
    L = int(k.max(initial=1))
    frac = np.arange(1, L, dtype=np.float64)[None, :] / k[:, None]  # (U, L-1), >= 1 past k-1
    target = cum[:, -1:] * frac
    first = (cum[:, None, :] < target[:, :, None]).sum(axis=2)  # (U, L-1)
    below = np.take_along_axis(cum, np.clip(first - 1, 0, n)[:, :], axis=1)
    above = np.take_along_axis(cum, np.clip(first, 0, n), axis=1)
    near = np.where(np.abs(below - target) <= np.abs(above - target), first - 1, first)
    j = np.arange(1, L, dtype=np.int64)[None, :]
    slack = np.clip(near - j, 0, (counts - k)[:, None])
    inner = np.maximum.accumulate(slack, axis=1) + j  # (U, L-1): at least one sample per batch
    keep = j < k[:, None]
    cuts_UL = np.concatenate([np.zeros((U, 1), np.int64), np.where(keep, inner, -1), counts[:, None]], axis=1)
    cuts_UL[:, 1:] = np.where(cuts_UL[:, 1:] >= 0, cuts_UL[:, 1:] + starts[:-1, None], -1)
    cuts = cuts_UL[:, 1:][cuts_UL[:, 1:] >= 0]
    return unit, pos, np.concatenate([[0], cuts]).astype(np.int64)


def _assign(samples_U, cost_NK, world_size, batches_U):
    cost, sizes = _normalized_costs(samples_U, cost_NK)
    weight = cost.sum(axis=2)
    rank_of = assign_ranks(cost, sizes, world_size)
    _ensure_counts(rank_of, weight, world_size, batches_U)
    return weight, rank_of, sizes


def plan_window(samples_U: Sequence[np.ndarray], offsets_U: Sequence[np.ndarray], cost_NK: np.ndarray | None,
                world_size: int, batches_U: np.ndarray, load_NK: np.ndarray | None = None,
                caps_K: np.ndarray | None = None) -> list[list[list[np.ndarray]]]:
    weight, rank_of, _ = _assign(samples_U, cost_NK, world_size, batches_U)
    if load_NK is not None and caps_K is not None:
        pos_plan = _capped_plan(samples_U, offsets_U, weight, rank_of, world_size, batches_U, load_NK,
                                np.asarray(caps_K, dtype=np.int64))
        return [[[samples_U[u][p] for p in batches] for batches in step] for u, step in enumerate(pos_plan)]
    plan: list[list[list[np.ndarray]]] = [[] for _ in samples_U]
    for rank in range(world_size):
        _, pos, cuts = _rank_batches(rank_of, weight, rank, batches_U)
        first = 0
        for u, k in enumerate(np.asarray(batches_U).tolist()):
            batch_pos = [pos[a:b] for a, b in zip(cuts[first:first + k].tolist(), cuts[first + 1:first + k + 1].tolist())]
            plan[u].append([samples_U[u][p] for p in batch_pos])
            first += k
    return plan


# ----------------------------------------------------------------------------- caps
def _fits(load_nK: np.ndarray, caps_K: np.ndarray) -> bool:
    """A batch respects the packer's caps, or is one sample (an isolated oversize one may exceed them)."""
    return len(load_nK) <= 1 or bool((load_nK.sum(axis=0) <= caps_K).all())


def _greedy_cuts(load_nK: np.ndarray, w_n: list, caps_K: np.ndarray, target: float | None) -> list[int]:
    """Cuts of a cap-aware greedy pass in manifest order: a new batch starts when the next sample
    would push the batch over a cap or (with ``target``) past the cost target by more than half
    the sample. Without ``target`` it makes the fewest batches any cut in this order can."""
    cuts, acc, acc_w = [0], np.zeros(len(caps_K), dtype=np.int64), 0.0
    for i in range(len(w_n)):
        over = bool(((acc + load_nK[i]) > caps_K).any())
        if i > cuts[-1] and (over or (target is not None and acc_w + 0.5 * w_n[i] > target)):
            cuts.append(i)
            acc, acc_w = np.zeros_like(acc), 0.0
        acc = acc + load_nK[i]
        acc_w += w_n[i]
    cuts.append(len(w_n))
    return cuts


def _capped_rank_cuts(load_nK: np.ndarray, w_n: np.ndarray, caps_K: np.ndarray, k: int,
                      cuts: list[int]) -> list[int] | None:
    """One rank's ``k`` batches of one step with no batch over the caps (``cuts`` into its
    samples), or ``None`` when ``k`` contiguous batches cannot respect them.

    The equal-cost cut is kept when it already respects the caps; else a cap-aware greedy cut
    (cost target first, then caps only) is split at balanced points up to ``k`` batches
    (splitting never breaks a cap).
    """
    if all(_fits(load_nK[a:b], caps_K) for a, b in zip(cuts, cuts[1:])):
        return cuts
    w = w_n.tolist()
    total = sum(w)
    for target in (total / k, None):
        out = _greedy_cuts(load_nK, w, caps_K, target)
        if len(out) - 1 <= k:
            break
    else:
        return None
    while len(out) - 1 < k:
        span = [(sum(w[a:b]), -i) for i, (a, b) in enumerate(zip(out, out[1:])) if b - a > 1]
        _, neg = max(span)
        a, b = out[-neg], out[-neg + 1]
        part = np.cumsum(w[a:b - 1])  # left part's weight at each cut a+1..b-1
        whole = part[-1] + w[b - 1]
        out.insert(-neg + 1, a + 1 + int(np.argmin(np.abs(2.0 * part - whole))))
    return out


def _group_fallback(offsets: np.ndarray, weight_n: np.ndarray, world_size: int, k: int) -> list[list[np.ndarray]]:
    """The whole-group plan (positions): packed groups split (never merged when they number at
    most ``k * R'``) to ``k * R'`` batches, ``k`` per rank by LPT."""
    groups = [np.arange(a, b, dtype=np.int64) for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
    batches, _, _ = adjust_group_count(groups, weight_n, k * world_size)
    costs = np.array([float(np.cumsum(weight_n[g])[-1]) for g in batches])
    return [[batches[g] for g in taken] for taken in assign_groups(costs, world_size, k)]


def _capped_plan(samples_U, offsets_U, weight_Un, rank_of_Un, world_size, batches_U, load_NK, caps_K):
    """``plan[u][rank]``: positions of each batch, with the caps respected (see :func:`plan_window`)."""
    ks = np.asarray(batches_U, dtype=np.int64).tolist()
    per_rank = []
    for rank in range(world_size):
        unit, pos, cuts = _rank_batches(rank_of_Un, weight_Un, rank, batches_U)
        per_rank.append((unit, pos, cuts))
    plan, first = [], 0
    for u, k in enumerate(ks):
        load_nK = np.asarray(load_NK, dtype=np.int64)[samples_U[u]]
        step = []
        for unit, pos, cuts in per_rank:
            c = cuts[first:first + k + 1]
            p = pos[c[0]:c[-1]]
            rc = _capped_rank_cuts(load_nK[p], weight_Un[u, p], caps_K, k, (c - c[0]).tolist())
            if rc is None:
                step = None
                break
            step.append([p[a:b] for a, b in zip(rc, rc[1:])])
        if step is None:
            step = _group_fallback(np.asarray(offsets_U[u]), weight_Un[u], world_size, k)
        plan.append(step)
        first += k
    return plan
