"""Assign groups to (step, rank, micro): every rank gets exactly ``micro_batches`` groups per step.

Choice for G not a multiple of ``world_size x micro_batches`` (R x M): :func:`assign_groups`
refuses it (an :class:`InputError` with the fix) rather than leaving ranks idle or padding with
empty groups. Our packer is asked for a multiple directly (``group_multiple=R*M``); for other
packers (ISF, baselines) :func:`split_to_multiple` splits the heaviest multi-sample groups in two
until G is a multiple, which keeps every cap (a part of a group never exceeds the group).

Algorithm of :func:`assign_groups`:

1. **Classes.** Groups are classed by which *sparse* modules they hold (some groups have none
   of it, e.g. audio) and by the exact value of *discrete* modules (few distinct group costs,
   e.g. tiles x 256 tokens), so those balance exactly within a step.
2. **Blocks of R.** Each class is shuffled, ordered by cost quantized to ``tolerance`` of the
   mean (ties keep the shuffled order, so near-equal groups stay randomly mixed; the module
   with the widest relative spread leads; sparse modules use a coarser grid), optionally only
   within windows of ``window`` blocks, and cut into blocks of R consecutive groups. Leftovers
   of every class (< R each) form mixed blocks.
3. **Steps.** Blocks are shuffled (seeded) and dealt M per step, so a step holding audio holds
   it on every rank.
4. **Ranks.** Within a step, block m's groups go to the ranks, heaviest group to the rank with
   the least normalized load so far (vectorized over all steps); ``micro = m``.

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

from balancer_cli.errors import InputError
from balancer_cli.manifest import StepShape
from balancer_cli.pack.types import Assignment, Packing, group_sums

__all__ = ["assign_groups", "split_to_multiple", "check_assignment"]


def _spread_order(cost_GK: np.ndarray) -> np.ndarray:
    """Module order for sorting: the widest relative spread (std / mean) first."""
    mean = cost_GK.mean(axis=0)
    cv = np.divide(cost_GK.std(axis=0), mean, out=np.zeros_like(mean), where=mean > 0)
    return np.argsort(-cv, kind="stable")


def _classes(cost_GK: np.ndarray, R: int, discrete_levels: int) -> np.ndarray:
    """(G,) class id: which sparse modules a group holds, plus the value of discrete modules.

    A discrete module only joins the key while its classes stay large (at least 4 blocks of R
    per distinct value on average), so leftovers (< R per class) stay few.
    """
    G, K = cost_GK.shape
    present = cost_GK > 0
    sparse = ~present.all(axis=0) & present.any(axis=0)
    key = [present[:, k].astype(np.float64) for k in np.flatnonzero(sparse)]
    n_classes = 1 << len(key)
    for k in range(K):
        levels = np.unique(cost_GK[:, k])
        if 1 < len(levels) <= discrete_levels and G >= 4 * R * n_classes * len(levels):
            key.append(cost_GK[:, k])
            n_classes *= len(levels)
    if not key:
        return np.zeros(G, np.int64)
    return np.unique(np.stack(key, axis=1), axis=0, return_inverse=True)[1].reshape(-1)


def assign_groups(
    cost_GK: np.ndarray,
    *,
    world_size: int,
    micro_batches: int,
    seed: int = 0,
    window: int = 0,
    tolerance: float = 0.002,
    discrete_levels: int = 32,
    sparse_factor: float = 50.0,
) -> Assignment:
    """Place G groups on steps x ranks x micro-batches (see the module docstring).

    Args:
        cost_GK: (G, K) cost of each group per module.
        world_size: R, data-parallel ranks.
        micro_batches: M, groups per rank per step (gradient accumulation).
        seed: seeds the shuffles.
        window: blocks per sorting window; larger balances better, smaller keeps steps more
            random. 0 sorts each class entirely (homogeneous steps, OmniBal-style).
        tolerance: groups whose costs differ by less than this share of the mean sort as equal
            (and stay in shuffled order); 0 sorts exactly.
        sparse_factor: sorting grid of sparse modules, in multiples of ``tolerance``.
        discrete_levels: a module whose group costs take at most this many distinct values
            (item counts, tiles x 256 tokens) is balanced exactly: its value joins the class.

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
    pattern = _classes(cost, R, discrete_levels)
    keys = _spread_order(cost)
    # Sort keys quantized to ``tolerance`` of each module's mean: groups within tolerance of each
    # other tie, and ties keep their shuffled order, so near-equal groups stay randomly mixed.
    mean_K = cost.mean(axis=0)
    if tolerance > 0:
        # Sparse modules (present in some groups only) get a coarser grid (sparse_factor x
        # tolerance): they vary most and would otherwise decide the order alone, leaving the
        # dense modules (the LLM) unordered within a block.
        present = cost > 0
        tol_K = np.where(~present.all(axis=0) & present.any(axis=0), tolerance * sparse_factor, tolerance)
        scale_K = np.divide(1.0, tol_K * mean_K, out=np.zeros_like(mean_K), where=mean_K > 0)
        sort_key = np.floor(cost * scale_K)[:, keys[::-1]]
    else:
        sort_key = cost[:, keys[::-1]]
    full_blocks: list[np.ndarray] = []
    leftovers: list[np.ndarray] = []
    for cls in np.unique(pattern):
        members = np.flatnonzero(pattern == cls)
        members = members[rng.permutation(len(members))]
        nfull = len(members) // R * R
        win = len(members) if window <= 0 else window * R
        body = members[:nfull]
        for lo in range(0, nfull, win):
            chunk = body[lo:lo + win]
            chunk = chunk[np.lexsort(sort_key[chunk].T)]
            full_blocks.append(chunk.reshape(-1, R))
        if nfull < len(members):
            leftovers.append(members[nfull:])
    blocks_BR = np.concatenate(full_blocks) if full_blocks else np.zeros((0, R), np.int64)
    if leftovers:
        rest = np.concatenate(leftovers)
        rest = rest[np.lexsort(sort_key[rest].T)]
        blocks_BR = np.concatenate([blocks_BR, rest.reshape(-1, R)])
    blocks_BR = blocks_BR[rng.permutation(len(blocks_BR))]
    S = G // per_step
    blocks_SMR = blocks_BR.reshape(S, M, R)
    # Normalized per-group load used to even out ranks when M > 1.
    mean = cost.mean(axis=0)
    norm_G = (cost * np.divide(1.0, mean, out=np.zeros_like(mean), where=mean > 0)).sum(axis=1)
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
    order = np.argsort(-weight_G, kind="stable")
    offsets = packing.group_offsets.tolist()
    multi = order[sizes[order] >= 2][:need]
    if len(multi) < need:
        raise InputError(
            f"cannot reach a multiple of {multiple} groups from {G}: only {len(multi)} groups hold "
            f"two or more samples, {need} splits needed",
            fix="lower {world_size} or {micro_batches}, or pack more samples",
        )
    splits = {int(g): int(sizes[g] // 2) for g in multi}
    new_offsets = []
    new_iso = []
    for g in range(G):
        new_offsets.append(offsets[g])
        new_iso.append(bool(packing.isolated[g]))
        if g in splits:
            new_offsets.append(offsets[g] + splits[g])
            new_iso.append(False)
    new_offsets.append(offsets[-1])
    return Packing(
        order=packing.order,
        group_offsets=np.asarray(new_offsets, dtype=np.int64),
        isolated=np.asarray(new_iso, dtype=bool),
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
