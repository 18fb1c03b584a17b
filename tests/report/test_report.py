"""Report metrics: definitions on hand-made loads, computed from the written manifest, rendering."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer_cli._shuffle import shuffled
from balancer_cli.errors import ManifestError
from balancer_cli.lengths import make_lengths_table
from balancer_cli.manifest import ManifestRows, open_manifest, write_manifest
from balancer_cli.pack.evaluate import evaluate_rows, step_mix_distances
from balancer_cli.metrics import dist_ratio, pad_ratio, step_loads, step_utilization, utilization
from balancer_cli.pack.config import PackConfig
from balancer_cli.pack.inputs import prepare_inputs
from balancer_cli.pack.pipeline import pack_manifest
from balancer_cli.report.build import build_report, report_figure, write_report
from balancer_cli.report.markdown import render_markdown, summary_table


def test_metric_definitions_on_known_loads():
    load_SR = np.array([[4.0, 2.0, 2.0], [3.0, 3.0, 3.0], [0.0, 0.0, 0.0]])
    # step 0: (0 + 2 + 2) / (4 x 3) = 1/3; step 1: 0; empty step 2: 0
    assert dist_ratio(load_SR) == pytest.approx((1 / 3) / 3)
    assert utilization(load_SR) == pytest.approx(17 / (3 * 7))
    # modules one after another: vision [4,2,2] then llm [1,1,4] at one step
    assert step_utilization([np.array([[4.0, 2.0, 2.0]]), np.array([[1.0, 1.0, 4.0]])]) == pytest.approx(14 / (3 * 8))
    # groups {10, 6} and {5}: pad 4 of (10 x 2 + 5 x 1)
    assert pad_ratio(np.array([7, 7, 9]), np.array([10.0, 6.0, 5.0])) == pytest.approx(4 / 25)
    assert step_loads(np.array([1, 1]), np.array([0, 0]), np.array([2.0, 3.0]), num_steps=2, world_size=2).tolist() \
        == [[0.0, 0.0], [5.0, 0.0]]
    assert step_mix_distances(np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1]), 2, 2).tolist() == [0.0, 0.0]


def test_evaluate_counts_over_cap_groups_and_post_balance_ranks():
    vision = (np.array([512, 512, 0, 0]), np.array([2, 2, 0, 0]))
    lt = make_lengths_table(np.array([100, 100, 10, 10]), {"vision": vision})
    inputs = prepare_inputs(lt)
    rows = ManifestRows(np.zeros(4, int), np.array([0, 0, 1, 1]), np.zeros(4, int), np.arange(4),
                        extra={"vision_rank": np.array([0, 1, 1, 1])})
    ev = evaluate_rows(inputs, rows, np.array([], np.int64), (), caps_K=np.array([3, 1000]), world_size=2,
                       micro_batches=1, epoch_num_steps=[1])
    m = ev.metrics
    assert m["groups"] == {"count": 2, "mean_size": 2.0, "over_cap": 1, "over_cap_multi_sample": 1}
    assert m["modules"]["vision"]["utilization"] == 0.5
    assert m["post_balance"]["modules"]["vision"] == {"dist_ratio": 0.0, "utilization": 1.0}
    assert ev.loads["vision"].tolist() == [[1024.0, 0.0]]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), sources=st.integers(1, 300), steps=st.integers(1, 12), world=st.integers(1, 5))
def test_the_step_mix_is_the_distance_of_each_steps_counts(seed, sources, steps, world):
    """The evaluation measures each step's mix while its rows pass (no (S, O) table): the same
    distances as the steps' source counts give, for many sources (some in no row), steps of any
    size and the seeded shuffle of random batching."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(steps * world, 40 * steps * world + 1))
    source = np.array([f"s{i}" for i in rng.integers(0, sources, n)])
    inputs = prepare_inputs(make_lengths_table(rng.integers(1, 500, n), source=source))
    step = np.sort(np.concatenate([np.arange(steps).repeat(world), rng.integers(0, steps, n - steps * world)]))
    rank = np.concatenate([np.sort(np.concatenate([np.arange(world), rng.integers(0, world, c - world)]))
                           for c in np.bincount(step, minlength=steps)])
    rows = ManifestRows(step, rank, np.zeros(n, int), rng.permutation(n))
    mix = evaluate_rows(inputs, rows, np.array([], np.int64), (), caps_K=np.array([10**6]), world_size=world,
                        micro_batches=1, epoch_num_steps=[steps]).metrics["step_mix"]
    O = len(inputs.source_names)
    source_P = inputs.source_codes_N[rows.sample]
    placed = step_mix_distances(step, source_P, steps, O)
    reference = step_mix_distances(step, shuffled(np.random.default_rng(0), source_P), steps, O)
    assert mix["mean_distance"] == pytest.approx(placed.mean(), abs=2e-6)
    assert mix["max_distance"] == pytest.approx(placed.max(), abs=2e-6)
    assert mix["shuffled_mean_distance"] == pytest.approx(reference.mean(), abs=2e-6)
    assert mix["num_sources"] == O


