"""Search packing thresholds: a K-dimensional grid over caps (and ISF's acceptance bounds).

OmniBal walks one line (Qv and Qt grow together) until the average group size lands in
[micro_bs, micro_bs + 1]. :func:`search_thresholds` instead evaluates a grid over every
module's cap independently, within the user's memory limits (``max_caps_K``), on a seeded
subsample, and ranks candidates by one objective built from the shared metrics:

``sum_k (1 - utilization_k) + pad_ratio_weight * pad_ratio + 10 * excluded_share
+ (efficiency - 1) + 10 * max(0, efficiency - 1.03) + size_weight * |mean group size / target - 1|
+ mix_weight * max(0, mix_vs_random - 1)``

where ``excluded_share`` counts oversize samples (isolated or dropped); ``efficiency`` is the
groups over the fewest the candidate's own caps permit
(:func:`~balancer_cli.pack.bounds.groups_lower_bound`), and past ``MAX_STEP_EXCESS`` (1.03,
the packer's own limit) it weighs ten times as much: more steps than that are a cost, not a
preference. The target group size sets the scale of the caps; ``mix_vs_random`` is the steps'
source mix against random batching of the same steps
(:func:`~balancer_cli.pack.evaluate.step_mix_ratio`, with ``source_N``): caps whose groups
cannot be mixed (tight caps make groups of one kind) lose.

A subsample is packed to a multiple of its share of a step's groups (R x M x n / N), so it
holds as many "steps" as the full data and rounding to them weighs as much: it decides whether
dealing's groups or first fit's tighter but clustered ones are kept, and so the mix. With one
micro-batch a subsample's ~20 steps mix classes of groups that the full run keeps one to a step,
so its mix is taken as at least what the classes' bias predicts for the full run
(:func:`~balancer_cli.pack.packers._class_mix.class_bias_ratio`). An input of up to 1.5x the
sample size is evaluated whole, with its rounding, exactly as it will be packed (the step polish
included); there the contract's bounds come first: candidates with Dist Ratio <= 0.005 on every
dense module (utilization >= 0.9 on sparse ones), steps <= 1.03x the bound and mix <= 1.0x rank
before the others (``Candidate.within_bounds``), whose objective may be lower (few steps: one
step where an oversize sample idles the other ranks decides the Dist, which the objective
barely weighs). On a subsample the Dist of ~20 steps says too little to judge.
For ``algorithm="isf"`` every cap candidate is combined with acceptance bounds (the encoders'
bound equal to their cap, the LLM's at a few fractions of its cap). The best candidate is then
packed once on the full data by the caller.

Example:
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> items = rng.integers(1, 6, 3000); tokens = 256 * items + rng.integers(20, 400, 3000)
    >>> load = np.stack([items, tokens], 1); cost = load.astype(float)
    >>> res = search_thresholds(load, cost, world_size=4, micro_batches=1, max_caps_K=np.array([24, 8192]),
    ...                         target_group_size=4, grid=3)
    >>> len(res.candidates) == 9 and res.grid_objective.shape == (3, 3)
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from balancer_cli.errors import InputError, UsageError
from balancer_cli.manifest import StepShape
from balancer_cli.pack._search_eval import assigned, measured, packed
from balancer_cli.pack.contract import (
    CHECK_FALLBACKS,
    MAX_DIST_RATIO,
    MAX_STEP_MIX,
    MIN_SPARSE_UTILIZATION,
)
from balancer_cli.pack.packers.balanced import MAX_STEP_EXCESS, deal_balanced
from balancer_cli.pack.polish import polish_passes

__all__ = ["SearchResult", "Candidate", "search_thresholds", "default_caps", "typical_caps", "tail_raised",
           "DEFAULT_GROUP_SIZE", "SUBSAMPLE_STEPS", "MAX_GRID", "TAIL_RAISE"]

#: Weight of groups beyond ``MAX_STEP_EXCESS`` x the lower bound: steps past it are a cost the
#: user did not ask for (a contract, not a preference), so they outweigh any other term.
_OVER_BOUND_WEIGHT = 10.0
#: Dealt groups the pruning search keeps for the candidates it evaluates (those visited first):
#: ~0.5 MB each on a 12k subsample, so all of a two-module grid's 25, ~60 of three modules' 125.
_DEALS_KEPT_BYTES = 32 << 20
#: Candidates a pruning search of the whole input measures for sure: its best and the next ones,
#: which the pipeline packs in full when the pick breaks a bound.
_WHOLE_INPUT_TOP = 1 + CHECK_FALLBACKS
#: OmniBal's search stops when the average group holds micro_bs..micro_bs+1 samples (micro_bs 4).
DEFAULT_GROUP_SIZE = 4.5
#: Steps a subsample holds at least, at the target group size: the sample size is raised to it for
#: many groups a step (a 12k subsample at ``--dp 1000 x 2`` fills about one step, and every
#: candidate failed on 19k samples, which fill up to 9 steps of one sample a group).
SUBSAMPLE_STEPS = 8
#: The most cap values tried per module: the search packs ``grid ** K`` candidates (64 ** 3 is
#: already ~262k), and numpy cannot lay out an axis of an unbounded one.
MAX_GRID = 64
#: A searched cap this many times what a group of typical samples needs or more is reported (:func:`tail_raised`).
TAIL_RAISE = 4.0
_TAIL_ROWS = 100_000  # rows typical_caps reads at most: a stride through the table, no copy, no draw


@dataclass(frozen=True)
class Candidate:
    """One evaluated setting and its metrics on the subsample."""

    caps_K: tuple[int, ...]
    bounds_K: tuple[int, ...]
    objective: float
    dist_ratio_K: tuple[float, ...]
    utilization_K: tuple[float, ...]
    pad_ratio: float
    excluded_share: float
    steps_over_lower_bound: float
    mean_group_size: float
    #: Step mix against random batching of the same steps (1.0 = as mixed; 1.0 without sources).
    mix_vs_random: float = 1.0
    #: Skipped (``prune=True``): the terms its packing alone decides (evaluated whole: with its
    #: step mix's) already rank it out; ``objective`` is then that lower bound, and the metrics
    #: not measured are empty / NaN (Dist Ratio, utilization, pad ratio; the mix unless known).
    pruned: bool = False
    #: Our packer's, evaluated on the whole input and within every bound of the contract: Dist Ratio <=
    #: :data:`MAX_DIST_RATIO` on dense modules, utilization >= :data:`MIN_SPARSE_UTILIZATION` on
    #: sparse ones, steps <= ``MAX_STEP_EXCESS`` x the bound and mix <= 1.0x random. Such
    #: candidates rank before the others (on a subsample the Dist of ~20 steps says too little).
    within_bounds: bool = False


@dataclass(frozen=True)
class SearchResult:
    """Ranked candidates (best first), the winner, and the objective on the grid for a heat map.

    Attributes:
        candidates: every candidate, best first.
        best_caps_K, best_bounds_K: (K,) int64 of the best candidate.
        grid_axes: per module, the cap values tried (the heat map's axes).
        grid_objective: objective per grid point, shape ``(len(axis) for axis in grid_axes)``
            (for ISF the best bound per cap point).
        sample_size: samples the candidates were evaluated on.
        algorithm: ``balanced`` or ``isf``.
    """

    candidates: tuple[Candidate, ...]
    best_caps_K: np.ndarray
    best_bounds_K: np.ndarray
    grid_axes: tuple[np.ndarray, ...]
    grid_objective: np.ndarray
    sample_size: int
    algorithm: str
    params: dict = field(default_factory=dict)


def default_caps(load_NK: np.ndarray, target_group_size: float = DEFAULT_GROUP_SIZE,
                 llm_slack: float = 0.06) -> np.ndarray:
    """Caps for a target group size when the user gives none.

    Encoder caps are ``ceil(size x mean items)``; the LLM cap (last column) gets ``llm_slack``
    more and is rounded up to a multiple of 128. So the item caps bind and groups fill them
    exactly (item counts are small integers: equal counts per group are what makes encoder
    balance exact, as OmniBal's ``vit_num == Q'v`` acceptance does), while the LLM cap leaves
    room to even out tokens. No cap is below the 99.9th percentile of single samples, so
    almost nothing is oversize.

    Example:
        >>> default_caps(np.array([[4, 1100], [3, 1200], [5, 1000]]), 4).tolist()
        [16, 4736]
    """
    load = np.asarray(load_NK, dtype=np.float64)
    caps = np.ceil(target_group_size * load.mean(axis=0))
    caps[-1] = caps[-1] * (1.0 + llm_slack) if load.shape[1] > 1 else caps[-1]
    caps = np.maximum(caps, np.ceil(np.percentile(load, 99.9, axis=0)))
    caps[-1] = np.ceil(caps[-1] / 128) * 128
    return np.maximum(caps, 1).astype(np.int64)


def typical_caps(load_NK: np.ndarray, target_group_size: float | None = None) -> np.ndarray:
    """(K,) the caps a group of typical samples needs: :func:`default_caps` of the loads clipped at
    the 99th percentile of the samples that hold each module, and no less than it (a stride of at
    most ~100k rows): the longest 1% do not raise them, and a sparse module's holders are typical.

    Example:
        >>> typical_caps(np.array([[0, 100]] * 3000 + [[11, 300]] * 10 + [[0, 10_000_000]] * 5)).tolist()
        [11, 512]
    """
    load = np.asarray(load_NK)
    rows = load[:: max(1, len(load) // _TAIL_ROWS)]
    top_K = np.array([np.percentile(col[col > 0], 99) if (col > 0).any() else 0.0 for col in rows.T])
    return np.maximum(default_caps(np.minimum(rows, top_K), target_group_size or DEFAULT_GROUP_SIZE),
                      np.ceil(top_K).astype(np.int64))


def tail_raised(caps_K: Sequence[int], typical_K: Sequence[int], modules: Sequence[str], given=()) -> dict:
    """``{"tail_raised": {module: typical cap}}`` for the searched caps (modules not in ``given``)
    :data:`TAIL_RAISE` or more times :func:`typical_caps`' (else ``{}``; ``params.search``). No
    searched cap is below the longest 0.1% of single samples (:func:`default_caps`): where they are
    far longer than the rest (long videos, lengths read wrong), every group holds that much more.

    Example:
        >>> tail_raised([10_000_000, 18], [512, 2], ("llm", "vision"), given=("vision",))
        {'tail_raised': {'llm': 512}}
    """
    raised = {m: int(t) for m, c, t in zip(modules, caps_K, typical_K) if c >= TAIL_RAISE * t and m not in given}
    return {"tail_raised": raised} if raised else {}


def _axis(max_cap: int, center: float, grid: int, floor: float) -> np.ndarray:
    """``grid`` caps, geometric from ~0.6 x center up to min(max_cap, 1.6 x center)."""
    hi = float(min(max_cap, max(center * 1.6, floor)))
    lo = float(max(floor, min(center * 0.6, hi)))
    vals = np.unique(np.round(np.geomspace(max(lo, 1), max(hi, 1), grid)).astype(np.int64))
    return np.clip(vals, 1, max_cap)


def _visit_key(item):
    """Pruning visits candidates by the objective terms their dealt packing decides, then caps."""
    (_, caps, _), fixed = item[0], item[1]
    return fixed[0], tuple(caps.tolist())


def search_thresholds(
    load_NK: np.ndarray,
    cost_NK: np.ndarray,
    *,
    world_size: int,
    micro_batches: int,
    max_caps_K: np.ndarray,
    min_caps_K: np.ndarray | None = None,
    target_group_size: float | None = None,
    seed: int = 0,
    algorithm: str = "balanced",
    grid: int = 5,
    sample_size: int = 12_000,
    pad_ratio_weight: float = 0.1,
    size_weight: float = 0.5,
    passes: int = 3,
    source_N: np.ndarray | None = None,
    mix_weight: float = 1.0,
    prune: bool = False,
    rows: np.ndarray | None = None,
) -> SearchResult:
    """Grid-search caps (and ISF bounds) on a subsample; see the module docstring.

    Args:
        load_NK: (N, K) int loads (items per encoder, LLM tokens last).
        cost_NK: (N, K) float costs to balance.
        world_size, micro_batches: R and M of the training job.
        max_caps_K: (K,) memory limits: the largest cap allowed per module.
        min_caps_K: (K,) the smallest cap allowed per module (default 1; at most ``max_caps_K``).
        target_group_size: desired mean samples per group (default 4.5, OmniBal's 4..5);
            it centers the grid and weighs in the objective.
        seed: subsample and packing seed.
        algorithm: ``balanced`` (our packer; bounds are reported equal to the caps) or ``isf``.
        grid: points per module axis (``grid ** K`` cap candidates), 1 to :data:`MAX_GRID`.
        sample_size: samples evaluated per candidate (a seeded subsample; an input of up to 1.5x
            this many is evaluated whole, exactly as it will be packed). Raised to hold
            :data:`SUBSAMPLE_STEPS` steps of ``target_group_size`` samples a group.
        pad_ratio_weight, size_weight: objective weights.
        passes: refinement passes of our packer during the search.
        source_N: (N,) source code per sample: groups and steps are mixed by source and the
            objective counts the step mix (None: sources are ignored).
        mix_weight: weight of the step mix in the objective.
        prune: skip the refinement, assignment and metrics of candidates whose packing alone
            (excluded share, efficiency, group size: known after dealing) scores past the best
            one found so far, visiting candidates by those terms. Evaluated whole, the bar is
            the third best, and a candidate that cannot be within the bounds skips the polish
            once those terms plus its step mix's pass the bar
            (:mod:`~balancer_cli.pack._search_eval`). The best candidate (the best three
            evaluated whole) is the same as without pruning; the others are only ranked among
            the ones evaluated, then the pruned ones (``Candidate.pruned``). ``balancer pack``
            prunes, ``balancer search`` evaluates every candidate.
        rows: the rows of ``load_NK``, ``cost_NK`` and ``source_N`` to search over, ascending
            (default all): the same search as over those rows' copies, without them.

    Raises:
        InputError: no samples.
        UsageError: bad limits, grid or algorithm.
    """
    # Only the subsample is converted to the kernels' types: at 10M samples a converted copy of the
    # whole (N, K) inputs would be ~0.4 GB for rows the search never reads.
    load, cost = np.asarray(load_NK), np.asarray(cost_NK)
    N = len(load) if rows is None else len(rows)
    if load.ndim != 2 or N == 0:
        raise InputError("no samples to search thresholds on", fix="check the lengths table with `balancer scan`")
    if algorithm not in ("balanced", "isf"):
        raise UsageError(f"unknown {{algorithm}} {algorithm!r}", fix="use balanced or isf")
    max_caps = np.asarray(max_caps_K, dtype=np.int64).reshape(-1)
    if len(max_caps) != load.shape[1] or (max_caps < 1).any():
        raise UsageError(f"{{max_caps_K}} {max_caps.tolist()} must be one positive value per module "
                         f"({load.shape[1]})", fix="give one positive limit per module, encoders first, llm last")
    if not 1 <= grid <= MAX_GRID:
        raise UsageError(f"grid must be in 1..{MAX_GRID}, got {grid}", fix="use --grid 5")
    shape = StepShape(world_size=world_size, micro_batches=micro_batches)
    R, M = shape.world_size, shape.micro_batches
    rng = np.random.default_rng(seed)
    target = float(target_group_size or DEFAULT_GROUP_SIZE)
    size = max(int(sample_size), int(np.ceil(SUBSAMPLE_STEPS * R * M * target)))
    # Up to 1.5x the sample size the whole input is cheap enough, and evaluated exactly.
    n = N if N <= 1.5 * size else size
    pick = np.sort(rng.choice(N, n, replace=False)) if n < N else np.arange(N)
    pick = pick if rows is None else np.asarray(rows)[pick]
    sub_load, sub_cost = load[pick].astype(np.int64), cost[pick].astype(np.float64)
    sub_source = None if source_N is None else np.asarray(source_N)[pick].astype(np.int64)
    centers = default_caps(sub_load, target)
    floors = np.maximum(1, sub_load.mean(axis=0))
    if min_caps_K is not None:
        floors = np.maximum(floors, np.minimum(np.asarray(min_caps_K, dtype=np.int64).reshape(-1), max_caps))
    axes = tuple(_axis(int(max_caps[k]), float(centers[k]), grid, float(floors[k])) for k in range(load.shape[1]))
    exact = n == N
    # The subsample's share of a step's groups: it holds as many steps as the full data
    # (:func:`~balancer_cli.pack._search_eval.packed`).
    multiple = R * M if exact else max(1, round(R * M * n / N))
    points = []  # (grid index, caps, bounds), in grid order
    for idx in np.ndindex(*tuple(len(a) for a in axes)):
        caps = np.array([axes[k][i] for k, i in enumerate(idx)], dtype=np.int64)
        if algorithm == "isf":
            bound_sets = [np.concatenate([caps[:-1], [int(caps[-1] * f)]]) for f in (0.9, 0.95, 0.98)]
        else:
            bound_sets = [caps]
        points += [(idx, caps, bounds) for bounds in bound_sets]

    def fixed_terms(p, efficiency):
        """(objective terms that the packing alone decides, excluded share, mean group size)."""
        excluded = (len(p.dropped) + int(p.isolated.sum())) / n
        size = len(p.order) / max(p.num_groups, 1)
        terms = (10.0 * excluded + (efficiency - 1.0) + _OVER_BOUND_WEIGHT * max(0.0, efficiency - MAX_STEP_EXCESS)
                 + size_weight * abs(size / target - 1.0))
        return terms, excluded, size

    candidates: list[Candidate] = []
    grid_obj = np.full(tuple(len(a) for a in axes), np.inf)
    if prune and algorithm == "balanced":
        # The group count, so the terms above, is known after dealing: visit candidates by them
        # (a dealing costs ~1/10 of a full evaluation) and skip those they alone put past the best.
        # The ones evaluated refine these dealt groups: they are not dealt twice.
        plan, kept = [], 0  # kept: bytes of the dealt groups held for later (_DEALS_KEPT_BYTES at most)
        for point in points:
            deal = deal_balanced(sub_load, point[1], cost_NK=sub_cost, group_multiple=multiple, seed=seed)
            res = packed(sub_load, sub_cost, sub_source, point[1], point[2], shape, algorithm, seed, 0, multiple, deal)
            if res is None:
                continue
            plan.append([point, fixed_terms(*res), res[1], deal])
            kept += deal.nbytes
            while kept > _DEALS_KEPT_BYTES:  # drop the deal visited last (a later one is dealt again)
                last = max((item for item in plan if item[3] is not None), key=_visit_key)
                kept -= last[3].nbytes
                last[3] = None
        plan.sort(key=_visit_key)
    else:
        plan = [(point, None, None, None) for point in points]
    # The best so far as (tier, objective): tier 0 within the bounds (every candidate on a
    # subsample, where none is judged against them), tier 1 outside. ``bar``: the key a candidate
    # must beat to rank among the best ``top`` (the best alone on a subsample).
    judged = exact and algorithm == "balanced"  # measured as the run will be: polished too
    top = _WHOLE_INPUT_TOP if judged else 1
    best_keys = [(1 if judged else 0, np.inf)] * top
    for (idx, caps, bounds), fixed, dealt_efficiency, deal in plan:
        key = (tuple(caps.tolist()), tuple(int(b) for b in bounds))
        bar = best_keys[-1]
        # Its objective is at least fixed[0]. While the bar is outside the bounds a candidate
        # within them would still rank first: only one whose steps already break them is skipped.
        if fixed is not None and fixed[0] > bar[1] + 1e-9 and (bar[0] == 0 or dealt_efficiency > MAX_STEP_EXCESS):
            bound, excluded, size = fixed
            candidates.append(Candidate(*key, float(bound), (), (), float("nan"), float(excluded),
                                        float(dealt_efficiency), float(size), float("nan"), pruned=True))
            continue
        res = packed(sub_load, sub_cost, sub_source, caps, bounds, shape, algorithm, seed, passes, multiple, deal)
        if res is None:
            continue
        p, efficiency = res
        terms, excluded, size = fixed_terms(p, efficiency)
        a, gs, mix = assigned(p, sub_cost, sub_source, shape, seed, sampled=not exact)
        # The polish leaves the steps' mixes and the group count as they are: with them the
        # objective is at least ``terms``, and only ``may_be_within`` candidates can pass the bounds.
        mix_term = mix_weight * max(0.0, mix - 1.0)
        may_be_within = efficiency <= MAX_STEP_EXCESS and mix <= MAX_STEP_MIX
        if prune and judged and terms + mix_term > bar[1] + 1e-9 and (bar[0] == 0 or not may_be_within):
            candidates.append(Candidate(*key, float(terms + mix_term), (), (), float("nan"), float(excluded),
                                        float(efficiency), float(size), float(mix), pruned=True))
            continue
        polish = (sub_load, caps, polish_passes(n), seed) if judged else None
        dist, util, pad, sparse = measured(p, a, gs, sub_cost, shape, polish)
        # Terms >= 0 added to the fixed ones: the objective is never below the bounds pruning used.
        objective = sum(1.0 - u for u in util) + pad_ratio_weight * pad + terms + mix_term
        within = judged and may_be_within and all(
            (u >= MIN_SPARSE_UTILIZATION) if sp else (d <= MAX_DIST_RATIO) for d, u, sp in zip(dist, util, sparse))
        candidates.append(Candidate(*key, float(objective), tuple(dist), tuple(util), float(pad), float(excluded),
                                    float(efficiency), float(size), float(mix), within_bounds=bool(within)))
        grid_obj[idx] = min(grid_obj[idx], objective)
        best_keys = sorted([*best_keys, (0 if within or not judged else 1, objective)])[:top]
    if not candidates:
        what = f"the {n} sample{'s' if n != 1 else ''}" if exact else f"a {n}-sample subsample"
        fix = "lower {world_size} or {micro_batches}" + ("" if exact else ", or raise {sample_size}")
        if algorithm == "isf" and n >= shape.groups_per_step:  # ISF's groups fill up: fewer than ours
            fix += ", or pack with {algorithm} balanced"
        raise UsageError(  # the options cannot fit this data: exit 2, as the packer's own step check
            f"no candidate caps pack {what} into whole steps of {shape.groups_per_step} groups (one step of "
            f"{{world_size}} {R} x {{micro_batches}} {M}, at least one sample a group)", fix=fix)
    candidates.sort(key=lambda c: (c.pruned, not c.within_bounds, c.objective, c.caps_K, c.bounds_K))
    best = candidates[0]
    return SearchResult(
        candidates=tuple(candidates),
        best_caps_K=np.array(best.caps_K, dtype=np.int64),
        best_bounds_K=np.array(best.bounds_K, dtype=np.int64),
        grid_axes=axes,
        grid_objective=grid_obj,
        sample_size=n,
        algorithm=algorithm,
        params={"world_size": R, "micro_batches": M, "max_caps_K": max_caps.tolist(), "target_group_size": target,
                "grid": grid, "seed": seed, "typical_caps": typical_caps(sub_load, target).tolist()},
    )
