"""Contracts of the foundation: lengths table, manifest files, CLI shell, torch isolation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer_cli import omnibal_json
from balancer_cli.cli import main
from balancer_cli.errors import InputError, ManifestError
from balancer_cli.lengths import (
    DEFAULT_SOURCE,
    lengths_fingerprint,
    make_lengths_table,
    read_lengths,
    write_lengths,
)
from balancer_cli.manifest import (
    ManifestRows,
    open_manifest,
    read_dropped,
    write_manifest,
)
from balancer_cli.omnibal_json import read_omnibal_json
from balancer_cli.pack.inputs import prepare_inputs


def test_import_and_help_do_not_import_torch():
    code = ("import sys, balancer_cli, balancer_cli.cli, balancer_cli.lengths, balancer_cli.manifest;"
            "from click.testing import CliRunner; from balancer_cli.cli import main;"
            "r = CliRunner().invoke(main, ['--help']); assert r.exit_code == 0, r.output;"
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_kernels_run_without_importing_scipy_linalg():
    """numba's import-time BLAS probe imported all of scipy.linalg (0.15 s of every command that runs
    a kernel) though no kernel here uses linear algebra: it is answered without the import
    (``balancer_cli._jit``), and a kernel that does use it still gets SciPy when it compiles."""
    pytest.importorskip("scipy")
    code = (
        "import sys, numpy as np, numba\n"
        "from balancer_cli.pack.bounds import groups_lower_bound\n"
        "assert groups_lower_bound(np.array([[5, 100], [5, 100]]), np.array([9, 4096])) == 2\n"
        "import numba.np.arraymath as arraymath\n"
        "assert arraymath._HAVE_BLAS and 'scipy.linalg' not in sys.modules\n"
        "dot = numba.njit(lambda a, b: np.dot(a, b))\n"
        "assert dot(np.ones(3), np.ones(3)) == 3.0 and 'scipy.linalg' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


def test_pack_and_report_run_without_importing_pandas(tmp_path):
    """pyarrow's ``pa.array`` and ``to_numpy`` import pandas (0.24-0.28 s of a command; it comes with
    ``datasets``): reading lengths, packing, writing and checking the manifest and reporting go
    through :mod:`balancer_cli._arrow` instead, with a source column and without, with drops."""
    rng = np.random.default_rng(0)
    write_lengths(make_lengths_table(rng.integers(1, 900, 300), {"vision": (np.full(300, 256), np.ones(300))},
                                     source=["a", "b", "c"] * 100), tmp_path / "l.parquet")
    code = (
        "import sys\n"
        "from balancer_cli.cli import main\n"
        "for args in (['pack', sys.argv[1] + '/l.parquet', '--dp', '2', '--max-llm-tokens', '800', '--oversize', 'drop',\n"
        "              '-o', sys.argv[1] + '/out', '--baselines', 'random,llm-ffd', '--quiet'],\n"
        "             ['report', sys.argv[1] + '/out']):\n"
        "    try:\n"
        "        main(args)\n"
        "    except SystemExit as end:\n"
        "        assert end.code == 0, args\n"
        "assert 'pandas' not in sys.modules, 'pandas imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(pq.read_table(tmp_path / "out" / "dropped.parquet")) > 0  # the drops were written and read back


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["int8", "uint16", "int32", "int64", "float32", "float64", "bool"]),
       n=st.integers(0, 50), start=st.integers(0, 5), chunks=st.integers(1, 3), seed=st.integers(0, 9),
       texts=st.lists(st.text(max_size=6), max_size=8))
def test_arrow_conversions_equal_pyarrows_own(kind, n, start, chunks, seed, texts):
    from balancer_cli._arrow import arrow_of, arrow_repeat, arrow_strings, numpy_of

    values = (np.random.default_rng(seed).integers(0, 100, n) % (2 if kind == "bool" else 100)).astype(kind)
    own = arrow_of(values[start:])
    assert own.equals(pa.array(values[start:])) and own.type == pa.array(values[start:]).type
    chunked = pa.chunked_array([pa.array(part) for part in np.array_split(values, chunks)], type=own.type)
    for arrow in (chunked, chunked.combine_chunks().slice(start), pa.array(values)):
        expected = arrow.to_numpy(zero_copy_only=False)
        assert numpy_of(arrow).dtype == expected.dtype and np.array_equal(numpy_of(arrow), expected)
    assert arrow_strings(texts).equals(pa.array(texts, pa.string()))
    assert arrow_repeat("s", n).to_pylist() == ["s"] * n


def test_help_lists_every_command_and_each_has_help():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for name in main.list_commands(None):
        sub = CliRunner().invoke(main, [name, "--help"])
        assert sub.exit_code == 0, (name, sub.output)
        assert "--json" in sub.output, f"{name} lacks --json"


def test_lengths_roundtrip_and_fingerprint(tmp_path):
    lt = make_lengths_table(np.array([300, 40, 7]), {"vision": (np.array([1024, 0, 0]), np.array([1, 0, 0]))},
                            error=[None, None, "missing image"])
    write_lengths(lt, tmp_path / "l.parquet")
    back = read_lengths(tmp_path / "l.parquet")
    assert back.fingerprint == lt.fingerprint
    assert back.ok_mask().tolist() == [True, True, False]
    assert back.metadata["fingerprint"] == lt.fingerprint
    assert pa.types.is_dictionary(back.table.schema.field("source").type)


def test_fingerprints_stay_those_older_manifests_recorded():
    """The fingerprint is stored in every manifest: its bytes never change (nulls, chunks, blocks)."""
    lt = make_lengths_table(np.array([300, 40, 7]), {"vision": (np.array([1024, 0, 0]), np.array([1, 0, 0]))},
                            error=[None, None, "missing image"])
    assert lt.fingerprint == "f941ff08359cb968e4413beb19c96f03"
    n = (1 << 20) + 5  # past one hashed block
    table = make_lengths_table(np.arange(n) % 997 + 1, {"audio": (np.arange(n) % 13 * 50, np.arange(n) % 13)},
                               error=[None if i % 7 else "x" for i in range(n)]).table
    chunked = pa.Table.from_batches(table.to_batches(max_chunksize=300_000))
    tokens = pa.array(np.arange(n) % 997 + 1, pa.int32(), mask=np.arange(n) % 5 == 0)
    nulls = table.set_column(table.column_names.index("llm_tokens"), "llm_tokens", tokens)
    assert lengths_fingerprint(table) == lengths_fingerprint(chunked) == "c2b58d001f2dfe884c3a37b33ef51140"
    assert lengths_fingerprint(nulls) == "1a12e47e56b3334ebf5538070f22e71a"


@pytest.mark.parametrize("kind", [pa.int64(), pa.int32(), None])
def test_sample_ids_are_positions_kept_checked_or_numbered(tmp_path, kind):
    """A ``sample`` column must be 0..N-1 in order (kept, as int64); without one, rows are numbered."""
    n = (1 << 20) + 3  # past one checked block
    table = make_lengths_table(np.arange(n) % 50 + 1).table.drop_columns(["sample"])
    if kind is not None:
        table = table.add_column(0, "sample", pa.array(np.arange(n), kind))
    pq.write_table(table, tmp_path / "l.parquet")
    back = read_lengths(tmp_path / "l.parquet").table.column("sample")
    assert back.type == pa.int64() and np.array_equal(np.asarray(back), np.arange(n))
    if kind is not None:
        ids = np.arange(n)
        ids[n - 2], ids[n - 1] = ids[n - 1], ids[n - 2]  # out of order in the last block
        pq.write_table(table.set_column(0, "sample", pa.array(ids, kind)), tmp_path / "bad.parquet")
        with pytest.raises(InputError, match="column 'sample' is not 0"):
            read_lengths(tmp_path / "bad.parquet")


def test_lengths_concatenation_fills_missing_modules(tmp_path):
    a = make_lengths_table(np.array([10, 20]), {"vision": (np.array([5, 6]), np.array([1, 1]))}, source="a")
    b = make_lengths_table(np.array([30]), {"audio": (np.array([9]), np.array([1]))}, source="b")
    write_lengths(a, tmp_path / "a.parquet")
    write_lengths(b, tmp_path / "b.parquet")
    both = read_lengths([tmp_path / "a.parquet", tmp_path / "b.parquet"])
    assert both.modules == ("vision", "audio")
    assert both.table.column("sample").to_pylist() == [0, 1, 2]
    assert both.tokens("audio").tolist() == [0, 0, 9]
    assert both.sources().tolist() == ["a", "a", "b"]


def test_lengths_concatenation_keeps_item_sizes_where_every_file_has_them(tmp_path):
    """``<m>_seqlens`` (each item's tokens: the encoder's attention cost under ``--cost-model
    flops``) was dropped from every concatenation, so several files fell back to items of equal
    size. It is kept where every file with the module has it; a file without the module adds
    samples without items."""
    vision = {"a": ([900, 50], [600, 0], [2, 0], [[100, 500], []]), "b": ([300, 70], [512, 64], [1, 1], [[512], [64]])}
    for name, (llm, tokens, items, sizes) in vision.items():
        write_lengths(make_lengths_table(np.array(llm), {"vision": (np.array(tokens), np.array(items))},
                                         seqlens={"vision": sizes}), tmp_path / f"{name}.parquet")
    write_lengths(make_lengths_table(np.array([10])), tmp_path / "text.parquet")
    write_lengths(make_lengths_table(np.array([40]), {"vision": (np.array([64]), np.array([1]))}), tmp_path / "c.parquet")
    files = [tmp_path / f"{name}.parquet" for name in ("a", "text", "b")]
    merged = read_lengths(files)
    assert merged.table.column("vision_seqlens").to_pylist() == [[100, 500], [], [], [512], [64]]
    assert merged.item_sumsq("vision").tolist() == [100**2 + 500**2, 0, 0, 512**2, 64**2]  # not 600**2 / 2 first
    assert "vision_seqlens" not in read_lengths([*files, tmp_path / "c.parquet"]).table.column_names  # c has none


@pytest.mark.parametrize("column", ["foo", "audio_tokens"])
def test_an_unknown_column_in_one_of_several_files_is_that_files_error(tmp_path, column):
    """One file's unknown column is refused (``prepare_inputs``); among several it was dropped
    unseen, so an encoder column spelled wrong counted as a module the file lacks (0 tokens)."""
    write_lengths(make_lengths_table(np.array([900, 50]), {"vision": (np.array([600, 0]), np.array([2, 0]))}),
                  tmp_path / "a.parquet")
    pq.write_table(pa.table({"llm_tokens": pa.array([10, 20]), column: pa.array([1, 2])}), tmp_path / "b.parquet")
    with pytest.raises(InputError, match=f"b.parquet: unknown column '{column}'; fix: rename or remove it"):
        read_lengths([tmp_path / "a.parquet", tmp_path / "b.parquet"])


def test_omnibal_json_import(internvl_lengths):
    lt = read_lengths(internvl_lengths)
    assert lt.num_samples == 70_706
    assert lt.modules == ("vision",)
    raw = json.loads(internvl_lengths[0].read_text())
    assert lt.items("vision")[: len(raw)].tolist() == [r["vit_num"] for r in raw]


@pytest.mark.parametrize("bad, match", [
    (pa.table({"llm_tokens": pa.array([1, -3])}), "negative 'llm_tokens' = -3"),
    (pa.table({"llm_tokens": pa.array([], pa.int32())}), "empty"),
    (pa.table({"tokens": pa.array([1])}), "'llm_tokens' is missing"),
    (pa.table({"llm_tokens": pa.array([1.5])}), "expected integers"),
    (pa.table({"llm_tokens": pa.array([1, None])}), "sample 1 has no value"),
])
def test_bad_lengths_tables_name_the_problem(tmp_path, bad, match):
    pq.write_table(bad, tmp_path / "bad.parquet")
    with pytest.raises(InputError, match=match):
        read_lengths(tmp_path / "bad.parquet")


@pytest.mark.parametrize("content, match", [
    (b"hello", r"neither a lengths Parquet file nor an OmniBal token-length JSON list \(it starts with b'hello'\)"),
    (b"", r"neither a lengths Parquet file .* \(it starts with b''\)"),
    (b'{"vit_num": 1, "token_num": 5}', "neither a lengths Parquet file"),
    (b"  [1, 2", "cannot read token-length JSON"),
    (b"PAR1 but cut short", "unreadable Parquet"),
])
def test_a_file_of_neither_format_is_named_with_its_start(tmp_path, content, match):
    """Bytes that are neither format get an error naming the file and its first bytes."""
    path = tmp_path / "lengths.parquet"
    path.write_bytes(content)
    with pytest.raises(InputError, match=match) as error:
        read_lengths(path)
    assert str(path) in error.value.message


def test_a_path_that_is_no_regular_file_is_named_so(tmp_path):
    """A folder, device or pipe is refused as what it is (a pipe is never opened: reading would
    block); only a path that does not exist is 'no such file'."""
    fifo = tmp_path / "pipe.parquet"
    os.mkfifo(fifo)
    for path in (tmp_path, fifo, Path(os.devnull)):
        with pytest.raises(InputError, match="not a regular file") as error:
            read_lengths(path)
        assert str(path) in error.value.message
    with pytest.raises(InputError, match="no such file"):
        read_lengths(tmp_path / "missing.parquet")


def test_null_sources_read_as_the_default_source(tmp_path):
    """A null source is the default source (as a missing column is), never silently the first one."""
    table = pa.table({"llm_tokens": pa.array([5, 6, 7, 8]), "source": pa.array(["b", None, "a", None])})
    pq.write_table(table, tmp_path / "l.parquet")
    lt = read_lengths(tmp_path / "l.parquet")
    assert lt.sources().tolist() == ["b", DEFAULT_SOURCE, "a", DEFAULT_SOURCE]
    inputs = prepare_inputs(lt)
    assert [inputs.source_names[c] for c in inputs.source_codes_N] == ["b", DEFAULT_SOURCE, "a", DEFAULT_SOURCE]


def test_omnibal_json_with_a_byte_order_mark_reads(tmp_path):
    path = tmp_path / "l.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps([{"vit_num": 2, "token_num": 600}]).encode())
    lt = read_lengths(path)
    assert (lt.items("vision").tolist(), lt.llm_tokens().tolist()) == ([2], [600])


@settings(max_examples=60, deadline=None)
@given(data=st.data(), chunk=st.sampled_from([3, 16, 64, 1 << 20]))
def test_omnibal_json_read_a_chunk_at_a_time_is_the_whole_parse(tmp_path_factory, data, chunk):
    """Records read a chunk of bytes at a time (cut at ``},``, even inside a string or a nested
    object) give what parsing the whole file gives: the same fields, or the same error."""
    records = data.draw(st.lists(st.fixed_dictionaries(
        {"vit_num": st.integers(0, 12),
         "token_num": st.one_of(st.integers(0, 9999), st.integers(0, 9), st.sampled_from([None, 1.5, "7"]))},
        optional={"note": st.sampled_from(["}, {", "a},b", "x"]), "flags": st.just({"y": 1})}), max_size=40))
    text = json.dumps(records, indent=data.draw(st.sampled_from([None, 1]))).encode()
    if data.draw(st.booleans()):  # break it somewhere
        at = data.draw(st.integers(0, max(0, len(text) - 1)))
        text = text[:at] + data.draw(st.sampled_from([b",", b"}", b"]", b"", b" ,"])) + text[at + 1:]
    path = tmp_path_factory.mktemp("json") / "src.json"
    path.write_bytes(text)

    def outcome():
        try:
            table = read_omnibal_json(path)
            return table.column("vision_items").to_pylist(), table.column("llm_tokens").to_pylist()
        except InputError as error:
            return error.message

    with mock.patch.object(omnibal_json, "_CHUNK_BYTES", chunk):
        streamed = outcome()
    with mock.patch.object(omnibal_json, "_streamed_fields", lambda path: None):
        assert streamed == outcome()


def test_manifest_row_groups_hold_whole_steps_and_seek(tmp_path):
    steps, ranks, micros, per_group = 50, 4, 2, 3
    step, rank, micro = (a.ravel() for a in np.meshgrid(np.arange(steps), np.arange(ranks), np.arange(micros),
                                                        indexing="ij"))
    step, rank, micro = (np.repeat(a, per_group) for a in (step, rank, micro))
    sample = np.random.default_rng(0).permutation(len(step))
    rows = ManifestRows(step, rank, micro, sample, extra={"vision_rank": rank[::-1].copy()})
    write_manifest(tmp_path, rows, dropped_sample=np.array([], np.int64), dropped_reason=[],
                   meta={"world_size": ranks, "micro_batches": micros, "num_samples": len(step), "seed": 1},
                   epoch_num_steps=[25, 25], rows_per_row_group=100)
    m = open_manifest(tmp_path)
    assert (m.num_steps, m.world_size, m.epoch_num_steps) == (50, 4, [25, 25])
    pf = pq.ParquetFile(tmp_path / "manifest.parquet")
    assert pf.num_row_groups > 1
    for i in range(pf.num_row_groups):
        s = pf.read_row_group(i).column("step").to_numpy()
        assert s[0] == m.meta["row_group_first_steps"][i]
    for first in (0, 7, 49):
        got = m.read_steps(first, first + 1)
        assert set(got.step.tolist()) == {first}
        np.testing.assert_array_equal(got.sample, sample[step == first])
        np.testing.assert_array_equal(got.extra["vision_rank"], rows.extra["vision_rank"][step == first])
    assert len(read_dropped(tmp_path)[0]) == 0


def test_manifest_rejects_unsorted_rows_and_missing_dir(tmp_path):
    rows = ManifestRows(np.array([1, 0]), np.array([0, 0]), np.array([0, 0]), np.array([0, 1]))
    with pytest.raises(ManifestError, match="not sorted"):
        write_manifest(tmp_path, rows, dropped_sample=np.array([]), dropped_reason=[], meta={})
    with pytest.raises(ManifestError, match="no manifest.parquet"):
        open_manifest(tmp_path / "nowhere")


def test_atomic_outputs_respect_the_umask(tmp_path):
    import os

    from balancer_cli._fsutil import atomic_path
    old = os.umask(0o022)
    try:
        with atomic_path(tmp_path / "out.bin") as tmp:
            tmp.write_bytes(b"x")
    finally:
        os.umask(old)
    assert (tmp_path / "out.bin").stat().st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


@pytest.mark.parametrize("folder", [False, True], ids=["file", "folder"])
def test_an_interrupt_as_the_temporary_is_made_leaves_none(tmp_path, monkeypatch, folder):
    """A SIGTERM raises in the main thread between any two steps (``Terminated``, a
    ``KeyboardInterrupt``). With ``mkstemp`` the temporary existed before the block that removes it
    was entered: one landing there left it behind (a flaky ``balancer scan`` SIGTERM test). Now its
    name is held first, so an interrupt right after it is made still finds it removed; the folder
    of ``committed_folder`` gets the umask's permissions as the files do."""
    import os

    from balancer_cli import _fsutil, commit

    real = _fsutil.create_new

    def made_then_interrupted(path, *, folder):
        real(path, folder=folder)
        raise KeyboardInterrupt

    target = tmp_path / ("out" if folder else "out.parquet")
    for module in (_fsutil, commit):
        monkeypatch.setattr(module, "create_new", made_then_interrupted)
    with pytest.raises(KeyboardInterrupt), (commit.committed_folder(target) if folder else _fsutil.atomic_path(target)):
        pass
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    old = os.umask(0o027)
    try:
        with commit.committed_folder(tmp_path / "made") as made:
            (made / "x").write_bytes(b"x")
    finally:
        os.umask(old)
    assert (tmp_path / "made").stat().st_mode & 0o777 == 0o750


