"""`balancer scan --hf-builder`: datasets.load_dataset over local files, offline, same table as our readers."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from PIL import Image

from balancer_cli.cli import main
from balancer_cli.lengths import read_lengths

SIZES = [(320, 240), (1024, 768), (64, 900), (500, 500)]


@pytest.fixture(autouse=True)
def _hf_cache(tmp_path, monkeypatch):
    # load_dataset writes its Arrow cache here instead of the user's ~/.cache.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def _run(*args: str):
    return CliRunner().invoke(main, ["scan", *args, "--model", "qwen2-vl", "--tokenizer", "qwen2", "-j", "1",
                                     "-q", "--json"], catch_exceptions=False)


def _records() -> list[dict]:
    return [{"file_name": f"img{i}.png",
             "conversations": [{"from": "human", "value": f"<image>\nDescribe picture {i}." + " more" * i},
                               {"from": "gpt", "value": "A plain square of colour." * (i + 1)}]}
            for i in range(len(SIZES))]


@pytest.fixture()
def imagefolder(tmp_path: Path) -> Path:
    """A tiny `imagefolder` dataset: PNGs of several sizes plus metadata.jsonl with conversations."""
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i, size in enumerate(SIZES):
        Image.new("RGB", size, (10 * i, 20, 30)).save(folder / f"img{i}.png")
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    return folder


def _table(path: Path):
    lengths = read_lengths(path)
    return lengths.table.drop_columns(["source"]), lengths


def test_imagefolder_matches_jsonl_reader(imagefolder, tmp_path):
    via_hf = _run(str(imagefolder), "--hf-builder", "imagefolder", "-o", str(tmp_path / "hf.parquet"))
    assert via_hf.exit_code == 0, via_hf.output
    summary = json.loads(via_hf.output)
    assert summary["samples"] == len(SIZES) and summary["errors"] == {}
    via_jsonl = _run(str(imagefolder / "metadata.jsonl"), "--field", "image=file_name",
                     "-o", str(tmp_path / "jsonl.parquet"))
    assert via_jsonl.exit_code == 0, via_jsonl.output
    hf_table, hf_lengths = _table(tmp_path / "hf.parquet")
    jsonl_table, jsonl_lengths = _table(tmp_path / "jsonl.parquet")
    assert hf_table.equals(jsonl_table)
    assert hf_lengths.fingerprint == jsonl_lengths.fingerprint
    # The images were measured from the Image column's bytes: a 1024x768 image is not a 320x240 one.
    assert len(set(hf_lengths.tokens("vision").tolist())) == len(SIZES)
    inputs = json.loads(pq.read_schema(tmp_path / "hf.parquet").metadata[b"balancer"])["inputs"]
    assert inputs[0]["builder"] == "imagefolder" and inputs[0]["num_samples"] == len(SIZES)


def test_parquet_builder_with_embedded_image_bytes(imagefolder, tmp_path):
    rows = {"image": [{"bytes": (imagefolder / r["file_name"]).read_bytes(), "path": None} for r in _records()],
            "conversations": [r["conversations"] for r in _records()]}
    features = datasets.Features({"image": datasets.Image(),
                                  "conversations": [{"from": datasets.Value("string"),
                                                     "value": datasets.Value("string")}]})
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(tmp_path / "embedded.parquet"))
    images = pq.read_table(tmp_path / "embedded.parquet").column("image").to_pylist()
    assert all(image["bytes"] for image in images)
    result = _run(str(tmp_path / "embedded.parquet"), "--hf-builder", "parquet", "-o", str(tmp_path / "b.parquet"))
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["errors"] == {}
    ours = _run(str(tmp_path / "embedded.parquet"), "-o", str(tmp_path / "ours.parquet"))
    assert ours.exit_code == 0, ours.output
    assert _table(tmp_path / "b.parquet")[0].equals(_table(tmp_path / "ours.parquet")[0])
    assert len(set(read_lengths(tmp_path / "b.parquet").tokens("vision").tolist())) == len(SIZES)


def test_json_builder_matches_json_reader_and_globs(imagefolder, tmp_path):
    records = [{**r, "image": r.pop("file_name")} for r in _records()]
    data = tmp_path / "data"
    data.mkdir()
    for name in ("a", "b"):
        (data / f"{name}.json").write_text(json.dumps(records))
    for i, size in enumerate(SIZES):  # relative image paths resolve against the input's folder
        (data / f"img{i}.png").write_bytes((imagefolder / f"img{i}.png").read_bytes())
    assert _run(str(data / "a.json"), "--hf-builder", "json", "-o", str(tmp_path / "hf.parquet")).exit_code == 0
    assert _run(str(data / "a.json"), "-o", str(tmp_path / "ours.parquet")).exit_code == 0
    hf_table, hf_lengths = _table(tmp_path / "hf.parquet")
    ours_table, ours_lengths = _table(tmp_path / "ours.parquet")
    assert hf_table.equals(ours_table)
    hf_input, ours_input = hf_lengths.metadata["inputs"][0], ours_lengths.metadata["inputs"][0]
    assert hf_input["file_fingerprint"] == ours_input["file_fingerprint"]  # a single file: its own fingerprint
    both = _run(str(data / "*.json"), "--hf-builder", "json", "-o", str(tmp_path / "glob.parquet"))
    assert both.exit_code == 0, both.output
    assert json.loads(both.output)["samples"] == 2 * len(SIZES)
    glob_lengths = read_lengths(tmp_path / "glob.parquet")
    assert glob_lengths.llm_tokens().tolist() == 2 * read_lengths(tmp_path / "ours.parquet").llm_tokens().tolist()


def test_hub_names_and_bad_inputs_fail_clearly_without_network(tmp_path):
    hub = _run("some-user/some-dataset", "--hf-builder", "some-user/some-dataset", "-o", str(tmp_path / "x.parquet"))
    assert hub.exit_code == 2
    assert "needs the network" in hub.output and "huggingface-cli download" in hub.output
    missing = _run("some-user/some-dataset", "--hf-builder", "parquet", "-o", str(tmp_path / "x.parquet"))
    assert missing.exit_code == 1 and "no local file matches" in missing.output
    url = _run("https://example.com/d.jsonl", "--hf-builder", "json", "-o", str(tmp_path / "x.parquet"))
    assert url.exit_code == 1 and "local files only" in url.output
    bad = tmp_path / "bad.csv"
    bad.write_text("text\n\"unterminated\n")
    both = _run(str(bad), "--hf-builder", "json", "--format", "jsonl", "-o", str(tmp_path / "x.parquet"))
    assert both.exit_code == 2 and "cannot be combined" in both.output
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a"}\n{not json\n')
    failed = _run(str(broken), "--hf-builder", "json", "-o", str(tmp_path / "x.parquet"))
    assert failed.exit_code == 1 and "datasets.load_dataset('json') failed" in failed.output
    assert not (tmp_path / "x.parquet").exists()
