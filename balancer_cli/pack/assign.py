"""Assign groups to (step, rank, micro): every rank gets exactly ``micro_batches`` groups per step.

Choice for G not a multiple of ``world_size x micro_batches`` (R x M): :func:`assign_groups`
refuses it (an :class:`InputError` with the fix) rather than leaving ranks idle or padding with
empty groups. Our packer is asked for a multiple directly (``group_multiple=R*M``); for other
packers (ISF, baselines) :func:`split_to_multiple` splits the heaviest multi-sample groups in two
until G is a multiple, which keeps every cap (a part of a group never exceeds the group).

Algorithm of :func:`assign_groups` (balance first, then the step's source mix):

1. **Cells.** Groups are keyed by which *sparse* modules they hold (some groups have none of
   it, e.g. audio), by the exact value of *discrete* modules (few distinct group costs, e.g.
   tiles x 256 tokens) and by their cost on a grid of ``tolerance`` x the module's mean
   (sparse modules: ``sparse_factor`` times coarser). Any R groups of one cell are balanced
   to within the grid, so the cell is where the source mix is chosen.
2. **Blocks of R.** Each cell is cut into blocks of R groups in R rounds; in round t every
   block of the cell takes one group, paired by a random projection of the source deviations
   (the block most short of a source direction takes the group richest in it), so each block's
   source counts approach the cell's mean instead of a random draw's. Leftovers of every cell
   (< R each) are paired again in cells of a twice coarser grid (discrete modules then on the
   grid too), up to 4 levels; the last ones are cut like a k-d tree (each part split at a
   multiple of R along the module it spreads most on), so a block takes neighbouring groups
   (:mod:`balancer_cli.pack._blocks`).
3. **Steps.** Blocks are dealt M per step in M rounds the same way (step deficits against
   block deviations), then steps are shuffled (seeded); a step holding audio holds it on every
   rank.
4. **Ranks.** Within a step, block m's groups go to the ranks, heaviest group to the rank with
   the least normalized load so far (vectorized over all steps); ``micro = m``.

The source deviations are ``mix_GO`` (samples per source per group) minus the group's share of
the global mix; without ``mix_GO`` the pairing is a seeded shuffle.

Example:
    >>> import numpy as np
    >>> a = assign_groups(np.array([[4., 10.], [4., 11.], [0., 9.], [0., 8.]]), world_size=2, micro_batches=1)
    >>> a.num_steps, sorted(zip(a.step.tolist(), a.rank.tolist()))
    (2, [(0, 0), (0, 1), (1, 0), (1, 1)])
    >>> bool(a.step[0] == a.step[1])  # the two vision-bearing groups share a step
    True
"""

from __future__ import annotations

import numpy as np

from balancer_cli._columns import column_sums
from balancer_cli._index import take_rows
from balancer_cli._shuffle import permutation
from balancer_cli.errors import InputError, UsageError
from balancer_cli.manifest import StepShape
from balancer_cli.pack._blocks import form_blocks, paired_rounds
from balancer_cli.pack.types import Assignment, Packing, group_sums, top_codes

__all__ = ["assign_groups", "group_source_counts", "source_columns", "source_deviation", "split_to_multiple",
           "check_assignment"]

#: Sources the assigner tracks: the most frequent ones, the rest counted as one.
MAX_SOURCES = 16


