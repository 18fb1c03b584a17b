"""Adaptive activation recomputation: per stage, recompute as little as possible to fit GPU memory.

Memory of pipeline stage i (of P) at its peak under the 1F1B schedule (PipeDream-Flush,
Narayanan et al. 2021, arXiv:2104.04473, Sec. 2.2: stage i holds the activations of
``min(P - i, m)`` micro-batches in flight):

    peak_i = state_i + inflight_i x stored_i(g*) + work_i(g*)

- ``state_i``: weights + gradients + Adam states of the stage's layers,
  :func:`balancer_cli.cost.flops.state_bytes_per_param` (ZeRO stage and data-parallel size);
- ``stored_i(g)``: activations the stage keeps for one micro-batch of group g, each layer at its
  recompute mode (none / selective / full, Korthikanti et al. 2022);
- ``work_i(g)``: the working set of recomputation: one recomputed layer's full activations
  (the largest such layer), since backward rebuilds one layer at a time;
- ``g*``: the heaviest group of the data for that stage (the max over groups is checked).

The plan must keep ``peak_i <= (1 - margin) x G``; the margin (default 10%) covers the CUDA
context, NCCL and allocator fragmentation, which the formulas do not model. Among plans that fit,
the planner minimizes the added forward FLOPs (a multiple-choice knapsack per stage, solved
exactly by dynamic programming over memory discretized into ``resolution`` steps, savings rounded
down so a plan that fits on the grid fits for real, and rounded up for a relaxation whose pick is
taken where it fits for real and costs less). With no recompute needed it recomputes
nothing; when even full recomputation of every layer does not fit it raises
:class:`~balancer_cli.errors.PlanError` with the memory needed.

Example:
    >>> from balancer_cli.cost.samples import CostModel
    >>> from balancer_cli.planners.chain import build_chain, explicit_features
    >>> model = CostModel.build("llama3-8b")
    >>> chain = build_chain(model)
    >>> feats = explicit_features(model, 8192, {})
    >>> bounds = ((0, 16), (17, 33))
    >>> args = dict(micro_batches=8, zero_stage=1, dp=8)
    >>> [s.num_recomputed for s in plan_recompute(chain, bounds, feats, feats, gpu_memory_gb=80, **args).stages]
    [0, 0]
    >>> [s.num_recomputed for s in plan_recompute(chain, bounds, feats, feats, gpu_memory_gb=60, **args).stages]
    [6, 0]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from balancer_cli.cost import flops
from balancer_cli.errors import PlanError
from balancer_cli.planners.chain import Layer, evaluate

__all__ = ["GB", "NONE", "SELECTIVE", "FULL", "StagePlan", "RecomputePlan", "plan_recompute", "stage_memory"]

#: Bytes of one GB (memory sizes are decimal, as GPU data sheets give them).
GB = 1e9
#: Indices of the recompute modes in :data:`balancer_cli.cost.flops.RECOMPUTE_MODES`.
NONE, SELECTIVE, FULL = 0, 1, 2


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    """One stage's recompute plan.

    Attributes:
        stage: index i.
        layers: inclusive chain range.
        modes: recompute mode per layer of the stage (``none``/``selective``/``full``).
        names: layer names of the stage.
        inflight: micro-batches whose activations the stage holds at its peak (1F1B).
        state_bytes, activation_bytes, work_bytes: the three parts of the peak (activation =
            inflight x stored per micro-batch), for the heaviest group.
        peak_bytes: their sum.
        base_flops: forward + backward FLOPs of the stage for a typical group.
        extra_flops: forward FLOPs the recomputation adds for a typical group.
    """

    stage: int
    layers: tuple[int, int]
    modes: tuple[str, ...]
    names: tuple[str, ...]
    inflight: int
    state_bytes: float
    activation_bytes: float
    work_bytes: float
    peak_bytes: float
    base_flops: float
    extra_flops: float

    @property
    def num_recomputed(self) -> int:
        """Layers of the stage recomputed at all (selective or full)."""
        return sum(m != "none" for m in self.modes)

    @property
    def overhead(self) -> float:
        """Added compute of the stage relative to its forward + backward."""
        return self.extra_flops / self.base_flops if self.base_flops else 0.0

    def recompute_layers(self) -> dict[str, list[str]]:
        """``{"full": [...], "selective": [...]}`` layer names.

        Example:
            >>> stage = StagePlan(stage=0, layers=(0, 2), modes=("full", "none", "selective"), names=("a", "b", "c"),
            ...                   inflight=1, state_bytes=0.0, activation_bytes=0.0, work_bytes=0.0, peak_bytes=0.0,
            ...                   base_flops=1.0, extra_flops=0.5)
            >>> stage.recompute_layers(), stage.num_recomputed, stage.overhead
            ({'full': ['a'], 'selective': ['c']}, 2, 0.5)
        """
        return {mode: [n for n, m in zip(self.names, self.modes) if m == mode] for mode in ("full", "selective")}


@dataclass(frozen=True, kw_only=True, slots=True)
class RecomputePlan:
    """Per-stage plans plus the budget they were fit to.

    Attributes:
        stages: one :class:`StagePlan` per pipeline stage.
        budget_bytes: ``(1 - margin) x G``.
        step_overhead: predicted step-time increase: slowest stage with recomputation over the
            slowest without, minus 1 (1F1B step time is set by the slowest stage).
    """

    stages: tuple[StagePlan, ...]
    budget_bytes: float
    step_overhead: float


def stage_memory(layers: Sequence[Layer], modes: Sequence[int], features: Mapping[str, object], *,
                 inflight: int, bytes_per_param: float) -> tuple[float, float, float]:
    """``(state, activation, work)`` bytes of a stage for the given features (arrays give arrays).

    Args:
        layers: the stage's layers.
        modes: recompute mode index per layer (:data:`NONE`, :data:`SELECTIVE`, :data:`FULL`).
        features: one group's features, or (G,) arrays of every group's.
        inflight: micro-batches whose activations the stage holds at its peak.
        bytes_per_param: weights + gradients + optimizer states per parameter.

    Example:
        >>> from balancer_cli.cost.samples import CostModel
        >>> from balancer_cli.planners.chain import build_chain, explicit_features
        >>> model = CostModel.build("llama3-8b")
        >>> layers = build_chain(model)[1:3]
        >>> state, act, work = stage_memory(layers, [FULL, NONE], explicit_features(model, 4096, {}), inflight=2,
        ...                                 bytes_per_param=16)
        >>> round(state / GB, 2), round(float(act) / GB, 2), round(float(work) / GB, 2)
        (6.98, 1.44, 0.69)
    """
    state = bytes_per_param * sum(layer.params for layer in layers)
    stored = sum(evaluate(layer.act[mode], features) for layer, mode in zip(layers, modes))
    work = 0.0
    for layer, mode in zip(layers, modes):
        if mode != NONE:
            work = np.maximum(work, evaluate(layer.act[NONE], features))
    return state, inflight * np.asarray(stored, dtype=np.float64), np.asarray(work, dtype=np.float64)


def _knapsack(saving: np.ndarray, cost: np.ndarray, need: float, resolution: int) -> np.ndarray | None:
    """Choose one mode per layer (columns: none/selective/full) with total saving >= need at the
    least total cost. ``saving``/``cost``: (L, 3). Returns the (L,) modes, or None if impossible."""
    n = len(saving)
    if need <= 0:
        return np.zeros(n, dtype=np.int64)
    if saving.max(axis=1).sum() < need:
        return None
    unit = need / resolution
    # Savings rounded down: a pick that fits on the grid fits for real, but one whose savings reach
    # ``need`` only with their fractions is missed. Rounded up they make a relaxation (its least cost
    # is at most the true optimum's): its pick, where its exact savings do reach ``need`` and it
    # costs less, is the exact optimum (a memory budget at such an edge got a dearer plan).
    safe = _grid_knapsack(np.minimum(np.floor(saving / unit + 1e-9).astype(np.int64), resolution), cost, resolution)
    relaxed = _grid_knapsack(np.minimum(np.ceil(saving / unit - 1e-9).astype(np.int64), resolution), cost, resolution)
    rows = np.arange(n)
    if relaxed is not None and saving[rows, relaxed].sum() >= need and (
            safe is None or cost[rows, relaxed].sum() < cost[rows, safe].sum() * (1 - 1e-12)):
        return relaxed
    return safe


def _grid_knapsack(units: np.ndarray, cost: np.ndarray, resolution: int) -> np.ndarray | None:
    """:func:`_knapsack` on a grid: ``units`` (L, 3) of saving per mode, ``resolution`` units needed."""
    n = len(units)
    best = np.full(resolution + 1, np.inf)  # best[j]: least cost saving >= j units (capped)
    best[0] = 0.0
    picks = np.zeros((n, resolution + 1), dtype=np.int8)
    grid = np.arange(resolution + 1)
    for k in range(n):
        new, pick = best.copy(), np.zeros(resolution + 1, dtype=np.int8)
        for mode in (SELECTIVE, FULL):
            if units[k, mode] <= 0:
                continue
            prev = np.maximum(grid - units[k, mode], 0)
            value = best[prev] + cost[k, mode]
            better = value < new - 1e-12 * max(1.0, abs(cost[k, mode]))
            new, pick = np.where(better, value, new), np.where(better, mode, pick)
        best, picks[k] = new, pick
    if not np.isfinite(best[resolution]):
        return None
    modes, j = np.zeros(n, dtype=np.int64), resolution
    for k in range(n - 1, -1, -1):
        mode = int(picks[k, j])
        modes[k] = mode
        if mode:
            j = max(j - int(units[k, mode]), 0)
    return modes


def _canonical(layers: Sequence[Layer], modes: np.ndarray) -> np.ndarray:
    """Identical layers are interchangeable: per module, put full first, then selective (Megatron's
    ``block`` method recomputes the first layers of a stage)."""
    out = modes.copy()
    for module in dict.fromkeys(layer.module for layer in layers):
        idx = [i for i, layer in enumerate(layers) if layer.module == module and layer.recomputable]
        chosen = sorted((modes[i] for i in idx), reverse=True)
        out[idx] = chosen
    return out


def plan_recompute(chain: Sequence[Layer], bounds: Sequence[tuple[int, int]], typical: Mapping[str, float],
                   heavy: Mapping[str, object], *, gpu_memory_gb: float, margin: float = 0.1, zero_stage: int = 0,
                   dp: int = 1, micro_batches: int = 1, resolution: int = 2000) -> RecomputePlan:
    """Plan recomputation for a partitioned chain.

    Args:
        chain: the layers (:func:`balancer_cli.planners.chain.build_chain`).
        bounds: inclusive layer range per stage.
        typical: features of a typical group (for the compute overhead).
        heavy: features of the groups to fit, scalars or (G,) arrays (the max over them must fit).
        gpu_memory_gb: G, memory per GPU in GB (1e9 bytes).
        margin: share of G kept free.
        zero_stage, dp: ZeRO stage 0-3 and data-parallel size (sharding of states).
        micro_batches: m, micro-batches per step per pipeline.
        resolution: memory grid steps of the knapsack.

    Raises:
        PlanError: some stage does not fit even with full recomputation of all its layers.

    Example:
        >>> from balancer_cli.cost.samples import CostModel
        >>> from balancer_cli.planners.chain import build_chain, explicit_features
        >>> model = CostModel.build("llama3-8b")
        >>> feats = explicit_features(model, 8192, {})
        >>> plan = plan_recompute(build_chain(model), ((0, 16), (17, 33)), feats, feats, gpu_memory_gb=60,
        ...                       micro_batches=8, zero_stage=1, dp=8)
        >>> [s.num_recomputed for s in plan.stages], round(plan.budget_bytes / GB, 1)
        ([6, 0], 54.0)
    """
    if not 0 <= margin < 1:
        raise ValueError(f"margin {margin} not in [0, 1)")
    budget = (1.0 - margin) * gpu_memory_gb * GB
    per_param = flops.state_bytes_per_param(zero_stage, dp)
    num_stages = len(bounds)
    plans: list[StagePlan] = []
    failures: list[str] = []
    for i, (first, last) in enumerate(bounds):
        layers = list(chain[first:last + 1])
        inflight = min(num_stages - i, micro_batches)
        heavy_of = lambda modes: _peak(layers, modes, heavy, inflight, per_param)  # noqa: E731
        modes = np.zeros(len(layers), dtype=np.int64)
        full_all = np.array([FULL if layer.recomputable else NONE for layer in layers])
        if heavy_of(modes)[0] > budget:
            if heavy_of(full_all)[0] > budget:
                failures.append(f"stage {i} needs {heavy_of(full_all)[0] / GB:.1f} GB with every layer recomputed")
                continue
            modes = _fit(layers, heavy, typical, inflight, per_param, budget, resolution, full_all)
        peak, g = heavy_of(modes)
        state, act, work = stage_memory(layers, modes, _pick(heavy, g), inflight=inflight, bytes_per_param=per_param)
        base = float(sum(layer.train_flops(typical) for layer in layers))
        extra = float(sum(evaluate(layer.extra[m], typical) for layer, m in zip(layers, modes)))
        plans.append(StagePlan(stage=i, layers=(first, last), modes=tuple(flops.RECOMPUTE_MODES[m] for m in modes),
                               names=tuple(layer.name for layer in layers), inflight=inflight, state_bytes=float(state),
                               activation_bytes=float(act), work_bytes=float(work), peak_bytes=float(peak),
                               base_flops=base, extra_flops=extra))
    if failures:
        raise PlanError(f"no recompute plan fits {gpu_memory_gb:g} GB per GPU (budget {budget / GB:.1f} GB after "
                        f"the {margin:.0%} margin): " + "; ".join(failures),
                        fix="add pipeline stages or tensor parallelism, raise {zero_stage}/{dp}, or use larger GPUs")
    slow = max(p.base_flops for p in plans)
    slow_with = max(p.base_flops + p.extra_flops for p in plans)
    return RecomputePlan(stages=tuple(plans), budget_bytes=budget, step_overhead=slow_with / slow - 1.0 if slow else 0.0)


def _pick(features: Mapping[str, object], g: int | None) -> dict[str, float]:
    """Group ``g``'s features (all of them when the features are scalars: ``g`` is None)."""
    if g is None:
        return {k: float(v) for k, v in features.items()}
    return {k: float(np.asarray(v).reshape(-1)[g]) if np.ndim(v) else float(v) for k, v in features.items()}


