"""Pipeline partition of a layer chain: OmniBal's balanced model partition (BMP) and the exact optimum.

BMP (OmniBal, Yao et al. 2024, arXiv:2407.20761, Sec. "Model Balance"): take a greedy
*anchor* partition (each cut where the running cost is closest to k/P of the total), enumerate
every partition whose cuts lie within ``radius`` layers of the anchor's, rank them by the variance
of the stage times and then by the activation volume crossing the cuts, and keep the ``top_k``.
OmniBal profiles those K for real; here the cost model scores them and the one with the smallest
largest stage wins. The exact min-max partition (dynamic programming over prefix sums, O(P L^2)
for P stages and L layers)
shows how far BMP is from the optimum; two baselines show what it beats: an equal number of
layers per stage (DeepSpeed ``partition_method="uniform"``) and Megatron's default for MLLMs
(the encoder with the first stage, LLM layers split evenly).

Example:
    >>> import numpy as np
    >>> costs = np.array([1.0, 1, 1, 1, 4, 2])
    >>> exact_partition(costs, 2)
    ((0, 3), (4, 5))
    >>> plan = plan_partition(costs, np.zeros(6), 2, radius=1, top_k=3)
    >>> plan.chosen.bounds, plan.chosen.max_cost, plan.optimum.max_cost
    (((0, 3), (4, 5)), 6.0, 6.0)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "Bounds",
    "Partition",
    "PartitionPlan",
    "make_partition",
    "exact_partition",
    "greedy_partition",
    "equal_layer_partition",
    "first_stage_partition",
    "bmp_candidates",
    "plan_partition",
    "bounds_from_cuts",
]

#: Stages as inclusive layer ranges: ``((first, last), ...)``, covering the chain in order.
Bounds = tuple[tuple[int, int], ...]
#: Candidate enumeration stops growing the radius past this many candidates.
MAX_CANDIDATES = 1_000_000


@dataclass(frozen=True, kw_only=True, slots=True)
class Partition:
    """Stages as inclusive layer ranges, with their costs and the bytes sent after each.

    Attributes:
        bounds: ``((first, last), ...)`` per stage, inclusive, covering the chain in order.
        stage_costs: cost per stage (FLOPs or measured seconds).
        cut_bytes: activation bytes each stage sends to the next (0 for the last).

    Example:
        >>> part = Partition(bounds=((0, 3), (4, 5)), stage_costs=(4.0, 6.0), cut_bytes=(3.0, 0.0))
        >>> part.max_cost, part.variance, part.comm_bytes
        (6.0, 1.0, 3.0)
    """

    bounds: Bounds
    stage_costs: tuple[float, ...]
    cut_bytes: tuple[float, ...]

    @property
    def max_cost(self) -> float:
        """The largest stage's cost: what sets the 1F1B step time."""
        return max(self.stage_costs)

    @property
    def variance(self) -> float:
        """Variance of the stage costs (BMP's first ranking key)."""
        return float(np.var(self.stage_costs))

    @property
    def comm_bytes(self) -> float:
        """Bytes crossing all cuts (BMP's second ranking key)."""
        return float(sum(self.cut_bytes))


def bounds_from_cuts(cuts: Sequence[int], num_layers: int) -> Bounds:
    """Cuts (first layer of each stage after the first) to inclusive bounds.

    Example:
        >>> bounds_from_cuts([2, 5], 7)
        ((0, 1), (2, 4), (5, 6))
    """
    starts = [0, *cuts]
    ends = [*cuts, num_layers]
    return tuple((int(a), int(b) - 1) for a, b in zip(starts, ends))


def make_partition(bounds: Bounds, costs: np.ndarray, out_bytes: np.ndarray) -> Partition:
    """The :class:`Partition` of ``bounds`` over layers of ``costs``, sending ``out_bytes`` after each.

    Example:
        >>> make_partition(((0, 3), (4, 5)), np.array([1.0, 1, 1, 1, 4, 2]), np.arange(6.0))
        Partition(bounds=((0, 3), (4, 5)), stage_costs=(4.0, 6.0), cut_bytes=(3.0, 0.0))
    """
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    stage_costs = tuple(float(prefix[b + 1] - prefix[a]) for a, b in bounds)
    cut = tuple(float(out_bytes[b]) if i < len(bounds) - 1 else 0.0 for i, (_, b) in enumerate(bounds))
    return Partition(bounds=bounds, stage_costs=stage_costs, cut_bytes=cut)


def _check(num_layers: int, stages: int) -> None:
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if num_layers < stages:
        raise ValueError(f"{num_layers} layers cannot fill {stages} stages")