def test_drop_reasons_are_counted_by_kind():
    inputs = prepare_inputs(make_lengths_table(np.arange(1, 5)))
    rows = ManifestRows(np.zeros(1, int), np.zeros(1, int), np.zeros(1, int), np.array([0]))
    reasons = ("missing_file: a.jsonl:3: x.jpg not found", "missing_file: a.jsonl:9: y.jpg not found",
               "oversize: llm 900 > cap 100")
    ev = evaluate_rows(inputs, rows, np.array([1, 2, 3]), reasons, caps_K=np.array([100]), world_size=1,
                       micro_batches=1, epoch_num_steps=[1])
    by_reason = ev.metrics["dropped"]["by_reason"]
    assert list(by_reason) == ["missing_file", "oversize"]
    assert by_reason["missing_file"] == {"count": 2, "share": 0.5, "example": reasons[0]}
    assert ev.metrics["dropped"]["share"] == 0.75


def _lengths(n=600, seed=0):
    rng = np.random.default_rng(seed)
    items = rng.integers(0, 8, n)
    error = [None] * n
    error[3] = "corrupt image"
    return make_lengths_table(items * 256 + rng.integers(30, 500, n), {"vision": (items * 256, items)},
                              error=error, source=rng.choice(["docvqa", "ai2d"], n))


def _write(tmp_path, lt, config):
    result = pack_manifest(lt, config)
    write_manifest(tmp_path, result.rows, dropped_sample=result.dropped_sample, dropped_reason=result.dropped_reason,
                   meta=result.meta, epoch_num_steps=result.epoch_num_steps)
    return result


def test_report_from_written_manifest_matches_the_pack_summary(tmp_path):
    lt = _lengths()
    config = PackConfig(world_size=4, micro_batches=2, epochs=2, caps=(("llm", 3000), ("vision", 10)))
    result = _write(tmp_path, lt, config)
    report = build_report(open_manifest(tmp_path), lt, baselines=("dataloader", "random", "llm-ffd", "isf"))
    data = report.data
    summary = result.meta["summary"]
    for key in ("modules", "step", "steps", "dropped", "groups", "step_mix"):
        assert data[key] == summary[key], key
    assert data["dropped"]["by_reason"] == {"corrupt image": {"count": 1, "share": round(1 / 600, 6),
                                                              "example": "corrupt image"}}
    assert set(data["baselines"]) == {"dataloader", "random", "llm-ffd", "isf"}
    for name, base in data["baselines"].items():
        assert set(base["modules"]) == {"vision", "llm"}, name
        assert {"dist_ratio", "pad_ratio", "utilization"} <= set(base["modules"]["llm"])
    # ours balances both modules better than a data loader's random batches of the same mean size
    for module in ("vision", "llm"):
        assert data["modules"][module]["dist_ratio"] < data["baselines"]["dataloader"]["modules"][module]["dist_ratio"]
    assert data["baselines"]["dataloader"]["batch_size"] == data["baselines"]["random"]["batch_size"]
    assert 0 < data["step_mix"]["shuffled_mean_distance"] < 1
    assert data["baselines"]["random"]["groups"]["over_cap"] >= 0
    assert data["steps"]["per_epoch"] == result.epoch_num_steps



@pytest.mark.parametrize("baselines, drawn", [(("random", "llm-ffd", "isf", "dataloader"), "dataloader"),
                                              (("random", "isf", "llm-ffd"), "isf"), (("random",), "random"), ((), None)])
