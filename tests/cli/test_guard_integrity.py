"""Readers refuse an uncommitted, changed or inconsistent manifest folder, naming what differs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from click.testing import CliRunner

from balancer_cli.cli import main
from balancer_cli.commit import COMMIT_FILE, read_commit, verify_commit, write_commit
from balancer_cli.errors import ManifestError
from balancer_cli.lengths import make_lengths_table, write_lengths
from balancer_cli.manifest import ManifestRows, open_manifest, read_dropped, write_manifest
from balancer_cli.replay.cursor import ManifestReplay
from balancer_cli.replay.reader import ManifestReader

CAPS = ["--max-llm-tokens", "3000", "--max-vision-items", "10", "--baselines", "none"]


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A pack of 300 samples (one oversize, so dropped) over 2 epochs, 2 ranks x 2 micro-batches."""
    tmp = tmp_path_factory.mktemp("packed")
    rng = np.random.default_rng(0)
    items = rng.integers(0, 6, 300)
    llm = items * 256 + rng.integers(30, 400, 300)
    llm[7] = 9000  # over the cap: dropped
    write_lengths(make_lengths_table(llm, {"vision": (items * 256, items)}), tmp / "lengths.parquet")
    result = _run("pack", tmp / "lengths.parquet", "--dp", 2, "--micro-batches", 2, "--epochs", 2,
                  "--oversize", "drop", "-o", tmp / "out", *CAPS)
    assert result.exit_code == 0, result.output
    return tmp / "out"


def _copy(packed: Path, dest: Path) -> Path:
    dest.mkdir()
    for path in packed.iterdir():
        (dest / path.name).write_bytes(path.read_bytes())
    return dest


def _refused_by_all(folder: Path, *needles: str) -> None:
    """``balancer report`` exits 1 with one line, and the sampler raises ManifestError, both naming it."""
    result = _run("report", folder)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error: "), result.output
    with pytest.raises(ManifestError) as raised:
        list(ManifestReplay(folder, rank=0, world_size=2))
    for needle in needles:
        assert needle in lines[0] and needle in str(raised.value), (lines[0], str(raised.value))


def _rewrite(packed: Path, dest: Path, *, rows=None, dropped=None, meta=None) -> Path:
    """A copy whose manifest was rewritten through write_manifest (so its commit record is valid)."""
    folder = _copy(packed, dest)
    manifest = open_manifest(folder)
    rows = rows(manifest.read_all()) if rows else manifest.read_all()
    sample, reason = read_dropped(folder)
    sample, reason = dropped(sample, reason) if dropped else (sample, reason)
    full = dict(manifest.meta)
    full = meta(full) if meta else full
    write_manifest(folder, rows, dropped_sample=sample, dropped_reason=list(reason), meta=full,
                   epoch_num_steps=full["epoch_num_steps"])
    return folder


def test_a_packed_folder_verifies_and_report_rewrites_its_record(packed, tmp_path):
    folder = _copy(packed, tmp_path / "ok")
    before = read_commit(folder)
    result = _run("report", folder)
    assert result.exit_code == 0, result.output
    after = read_commit(folder)
    assert set(after["files"]) == set(before["files"])
    verify_commit(folder, names=sorted(after["files"]), full=True)
    assert len(ManifestReader(folder).step_groups(0)) == 4


def test_missing_record_is_refused(packed, tmp_path):
    folder = _copy(packed, tmp_path / "old")
    (folder / COMMIT_FILE).unlink()  # e.g. a folder written before records existed
    _refused_by_all(folder, f"no valid {COMMIT_FILE}", "re-run `balancer pack`")


@pytest.mark.parametrize("name, change, message", [
    ("dropped.parquet", lambda b: b"", "has 0 bytes"),
    ("manifest.parquet", lambda b: b + b"\0", "bytes, _COMMIT.json records"),
    ("manifest.parquet", lambda b: b[:100] + bytes([b[100] ^ 1]) + b[101:], "does not match its checksum"),
    ("dropped.parquet", lambda b: b[:-9] + bytes([b[-9] ^ 1]) + b[-8:], "does not match its checksum"),
])
def test_a_changed_file_is_refused(packed, tmp_path, name, change, message):
    folder = _copy(packed, tmp_path / "changed")
    (folder / name).write_bytes(change((folder / name).read_bytes()))
    _refused_by_all(folder, name, message)


