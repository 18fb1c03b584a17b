"""Outputs never replace an input, a special file, or a folder balancer did not write."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from balancer_cli._fsutil import PARTS_MARKER, claim_parts_dir, remove_parts_dir
from balancer_cli.cli import main
from balancer_cli.commit import COMMIT_FILE, read_commit
from balancer_cli.errors import InputError
from balancer_cli.lengths import make_lengths_table, write_lengths

ROOT = Path(__file__).resolve().parents[2]
CAPS = ["--max-llm-tokens", "3000", "--max-vision-items", "10", "--baselines", "none"]
PACKED = {"manifest.parquet", "dropped.parquet", "report.json", "report.md", "report.png", COMMIT_FILE}


def _lengths(path: Path, n: int = 200, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    items = rng.integers(0, 6, n)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_lengths(make_lengths_table(items * 256 + rng.integers(30, 400, n), {"vision": (items * 256, items)}), path)
    return path


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _refused(result, *needles):
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1, result.output
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "; fix: " in lines[0], result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_pack_output_folder_is_committed_with_every_file_and_no_temp_left(tmp_path):
    lengths = _lengths(tmp_path / "in" / "lengths.parquet")
    result = _run("pack", lengths, "--dp", 2, "-o", tmp_path / "out", *CAPS, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["out"] == str(tmp_path / "out")
    assert {Path(p).parent for p in summary["files"].values()} == {tmp_path / "out"}
    assert {p.name for p in (tmp_path / "out").iterdir()} == PACKED
    record = read_commit(tmp_path / "out")
    assert set(record["files"]) == PACKED - {COMMIT_FILE} and record["tool_version"]
    for name, entry in record["files"].items():
        assert entry["size"] == (tmp_path / "out" / name).stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]  # no .out.tmp-* left


def test_output_that_is_or_holds_an_input_is_refused_and_the_input_kept(tmp_path):
    lengths = _lengths(tmp_path / "lengths.parquet")
    before = lengths.read_bytes()
    os.link(lengths, tmp_path / "hard.parquet")
    (tmp_path / "soft.parquet").symlink_to(lengths)
    _refused(_run("search", lengths, "--dp", 2, "-o", lengths, "--grid", 2, "--sample-size", 100),
             "is also an input")
    _refused(_run("search", lengths, "--dp", 2, "--plot", tmp_path / "sub" / ".." / "lengths.parquet"),
             "is also an input")
    _refused(_run("search", lengths, "--dp", 2, "-o", tmp_path / "hard.parquet"), "is also an input")
    _refused(_run("search", lengths, "--dp", 2, "-o", tmp_path / "soft.parquet"), "is also an input")
    # pack OUT/lengths.parquet -o OUT would replace the folder holding its own input
    inside = _lengths(tmp_path / "out" / "lengths.parquet")
    _refused(_run("pack", inside, "--dp", 2, "-o", tmp_path / "out", *CAPS), "is inside the output folder")
    assert _run("pack", lengths, "--dp", 2, "-o", lengths, *CAPS).exit_code == 2  # click: a file, not a folder
    assert lengths.read_bytes() == before and inside.is_file()
    assert (tmp_path / "hard.parquet").read_bytes() == before


def test_scan_refuses_its_own_input_as_output(tmp_path):
    data = tmp_path / "data.jsonl"
    shutil.copy(ROOT / "sample_data" / "llava.jsonl", data)
    before = data.read_bytes()
    _refused(_run("scan", data, "-o", data, "--model", "qwen2-vl"), "is also an input")
    _refused(_run("scan", tmp_path, "-o", tmp_path / "lengths.parquet", "--model", "qwen2-vl"),
             "inside the input folder")
    assert data.read_bytes() == before and not (tmp_path / "lengths.parquet").exists()


def test_an_output_folder_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch):
    """``-o`` under a file, or in a folder that refuses files (``/sys``, a read-only mount), was an
    "internal error" traceback line once the whole scan had run; it is one line before the scan."""
    from balancer_cli.scan import pipeline

    data = tmp_path / "data.jsonl"
    shutil.copy(ROOT / "sample_data" / "llava.jsonl", data)
    (tmp_path / "afile").write_text("mine")
    scanned = []
    monkeypatch.setattr(pipeline, "scan", lambda *a, **k: scanned.append(a))
    _refused(_run("scan", data, "-o", tmp_path / "afile" / "sub" / "x.parquet", "--model", "qwen2-vl"),
             f"{tmp_path / 'afile'} is a file, not a folder")
    _refused(_run("pack", _lengths(tmp_path / "l.parquet"), "-o", tmp_path / "afile" / "out"), "is a file, not a folder")

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    # What a read-only folder does to the probe file (root passes access checks).
    monkeypatch.setattr("balancer_cli._fsutil.create_new", refuse)
    _refused(_run("scan", data, "-o", tmp_path / "new" / "x.parquet", "--model", "qwen2-vl"),
             f"{tmp_path} is not writable (Permission denied)", "choose a writable folder")
    assert not scanned and (tmp_path / "afile").read_text() == "mine" and not (tmp_path / "new").exists()


@pytest.mark.parametrize("kind", ["fifo", "link-to-fifo", "device"])
def test_special_files_are_never_replaced(tmp_path, kind):
    lengths = _lengths(tmp_path / "lengths.parquet")
    if kind == "device":
        target = Path("/dev/null")
    else:
        target = tmp_path / "pipe"
        os.mkfifo(target)
        if kind == "link-to-fifo":
            (tmp_path / "link").symlink_to(target)
            target = tmp_path / "link"
    mode = os.lstat(target).st_mode
    _refused(_run("search", lengths, "--dp", 2, "-o", target), "not a regular file or folder")
    _refused(_run("pack", lengths, "--dp", 2, "-o", target, *CAPS), "not a regular file or folder")
    data = tmp_path / "data.jsonl"
    shutil.copy(ROOT / "sample_data" / "llava.jsonl", data)
    _refused(_run("scan", data, "-o", target, "--model", "qwen2-vl"), "not a regular file or folder")
    assert os.lstat(target).st_mode == mode


def test_existing_output_folder_replaced_only_when_ours_and_clean(tmp_path):
    lengths = _lengths(tmp_path / "lengths.parquet")
    other = _lengths(tmp_path / "other.parquet", seed=3)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    _refused(_run("pack", lengths, "--dp", 2, "-o", foreign, *CAPS), "not written by balancer")
    assert _snapshot(foreign) == {"notes.txt": b"keep me"}
    out = tmp_path / "out"
    assert _run("pack", lengths, "--dp", 2, "-o", out, *CAPS).exit_code == 0
    first = _snapshot(out)
    assert _run("pack", other, "--dp", 2, "-o", out, *CAPS).exit_code == 0  # ours: replaced as a whole
    second = _snapshot(out)
    assert second["manifest.parquet"] != first["manifest.parquet"] and set(second) == PACKED
    (out / "extra.txt").write_text("mine")
    _refused(_run("pack", lengths, "--dp", 2, "-o", out, *CAPS), "did not write (extra.txt)")
    assert _snapshot(out) == {**second, "extra.txt": b"mine"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lengths.parquet", "mine", "other.parquet", "out"]


def test_parts_folder_is_ours_only_with_the_marker(tmp_path):
    lengths = _lengths(tmp_path / "lengths.parquet")
    parts = tmp_path / "out.parts"
    parts.mkdir()
    (parts / "thesis.tex").write_text("years of work")
    _refused(_run("pack", lengths, "--dp", 2, "-o", tmp_path / "out", "--engine", "ray", *CAPS),
             "was not created by balancer", PARTS_MARKER)
    assert _snapshot(parts) == {"thesis.tex": b"years of work"} and not (tmp_path / "out").exists()
    remove_parts_dir(parts)  # no marker: never deleted
    assert (parts / "thesis.tex").is_file()
    with pytest.raises(InputError, match="was not created by balancer"):
        claim_parts_dir(parts)
    fresh = claim_parts_dir(tmp_path / "fresh.parts")
    (fresh / "block-00000000.parquet").write_text("x")
    assert claim_parts_dir(fresh) == fresh  # ours: reused
    remove_parts_dir(fresh)
    assert not fresh.exists()


def test_scan_ray_parts_folder_without_marker_is_refused(tmp_path):
    from balancer_cli.scan.engines.ray import _prepare_parts

    parts = tmp_path / "lengths.parquet.parts"
    parts.mkdir()
    (parts / "block-00000000.parquet").write_text("the user's own file")
    with pytest.raises(InputError, match="was not created by balancer"):
        _prepare_parts(parts, "key", ["a"])
    assert (parts / "block-00000000.parquet").read_text() == "the user's own file"
    assert _prepare_parts(tmp_path / "new.parts", "key", ["a"]) == [False]
    assert (tmp_path / "new.parts" / PARTS_MARKER).is_file()


def test_calibrate_refuses_its_lengths_as_output(tmp_path):
    lengths = _lengths(tmp_path / "lengths.parquet")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    before = lengths.read_bytes()
    _refused(_run("calibrate", tmp_path / "model", "--lengths", lengths, "-o", lengths), "is also an input")
    assert lengths.read_bytes() == before