def test_report_keeps_the_loads_of_the_drawn_baseline_only(tmp_path, baselines, drawn):
    """Every baseline's metrics, but (S, R) loads only for the manifest and the figure's baseline,
    in any order the baselines run: the figure is the one all their loads would give."""
    lt = _lengths()
    _write(tmp_path, lt, PackConfig(world_size=4, micro_batches=2, caps=(("llm", 3000), ("vision", 10))))
    report = build_report(open_manifest(tmp_path), lt, baselines=baselines)
    assert set(report.data["baselines"]) == set(baselines)
    assert set(report.loads) == {"ours"} | ({drawn} if drawn else set())
    assert report_figure(report.loads, "balanced")[2]["baseline_label"] == drawn

def test_report_reusing_the_pack_evaluation_is_the_report_of_the_read_rows(tmp_path):
    """``balancer pack`` hands its evaluation of the rows it wrote to the report: the same data and
    loads as evaluating the manifest read back; another cost model evaluates again."""
    lt = _lengths()
    config = PackConfig(world_size=4, micro_batches=2, caps=(("llm", 3000), ("vision", 10)))
    result = _write(tmp_path, lt, config)
    fresh = build_report(open_manifest(tmp_path), lt, baselines=("random",))
    reused = build_report(open_manifest(tmp_path), lt, baselines=("random",), ours=result.evaluation)
    assert json.dumps(fresh.data, sort_keys=True) == json.dumps(reused.data, sort_keys=True)
    for module, load_SR in fresh.loads["ours"].items():
        assert np.array_equal(load_SR, reused.loads["ours"][module])
    flops = build_report(open_manifest(tmp_path), lt, baselines=(), ours=result.evaluation,
                         cost={"cost_model": "flops", "cost_presets": (("llm", "qwen2-7b"), ("vision", "internvit-300m"))})
    assert flops.data["manifest"]["cost_model"] == "flops"
    assert flops.data["modules"]["llm"]["mean_rank_load"] != reused.data["modules"]["llm"]["mean_rank_load"]


def test_report_files_and_markdown(tmp_path):
    lt = _lengths(300, 1)
    _write(tmp_path, lt, PackConfig(world_size=2, caps=(("llm", 3000), ("vision", 10))))
    report = build_report(open_manifest(tmp_path), lt, baselines=("llm-ffd",))
    paths = write_report(tmp_path, report)
    data = json.loads(paths["json"].read_text())
    assert data["baselines"]["llm-ffd"]["modules"]["vision"]["dist_ratio"] >= 0
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths["md"].read_text()
    header, rows = summary_table(data)
    assert "| " + " | ".join(header) + " |" in md
    assert rows[0][0] == "ours (balanced)" and rows[1][0] == "llm-ffd"
    assert "corrupt image" in md and "1 of 300 samples" in md
    assert render_markdown(data) == md


def test_report_refuses_other_lengths(tmp_path):
    lt = _lengths(200, 2)
    _write(tmp_path, lt, PackConfig(world_size=2, caps=(("llm", 3000), ("vision", 10))))
    with pytest.raises(ManifestError, match="is not the one .* was packed from"):
        build_report(open_manifest(tmp_path), _lengths(200, 3))


def test_report_records_a_baseline_that_cannot_run(tmp_path):
    # Ours spreads 4 samples over 4 ranks; ISF fills one group with all of them, too few for a step.
    lt = make_lengths_table(np.array([100, 100, 100, 100]))
    _write(tmp_path, lt, PackConfig(world_size=4, caps=(("llm", 400),)))
    report = build_report(open_manifest(tmp_path), lt, baselines=("random", "isf"))
    assert "modules" in report.data["baselines"]["random"]
    assert "groups per step" in report.data["baselines"]["isf"]["error"]
    header, rows = summary_table(report.data)
    assert rows[2][:2] == ["isf", "not run: " + report.data["baselines"]["isf"]["error"]]


def test_baselines_sharing_one_window_plan_report_as_each_alone(tmp_path):
    """The report plans the baselines' windows once: every baseline's metrics equal its report alone."""
    lt = _lengths(n=1500, seed=4)
    _write(tmp_path, lt, PackConfig(world_size=4, micro_batches=2, epochs=2, window_samples=400,
                                    caps=(("llm", 3000), ("vision", 10))))
    names = ("dataloader", "random", "llm-ffd", "isf")
    together = build_report(open_manifest(tmp_path), lt, baselines=names).data["baselines"]
    for name in names:
        alone = build_report(open_manifest(tmp_path), lt, baselines=(name,)).data["baselines"][name]
        assert json.dumps(together[name], sort_keys=True) == json.dumps(alone, sort_keys=True), name


