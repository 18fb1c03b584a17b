"""One search candidate's evaluation: its packing split to whole steps, its assignment and step
mix, then (for the candidates worth it) the polish and the balance metrics.

The step mix is measured before the polish: the polish trades samples only between the groups
of one step (:mod:`balancer_cli.pack.polish`), so the steps' source mixes, like the group count,
are the same after it. Known this early, the terms that the polish cannot change bound a
candidate's objective from below, and :func:`~balancer_cli.pack.search.search_thresholds`
skips the polish of candidates that cannot win.

Example:
    >>> import numpy as np
    >>> from balancer_cli.manifest import StepShape
    >>> rng = np.random.default_rng(0)
    >>> items = rng.integers(1, 4, 400); load = np.stack([items, 64 * items + rng.integers(8, 90, 400)], 1)
    >>> shape = StepShape(world_size=2, micro_batches=1)
    >>> p, efficiency = packed(load, load.astype(float), None, np.array([8, 640]), None, shape, "balanced", 0, 1, 2)
    >>> a, gs, mix = assigned(p, load.astype(float), None, shape, seed=0)
    >>> dist, util, pad, sparse = measured(p, a, gs, load.astype(float), shape)
    >>> mix, len(dist) == 2 and util[0] > 0.9
    (1.0, True)
"""

from __future__ import annotations

from balancer_cli.errors import InputError
from balancer_cli.metrics import dist_ratio, pad_ratio, step_loads, utilization
from balancer_cli.pack._blocks import sparse_modules
from balancer_cli.pack.assign import (
    assign_groups,
    group_source_counts,
    split_to_multiple,
)
from balancer_cli.pack.bounds import groups_lower_bound
from balancer_cli.pack.evaluate import step_mix_ratio
from balancer_cli.pack.packers._class_mix import class_bias_ratio
from balancer_cli.pack.packers.balanced import BalancedOptions, deal_balanced
from balancer_cli.pack.packers.isf import pack_isf
from balancer_cli.pack.polish import polish_steps
from balancer_cli.pack.types import group_sums

__all__ = ["assigned", "measured", "packed"]


def packed(load, cost, source, caps, bounds, shape, algorithm, seed, passes, multiple, dealt=None):
    """One candidate's packing split to whole steps and its efficiency (steps over the fewest the
    caps permit), or None when it cannot fill a step. ``dealt``: our packer's dealt groups of the
    same candidate (:func:`~balancer_cli.pack.packers.balanced.deal_balanced`), refined instead of
    dealing again (the same packing).

    Groups are packed to a multiple of ``multiple``: a step's groups (R x M) on the whole input,
    as the full run packs; on a subsample the same share of its groups, so that it holds as many
    "steps" as the full data does. Rounding to whole steps then weighs as much on the subsample as
    in full, where it decides whether dealing's groups fit within ``MAX_STEP_EXCESS`` x the bound
    or first fit's tighter but clustered groups are kept (harsh 76k at ``--dp 128``: rounded to
    128 groups first fit's are kept, steps 5.9x less mixed than random batching; unrounded, the
    subsample kept dealing's and did not see it). The heaviest groups are then split to a
    multiple of R x M (as for ISF) for the assigner.
    """
    per_step = shape.groups_per_step
    if algorithm == "isf":
        p = pack_isf(load, caps, bounds, iterations=20, seed=seed)
    else:
        # Without the class-mix step: on a subsample of ~20 steps its gain is overrated (it moved
        # the picks at --dp 64 to caps that mix worse in full: 0.51x -> 1.03-1.17x).
        if dealt is None:
            dealt = deal_balanced(load, caps, cost_NK=cost, group_multiple=multiple, seed=seed)
        p = dealt.finish(source_N=source, options=BalancedOptions(passes=passes, class_mix=False))
    if p.num_groups < per_step:
        return None
    lower_bound = max(1, groups_lower_bound(load, caps))
    # The whole input: whole steps over the fewest, as the report counts them. A subsample: its
    # groups (a multiple of its share of a step) over the unrounded bound; the full run's steps
    # over its rounded-up bound are at most that, so near the 1.03x limit it errs on the safe side.
    if multiple == per_step:
        efficiency = -(-p.num_groups // per_step) / -(-lower_bound // per_step)
    else:
        efficiency = p.num_groups / lower_bound
    try:
        return split_to_multiple(p, cost[:, -1], per_step), efficiency
    except InputError:  # too few groups of two samples or more to split to whole steps: it cannot fill them
        return None


def assigned(p, cost, source, shape, seed, sampled=False):
    """(assignment, group sums, step mix) of a packing placed on steps x ranks as
    :func:`assign_groups` places it. ``sampled``: the packing is of a subsample; with one
    micro-batch the mix is then at least what the classes' bias predicts for the full run
    (:func:`~balancer_cli.pack.packers._class_mix.class_bias_ratio`)."""
    R, M = shape.world_size, shape.micro_batches
    gs = group_sums(p, cost)
    mix_GO = None if source is None else group_source_counts(p, source)
    a = assign_groups(gs, world_size=R, micro_batches=M, seed=seed, mix_GO=mix_GO)
    if source is None:
        return a, gs, 1.0
    mix = step_mix_ratio(a.step[p.group_ids()], source[p.order], a.num_steps)
    if sampled and M == 1:
        # A subsample's ~20 steps mix classes of groups that the full run's many steps keep
        # apart (one class a step): its classes' bias predicts the full run's mix better
        # (harsh 76k at --dp 128: 1.15x on the subsample, 5.86x in full; predicted 5.3x).
        mix = max(mix, class_bias_ratio(gs[:, :-1], mix_GO, R * M, sampled=True, by_steps=True))
    return a, gs, mix


def measured(p, a, gs, cost, shape, polish=None):
    """(dist_K, util_K, pad, sparse_K) of a packing assigned by ``a`` (``gs``: its group sums);
    with ``polish`` = (load, caps, passes, seed) polished first as the pipeline does
    (:func:`~balancer_cli.pack.polish.polish_steps`)."""
    R = shape.world_size
    sparse = sparse_modules(gs)
    if polish is not None:
        p = polish_steps(p, a, cost, polish[0], polish[1], seed=polish[3], passes=polish[2])
    gid = p.group_ids()
    step_P, rank_P = a.step[gid], a.rank[gid]
    dist, util = [], []
    for k in range(cost.shape[1]):
        load_SR = step_loads(step_P, rank_P, cost[p.order, k], num_steps=a.num_steps, world_size=R)
        dist.append(dist_ratio(load_SR))
        util.append(utilization(load_SR))
    return dist, util, pad_ratio(gid, cost[p.order, -1]), sparse
