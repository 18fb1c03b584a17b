"""The searched pick checked against the contract, and the next candidates tried where it breaks a bound.

The search ranks caps on a subsample, which can hide what only more of the data shows (a bias of
the steps' source mix, an extra step). :func:`checked_pick` takes the pick's *trial* and a function
that makes the trial of other caps, and keeps the trial that breaks the fewest of the contract's
bounds (:mod:`~balancer_cli.pack.contract`). A trial is one of

- :class:`Trial`: a full run (inputs up to ``pipeline.CHECK_MAX_SAMPLES``), or
- :class:`WindowTrial`: the run's first window (epoch 0, window 0), packed and placed exactly as
  the full run packs it, and measured on its own steps (:func:`window_metrics`). Past
  ``CHECK_MAX_SAMPLES`` a full run costs seconds to minutes, but a window is what the run packs
  anyway: the kept trial's window is reused, so a pick within every bound costs nothing more
  (a harsh mix resampled to 2.5M at ``--dp 16``: the subsample measured its pick at 0.76x
  random batching, 1.51x in full; the candidate kept on first windows 0.79x in full).

A candidate is placed only where it can be kept: its packing alone fixes its step count and
the samples it drops, so a packing that drops more samples than the pick's, or whose steps alone
break the contract at least as many times and as far as the best trial so far (:class:`Bar`),
is not placed (:func:`first_window`: an :class:`Unplaced` trial, recorded with ``placed:
false``). The placement could only add bounds broken, so the kept trial is the same, without
the step stages of a run that could not win (``sparse`` 18 of bench/bench_pack_random.py, 79k
at ``--dp 32``: two of its three fallbacks left unplaced, 70 s -> 26 s; docs/packing.md).

Example:
    >>> from types import SimpleNamespace
    >>> def trial(cap, broken):  # a stand-in: caps, and the bounds its run breaks
    ...     return SimpleNamespace(caps_K=np.array([cap]), broken=lambda: broken,
    ...                            rank=lambda modules: (len(broken), 0.0), dropped=lambda: 0)
    >>> search = SimpleNamespace(candidates=[SimpleNamespace(caps_K=(c,)) for c in (10, 20, 30)])
    >>> kept, record = checked_pick(("llm",), 1_000_000, search, trial(10, ["mix"]),
    ...                             lambda caps_K, bar: trial(int(caps_K[0]), []))
    >>> int(kept.caps_K[0]), record
    (20, {'pick_broken': ['mix'], 'tried': [{'caps': {'llm': 20}, 'broken': []}], 'kept': {'llm': 20}})
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from balancer_cli._index import take_rows
from balancer_cli.manifest import StepShape
from balancer_cli.pack import contract
from balancer_cli.pack.bounds import groups_lower_bound
from balancer_cli.pack.config import PackConfig
from balancer_cli.pack.inputs import PackInputs
from balancer_cli.pack.placement import Placement
from balancer_cli.pack.step_stages import window_metrics as placed_metrics
from balancer_cli.pack.types import Assignment, Packing
from balancer_cli.pack.window_place import (
    pack_window,
    place_packed,
    planned,
    window_view,
)
from balancer_cli.pack.windows import WindowMembers, WindowResult, WindowTask

__all__ = ["Bar", "Trial", "Unplaced", "WindowTrial", "checked_pick", "fallbacks", "first_window", "window_metrics",
           "window_trial"]


class _Measured:
    """What a trial's contract metrics (``self.metrics``) say, for :func:`checked_pick`."""

    __slots__ = ()

    def broken(self) -> tuple[str, ...]:
        """The contract's bounds the trial breaks (:mod:`~balancer_cli.pack.contract`)."""
        return tuple(self.metrics["contract"]["broken"])

    def rank(self, modules: Sequence[str]) -> tuple[int, float]:
        """How far the trial is from the contract: the bounds it breaks, then how far past them
        (:func:`~balancer_cli.pack.contract.excess`); less is nearer."""
        return len(self.broken()), contract.excess(self.metrics, modules)


@dataclass(frozen=True)
class Trial(_Measured):
    """One full run at some caps: its placement, evaluation and windows (``plan``)."""

    caps_K: np.ndarray
    bounds_K: np.ndarray
    placement: Placement
    evaluation: Any
    plan: WindowMembers | None = None

    @property
    def metrics(self) -> dict:
        return self.evaluation.metrics

    def dropped(self) -> int:
        return len(self.placement.dropped_sample)


@dataclass(frozen=True)
class WindowTrial(_Measured):
    """The first window of a run at some caps (``plan``: the run's windows), placed and measured."""

    caps_K: np.ndarray
    bounds_K: np.ndarray
    plan: WindowMembers
    first: WindowResult
    metrics: dict

    def dropped(self) -> int:
        return len(self.first.dropped)


