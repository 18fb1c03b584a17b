"""Input formats of `balancer scan`: detection, every reader, record shapes, meta files, concatenation."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from balancer_cli.errors import InputError, UsageError
from balancer_cli.scan.pipeline import scan
from balancer_cli.scan.measure import ScanConfig
from balancer_cli.scan.blocks import iter_blocks
from balancer_cli.scan.inputs import detect_format, expand_inputs
from balancer_cli.scan.readers import read_block
from balancer_cli.scan.records import RecordError, parse_record
from balancer_cli.scan.rules.registry import get_rule

CONFIG = ScanConfig(model="qwen2-vl", tokenizer="qwen2")


def _conv(question: str, answer: str) -> list[dict]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


def _png(path: Path, width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, "PNG")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buffer.getvalue())
    return buffer.getvalue()


@pytest.fixture()
def dataset(tmp_path: Path) -> tuple[Path, list[dict]]:
    """Five LLaVA records over real image files of different sizes (and one text-only record)."""
    sizes = [(640, 480), (33, 900), (1920, 1080), (448, 448)]
    for i, (w, h) in enumerate(sizes):
        _png(tmp_path / "imgs" / f"{i}.png", w, h)
    records = [
        {"id": "a", "image": "imgs/0.png", "conversations": _conv("<image>\nWhat is it?", "A red card.")},
        {"id": "b", "image": ["imgs/1.png", "imgs/2.png"], "conversations": _conv("<image> vs <image>", "Same.")},
        {"id": "c", "conversations": _conv("Only text here.", "Fine.")},
        {"id": "d", "image": "imgs/3.png", "conversations": _conv("Describe.", "Red.")},
        {"id": "e", "image": "imgs/0.png", "width": 640, "height": 480, "conversations": _conv("<image>\nSize?", "4:3")},
    ]
    return tmp_path, records


def _lengths(paths, **kwargs):
    return scan([str(p) for p in paths], kwargs.pop("config", CONFIG), jobs=1, **kwargs).lengths


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_detects_every_format(dataset, tmp_path):
    root, records = dataset
    jsonl = _write_jsonl(root / "d.jsonl", records)
    listed = root / "d.json"
    listed.write_text(json.dumps(records, indent=2))
    meta = root / "meta.json"
    meta.write_text(json.dumps({"mine": {"root": str(root), "annotation": str(jsonl), "repeat_time": 1}}, indent=2))
    parquet = root / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "hi"}]), parquet)
    assert [detect_format(str(p)) for p in (jsonl, listed, meta, parquet)] == ["jsonl", "json", "internvl-meta",
                                                                               "parquet"]
    (root / "empty.jsonl").write_text("\n \n")
    with pytest.raises(InputError, match="empty"):
        detect_format(str(root / "empty.jsonl"))
    (root / "x.csv").write_text("a,b\n1,2\n")
    with pytest.raises(InputError, match="cannot detect the input format") as info:
        detect_format(str(root / "x.csv"))
    assert "--format" in info.value.fix
    with pytest.raises(InputError, match="no such file"):
        expand_inputs([str(root / "missing.jsonl")])
    with pytest.raises(InputError, match="not a `datasets` save_to_disk folder"):
        detect_format(str(root / "imgs"))


def test_jsonl_json_list_and_meta_agree(dataset):
    root, records = dataset
    jsonl = _write_jsonl(root / "d.jsonl", records)
    listed = root / "d.json"
    listed.write_text(json.dumps(records, indent=2))
    meta = root / "meta.json"
    meta.write_text(json.dumps({"mine": {"root": str(root), "annotation": str(jsonl), "repeat_time": 1}}))
    a, b, c = (_lengths([p]) for p in (jsonl, listed, meta))
    assert a.llm_tokens().tolist() == b.llm_tokens().tolist() == c.llm_tokens().tolist()
    assert a.ok_mask().all()
    rule = get_rule("qwen2-vl")
    expected_vision = [rule.count_image(640, 480).encoder_tokens,
                       rule.count_image(33, 900).encoder_tokens + rule.count_image(1920, 1080).encoder_tokens,
                       0, rule.count_image(448, 448).encoder_tokens, rule.count_image(640, 480).encoder_tokens]
    assert a.tokens("vision").tolist() == expected_vision
    assert a.items("vision").tolist() == [1, 2, 0, 1, 1]
    assert a.table.column("vision_seqlens").to_pylist()[1] == [rule.count_image(33, 900).encoder_tokens,
                                                               rule.count_image(1920, 1080).encoder_tokens]
    # Record "d" has no placeholder: the image goes first, like "<image>\nDescribe." would.
    explicit = _write_jsonl(root / "e.jsonl", [{"image": "imgs/3.png", "conversations": _conv("<image>\nDescribe.", "Red.")}])
    assert _lengths([explicit]).llm_tokens()[0] == a.llm_tokens()[3]
    assert c.sources().tolist() == ["mine"] * 5 and a.sources().tolist() == ["d.jsonl"] * 5


def test_parquet_and_datasets_inputs(dataset):
    import datasets

    root, records = dataset
    baseline = _lengths([_write_jsonl(root / "d.jsonl", records)])
    # Parquet: conversations as list<struct>, images as paths (list column), several row groups.
    rows = [{"image": r.get("image") if isinstance(r.get("image"), list) else ([r["image"]] if "image" in r else []),
             "conversations": r["conversations"], "id": r["id"]} for r in records]
    pq.write_table(pa.Table.from_pylist(rows), root / "d.parquet", row_group_size=2)
    from_parquet = _lengths([root / "d.parquet"], block_size=3)
    assert from_parquet.llm_tokens().tolist() == baseline.llm_tokens().tolist()
    # Parquet as Hugging Face exports it: images as {"bytes", "path"} structs, sizes from the bytes.
    exported = [{"images": [{"bytes": (root / p).read_bytes(), "path": p} for p in row["image"]],
                 "conversations": row["conversations"]} for row in rows]
    pq.write_table(pa.Table.from_pylist(exported), root / "hf_export.parquet")
    assert _lengths([root / "hf_export.parquet"]).llm_tokens().tolist() == baseline.llm_tokens().tolist()
    # datasets: HF Image feature (embedded bytes: no file is opened) and width/height columns.
    hf_rows = {"image": [], "conversations": [], "width": [], "height": []}
    for r in records[:1] + records[3:]:
        path = root / (r["image"] if isinstance(r["image"], str) else r["image"][0])
        hf_rows["image"].append({"bytes": path.read_bytes(), "path": None})
        hf_rows["conversations"].append(r["conversations"])
        hf_rows["width"].append(None)  # null size columns: the size comes from the embedded bytes
        hf_rows["height"].append(None)
    features = datasets.Features({"image": datasets.Image(), "conversations": [{"from": datasets.Value("string"),
                                                                                 "value": datasets.Value("string")}],
                                  "width": datasets.Value("int32"), "height": datasets.Value("int32")})
    ds = datasets.Dataset.from_dict(hf_rows, features=features)
    ds.save_to_disk(str(root / "hf"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(root / "hfdict"))
    assert detect_format(str(root / "hf")) == "hf"
    from_hf = _lengths([root / "hf"])
    assert from_hf.llm_tokens().tolist() == [baseline.llm_tokens()[i] for i in (0, 3, 4)]
    assert _lengths([root / "hfdict"], split="test").num_samples == 1
    with pytest.raises(UsageError, match="no split 'val'"):
        _lengths([root / "hfdict"], split="val")
    # A datasets cache .arrow file (what load_dataset over local files writes).
    arrow = next((root / "hf").glob("*.arrow"))
    assert _lengths([arrow]).llm_tokens().tolist() == from_hf.llm_tokens().tolist()


def test_messages_records_and_image_pools(dataset):
    root, _ = dataset
    records = [
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "imgs/0.png"},
                                                   {"type": "text", "text": "What is it?"}]},
                      {"role": "assistant", "content": "A red card."}]},
        {"messages": [{"role": "user", "content": "<image>\nWhat is it?"}, {"role": "assistant", "content": "A red card."}],
         "images": ["imgs/0.png"]},
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nWhat is it?"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "A red card."}]}],
         "images": [{"path": "imgs/0.png", "width": 640, "height": 480}]},
    ]
    lengths = _lengths([_write_jsonl(root / "m.jsonl", records)])
    llava = _lengths([_write_jsonl(root / "l.jsonl", [{"image": "imgs/0.png",
                                                       "conversations": _conv("<image>\nWhat is it?", "A red card.")}])])
    assert lengths.ok_mask().all()
    assert lengths.llm_tokens()[1] == lengths.llm_tokens()[2] == llava.llm_tokens()[0]
    assert lengths.llm_tokens()[0] == llava.llm_tokens()[0] - 1  # no "\n" after the image in record 0
    assert lengths.tokens("vision").tolist() == [llava.tokens("vision")[0]] * 3


def test_parse_record_errors():
    with pytest.raises(RecordError, match="expected an object"):
        parse_record([1, 2])
    with pytest.raises(RecordError, match="2 <image> placeholder"):
        parse_record({"image": "a.png", "conversations": _conv("<image><image>", "x")})
    with pytest.raises(RecordError, match="no 'conversations'"):
        parse_record({"id": 3})
    with pytest.raises(RecordError, match="width="):
        parse_record({"image": {"path": "a.png", "width": "wide"}, "text": "x"})
    with pytest.raises(RecordError, match="image_sizes"):
        parse_record({"image": ["a.png", "b.png"], "image_sizes": [[1, 2]], "text": "x"})
    sample = parse_record({"img": "a.png", "w": 10, "h": 20, "caption": "hi"},
                          {"image": "img", "width": "w", "height": "h", "text": "caption"})
    assert (sample.media[0].ref, sample.media[0].width, sample.media[0].height) == ("a.png", 10, 20)


def test_internvl_meta_repeat_root_and_overrides(dataset):
    root, records = dataset
    (root / "ann").mkdir()
    jsonl = _write_jsonl(root / "ann" / "d.jsonl", records)
    meta = root / "meta.json"
    meta.write_text(json.dumps({
        "twice": {"root": str(root), "annotation": str(jsonl), "repeat_time": 2},
        "half": {"root": str(root), "annotation": str(jsonl), "repeat_time": 0.5, "max_dynamic_patch": 1},
    }))
    config = ScanConfig(model="internvl", tokenizer="qwen2")
    lengths = _lengths([meta], config=config, block_size=2)
    assert lengths.num_samples == 5 * 2 + 2
    assert lengths.sources().tolist() == ["twice"] * 10 + ["half"] * 2
    assert lengths.llm_tokens()[:5].tolist() == lengths.llm_tokens()[5:10].tolist()
    items = lengths.items("vision")
    assert items[0] > 1 and items[10] == 1  # max_dynamic_patch=1: a single tile, no thumbnail
    assert lengths.ok_mask().all()


def test_several_inputs_concatenate_in_order(dataset):
    root, records = dataset
    first = _write_jsonl(root / "first.jsonl", records[:2])
    second = root / "second.json"
    second.write_text(json.dumps(records[2:]))
    both = _lengths([first, second], block_size=1)
    assert both.table.column("sample").to_pylist() == list(range(5))
    assert both.sources().tolist() == ["first.jsonl"] * 2 + ["second.json"] * 3
    assert both.llm_tokens().tolist() == _lengths([first]).llm_tokens().tolist() + _lengths([second]).llm_tokens().tolist()


def test_blocks_and_lines(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n\n{"text": "b"}\nnot json\n{"text": "c"}\n')
    blocks = list(iter_blocks([str(data)], block_size=2))
    assert [(b.first_sample, b.num_records, b.first_line) for b in blocks] == [(0, 2, 1), (2, 2, 4)]
    lines = [line for block in blocks for line, _ in read_block(block)]
    assert lines == [1, 3, 4, 5]
    pretty = tmp_path / "p.json"
    pretty.write_text('[\n  {"text": "a"},\n  {"text":\n   "b"},\n  3\n]\n')
    lengths = scan([str(pretty)], CONFIG, jobs=1, block_size=2).lengths
    assert lengths.errors()[2].startswith(f"malformed_record: {pretty}:5: record is a JSON int")
    pretty.write_text('[\n  {"text": "a"},\n  {"text": }\n]\n')
    with pytest.raises(InputError, match=r"p.json:3: not a valid JSON list"):
        list(iter_blocks([str(pretty)]))


def test_a_forced_format_or_field_that_names_nothing_is_refused(tmp_path):
    """``--format hf`` on a JSONL file read as datasets' own 'Directory ... is neither a Dataset
    directory', ``--format internvl-meta`` on a folder as '[Errno 21] Is a directory'; a ``--field``
    naming no column of a Parquet table found no images, silently."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n')
    with pytest.raises(InputError, match=r"d\.jsonl: a file, and --format hf reads a datasets save_to_disk folder"):
        expand_inputs([str(data)], format="hf")
    with pytest.raises(InputError, match="a folder, and --format internvl-meta reads a file"):
        expand_inputs([str(tmp_path)], format="internvl-meta")
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["a"], "file_name": ["x.png"]}), table)
    config = ScanConfig(model="qwen2-vl", tokenizer="qwen2", fields=(("image", "nope"),))
    with pytest.raises(InputError, match=r"--field image=nope names no column of the table \(columns: text, file_name"):
        scan([str(table)], config, jobs=1)
    mapped = ScanConfig(model="qwen2-vl", tokenizer="qwen2", fields=(("image", "file_name"),))
    assert scan([str(table)], mapped, jobs=1).lengths.errors().tolist()[0].startswith("missing_file")


def test_an_empty_media_path_is_that_records_error(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"image": "", "conversations": [{"from": "human", "value": "<image>hi"}]}\n')
    (error,) = scan([str(data)], ScanConfig(model="qwen2-vl", tokenizer="qwen2"), jobs=1).lengths.errors().tolist()
    assert error.startswith("malformed_record: ") and "image path is empty ('')" in error and "; fix: " in error