def test_the_plan_pack_hands_over_is_the_baselines_plan(tmp_path, monkeypatch):
    """With the windows pack planned (``PackResult.plan``) the baselines pack them without planning
    again (10M: ~0.5-1 s), and the report is the one that plans them itself."""
    import balancer_cli.report.build as build

    lt = _lengths(n=1500, seed=5)
    result = _write(tmp_path, lt, PackConfig(world_size=4, micro_batches=2, epochs=2, window_samples=400,
                                             caps=(("llm", 3000), ("vision", 10))))
    names = ("random", "llm-ffd", "isf")
    planned = build_report(open_manifest(tmp_path), lt, baselines=names).data
    monkeypatch.setattr(build, "plan_windows", lambda *a, **k: pytest.fail("planned again"))
    handed = build_report(open_manifest(tmp_path), lt, baselines=names, plan=result.plan).data
    assert json.dumps(handed, sort_keys=True) == json.dumps(planned, sort_keys=True)


@pytest.mark.parametrize(("micro_batches", "share", "advised"), [(1, 0.6, 2), (1, 0.1, 10), (2, 0.3, 4), (2, 0.5, None),
                                                                  (4, 0.3, None)])
def test_a_missed_mix_names_the_micro_batches_that_let_every_step_hold_a_sparse_module(micro_batches, share, advised):
    """A step holds a sparse module on every rank or on none: with it in ``share`` of the groups at
    most ``share x M`` of the steps hold it; the hint names ceil(1 / share) micro-batches, and says
    nothing where every step can hold it already (the mix is then missed for another reason)."""
    from balancer_cli.report.markdown import contract_lines

    data = {"contract": {"bounds": {"max_step_mix_vs_random": 1.0}, "broken": ["mix"]},
            "step_mix": {"vs_random": 1.4}, "manifest": {"micro_batches": micro_batches},
            "modules": {"audio": {"sparse": True, "group_share": share}, "llm": {"sparse": False, "group_share": 1.0}}}
    lines = contract_lines(data)
    assert lines[0].startswith("bounds missed: step mix 1.40x random batching > 1.0x")
    if advised is None:
        assert lines == lines[:1]
    else:
        assert lines[1].startswith(f"  audio is in {share:.0%} of the groups")
        assert f"at most {share * micro_batches:.0%} of the steps hold it" in lines[1]
        assert lines[1].endswith(f"--micro-batches {advised} or more lets every step hold it")


@pytest.mark.parametrize(("micro_batches", "share", "searched", "given", "target"), [
    (1, 0.46, True, None, 10), (2, 0.3, True, None, 8), (1, 0.1, True, None, 46),
    (1, 0.46, False, None, None),  # every cap given: no search, the caps fix the group size
    (1, 0.46, True, ["llm"], None),  # an LLM cap given: the search stays under it
    (1, 0.000001, True, None, None),  # one group in a million: past what --target-group-size takes
])
def test_a_missed_mix_names_the_group_size_that_lets_every_step_hold_a_sparse_module(micro_batches, share, searched,
                                                                                       given, target):
    """At M micro-batches, groups ceil(mean size / (share x M)) samples large hold the module in
    every step's ranks (as many groups hold it, a larger share of fewer): the hint names that
    ``--target-group-size`` too, where the search picks every cap."""
    from balancer_cli.report.markdown import contract_lines

    search = {"given": given} if given else {}
    data = {"contract": {"bounds": {"max_step_mix_vs_random": 1.0}, "broken": ["mix"]}, "step_mix": {"vs_random": 1.4},
            "manifest": {"micro_batches": micro_batches, "params": {"searched": searched, "search": search}},
            "groups": {"mean_size": 4.6},
            "modules": {"audio": {"sparse": True, "group_share": share}, "llm": {"sparse": False, "group_share": 1.0}}}
    hint = contract_lines(data)[1]
    if target is None:
        assert hint.endswith("or more lets every step hold it")
    else:
        unit = "micro-batch" if micro_batches == 1 else "micro-batches"
        assert hint.endswith(f"lets every step hold it, or --target-group-size {target} at {micro_batches} {unit} "
                             f"(groups of ~{target} samples where they hold 4.6)")