@dataclass(frozen=True)
class Unplaced:
    """A candidate not placed: its packing shows that no placement of it could be kept
    (:meth:`Bar.unreachable`). What it breaks is what its packing alone does (the steps bound):
    a placed run breaks those and maybe more."""

    caps_K: np.ndarray
    bounds_K: np.ndarray
    steps_vs_lower_bound: float
    num_dropped: int

    def broken(self) -> tuple[str, ...]:
        return contract.broken_bounds(self._metrics(), ())

    def rank(self, modules: Sequence[str] = ()) -> tuple[int, float]:
        """At most a placed run's rank (:meth:`_Measured.rank`): its bounds broken are among that run's."""
        return len(self.broken()), contract.excess(self._metrics(), ())

    def dropped(self) -> int:
        return self.num_dropped

    def _metrics(self) -> dict:
        return {"steps": {"vs_lower_bound": self.steps_vs_lower_bound}}


@dataclass(frozen=True)
class Bar:
    """What a candidate's trial must beat to be kept by :func:`checked_pick`: the best trial's
    rank so far, without dropping more samples than the pick's.

    Example:
        >>> bar, caps = Bar(rank=(1, 0.4), dropped=0), np.array([9])  # the best breaks one bound, 0.4 past
        >>> [bar.unreachable(Unplaced(caps, caps, steps, dropped)) for steps, dropped in ((1.045, 0), (1.035, 0),
        ...                                                                            (1.02, 2))]
        [True, False, True]
    """

    rank: tuple[int, float]
    dropped: int

    def unreachable(self, packed: Unplaced) -> bool:
        """Whether no placement of a packing with ``packed``'s steps (over their lower bound) and
        samples dropped can be kept: it drops more than the pick, or its steps alone break the
        bounds as many times and as far as the best (every bound a placement adds breaks by more
        than nothing: :func:`~balancer_cli.pack.contract.excess`)."""
        return packed.dropped() > self.dropped or packed.rank() >= tuple(self.rank)


