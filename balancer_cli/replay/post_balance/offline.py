"""Post-balancing applied offline to a manifest (``balancer pack --post-balance``).

The packer balances what it sees per group; post-balancing then decides, per step, which rank
runs each encoder's phase for each manifest row, while the LLM phase stays on the row's rank.
The result is stored as extra int32 manifest columns (``<m>_rank``) that the runtime dispatcher
replays, and :func:`phase_utilization` measures what it buys.

Example:
    >>> import numpy as np
    >>> from balancer_cli.manifest import ManifestRows
    >>> rows = ManifestRows(step=np.zeros(4, int), rank=np.array([0, 0, 1, 1]), micro=np.zeros(4, int),
    ...                     sample=np.arange(4))
    >>> costs = {"vision": np.array([9., 8., 1., 0.]), "llm": np.array([5., 5., 5., 5.])}
    >>> ranks = manifest_phase_ranks(rows, costs, world_size=2)
    >>> ranks["vision"].tolist()
    [0, 1, 1, 1]
    >>> u = phase_utilization(rows, costs, ranks, world_size=2)
    >>> round(u["vision"], 3), u["llm"], round(phase_utilization(rows, costs, {}, world_size=2)["vision"], 3)
    (1.0, 1.0, 0.529)
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np

from balancer_cli._index import run_blocks, search_sorted
from balancer_cli.errors import PlanError
from balancer_cli.lengths import LLM
from balancer_cli.manifest import ManifestRows
from balancer_cli.replay.post_balance.loads import phase_loads
from balancer_cli.replay.post_balance.plan import PostBalancePlan, plan_post_balance

__all__ = ["manifest_phase_ranks", "phase_utilization", "plan_from_phase_ranks"]

#: Rows whose costs :func:`manifest_phase_ranks` gathers at a time (whole steps, a step past it at most).
_BLOCK_ROWS = 1 << 18


def _module_order(costs: Mapping[str, np.ndarray]) -> list[str]:
    if LLM not in costs:
        raise PlanError(f"costs have no {LLM!r} module (got {', '.join(costs) or 'none'})",
                        fix="pass per-sample costs of every encoder and of 'llm' (see balancer_cli.cost.samples.sample_costs)")
    return [m for m in costs if m != LLM] + [LLM]


def _step_bounds(rows: ManifestRows) -> np.ndarray:
    """(S + 1,) where each step's rows start, then the row count: compared in the column's own
    type (no (P,) int64 copies of it)."""
    step = np.asarray(rows.step)
    if len(step) == 0:
        return np.zeros(1, np.int64)
    if (step[1:] < step[:-1]).any():
        raise PlanError("manifest rows are not sorted by step", fix="pass rows as written by write_manifest")
    return np.concatenate([[0], np.flatnonzero(step[1:] != step[:-1]) + 1, [len(step)]]).astype(np.int64)


def manifest_phase_ranks(
    rows: ManifestRows,
    costs: Mapping[str, np.ndarray],
    world_size: int,
    *,
    attention: str | Sequence[str] = "varlen",
    ranks_per_node: int | None = None,
) -> dict[str, np.ndarray]:
    """Rank that runs each encoder's phase for every manifest row, step by step.

    Args:
        rows: manifest rows sorted by (step, rank, micro).
        costs: ``{module: (num_samples,) cost per sample id}`` for the encoders and ``"llm"``.
        world_size: R.
        attention: ``"varlen"``/``"padded"`` for all modules or one per module (encoders, then llm).
        ranks_per_node: prefer moves within a node.

    Returns:
        ``{encoder: (len(rows),) int32}``; the LLM phase stays at ``rows.rank``.

    Raises:
        PlanError: costs without ``llm``, a sample id outside a cost array, ranks outside R.

    Example:
        >>> rows = ManifestRows(step=np.zeros(4, int), rank=np.array([0, 0, 1, 1]), micro=np.zeros(4, int),
        ...                     sample=np.arange(4))
        >>> costs = {"vision": np.array([9., 8., 1., 0.]), "llm": np.array([5., 5., 5., 5.])}
        >>> manifest_phase_ranks(rows, costs, world_size=2)["vision"].tolist()
        [0, 1, 1, 1]
    """
    order = _module_order(costs)
    # The rows' own columns, and the costs gathered a block of steps at a time: a (P, K) float64
    # table and int64 copies of the columns took 0.54 GB at 10M rows (--memory-gb 1 ended at 1.23 GiB).
    sample, rank = np.asarray(rows.sample), np.asarray(rows.rank)
    columns = [np.asarray(costs[m]) for m in order]
    for m, column in zip(order, columns):
        if len(sample) and sample.max() >= len(column):
            raise PlanError(f"manifest sample {int(sample.max())} has no cost in module {m!r} "
                            f"({len(column)} costs)", fix="compute costs from the lengths table the manifest was packed from")
    if len(rank) and (rank.min() < 0 or rank.max() >= world_size):
        raise PlanError(f"manifest rank {int(rank.max())} is outside world_size {world_size}",
                        fix="pass the manifest's world_size")
    out = np.empty((len(order) - 1, len(rows)), np.int32)
    bounds = _step_bounds(rows)
    for first, last in itertools.pairwise(run_blocks(bounds, _BLOCK_ROWS)):  # steps first .. last - 1
        a = bounds[first]
        cost_PK = np.stack([column[sample[a:bounds[last]]].astype(np.float64) for column in columns], axis=1)
        for lo, hi in itertools.pairwise(bounds[first:last + 1]):
            # rows of one step are sorted by rank: each rank's rows are one contiguous slice
            cuts = lo - a + search_sorted(rank[lo:hi], np.arange(world_size + 1))
            plan = plan_post_balance([cost_PK[x:y] for x, y in itertools.pairwise(cuts)], ranks_per_node,
                                     modules=order, attention=attention)
            out[:, lo:hi] = plan.dest_KN[:-1]
    return {m: out[i] for i, m in enumerate(order[:-1])}


def phase_utilization(
    rows: ManifestRows,
    costs: Mapping[str, np.ndarray],
    phase_ranks: Mapping[str, np.ndarray],
    world_size: int,
    *,
    attention: str | Mapping[str, str] = "varlen",
) -> dict[str, float]:
    """Utilization per module and for the whole step, given which rank runs each phase.

    Utilization is ``sum_s sum_r T(s, r) / (R * sum_s max_r T(s, r))`` (ARCHITECTURE.md); the whole
    step runs modules one after another, so its time is ``sum_m max_r T``. A module missing from
    ``phase_ranks`` runs on ``rows.rank`` (pass ``{}`` for the utilization before post-balancing).

    Returns:
        ``{module: utilization, ..., "step": whole-step utilization}``.

    Example:
        >>> rows = ManifestRows(step=np.zeros(2, int), rank=np.array([0, 1]), micro=np.zeros(2, int),
        ...                     sample=np.arange(2))
        >>> costs = {"vision": np.array([3., 1.]), "llm": np.array([2., 2.])}
        >>> phase_utilization(rows, costs, {}, world_size=2)
        {'vision': 0.6666666666666666, 'llm': 1.0, 'step': 0.8}
    """
    order = _module_order(costs)
    sample = np.asarray(rows.sample, dtype=np.int64)
    bounds = _step_bounds(rows)
    busy = {m: 0.0 for m in order}
    peak = {m: 0.0 for m in order}
    for m in order:
        mode = attention if isinstance(attention, str) else attention.get(m, "varlen")
        cost = np.asarray(costs[m], dtype=np.float64)[sample]
        where = np.asarray(phase_ranks.get(m, rows.rank), dtype=np.int64)
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            load_R = phase_loads(cost[lo:hi], where[lo:hi], world_size, mode)
            busy[m] += float(load_R.sum())
            peak[m] += float(load_R.max(initial=0.0))
    result = {m: (busy[m] / (world_size * peak[m]) if peak[m] > 0 else 1.0) for m in order}
    total_peak = sum(peak.values())
    result["step"] = sum(busy.values()) / (world_size * total_peak) if total_peak > 0 else 1.0
    return result


def plan_from_phase_ranks(
    rank_P: np.ndarray,
    phase_ranks: Mapping[str, np.ndarray],
    world_size: int,
    *,
    cost_PK: np.ndarray | None = None,
    attention: str | Sequence[str] = "varlen",
) -> PostBalancePlan:
    """Rebuild one step's plan from a manifest's ``<m>_rank`` columns (no communication).

    The training job replays the offline decision: every rank reads the same step's rows and
    gets the same plan, ready for :class:`~balancer_cli.runtime.dispatch.PhaseDispatcher`.

    Args:
        rank_P: (P,) the rows' ranks for one step, sorted (manifest order); row order within a
            rank is the sample order on that rank.
        phase_ranks: ``{encoder: (P,) rank running its phase}``, in phase order; the LLM phase
            runs on ``rank_P``.
        world_size: R.
        cost_PK: optional (P, K) costs (encoders in ``phase_ranks`` order, then the LLM) to fill
            the predicted loads; zeros otherwise.
        attention: ``"varlen"``/``"padded"`` for the loads, for all or per module.

    Example:
        >>> plan = plan_from_phase_ranks(np.array([0, 0, 1]), {"vision": np.array([0, 1, 1])}, 2)
        >>> plan.modules, [d.tolist() for d in plan.destinations[0]]
        (('vision', 'llm'), [[0, 1], [1]])
    """
    rank_P = np.asarray(rank_P, dtype=np.int64)
    if len(rank_P) and ((np.diff(rank_P) < 0).any() or rank_P.min() < 0 or rank_P.max() >= world_size):
        raise PlanError("a step's rows must be sorted by rank, with ranks in 0..world_size-1",
                        fix="pass one step of a manifest written by balancer pack")
    modules = tuple(phase_ranks) + (LLM,)
    dest_KN = np.stack([np.asarray(phase_ranks[m], dtype=np.int32) for m in phase_ranks]
                       + [rank_P.astype(np.int32)]).reshape(len(modules), len(rank_P))
    if ((dest_KN < 0) | (dest_KN >= world_size)).any():
        raise PlanError(f"a phase rank is outside 0..{world_size - 1}", fix="pass the manifest's world_size")
    modes = (attention,) * len(modules) if isinstance(attention, str) else tuple(attention)
    offsets = np.concatenate([[0], np.cumsum(np.bincount(rank_P, minlength=world_size))]).astype(np.int64)
    before = np.zeros((len(modules), world_size))
    after = np.zeros((len(modules), world_size))
    lower = np.zeros(len(modules))
    if cost_PK is not None:
        cost_PK = np.asarray(cost_PK, dtype=np.float64).reshape(len(rank_P), len(modules))
        for m in range(len(modules)):
            before[m] = phase_loads(cost_PK[:, m], rank_P, world_size, modes[m])
            after[m] = phase_loads(cost_PK[:, m], dest_KN[m], world_size, modes[m])
            lower[m] = max(cost_PK[:, m].sum() / world_size, cost_PK[:, m].max(initial=0.0))
    for a in (offsets, dest_KN, before, after, lower):
        a.setflags(write=False)
    return PostBalancePlan(modules, modes, world_size, None, offsets, dest_KN, before, after, lower)