def test_a_stale_report_file_does_not_block_readers(packed, tmp_path):
    folder = _copy(packed, tmp_path / "stale")
    (folder / "report.md").write_text("edited by hand")
    assert ManifestReader(folder).num_steps > 0  # report files are derived: `balancer report` rewrites them
    assert _run("report", folder).exit_code == 0


def _duplicate(rows):
    sample = rows.sample.copy()  # sample rows[1] is lost, rows[0] is placed twice in its place
    sample[1] = sample[0]
    return ManifestRows(rows.step, rows.rank, rows.micro, sample, rows.extra)


def _remove_one(rows):
    keep = np.ones(len(rows), bool)
    keep[3] = False
    return ManifestRows(rows.step[keep], rows.rank[keep], rows.micro[keep], rows.sample[keep])


def test_integrity_names_what_differs(packed, tmp_path):
    rows = open_manifest(packed).read_all()
    _refused_by_all(_rewrite(packed, tmp_path / "dup", rows=_duplicate), f"sample {rows.sample[0]} is placed 2 times in epoch 0")
    _refused_by_all(_rewrite(packed, tmp_path / "removed", rows=_remove_one),
                    f"sample {rows.sample[3]} is neither placed nor dropped in epoch 0")
    _refused_by_all(_rewrite(packed, tmp_path / "emptied", dropped=lambda s, r: (s[:0], r[:0])),
                    "sample 7 is neither placed nor dropped in epoch 0")
    _refused_by_all(_rewrite(packed, tmp_path / "twice", dropped=lambda s, r: (np.r_[s, s], np.r_[r, r])),
                    "sample 7 is listed twice in dropped.parquet")
    _refused_by_all(_rewrite(packed, tmp_path / "noreason", dropped=lambda s, r: (s, np.array([""] * len(s)))),
                    "without a reason")
    _refused_by_all(_rewrite(packed, tmp_path / "more", meta=lambda m: {**m, "num_samples": 301}),
                    "sample 300 is neither placed nor dropped in epoch 0")
    _refused_by_all(_rewrite(packed, tmp_path / "fewer", meta=lambda m: {**m, "num_samples": 299}),
                    "is outside 0..298")
    _refused_by_all(_rewrite(packed, tmp_path / "world", meta=lambda m: {**m, "world_size": 1}),
                    "rank 1 at step 0 is outside 0..0")
    _refused_by_all(_rewrite(packed, tmp_path / "wider", meta=lambda m: {**m, "world_size": 3}),
                    "step 0 has 4 groups, expected 3 ranks x 2 micro-batches")


def _step_as_text(table):
    return table.set_column(table.schema.get_field_index("step"), "step", table.column("step").cast(pa.string()))


@pytest.mark.parametrize("edit, message", [
    (lambda table: table.drop_columns(["rank"]), "no single integer column 'rank'"),
    (_step_as_text, "no single integer column 'step'"),
    (lambda table: table.append_column("micro", table.column("micro")), "no single integer column 'micro'"),
    (lambda table: table.replace_schema_metadata({b"balancer": b"[1]"}), "no 'balancer' metadata"),
])
def test_a_manifest_of_another_schema_is_refused(packed, tmp_path, edit, message):
    """Written by another tool, with a valid record: one line, not an error inside a reader."""
    folder = _copy(packed, tmp_path / "edited")
    pq.write_table(edit(pq.read_table(folder / "manifest.parquet")), folder / "manifest.parquet")
    (folder / COMMIT_FILE).unlink()
    write_commit(folder)
    _refused_by_all(folder, message, "fix: pass a folder `balancer pack` wrote")


def _past_int32(rows):
    sample = rows.sample.astype(np.int64)
    sample[2] += 2**32  # the same id modulo 2^32: a narrowing read would see the original sample
    return ManifestRows(rows.step, rows.rank, rows.micro, sample, rows.extra)


