"""Fuzz: random malformed records and files never end a scan with anything but our own errors, and
every record the input holds is a row, in order, either measured or with an error.

Each example writes one input (JSONL lines, a JSON list, or Parquet rows) that interleaves known
"sentinel" records (each with its own text length, so its ``llm_tokens`` says where it landed)
with random hostile ones: deep nesting, NaN/inf/huge numbers, wrong types, lone surrogates, NUL
bytes, placeholders without media, paths out of the root or onto device files, random bytes.
"""

from __future__ import annotations

import functools
import json
import string
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from balancer_cli.cli import main
from balancer_cli.errors import BalancerError, InputError
from balancer_cli.scan.measure import ScanConfig
from balancer_cli.scan.pipeline import scan
from balancer_cli.scan.records import FIELD_NAMES

CONFIG = ScanConfig(model="qwen2-vl", tokenizer="qwen2")
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

NASTY_TEXT = ["\ud800", "\x00", "<image>", "<video>\n", "<audio>", "../../etc/passwd", "/dev/zero", "/etc/passwd",
              "a.png", "v.mp4", "nan", "1e999", "\ufeff", "\u3000", "x" * 300]
leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from(NASTY_TEXT),
)
keys = st.one_of(st.sampled_from(FIELD_NAMES + ("from", "value", "role", "content", "type", "path", "bytes",
                                                "sampling_rate", "array", "url", "image_url")),
                 st.text(string.ascii_letters, max_size=6))
values = st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(keys, inner, max_size=5)), max_leaves=25)
records = st.one_of(st.dictionaries(keys, values, max_size=6), values)


def _hostile_line() -> st.SearchStrategy[bytes]:
    return st.one_of(
        records.map(lambda r: json.dumps(r).encode()),
        st.binary(max_size=40).map(lambda b: b.replace(b"\n", b" ")),
        st.integers(1, 3000).map(lambda k: b"[" * k + b"]" * k),
        st.integers(1, 3000).map(lambda k: b'{"text": ' + b"[" * k + b"]" * k + b"}"),
    )


@functools.cache
def _sentinel_tokens(tmp: str, count: int) -> tuple[int, ...]:
    path = Path(tmp) / f"sentinels_{count}.jsonl"
    path.write_text("".join(json.dumps(_sentinel(i)) + "\n" for i in range(count)))
    return tuple(scan([str(path)], CONFIG, jobs=1).lengths.tokens("llm").tolist())


def _sentinel(i: int) -> dict:
    return {"text": "sentinel " + "word " * (3 * i + 1)}


def _check(path: Path, sentinel_at: list[int], num_records: int, tmp: Path, allow_input_error: bool) -> None:
    try:
        lengths = scan([str(path)], CONFIG, jobs=1, block_size=3).lengths
    except InputError:
        assert allow_input_error, "a file every record of which is readable was refused"
        return
    except BalancerError as exc:
        raise AssertionError(f"unexpected {type(exc).__name__}: {exc}") from None
    errors = lengths.errors().tolist()
    tokens = lengths.tokens("llm").tolist()
    assert len(errors) == num_records  # conservation: one row per record
    expected = _sentinel_tokens(str(tmp), len(sentinel_at))
    for i, at in enumerate(sentinel_at):
        assert errors[at] is None and tokens[at] == expected[i], (at, errors[at])  # in order, unharmed
    for error, n in zip(errors, tokens):
        assert (error is None) or (n == 0 and ":" in error)  # an error row carries no counts


@SETTINGS
@given(lines=st.lists(_hostile_line(), min_size=1, max_size=8))
def test_fuzz_jsonl_lines(tmp_path_factory, lines):
    tmp = tmp_path_factory.getbasetemp()
    body, sentinel_at, count = [], [], 0
    for i, line in enumerate(lines):
        body.append(json.dumps(_sentinel(i)).encode())
        sentinel_at.append(count)
        count += 1
        body.append(line)
        count += bool(line.strip())  # blank lines are not records
    path = Path(tmp) / "fuzz.jsonl"
    path.write_bytes(b"\n".join(body) + b"\n")
    _check(path, sentinel_at, count, Path(tmp), allow_input_error=False)


@SETTINGS
@given(items=st.lists(st.one_of(records.map(json.dumps),
                                st.integers(1, 3000).map(lambda k: "[" * k + "]" * k)), min_size=1, max_size=8))
def test_fuzz_json_list(tmp_path_factory, items):
    tmp = tmp_path_factory.getbasetemp()
    elements, sentinel_at = [], []
    for i, item in enumerate(items):
        sentinel_at.append(len(elements))
        elements += [json.dumps(_sentinel(i)), item]
    path = Path(tmp) / "fuzz.json"
    path.write_text("[\n" + ",\n".join(elements) + "\n]")
    _check(path, sentinel_at, len(elements), Path(tmp), allow_input_error=False)


cells = st.one_of(st.none(), st.text(max_size=20), st.sampled_from([t for t in NASTY_TEXT if t != "\ud800"]))
numbers = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**62, 2**62))


@SETTINGS
@given(rows=st.lists(st.tuples(cells, cells, numbers, numbers, cells), min_size=1, max_size=8))
def test_fuzz_parquet_rows(tmp_path_factory, rows):
    tmp = tmp_path_factory.getbasetemp()
    text, image, width, height, video, sentinel_at = [], [], [], [], [], []
    for i, (t, im, w, h, v) in enumerate(rows):
        sentinel_at.append(len(text))
        for row in ((_sentinel(i)["text"], None, None, None, None), (t, im, w, h, v)):
            text.append(row[0])
            image.append(row[1])
            width.append(None if row[2] is None else float(row[2]))
            height.append(None if row[3] is None else float(row[3]))
            video.append(row[4])
    path = Path(tmp) / "fuzz.parquet"
    pq.write_table(pa.table({"text": pa.array(text, pa.string()), "image": pa.array(image, pa.string()),
                             "width": pa.array(width, pa.float64()), "height": pa.array(height, pa.float64()),
                             "video": pa.array(video, pa.string())}), path, row_group_size=3)
    _check(path, sentinel_at, len(text), Path(tmp), allow_input_error=False)


@SETTINGS
@given(data=st.binary(min_size=1, max_size=200))
def test_fuzz_random_files_end_in_our_errors_only(tmp_path_factory, data):
    tmp = tmp_path_factory.getbasetemp()
    for name, head in (("raw.bin", b""), ("raw.jsonl", b'{"text": "a"}\n'), ("raw.json", b"["),
                       ("raw.parquet", b"PAR1")):
        path = Path(tmp) / name
        path.write_bytes(head + data)
        try:
            scan([str(path)], CONFIG, jobs=1, block_size=2)
        except BalancerError:
            pass  # our own error, with its one-line message
    # the same through the CLI: exit 0, or one `Error:` line and exit 1/2; never a traceback
    result = CliRunner().invoke(main, ["scan", str(path), "-o", str(Path(tmp) / "out.parquet"), "--model",
                                       "qwen2-vl", "-j", "1", "-q"], catch_exceptions=False)
    assert result.exit_code in (0, 1, 2) and "Traceback" not in result.output
    if result.exit_code:
        assert result.output.strip().splitlines()[-1].startswith("Error: ")
