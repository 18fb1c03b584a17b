"""Even out the groups that run side by side: swaps and moves between the groups of one slot.

The packer makes all groups equal to one global target and the assigner puts groups of one
class (equal item counts) side by side; what is left is the spread of the R groups of a slot
(a step and micro-batch index: one micro-batch per rank, run at the same time). Here the groups
of each slot of an uneven step exchange samples so that they equal *their own* mean, within the
caps: the packer's local search (:func:`~balancer_cli.pack.packers._refine_kernels.refine_pass`;
the targets cancel in a pair's exchange, so the slot's mean needs no term of its own) with
partner groups drawn from the slot. A sample stays in its step, so every step's source mix is
unchanged: only ranks within a step trade samples. A discrete module's terms (tiles: few distinct
group sums) weigh :data:`DISCRETE_WEIGHT` times the others': the tile stage before the polish
evens out a step's tiles, and a swap that evened the LLM at the price of a tile undid it.

With M > 1 micro-batches a rank's load is the sum of its M groups, so what is evened out is
the *ranks'* sums: the slots of a step are polished one micro-batch at a time, each group
carrying its rank's sum in the objective (a rank has one group per slot, so the pass keeps
that sum exact), and a heavy group can offset a light one of the same rank (three-module
inputs at 2-4 micro-batches: docs/packing.md).

Example:
    >>> import numpy as np
    >>> from balancer_cli.pack.types import Assignment, Packing
    >>> p = Packing(order=np.array([0, 1, 2, 3]), group_offsets=np.array([0, 2, 4]),
    ...             isolated=np.zeros(2, bool), dropped=np.zeros(0, np.int64), dropped_reason=())
    >>> a = Assignment(step=np.array([0, 0]), rank=np.array([0, 1]), micro=np.array([0, 0]), num_steps=1)
    >>> cost = np.array([[0., 9.], [0., 8.], [0., 1.], [0., 2.]])
    >>> q = polish_steps(p, a, cost, cost.astype(np.int64), np.array([1, 20]))
    >>> sorted(sorted(cost[g, 1].tolist()) for g in q.groups())  # 17 + 3 -> 10 + 10
    [[1.0, 9.0], [2.0, 8.0]]
"""

from __future__ import annotations

import numpy as np

from balancer_cli._index import concat_ranges, sum_rows, take_rows
from balancer_cli._shuffle import permutation
from balancer_cli.pack._blocks import discrete_modules
from balancer_cli.pack.packers._refine_kernels import refine_pass
from balancer_cli.pack.types import Assignment, Packing, group_sums

__all__ = ["polish_steps", "polish_passes", "POLISH_PASSES", "POLISH_ROWS", "POLISH_MAX_ROWS", "POLISH_PARTNERS",
           "POLISH_ABOVE", "DISCRETE_WEIGHT"]

#: Passes over the uneven slots' groups at most; each draws new partners (16 instead of 4: on 48
#: random inputs the LLM Dist fell on 41 and rose on none, 60k samples at ``--dp 64`` x 2 went
#: from 0.0050 to 0.0042; real 70k at ``--dp 8``: +0.11 s).
POLISH_PASSES = 16
#: Row-passes a window's polish may cost (:func:`polish_passes`): a pass over 1.2M rows costs
#: ~0.4 s and its setup ~0.3 s.
POLISH_ROWS = 2_000_000
#: Windows above this many rows are not polished: their Dist Ratio is within bounds already
#: (1.2M: 0.003) and a 10M run's 780k-row windows would pay a pass each (+9 s CPU).
POLISH_MAX_ROWS = 600_000
#: Partners per group and pass, drawn from its slot.
POLISH_PARTNERS = 3
#: A step is polished when a module's idle share ``(max - mean) / max`` over its ranks exceeds
#: this: below it the step is already within the Dist Ratio the packer aims at.
POLISH_ABOVE = 0.002
#: Weight of a discrete module's (tiles') terms in the polish's objective, over the others': one
#: tile off on two ~20-tile ranks then outweighs their LLM loads +-50% apart, so the polish keeps
#: even tiles (48 `sparse` inputs: vision Dist over the bound in 2 -> 0, the LLM's in 1 -> 1;
#: docs/packing.md, "Tiles kept by the polish").
DISCRETE_WEIGHT = 100.0