def test_sample_ids_past_int32_are_read_exactly_and_refused(packed, tmp_path):
    rows = open_manifest(packed).read_all()
    _refused_by_all(_rewrite(packed, tmp_path / "wrapped", rows=_past_int32), f"{int(rows.sample[2]) + 2**32}")


def test_edited_epochs_are_refused(packed, tmp_path):
    folder = _rewrite(packed, tmp_path / "epochs")
    meta = dict(open_manifest(folder).meta)
    table = pq.read_table(folder / "manifest.parquet")
    first = meta["epoch_num_steps"][0]
    meta["epoch_num_steps"] = [first - 1, meta["num_steps"] - first + 1]  # a step moved to the other epoch
    pq.write_table(table.replace_schema_metadata({b"balancer": json.dumps(meta)}), folder / "manifest.parquet")
    from balancer_cli.commit import write_commit

    write_commit(folder)
    result = _run("report", folder)
    assert result.exit_code == 1 and "in epoch 0" in result.output, result.output


@pytest.mark.parametrize("field, value, message", [
    ("num_steps", "x", "metadata field 'num_steps' is 'x', not an integer"),
    ("world_size", None, "metadata field 'world_size' is missing"),
    ("epoch_num_steps", ["a", 1], "metadata field 'epoch_num_steps' is ['a', 1], not a list of step counts"),
    ("epoch_num_steps", 7, "metadata field 'epoch_num_steps' is 7, not a list of step counts"),
    # Each was a crash far from its cause, a silent truncation or a usage error about a flag
    # nobody passed (exit 2), before the metadata was checked on opening.
    ("num_samples", "329", "metadata field 'num_samples' is '329', not an integer in 0..1099511627776"),
    ("num_samples", 10**13, "metadata field 'num_samples' is 10000000000000, not an integer"),
    ("num_samples", None, "metadata field 'num_samples' is missing"),  # conservation counts them
    ("micro_batches", 1.5, "metadata field 'micro_batches' is 1.5, not an integer in 1..2097151"),
    ("seed", -1, "metadata field 'seed' is -1, not an integer"),
    ("seed", True, "metadata field 'seed' is True, not an integer"),
    ("row_group_first_steps", [5], "metadata field 'row_group_first_steps' is [5], not the first step of each"),
    ("row_group_first_steps", "x", "metadata field 'row_group_first_steps' is 'x'"),
    ("epochs", 5, "metadata field 'epochs' is 5, not the 2 epochs of epoch_num_steps"),
    ("report_baselines", "isf", "metadata field 'report_baselines' is 'isf', not a list of names"),
    ("params", {"caps": None}, "metadata field 'params.caps' is None, not an object of positive integers"),
    ("params", {"caps": {"llm": -1}}, "metadata field 'params.caps' is {'llm': -1}"),
    ("params", [], "metadata field 'params' is [], not an object"),
    ("params", None, "the metadata records no caps for module 'vision'"),  # (None: the field removed)
    ("algorithm", "bogus", "its recorded parameters are invalid (unknown algorithm 'bogus')"),
    ("report_baselines", ["bogus"], "its recorded report baselines are invalid (unknown algorithm 'bogus')"),
])
def test_a_metadata_field_that_is_not_an_integer_is_named(packed, tmp_path, field, value, message):
    folder = _rewrite(packed, tmp_path / "meta")
    meta = dict(open_manifest(folder).meta)
    if value is None:
        del meta[field]
    else:
        meta[field] = value
    table = pq.read_table(folder / "manifest.parquet")
    pq.write_table(table.replace_schema_metadata({b"balancer": json.dumps(meta)}), folder / "manifest.parquet")
    write_commit(folder)
    result = _run("report", folder)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and message in lines[0], result.output
    if "record" not in message:  # what the report alone reads aside, every reader refuses it alike
        with pytest.raises(ManifestError, match=re.escape(message)):
            list(ManifestReplay(folder, rank=0, world_size=2))


