"""`balancer pack` and `balancer report` end to end through click, including bad input."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from balancer_cli.cli import main
from balancer_cli.lengths import make_lengths_table, write_lengths
from balancer_cli.manifest import open_manifest, read_dropped

CAPS = ["--max-llm-tokens", "3000", "--max-vision-items", "10"]


def _lengths_file(tmp_path, n=400, seed=0, name="lengths.parquet", audio=False):
    rng = np.random.default_rng(seed)
    items = rng.integers(0, 8, n)
    modules = {"vision": (items * 256, items)}
    llm = items * 256 + rng.integers(30, 500, n)
    if audio:  # sparse: one sample in ten has audio clips
        clips = np.where(rng.random(n) < 0.1, rng.integers(1, 3, n), 0)
        modules["audio"] = (clips * 750, clips)
        llm = llm + clips * 750
    error = [None] * n
    error[5] = "missing image a.jpg"
    path = tmp_path / name
    write_lengths(make_lengths_table(llm, modules, error=error, source=rng.choice(["x", "y"], n)), path)
    return path


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_pack_writes_manifest_report_and_prints_the_table(tmp_path):
    lengths = _lengths_file(tmp_path)
    result = _run("pack", lengths, "-o", tmp_path / "out", "--dp", 4, "--micro-batches", 2, *CAPS)
    assert result.exit_code == 0, result.output
    for name in ("manifest.parquet", "dropped.parquet", "report.json", "report.md", "report.png"):
        assert (tmp_path / "out" / name).is_file(), name
    assert "ours (balanced)" in result.output and "random" in result.output and "isf" in result.output
    manifest = open_manifest(tmp_path / "out")
    assert manifest.world_size == 4 and manifest.micro_batches == 2
    assert manifest.meta["lengths_files"] == [str(lengths.resolve())]
    samples, reasons = read_dropped(tmp_path / "out")
    assert samples.tolist() == [5] and reasons.tolist() == ["missing image a.jpg"]


def test_pack_is_byte_identical_for_same_inputs_and_seed(tmp_path):
    lengths = _lengths_file(tmp_path)
    outs = []
    for name in ("a", "b"):
        result = _run("pack", lengths, "-o", tmp_path / name, "--dp", 2, "--seed", 7, "--epochs", 2, *CAPS)
        assert result.exit_code == 0, result.output
        outs.append(tmp_path / name)
    for name in ("manifest.parquet", "dropped.parquet", "report.json"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    other = _run("pack", lengths, "-o", tmp_path / "c", "--dp", 2, "--seed", 8, "--epochs", 2, *CAPS)
    assert other.exit_code == 0
    assert (tmp_path / "c" / "manifest.parquet").read_bytes() != (outs[0] / "manifest.parquet").read_bytes()


def test_epochs_place_every_sample_once_per_epoch(tmp_path):
    lengths = _lengths_file(tmp_path, n=300)
    result = _run("pack", lengths, "-o", tmp_path / "out", "--dp", 3, "--epochs", 3, "--baselines", "none", *CAPS)
    assert result.exit_code == 0, result.output
    manifest = open_manifest(tmp_path / "out")
    rows = manifest.read_all()
    dropped, _ = read_dropped(tmp_path / "out")
    first = 0
    for steps in manifest.epoch_num_steps:
        epoch = manifest.read_steps(first, first + steps)
        assert sorted(epoch.sample.tolist() + dropped.tolist()) == list(range(300))
        first += steps
    assert first == manifest.num_steps == int(rows.step.max()) + 1


def test_pack_json_summary(tmp_path):
    result = _run("pack", _lengths_file(tmp_path), "-o", tmp_path / "out", "--dp", 2, "--json",
                  "--baselines", "random", *CAPS)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["manifest"]["params"]["caps"] == {"vision": 10, "llm": 3000}
    assert set(summary["baselines"]) == {"random"}
    assert summary["dropped"]["count"] == 1
    assert summary["files"]["json"].endswith("report.json")


def test_sparse_audio_module_end_to_end(tmp_path):
    lengths = _lengths_file(tmp_path, audio=True)
    result = _run("pack", lengths, "-o", tmp_path / "out", "--dp", 2, "--max-audio-items", 3, *CAPS, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["manifest"]["modules"] == ["vision", "audio", "llm"]
    assert summary["modules"]["audio"]["utilization"] > 0
    assert summary["manifest"]["params"]["caps"]["audio"] == 3
    assert summary["groups"]["over_cap_multi_sample"] == 0  # only isolated oversize samples exceed caps


@pytest.mark.parametrize("windows", [[], ["--window-samples", 300, "--epochs", 2]])
def test_report_command_recomputes_the_same_report(tmp_path, windows):
    """``balancer report`` plans the baselines' windows itself; ``pack`` hands over its own plan (a
    sample with a scan error among them): the same bytes either way."""
    lengths = _lengths_file(tmp_path, n=1200 if windows else 400)
    assert _run("pack", lengths, "-o", tmp_path / "out", "--dp", 2, *windows, *CAPS).exit_code == 0
    if windows:
        assert open_manifest(tmp_path / "out").meta["params"]["windows"] == 4
    written = (tmp_path / "out" / "report.json").read_bytes()
    (tmp_path / "out" / "report.json").unlink()
    result = _run("report", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "report.json").read_bytes() == written
    explicit = _run("report", tmp_path / "out", "--lengths", lengths, "--json")
    assert json.loads(explicit.output)["steps"] == json.loads(written)["steps"]


def test_report_command_fails_clearly_on_other_or_missing_lengths(tmp_path):
    lengths = _lengths_file(tmp_path)
    assert _run("pack", lengths, "-o", tmp_path / "out", "--dp", 2, *CAPS).exit_code == 0
    other = _lengths_file(tmp_path, seed=1, name="other.parquet")
    result = _run("report", tmp_path / "out", "--lengths", other)
    assert result.exit_code == 1
    assert "is not the one" in result.output and "fix: pass the same lengths files" in result.output
    lengths.unlink()
    result = _run("report", tmp_path / "out")
    assert result.exit_code == 1 and "no longer exists" in result.output and "--lengths" in result.output
    result = _run("report", tmp_path / "nothing")
    assert result.exit_code == 1 and "no manifest.parquet" in result.output


def _bad_parquet(tmp_path, table):
    path = tmp_path / "bad.parquet"
    pq.write_table(table, path)
    return path


@pytest.mark.parametrize("table, code, message", [
    (pa.table({"llm_tokens": pa.array([10, 20]), "audio_tokens": pa.array([1, 2])}), 1,
     "bad.parquet: unknown column 'audio_tokens' (an encoder 'audio' needs both audio_tokens and audio_items)"),
    (pa.table({"llm_tokens": pa.array([10, -20])}), 1, "negative 'llm_tokens' = -20"),
    (pa.table({"llm_tokens": pa.array([10, 3_000_000_000, 20])}), 1,
     "sample 1 has 'llm_tokens' = 3000000000, past int32 (2147483647)"),
    (pa.table({"llm_tokens": pa.array([10, None])}), 1, "sample 1 has no value in 'llm_tokens'"),
    (pa.table({"llm_tokens": pa.array([], pa.int32())}), 1, "the lengths table is empty"),
    (pa.table({"tokens": pa.array([1])}), 1, "column 'llm_tokens' is missing"),
    (pa.Table.from_arrays([pa.array([1]), pa.array([2])], names=["llm_tokens", "llm_tokens"]), 1,
     "bad.parquet: column 'llm_tokens' appears 2 times"),
    (pa.table({"llm_tokens": pa.array([1])}).replace_schema_metadata({b"balancer": b"{cut"}), 1,
     "bad.parquet: its 'balancer' metadata is not a JSON object"),
    (pa.table({"llm_tokens": pa.array([1])}).replace_schema_metadata({b"balancer": b"[1]"}), 1,
     "bad.parquet: its 'balancer' metadata is not a JSON object ([1])"),
])
def test_bad_lengths_exit_with_one_line_and_fix(tmp_path, table, code, message):
    result = _run("pack", _bad_parquet(tmp_path, table), "-o", tmp_path / "out", "--max-llm-tokens", 100)
    assert result.exit_code == code, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0] and "fix:" in lines[0]
    assert not (tmp_path / "out" / "manifest.parquet").exists()


@pytest.mark.parametrize("args, message", [
    (["--max-llm-tokens", "10", "--max-vision-items", "10"],
     "--max-llm-tokens 10 is smaller than every sample (smallest: 30 tokens); "
     "fix: raise --max-llm-tokens to at least 30"),
    (["--dp", "5000", *CAPS], "--dp 5000 x --micro-batches 1 needs 5000 groups per step, but the samples form only"),
    (["--max-llm-tokens", "40", "--oversize", "drop", "--dp", "8"], "--max-llm-tokens 40 leaves"),
    (["--max-llm-tokens", "40", "--dp", "64"], "are isolated in groups of their own (--oversize isolate)"),
    (["--cap", "vision", *CAPS], "--cap 'vision' is not MODULE=INTEGER"),
    (["--cap", "audio=3", *CAPS], "--max-audio-items names an unknown module 'audio'"),
    (["--baselines", "greedy", *CAPS], "unknown baseline 'greedy'"),
])
def test_bad_options_exit_2_with_the_fix(tmp_path, args, message):
    result = _run("pack", _lengths_file(tmp_path), "-o", tmp_path / "out", *args)
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and message in result.output and "fix:" in result.output


def test_post_balance_adds_phase_rank_columns(tmp_path):
    pytest.importorskip("balancer_cli.replay.post_balance", reason="post-balancing module not in this build")
    lengths = _lengths_file(tmp_path)
    result = _run("pack", lengths, "-o", tmp_path / "out", "--dp", 4, "--post-balance", "--baselines", "none",
                  "--json", *CAPS)
    assert result.exit_code == 0, result.output
    rows = open_manifest(tmp_path / "out").read_all()
    assert set(rows.extra) == {"vision_rank"}
    assert rows.extra["vision_rank"].min() >= 0 and rows.extra["vision_rank"].max() < 4
    summary = json.loads(result.output)
    post = summary["post_balance"]
    assert post["modules"]["vision"]["utilization"] >= summary["modules"]["vision"]["utilization"] - 1e-9


def test_internvl_lengths_end_to_end(internvl_lengths, tmp_path):
    pytest.importorskip("balancer_cli.pack.search", reason="threshold search not merged yet")
    result = _run("pack", *internvl_lengths, "--dp", 8, "-o", tmp_path / "out", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["manifest"]["num_samples"] == 70_706 and summary["manifest"]["params"]["searched"]
    assert "tail_raised" not in summary["manifest"]["params"]["search"]  # no sample far past the rest
    rows = open_manifest(tmp_path / "out").read_all()
    dropped, _ = read_dropped(tmp_path / "out")
    assert len(rows) + len(dropped) == 70_706
    ours, isf = summary["modules"], summary["baselines"]["isf"]["modules"]
    assert ours["vision"]["dist_ratio"] < isf["vision"]["dist_ratio"]
    assert ours["llm"]["dist_ratio"] < isf["llm"]["dist_ratio"]


def test_unwritable_output_is_a_one_line_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = _run("pack", _lengths_file(tmp_path), "-o", blocker / "out", "--baselines", "none", *CAPS)
    assert result.exit_code == 1, result.output
    # Refused before any work (the folder checked first), one line naming the file in the way.
    assert result.output.startswith(f"Error: cannot write {blocker / 'out'}: {blocker} is a file, not a folder")
    assert "fix: name an output path under a folder" in result.output and result.output.count("\n") == 1


def test_flops_cost_model_is_recorded_and_replayed_by_report(tmp_path):
    lengths = _lengths_file(tmp_path)
    args = ["--cost-model", "flops", "--vision-model", "internvit-300m", "--llm-model", "qwen2-7b"]
    result = _run("pack", lengths, "-o", tmp_path / "out", "--dp", 2, "--baselines", "dataloader", *args, *CAPS)
    assert result.exit_code == 0, result.output
    params = open_manifest(tmp_path / "out").meta["params"]
    assert params["cost_model"] == "flops"
    assert params["cost_presets"] == {"llm": "qwen2-7b", "vision": "internvit-300m"}
    written = (tmp_path / "out" / "report.json").read_bytes()
    assert _run("report", tmp_path / "out").exit_code == 0
    assert (tmp_path / "out" / "report.json").read_bytes() == written
    assert "cost model flops (llm: qwen2-7b, vision: internvit-300m)" in (tmp_path / "out" / "report.md").read_text()


def test_flops_without_llm_model_is_a_usage_error(tmp_path):
    result = _run("pack", _lengths_file(tmp_path), "-o", tmp_path / "out", "--cost-model", "flops", *CAPS)
    assert result.exit_code == 2 and "needs an LLM preset" in result.output and "--llm-model" in result.output


@pytest.mark.parametrize("window, raised", [(1, True), (150, False)])
def test_pack_prints_its_windows_and_when_they_merged(tmp_path, window, raised):
    """A windowed run names its windows; windows asked under the minimum say so, with the fix."""
    lengths = _lengths_file(tmp_path, n=600)
    result = _run("pack", lengths, "-o", tmp_path / "out", "--dp", 4, "--window-samples", window,
                  "--baselines", "none", *CAPS)
    assert result.exit_code == 0, result.output
    params = open_manifest(tmp_path / "out").meta["params"]
    assert params["windows"] > 1 and f"{params['windows']} windows) ->" in result.output
    assert (params["window_samples"] < params["min_window_samples"]) == raised
    assert ("raise --window-samples or --memory-gb" in result.output) == raised
    again = _run("report", tmp_path / "out", "--baselines", "none")
    assert again.exit_code == 0 and result.output.splitlines()[2] == again.output.splitlines()[2]


def test_pack_names_the_bounds_ours_misses_and_why(tmp_path):
    """A speech source (10% of the samples, 2 clips each: fewer of them than groups)
    at one micro-batch: steps hold audio on every rank or none, so the mix bound is missed; the
    CLI, report.json and report.md say so, and with two micro-batches it is met and nothing is said."""
    rng = np.random.default_rng(0)
    n = 4000
    speech = rng.random(n) < 0.1
    clips = np.where(speech, 2, 0)
    audio = clips * rng.integers(200, 600, n)
    path = tmp_path / "speech.parquet"
    write_lengths(make_lengths_table(rng.integers(50, 600, n) + audio, {"audio": (audio, clips)},
                                     source=np.where(speech, "speech", "text")), path)
    one = _run("pack", path, "-o", tmp_path / "one", "--dp", 8, "--baselines", "none")
    assert one.exit_code == 0, one.output
    report = json.loads((tmp_path / "one" / "report.json").read_text())
    assert report["modules"]["audio"]["sparse"] and not report["modules"]["llm"]["sparse"]
    assert "mix" in report["contract"]["broken"] and report["contract"]["bounds"]["max_step_mix_vs_random"] == 1.0
    line = next(x for x in one.output.splitlines() if x.startswith("bounds missed: "))
    assert f"step mix {report['step_mix']['vs_random']:.2f}x random batching > 1.0x" in line
    # The hint says how many of the steps can hold audio and how many micro-batches let every step.
    share = report["modules"]["audio"]["group_share"]
    hint = next(x for x in one.output.splitlines() if x.startswith("  audio is in "))
    assert f"at 1 micro-batch at most {share:.0%} of the steps hold it" in hint
    assert f"--micro-batches {math.ceil(1 / share)} or more lets every step hold it" in hint
    assert math.ceil(1 / share) == 2  # audio in over half of the groups: two micro-batches mix the steps (below)
    # ... or, at one micro-batch, larger groups: as many of them hold audio, a larger share
    size = report["groups"]["mean_size"]
    target = math.ceil(size / share)
    assert hint.endswith(f", or --target-group-size {target} at 1 micro-batch (groups of ~{target} samples where "
                         f"they hold {size:.1f})")
    markdown = (tmp_path / "one" / "report.md").read_text()
    assert line in markdown and hint in markdown
    two = _run("pack", path, "-o", tmp_path / "two", "--dp", 8, "--micro-batches", 2, "--baselines", "none")
    assert two.exit_code == 0, two.output
    assert json.loads((tmp_path / "two" / "report.json").read_text())["contract"]["broken"] == []
    assert "bounds missed" not in two.output and "bounds missed" not in (tmp_path / "two" / "report.md").read_text()
    # The group size the hint names lifts the mix's floor at one micro-batch (its 48 steps then
    # miss the audio Dist: one speech sample a group, unequal clips, no second group to pair).
    larger = _run("pack", path, "-o", tmp_path / "larger", "--dp", 8, "--target-group-size", target,
                  "--baselines", "none")
    assert larger.exit_code == 0, larger.output
    report = json.loads((tmp_path / "larger" / "report.json").read_text())
    assert report["modules"]["audio"]["group_share"] > 0.9 and report["step_mix"]["vs_random"] <= 1.0
    assert "mix" not in report["contract"]["broken"]
    # A cap the user gave bounds the search's groups: the hint names the micro-batches only.
    llm_cap = json.loads((tmp_path / "one" / "report.json").read_text())["manifest"]["params"]["caps"]["llm"]
    capped = _run("pack", path, "-o", tmp_path / "capped", "--dp", 8, "--max-llm-tokens", llm_cap, "--baselines", "none")
    assert capped.exit_code == 0, capped.output
    report = json.loads((tmp_path / "capped" / "report.json").read_text())
    assert report["manifest"]["params"]["search"]["given"] == ["llm"]
    hint = next(x for x in capped.output.splitlines() if x.startswith("  audio is in "))
    assert hint.endswith("or more lets every step hold it")


def test_pack_says_when_the_longest_samples_raised_the_caps(tmp_path):
    """Five lengths read as 10M tokens among 3,000 of 30-300: the searched cap follows them (no
    sample oversize), so every group holds thousands of samples; the CLI and report.md say so and
    name the option that caps them; with it, those five get groups of their own."""
    rng = np.random.default_rng(0)
    llm = np.concatenate([rng.integers(30, 300, 3000), np.full(5, 10_000_000)])
    path = tmp_path / "outliers.parquet"
    write_lengths(make_lengths_table(llm, {}, source=rng.choice(["x", "y"], len(llm))), path)
    raised = _run("pack", path, "-o", tmp_path / "raised", "--dp", 8, "--baselines", "none")
    assert raised.exit_code == 0, raised.output
    params = open_manifest(tmp_path / "raised").meta["params"]
    typical = params["search"]["tail_raised"]["llm"]
    assert params["caps"]["llm"] >= 10_000_000 and 300 <= typical <= 2048
    line = next(x for x in raised.output.splitlines() if x.startswith("caps follow the longest 0.1%"))
    assert f"cap them with --max-llm-tokens {typical}:" in line
    assert f"- {line}" in (tmp_path / "raised" / "report.md").read_text()
    capped = _run("pack", path, "-o", tmp_path / "capped", "--dp", 8, "--baselines", "none", "--max-llm-tokens", typical)
    assert capped.exit_code == 0 and "caps follow" not in capped.output
    before, after = (json.loads((tmp_path / out / "report.json").read_text()) for out in ("raised", "capped"))
    assert after["groups"]["over_cap"] == 5 and after["steps"]["total"] >= 10 * before["steps"]["total"]


def test_pack_says_where_no_placement_reaches_a_sparse_modules_utilization(tmp_path):
    """Three audio samples among 3,000 at --dp 8: a step holding audio idles at least five ranks on
    it, so its utilization bound is out of reach; the CLI and report.md say so with the ceiling,
    which report.json holds, and the packer reaches it (all three in one step, one a rank)."""
    rng = np.random.default_rng(0)
    audio = np.zeros(3000, np.int64)
    audio[[10, 1500, 2999]] = [900, 700, 500]
    path = tmp_path / "rare.parquet"
    write_lengths(make_lengths_table(rng.integers(50, 600, 3000) + audio, {"audio": (audio, (audio > 0) * 1)}), path)
    result = _run("pack", path, "-o", tmp_path / "out", "--dp", 8, "--baselines", "none")
    assert result.exit_code == 0, result.output
    audio_metrics = json.loads((tmp_path / "out" / "report.json").read_text())["modules"]["audio"]
    assert audio_metrics["utilization_ceiling"] == round(2100 / (8 * 900), 6) == audio_metrics["utilization"]
    hint = next(x for x in result.output.splitlines() if x.startswith("  audio's load is "))
    assert hint.endswith("no placement keeps more than 0.292 of its rank-time busy on this input (0.292 here)")
    assert hint in (tmp_path / "out" / "report.md").read_text()
    # Each epoch's steps hold its own three: the ceiling stays theirs, and the packer reaches it again.
    result = _run("pack", path, "-o", tmp_path / "two", "--dp", 8, "--epochs", 2, "--baselines", "none")
    assert result.exit_code == 0, result.output
    audio_metrics = json.loads((tmp_path / "two" / "report.json").read_text())["modules"]["audio"]
    assert audio_metrics["utilization_ceiling"] == round(2100 / (8 * 900), 6) == audio_metrics["utilization"]


def test_pack_names_the_samples_over_a_cap_where_their_steps_alone_miss_the_dist_bound(tmp_path):
    """One text of 20,000 tokens among 3,000 of 100-200 at --max-llm-tokens 1500: its step misses
    the Dist bound; the CLI and report.md name the sample and --oversize drop (with which every
    bound holds), not the micro-batches."""
    llm = np.random.default_rng(0).integers(100, 200, 3000)
    llm[7] = 20_000
    path = tmp_path / "spike.parquet"
    write_lengths(make_lengths_table(llm), path)
    result = _run("pack", path, "-o", tmp_path / "out", "--dp", 4, "--max-llm-tokens", 1500, "--baselines", "none")
    assert result.exit_code == 0, result.output
    hint = next(x for x in result.output.splitlines() if x.startswith("  llm Dist: "))
    assert "the 1 sample over a cap" in hint and "--oversize drop drops them (0.033% of the samples)" in hint
    assert "--micro-batches 2" not in result.output and hint in (tmp_path / "out" / "report.md").read_text()
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["modules"]["llm"]["over_cap"]["largest"] == {"module": "llm", "load": 20000, "cap": 1500}
    result = _run("pack", path, "-o", tmp_path / "drop", "--dp", 4, "--max-llm-tokens", 1500, "--oversize", "drop",
                  "--baselines", "none")
    assert result.exit_code == 0 and "bounds missed" not in result.output, result.output


def test_samples_of_a_billion_tokens_pack_under_the_largest_cap_a_manifest_holds(tmp_path):
    """Lengths near int32's top (valid in a lengths table): the search's limit for a cap, 8x the
    90th percentile, would be 8e9; it stays at the largest cap a manifest holds (int32), so the
    written manifest passes its own check (it failed with caps[llm] 5972362758 before)."""
    path = tmp_path / "huge.parquet"
    write_lengths(make_lengths_table(np.full(50, 10**9), {"vision": (np.full(50, 10**9), np.full(50, 10**6))}), path)
    result = _run("pack", path, "-o", tmp_path / "out", "--dp", 4, "--baselines", "random")
    assert result.exit_code == 0, result.output
    caps = json.loads((tmp_path / "out" / "report.json").read_text())["manifest"]["params"]["caps"]
    assert caps["llm"] == 2**31 - 1 and caps["vision"] <= 2**31 - 1
    assert sorted(open_manifest(tmp_path / "out").read_all().sample.tolist()) == list(range(50))