@pytest.mark.parametrize(("broken", "micro_batches", "hint"), [
    (["dist:audio"], 1, "so groups packing cannot make equal leave its steps uneven"),
    (["mix", "dist:audio"], 1, "so groups of like costs share steps, and their sources with them"),
    (["mix"], 1, "so groups of like costs share steps, and their sources with them"),
    (["dist:audio"], 2, None),  # two micro-batches pair groups already
    (["steps"], 1, None),  # more micro-batches do not lower the step count's bound
    (["dist:audio", "util:video"], 1, None),  # few or sparse steps (sample_data): pairing did not help
    # The searched pick broke the LLM's Dist and the mix, the caps kept the steps bound instead.
    (["steps", "picked:dist:llm,mix"], 1, ("so the searched caps' groups left the steps uneven or unmixed "
                                           "(dist:llm, mix)")),
    (["steps", "picked:util:audio"], 1, None),  # the pick's broken bound is no pairing's to fix
])
def test_a_missed_dist_or_mix_at_one_micro_batch_names_two(broken, micro_batches, hint):
    """At one micro-batch a rank's load is one group: a step's groups must be equal on every module,
    and where packing could not make them so the steps stay uneven (``sparse`` 1013, 70k at
    ``--dp 64``: audio Dist 0.0081) or unmixed; two micro-batches fixed both on the inputs measured
    (audio 0.0008), so the report names them for a missed Dist too, not only for a missed mix; not
    where a sparse module idles too (sample_data: its LLM Dist rose at two)."""
    from balancer_cli.report.markdown import contract_lines

    bounds = {"max_dist_ratio": 0.005, "max_step_mix_vs_random": 1.0, "min_sparse_utilization": 0.9,
              "max_steps_vs_lower_bound": 1.03}
    data = {"contract": {"bounds": bounds, "broken": broken}, "step_mix": {"vs_random": 1.4},
            "steps": {"vs_lower_bound": 1.04}, "manifest": {"micro_batches": micro_batches},
            "modules": {"audio": {"sparse": False, "group_share": 1.0, "dist_ratio": 0.0081},
                        "llm": {"sparse": False, "group_share": 1.0, "dist_ratio": 0.001}}}
    if "util:video" in broken:  # (a sparse module in the mix cases would be the sparse floor's hint)
        data["modules"]["video"] = {"sparse": True, "group_share": 0.13, "utilization": 0.65}
    picked = [bound for bound in broken if bound.startswith("picked:")]
    if picked:  # what the searched pick broke in full, where a later candidate's caps were kept
        data["contract"]["broken"] = [bound for bound in broken if bound not in picked]
        data["manifest"]["params"] = {"search": {"checked": {"pick_broken": picked[0][len("picked:"):].split(","),
                                                             "kept": {"llm": 14336}}}}
    lines = contract_lines(data)
    assert lines[0].startswith("bounds missed: ")
    if hint is None:
        assert lines[1:] == []
    else:
        expected = (f"  at one micro-batch a step's groups must be equal on every module, {hint}: "
                    "--micro-batches 2 lets each rank pair two unequal groups")
        assert lines[1:] == [expected]


@pytest.mark.parametrize(("searched", "given", "suffix"), [
    (True, None, ", or --target-group-size 15 gives each group twice the samples (7.5 now)"),
    (True, ["vision"], ""),  # a cap the user gave bounds the search's groups
    (False, None, ""),  # every cap given: they fix the group size
])
def test_a_missed_mix_at_one_micro_batch_names_twice_the_group_size_where_the_search_picks_the_caps(searched, given,
                                                                                                   suffix):
    """Groups of twice the samples even out at one micro-batch as a rank's two groups do (fresh
    misses: `harsh` 942, 12k at --dp 32, mix 2.04x -> 0.83x at twice the size, 0.50x at two micro-
    batches): named after the micro-batches where the search picks every cap."""
    from balancer_cli.report.markdown import contract_lines

    data = {"contract": {"bounds": {"max_step_mix_vs_random": 1.0}, "broken": ["mix"]}, "step_mix": {"vs_random": 2.04},
            "manifest": {"micro_batches": 1, "params": {"searched": searched, "search": {"given": given} if given else {}}},
            "groups": {"mean_size": 7.5}, "modules": {"llm": {"sparse": False, "group_share": 1.0}}}
    assert contract_lines(data)[1].endswith("--micro-batches 2 lets each rank pair two unequal groups" + suffix)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 40), world=st.integers(1, 16), steps=st.integers(1, 6),
       epochs=st.integers(1, 3))