def polish_steps(packing: Packing, assignment: Assignment, cost_NK: np.ndarray, load_NK: np.ndarray,
                 caps_K: np.ndarray, *, seed: int = 0, passes: int = POLISH_PASSES) -> Packing:
    """The packing with the groups of each uneven step evened out (see the module docstring).

    Groups keep their index (so their slot); isolated oversize groups, groups the assigner left
    out and steps already even are not touched.

    Args:
        packing: groups (G of them) as the assigner placed them.
        assignment: the groups' slots.
        cost_NK: (N, K) per-sample cost to balance.
        load_NK: (N, K) per-sample integer load, checked against ``caps_K``.
        caps_K: (K,) caps per group.
        seed: seeds the visiting orders and partner draws.
        passes: passes over the uneven steps' groups.

    Returns:
        A :class:`Packing` of the same samples, groups and slots (``packing`` itself when no step
        is uneven).
    """
    G = packing.num_groups
    offsets = np.asarray(packing.group_offsets, dtype=np.int64)
    if G < 2 or passes < 1 or offsets[-1] == 0:
        return packing
    order = np.asarray(packing.order, dtype=np.int64)
    cost = np.asarray(cost_NK, dtype=np.float64)
    count = np.diff(offsets)
    csum_GK = group_sums(packing, cost)
    unit_G, usum_UK, step_U = _rank_units(assignment, csum_GK)
    active_G = ~np.asarray(packing.isolated, dtype=bool) & (count > 0)
    groups_J, size_S = _uneven_slots(assignment, active_G, unit_G, usum_UK, step_U)
    J = len(groups_J)
    if J < 2:
        return packing
    # The chosen groups renumbered slot by slot, their rows group by group: a slot's data lies together.
    count_J = count[groups_J]
    starts_J = np.concatenate([[0], np.cumsum(count_J)[:-1]])
    rows_F = order[concat_ranges(offsets[groups_J], count_J)]
    weight_FK = take_rows(cost, rows_F)
    load_FK = take_rows(np.asarray(load_NK), rows_F).astype(np.int64, copy=False)
    lsum_JK = np.add.reduceat(load_FK, starts_J, axis=0)
    X = int(count_J.max()) + 4
    members_JX = np.full((J, X), -1, np.int64)
    members_JX[np.repeat(np.arange(J), count_J), np.arange(len(rows_F)) - np.repeat(starts_J, count_J)] = \
        np.arange(len(rows_F))
    target_K = csum_GK.mean(axis=0)
    inv_t = np.divide(1.0, target_K, out=np.zeros_like(target_K), where=target_K > 0)
    weight_K = inv_t**2 * np.where(discrete_modules(csum_GK[active_G]), DISCRETE_WEIGHT, 1.0)
    # Each group's partners are drawn from its own slot: the slot's first group and size.
    start_J = np.repeat(np.cumsum(size_S) - size_S, size_S)
    size_J = np.repeat(size_S, size_S)
    rng = np.random.default_rng(seed)
    caps = np.asarray(caps_K, dtype=np.int64)
    micro_J = np.asarray(assignment.micro, dtype=np.int64)[groups_J]
    unit_J = unit_G[groups_J]
    micros = np.unique(micro_J)
    for _ in range(passes):
        cand = start_J[:, None] + rng.integers(0, 1 << 62, (J, POLISH_PARTNERS)) % size_J[:, None]
        visit = permutation(rng, J)
        changed = 0
        for m in micros:
            # Each group carries its rank's sum (M = 1: its own); within one micro-batch a rank has
            # one group, so the pass keeps the sums exact.
            own = visit[micro_J[visit] == m]
            rank_JK = np.ascontiguousarray(usum_UK[unit_J])
            before = rank_JK[own]
            # tol -1: a group is never "on target" (the target is the global mean, not the slot's).
            changed += refine_pass(own, cand, members_JX, count_J, rank_JK, lsum_JK, weight_FK,
                                   np.zeros(0, np.int8), load_FK, caps, target_K, weight_K, -1.0)
            usum_UK[unit_J[own]] += rank_JK[own] - before
        if changed == 0:
            break
    new_count = count.copy()
    new_count[groups_J] = count_J
    new_offsets = np.concatenate([[0], np.cumsum(new_count)])
    new_order = np.empty_like(order)
    kept = np.ones(G, bool)
    kept[groups_J] = False
    new_order[concat_ranges(new_offsets[:-1][kept], count[kept])] = \
        order[concat_ranges(offsets[:-1][kept], count[kept])]
    mask = np.arange(X)[None, :] < count_J[:, None]
    new_order[concat_ranges(new_offsets[groups_J], count_J)] = rows_F[members_JX[mask]]
    return Packing(order=new_order, group_offsets=new_offsets, isolated=packing.isolated, dropped=packing.dropped,
                   dropped_reason=packing.dropped_reason)


