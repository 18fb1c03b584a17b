"""Per-record fault isolation: one bad record is that record's error (with a kind), never the scan's end.

Every case here ended the whole scan with a traceback, or lost or shifted rows, before.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from balancer_cli.errors import InputError, SampleError, UsageError
from balancer_cli.scan.measure import INT32_MAX, ScanConfig
from balancer_cli.scan.pipeline import scan
from balancer_cli.scan.records import FIELD_LIMITS, RecordError, parse_record

CONFIG = ScanConfig(model="qwen2-vl", tokenizer="qwen2")
GOOD = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}


def _scan(path: Path, config: ScanConfig = CONFIG, **kwargs):
    return scan([str(path)], config, jobs=1, **kwargs).lengths


def _errors(lengths) -> list:
    return [None if e is None else e.split(":", 1)[0] for e in lengths.errors().tolist()]


def _video(**fields) -> dict:
    return {"video": "v.mp4", "conversations": [{"from": "human", "value": "<video>\nWhat?"}], **fields}


BAD_LINES = {
    "deep_json": "[" * 100_000 + "]" * 100_000,
    "deep_object": '{"text": ' + "[" * 50_000 + "]" * 50_000 + "}",
    "nan_duration": json.dumps(_video(duration="nan")),
    "nan_literal": '{"video": "v.mp4", "duration": NaN, "conversations": [{"from": "human", "value": "<video>"}]}',
    "inf_fps": '{"video": "v.mp4", "duration": 3, "fps": Infinity, "conversations": [{"from": "human", "value": "<video>"}]}',
    "frames_int32": json.dumps(_video(num_frames=1e9)),
    "frames_huge_int": json.dumps(_video(num_frames=10**30)),
    "width_negative": json.dumps({"image": "a.png", "width": -5, "height": 10, "conversations": [
        {"from": "human", "value": "<image>"}]}),
    "width_dict": json.dumps({"image": "a.png", "width": {"a": 1}, "height": 10, "conversations": [
        {"from": "human", "value": "<image>"}]}),
    "nul_in_path": json.dumps({"image": "a\u0000.png", "conversations": [{"from": "human", "value": "<image>"}]}),
    "lone_surrogate": '{"text": "bad \\ud800 text"}',
    "digits": '{"text": "x", "width": ' + "9" * 5000 + "}",
    "not_utf8": b'{"text": "\xff\xfe"}',
}


def test_each_bad_line_is_its_own_error_and_every_good_line_is_measured(tmp_path):
    names = list(BAD_LINES)
    lines = []
    for name in names:
        line = BAD_LINES[name]
        lines += [json.dumps(GOOD).encode(), line if isinstance(line, bytes) else line.encode()]
    lines.append(json.dumps(GOOD).encode())
    data = tmp_path / "d.jsonl"
    data.write_bytes(b"\n".join(lines) + b"\n")
    lengths = _scan(data)
    kinds = _errors(lengths)
    assert len(kinds) == 2 * len(names) + 1  # conservation: every line is a row, in order
    assert kinds[0::2] == [None] * (len(names) + 1)
    bad = dict(zip(names, kinds[1::2]))
    assert all(kind is not None for kind in bad.values()), bad
    assert bad["deep_json"] == bad["deep_object"] == bad["nan_duration"] == "malformed_record"
    assert bad["frames_int32"] == bad["frames_huge_int"] == bad["lone_surrogate"] == "malformed_record"
    good = lengths.tokens("llm")[0::2]
    assert len(set(good.tolist())) == 1 and good[0] > 0  # the bad neighbours changed nothing


def test_strict_mode_raises_the_first_bad_record_as_sample_error(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(GOOD) + "\n" + BAD_LINES["deep_json"] + "\n")
    with pytest.raises(SampleError, match=r"d\.jsonl:2"):
        _scan(data, ScanConfig(strict=True))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1, 10**30, FIELD_LIMITS["num_frames"] + 1, "x", [3]])
def test_numeric_fields_must_be_finite_in_range_numbers(value):
    with pytest.raises(RecordError):
        parse_record(_video(num_frames=value))


def test_fields_at_their_limits_still_parse():
    sample = parse_record(_video(num_frames=FIELD_LIMITS["num_frames"], fps="30", duration=FIELD_LIMITS["duration"]))
    assert (sample.media[0].num_frames, sample.media[0].fps) == (FIELD_LIMITS["num_frames"], 30.0)


def test_a_count_beyond_int32_is_a_too_large_error_not_a_wrapped_value(tmp_path):
    text = "word " * 200
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": text}) + "\n")
    from balancer_cli.scan import measure

    assert measure.INT32_MAX == INT32_MAX == 2**31 - 1
    original = measure.INT32_MAX
    measure.INT32_MAX = 10  # the same check, at a size a test can reach
    try:
        kinds = _errors(_scan(data))
    finally:
        measure.INT32_MAX = original
    assert kinds == ["too_large"]


def test_a_jsonl_with_a_utf8_bom_keeps_its_first_record(tmp_path):
    data = tmp_path / "bom.jsonl"
    data.write_bytes(b"\xef\xbb\xbf" + (json.dumps(GOOD) + "\n").encode() * 3)
    lengths = _scan(data)
    assert _errors(lengths) == [None, None, None]


def test_a_json_list_with_a_deep_element_keeps_every_row(tmp_path):
    data = tmp_path / "d.json"
    data.write_text("[" + json.dumps(GOOD) + ", " + "[" * 5000 + "]" * 5000 + ", " + json.dumps(GOOD) + "]")
    assert _errors(_scan(data)) == [None, "malformed_record", None]


def test_a_parquet_file_with_no_known_column_is_one_input_error(tmp_path):
    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"foo": [1, 2], "bar": ["a", "b"]}), path)
    with pytest.raises(InputError, match=r"x\.parquet: no column the scan understands \(columns: foo, bar\)"):
        _scan(path)


def test_a_corrupt_data_page_behind_a_valid_footer_is_one_input_error(tmp_path):
    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"text": [f"sample {i} " * 20 for i in range(200)]}), path, compression="snappy")
    data = bytearray(path.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little") + 8
    for i in range(8, len(data) - footer):  # every data byte, footer untouched
        data[i] = 0xAB
    path.write_bytes(bytes(data))
    with pytest.raises(InputError, match=r"x\.parquet: unreadable Parquet rows 1\.\.200"):
        _scan(path)


def test_rule_parameters_are_bounded():
    with pytest.raises(UsageError, match="max_tiles=1,000,000 is above 1,024"):
        ScanConfig(model="internvl", model_params=(("max_tiles", 1_000_000),))
    with pytest.raises(UsageError, match="not a finite number"):
        ScanConfig(model_params=(("max_pixels", float("nan")),))
    with pytest.raises(UsageError, match="video size"):
        ScanConfig(video_size=(0, 10))
    ScanConfig(model="internvl", model_params=(("max_tiles", 1024),)).rule()  # the limit itself runs


def test_a_first_line_nested_too_deeply_is_detected_as_jsonl_and_is_its_own_error(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": ' + "[" * 50_000 + "]" * 50_000 + "}\n" + json.dumps(GOOD) + "\n")
    assert _errors(_scan(data)) == ["malformed_record", None]


def test_a_record_removed_while_scanning_is_an_input_error_not_a_shift(tmp_path):
    from balancer_cli.scan.blocks import iter_blocks
    from balancer_cli.scan.measure import measure_block

    data = tmp_path / "d.jsonl"
    data.write_text((json.dumps(GOOD) + "\n") * 4)
    (block,) = iter_blocks([str(data)])
    data.write_text(json.dumps(GOOD) + "\n" + " " * (data.stat().st_size - len(json.dumps(GOOD)) - 1))
    with pytest.raises(InputError, match="1 records read where 4 were counted"):
        measure_block(block, CONFIG)


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="needs FIFOs")
def test_a_fifo_or_a_nul_path_as_input_is_an_input_error_not_a_hang(tmp_path):
    import os

    os.mkfifo(tmp_path / "pipe.jsonl")
    with pytest.raises(InputError, match="not a regular file"):
        _scan(tmp_path / "pipe.jsonl")
    with pytest.raises(InputError):
        _scan(Path(str(tmp_path / "a") + "\x00.jsonl"))


@pytest.mark.parametrize("first", ["[1]", "[]", '{"text": "a"', '{"text": "a"}\u0000', "garbage", '"a string"',
                                   '{"a": 1} {"b": 2}', '{"w": ' + "9" * 5000 + "}"])
def test_a_bad_first_line_is_that_records_error_not_the_files(tmp_path, first):
    """The format was told by the first line alone: a list there made the file a JSON list (its
    records after the list lost, exit 0), a broken object or text ended the scan. Records on the
    next lines make it JSON lines, whose first record is broken."""
    data = tmp_path / "d.data"  # no .jsonl suffix: the content decides
    data.write_text(first + "\n" + (json.dumps(GOOD) + "\n") * 2)
    lengths = _scan(data)
    assert _errors(lengths) == ["malformed_record", None, None]
    assert "; fix: " in lengths.errors().tolist()[0]  # a row error names its fix too


def test_a_json_list_followed_by_more_data_is_refused_not_cut(tmp_path):
    for text in ("[" + json.dumps(GOOD) + "][" + json.dumps(GOOD) + "]", "[" + json.dumps(GOOD) + "] trailing text",
                 "[\n" + json.dumps(GOOD) + "\n]\n" + json.dumps(GOOD)):
        data = tmp_path / "d.json"
        data.write_text(text)
        with pytest.raises(InputError, match=r"d\.json:\d+: not a valid JSON list \(more data after the list"):
            _scan(data)
    data.write_text("[" + json.dumps(GOOD) + "]\n \n")  # whitespace after the list is fine
    assert _errors(_scan(data)) == [None]


def test_a_one_line_file_that_is_no_json_is_a_jsonl_record_by_its_name(tmp_path):
    (tmp_path / "one.jsonl").write_text('{"text": "a"')
    assert _errors(_scan(tmp_path / "one.jsonl")) == ["malformed_record"]
    (tmp_path / "one.json").write_text('{"text": "a"')
    with pytest.raises(InputError, match="neither JSONL nor a valid JSON document"):
        _scan(tmp_path / "one.json")
