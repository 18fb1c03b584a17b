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
from typing import NamedTuple

import numpy as np

from balancer_cli._index import search_sorted, take_rows
from balancer_cli._shuffle import shuffle, shuffled
from balancer_cli.errors import ManifestError
from balancer_cli.lengths import LLM
from balancer_cli.manifest import ManifestRows, StepShape, is_slot_sorted
from balancer_cli.metrics import (
    dist_ratio,
    dist_ratio_per_step,
    step_utilization,
    utilization,
)
from balancer_cli.pack._blocks import sparse_shares
from balancer_cli.pack._evaluate_kernel import code_counts, new_tally, tally_rows
from balancer_cli.pack.bounds import groups_lower_bound
from balancer_cli.pack.contract import (
    MAX_DIST_RATIO,
    MIN_SPARSE_UTILIZATION,
    contract_entry,
)

__all__ = ["Evaluation", "evaluate_rows", "over_cap_dist", "reason_kind", "step_mix_distances", "step_mix_ratio",
           "utilization_ceiling"]


@dataclass(frozen=True)
class Evaluation:
    """Metrics (JSON-ready dict) plus the (S, R) cost matrices per module, for plots.

    Attributes:
        metrics: ``modules.<m>.{dist_ratio,pad_ratio,utilization,mean_rank_load,group_share,sparse}``
            (and ``utilization_ceiling`` where a sparse module is under the contract's utilization:
            :func:`utilization_ceiling`; ``over_cap`` where a dense module's Dist is over the
            contract's only in the steps holding groups over a cap: :func:`over_cap_dist`), ``step``, ``steps``, ``groups``, ``dropped``,
            ``step_mix``, ``contract`` (the bounds and those broken:
            :func:`~balancer_cli.pack.contract.contract_entry`) and, with phase ranks,
            ``post_balance``.
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
                            minlength=num_steps * num_sources).reshape(num_steps, num_sources)
    return _distances(counts_SO)


def _distances(counts_SO: np.ndarray) -> np.ndarray:
    """(S,) total-variation distance of each step's source counts from the counts of all steps."""
    counts_SO = np.asarray(counts_SO, dtype=np.float64)
    if counts_SO.size == 0 or counts_SO.sum() == 0:
        return np.zeros(len(counts_SO))
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
    mean, reference_mean = _mean(distances), _mean(reference)
    return float(mean / reference_mean) if reference_mean > 0 else 1.0