def first_window(inputs: PackInputs, config: PackConfig, caps_K: np.ndarray, bounds_K: np.ndarray, bar: Bar | None,
                 windows: tuple | None = None, *, whole_run: bool) -> tuple[WindowMembers, WindowResult | Unplaced]:
    """``(plan, first)``: the windows at ``caps_K`` (``windows``: :func:`~balancer_cli.pack.window_place.planned`
    of them, when the caller holds it) and the first one placed (epoch 0, window 0), or
    :class:`Unplaced` where its packing cannot beat ``bar`` (None: placed in any case).

    ``whole_run``: the window is the whole run, measured as the report measures a run (its steps
    over their bound rounded, the samples with a scan error among the dropped); else as
    :func:`window_metrics` measures a window.
    """
    whole, ids_n, plan = windows if windows is not None else planned(inputs, config, caps_K)
    task = WindowTask(packer=config.algorithm, config=config, caps_K=caps_K, bounds_K=bounds_K, epoch=0, window=0)
    view = window_view(inputs, whole, ids_n, plan.members[0][0])
    packing = pack_window(task, view)
    if bar is not None:
        per_step = config.shape.groups_per_step
        ids = np.asarray(view.ids_n)[np.asarray(packing.order, dtype=np.int64)]
        steps = _steps_over_bound(packing.num_groups // per_step, inputs, caps_K, ids, per_step)
        steps = round(steps, 6) if whole_run else steps  # as evaluate.py reports a run's
        dropped = len(packing.dropped) + (len(inputs.error_rows) if whole_run else 0)
        packed = Unplaced(caps_K, bounds_K, steps, dropped)
        if bar.unreachable(packed):
            return plan, packed
    return plan, place_packed(task, view, packing)


def window_trial(inputs: PackInputs, config: PackConfig, caps_K: np.ndarray, bounds_K: np.ndarray,
                 bar: Bar | None = None) -> WindowTrial | Unplaced:
    """The run's first window at ``caps_K`` placed as the run places it and measured against the
    contract on its own steps (:func:`window_metrics`); unplaced where it cannot beat ``bar``."""
    plan, first = first_window(inputs, config, caps_K, bounds_K, bar, whole_run=False)
    if isinstance(first, Unplaced):
        return first
    return WindowTrial(caps_K, bounds_K, plan, first, window_metrics(first, inputs, config.shape, caps_K))


def window_metrics(result: WindowResult, inputs: PackInputs, shape: StepShape, caps_K: np.ndarray) -> dict:
    """What the contract reads, of one placed window on its own steps: each module's Dist Ratio,
    utilization and sparse flag and the step mix (:func:`~balancer_cli.pack.step_stages.window_metrics`),
    the steps over the fewest its samples need, and the ``contract`` entry."""
    keep_G = result.step_G >= 0  # groups of an incomplete last step are left out
    size_G = np.diff(result.offsets_G)
    ids = result.order_P[np.repeat(keep_G, size_G)]
    packing = Packing(np.arange(len(ids)), np.concatenate([[0], np.cumsum(size_G[keep_G])]),
                      np.zeros(int(keep_G.sum()), bool), np.zeros(0, np.int64), ())
    assignment = Assignment(result.step_G[keep_G], result.rank_G[keep_G], result.micro_G[keep_G], result.num_steps)
    metrics = placed_metrics(packing, assignment, take_rows(inputs.cost_NK, ids), inputs.source_codes_N[ids], shape,
                             inputs.modules)
    steps = _steps_over_bound(result.num_steps, inputs, caps_K, result.order_P, shape.groups_per_step)
    metrics["steps"] = {"vs_lower_bound": steps}
    metrics["contract"] = contract.contract_entry(metrics, inputs.modules)
    return metrics


def _steps_over_bound(num_steps: int, inputs: PackInputs, caps_K: np.ndarray, ids: np.ndarray, per_step: int) -> float:
    """``num_steps`` over the fewest steps the samples ``ids`` fill under ``caps_K`` (at least one)."""
    least = -(-groups_lower_bound(inputs.load_NK, caps_K, rows=ids) // per_step)
    return num_steps / max(least, 1)


def checked_pick(modules: Sequence[str], num_samples: int, search: Any, pick: Any,
                 run: Callable[[np.ndarray], Any], *, sifted: bool = False) -> tuple[Any, dict[str, Any]]:
    """The pick's trial, or a later candidate's that breaks fewer of the contract's bounds.

    When the pick's trial breaks a bound, the next candidates (in the search's order, measured
    ones first; ``sifted``: in :func:`fallbacks`' order) are tried with ``run(caps_K, bar)`` (which
    may leave one that cannot beat the :class:`Bar` unplaced: :func:`first_window`), up to
    :func:`~balancer_cli.pack.contract.check_fallbacks` of them (2; up to 8 for small inputs),
    and the trial breaking the fewest bounds is kept; of trials breaking as many, the one least
    far past them (``rank``; the earlier on a tie, so the pick first). A trial that drops more
    samples than the pick's (``--oversize drop`` under tighter caps) is never kept: balance is
    not bought with data.

    Returns:
        ``(trial, record)``: the kept trial, and what was checked (for the manifest's metadata).
    """
    record: dict[str, Any] = {"pick_broken": list(pick.broken()), "tried": [], "kept": "pick"}
    best, best_rank = pick, pick.rank(modules)
    seen, tries = [np.asarray(pick.caps_K)], contract.check_fallbacks(num_samples)
    for candidate in fallbacks(search.candidates, pick.caps_K) if sifted else search.candidates:
        if best_rank[0] == 0 or len(record["tried"]) == tries:
            break
        caps_K = np.asarray(candidate.caps_K, dtype=np.int64)
        if any(np.array_equal(caps_K, s) for s in seen):
            continue
        seen.append(caps_K)
        trial = run(caps_K, Bar(best_rank, pick.dropped()))
        by_module = {m: int(c) for m, c in zip(modules, caps_K)}
        record["tried"].append({"caps": by_module, "broken": list(trial.broken()),
                                **({"placed": False} if isinstance(trial, Unplaced) else {})})
        trial_rank = trial.rank(modules)
        if trial_rank < best_rank and trial.dropped() <= pick.dropped():
            best, best_rank = trial, trial_rank
            record["kept"] = by_module
    return best, record


def fallbacks(candidates: Sequence[Any], pick_caps_K: np.ndarray) -> list[Any]:
    """The search's candidates in the order :func:`checked_pick` tries them on first windows: its
    own order (measured ones first), less those that exclude more samples (isolated or dropped over
    a cap) on the subsample than the pick, and those the subsample measured past the mix or steps
    bound last.

    In the search's own order, a harsh mix of 2.5M at ``--dp 16`` whose pick broke the mix bound
    on its first window tried one measured at 2.0x on the subsample and one with an LLM cap that
    isolated 4,155 long samples; the one after, 0.79x in full, never. Where the check packs full
    runs (inputs up to ``pipeline.CHECK_MAX_SAMPLES``) the search's order is kept: its step stages
    bring candidates under the mix bound that the search measured over it (on the 48 ``sparse``
    inputs of ``bench/bench_pack_random.py`` this order lost two that the search's order had kept
    within every bound).

    Example:
        >>> from types import SimpleNamespace as C
        >>> cands = [C(caps_K=(1,), excluded_share=0.0, pruned=False, mix_vs_random=0.7, steps_over_lower_bound=1.0),
        ...          C(caps_K=(2,), excluded_share=0.0, pruned=False, mix_vs_random=2.0, steps_over_lower_bound=1.0),
        ...          C(caps_K=(3,), excluded_share=0.1, pruned=True),
        ...          C(caps_K=(4,), excluded_share=0.0, pruned=True)]
        >>> [c.caps_K[0] for c in fallbacks(cands, np.array([1]))]
        [1, 4, 2]
    """
    pick = next((c for c in candidates if np.array_equal(np.asarray(c.caps_K), pick_caps_K)), None)
    most = pick.excluded_share if pick is not None else np.inf
    allowed = [c for c in candidates if c.excluded_share <= most]

    def measured_broken(c: Any) -> bool:
        return not c.pruned and (c.mix_vs_random > contract.MAX_STEP_MIX
                                 or c.steps_over_lower_bound > contract.MAX_STEP_EXCESS)

    return sorted(allowed, key=measured_broken)