def polish_passes(num_rows: int) -> int:
    """Passes for a window of ``num_rows`` rows: as many as :data:`POLISH_ROWS` row-passes allow, up
    to :data:`POLISH_PASSES`; none above :data:`POLISH_MAX_ROWS` rows.

    Example:
        >>> polish_passes(70_000), polish_passes(300_000), polish_passes(780_000)
        (16, 6, 0)
    """
    if num_rows > POLISH_MAX_ROWS:
        return 0
    return min(POLISH_PASSES, POLISH_ROWS // max(int(num_rows), 1))


def _rank_units(assignment, csum_GK):
    """(unit_G, usum_UK, step_U): each placed group's (step, rank) unit (-1: left out), each
    unit's summed cost (isolated groups' included: they run on the rank too) and its step."""
    step = np.asarray(assignment.step, dtype=np.int64)
    rank = np.asarray(assignment.rank, dtype=np.int64)
    placed = step >= 0
    world = int(rank[placed].max()) + 1 if placed.any() else 1
    units, unit = np.unique(step[placed] * world + rank[placed], return_inverse=True)
    usum_UK = sum_rows(unit, csum_GK[placed], len(units))
    unit_G = np.full(len(step), -1, np.int64)
    unit_G[placed] = unit
    return unit_G, usum_UK, units // world


def _uneven_slots(assignment, active_G, unit_G, usum_UK, step_U):
    """(groups_J, size_S): the ``active_G`` groups of the steps where a module's idle share
    ``(max - mean) / max`` over the ranks exceeds :data:`POLISH_ABOVE`, slot by slot, and the
    number of groups of each such slot."""
    micro = np.asarray(assignment.micro, dtype=np.int64)
    step = np.asarray(assignment.step, dtype=np.int64)
    slot_G = step * (int(micro.max()) + 1) + micro
    groups = np.flatnonzero(active_G & (unit_G >= 0))
    if len(groups) == 0:
        return groups, np.zeros(0, np.int64)
    # Units are numbered in (step, rank) order: each step's ranks lie together.
    first = np.flatnonzero(np.concatenate([[True], step_U[1:] != step_U[:-1]]))
    peak = np.maximum.reduceat(usum_UK, first, axis=0)
    mean = np.add.reduceat(usum_UK, first, axis=0) / np.diff(np.append(first, len(usum_UK)))[:, None]
    idle = np.divide(peak - mean, peak, out=np.zeros_like(peak), where=peak > 0).max(axis=1)
    groups = groups[np.isin(step[groups], step_U[first][idle > POLISH_ABOVE])]
    groups = groups[np.argsort(slot_G[groups], kind="stable")]
    slot = slot_G[groups]
    if len(groups) == 0:
        return groups, np.zeros(0, np.int64)
    first = np.flatnonzero(np.concatenate([[True], slot[1:] != slot[:-1]]))
    return groups, np.diff(np.append(first, len(groups)))