def exact_partition(costs: Sequence[float], stages: int) -> Bounds:
    """The contiguous partition into ``stages`` non-empty stages minimizing the largest stage cost.

    Dynamic programming: ``best[k][j]`` = smallest largest stage over the first ``j`` layers in
    ``k`` stages; O(P L^2) with a vectorized inner minimum. Ties keep the earliest cut.

    Raises:
        ValueError: ``stages < 1`` or more stages than layers.

    Example:
        >>> exact_partition([1.0, 1, 1, 1, 4, 2], 2)
        ((0, 3), (4, 5))
    """
    c = np.asarray(costs, dtype=np.float64)
    n = len(c)
    _check(n, stages)
    prefix = np.concatenate([[0.0], np.cumsum(c)])
    best = np.full((stages + 1, n + 1), np.inf)
    arg = np.zeros((stages + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            i = np.arange(k - 1, j)  # the last stage is layers i .. j-1
            value = np.maximum(best[k - 1, i], prefix[j] - prefix[i])
            pick = int(np.argmin(value))
            best[k, j], arg[k, j] = value[pick], i[pick]
    cuts, j = [], n
    for k in range(stages, 1, -1):
        j = int(arg[k, j])
        cuts.append(j)
    return bounds_from_cuts(cuts[::-1], n)


def greedy_partition(costs: Sequence[float], stages: int) -> Bounds:
    """BMP's anchor: cut where the running cost is closest to k/P of the total (each stage non-empty).

    Example:
        >>> greedy_partition([1.0, 1, 1, 1, 4, 2], 2)
        ((0, 3), (4, 5))
    """
    c = np.asarray(costs, dtype=np.float64)
    n = len(c)
    _check(n, stages)
    prefix = np.cumsum(c)
    total = prefix[-1]
    cuts, prev = [], 0
    for k in range(1, stages):
        target = total * k / stages
        j = int(np.argmin(np.abs(prefix - target))) + 1  # cut after the closest layer
        j = min(max(j, prev + 1), n - (stages - k))
        cuts.append(j)
        prev = j
    return bounds_from_cuts(cuts, n)


def equal_layer_partition(num_layers: int, stages: int) -> Bounds:
    """Equal layer counts per stage, the remainder to the first stages (DeepSpeed ``uniform``).

    Example:
        >>> equal_layer_partition(7, 3)
        ((0, 2), (3, 4), (5, 6))
    """
    _check(num_layers, stages)
    sizes = [len(a) for a in np.array_split(np.arange(num_layers), stages)]
    return bounds_from_cuts(np.cumsum(sizes)[:-1].tolist(), num_layers)


def first_stage_partition(llm_first: int, llm_layers: int, num_layers: int, stages: int) -> Bounds:
    """Megatron's MLLM default: everything before the LLM layers with the first stage, the
    ``llm_layers`` LLM layers (starting at chain index ``llm_first``) split evenly, the head last.

    Raises:
        ValueError: fewer LLM layers than stages.

    Example:
        >>> first_stage_partition(3, 6, 10, 3)   # 3 layers before the LLM, 6 LLM layers, the head
        ((0, 4), (5, 6), (7, 9))
    """
    if llm_layers < stages:
        raise ValueError(f"{llm_layers} LLM layers cannot fill {stages} stages")
    sizes = [len(a) for a in np.array_split(np.arange(llm_layers), stages)]
    cuts = (llm_first + np.cumsum(sizes)[:-1]).tolist()
    return bounds_from_cuts(cuts, num_layers)


def bmp_candidates(costs: Sequence[float], out_bytes: Sequence[float], stages: int, *, radius: int = 2,
                   top_k: int = 5) -> tuple[Bounds, list[Partition], int]:
    """BMP's search: the anchor, and the ``top_k`` partitions within ``radius`` of its cuts ranked
    by (variance of stage costs, bytes crossing the cuts). Returns ``(anchor, top, radius used)``;
    the radius shrinks while (2r + 1)^(P - 1) exceeds :data:`MAX_CANDIDATES`.

    Example:
        >>> anchor, top, radius = bmp_candidates([1.0, 1, 1, 1, 4, 2], [0.0] * 6, 2, radius=1, top_k=2)
        >>> anchor, [p.bounds for p in top], radius
        (((0, 3), (4, 5)), [((0, 3), (4, 5)), ((0, 2), (3, 5))], 1)
    """
    c = np.asarray(costs, dtype=np.float64)
    out = np.asarray(out_bytes, dtype=np.float64)
    n = len(c)
    anchor = greedy_partition(c, stages)
    if stages == 1:
        return anchor, [make_partition(anchor, c, out)], 0
    radius = min(radius, _largest_radius(stages))
    anchor_cuts = np.array([b[0] for b in anchor[1:]], dtype=np.int64)
    offsets = np.array(list(itertools.product(range(-radius, radius + 1), repeat=stages - 1)), dtype=np.int64)
    cuts = anchor_cuts[None, :] + offsets.reshape(-1, stages - 1)
    edges = np.concatenate([np.zeros((len(cuts), 1), np.int64), cuts, np.full((len(cuts), 1), n)], axis=1)
    valid = (np.diff(edges, axis=1) > 0).all(axis=1)
    edges = edges[valid]
    prefix = np.concatenate([[0.0], np.cumsum(c)])
    stage_cost = prefix[edges[:, 1:]] - prefix[edges[:, :-1]]
    variance = stage_cost.var(axis=1)
    comm = out[edges[:, 1:-1] - 1].sum(axis=1)
    order = np.lexsort((comm, variance))[:top_k]
    top = [make_partition(bounds_from_cuts(edges[i, 1:-1].tolist(), n), c, out) for i in order]
    return anchor, top, radius


def _largest_radius(stages: int) -> int:
    """The largest r with (2r + 1)^(P - 1) <= :data:`MAX_CANDIDATES` (0 if none).

    What shrinking a radius one step at a time reaches, found without walking down from the
    radius asked for (``--radius 99999999999999999999`` never finished).

    Example:
        >>> _largest_radius(2), _largest_radius(3), _largest_radius(40)
        (499999, 499, 0)
    """
    root = int((MAX_CANDIDATES ** (1.0 / (stages - 1)) - 1) // 2)  # a float estimate, corrected below
    while (2 * (root + 1) + 1) ** (stages - 1) <= MAX_CANDIDATES:
        root += 1
    while root > 0 and (2 * root + 1) ** (stages - 1) > MAX_CANDIDATES:
        root -= 1
    return max(root, 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class PartitionPlan:
    """The result of :func:`plan_partition`.

    Attributes:
        chosen: BMP's pick (smallest largest stage among the top-K; ties by rank).
        optimum: the exact min-max partition.
        equal: equal layers per stage.
        anchor: BMP's greedy anchor.
        candidates: BMP's top-K, ranked.
        radius: the search radius used.
    """

    chosen: Partition
    optimum: Partition
    equal: Partition
    anchor: Partition
    candidates: tuple[Partition, ...]
    radius: int

    @property
    def gap_to_optimum(self) -> float:
        """chosen / optimum largest stage - 1 (0 when BMP found an optimum)."""
        return self.chosen.max_cost / self.optimum.max_cost - 1.0

    @property
    def gain_vs_equal(self) -> float:
        """equal / chosen largest stage - 1: the speed-up of the bottleneck stage."""
        return self.equal.max_cost / self.chosen.max_cost - 1.0


def plan_partition(costs: Sequence[float], out_bytes: Sequence[float], stages: int, *, radius: int = 2,
                   top_k: int = 5, method: str = "bmp") -> PartitionPlan:
    """Plan a ``stages``-way pipeline over a chain with per-layer ``costs``.

    Args:
        costs: cost of each layer (FLOPs of a typical group, or measured seconds).
        out_bytes: activation bytes sent when a cut falls after each layer.
        stages: P, pipeline stages.
        radius: BMP's search radius r around the anchor's cuts.
        top_k: BMP candidates kept (OmniBal profiles them; we score them with ``costs``).
        method: ``bmp`` (chosen = BMP's pick) or ``exact`` (chosen = the optimum).

    Raises:
        ValueError: fewer layers than stages, or a negative cost.

    Example:
        >>> plan = plan_partition([1.0, 1, 1, 1, 4, 2], [0.0] * 6, 2, radius=1, top_k=3)
        >>> plan.chosen.bounds, plan.equal.bounds, round(plan.gain_vs_equal, 3)   # 7 / 6 - 1
        (((0, 3), (4, 5)), ((0, 2), (3, 5)), 0.167)
    """
    c = np.asarray(costs, dtype=np.float64)
    out = np.asarray(out_bytes, dtype=np.float64)
    if (c < 0).any() or not np.isfinite(c).all():
        raise ValueError("layer costs must be finite and >= 0")
    if method not in ("bmp", "exact"):
        raise ValueError(f"method {method!r} not in ('bmp', 'exact')")
    _check(len(c), stages)
    anchor_bounds, top, used = bmp_candidates(c, out, stages, radius=radius, top_k=top_k)
    optimum = make_partition(exact_partition(c, stages), c, out)
    best = min(top, key=lambda p: p.max_cost) if top else make_partition(anchor_bounds, c, out)
    return PartitionPlan(chosen=optimum if method == "exact" else best, optimum=optimum,
                         equal=make_partition(equal_layer_partition(len(c), stages), c, out),
                         anchor=make_partition(anchor_bounds, c, out), candidates=tuple(top), radius=used)
