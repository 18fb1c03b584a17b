"""Metrics of a set of manifest rows: the numbers ``report.json`` holds for a manifest or a baseline.

:func:`evaluate_rows` only looks at placements (step, rank, micro, sample, optional ``<m>_rank``
phase ranks) plus the per-sample lengths, never at a packer's internal state, so the report of a
written manifest and the one computed before writing agree exactly.

Example:
    >>> import numpy as np
    >>> from balancer_cli.lengths import make_lengths_table
    >>> from balancer_cli.manifest import ManifestRows
    >>> from balancer_cli.pack.inputs import prepare_inputs
    >>> inputs = prepare_inputs(make_lengths_table(np.array([100, 60, 40, 100])))
    >>> rows = ManifestRows(np.array([0, 0, 0, 0]), np.array([0, 0, 1, 1]), np.zeros(4, int), np.array([0, 1, 2, 3]))
    >>> ev = evaluate_rows(inputs, rows, np.array([], np.int64), (), caps_K=np.array([200]), world_size=2,
    ...                    micro_batches=1, epoch_num_steps=[1])
    >>> ev.metrics["modules"]["llm"]["utilization"], ev.metrics["steps"]["lower_bound"]
    (0.9375, 1)
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from balancer_cli.lengths import LLM
from balancer_cli.manifest import ManifestRows, StepShape
from balancer_cli.metrics import (
    dist_ratio,
    pad_ratio,
    step_loads,
    step_utilization,
    utilization,
)
from balancer_cli.pack.bounds import groups_lower_bound

__all__ = ["Evaluation", "evaluate_rows", "reason_kind", "step_mix_distances", "step_mix_ratio"]


@dataclass(frozen=True)
class Evaluation:
    """Metrics (JSON-ready dict) plus the (S, R) cost matrices per module, for plots.

    Attributes:
        metrics: ``modules.<m>.{dist_ratio,pad_ratio,utilization}``, ``step``, ``steps``,
            ``groups``, ``dropped``, ``step_mix`` and, with phase ranks, ``post_balance``.
        loads: ``{module: (S, R) float64}`` summed cost per step and rank.
    """

    metrics: dict
    loads: dict


def _round(x: float) -> float:
    # Fixed precision keeps report.json stable and readable.
    return round(float(x), 6)


def step_mix_distances(step_P: np.ndarray, source_P: np.ndarray, num_steps: int, num_sources: int) -> np.ndarray:
    """(S,) total-variation distance of each step's source mix from the mix of all placed samples.

    Example:
        >>> step_mix_distances(np.array([0, 0, 1, 1]), np.array([0, 0, 1, 1]), 2, 2).tolist()
        [0.5, 0.5]
    """
    if len(step_P) == 0 or num_steps == 0:
        return np.zeros(num_steps)
    counts_SO = np.bincount(np.asarray(step_P, np.int64) * num_sources + np.asarray(source_P, np.int64),
                            minlength=num_steps * num_sources).reshape(num_steps, num_sources).astype(float)
    overall_O = counts_SO.sum(axis=0) / counts_SO.sum()
    totals_S = counts_SO.sum(axis=1, keepdims=True)
    mix_SO = np.divide(counts_SO, totals_S, out=np.zeros_like(counts_SO), where=totals_S > 0)
    return 0.5 * np.abs(mix_SO - overall_O).sum(axis=1)


def step_mix_ratio(step_P: np.ndarray, source_P: np.ndarray, num_steps: int) -> float:
    """Mean step-mix distance over that of the same steps holding a seeded shuffle of the samples.

    1.0 is as mixed as random batching with the same step structure; below 1.0, steps are closer
    to the global source mix than random draws would be. 1.0 when random batching itself has no
    distance (one source).

    Example:
        >>> step = np.repeat(np.arange(4), 4)  # 4 steps of 4 samples
        >>> step_mix_ratio(step, np.repeat([0, 1, 0, 1], 4), 4) > 1.0  # one source per step
        True
        >>> step_mix_ratio(step, np.tile([0, 1], 8), 4)  # every step holds the global mix
        0.0
    """
    source_P = np.asarray(source_P, dtype=np.int64)
    num_sources = int(source_P.max()) + 1 if len(source_P) else 1
    distances, reference = _mix_and_reference(step_P, source_P, num_steps, num_sources)
    mean, shuffled = _mean(distances), _mean(reference)
    return float(mean / shuffled) if shuffled > 0 else 1.0


def _mix_and_reference(step_P, source_P, num_steps, num_sources):
    """(S,) step-mix distances of the placement, and of the same steps filled by a seeded shuffle
    of the placed samples (what random batching gives; small steps deviate by chance alone)."""
    distances = step_mix_distances(step_P, source_P, num_steps, num_sources)
    shuffled_P = source_P[np.random.default_rng(0).permutation(len(source_P))]
    return distances, step_mix_distances(step_P, shuffled_P, num_steps, num_sources)


def _mean(x: np.ndarray) -> float:
    return float(x.mean()) if len(x) else 0.0


def reason_kind(reason: str) -> str:
    """The kind a drop reason is counted under: the text before the first ``:``.

    Scan errors read ``kind: file:line: message`` and oversize drops ``oversize: module v > cap c``,
    so per-sample details do not explode the table.

    Example:
        >>> reason_kind("missing_file: data.jsonl:3: img.jpg not found"), reason_kind("not in a full step")
        ('missing_file', 'not in a full step')
    """
    return str(reason).split(":", 1)[0].strip() or str(reason)


def _dropped(dropped_sample: np.ndarray, dropped_reason: Sequence[str], num_samples: int) -> dict:
    kinds = Counter(reason_kind(r) for r in dropped_reason)
    examples: dict[str, str] = {}
    for reason in dropped_reason:
        examples.setdefault(reason_kind(reason), str(reason))
    return {
        "count": int(len(dropped_sample)),
        "share": _round(len(dropped_sample) / max(num_samples, 1)),
        "by_reason": {k: {"count": c, "share": _round(c / max(num_samples, 1)), "example": examples[k]}
                      for k, c in sorted(kinds.items(), key=lambda kc: (-kc[1], kc[0]))},
    }


def evaluate_rows(
    inputs,
    rows: ManifestRows,
    dropped_sample: np.ndarray,
    dropped_reason: Sequence[str],
    *,
    caps_K: np.ndarray,
    world_size: int,
    micro_batches: int,
    epoch_num_steps: Sequence[int],
) -> Evaluation:
    """All report metrics of one manifest (or baseline) from its rows and the per-sample lengths.

    Args:
        inputs: :class:`~balancer_cli.pack.pipeline.PackInputs` of the lengths table.
        rows: the placements (all epochs; steps numbered globally).
        dropped_sample, dropped_reason: samples not placed and why.
        caps_K: caps per module (for over-cap groups and the lower bound on steps).
        world_size, micro_batches: R and M.
        epoch_num_steps: steps of each epoch.
    """
    num_steps = int(sum(epoch_num_steps))
    step = np.asarray(rows.step, np.int64)
    rank = np.asarray(rows.rank, np.int64)
    sample = np.asarray(rows.sample, np.int64)
    group = (step * world_size + rank) * micro_batches + np.asarray(rows.micro, np.int64)
    modules, loads, post = {}, {}, {}
    for k, module in enumerate(inputs.modules):
        cost = inputs.cost_NK[sample, k]
        load_SR = step_loads(step, rank, cost, num_steps=num_steps, world_size=world_size)
        loads[module] = load_SR
        modules[module] = {
            "dist_ratio": _round(dist_ratio(load_SR)),
            "pad_ratio": _round(pad_ratio(group, cost)),
            "utilization": _round(utilization(load_SR)),
            "mean_rank_load": _round(load_SR.mean()) if load_SR.size else 0.0,
        }
        phase_rank = rows.extra.get(f"{module}_rank") if module != LLM else None
        if phase_rank is not None:
            phase_SR = step_loads(step, np.asarray(phase_rank, np.int64), cost, num_steps=num_steps,
                                  world_size=world_size)
            post[module] = phase_SR
    metrics = {
        "modules": modules,
        "step": {"utilization": _round(step_utilization(list(loads.values())))},
        "steps": _steps(inputs, rows, caps_K, StepShape(world_size=world_size, micro_batches=micro_batches).groups_per_step,
                        epoch_num_steps),
        "groups": _groups(inputs, group, sample, caps_K),
        "dropped": _dropped(np.asarray(dropped_sample), dropped_reason, inputs.num_samples),
        "step_mix": _step_mix(inputs, step, sample, num_steps),
    }
    if post:
        phases = {m: {"dist_ratio": _round(dist_ratio(x)), "utilization": _round(utilization(x))}
                  for m, x in post.items()}
        step_loads_post = [post.get(m, loads[m]) for m in inputs.modules]
        metrics["post_balance"] = {"modules": phases,
                                   "step": {"utilization": _round(step_utilization(step_loads_post))}}
    return Evaluation(metrics, loads)


def _steps(inputs, rows: ManifestRows, caps_K: np.ndarray, per_step: int, epoch_num_steps: Sequence[int]) -> dict:
    """Steps per epoch against a lower bound: the fewest groups the caps allow
    (:func:`~balancer_cli.pack.bounds.groups_lower_bound`), R x M of them per step."""

    bounds, first = [], 0
    step = np.asarray(rows.step, np.int64)
    for steps in epoch_num_steps:
        lo, hi = np.searchsorted(step, [first, first + steps])
        placed_NK = inputs.load_NK[np.asarray(rows.sample[lo:hi], np.int64)]
        groups = groups_lower_bound(placed_NK, np.asarray(caps_K)) if len(placed_NK) else 0
        bounds.append(math.ceil(groups / per_step))
        first += steps
    total, bound = int(sum(epoch_num_steps)), int(sum(bounds))
    return {"total": total, "per_epoch": [int(s) for s in epoch_num_steps], "lower_bound": bound,
            "lower_bound_per_epoch": bounds, "vs_lower_bound": _round(total / bound) if bound else 1.0}


def _groups(inputs, group_P: np.ndarray, sample_P: np.ndarray, caps_K: np.ndarray) -> dict:
    if len(group_P) == 0:
        return {"count": 0, "mean_size": 0.0, "over_cap": 0}
    if np.all(group_P[1:] >= group_P[:-1]):
        # Rows sorted by slot (every manifest and baseline): groups are runs, no sort or scatter-add.
        starts = np.flatnonzero(np.concatenate([[True], group_P[1:] != group_P[:-1]]))
        sizes = np.diff(np.append(starts, len(group_P)))
        load_GK = np.stack([np.add.reduceat(inputs.load_NK[sample_P, k], starts)
                            for k in range(inputs.load_NK.shape[1])], axis=1)
    else:
        _, dense, sizes = np.unique(group_P, return_inverse=True, return_counts=True)
        load_GK = np.zeros((len(sizes), inputs.load_NK.shape[1]), dtype=np.int64)
        np.add.at(load_GK, dense, inputs.load_NK[sample_P])
    over = (load_GK > np.asarray(caps_K)[None, :]).any(axis=1)
    return {"count": int(len(sizes)), "mean_size": _round(sizes.mean()), "over_cap": int(over.sum()),
            "over_cap_multi_sample": int((over & (sizes > 1)).sum())}


def _step_mix(inputs, step_P: np.ndarray, sample_P: np.ndarray, num_steps: int) -> dict:
    source_P = inputs.source_codes_N[sample_P]
    distances, reference = _mix_and_reference(step_P, source_P, num_steps, len(inputs.source_names))
    mean, shuffled = _mean(distances), _mean(reference)
    return {"mean_distance": _round(mean),
            "max_distance": _round(distances.max()) if len(distances) else 0.0,
            "shuffled_mean_distance": _round(shuffled),
            # The measure to read: 1.0 is as mixed as random batching of the same steps.
            "vs_random": _round(mean / shuffled) if shuffled > 0 else 1.0,
            "num_sources": len(inputs.source_names)}
