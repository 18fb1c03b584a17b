"""A packed window's groups placed on steps: the assignment, then the step stages; where the steps
come out less mixed than random batching, coarser assignment cells are tried as well.

:func:`place_steps` assigns the groups (:func:`~balancer_cli.pack.assign.assign_groups`) and runs
the stages that even the steps out after it: the source mix
(:func:`~balancer_cli.pack.step_mix.even_step_mix`), the ranks' tiles
(:func:`~balancer_cli.pack.step_discrete.even_discrete_steps`), each slot's groups
(:func:`~balancer_cli.pack.polish.polish_steps`), the groups' spread across steps
(:func:`~balancer_cli.pack.step_trade.trade_across_steps`) and each step's heaviest rank
(:func:`~balancer_cli.pack.step_peaks.shave_step_peaks`).

**Coarser cells.** The assigner forms a step from groups of one *cell*: groups whose costs lie
within ``tolerance`` (0.6%) of each module's mean of each other. Where a group's cost follows
its recipe (a 4-tile sample with two 1-tile ones against one 6-tile sample), a cell holds one
recipe and its steps one source mix: on random three-module inputs drawn afresh steps came out
1.27x and 1.38x less mixed than random batching, where the same groups dealt to steps at random
would have been ~0.6x. The stages after the assignment re-balance much of what a coarser cell
leaves uneven, so where the window's steps mix worse than random batching
(:data:`~balancer_cli.pack.contract.MAX_STEP_MIX`), :func:`place_steps` places them again, each of
:data:`RETRIES` in turn: first on the same cells with the step mix's loose trades (encoder weights
need not be equal: :func:`~balancer_cli.pack.step_mix.even_step_mix`), then on coarser cells. It
keeps a retry only where it breaks none of the contract's
bounds on the window (:func:`window_metrics`) newly and none that both break by more, and either
fewer of them or the same less far past (:func:`~balancer_cli.pack.contract.excess`); else the
first placement stands, byte for byte. Windows whose steps a sparse module binds
at one micro-batch (each class of steps' mean mix already as far as random batching) are not
retried: no cell size changes which steps hold the module.

Example:
    >>> import numpy as np
    >>> from balancer_cli.manifest import StepShape
    >>> from balancer_cli.pack.types import Packing
    >>> p = Packing(np.arange(8), np.arange(0, 9, 2), np.zeros(4, bool), np.array([], np.int64), ())
    >>> cost = np.array([[1.0, 5.0]] * 8)
    >>> q, a = place_steps(p, cost, cost.astype(np.int64), np.array([4, 20]), np.array([0, 1] * 4),
    ...                    StepShape(world_size=2, micro_batches=1), seeds=(0, 1, 2), polish_passes=1)
    >>> a.num_steps, sorted(q.order.tolist()) == list(range(8))
    (2, True)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from balancer_cli.manifest import StepShape
from balancer_cli.pack._blocks import sparse_modules
from balancer_cli.pack.assign import assign_groups, group_source_counts
from balancer_cli.pack.contract import MAX_STEP_MIX, broken_bounds, excess
from balancer_cli.pack.evaluate import step_mix_ratio
from balancer_cli.pack.types import Assignment, Packing, group_sums

__all__ = ["ASSIGN_TOLERANCE", "GATE", "GATE_ROWS", "RETRIES", "place_steps", "window_broken",
           "window_metrics"]

#: The assigner's cells, as a share of each module's mean cost (its default).
ASSIGN_TOLERANCE = 0.006
#: Placements tried, in order, where the steps mix worse than random batching: (cell tolerance,
#: the step mix's ``loose``); the first that meets every bound ends the retries (each costs the
#: stages again). The loose trades took two of the 48 ``sparse`` inputs of
#: bench/bench_pack_random.py within every bound (a 243k at 64 x 2 from 1.34x to 0.21x, a 55k at
#: 32 x 1 from 1.12x to 0.53x; docs/packing.md). 0.1 goes first: where it meets every bound, one
#: run ends the retries; 0.03 runs only where 0.1 broke a bound the first placement met (the same
#: rows on 87 of 88 inputs, 12% less time). Both are skipped where the polish does not run
#: (windows over ``polish.POLISH_MAX_ROWS``: given caps at 1.2M took 6.8 s -> 9.0 s for the same
#: rows). Coarser cells, at fixed caps on the inputs that broke the mix bound: 0.15 took a 150k at
#: 16 x 2 from 1.27x to 0.29x and a 72k at 64 x 2 from 1.007x to 0.999x; 0.08 a 359k at 64 x 1
#: from 1.38x to 0.94x (0.15 mixed it at 0.86x, but its audio Dist rose to 0.0063; 0.1: 1.19x).
#: 0.05 fixed none, 0.4 none that these leave.
RETRIES = ((ASSIGN_TOLERANCE, 0.1), (ASSIGN_TOLERANCE, 0.03), (0.15, 0.0), (0.08, 0.0))
#: Windows of more rows first compare their steps with a multinomial draw of the same sizes (a
#: few ms) and skip the exact measure where they are at most ``GATE`` x as far from the mix (10M
#: in windows of 780k: 0.64x; the exact measure shuffles every row, 20 ms a window).
GATE_ROWS = 100_000
GATE = 0.8


def place_steps(packing: Packing, cost_nK: np.ndarray, load_nK: np.ndarray, caps_K: np.ndarray,
                source_n: np.ndarray, shape: StepShape, *, seeds: tuple[int, int, int], polish_passes: int,
                modules: Sequence[str] | None = None) -> tuple[Packing, Assignment]:
    """Assign ``packing``'s groups to steps and even the steps out (see the module docstring).

    Args:
        packing: a window's groups, a multiple of ``shape.groups_per_step`` of them.
        cost_nK: (n, K) cost of each of the window's samples per module (LLM last).
        load_nK: (n, K) integer loads (the caps' unit).
        caps_K: (K,) caps the groups keep.
        source_n: (n,) source code of each sample.
        shape: ranks x micro-batches of a step.
        seeds: the (assign, polish, trade) seeds.
        polish_passes: passes of the step polish (:func:`~balancer_cli.pack.polish.polish_passes`).
        modules: module names (the retry's bounds name them; default ``m0, m1, ...``).

    Returns:
        The groups (samples moved between them by the stages) and their slots.
    """
    modules = tuple(modules) if modules is not None else tuple(f"m{k}" for k in range(cost_nK.shape[1]))
    mix_GO = group_source_counts(packing, source_n)
    placed = _placed(packing, mix_GO, cost_nK, load_nK, caps_K, source_n, shape, seeds, polish_passes,
                     ASSIGN_TOLERANCE)
    retries = _retries(*placed, cost_nK, source_n, shape.micro_batches)
    if not retries:
        return placed
    best = window_metrics(*placed, cost_nK, source_n, shape, modules)
    first_broken = set(broken_bounds(best, modules))
    try_loose = bool(polish_passes)  # without the polish nothing evens the ranks loose trades leave
    for tolerance, loose in retries:
        if loose and not try_loose:
            continue
        retry = _placed(packing, mix_GO, cost_nK, load_nK, caps_K, source_n, shape, seeds, polish_passes, tolerance,
                        loose)
        metrics = window_metrics(*retry, cost_nK, source_n, shape, modules)
        if loose:  # a gentler one is for a bound the looser trades broke, not for a mix they left
            try_loose = not set(broken_bounds(metrics, modules)) <= first_broken
        if _improves(metrics, best, modules):
            placed, best = retry, metrics
        if not broken_bounds(best, modules):
            break
    return placed


def window_metrics(packing: Packing, assignment: Assignment, cost_nK: np.ndarray, source_n: np.ndarray,
                   shape: StepShape, modules: Sequence[str]) -> dict:
    """What the contract (:func:`~balancer_cli.pack.contract.broken_bounds`) reads, of a placed
    window on its own steps: each module's Dist Ratio, utilization and sparse flag (as the search
    measures its candidates: :func:`~balancer_cli.pack._search_eval.measured`), and the step mix
    (the step count is the packing's, the same for every placement of it)."""
    # The polish's compiled kernels: imported late.
    from balancer_cli.pack._search_eval import measured

    dist_K, util_K, _, sparse_K = measured(packing, assignment, group_sums(packing, cost_nK), cost_nK, shape)
    step_P = assignment.step[packing.group_ids()]
    return {"modules": {module: {"dist_ratio": dist_K[k], "utilization": util_K[k], "sparse": bool(sparse_K[k])}
                        for k, module in enumerate(modules)},
            "steps": {"vs_lower_bound": 1.0},
            "step_mix": {"vs_random": step_mix_ratio(step_P, source_n[packing.order], assignment.num_steps)}}


def window_broken(packing: Packing, assignment: Assignment, cost_nK: np.ndarray, source_n: np.ndarray,
                  shape: StepShape, modules: Sequence[str]) -> tuple[str, ...]:
    """The contract's bounds a placed window breaks on its own steps (:func:`window_metrics`).

    Example:
        >>> from balancer_cli.pack.types import Packing
        >>> p = Packing(np.arange(4), np.arange(5), np.zeros(4, bool), np.array([], np.int64), ())
        >>> a = Assignment(step=np.array([0, 0, 1, 1]), rank=np.array([0, 1, 0, 1]), micro=np.zeros(4, int),
        ...                num_steps=2)
        >>> cost = np.array([[5.0], [5.0], [5.0], [9.0]])  # step 1's ranks: 5 and 9 tokens
        >>> shape = StepShape(world_size=2, micro_batches=1)
        >>> window_broken(p, a, cost, np.array([0, 1, 0, 1]), shape, ("llm",))  # each step: one of each source
        ('dist:llm',)
    """
    return broken_bounds(window_metrics(packing, assignment, cost_nK, source_n, shape, modules), modules)


def _improves(metrics: dict, best: dict, modules: Sequence[str]) -> bool:
    """Whether ``metrics`` break none of the bounds ``best`` meets, none of those both break by
    more (``sample_data``'s retry fixed its mix but took vision Dist 0.058 -> 0.094), and either
    fewer bounds or the same ones less far (:func:`~balancer_cli.pack.contract.excess`: a mix of
    1.39x that the coarser cells take to 1.28x at one micro-batch)."""
    broken, best_broken = set(broken_bounds(metrics, modules)), set(broken_bounds(best, modules))
    if not broken <= best_broken:
        return False
    for bound in broken:
        kind, _, module = bound.partition(":")
        now, then = metrics["modules"].get(module), best["modules"].get(module)
        if kind == "dist" and now["dist_ratio"] > then["dist_ratio"]:
            return False
        if kind == "util" and now["utilization"] < then["utilization"]:
            return False
        if kind == "mix" and metrics["step_mix"]["vs_random"] > best["step_mix"]["vs_random"]:
            return False
    return broken < best_broken or excess(metrics, modules) < excess(best, modules)


def _retries(packing: Packing, assignment: Assignment, cost_nK: np.ndarray, source_n: np.ndarray,
             micro_batches: int) -> tuple[tuple[float, float], ...]:
    """The :data:`RETRIES` worth running: none where the steps mix as well as random batching
    (:data:`MAX_STEP_MIX`) or no retry could change that (below), only the loose trades where
    the steps holding samples over a cap keep the mix over the bound whatever the cells.

    Above :data:`GATE_ROWS` rows, steps clearly better mixed than a multinomial draw of their sizes
    (:data:`GATE` x its distance) pass without the exact measure's shuffle of every row. At one
    micro-batch a step holds a sparse module on every rank or on none at any cell size (the
    classes of which sparse modules a group holds key the cells at every level), so the mix of
    each class of steps is the packing's: where the mean step distance that this alone forces
    (:func:`_class_floor`) is already as far as random batching's, no retry can mix the steps
    (the three-module 300k of the scale benchmark at 32 ranks: floor 1.6x, two retries took its
    pack from 4.5 s to 10.5 s for nothing).

    A sample over a cap is a group larger than any other, so the steps that hold such groups hold
    their like at any cell size; where those steps' mix alone forces a mean step distance as far
    as random batching's (:func:`_class_floor` of the steps holding them), coarser cells only
    break a Dist bound, while the loose trades can still bring the steps nearer the mix
    (``dynamic`` 37, 170k at 32 x 1: 338 videos over a cap in 17 steps; the loose retry took its
    mix from 8.56x to 6.10x, the coarser cells broke the LLM's Dist each time; three packs, the
    pick's and its check's, 96 s -> 25 s, the same manifest).
    """
    step_P = assignment.step[packing.group_ids()].astype(np.int64)
    source_P = np.asarray(source_n, dtype=np.int64)[packing.order]
    S, O = assignment.num_steps, int(source_P.max()) + 1 if len(source_P) else 1
    counts_SO = np.bincount(step_P * O + source_P, minlength=S * O).reshape(S, O)
    share_O = counts_SO.sum(axis=0) / max(len(source_P), 1)
    mean = _mean_distance(counts_SO, share_O)
    if len(source_P) > GATE_ROWS:
        drawn_SO = np.random.default_rng(0).multinomial(counts_SO.sum(axis=1), share_O)
        if mean <= GATE * _mean_distance(drawn_SO, share_O):
            return ()
    ratio = step_mix_ratio(step_P, source_P, S)
    if ratio <= MAX_STEP_MIX:
        return ()
    bound = MAX_STEP_MIX * mean / ratio  # the ratio's denominator: random batching's mean step distance

    def beyond_reach(held_G: np.ndarray) -> bool:  # the steps holding these groups keep the mix over
        holds_S = np.zeros(S, bool)
        holds_S[np.asarray(assignment.step)[held_G]] = True
        return held_G.any() and _class_floor(counts_SO, share_O, holds_S) >= bound

    if micro_batches == 1:
        gsum_GK = group_sums(packing, cost_nK)
        sparse_K = sparse_modules(gsum_GK)
        if sparse_K.any() and beyond_reach((gsum_GK[:, sparse_K] > 0).any(axis=1)):
            return ()
    if beyond_reach(np.asarray(packing.isolated, dtype=bool)):
        return tuple(retry for retry in RETRIES if retry[1])
    return RETRIES


def _class_floor(counts_SO: np.ndarray, share_O: np.ndarray, class_S: np.ndarray) -> float:
    """The least mean step distance from ``share_O`` that steps of these two classes can have
    while each class keeps its mean source mix (the distance is convex:
    ``mean_s d(mix_s) >= d(mean_s mix_s)`` within a class).

    Example:
        >>> counts = np.array([[2, 2], [2, 2], [0, 4], [0, 4]])  # source 0 only in the first class
        >>> _class_floor(counts, np.array([0.25, 0.75]), np.array([True, True, False, False]))
        0.25
    """
    size_S = np.maximum(counts_SO.sum(axis=1, keepdims=True), 1)
    mix_SO = counts_SO / size_S
    floor = 0.0
    for members in (class_S, ~class_S):
        if members.any():
            floor += members.mean() * 0.5 * float(np.abs(mix_SO[members].mean(axis=0) - share_O).sum())
    return float(floor)


def _mean_distance(counts_SO: np.ndarray, share_O: np.ndarray) -> float:
    """Mean over steps of the total-variation distance of their source counts from ``share_O``."""
    size_S = np.maximum(counts_SO.sum(axis=1, keepdims=True), 1)
    return float((0.5 * np.abs(counts_SO / size_S - share_O).sum(axis=1)).mean())


def _placed(packing, mix_GO, cost_nK, load_nK, caps_K, source_n, shape, seeds, polish_passes, tolerance,
            loose=0.0):
    """The assignment on cells of ``tolerance``, then the stages (the step mix's trades ``loose``
    or not; imported late: compiled kernels)."""
    from balancer_cli.pack.polish import polish_steps
    from balancer_cli.pack.step_discrete import even_discrete_steps
    from balancer_cli.pack.step_mix import even_step_mix
    from balancer_cli.pack.step_peaks import shave_step_peaks
    from balancer_cli.pack.step_trade import trade_across_steps

    assign_seed, polish_seed, trade_seed = seeds
    assignment = assign_groups(group_sums(packing, cost_nK), world_size=shape.world_size,
                               micro_batches=shape.micro_batches, seed=assign_seed, mix_GO=mix_GO,
                               tolerance=tolerance)
    packing, assignment = even_step_mix(packing, assignment, cost_nK, load_nK, caps_K, source_n, mix_GO=mix_GO,
                                        loose=loose)
    packing = even_discrete_steps(packing, assignment, cost_nK, load_nK, caps_K, source_n)
    packing = polish_steps(packing, assignment, cost_nK, load_nK, caps_K, seed=polish_seed, passes=polish_passes)
    packing = trade_across_steps(packing, assignment, cost_nK, load_nK, caps_K, source_n, seed=trade_seed,
                                 polish_passes=polish_passes, polish_seed=polish_seed)
    packing = shave_step_peaks(packing, assignment, cost_nK, load_nK, caps_K, source_n)
    return packing, assignment
