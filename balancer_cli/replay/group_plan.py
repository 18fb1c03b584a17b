"""The whole-group plan of elastic replay: packed groups split or merged, then dealt out by LPT.

Sample-level re-planning (:mod:`balancer_cli.replay.replan`) falls back to this plan for a step
whose samples cannot be cut into batches under the packer's caps: splitting a packed group never
breaks a cap, so every batch of this plan fits when the step has at most ``k * R'`` groups.

Example:
    >>> import numpy as np
    >>> groups, _, _ = adjust_group_count([np.array([0, 1, 2]), np.array([3])], np.ones(4), 4)
    >>> [g.tolist() for g in groups], assign_groups(np.array([1., 1., 1., 1.]), 2, 2)
    ([[0], [1], [2], [3]], [[0, 2], [1, 3]])
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from balancer_cli.errors import ManifestError

__all__ = ["adjust_group_count", "assign_groups"]


def _split_point(costs: list) -> int:
    """Cut index in 1..n-1 that makes the two halves' costs closest (first one on ties)."""
    total, best, best_gap, acc = sum(costs), 1, None, 0.0
    for cut, c in enumerate(costs[:-1], start=1):
        acc += c
        gap = abs(2.0 * acc - total)
        if best_gap is None or gap < best_gap:
            best, best_gap = cut, gap
    return best


def _group_costs(groups: Sequence[np.ndarray], sample_cost: np.ndarray) -> list:
    """Per-group summed cost as Python floats, with one gather for the whole step."""
    sizes = [len(g) for g in groups]
    if not groups or sum(sizes) == 0:
        return [0.0] * len(groups)
    flat = np.asarray(sample_cost[np.concatenate(groups)], dtype=np.float64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return np.add.reduceat(flat, starts).tolist()


def adjust_group_count(
    groups: Sequence[np.ndarray], sample_cost: np.ndarray, target: int
) -> tuple[list[np.ndarray], int, int]:
    """Split or merge groups until there are exactly ``target`` of them.

    Args:
        groups: non-empty (n_g,) int64 arrays of sample indices, in manifest order.
        sample_cost: (N,) per-sample cost indexed by sample.
        target: number of groups wanted; at most the total number of samples.

    Returns:
        ``(groups, splits, merges)``: the new groups in manifest order (a split group's halves stay
        in place; a merged group sits where its first part was), and how many splits and merges.

    Raises:
        ManifestError: ``target`` is above the number of samples.

    Example:
        >>> g, s, m = adjust_group_count([np.array([0, 1]), np.array([2])], np.array([1., 1., 5.]), 3)
        >>> [x.tolist() for x in g], s, m
        ([[0], [1], [2]], 1, 0)
    """
    total = sum(len(g) for g in groups)
    if target > total:
        raise ManifestError(f"cannot make {target} non-empty batches from {total} samples")
    # Each group carries a sort key (its manifest position, then split halves), so the output
    # order is deterministic and follows the manifest.
    keyed = [((i,), np.asarray(g, dtype=np.int64)) for i, g in enumerate(groups)]
    splits = merges = 0
    costs = _group_costs(groups, sample_cost)
    if len(keyed) < target:
        heap = [(-c, key, g) for c, (key, g) in zip(costs, keyed) if len(g) > 1]
        done = [(key, g) for key, g in keyed if len(g) <= 1]
        heapq.heapify(heap)
        while len(heap) + len(done) < target:
            _, key, g = heapq.heappop(heap)
            member_costs = np.asarray(sample_cost[g], dtype=np.float64).tolist()
            cut = _split_point(member_costs)
            for half_key, half, half_cost in (((*key, 0), g[:cut], sum(member_costs[:cut])),
                                              ((*key, 1), g[cut:], sum(member_costs[cut:]))):
                if len(half) > 1:
                    heapq.heappush(heap, (-half_cost, half_key, half))
                else:
                    done.append((half_key, half))
            splits += 1
        keyed = done + [(key, g) for _, key, g in heap]
    elif len(keyed) > target:
        heap = [(c, key, g) for c, (key, g) in zip(costs, keyed)]
        heapq.heapify(heap)
        while len(heap) > target:
            cost_a, key_a, a = heapq.heappop(heap)
            cost_b, key_b, b = heapq.heappop(heap)
            (key_a, a), (key_b, b) = sorted([(key_a, a), (key_b, b)], key=lambda kv: kv[0])
            heapq.heappush(heap, (cost_a + cost_b, key_a, np.concatenate([a, b])))
            merges += 1
        keyed = [(key, g) for _, key, g in heap]
    keyed.sort(key=lambda kv: kv[0])
    return [g for _, g in keyed], splits, merges


def assign_groups(group_costs: np.ndarray, world_size: int, batches_per_rank: int) -> list[list[int]]:
    """LPT assignment of ``world_size * batches_per_rank`` groups, exactly ``batches_per_rank`` per rank.

    Returns:
        Per rank, the group indices it gets, ascending (manifest order).

    Example:
        >>> assign_groups(np.array([5., 1., 4., 2.]), 2, 2)
        [[0, 1], [2, 3]]
    """
    if len(group_costs) != world_size * batches_per_rank:
        raise ValueError(f"{len(group_costs)} groups for {world_size} x {batches_per_rank} batches")
    cost_list = np.asarray(group_costs, dtype=np.float64).tolist()
    order = sorted(range(len(cost_list)), key=lambda g: (-cost_list[g], g))
    heap = [(0.0, rank) for rank in range(world_size)]
    taken: list[list[int]] = [[] for _ in range(world_size)]
    for g in order:
        load, rank = heapq.heappop(heap)
        taken[rank].append(g)
        if len(taken[rank]) < batches_per_rank:
            heapq.heappush(heap, (load + cost_list[g], rank))
    return [sorted(t) for t in taken]