def test_no_placement_passes_the_utilization_ceiling_and_one_step_an_epoch_reaches_it(seed, n, world, steps, epochs):
    """``utilization_ceiling`` bounds the utilization of every placement of the costs on R ranks
    (samples anywhere within their epoch's steps, several a rank), and samples no more than the
    ranks, one a rank in one step an epoch, reach it: it is the best any packer can do."""
    from balancer_cli.pack.evaluate import utilization_ceiling

    rng = np.random.default_rng(seed)
    cost = rng.integers(0, 5000, n).astype(np.float64) * (rng.random(n) < 0.7)
    ceiling = utilization_ceiling([cost] * epochs, world)
    step = np.concatenate([e * steps + rng.integers(0, steps, n) for e in range(epochs)])  # each epoch its steps
    anywhere = step_loads(step, rng.integers(0, world, n * epochs), np.tile(cost, epochs), num_steps=steps * epochs,
                          world_size=world)
    assert utilization(anywhere) <= ceiling + 1e-12
    if n <= world:
        ranks = np.concatenate([rng.permutation(world)[:n] for _ in range(epochs)])
        one_step = step_loads(np.repeat(np.arange(epochs), n), ranks, np.tile(cost, epochs), num_steps=epochs,
                              world_size=world)
        assert utilization(one_step) == pytest.approx(ceiling)


def test_a_sparse_module_under_its_ceiling_is_named_as_the_inputs_floor():
    """Five audio samples on eight ranks (``sparse`` 8007): no step holds audio on every rank, so
    its utilization cannot pass its ceiling (their load over 8 x the largest); the report data
    holds the ceiling where the bound is missed, and the hint says no placement reaches it."""
    from balancer_cli.report.markdown import contract_lines

    audio = np.array([1627, 2468, 578, 865, 649] + [0] * 35)
    lt = make_lengths_table(np.full(40, 3000) + audio, {"audio": (audio, (audio > 0).astype(np.int64))})
    inputs = prepare_inputs(lt)
    rows = ManifestRows(np.repeat(np.arange(5), 8), np.tile(np.arange(8), 5), np.zeros(40, int), np.arange(40))
    ev = evaluate_rows(inputs, rows, np.array([], np.int64), (), caps_K=np.array([3, 9000]), world_size=8,
                       micro_batches=1, epoch_num_steps=[5])
    audio_metrics = ev.metrics["modules"]["audio"]
    assert audio_metrics["sparse"] and audio_metrics["utilization"] == audio_metrics["utilization_ceiling"] == 0.313361
    assert "utilization_ceiling" not in ev.metrics["modules"]["llm"]  # dense: judged by its Dist
    data = {**ev.metrics, "manifest": {"micro_batches": 1, "world_size": 8}}
    lines = contract_lines(data)
    assert lines[0].startswith("bounds missed: audio utilization 0.313 < 0.9 (held by 12% of the groups)")
    assert lines[1] == ("  audio's load is 0.313 of 8 ranks x its largest sample's, whose step waits for it on every "
                        "rank: no placement keeps more than 0.313 of its rank-time busy on this input (0.313 here)")
    # Where a placement could reach the bound, the report says nothing more (and holds no ceiling).
    data["modules"] = {**data["modules"], "audio": {**audio_metrics, "utilization_ceiling": 0.95}}
    assert contract_lines(data)[1:] == []
    # A module in under 1% of the groups reads as such, not as 0%.
    data["modules"]["audio"]["group_share"] = 0.0011
    assert "(held by 0.11% of the groups)" in contract_lines(data)[0]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), world=st.integers(1, 6), micro=st.integers(1, 3), steps=st.integers(1, 8))