def assign_groups(
    cost_GK: np.ndarray,
    *,
    world_size: int,
    micro_batches: int,
    seed: int = 0,
    mix_GO: np.ndarray | None = None,
    tolerance: float = 0.006,
    discrete_levels: int = 32,
    sparse_factor: float = 10.0,
) -> Assignment:
    """Place G groups on steps x ranks x micro-batches (see the module docstring).

    Args:
        cost_GK: (G, K) cost of each group per module.
        world_size: R, data-parallel ranks.
        micro_batches: M, groups per rank per step (gradient accumulation).
        seed: seeds the pairings and shuffles.
        mix_GO: (G, O) samples of each source in each group; steps are then balanced in
            source mix as well as in cost. None: sources are not considered.
        tolerance: cost grid as a share of each module's mean: R groups of one cell differ by
            less than this (Dist Ratio about 0.4 x tolerance at most); larger mixes steps more.
        discrete_levels: a module whose group costs take at most this many distinct values
            (item counts, tiles x 256 tokens) is balanced exactly: its value joins the cell.
        sparse_factor: grid of sparse modules, in multiples of ``tolerance``.

    Returns:
        An :class:`Assignment` with ``num_steps = G / (R * M)``.

    Raises:
        InputError: G is not a positive multiple of R x M (the message gives the fix).
        UsageError: world_size or micro_batches < 1.
    """
    cost = np.asarray(cost_GK, dtype=np.float64)
    if cost.ndim == 1:
        cost = cost[:, None]
    G = cost.shape[0]
    shape = StepShape(world_size=world_size, micro_batches=micro_batches)  # validates both
    R, M, per_step = shape.world_size, shape.micro_batches, shape.groups_per_step
    if G < per_step:
        raise InputError(
            f"{G} groups cannot fill one step of {R} ranks x {M} micro-batches ({per_step} groups)",
            fix="lower {world_size} or {micro_batches}, or lower the caps so that more groups form",
        )
    if G % per_step:
        raise InputError(
            f"{G} groups is not a multiple of world_size x micro_batches = {per_step}",
            fix=f"pack with group_multiple={per_step}, or call split_to_multiple(packing, ..., {per_step})",
        )
    rng = np.random.default_rng(seed)
    dev_GO = source_deviation(mix_GO, G)
    blocks_BR = form_blocks(cost, dev_GO, R, rng, tolerance, discrete_levels, sparse_factor, held_apart=M == 1)
    S = G // per_step
    # Blocks -> steps: M rounds, each step takes one block per round (source-paired).
    step_B = paired_rounds(np.zeros(len(blocks_BR), np.int64), take_rows(dev_GO, blocks_BR).sum(axis=1),
                            np.array([S]), M, rng, principal=True)
    blocks_SMR = take_rows(blocks_BR, np.argsort(step_B, kind="stable")).reshape(S, M, R)
    blocks_SMR = take_rows(blocks_SMR, permutation(rng, S))
    return _ranks(blocks_SMR, cost, rng)


def source_deviation(mix_GO: np.ndarray | None, G: int) -> np.ndarray:
    """(G, O) samples per source minus the group's share of the global source mix."""
    if mix_GO is None:
        return np.zeros((G, 1))
    mix = np.asarray(mix_GO, dtype=np.float64)
    if mix.shape[0] != G:
        raise UsageError(f"mix_GO has {mix.shape[0]} rows for {G} groups", fix="pass one row of source counts per group")
    total = mix.sum()
    share_O = column_sums(mix) / total if total > 0 else np.zeros(mix.shape[1])
    return mix - mix.sum(axis=1, keepdims=True) * share_O


def _ranks(blocks_SMR, cost_GK, rng) -> Assignment:
    """Step 4: block m of each step to micro m, heaviest group to the least loaded rank so far."""
    S, M, R = blocks_SMR.shape
    G = S * M * R
    mean = cost_GK.mean(axis=0)
    norm_G = (cost_GK * np.divide(1.0, mean, out=np.zeros_like(mean), where=mean > 0)).sum(axis=1)
    step = np.empty(G, np.int32)
    rank = np.empty(G, np.int32)
    micro = np.empty(G, np.int32)
    acc_SR = np.zeros((S, R))
    rows = np.arange(S)[:, None]
    for m in range(M):
        grp_SR = blocks_SMR[:, m, :]
        # Heaviest group of the block -> least loaded rank (ties broken by a per-step random
        # rank order and a stable sort).
        rank_perm_SR = np.argsort(rng.random((S, R)), axis=1)
        load_perm_SR = np.take_along_axis(acc_SR, rank_perm_SR, 1)
        by_load = np.take_along_axis(rank_perm_SR, np.argsort(load_perm_SR, 1, kind="stable"), 1)
        by_weight = np.argsort(-norm_G[grp_SR], axis=1, kind="stable")
        g_sorted = np.take_along_axis(grp_SR, by_weight, 1)
        step[g_sorted] = rows
        rank[g_sorted] = by_load
        micro[g_sorted] = m
        acc_SR[rows, by_load] += norm_G[g_sorted]
    return Assignment(step=step, rank=rank, micro=micro, num_steps=int(S))


def group_source_counts(packing: Packing, source_N: np.ndarray, max_sources: int = MAX_SOURCES) -> np.ndarray:
    """(G, O) samples of each source in each group, the ``max_sources - 1`` most frequent apart.

    Example:
        >>> p = Packing(np.arange(4), np.array([0, 3, 4]), np.zeros(2, bool), np.array([], np.int64), ())
        >>> group_source_counts(p, np.array([0, 1, 1, 0])).tolist()
        [[1, 2], [1, 0]]
    """
    column_P, O = source_columns(packing, source_N, max_sources)
    return np.bincount(packing.group_ids() * O + column_P,
                       minlength=packing.num_groups * O).reshape(packing.num_groups, O)


