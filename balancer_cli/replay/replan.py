"""Balanced elastic re-planning of whole windows of steps at once (vectorized over steps).

A step (or run of steps) of a manifest packed for ``R`` ranks is re-planned for ``R'`` ranks with
``k`` batches each, as a pure function of its samples, the per-sample cost of every module and
``R'`` (every rank computes the same plan without collectives):

1. **Weights.** Each module's per-sample cost is divided by the module's step total, so every
   module counts equally; a sample's weight is the sum over modules (unit cost without lengths).
2. **LPT over samples.** Heaviest sample first (manifest position on ties) to the least loaded
   rank (lowest rank on ties); a rank left with fewer than ``k`` samples takes the lightest
   samples of the rank with the most. Balancing samples,
   not packed groups, removes the group-granularity floor of the old whole-group plan (a
   perfectly packed 4x2 manifest replayed on 3 ranks at Dist Ratio 0.11).
3. **Swaps** (two or more modules): the rank with the highest load of any module swaps one
   sample with another rank when that lowers the pair's peak, up to 16 rounds (numba kernel).
4. **Batches.** A rank's samples, in manifest order, are cut into ``k`` batches of nearly equal
   weight (at least one sample each); this never changes the rank's load.
5. **Caps** (when the per-sample capped quantities and the packer's caps are given): a cut that
   puts a batch over a cap is replaced by a cap-aware one; a step where some rank cannot fit
   ``k`` batches under the caps falls back, for every rank, to the whole-group plan.

Every step is computed on its own rows of padded ``(U, n)`` arrays with sequential per-row sums,
so a step's plan is bit-identical whether it is planned alone (resume) or inside a window of
steps (iteration), and on every rank. Per step, with one module, LPT keeps every rank within one
sample of the mean: ``max_r load_r <= mean + max sample``; with unit cost the per-rank sample
counts differ by at most one, the least a step of ``n`` samples allows.

Example:
    >>> import numpy as np
    >>> samples = [np.arange(8)]; offsets = [np.array([0, 2, 4, 6, 8])]
    >>> plan = plan_window(samples, offsets, np.ones((8, 1)), world_size=3, batches_U=np.array([2]))
    >>> [[b.tolist() for b in batches] for batches in plan[0]]
    [[[0], [3, 6]], [[1], [4, 7]], [[2], [5]]]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from balancer_cli.replay.elastic_kernels import lpt_swap
from balancer_cli.replay.group_plan import adjust_group_count, assign_groups

__all__ = ["assign_ranks", "plan_window", "plan_window_rank"]

_SWAP_ROUNDS = 16


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
    """(U, n) rank of every sample of every step (-1 past a step's end).

    Per step: LPT by summed normalized cost, heaviest first (manifest position on ties) to the
    least loaded rank (lowest on ties), so ``max_r load_r <= mean + max sample``; then, with two
    or more modules, up to ``swap_rounds`` swaps lower the peak module load (see
    :func:`balancer_cli.replay.elastic_kernels.lpt_swap`). Callers enforce ``k`` samples per
    rank with :func:`_ensure_counts`.

    Example:
        >>> cost_UnK = np.array([[[0.5], [0.25], [0.25]]])  # one step of 3 samples, one module
        >>> assign_ranks(cost_UnK, np.array([3]), world_size=2).tolist()
        [[0, 1, 1]]
    """
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
    """Plan ``U`` steps for every rank: ``plan[u][rank]`` is that rank's ``batches_U[u]`` batches.

    Args:
        samples_U: per step, its (n_u,) int64 samples in manifest order.
        offsets_U: per step, its group offsets into ``samples_U[u]`` (``[0, .., n_u]``); used only
            by the cap-safe fallback.
        cost_NK: (N, K) per-sample cost of each module, indexed by sample; ``None`` for unit cost.
        world_size: ``R'``; batches_U: (U,) batches per rank of each step (``k * R' <= n_u``).
        load_NK, caps_K: (N, K) per-sample capped quantities (encoder items, LLM tokens) and the
            packer's (K,) caps. With both, no batch exceeds a cap unless it is one sample: a
            rank's equal-cost cut that breaks a cap is replaced by a cap-aware cut, and when some
            rank of a step cannot fit its samples in ``k`` batches under the caps, the whole step
            (every rank) takes the whole-group plan (packed groups split, never merged when the
            step has at most ``k * R'`` groups). Every rank computes every rank's cut, so the
            decision is the same on all ranks. Without them, batches are cut by cost only.

    Example:
        >>> samples = [np.arange(4)]; offsets = [np.array([0, 1, 2, 3, 4])]
        >>> load_NK, caps_K = np.array([[100], [100], [200], [800]]), np.array([900])
        >>> [[b.tolist() for b in batches] for batches in plan_window(samples, offsets, None, 1, np.array([2]))[0]]
        [[[0, 1], [2, 3]]]
        >>> [[b.tolist() for b in batches]
        ...  for batches in plan_window(samples, offsets, None, 1, np.array([2]), load_NK, caps_K)[0]]
        [[[0, 1, 2], [3]]]
    """
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


def plan_window_rank(samples_U: Sequence[np.ndarray], offsets_U: Sequence[np.ndarray], cost_NK: np.ndarray | None,
                     world_size: int, batches_U: np.ndarray, rank: int, load_NK: np.ndarray | None = None,
                     caps_K: np.ndarray | None = None) -> tuple[list[int], list[int]]:
    """One rank's batches of ``U`` steps, flat: ``(samples, bounds)`` with batch ``i`` at
    ``samples[bounds[i]:bounds[i+1]]``; the same batches as :func:`plan_window` (with caps, every
    rank's cut is computed so the fallback decision is shared).

    Example:
        >>> samples = [np.arange(8)]; offsets = [np.array([0, 2, 4, 6, 8])]
        >>> plan_window_rank(samples, offsets, np.ones((8, 1)), 3, np.array([2]), rank=1)
        ([1, 4, 7], [0, 1, 3])
    """
    if load_NK is not None and caps_K is not None:
        plan = plan_window(samples_U, offsets_U, cost_NK, world_size, batches_U, load_NK, caps_K)
        mine = [b for step in plan for b in step[rank]]
        bounds = np.concatenate([[0], np.cumsum([len(b) for b in mine])]).astype(np.int64)
        flat = np.concatenate(mine) if mine else np.empty(0, np.int64)
        return flat.tolist(), bounds.tolist()
    weight, rank_of, sizes = _assign(samples_U, cost_NK, world_size, batches_U)
    unit, pos, cuts = _rank_batches(rank_of, weight, rank, batches_U)
    base = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    flat = np.concatenate(list(samples_U))[base[unit] + pos] if len(unit) else np.empty(0, np.int64)
    return flat.tolist(), cuts.tolist()


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
