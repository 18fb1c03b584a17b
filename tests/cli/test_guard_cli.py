"""The CLI's last line of defence: no traceback from any command, bounded options, NaN refused."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from balancer_cli.cli import DEBUG_ENV, main

GOOD = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}


def _invoke(args, env=None):
    return CliRunner().invoke(main, args, catch_exceptions=False, env=env or {DEBUG_ENV: ""})


@pytest.fixture()
def data(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")
    return path


def test_an_unexpected_exception_is_one_line_and_exit_1(monkeypatch, data, tmp_path):
    import balancer_cli.run

    def boom(*args, **kwargs):
        raise ValueError("boom \x00 bytes")

    monkeypatch.setattr(balancer_cli.run, "scan_to_file", boom)
    result = _invoke(["scan", str(data), "-o", str(tmp_path / "l.parquet"), "--model", "qwen2-vl"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output
    assert lines[0].startswith("Error: internal error in `balancer scan` (ValueError: boom \\x00 bytes)")
    assert "please report" in lines[0] and f"{DEBUG_ENV}=1" in lines[0]


def test_the_traceback_is_printed_only_with_the_debug_variable(monkeypatch, data, tmp_path):
    import balancer_cli.run

    monkeypatch.setattr(balancer_cli.run, "scan_to_file", lambda *a, **k: {}["missing"])
    result = _invoke(["scan", str(data), "-o", str(tmp_path / "l.parquet"), "--model", "qwen2-vl"],
                     env={DEBUG_ENV: "1"})
    assert result.exit_code == 1
    assert "Traceback (most recent call last)" in result.output and "KeyError" in result.output
    assert result.output.strip().splitlines()[-1].startswith("Error: internal error in `balancer scan` (KeyError")


def test_usage_errors_and_help_still_pass_through():
    assert _invoke(["--help"]).exit_code == 0
    assert _invoke(["no-such-command"]).exit_code == 2
    assert _invoke(["scan", "--help"]).exit_code == 0


def test_max_tiles_out_of_bounds_is_a_usage_error_not_a_hang(data, tmp_path):
    result = _invoke(["scan", str(data), "-o", str(tmp_path / "l.parquet"), "--model", "internvl",
                      "--max-tiles", "1000000", "-j", "1"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        "Error: rule parameter max_tiles=1,000,000 is above 1,024; fix: give max_tiles of at most 1,024"]


def test_a_scan_of_hostile_records_exits_0_with_every_row(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([json.dumps(GOOD), "[" * 100_000, '{"text": "\\ud800"}',
                               json.dumps({"video": "v.mp4", "num_frames": 1e9, "conversations": [
                                   {"from": "human", "value": "<video>"}]}), json.dumps(GOOD)]) + "\n")
    out = tmp_path / "l.parquet"
    result = _invoke(["scan", str(path), "-o", str(out), "--model", "qwen2-vl", "-j", "1", "--json"])
    assert result.exit_code == 0, result.output
    from balancer_cli.lengths import read_lengths

    errors = read_lengths(out).errors().tolist()
    assert [e is None for e in errors] == [True, False, False, False, True]


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_plan_recompute_refuses_a_non_finite_memory(value):
    result = _invoke(["plan-recompute", "--gpu-memory-gb", value, "--llm", "qwen2-7b"])
    assert result.exit_code == 2
    assert "is not a finite number" in result.output and "Traceback" not in result.output