def source_columns(packing: Packing, source_N: np.ndarray, max_sources: int = MAX_SOURCES) -> tuple[np.ndarray, int]:
    """((P,) source column of each placed row, in packing order; O): the columns of
    :func:`group_source_counts` (the ``max_sources - 1`` most frequent sources apart, the rest
    in one; one column when nothing is placed).

    Example:
        >>> p = Packing(np.arange(4), np.array([0, 3, 4]), np.zeros(2, bool), np.array([], np.int64), ())
        >>> column_P, O = source_columns(p, np.array([0, 1, 1, 0]))
        >>> column_P.tolist(), O
        ([0, 1, 1, 0], 2)
    """
    code_P = np.asarray(source_N, dtype=np.int64)[np.asarray(packing.order, dtype=np.int64)]
    if len(code_P) == 0:
        return np.zeros(0, np.int64), 1
    column, O = top_codes(code_P, max_sources)
    return column[code_P], O


def split_to_multiple(packing: Packing, weight_N: np.ndarray, multiple: int) -> Packing:
    """Split the heaviest multi-sample groups in two until the group count is a multiple.

    Each split moves the group's second half (by position) into a new group right after it, so
    caps stay respected and isolated groups (one sample) are never split.

    Args:
        packing: any packing.
        weight_N: (N,) per-sample weight deciding which groups are heaviest (e.g. LLM tokens).
        multiple: R x M.

    Raises:
        InputError: not enough multi-sample groups to split.

    Example:
        >>> p = Packing(np.arange(5), np.array([0, 3, 5]), np.zeros(2, bool), np.array([], np.int64), ())
        >>> [g.tolist() for g in split_to_multiple(p, np.ones(5), 4).groups()]
        [[0], [1, 2], [3], [4]]
    """
    G = packing.num_groups
    need = (-G) % multiple
    if need == 0:
        return packing
    sizes = packing.group_sizes()
    weight_G = group_sums(packing, np.asarray(weight_N, dtype=np.float64))
    offsets = np.asarray(packing.group_offsets, dtype=np.int64)
    # The `need` heaviest groups of two or more samples, ties by index (argsort(-weight, stable)'s
    # first ones), without sorting every group: a partition keeps the candidates at most that light.
    multi = np.flatnonzero(sizes >= 2)
    key = -weight_G[multi]
    if len(multi) > need > 0:
        within = key <= np.partition(key, need - 1)[need - 1]
        multi, key = multi[within], key[within]
    multi = multi[np.argsort(key, kind="stable")][:need]
    if len(multi) < need:
        raise InputError(
            f"cannot reach a multiple of {multiple} groups from {G}: only {len(multi)} groups hold "
            f"two or more samples, {need} splits needed",
            fix="lower {world_size} or {micro_batches}, or pack more samples",
        )
    # Each split group g is followed by its second half (never isolated): one more offset inside g.
    split = np.zeros(G, bool)
    split[multi] = True
    new_offsets = np.empty(G + need + 1, np.int64)
    new_iso = np.zeros(G + need, bool)
    at = np.arange(G) + np.cumsum(split) - split  # where group g lands among the new groups
    new_offsets[at] = offsets[:-1]
    new_offsets[at[multi] + 1] = offsets[multi] + sizes[multi] // 2
    new_offsets[-1] = offsets[-1]
    new_iso[at] = packing.isolated
    return Packing(
        order=packing.order,
        group_offsets=new_offsets,
        isolated=new_iso,
        dropped=packing.dropped,
        dropped_reason=packing.dropped_reason,
    )


def check_assignment(assignment: Assignment, num_groups: int, world_size: int, micro_batches: int) -> None:
    """Assert every (step, rank, micro) slot holds exactly one group and every group has one slot."""
    S = assignment.num_steps
    assert len(assignment.step) == len(assignment.rank) == len(assignment.micro) == num_groups
    assert S * world_size * micro_batches == num_groups, "groups do not fill whole steps"
    slot = (assignment.step.astype(np.int64) * world_size + assignment.rank) * micro_batches + assignment.micro
    assert (assignment.step >= 0).all() and (assignment.step < S).all()
    assert (assignment.rank >= 0).all() and (assignment.rank < world_size).all()
    assert (assignment.micro >= 0).all() and (assignment.micro < micro_batches).all()
    assert np.array_equal(np.sort(slot), np.arange(num_groups)), "a slot is empty or doubly used"
