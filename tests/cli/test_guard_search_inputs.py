"""search / pack / calibrate refuse options past their range, and tables with nothing measured, in one line."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from cli_util import invoke as _invoke
from cli_util import one_error as _one_error

from balancer_cli.cost.calibration import MAX_GROUP_ITEMS, MAX_GROUP_TOKENS, GridSpec
from balancer_cli.errors import UsageError
from balancer_cli.lengths import make_lengths_table, write_lengths
from balancer_cli.pack.config import MAX_CAP, MAX_TARGET_GROUP_SIZE, PackConfig

HUGE = "99999999999999999999"


def _lengths(tmp_path, n=300, error_every_row=False):
    rng = np.random.default_rng(0)
    items = rng.integers(0, 6, n)
    clips = np.where(rng.random(n) < 0.2, 1, 0)
    modules = {"vision": (items * 256, items), "audio": (clips * 750, clips)}
    error = ["unreadable image"] * n if error_every_row else None
    path = tmp_path / "lengths.parquet"
    write_lengths(make_lengths_table(items * 256 + clips * 750 + rng.integers(30, 500, n), modules, error=error), path)
    return path


# -- 3. caps and grid past any integer type ---------------------------------------------------

@pytest.mark.parametrize("command", ["search", "pack"])
@pytest.mark.parametrize("option, flag", [(["--max-llm-tokens", HUGE], "--max-llm-tokens"),
                                          (["--max-vision-items", HUGE], "--max-vision-items"),
                                          (["--max-audio-items", HUGE], "--max-audio-items"),
                                          (["--cap", f"llm={HUGE}"], "--max-llm-tokens"),
                                          (["--max-llm-tokens", str(MAX_CAP + 1)], "--max-llm-tokens")])
def test_a_cap_past_its_range_is_a_usage_error(tmp_path, command, option, flag):
    out = ["-o", tmp_path / "out"] if command == "pack" else []
    line = _one_error(_invoke([command, _lengths(tmp_path), *out, *option, "--quiet"]), 2)
    assert line.startswith(f"Error: {flag} ") and f"must be a positive integer up to {MAX_CAP}" in line


def test_the_largest_cap_still_packs(tmp_path):
    result = _invoke(["search", _lengths(tmp_path), "--max-llm-tokens", MAX_CAP, "--quiet", "--top", "1"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("grid", [HUGE, "65"])
def test_a_grid_past_its_range_is_a_usage_error(tmp_path, grid):
    line = _one_error(_invoke(["search", _lengths(tmp_path), "--grid", grid, "--quiet"]), 2)
    assert line.startswith(f"Error: --grid must be an integer in 2..64, not {grid}")


def test_the_library_search_refuses_the_same_grid():
    from balancer_cli.pack.search import MAX_GRID, search_thresholds

    load = np.stack([np.ones(50, np.int64), np.full(50, 100)], 1)
    with pytest.raises(UsageError, match=f"grid must be in 1..{MAX_GRID}"):
        search_thresholds(load, load.astype(float), world_size=1, micro_batches=1, max_caps_K=np.array([4, 800]),
                          grid=MAX_GRID + 1)


def test_caps_and_bounds_are_bounded_in_python_too():
    with pytest.raises(UsageError, match=r"caps\[llm\] 2147483648 must be a positive integer up to"):
        PackConfig(caps={"llm": MAX_CAP + 1})
    with pytest.raises(UsageError, match=r"bounds\[llm\]"):
        PackConfig(bounds={"llm": 10**20})
    assert PackConfig(caps={"llm": MAX_CAP}).caps == (("llm", MAX_CAP),)


# -- 4. a target group size that overflows the caps ---------------------------------------------

@pytest.mark.parametrize("command, value", [("search", "1e30"), ("search", "1000001"), ("pack", HUGE)])
def test_a_target_group_size_past_its_range_is_a_usage_error(tmp_path, command, value):
    out = ["-o", tmp_path / "out"] if command == "pack" else []
    line = _one_error(_invoke([command, _lengths(tmp_path), *out, "--target-group-size", value, "--quiet"]), 2)
    assert line.startswith("Error: --target-group-size must be a number >= 1 and <= 1000000")


def test_the_largest_target_group_size_searches_without_a_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        result = _invoke(["search", _lengths(tmp_path), "--target-group-size", MAX_TARGET_GROUP_SIZE, "--quiet"])
    assert result.exit_code == 0 and "Warning" not in result.output, result.output


# -- 5. a table where every row has an error ----------------------------------------------------

def test_pack_of_a_table_without_measured_samples_is_one_line(tmp_path):
    line = _one_error(_invoke(["pack", _lengths(tmp_path, error_every_row=True), "-o", tmp_path / "out", "--quiet"]), 1)
    assert "all 300 samples have a scan error (first: unreadable image)" in line


def test_search_of_a_table_without_measured_samples_is_one_line(tmp_path):
    """The search took percentiles of no rows (an IndexError, reported as an internal error)."""
    line = _one_error(_invoke(["search", _lengths(tmp_path, error_every_row=True), "--quiet"]), 1)
    assert "all 300 samples have a scan error (first: unreadable image)" in line


# -- 6. calibrate: group limits and modules ----------------------------------------------------

@pytest.fixture()
def model_dir(tmp_path):
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, '
        '"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000}')
    return folder


@pytest.mark.parametrize("option, most", [(["--max-llm-tokens", HUGE], MAX_GROUP_TOKENS),
                                          (["--max-llm-tokens", str(MAX_GROUP_TOKENS + 1)], MAX_GROUP_TOKENS),
                                          (["--max-vision-items", str(MAX_GROUP_ITEMS + 1)], MAX_GROUP_ITEMS)])
def test_calibrate_group_limits_are_bounded(tmp_path, model_dir, option, most):
    line = _one_error(_invoke(["calibrate", model_dir, "--lengths", _lengths(tmp_path), *option,
                               "-o", tmp_path / "costs.json", "--quiet"]), 2)
    assert line.startswith(f"Error: {option[0]} must be an integer in 1..{most}, not {option[1]}")
    assert not (tmp_path / "costs.json").exists()


@pytest.mark.parametrize("modules", ["", " , "])
def test_calibrate_modules_naming_nothing_is_a_usage_error(tmp_path, model_dir, modules):
    line = _one_error(_invoke(["calibrate", model_dir, "--lengths", _lengths(tmp_path), "--modules", modules,
                               "-o", tmp_path / "costs.json", "--quiet"]), 2)
    assert line.startswith(f"Error: --modules {modules!r} names no module")


def test_the_calibration_grid_is_bounded_in_python_too():
    with pytest.raises(UsageError, match="max_total must be in 1..1048576"):
        GridSpec(max_total=MAX_GROUP_TOKENS + 1)
    with pytest.raises(UsageError, match="max_count must be in 1..4096"):
        GridSpec(max_count=10**20)
    assert GridSpec(max_total=MAX_GROUP_TOKENS, max_count=MAX_GROUP_ITEMS).max_total == MAX_GROUP_TOKENS