def test_the_dist_in_steps_with_groups_over_a_cap_and_in_the_others_add_up(seed, world, micro, steps):
    """``over_cap_dist`` splits a module's Dist between the steps holding a group over a cap and the
    others, adding up to the whole; it names the steps that hold one, the count of such groups and
    the one most over its cap, and explains a module only where the other steps are within the bound."""
    from balancer_cli.pack.contract import MAX_DIST_RATIO
    from balancer_cli.pack.evaluate import over_cap_dist

    rng = np.random.default_rng(seed)
    n = world * micro * steps * 3
    load = np.stack([rng.integers(0, 4, n), rng.integers(10, 100, n)], axis=1)
    load[rng.random(n) < 0.05, 1] *= 30  # some over the llm cap
    caps = np.array([6, 250])
    step, rank, micro_n = rng.integers(0, steps, n), rng.integers(0, world, n), rng.integers(0, micro, n)
    order = np.lexsort((micro_n, rank, step))
    rows = ManifestRows(step[order], rank[order], micro_n[order], order)
    loads = [step_loads(rows.step, rows.rank, load[order, k].astype(float), num_steps=steps, world_size=world)
             for k in range(2)]
    explained = over_cap_dist(load, load, rows, caps, loads, [0, 1])
    slot = (rows.step * world + rows.rank) * micro + rows.micro
    group_load = np.stack([np.bincount(slot, weights=load[order, k], minlength=steps * world * micro) for k in (0, 1)], 1)
    over_group = (group_load > caps).any(axis=1)
    over_steps = np.unique(np.flatnonzero(over_group) // (world * micro))
    for k in (0, 1):
        dist_S = np.nan_to_num([dist_ratio(loads[k][s:s + 1]) for s in range(steps)])
        rest = dist_S.sum() / steps - dist_S[over_steps].sum() / steps
        if k not in explained:
            assert not over_group.any() or rest > MAX_DIST_RATIO
            continue
        entry = explained[k]
        assert rest <= MAX_DIST_RATIO and entry["steps"] == len(over_steps) and entry["groups"] == over_group.sum()
        assert entry["dist"] == pytest.approx(dist_S[over_steps].sum() / steps, abs=1e-6)
        ratio = group_load[over_group] / caps
        assert entry["largest"]["load"] / caps[entry["largest"]["module"]] == pytest.approx(ratio.max())


def test_a_dist_missed_in_the_steps_of_samples_over_a_cap_names_them_and_not_the_micro_batches():
    """One sample of 20,000 tokens among 3,000 of 100-200 at a cap of 1,500 (a heavy tail's
    spike; fresh inputs with a dynamic-resolution vision source and long texts): alone in its
    group, its step cannot be even at one micro-batch or two, nor with larger groups. The report
    data splits the Dist and the hint names the samples and the fix, not the micro-batches."""
    from balancer_cli.report.markdown import contract_lines

    llm = np.random.default_rng(0).integers(100, 200, 3000)
    llm[7] = 20_000
    result = pack_manifest(make_lengths_table(llm), PackConfig(world_size=4, caps={"llm": 1500}))
    entry = result.evaluation.metrics["modules"]["llm"]["over_cap"]
    assert entry == {"dist": 0.009024, "steps": 1, "groups": 1, "largest": {"module": "llm", "load": 20_000, "cap": 1500}}
    assert result.evaluation.metrics["contract"]["broken"] == ["dist:llm"]
    lines = contract_lines({**result.evaluation.metrics, "manifest": result.meta})
    assert lines[1:] == [(
        "  llm Dist: 0.0090 of it is in the 1 step holding the 1 sample over a cap, each alone in a group larger than "
        "the caps let any other be (the largest of 20000 llm tokens, cap 1500): --oversize drop drops them (0.033% of "
        "the samples), the other steps' share 0.0000")]
    # As measured on the fresh inputs: dropped, every bound holds; two micro-batches do not help.
    dropped = pack_manifest(make_lengths_table(llm), PackConfig(world_size=4, caps={"llm": 1500}, oversize="drop"))
    assert dropped.evaluation.metrics["contract"]["broken"] == [] and dropped.dropped_sample.tolist() == [7]
    paired = pack_manifest(make_lengths_table(llm), PackConfig(world_size=4, micro_batches=2, caps={"llm": 1500}))
    assert "dist:llm" in paired.evaluation.metrics["contract"]["broken"]
    assert "over_cap" not in dropped.evaluation.metrics["modules"]["llm"]