def test_a_killed_writes_temporary_file_is_removed_by_the_next_write(tmp_path):
    """A temporary of ``lengths.parquet`` whose run is gone (SIGKILL) goes with the next write of
    it; a live run's, another name's and a folder are kept."""
    import os
    import subprocess

    from balancer_cli._fsutil import atomic_path, temporary_prefix

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # its PID is free now
    prefix = temporary_prefix(tmp_path / "lengths.parquet")
    dead = tmp_path / f"{prefix}{child.pid}-a.tmp"
    live = tmp_path / f"{prefix}{os.getppid()}-b.tmp"
    other = tmp_path / f"{temporary_prefix(tmp_path / 'other.parquet')}{child.pid}-c.tmp"
    folder = tmp_path / f"{prefix}{child.pid}-d"
    for path in (dead, live, other):
        path.write_bytes(b"half written")
    folder.mkdir()
    write_lengths(make_lengths_table(np.arange(10, 20)), tmp_path / "lengths.parquet")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["lengths.parquet", live.name, other.name, folder.name])
    with atomic_path(tmp_path / "other.parquet") as tmp:
        tmp.write_bytes(b"x")
    assert not other.exists() and live.exists()


def test_prefetch_is_only_a_hint():
    """A compiled kernel that prefetches (any integer index type, 1-D and 2-D arrays, the last
    element) computes exactly what the same kernel without it does."""
    from balancer_cli._jit import HAVE_NUMBA, njit, prefetch

    if not HAVE_NUMBA:
        pytest.skip("numba absent: prefetch is a no-op function")

    def gather_sum(table_NK, rows, hint):
        total = 0.0
        for p in range(len(rows)):
            if hint and p + 2 < len(rows):
                prefetch(table_NK, rows[p + 2] * table_NK.shape[1])
                prefetch(rows, np.int32(p + 2))
            total += table_NK[rows[p], 0] * 3.0 + table_NK[rows[p], -1]
        return total

    compiled = njit(gather_sum)
    rng = np.random.default_rng(0)
    table = rng.random((1000, 3))
    for rows in (rng.integers(0, 1000, 500), rng.integers(0, 1000, 500).astype(np.int32), np.array([999])):
        assert compiled(table, rows, True) == compiled(table, rows, False) != 0.0


def test_warm_up_runs_the_call_on_another_thread_and_drops_its_error():
    """``pack`` builds numba's contexts on a daemon thread while it reads: the call runs there, and
    an error in it is left to the kernel's first real call (never raised by the warm-up)."""
    import threading

    from balancer_cli._jit import warm_up

    ran_on = []

    def call():
        ran_on.append(threading.current_thread())
        raise RuntimeError("the kernel's first real call raises it")

    thread = warm_up(call)
    if thread is None:
        pytest.skip("numba absent: nothing to warm")
    thread.join()
    assert thread.daemon and ran_on == [thread] and thread is not threading.current_thread()