def test_the_report_never_writes_over_an_input_and_names_a_given_lengths_path(packed, tmp_path):
    """A lengths file passed as ``--lengths`` at ``OUT/report.md`` (or linked from ``report.json``) was
    replaced by the report; a given path that is missing or no regular file was said to be "recorded
    in OUT" and "no longer" there."""
    folder = _copy(packed, tmp_path / "in")
    lengths = packed.parent / "lengths.parquet"
    (folder / "report.md").write_bytes(lengths.read_bytes())
    result = _run("report", folder, "--lengths", folder / "report.md")
    assert result.exit_code == 1 and "is also an input" in result.output, result.output
    assert (folder / "report.md").read_bytes() == lengths.read_bytes()
    (folder / "report.json").unlink()
    (folder / "report.json").symlink_to(lengths)
    result = _run("report", folder, "--lengths", lengths)
    assert result.exit_code == 1 and "is also an input" in result.output, result.output
    for path, message in ((tmp_path / "nope.parquet", "no such file"), ("/dev/null", "not a regular file")):
        result = _run("report", packed, "--lengths", path)
        assert result.exit_code == 1 and f"{path}: {message}" in result.output, result.output


def test_a_malformed_or_newer_commit_record_is_named(packed, tmp_path):
    folder = _copy(packed, tmp_path / "record")
    record = json.loads((folder / COMMIT_FILE).read_text())
    size = record["files"]["manifest.parquet"]["size"]
    record["files"]["manifest.parquet"]["size"] = str(size)
    (folder / COMMIT_FILE).write_text(json.dumps(record))
    _refused_by_all(folder, f"entry of manifest.parquet is malformed (size '{size}'")
    record["files"]["manifest.parquet"]["size"], record["version"] = size, 99
    (folder / COMMIT_FILE).write_text(json.dumps(record))
    _refused_by_all(folder, f"{COMMIT_FILE} is of version 99, this balancer_cli reads version 1")


def test_damaged_rows_and_dropped_lists_are_manifest_errors(packed, tmp_path, monkeypatch):
    """Past 8 MiB the commit record's quick check compares sizes only: a changed byte of the rows
    raised the Parquet reader's own OSError or UnicodeDecodeError, naming no file; a dropped list
    without its reason column a KeyError."""
    from balancer_cli.manifest import ManifestFile

    folder = _copy(packed, tmp_path / "damaged")

    def corrupt(self, indices, **options):
        raise OSError("Corrupt Lz4 compressed data.")

    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", corrupt)
    _refused_by_all(folder, "manifest.parquet: unreadable rows (Corrupt Lz4 compressed data.)")
    monkeypatch.undo()
    assert ManifestFile.read_row_groups  # the one way rows are read
    folder = _copy(packed, tmp_path / "dropped")
    pq.write_table(pq.read_table(folder / "dropped.parquet").drop_columns(["reason"]), folder / "dropped.parquet")
    (folder / COMMIT_FILE).unlink()
    write_commit(folder)
    _refused_by_all(folder, "dropped.parquet: not a list of dropped samples")


def test_a_phase_rank_column_out_of_range_is_refused(packed, tmp_path):
    def with_phase(rows):
        return ManifestRows(rows.step, rows.rank, rows.micro, rows.sample, {"vision_rank": np.full(len(rows), 2)})

    _refused_by_all(_rewrite(packed, tmp_path / "phase", rows=with_phase), "column vision_rank names a rank outside 0..1")