def _peak(layers, modes, heavy, inflight, per_param) -> tuple[float, int | None]:
    """The stage's peak bytes over the groups of ``heavy``, and the group that reaches it."""
    state, act, work = stage_memory(layers, modes, heavy, inflight=inflight, bytes_per_param=per_param)
    total = np.atleast_1d(state + act + work)
    g = int(np.argmax(total))
    return float(total[g]), (g if any(np.ndim(v) for v in heavy.values()) else None)


def _fit(layers, heavy, typical, inflight, per_param, budget, resolution, full_all) -> np.ndarray:
    """Knapsack on the heaviest group, re-checked on all groups; tighten and retry when another
    group (heavier under the chosen modes) does not fit. The working set depends on which layers
    are recomputed, so each distinct layer size is tried as the largest recomputed one."""
    _, g = _peak(layers, np.zeros(len(layers), dtype=np.int64), heavy, inflight, per_param)
    target = budget
    for _ in range(8):
        feats = _pick(heavy, g)
        state, act, _ = stage_memory(layers, np.zeros(len(layers), dtype=np.int64), feats, inflight=inflight,
                                     bytes_per_param=per_param)
        none = np.array([float(evaluate(layer.act[NONE], feats)) for layer in layers])
        saving = np.zeros((len(layers), 3))
        cost = np.zeros((len(layers), 3))
        for k, layer in enumerate(layers):
            if not layer.recomputable:
                continue
            for mode in (SELECTIVE, FULL):
                saving[k, mode] = inflight * (none[k] - float(evaluate(layer.act[mode], feats)))
                cost[k, mode] = float(evaluate(layer.extra[mode], typical))
        best, best_cost = None, np.inf
        recomputable = np.array([layer.recomputable for layer in layers])
        for work in sorted(set(none[recomputable].tolist())):
            allowed = recomputable & (none <= work)
            modes = _knapsack(np.where(allowed[:, None], saving, 0.0), cost, float(state + act + work - target), resolution)
            if modes is not None:
                total = float(sum(cost[k, m] for k, m in enumerate(modes)))
                if best is None or total < best_cost - 1e-9 * max(1.0, best_cost):
                    best, best_cost = modes, total
        if best is None:
            return full_all
        modes = _canonical(layers, best)
        peak, g_worst = _peak(layers, modes, heavy, inflight, per_param)
        if peak <= budget:
            return modes
        target -= peak - budget
        g = g_worst
    return full_all