def _mix_and_reference(step_P, source_P, num_steps, num_sources):
    """(S,) step-mix distances of the placement, and of the same steps filled by a seeded shuffle
    of the placed samples (what random batching gives; small steps deviate by chance alone)."""
    distances = step_mix_distances(step_P, source_P, num_steps, num_sources)
    shuffled_P = shuffled(np.random.default_rng(0), source_P)
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

    Every metric sums over steps, groups or (step, rank) cells: one compiled pass over the rows
    fills them all (:mod:`~balancer_cli.pack._evaluate_kernel`), holding a byte per row beyond
    the rows themselves (their sources, shuffled).

    Args:
        inputs: :class:`~balancer_cli.pack.pipeline.PackInputs` of the lengths table.
        rows: the placements (all epochs; steps numbered globally), sorted by (step, rank,
            micro) as every manifest and baseline is (others are sorted first, a copy).
        dropped_sample, dropped_reason: samples not placed and why.
        caps_K: caps per module (for over-cap groups and the lower bound on steps).
        world_size, micro_batches: R and M.
        epoch_num_steps: steps of each epoch.
    """
    num_steps = int(sum(epoch_num_steps))
    R, M = world_size, micro_batches
    rows = _by_slot(rows)
    modules = inputs.modules
    phased = [m for m in modules if m != LLM and f"{m}_rank" in rows.extra]
    num_sources = len(inputs.source_names)
    (loads_KSR, post_QSR, dist_2S, padded_K, total_K, held_K, groups_4) = tally = new_tally(
        num_modules=len(modules), num_steps=num_steps, world_size=R, num_phases=len(phased))
    # Random batching of the same steps: the placed samples' sources in a seeded shuffle (1 B/row).
    source_P = inputs.source_codes_N[rows.sample]
    share_O = code_counts(source_P, num_sources) / max(len(source_P), 1)
    if len(source_P):
        dist_2S[:] = 0.5 * share_O.sum()  # a step without rows: as far as a step of no source
    # In place: the order step_mix_ratio draws (its shuffled copy), without a copy (1 B a row).
    shuffle(np.random.default_rng(0), source_P)
    phase_QP = np.stack([np.asarray(rows.extra[f"{m}_rank"]) for m in phased]) if phased else np.zeros((0, 0), np.int32)
    phase_of_K = np.array([phased.index(m) if m in phased else -1 for m in modules], np.int64)
    if tally_rows(rows.step, rows.rank, rows.micro, rows.sample, inputs.cost_NK, inputs.load_NK,
                  inputs.source_codes_N, source_P, share_O, phase_QP, phase_of_K, np.asarray(caps_K, np.int64), R,
                  *tally):
        raise ManifestError(f"rows name a step outside 0..{num_steps - 1} or a rank outside 0..{R - 1}",
                            fix="check the manifest first (balancer_cli.replay.integrity.check_manifest)")
    del source_P, phase_QP
    loads = dict(zip(modules, loads_KSR))
    post = dict(zip(phased, post_QSR))
    groups = _GroupTally(*groups_4.tolist())
    share_K = held_K / max(groups.count, 1)
    sparse_K = sparse_shares(share_K)
    metrics = {
        "modules": {m: {
            "dist_ratio": _round(dist_ratio(loads[m])),
            "pad_ratio": _round((padded_K[k] - total_K[k]) / padded_K[k] if padded_K[k] > 0 else 0.0),
            "utilization": _round(utilization(loads[m])),
            "mean_rank_load": _round(loads[m].mean()) if loads[m].size else 0.0,
            # A module a real share of the groups lack is judged by utilization, not Dist (the contract).
            "group_share": _round(share_K[k]),
            "sparse": bool(sparse_K[k]),
        } for k, m in enumerate(modules)},
        "step": {"utilization": _round(step_utilization(list(loads.values())))},
        "steps": _steps(inputs, rows, caps_K, StepShape(world_size=R, micro_batches=M).groups_per_step,
                        epoch_num_steps),
        "groups": groups.summary(),
        "dropped": _dropped(np.asarray(dropped_sample), dropped_reason, inputs.num_samples),
        "step_mix": _step_mix(*dist_2S, num_sources),
    }
    # Under the bound, the report says whether any placement could reach it (only there, so every
    # other report keeps its bytes; a gather of the placed samples' costs). Epochs hold steps of
    # their own, each epoch every sample once.
    under = [k for k, m in enumerate(modules)
             if metrics["modules"][m]["sparse"] and metrics["modules"][m]["utilization"] < MIN_SPARSE_UTILIZATION]
    epoch_starts = search_sorted(rows.step, np.cumsum(epoch_num_steps))[:-1] if under else None
    for k in under:
        cost_by_epoch = np.split(inputs.cost_NK[rows.sample, k], epoch_starts)
        metrics["modules"][modules[k]]["utilization_ceiling"] = _round(utilization_ceiling(cost_by_epoch, R))
    over_dist = [k for k, m in enumerate(modules)
                 if not metrics["modules"][m]["sparse"] and metrics["modules"][m]["dist_ratio"] > MAX_DIST_RATIO]
    # Only where every group over a cap is one sample (isolated: ours, and --oversize isolate),
    # not where groups of several are (baselines that ignore the caps), and only there: every
    # other report keeps its bytes.
    if over_dist and groups.over and not groups.over_multi:
        for k, entry in over_cap_dist(inputs.load_NK, inputs.cost_NK, rows, caps_K, [loads[m] for m in modules],
                                      over_dist).items():
            entry["largest"]["module"] = modules[entry["largest"]["module"]]
            metrics["modules"][modules[k]]["over_cap"] = entry
    metrics["contract"] = contract_entry(metrics, modules)
    if post:
        phases = {m: {"dist_ratio": _round(dist_ratio(x)), "utilization": _round(utilization(x))}
                  for m, x in post.items()}
        step_loads_post = [post.get(m, loads[m]) for m in modules]
        metrics["post_balance"] = {"modules": phases,
                                   "step": {"utilization": _round(step_utilization(step_loads_post))}}
    return Evaluation(metrics, loads)


def utilization_ceiling(cost_by_epoch: Sequence[np.ndarray], world_size: int) -> float:
    """The highest utilization any placement of these costs on ``world_size`` ranks can reach,
    each epoch's samples on steps of their own: ``sum / (R x sum_e max(largest_e, sum_e / R))``.

    A rank holding an epoch's largest sample is busy that long in its step, so that epoch's steps'
    maxima sum to at least that, and to at least its total over R; utilization is the total over R
    times the sum of all steps' maxima. Below 1 where a module's load in an epoch is less than R
    times its largest sample: fewer samples than ranks, or one that outweighs the rest (``sparse``
    8007: 5 audio samples on 8 ranks, 0.313, which the packer reaches by placing all five in one
    step).

    Args:
        cost_by_epoch: one (P_e,) array of the placed samples' costs per epoch.
        world_size: R.

    Example:
        >>> round(utilization_ceiling([np.array([2468., 1627., 865., 649., 578.])], 8), 4)
        0.3134
        >>> utilization_ceiling([np.array([3., 0., 0.])] * 2, 2), utilization_ceiling([np.zeros(0)], 2)
        (0.5, 1.0)
    """
    totals = np.array([float(np.sum(c, dtype=np.float64)) for c in cost_by_epoch])
    largest = np.array([float(np.max(c, initial=0.0)) for c in cost_by_epoch])
    busy = float(np.maximum(largest, totals / world_size).sum()) * world_size
    return float(totals.sum()) / busy if busy > 0 else 1.0


def over_cap_dist(load_NK: np.ndarray, cost_NK: np.ndarray, rows: ManifestRows, caps_K: np.ndarray,
                  loads_KSR: Sequence[np.ndarray], modules_k: Sequence[int]) -> dict[int, dict]:
    """Of each module ``k`` in ``modules_k`` whose Dist is over the contract's, the share in the
    steps that hold a group over a cap (a sample over one, alone in its group: ``--oversize
    isolate``), where the other steps' share is within it.

    Such a group (ours: one sample) is larger than any the caps let form, so no other group in its
    step matches it; dropping them (``--oversize drop``) or caps that hold them even such steps
    out (docs/packing.md, "What still misses"). The largest is named by its load over its cap, of
    the module it is most over.

    Args:
        load_NK, cost_NK: the samples' loads (for the caps) and costs (for the Dist).
        rows: the placement, slot-sorted; ``loads_KSR``: its (S, R) costs per module.
        caps_K: the caps; ``modules_k``: the modules to explain (indices of ``loads_KSR``).

    Returns:
        ``{k: {"dist": in those steps (their per-step Dist summed over all steps), "steps": how
        many, "groups": groups over a cap, "largest": {"module": the index of the module the
        largest is most over, "load", "cap"}}}``, for the modules whose other steps are within
        the bound only.

    Example:
        >>> from balancer_cli.manifest import ManifestRows
        >>> load = np.array([[90], [10], [10], [10], [5], [5], [5], [5]])  # cap 20: sample 0 is over it
        >>> rows = ManifestRows(np.array([0, 0, 1, 1, 1, 1, 1, 1]), np.array([0, 1, 0, 0, 1, 1, 1, 1]),
        ...                     np.zeros(8, int), np.arange(8))
        >>> loads = [np.array([[90., 10.], [20., 20.]])]
        >>> over_cap_dist(load, load, rows, np.array([20]), loads, [0])[0]["steps"]
        1
    """
    slot = rows.slot_numbers()
    if len(slot) == 0:
        return {}
    starts = np.flatnonzero(np.r_[True, slot[1:] != slot[:-1]])
    # One gather of the rows' loads, summed per group in int64 (int32 loads near their top add up past it).
    group_load_GK = np.add.reduceat(take_rows(load_NK, rows.sample).astype(np.int64, copy=False), starts, axis=0)
    over_G = (group_load_GK > np.asarray(caps_K, np.int64)).any(axis=1)
    if not over_G.any():
        return {}
    num_steps = len(loads_KSR[0])
    over_S = np.zeros(num_steps, bool)
    over_S[rows.step[starts[over_G]]] = True
    # The group most over its cap, and the module it is most over.
    ratio_OK = group_load_GK[over_G] / np.maximum(np.asarray(caps_K, np.float64), 1)
    worst, j = np.unravel_index(int(np.argmax(ratio_OK)), ratio_OK.shape)
    load, cap = int(group_load_GK[np.flatnonzero(over_G)[worst], j]), int(caps_K[j])
    explained = {}
    for k in modules_k:
        dist_S = dist_ratio_per_step(loads_KSR[k])
        inside, rest = dist_S[over_S].sum() / max(num_steps, 1), dist_S[~over_S].sum() / max(num_steps, 1)
        if rest <= MAX_DIST_RATIO:
            explained[k] = {"dist": _round(inside), "steps": int(over_S.sum()), "groups": int(over_G.sum()),
                            "largest": {"module": int(j), "load": load, "cap": cap}}
    return explained


def _by_slot(rows: ManifestRows) -> ManifestRows:
    """``rows`` when sorted by (step, rank, micro), else a sorted copy (stable: order in group kept)."""
    if is_slot_sorted(rows):
        return rows
    order = np.argsort(rows.slot_numbers(), kind="stable")
    return ManifestRows(rows.step[order], rows.rank[order], rows.micro[order], rows.sample[order],
                        {name: column[order] for name, column in rows.extra.items()})


class _GroupTally(NamedTuple):
    """Group count, samples and over-cap groups (all, and those of several samples)."""

    count: int
    samples: int
    over: int
    over_multi: int

    def summary(self) -> dict:
        if self.count == 0:
            return {"count": 0, "mean_size": 0.0, "over_cap": 0}
        return {"count": self.count, "mean_size": _round(self.samples / self.count), "over_cap": self.over,
                "over_cap_multi_sample": self.over_multi}


def _steps(inputs, rows: ManifestRows, caps_K: np.ndarray, per_step: int, epoch_num_steps: Sequence[int]) -> dict:
    """Steps per epoch against a lower bound: the fewest groups the caps allow
    (:func:`~balancer_cli.pack.bounds.groups_lower_bound`), R x M of them per step."""

    bounds, first = [], 0
    for steps in epoch_num_steps:
        lo, hi = search_sorted(rows.step, [first, first + steps])
        # Every sample placed (each once an epoch): the bound of all rows, without a mask of them.
        every = hi - lo == inputs.num_samples
        groups = groups_lower_bound(inputs.load_NK, np.asarray(caps_K), rows=None if every else rows.sample[lo:hi]
                                    ) if hi > lo else 0
        bounds.append(math.ceil(groups / per_step))
        first += steps
    total, bound = int(sum(epoch_num_steps)), int(sum(bounds))
    return {"total": total, "per_epoch": [int(s) for s in epoch_num_steps], "lower_bound": bound,
            "lower_bound_per_epoch": bounds, "vs_lower_bound": _round(total / bound) if bound else 1.0}


def _step_mix(distances: np.ndarray, reference: np.ndarray, num_sources: int) -> dict:
    """The report's step mix of the steps' distances and those of the shuffle (:func:`tally_rows`)."""
    mean, reference_mean = _mean(distances), _mean(reference)
    return {"mean_distance": _round(mean),
            "max_distance": _round(distances.max()) if len(distances) else 0.0,
            "shuffled_mean_distance": _round(reference_mean),
            # The measure to read: 1.0 is as mixed as random batching of the same steps.
            "vs_random": _round(mean / reference_mean) if reference_mean > 0 else 1.0,
            "num_sources": num_sources}