@pytest.mark.parametrize("block", [1, 2, 7, 1 << 20])
def test_row_checks_in_blocks_judge_like_one_block(packed, monkeypatch, block):
    """The slot checks run a block of rows at a time: every block size gives the same verdicts,
    across block edges too."""
    from balancer_cli import _index
    from balancer_cli.replay import integrity

    monkeypatch.setattr(_index, "RUNS_BLOCK", block)
    manifest = open_manifest(packed)
    rows, (dropped, reasons) = manifest.read_all(), read_dropped(packed)
    meta = manifest.meta

    def check(step, rank, world_size=meta["world_size"]):
        integrity.check_rows("m", step, rank, rows.micro, rows.sample, world_size=world_size,
                             micro_batches=meta["micro_batches"], num_samples=meta["num_samples"],
                             epoch_num_steps=meta["epoch_num_steps"], dropped_sample=dropped, dropped_reason=reasons)

    check(rows.step, rows.rank)
    for at in (1, 2, 7, len(rows) // 2):  # two rows swapped across any edge
        rank = rows.rank.copy()
        first = int(np.flatnonzero(rank[at:] != rank[at - 1])[0]) + at  # the next row of another rank
        rank[[at - 1, first]] = rank[[first, at - 1]]
        with pytest.raises(ManifestError, match="not sorted by"):
            check(rows.step, rank)
    with pytest.raises(ManifestError, match="step 0 has 4 groups, expected 3 ranks x 2 micro-batches"):
        check(rows.step, rows.rank, world_size=3)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 12), epochs=st.integers(1, 3), data=st.data())
def test_conservation_verdicts_are_those_of_plain_counts(n, epochs, data):
    """Any placements and dropped list (duplicates, samples both placed and dropped, missing ones,
    a sample placed 300 times) get the verdict that counting each sample's placements names."""
    from balancer_cli.replay import integrity

    steps = data.draw(st.lists(st.lists(st.integers(0, n - 1), min_size=1, max_size=2 * n), min_size=epochs,
                               max_size=epochs))
    if data.draw(st.booleans()):
        steps[0] = steps[0] + [steps[0][0]] * 300
    dropped = data.draw(st.lists(st.integers(0, n - 1), max_size=n))
    sample = np.array([s for epoch in steps for s in epoch], np.int32)
    step = np.repeat(np.arange(epochs), [len(e) for e in steps]).astype(np.int32)
    verdict = None
    counts_D = np.bincount(np.array(dropped, np.int64), minlength=n)
    if len(dropped) and counts_D.max() > 1:
        verdict = f"sample {int(np.argmax(counts_D))} is listed twice"
    else:
        for epoch, placed in enumerate(steps):
            count_N = np.bincount(np.array(placed, np.int64), minlength=n) + counts_D
            bad = np.flatnonzero(count_N != 1)
            if len(bad):
                s = int(bad[count_N[bad] > 1][0] if (count_N[bad] > 1).any() else bad[0])
                state = ("neither placed nor dropped" if count_N[s] == 0 else "placed and also dropped"
                         if counts_D[s] else f"placed {count_N[s]} times")
                verdict = f"sample {s} is {state} in epoch {epoch} ({len(bad)} samples differ"
                break
    check = {"world_size": 1, "micro_batches": 1, "num_samples": n, "epoch_num_steps": [1] * epochs,
             "dropped_sample": np.array(dropped, np.int64), "dropped_reason": ["r"] * len(dropped)}
    zeros = np.zeros(len(sample), np.int32)
    if verdict is None:
        integrity.check_rows("m", step, zeros, zeros, sample, **check)
    else:
        with pytest.raises(ManifestError, match=re.escape(verdict)):
            integrity.check_rows("m", step, zeros, zeros, sample, **check)


def test_the_planners_refuse_a_manifest_the_sampler_refuses(packed, tmp_path):
    """``plan-partition --manifest`` planned for rows that place a sample twice (exit 0) where the
    sampler refuses them: the planners check conservation too."""
    def duplicated(rows):
        sample = rows.sample.copy()
        sample[0] = sample[1]
        return ManifestRows(rows.step, rows.rank, rows.micro, sample, rows.extra)

    folder = _rewrite(packed, tmp_path / "dup", rows=duplicated)
    args = ["--llm", "qwen2-7b", "--vision", "internvit-300m", "--stages", 2, "--manifest", folder,
            "--lengths", packed.parent / "lengths.parquet"]
    result = _run("plan-partition", *args)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and "placed 2 times" in lines[0], result.output
    assert _run("plan-partition", *args[:-4], "--manifest", packed, "--lengths",
                packed.parent / "lengths.parquet").exit_code == 0
