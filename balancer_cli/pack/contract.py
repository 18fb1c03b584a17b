"""The pack contract's bounds, checked on a placed manifest's metrics.

A packing meets the contract when every dense module's Dist Ratio is at most
:data:`MAX_DIST_RATIO`, every sparse module (one a real share of the groups lack) keeps at least
:data:`MIN_SPARSE_UTILIZATION` of its rank-time busy, the steps are at most ``MAX_STEP_EXCESS``
x their lower bound and the steps are as mixed as random batching or better (``vs_random`` <=
:data:`MAX_STEP_MIX`). Which modules are sparse is a fact of the placement: the metrics hold it
(:func:`~balancer_cli.pack.evaluate.evaluate_rows`, ``modules.<m>.sparse``), and their
``contract`` entry says which bounds the rows break (:func:`contract_entry`), for ours and for
every baseline. The search ranks candidates by these bounds on a subsample; the pipeline checks
its pick on the whole input with :func:`broken_bounds` (a subsample's few steps can hide a bias
or an extra step that the full run shows) and falls back to the next candidates.

Example:
    >>> metrics = {"modules": {"llm": {"dist_ratio": 0.0, "utilization": 1.0, "sparse": False}},
    ...            "steps": {"vs_lower_bound": 1.0}, "step_mix": {"vs_random": 1.2}}
    >>> broken_bounds(metrics, ("llm",))
    ('mix',)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from balancer_cli.pack.packers.balanced import MAX_STEP_EXCESS

__all__ = ["CHECK_FALLBACKS", "CHECK_MAX_FALLBACKS", "CHECK_ROWS", "MAX_DIST_RATIO", "MAX_STEP_MIX",
           "MIN_SPARSE_UTILIZATION", "broken_bounds", "check_fallbacks", "contract_entry", "excess"]

#: Dist Ratio of every dense module.
MAX_DIST_RATIO = 0.005
#: Utilization of every sparse module (Dist Ratio of a module most ranks lack is not balance).
MIN_SPARSE_UTILIZATION = 0.9
#: Step mix against random batching of the same steps (1.0: as mixed as random batching).
MAX_STEP_MIX = 1.0
#: How many more candidates the pipeline packs in full when its pick breaks a bound (one pack
#: each); a pruning search of the whole input measures that many after its best for sure.
CHECK_FALLBACKS = 2
#: Small inputs try more, up to :data:`CHECK_MAX_FALLBACKS`, while the fallbacks pack at most this
#: many rows in all (a 24k input: 8 tries of ~0.5 s each). On the random three-module inputs of
#: ``bench/bench_pack_random.py`` the 3rd-8th candidates brought a `sparse` 24k at 8 x 2 and a
#: `speech` 93k at 8 x 2 (and a harsh 12k) within every bound (docs/packing.md).
CHECK_ROWS = 300_000
CHECK_MAX_FALLBACKS = 8


def check_fallbacks(num_samples: int) -> int:
    """How many candidates after the pick an input of ``num_samples`` is packed with in full, at most.

    Example:
        >>> check_fallbacks(24_000), check_fallbacks(100_000), check_fallbacks(1_000_000)
        (8, 3, 2)
    """
    return max(CHECK_FALLBACKS, min(CHECK_MAX_FALLBACKS, CHECK_ROWS // max(int(num_samples), 1)))


def _bounds(metrics: Mapping[str, Any], modules: Sequence[str]) -> Iterator[tuple[str, bool, float]]:
    """Each bound the metrics are checked against, in :func:`broken_bounds`' order: its name,
    whether it is broken and how far past it they are in units of its allowance (:func:`excess`)."""
    for module in modules:
        m = metrics["modules"][module]
        if m["sparse"]:
            busy = m["utilization"]
            yield f"util:{module}", busy < MIN_SPARSE_UTILIZATION, (1.0 - busy) / (1.0 - MIN_SPARSE_UTILIZATION) - 1.0
        else:
            dist = m["dist_ratio"]
            yield f"dist:{module}", dist > MAX_DIST_RATIO, dist / MAX_DIST_RATIO - 1.0
    steps = metrics["steps"]["vs_lower_bound"]
    yield "steps", steps > MAX_STEP_EXCESS, (steps - 1.0) / (MAX_STEP_EXCESS - 1.0) - 1.0
    mix = metrics.get("step_mix", {}).get("vs_random")
    if mix is not None:
        yield "mix", mix > MAX_STEP_MIX, mix / MAX_STEP_MIX - 1.0


def broken_bounds(metrics: Mapping[str, Any], modules: Sequence[str]) -> tuple[str, ...]:
    """The contract's bounds a placed manifest breaks, in a fixed order (empty: it meets them all).

    Args:
        metrics: :attr:`~balancer_cli.pack.evaluate.Evaluation.metrics` of the manifest (each
            module's ``sparse`` flag, Dist Ratio and utilization, the steps and the step mix).
        modules: module names in column order (encoders first, LLM last).

    Returns:
        ``"dist:<module>"`` / ``"util:<module>"`` per module out of bounds, then ``"steps"`` and
        ``"mix"``.
    """
    return tuple(name for name, broken, _ in _bounds(metrics, modules) if broken)


def excess(metrics: Mapping[str, Any], modules: Sequence[str]) -> float:
    """How far past the contract's bounds a placed manifest is: over the bounds it breaks, the sum
    of each one's excess in units of what the bound allows (0 when it meets them all).

    A bound's allowance is its distance from the ideal (Dist Ratio 0, utilization 1, steps at the
    lower bound, the step mix 0), so bounds of different kinds weigh alike: a Dist Ratio of
    0.0075 is 0.5 past, as are a sparse utilization of 0.85, steps 1.045x the lower bound and a
    step mix of 1.5x random batching. The pipeline's check ranks runs that break as many bounds
    by it (:func:`broken_bounds` counts first).

    Example:
        >>> metrics = {"modules": {"llm": {"dist_ratio": 0.0075, "utilization": 0.99, "sparse": False}},
        ...            "steps": {"vs_lower_bound": 1.01}, "step_mix": {"vs_random": 1.5}}
        >>> round(excess(metrics, ("llm",)), 6)
        1.0
    """
    total = 0.0
    for _, broken, past in _bounds(metrics, modules):
        if broken:
            total += past
    return total


def contract_entry(metrics: Mapping[str, Any], modules: Sequence[str]) -> dict[str, Any]:
    """The metrics' ``contract`` entry: the bounds (JSON-ready) and those the rows break.

    Example:
        >>> metrics = {"modules": {"llm": {"dist_ratio": 0.007, "utilization": 0.99, "sparse": False}},
        ...            "steps": {"vs_lower_bound": 1.01}, "step_mix": {"vs_random": 0.6}}
        >>> contract_entry(metrics, ("llm",))["broken"]
        ['dist:llm']
    """
    return {
        "bounds": {"max_dist_ratio": MAX_DIST_RATIO, "min_sparse_utilization": MIN_SPARSE_UTILIZATION,
                   "max_steps_vs_lower_bound": MAX_STEP_EXCESS, "max_step_mix_vs_random": MAX_STEP_MIX},
        "broken": list(broken_bounds(metrics, modules)),
    }
