"""Input patterns: WebDataset brace notation and globs the shell did not expand scan exactly the
files they name (a shard folder's table, byte for byte), and a pattern naming nothing is one line."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer_cli.cli import main
from balancer_cli.errors import InputError, UsageError
from balancer_cli.scan.patterns import MAX_EXPANSION, brace_expand, expand_pattern


def test_brace_expansion_follows_braceexpand():
    assert brace_expand("s-{0..3}.tar") == ["s-0.tar", "s-1.tar", "s-2.tar", "s-3.tar"]
    assert brace_expand("s-{000098..000101}.tar") == ["s-000098.tar", "s-000099.tar", "s-000100.tar", "s-000101.tar"]
    assert brace_expand("s-{3..1}") == ["s-3", "s-2", "s-1"]
    assert brace_expand("{train,val}/{00..01}.tar") == ["train/00.tar", "train/01.tar", "val/00.tar", "val/01.tar"]
    assert brace_expand("a{}b{x}c") == ["a{}b{x}c"]  # no range, no comma: literal, as braceexpand keeps it
    assert brace_expand("plain.tar") == ["plain.tar"]
    with pytest.raises(UsageError, match="at most"):
        brace_expand("{0..99999999}.tar")
    with pytest.raises(UsageError, match="at most"):
        brace_expand("{0..999}{0..999}{0..9}.tar")


@settings(max_examples=60, deadline=None)
@given(lo=st.integers(0, 120), span=st.integers(0, 30), width=st.integers(1, 6))
def test_numeric_ranges_are_every_value_once_in_order(lo, span, width):
    hi = lo + span
    got = brace_expand(f"x{{{str(lo).zfill(width)}..{str(hi).zfill(width)}}}")
    padded = width > 1 and (len(str(lo)) < width or len(str(hi)) < width)
    want = [f"x{str(v).zfill(width) if padded else v}" for v in range(lo, hi + 1)]
    assert got == want and len(got) <= MAX_EXPANSION


def _shard(path: Path, keys: range) -> None:
    with tarfile.open(path, "w") as tar:
        for i in keys:
            data = json.dumps({"conversations": [{"from": "human", "value": f"question {i} " * (i % 4 + 1)},
                                                 {"from": "gpt", "value": "answer"}]}).encode()
            info = tarfile.TarInfo(f"k{i:04d}.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _scan(*args: str) -> CliRunner:
    return CliRunner().invoke(main, ["scan", *args, "--model", "qwen2-vl", "-q", "-j", "1"])


def test_a_quoted_shard_pattern_scans_like_the_folder(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    for s in range(4):
        _shard(folder / f"train-{s:06d}.tar", range(10 * s, 10 * s + 7))
    by_folder, by_brace, by_glob = (tmp_path / f"{n}.parquet" for n in ("folder", "brace", "glob"))
    assert _scan(str(folder), "-o", str(by_folder)).exit_code == 0
    assert _scan(str(folder / "train-{000000..000003}.tar"), "-o", str(by_brace)).exit_code == 0
    assert _scan(str(folder / "train-*.tar"), "-o", str(by_glob)).exit_code == 0
    from balancer_cli.lengths import read_lengths

    tables = [read_lengths(p).table for p in (by_folder, by_brace, by_glob)]
    assert tables[0].num_rows == 28 and tables[0].equals(tables[1]) and tables[0].equals(tables[2])
    assert set(tables[1].column("source").to_pylist()) == {"shards"}  # the folder's name, as for the folder
    # a subset of the shards, by range
    part = tmp_path / "part.parquet"
    assert _scan(str(folder / "train-{000001..000002}.tar"), "-o", str(part)).exit_code == 0
    assert read_lengths(part).num_samples == 14
    # the output may not be one of the files a pattern names
    result = _scan(str(folder / "train-*.tar"), "-o", str(folder / "train-000000.tar"))
    assert result.exit_code == 1 and "Error:" in result.output


def test_patterns_naming_nothing_are_one_line_errors(tmp_path):
    _shard(tmp_path / "a-0.tar", range(3))
    result = _scan(str(tmp_path / "a-{0..2}.tar"), "-o", str(tmp_path / "x.parquet"))
    assert result.exit_code == 1 and "a-1.tar: no such file (from the pattern" in result.output
    assert len(result.output.strip().splitlines()) == 1
    result = _scan(str(tmp_path / "b-*.tar"), "-o", str(tmp_path / "x.parquet"))
    assert result.exit_code == 1 and "no file matches the pattern" in result.output
    with pytest.raises(InputError):
        expand_pattern(str(tmp_path / "c-[0-9].tar"))
    # a file whose name holds pattern characters is taken as written
    odd = tmp_path / "odd-{1..2}.tar"
    _shard(odd, range(2))
    assert expand_pattern(str(odd)) == [str(odd)]


def test_letter_ranges():
    assert brace_expand("part-{a..c}.tar") == ["part-a.tar", "part-b.tar", "part-c.tar"]
    assert brace_expand("{C..A}") == ["C", "B", "A"]


def test_media_members_bind_in_natural_order(tmp_path):
    """Twelve images ``0.png`` .. ``11.png``: the placeholders take them 0, 1, 2, ..., 10, 11 (not 0, 1, 10, 11, 2)."""
    from PIL import Image

    from balancer_cli.lengths import read_lengths

    shard = tmp_path / "s.tar"
    sizes = [(56 + 28 * i, 56) for i in range(12)]  # every image a different token count
    with tarfile.open(shard, "w") as tar:
        record = json.dumps({"conversations": [{"from": "human", "value": "<image>" * 12 + "\nCompare."},
                                               {"from": "gpt", "value": "ok"}]}).encode()
        members = [("k.json", record)]
        for i, size in enumerate(sizes):
            buf = io.BytesIO()
            Image.new("RGB", size).save(buf, "PNG")
            members.append((f"k.{i}.png", buf.getvalue()))
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out = tmp_path / "l.parquet"
    assert _scan(str(shard), "-o", str(out)).exit_code == 0
    seqlens = read_lengths(out).table.column("vision_seqlens").to_pylist()[0]
    assert seqlens == sorted(seqlens) and len(set(seqlens)) == 12  # widths grow with the index
