"""The pick check leaves a candidate unplaced only where no placement of it could be kept."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pack_util import text_only_20k

from balancer_cli.pack import contract
from balancer_cli.pack.contract import broken_bounds, contract_entry, excess
from balancer_cli.pack.pick_check import Bar, Unplaced, checked_pick


def _metrics(dist, util, steps, mix, sparse):
    return {"modules": {m: {"dist_ratio": d, "utilization": u, "sparse": s}
                        for m, d, u, s in zip(("audio", "llm"), dist, util, sparse)},
            "steps": {"vs_lower_bound": steps}, "step_mix": {"vs_random": mix}}


_MODULES = ("audio", "llm")
_metric = st.tuples(st.tuples(st.floats(0, 0.02), st.floats(0, 0.02)), st.tuples(st.floats(0.5, 1), st.floats(0.5, 1)),
                    st.floats(1.0, 1.1), st.floats(0.0, 3.0), st.tuples(st.booleans(), st.just(False)))


@settings(max_examples=300, deadline=None)
@given(best=_metric, placed=_metric, best_dropped=st.integers(0, 3), dropped=st.integers(0, 3),
       extra_dropped=st.integers(0, 3))
def test_an_unreachable_packing_is_never_kept_whatever_its_placement(best, placed, best_dropped, dropped,
                                                                     extra_dropped):
    """Soundness: where :meth:`Bar.unreachable` says so of a packing's steps and drops, every
    placement of it (any Dist, utilization and mix; as many drops or more) ranks at least as far
    as the best or drops more than the pick, so :func:`checked_pick` would not keep it."""
    best_metrics, metrics = _metrics(*best), _metrics(*placed)
    best_rank = (len(broken_bounds(best_metrics, _MODULES)), excess(best_metrics, _MODULES))
    bar = Bar(rank=best_rank, dropped=best_dropped)
    unplaced = Unplaced(np.array([1]), np.array([1]), metrics["steps"]["vs_lower_bound"], dropped)
    if bar.unreachable(unplaced):
        rank = (len(broken_bounds(metrics, _MODULES)), excess(metrics, _MODULES))
        assert not (rank < best_rank and dropped + extra_dropped <= best_dropped)
    # What an unplaced trial records is what its placement breaks of the steps bound: a subset.
    assert set(unplaced.broken()) <= set(broken_bounds(metrics, _MODULES))
    assert unplaced.rank() <= (len(broken_bounds(metrics, _MODULES)), excess(metrics, _MODULES))


def test_an_unplaced_trial_is_recorded_counted_and_never_kept(monkeypatch):
    """``checked_pick`` passes each run the bar to beat; an :class:`Unplaced` answer counts as a
    try, is recorded with ``placed: false`` and the bounds its packing breaks, and is not kept."""
    from types import SimpleNamespace

    def trial(cap, broken):
        metrics = {"modules": {}, "steps": {"vs_lower_bound": 1.0}, "step_mix": {"vs_random": 2.0 if broken else 0.5}}
        metrics["contract"] = contract_entry(metrics, ())
        return SimpleNamespace(caps_K=np.array([cap]), metrics=metrics, broken=lambda: tuple(broken),
                               rank=lambda modules: (len(broken), excess(metrics, ())), dropped=lambda: 0)

    bars = []

    def run(caps_K, bar):
        bars.append(bar)
        cap = int(caps_K[0])
        return Unplaced(caps_K, caps_K, 1.06, 0) if cap == 20 else trial(cap, ["mix"] if cap == 30 else [])

    search = SimpleNamespace(candidates=[SimpleNamespace(caps_K=(c,)) for c in (10, 20, 30, 40)])
    monkeypatch.setattr(contract, "CHECK_FALLBACKS", 3)
    monkeypatch.setattr(contract, "CHECK_ROWS", 0)
    kept, record = checked_pick((), 1000, search, trial(10, ["mix"]), run)
    assert record["tried"] == [{"caps": {}, "broken": ["steps"], "placed": False}, {"caps": {}, "broken": ["mix"]},
                               {"caps": {}, "broken": []}]
    assert int(kept.caps_K[0]) == 40 and record["kept"] == {}
    assert bars[0] == Bar(rank=(1, 1.0), dropped=0) and bars[-1].rank == (1, 1.0)


@pytest.mark.parametrize("world_size, micro_batches, seed, window", [(128, 2, 1, None), (64, 1, 0, 7000)])
def test_leaving_candidates_unplaced_changes_nothing_but_the_record(monkeypatch, world_size, micro_batches, seed,
                                                                    window):
    """The same manifest with and without unplaced candidates, in full runs (``--dp 128`` x 2:
    two of three fallbacks take a step more than the pick) and on first windows (past
    ``CHECK_MAX_SAMPLES``); the record differs only in the ``placed`` marks."""
    from balancer_cli.pack import pipeline
    from balancer_cli.pack.config import PackConfig

    if window:
        monkeypatch.setattr(pipeline, "CHECK_MAX_SAMPLES", 0)
    config = PackConfig(world_size=world_size, micro_batches=micro_batches, seed=seed, window_samples=window)
    table = text_only_20k()
    result = pipeline.pack_manifest(table, config)
    tried = result.meta["params"]["search"]["checked"]["tried"]
    assert any(t.get("placed") is False for t in tried)
    assert all(t["broken"] == ["steps"] for t in tried if t.get("placed") is False)
    monkeypatch.setattr(Bar, "unreachable", lambda self, packed: False)
    every = pipeline.pack_manifest(table, config)
    for column in ("step", "rank", "micro", "sample"):
        assert np.array_equal(getattr(every.rows, column), getattr(result.rows, column))
    assert every.meta["params"]["caps"] == result.meta["params"]["caps"]
    assert every.meta["summary"] == result.meta["summary"]
    placed_tries = every.meta["params"]["search"]["checked"]["tried"]
    assert [t["caps"] for t in placed_tries] == [t["caps"] for t in tried]
    for unplaced, placed in zip(tried, placed_tries):
        if unplaced.get("placed") is False:  # what it broke placed includes what its packing broke
            assert set(unplaced["broken"]) <= set(placed["broken"])
        else:
            assert unplaced == placed
