"""Elastic replay: re-assign a manifest's groups to a different number of ranks.

A manifest is packed for ``R`` ranks with ``M`` groups per rank per step. Replaying it on
``R' != R`` ranks keeps every step's samples together (the optimizer still sees the same global
batch) and re-plans each step as follows, as a pure function of the step's groups, the per-sample
costs and ``R'`` (so every rank computes the same plan on its own, without collectives):

1. ``k = ceil(R * M / R')`` batches per rank per step.
2. The step's samples are balanced over the ``R'`` ranks by every module's cost (LPT over
   samples plus swaps, :mod:`balancer_cli.replay.replan`), each rank keeping at least ``k``.
3. Each rank's samples, in manifest order, are cut into ``k`` batches of nearly equal cost, so
   every rank runs the same number of batches. With the lengths table, no batch exceeds the
   packer's caps unless it is one sample: cuts respect the caps, and a step that cannot is
   re-planned for every rank by splitting packed groups (the former whole-group plan).

(The whole-group plan is :mod:`balancer_cli.replay.group_plan`.)

A step with fewer than ``G'`` samples cannot give every rank ``k`` non-empty batches; such a step
is merged with the steps after it (a **run**) until the run has at least ``G'`` samples; a short
run at the end of an epoch joins the run before it. Only when a whole (remaining) epoch has fewer
than ``G'`` samples does its single step get fewer batches per rank; when it has fewer samples
than ranks (what is left of an epoch resumed on more ranks), every rank gets one batch, and the
ranks past its last sample get an empty one (every rank still runs the same number of batches).

Example:
    >>> import numpy as np
    >>> groups = [np.array([0, 1, 2, 3]), np.array([4]), np.array([5, 6])]
    >>> plan = plan_step(groups, np.ones(7), world_size=2, batches_per_rank=2)
    >>> [[b.tolist() for b in batches] for batches in plan]
    [[[0, 2], [4, 6]], [[1], [3, 5]]]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from balancer_cli.replay.replan import plan_window

__all__ = ["ElasticReport", "batches_per_rank", "plan_step", "form_runs"]


def batches_per_rank(manifest_world_size: int, micro_batches: int, world_size: int) -> int:
    """Batches each of ``world_size`` ranks gets per step: ``M`` natively, else ``ceil(R*M/R')``.

    Example:
        >>> batches_per_rank(4, 1, 3), batches_per_rank(4, 2, 4), batches_per_rank(2, 1, 4)
        (2, 2, 1)
    """
    if world_size == manifest_world_size:
        return micro_batches
    return max(1, math.ceil(manifest_world_size * micro_batches / world_size))


def plan_step(
    groups: Sequence[np.ndarray], sample_cost: np.ndarray, world_size: int, batches_per_rank: int,
    load_NK: np.ndarray | None = None, caps_K: np.ndarray | None = None,
) -> list[list[np.ndarray]]:
    """Plan one step (or run) for ``world_size`` ranks: per rank, its batches in order.

    Balanced per module at sample granularity by :func:`balancer_cli.replay.replan.plan_window`
    (LPT over the step's samples, then each rank's samples cut into batches of nearly equal cost).
    Gives every rank ``min(batches_per_rank, samples // world_size)`` batches (the smaller value
    only for an epoch too short to fill them), and one batch each, empty past the step's last
    sample, to a step of fewer samples than ranks.

    Args:
        groups: the step's groups in manifest order.
        sample_cost: (N,) cost, or (N, K) cost of each module, indexed by sample.
        load_NK, caps_K: per-sample capped quantities and the packer's caps; with both, no batch
            exceeds a cap unless it is one sample (see :func:`balancer_cli.replay.replan.plan_window`).

    Example:
        >>> groups = [np.array([0, 1, 2, 3]), np.array([4]), np.array([5, 6])]
        >>> [[b.tolist() for b in batches] for batches in plan_step(groups, np.ones(7), 2, 2)]
        [[[0, 2], [4, 6]], [[1], [3, 5]]]
        >>> [[b.tolist() for b in batches] for batches in plan_step(groups[1:], np.ones(7), 4, 2)]
        [[[4]], [[5]], [[6]], [[]]]
    """
    sizes = [len(g) for g in groups]
    total = sum(sizes)
    k = max(1, min(batches_per_rank, total // world_size))
    samples = np.concatenate([np.asarray(g, dtype=np.int64) for g in groups])
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    cost = np.asarray(sample_cost, dtype=np.float64)
    cost_NK = cost[:, None] if cost.ndim == 1 else cost
    return plan_window([samples], [offsets], cost_NK, world_size, np.array([k]), load_NK, caps_K)[0]


def form_runs(step_samples: np.ndarray, min_samples: int, head_samples: int = 0) -> np.ndarray:
    """Cut a sequence of steps into runs holding at least ``min_samples`` samples each.

    Greedy from the front (so the runs after any run boundary do not depend on what came before);
    a short last run joins the one before it. ``head_samples`` (fewer than ``min_samples``) are
    samples already waiting in front of the first step (the unfinished part of an interrupted
    step); they join the first run.

    Returns:
        (U+1,) int64 run boundaries as positions into ``step_samples`` (``[0, .., S]``); a head
        too small for a run of its own and with no steps behind it gives ``[0, 0]``.

    Example:
        >>> form_runs(np.array([4, 1, 1, 4, 3]), 3).tolist(), form_runs(np.array([4, 1, 1, 4, 1]), 3).tolist()
        ([0, 1, 4, 5], [0, 1, 5])
    """
    counts = np.asarray(step_samples, dtype=np.int64)
    if len(counts) == 0 and head_samples == 0:
        return np.zeros(1, dtype=np.int64)
    if len(counts) and head_samples == 0 and counts.min() >= min_samples:
        return np.arange(len(counts) + 1, dtype=np.int64)
    bounds = [0]
    acc = head_samples
    for pos, n in enumerate(counts.tolist()):
        acc += n
        if acc >= min_samples:
            bounds.append(pos + 1)
            acc = 0
    if bounds[-1] != len(counts):
        if len(bounds) > 1:
            bounds[-1] = len(counts)
        else:
            bounds.append(len(counts))
    if len(bounds) == 1:
        bounds.append(0)
    return np.asarray(bounds, dtype=np.int64)


@dataclass(frozen=True, kw_only=True)
class ElasticReport:
    """What elastic replay changed, for the log.

    Attributes:
        manifest_world_size, world_size: ``R`` (packed for) and ``R'`` (replaying on).
        micro_batches, batches_per_rank: ``M`` and ``k`` (batches per rank per step).
        steps_packed, steps_replayed: remaining steps of the epoch before and after run merging.
        splits_per_step: batches per step beyond the packed groups (``k*R' - R*M`` when positive).
        merges_per_step: batches per step short of the packed groups (``R*M - k*R'``, never with this ``k``).
        dist_ratio_packed, dist_ratio_replayed: mean Dist Ratio of the first planned steps.
        resumed_mid_step: a step interrupted at another world size was re-planned.

    Example:
        >>> ElasticReport(manifest_world_size=4, world_size=3, micro_batches=2, batches_per_rank=3,
        ...               steps_packed=10, steps_replayed=10, splits_per_step=1, merges_per_step=0,
        ...               dist_ratio_packed=0.0, dist_ratio_replayed=0.01, resumed_mid_step=False).describe()
        ... # doctest: +ELLIPSIS
        'manifest packed for 4 ranks x 2 micro-batches, replaying on 3 ranks x 3 batches per step; ...'
    """

    manifest_world_size: int
    world_size: int
    micro_batches: int
    batches_per_rank: int
    steps_packed: int
    steps_replayed: int
    splits_per_step: int
    merges_per_step: int
    dist_ratio_packed: float
    dist_ratio_replayed: float
    resumed_mid_step: bool

    def describe(self) -> str:
        """One log line."""
        text = (f"manifest packed for {self.manifest_world_size} ranks x {self.micro_batches} micro-batches, "
                f"replaying on {self.world_size} ranks x {self.batches_per_rank} batches per step; "
                f"{self.splits_per_step} more batch(es) than packed groups per step")
        if self.merges_per_step:
            text += f", {self.merges_per_step} fewer"
        if self.steps_replayed != self.steps_packed:
            text += f"; {self.steps_packed} remaining steps merged into {self.steps_replayed} (steps with too few samples)"
        if self.resumed_mid_step:
            text += "; the interrupted step was re-planned over the new ranks"
        return text + (f"; Dist Ratio of the first steps {self.dist_ratio_packed:.3f} as packed,"
                       f" {self.dist_ratio_replayed:.3f} as replayed")
