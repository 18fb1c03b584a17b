"""`balancer search` end to end, and `pack` running the search itself."""

from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner

from balancer_cli.cli import main
from balancer_cli.lengths import make_lengths_table, write_lengths
from balancer_cli.manifest import open_manifest


def _lengths_file(tmp_path, n=1500, seed=0):
    rng = np.random.default_rng(seed)
    items = rng.integers(1, 7, n)
    path = tmp_path / "lengths.parquet"
    write_lengths(make_lengths_table(items * 256 + rng.integers(30, 400, n), {"vision": (items * 256, items)}), path)
    return path


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_search_prints_ranked_table_and_writes_json_and_heat_map(tmp_path):
    result = _run("search", _lengths_file(tmp_path), "--dp", 4, "--grid", 3, "--sample-size", 1000,
                  "--max-llm-tokens", 6000, "-o", tmp_path / "search.json", "--plot", tmp_path / "search.png")
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "search.json").read_text())
    objectives = [c["objective"] for c in data["candidates"]]
    assert objectives == sorted(objectives) and len(objectives) == 9
    assert data["best"]["caps"] == data["candidates"][0]["caps"]
    assert all(c["caps"]["llm"] <= 6000 for c in data["candidates"])  # given caps are limits
    assert len(data["grid"]["axes"]["vision"]) * len(data["grid"]["axes"]["llm"]) == 9
    assert (tmp_path / "search.png").read_bytes()[:4] == b"\x89PNG"
    assert "cap vision" in result.output and "best caps: " in result.output
    best = data["best"]["caps"]
    assert f"--max-vision-items {best['vision']} --max-llm-tokens {best['llm']}" in result.output


def test_search_json_summary_is_one_object(tmp_path):
    result = _run("search", _lengths_file(tmp_path), "--dp", 2, "--grid", 2, "--sample-size", 500, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["world_size"] == 2 and summary["num_samples"] == 1500 and summary["files"] == {}


def test_pack_runs_the_search_when_caps_are_missing(tmp_path):
    lengths = _lengths_file(tmp_path)
    result = _run("pack", lengths, "--dp", 4, "-o", tmp_path / "out", "--max-llm-tokens", 6000,
                  "--baselines", "none", "--json")
    assert result.exit_code == 0, result.output
    params = open_manifest(tmp_path / "out").meta["params"]
    assert params["searched"] is True and params["caps"]["llm"] <= 6000
    assert json.loads(result.output)["manifest"]["params"]["caps"] == params["caps"]


def test_text_only_lengths_pack_and_search(tmp_path):
    path = tmp_path / "text.parquet"
    write_lengths(make_lengths_table(np.random.default_rng(1).integers(20, 3000, 800)), path)
    result = _run("search", path, "--dp", 2, "--grid", 3, "--sample-size", 800, "--plot", tmp_path / "s.png", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["modules"] == ["llm"] and (tmp_path / "s.png").is_file()
    result = _run("pack", path, "--dp", 2, "-o", tmp_path / "out", "--baselines", "dataloader", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["modules"]["llm"]["dist_ratio"] < summary["baselines"]["dataloader"]["modules"]["llm"]["dist_ratio"]


def test_search_says_when_the_longest_samples_raised_its_best_caps(tmp_path):
    """Five lengths read as 10M tokens: the best cap follows them; the table says so, and the JSON."""
    rng = np.random.default_rng(0)
    path = tmp_path / "outliers.parquet"
    write_lengths(make_lengths_table(np.concatenate([rng.integers(30, 300, 2000), np.full(5, 10_000_000)]), {}), path)
    result = _run("search", path, "--dp", 8, "--grid", 3, "--json")
    assert result.exit_code == 0, result.output
    best = json.loads(result.output)["best"]
    assert best["caps"]["llm"] >= 6_000_000 and 300 <= best["tail_raised"]["llm"] <= 2048
    text = _run("search", path, "--dp", 8, "--grid", 3)
    assert f"cap them with --max-llm-tokens {best['tail_raised']['llm']}:" in text.output
    plain = _run("search", _lengths_file(tmp_path), "--dp", 4, "--grid", 3, "--json")
    assert "tail_raised" not in json.loads(plain.output)["best"]
