"""The contract's bounds on a placed manifest, and the pipeline's full-run check of the searched pick."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pack_util import text_only_20k as _text_only_20k

from balancer_cli.manifest import ManifestRows
from balancer_cli.pack import contract
from balancer_cli.pack._blocks import sparse_modules
from balancer_cli.pack.contract import (
    MAX_DIST_RATIO,
    MAX_STEP_MIX,
    MIN_SPARSE_UTILIZATION,
    broken_bounds,
    contract_entry,
    excess,
)
from balancer_cli.pack.packers.balanced import MAX_STEP_EXCESS


def _rows(groups: int, per_group: int) -> ManifestRows:
    """``groups`` groups of ``per_group`` samples, one group per (step, rank) of 2 ranks."""
    g = np.repeat(np.arange(groups), per_group)
    return ManifestRows(g // 2, g % 2, np.zeros_like(g), np.arange(len(g)))


def _metrics(dist, util, steps, mix, sparse=(False, False)):
    return {"modules": {m: {"dist_ratio": d, "utilization": u, "sparse": s}
                        for m, d, u, s in zip(("audio", "llm"), dist, util, sparse)},
            "steps": {"vs_lower_bound": steps}, "step_mix": {"vs_random": mix}}


@settings(max_examples=60, deadline=None)
@given(dist=st.floats(0, 0.02), util=st.floats(0.5, 1.0), steps=st.floats(1.0, 1.1), mix=st.floats(0.0, 3.0),
       sparse=st.booleans())
def test_each_bound_is_broken_exactly_when_its_value_is_past_it(dist, util, steps, mix, sparse):
    """Dense modules are held to Dist, sparse ones (few groups hold them) to utilization."""
    broken = broken_bounds(_metrics((dist, dist), (util, util), steps, mix, (sparse, False)), ("audio", "llm"))
    expected = []
    if sparse:
        expected += ["util:audio"] if util < MIN_SPARSE_UTILIZATION else []
    elif dist > MAX_DIST_RATIO:
        expected += ["dist:audio"]
    expected += ["dist:llm"] if dist > MAX_DIST_RATIO else []
    expected += ["steps"] if steps > MAX_STEP_EXCESS else []
    expected += ["mix"] if mix > MAX_STEP_MIX else []
    assert broken == tuple(expected)
    assert contract_entry(_metrics((dist, dist), (util, util), steps, mix, (sparse, False)), ("audio", "llm")) == {
        "bounds": {"max_dist_ratio": MAX_DIST_RATIO, "min_sparse_utilization": MIN_SPARSE_UTILIZATION,
                   "max_steps_vs_lower_bound": MAX_STEP_EXCESS, "max_step_mix_vs_random": MAX_STEP_MIX},
        "broken": expected}


@settings(max_examples=60, deadline=None)
@given(dist=st.floats(0, 0.02), util=st.floats(0.5, 1.0), steps=st.floats(1.0, 1.1), mix=st.floats(0.0, 3.0),
       sparse=st.booleans(), worse=st.floats(0.0, 0.5))
def test_the_excess_is_zero_within_the_bounds_and_grows_past_each(dist, util, steps, mix, sparse, worse):
    """``excess`` sums each broken bound's excess in units of its allowance: 0 exactly when every
    bound is met, positive otherwise, and larger where any value moves further past its bound."""
    modules = ("audio", "llm")
    metrics = _metrics((dist, dist), (util, util), steps, mix, (sparse, False))
    value = excess(metrics, modules)
    assert (value == 0.0) == (not broken_bounds(metrics, modules)) and value >= 0.0
    # Each value further from its ideal by ``worse`` of its allowance: the same bounds break or more,
    # and the excess does not fall (it rises wherever a broken bound moved).
    further = _metrics((dist + worse * MAX_DIST_RATIO,) * 2, (util - worse * (1 - MIN_SPARSE_UTILIZATION),) * 2,
                       steps + worse * (MAX_STEP_EXCESS - 1), mix + worse * MAX_STEP_MIX, (sparse, False))
    assert set(broken_bounds(metrics, modules)) <= set(broken_bounds(further, modules))
    assert excess(further, modules) >= value
    if broken_bounds(metrics, modules) and worse > 0.01:
        assert excess(further, modules) > value


@settings(max_examples=40, deadline=None)
@given(steps=st.integers(1, 30), R=st.integers(1, 6), M=st.integers(1, 3), share=st.floats(0, 1),
       seed=st.integers(0, 99))
def test_the_metrics_say_which_modules_are_sparse_as_the_packer_judges_them(steps, R, M, share, seed):
    """Each module's share of the placed groups that hold it, and so whether it is sparse, as
    :func:`sparse_modules` finds from the groups' sums (the assigner's and the trade's test)."""
    from balancer_cli.lengths import make_lengths_table
    from balancer_cli.pack.evaluate import evaluate_rows
    from balancer_cli.pack.inputs import prepare_inputs

    rng = np.random.default_rng(seed)
    size = rng.integers(1, 4, steps * R * M)
    slot = np.repeat(np.arange(steps * R * M), size)
    n = len(slot)
    clips = (rng.random(n) < share) * rng.integers(1, 3, n)
    inputs = prepare_inputs(make_lengths_table(rng.integers(10, 99, n) + 50 * clips, {"audio": (50 * clips, clips)}))
    rows = ManifestRows(slot // (R * M), slot // M % R, slot % M, rng.permutation(n))
    metrics = evaluate_rows(inputs, rows, np.zeros(0, np.int64), (), caps_K=np.array([99, 9999]), world_size=R,
                            micro_batches=M, epoch_num_steps=[steps]).metrics
    cost_GK = np.stack([np.bincount(slot, inputs.cost_NK[rows.sample, k]) for k in range(2)], axis=1)
    assert [metrics["modules"][m]["sparse"] for m in ("audio", "llm")] == sparse_modules(cost_GK).tolist()
    assert metrics["modules"]["audio"]["group_share"] == round(float(np.mean(cost_GK[:, 0] > 0)), 6)
    assert metrics["contract"]["broken"] == list(broken_bounds(metrics, ("audio", "llm")))


def test_a_pick_that_breaks_a_bound_in_full_falls_to_a_candidate_that_does_not(monkeypatch):
    from balancer_cli.pack import pipeline
    from balancer_cli.pack.config import PackConfig

    table, config = _text_only_20k(), PackConfig(world_size=64, micro_batches=2)
    result = pipeline.pack_manifest(table, config)
    params, summary = result.meta["params"], result.meta["summary"]
    checked = params["search"]["checked"]
    assert checked["pick_broken"] and checked["tried"] and checked["kept"] != "pick"
    assert checked["kept"] == params["caps"] and checked["tried"][-1]["broken"] == []
    assert summary["step_mix"]["vs_random"] <= MAX_STEP_MIX and summary["steps"]["vs_lower_bound"] <= MAX_STEP_EXCESS
    # Conservation: the kept run places every sample once; the same inputs give the same rows.
    assert np.array_equal(np.sort(result.rows.sample), np.arange(table.num_samples))
    again = pipeline.pack_manifest(table, config)
    assert np.array_equal(again.rows.sample, result.rows.sample) and np.array_equal(again.rows.step, result.rows.step)
    # Past CHECK_MAX_SAMPLES the candidates are tried on their first windows (here: the whole
    # input, so the pick breaks the same bounds), in fallbacks' order: another one is kept.
    monkeypatch.setattr(pipeline, "CHECK_MAX_SAMPLES", 0)
    probed = pipeline.pack_manifest(table, config)
    on_window = probed.meta["params"]["search"]["checked"]
    assert on_window["on"] == "first window" and on_window["pick_broken"] == checked["pick_broken"]
    assert on_window["kept"] == probed.meta["params"]["caps"] and on_window["tried"][-1]["broken"] == []
    assert probed.meta["summary"]["contract"]["broken"] == []
    # Without the check the pick is kept as the search made it, bounds broken.
    monkeypatch.setattr(pipeline, "CHECK_MAX_SAMPLES", 10**9)
    monkeypatch.setattr(pipeline, "checked_pick", lambda modules, n, search, pick, run: (pick, None))
    unchecked = pipeline.pack_manifest(table, config)
    assert "checked" not in unchecked.meta["params"]["search"]
    assert unchecked.meta["params"]["caps"] == {"llm": int(pipeline.run_search(
        pipeline.prepare_inputs(table), config, prune=True).best_caps_K[0])} != params["caps"]
    # The bounds the check found the pick breaking (its windows' coarser cells fix what they can).
    assert unchecked.meta["summary"]["contract"]["broken"] == checked["pick_broken"]


@pytest.mark.parametrize("window, R, M, seed, falls_back", [(7000, 64, 2, 1, False), (7000, 64, 1, 0, True)])
def test_past_check_max_samples_the_pick_is_checked_on_its_first_window_and_the_run_reuses_it(
        monkeypatch, window, R, M, seed, falls_back):
    """Past ``CHECK_MAX_SAMPLES`` each candidate tried packs one window, the run packs every other
    window once, and its rows are those of the kept caps packed without a search (the first window
    is reused exactly as the run would have placed it). At one micro-batch the pick's first window
    breaks the steps bound, the next candidate's too, and the third is kept."""
    import dataclasses

    from balancer_cli.pack import pick_check, pipeline, window_place
    from balancer_cli.pack.config import PackConfig

    table = _text_only_20k()
    config = PackConfig(world_size=R, micro_batches=M, window_samples=window, seed=seed)
    monkeypatch.setattr(pipeline, "CHECK_MAX_SAMPLES", 0)
    placed = []
    real_place = window_place.place_packed
    monkeypatch.setattr(window_place, "place_packed",
                        lambda task, view, packing: placed.append(task) or real_place(task, view, packing))
    monkeypatch.setattr(pick_check, "place_packed", window_place.place_packed)
    result = pipeline.pack_manifest(table, config)
    params = result.meta["params"]
    checked = params["search"]["checked"]
    assert checked["on"] == "first window" and params["windows"] >= 2
    assert (checked["kept"] != "pick") == falls_back == bool(checked["pick_broken"])
    # A candidate whose first window's packing cannot beat the best (its steps alone) is not placed.
    placed_tries = [t for t in checked["tried"] if t.get("placed", True)]
    assert all(t["broken"] == ["steps"] for t in checked["tried"] if not t.get("placed", True))
    assert len(placed) == params["windows"] + len(placed_tries)
    assert all((task.epoch, task.window) == (0, 0) for task in placed[:1 + len(placed_tries)])
    assert np.array_equal(np.sort(result.rows.sample), np.arange(table.num_samples))
    plain = pipeline.pack_manifest(table, dataclasses.replace(config, caps=tuple(params["caps"].items())))
    for column in ("step", "rank", "micro", "sample"):
        assert np.array_equal(getattr(plain.rows, column), getattr(result.rows, column))


@pytest.mark.parametrize("fallbacks", [0, 1])
def test_a_pick_within_every_bound_is_packed_once(monkeypatch, fallbacks):
    """A pick that meets the contract in full is kept without packing another candidate."""
    from balancer_cli.lengths import make_lengths_table
    from balancer_cli.pack import pipeline
    from balancer_cli.pack.config import PackConfig

    rng = np.random.default_rng(2)
    n = 6000
    tiles = rng.integers(0, 4, n)
    table = make_lengths_table(256 * tiles + rng.integers(20, 400, n), {"vision": (256.0 * tiles, tiles)},
                               source=np.array(["a", "b"])[(tiles > 1).astype(int)])
    calls = []
    real_place = pipeline.place_packer
    monkeypatch.setattr(pipeline, "place_packer", lambda *a, **k: calls.append(a[4]) or real_place(*a, **k))
    monkeypatch.setattr(contract, "CHECK_FALLBACKS", fallbacks)
    monkeypatch.setattr(contract, "CHECK_ROWS", 0)
    result = pipeline.pack_manifest(table, PackConfig(world_size=4))
    checked = result.meta["params"]["search"]["checked"]
    assert checked["pick_broken"] == [] and checked["tried"] == [] and checked["kept"] == "pick"
    assert len(calls) == 1


def test_the_cli_says_when_a_later_candidate_replaced_the_pick(tmp_path):
    from click.testing import CliRunner

    from balancer_cli.cli import main
    from balancer_cli.lengths import write_lengths

    write_lengths(_text_only_20k(), tmp_path / "lengths.parquet")
    out = CliRunner().invoke(main, ["pack", str(tmp_path / "lengths.parquet"), "--dp", "64", "--micro-batches", "2",
                                    "--baselines", "none", "-o", str(tmp_path / "out")])
    assert out.exit_code == 0, out.output
    # The pick's windows were assigned again on coarser cells, which fixed its mix but not its steps.
    assert "(searched; the subsample's pick broke steps in full, a later candidate kept)" in out.output
    assert "bounds missed" not in out.output  # the kept candidate meets every bound


def test_a_fallback_that_drops_more_samples_is_never_kept_and_the_tries_are_bounded(monkeypatch):
    """``checked_pick`` over fake full runs: the pick's own caps are not packed again, a run that
    drops more samples than the pick's is not kept however balanced, at most ``check_fallbacks`` runs."""
    from types import SimpleNamespace

    from balancer_cli.pack.pick_check import Trial, checked_pick
    from balancer_cli.pack.placement import Placement

    rows = _rows(4, 2)
    inputs = SimpleNamespace(modules=("llm",), cost_NK=np.ones((8, 1)), num_samples=8)

    def trial(cap, mix, dropped):
        metrics = {"modules": {"llm": {"dist_ratio": 0.0, "utilization": 1.0, "sparse": False}},
                   "steps": {"vs_lower_bound": 1.0}, "step_mix": {"vs_random": mix}}
        metrics["contract"] = contract_entry(metrics, ("llm",))
        placement = Placement(rows, np.arange(dropped), ("over cap",) * dropped, [2])
        return Trial(np.array([cap]), np.array([cap]), placement, SimpleNamespace(metrics=metrics))

    runs = {10: trial(10, 1.5, 0), 20: trial(20, 0.5, 3), 30: trial(30, 1.2, 0), 40: trial(40, 0.5, 0),
            50: trial(50, 0.5, 0)}
    packed = []

    def run(caps_K, bar):
        packed.append(int(caps_K[0]))
        return runs[int(caps_K[0])]

    search = SimpleNamespace(candidates=[SimpleNamespace(caps_K=(c,), excluded_share=0.0) for c in (10, 10, 20, 30, 40, 50)])
    monkeypatch.setattr(contract, "CHECK_FALLBACKS", 3)
    monkeypatch.setattr(contract, "CHECK_ROWS", 0)  # no more tries for small inputs here (below)
    kept, record = checked_pick(inputs.modules, inputs.num_samples, search, runs[10], run)
    assert packed == [20, 30, 40] and kept is runs[40]
    assert record == {"pick_broken": ["mix"], "kept": {"llm": 40}, "tried": [
        {"caps": {"llm": 20}, "broken": []}, {"caps": {"llm": 30}, "broken": ["mix"]}, {"caps": {"llm": 40}, "broken": []}]}
    monkeypatch.setattr(contract, "CHECK_FALLBACKS", 1)
    packed.clear()
    kept, record = checked_pick(inputs.modules, inputs.num_samples, search, runs[10], run)
    assert packed == [20] and kept is runs[10] and record["kept"] == "pick"
    # Small inputs try more, while the tries pack at most CHECK_ROWS rows: 8 samples, two tries' worth.
    monkeypatch.setattr(contract, "CHECK_ROWS", 16)
    packed.clear()
    kept, record = checked_pick(inputs.modules, inputs.num_samples, search, runs[10], run)
    # 30 breaks the mix bound as the pick does, but less far past it (1.2x against 1.5x): kept.
    assert packed == [20, 30] and kept is runs[30] and len(record["tried"]) == 2 and record["kept"] == {"llm": 30}
