"""`balancer scan` end to end through the CLI: sample_data, bad inputs, strict mode, exit codes, outputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from PIL import Image

from balancer_cli.cli import main
from balancer_cli.lengths import read_lengths
from balancer_cli.scan.rules.registry import get_rule

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "sample_data"


def _run(*args: str):
    return CliRunner().invoke(main, ["scan", *args], catch_exceptions=False)


def _conv(question: str, answer: str = "ok") -> list[dict]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


@pytest.fixture()
def bad_dataset(tmp_path: Path) -> Path:
    """One good record, then one record per kind of bad input."""
    images = tmp_path / "root" / "images"
    images.mkdir(parents=True)
    Image.new("RGB", (320, 240), (1, 2, 3)).save(images / "ok.png")
    (images / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 10)
    (images / "notes.png").write_bytes(b"this is text, not an image at all" * 3)
    (tmp_path / "secret.png").write_bytes((images / "ok.png").read_bytes())
    lines = [
        json.dumps({"image": "images/ok.png", "conversations": _conv("<image>\nOK?")}),           # 1 good
        json.dumps({"image": "images/missing.png", "conversations": _conv("<image>\nWhere?")}),   # 2 missing
        json.dumps({"image": "images/corrupt.png", "conversations": _conv("<image>\nBroken?")}),  # 3 corrupt
        json.dumps({"image": "../../etc/passwd", "conversations": _conv("<image>\nEscape?")}),    # 4 escape
        json.dumps({"image": "../secret.png", "conversations": _conv("<image>\nEscape?")}),       # 5 escape
        "{not json",                                                                               # 6 malformed
        json.dumps(["a", "list"]),                                                                 # 7 malformed
        json.dumps({"image": "images/notes.png", "conversations": _conv("<image>\nText?")}),      # 8 not an image
        json.dumps({"image": "x.png", "width": 4000, "height": 10, "conversations": _conv("<image>")}),  # 9 rejected
        json.dumps({"video": {"fps": 2.0}, "conversations": _conv("<video>\nNo duration")}),      # 10 no metadata
    ]
    data = tmp_path / "root" / "bad.jsonl"
    data.write_text("\n".join(lines) + "\n")
    return data


def test_main_command_on_sample_data(tmp_path):
    out = tmp_path / "out" / "lengths.parquet"
    result = _run(str(SAMPLE / "llava.jsonl"), str(SAMPLE / "messages.json"), "-o", str(out),
                  "--model", "qwen2-vl", "--tokenizer", "qwen2", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    lengths = read_lengths(out)
    n_lines = sum(1 for line in (SAMPLE / "llava.jsonl").read_text().splitlines() if line.strip())
    n_messages = len(json.loads((SAMPLE / "messages.json").read_text()))
    assert lengths.num_samples == summary["samples"] == n_lines + n_messages
    assert set(summary["errors"]) >= {"missing_file", "path_escape", "malformed_record"}
    assert summary["measured"] + sum(summary["errors"].values()) == lengths.num_samples
    assert set(lengths.modules) == {"vision", "video", "audio"}
    assert (lengths.llm_tokens()[lengths.ok_mask()] > 0).all()
    meta = lengths.metadata
    assert meta["schema_version"] == 1 and meta["tool_version"] and meta["template"] == "qwen2-vl"
    assert meta["model"]["preset"] == "qwen2-vl" and meta["model"]["params"]["max_pixels"] == 12845056
    assert meta["tokenizer"]["spec"] == "qwen2" and meta["tokenizer"]["fingerprint"]
    assert [i["source"] for i in meta["inputs"]] == ["llava.jsonl", "messages.json"]
    assert all(i["size_bytes"] > 0 and len(i["file_fingerprint"]) == 32 for i in meta["inputs"])
    assert [i["num_samples"] for i in meta["inputs"]] == [n_lines, n_messages]
    text = _run(str(SAMPLE / "llava.jsonl"), "-o", str(out), "--model", "qwen2-vl", "-q")
    assert text.exit_code == 0 and "errors" in text.output and "first path_escape:" in text.output


def test_every_bad_input_keeps_its_row(bad_dataset, tmp_path):
    out = tmp_path / "lengths.parquet"
    result = _run(str(bad_dataset), "-o", str(out), "--model", "qwen2-vl", "--json")
    assert result.exit_code == 0, result.output
    errors = read_lengths(out).errors().tolist()
    assert errors[0] is None and all(e is not None for e in errors[1:])
    kinds = [e.split(":", 1)[0] for e in errors[1:]]
    assert kinds == ["missing_file", "corrupt_image", "path_escape", "path_escape", "malformed_record",
                     "malformed_record", "unsupported_image", "rejected_by_model", "missing_video_metadata"]
    for line, error in enumerate(errors[1:], start=2):
        assert f"{bad_dataset}:{line}: " in error  # where: file and line
    assert "images/missing.png" in errors[1] and "'../../etc/passwd'" in errors[3]
    summary = json.loads(result.output)
    assert summary["errors"] == {"corrupt_image": 1, "malformed_record": 2, "missing_file": 1,
                                 "missing_video_metadata": 1, "path_escape": 2, "rejected_by_model": 1,
                                 "unsupported_image": 1}


def test_strict_stops_with_one_line_and_no_output(bad_dataset, tmp_path):
    out = tmp_path / "lengths.parquet"
    result = CliRunner().invoke(main, ["scan", str(bad_dataset), "-o", str(out), "--model", "qwen2-vl", "--strict"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {bad_dataset}:2: image not found: images/missing.png")
    assert "Traceback" not in result.output and not out.exists()
    # With workers too (several blocks): same message.
    result = CliRunner().invoke(main, ["scan", str(bad_dataset), "-o", str(out), "--model", "qwen2-vl", "--strict",
                                       "-j", "2", "--block-size", "1"])
    assert result.exit_code == 1 and result.output.strip().splitlines()[0].startswith(f"Error: {bad_dataset}:2: ")


def test_atomic_output_leaves_previous_file_untouched(bad_dataset, tmp_path):
    out = tmp_path / "lengths.parquet"
    out.write_bytes(b"previous")
    result = CliRunner().invoke(main, ["scan", str(bad_dataset), "-o", str(out), "--model", "qwen2-vl", "--strict"])
    assert result.exit_code == 1 and out.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lengths.parquet", "root", "secret.png"]


@pytest.mark.parametrize("args, code, message", [
    (["--model", "gpt-9"], 2, "unknown vision preset 'gpt-9'"),
    (["--model", "qwen2-vl", "--tokenizer", "nope"], 2, "neither a named vocabulary"),
    (["--model", "qwen2-vl", "--template", "nope"], 2, "unknown chat template"),
    (["--model", "qwen2-vl", "--param", "warp=3"], 2, "has no parameter 'warp'"),
    (["--model", "qwen2-vl", "--video-size", "big"], 2, "WIDTHxHEIGHT"),
    (["--model", "qwen2-vl", "--field", "colour=c"], 2, "--field"),
    (["--model", "qwen2-vl", "--engine", "warp"], 2, "unknown --engine 'warp'"),
    # each named no fix before
    (["--model", "qwen2-vl", "--video-size", "0x0"], 2, "--video-size '0x0' must be positive"),
    (["--model", "qwen2-vl", "--param", "max_pixels=-1"], 2, "max_pixels=-1 must be >= 1"),
    (["--model", "qwen2-vl", "--param", "max_pixels=abc"], 2, "max_pixels='abc' must be of type int"),
    (["--model", "qwen2-vl", "--param", "min_pixels=99999999999"], 2, "min_pixels=99999999999 exceeds max_pixels"),
    (["--model", "qwen2-vl", "--param", "frame_sampler=x"], 2, "frame_sampler='x' is not one of"),
    (["--model", "qwen2-vl", "--block-size", "0"], 2, "--block-size 0 must be >= 1"),
])
def test_usage_errors_exit_2(args, code, message, tmp_path):
    result = CliRunner().invoke(main, ["scan", str(SAMPLE / "messages.json"), "-o", str(tmp_path / "x.parquet"), *args])
    assert result.exit_code == code, result.output
    assert result.output.startswith("Error: ") and message in result.output and "fix: " in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_input_errors_exit_1(tmp_path):
    out = str(tmp_path / "x.parquet")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "data.bin").write_bytes(b"\x00\x01garbage")
    (tmp_path / "broken.json").write_text('[{"text": "a"},')
    for name, message in (("missing.jsonl", "no such file"), ("empty.jsonl", "empty"),
                          ("data.bin", "cannot detect the input format"), ("broken.json", "not a valid JSON list")):
        result = CliRunner().invoke(main, ["scan", str(tmp_path / name), "-o", out, "--model", "qwen2-vl"])
        assert result.exit_code == 1, (name, result.output)
        assert result.output.startswith("Error: ") and message in result.output and "fix: " in result.output
        assert len(result.output.strip().splitlines()) == 1
    assert not Path(out).exists()
    (tmp_path / "x.parquet.parts").write_text("mine")  # where the ray engine keeps its blocks
    result = CliRunner().invoke(main, ["scan", str(SAMPLE / "messages.json"), "-o", out, "--model", "qwen2-vl",
                                       "--engine", "ray"])
    assert result.exit_code == 1 and "x.parquet.parts (the ray engine's work folder for" in result.output
    assert (tmp_path / "x.parquet.parts").read_text() == "mine"
    missing = CliRunner().invoke(main, ["scan", "-o", out, "--model", "qwen2-vl"])
    assert missing.exit_code == 2


def test_deterministic_and_independent_of_jobs(tmp_path):
    args = [str(SAMPLE / "llava.jsonl"), str(SAMPLE / "messages.json"), "--model", "internvl", "-q",
            "--block-size", "40"]
    outputs = []
    for name, jobs in (("a", "1"), ("b", "1"), ("c", "2")):
        out = tmp_path / f"{name}.parquet"
        assert _run(*args, "-o", str(out), "-j", jobs).exit_code == 0
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1] == outputs[2]
    table = pq.read_table(tmp_path / "a.parquet")
    assert table.column("sample").to_pylist() == list(range(table.num_rows))


def test_rule_overrides_processor_config_and_video_size(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"image": "a.png", "width": 1920, "height": 1080, "conversations": _conv("<image>")}) + "\n"
                    + json.dumps({"video": "v.mp4", "duration": 10.0, "conversations": _conv("<video>")}) + "\n"
                    + json.dumps({"audio": {"path": "a.wav", "duration": 3.3}, "conversations": _conv("<audio>")}) + "\n")

    def vision(*extra: str) -> tuple[list, list, list]:
        out = tmp_path / "o.parquet"
        assert _run(str(data), "-o", str(out), "--model", "qwen2-vl", "-q", *extra).exit_code == 0
        lengths = read_lengths(out)
        return lengths.tokens("vision").tolist(), lengths.tokens("video").tolist(), lengths.tokens("audio").tolist()

    rule = get_rule("qwen2-vl")
    images, videos, audio = vision()
    assert images[0] == rule.count_image(1920, 1080).encoder_tokens
    assert videos[1] == rule.count_video(0, 640, 360, duration_s=10.0).encoder_tokens
    assert audio[2] == 165  # ceil(3.3 s x 50 frames/s)
    small = get_rule("qwen2-vl", max_pixels=200_000).count_image(1920, 1080).encoder_tokens
    assert vision("--max-pixels", "200000")[0][0] == small
    config = tmp_path / "preprocessor_config.json"
    config.write_text(json.dumps({"min_pixels": 3136, "max_pixels": 200000, "patch_size": 14}))
    assert vision("--processor-config", str(config))[0][0] == small
    assert vision("--video-size", "1280x720")[1][1] == rule.count_video(0, 1280, 720, duration_s=10.0).encoder_tokens


def test_image_root_and_field_mapping(tmp_path):
    shutil.copytree(SAMPLE / "images", tmp_path / "pics")
    data = tmp_path / "ann" / "d.jsonl"
    data.parent.mkdir()
    data.write_text(json.dumps({"file": "img_12_448x448.png", "caption": "A square."}) + "\n")
    out = tmp_path / "o.parquet"
    result = _run(str(data), "-o", str(out), "--model", "qwen2-vl", "--image-root", str(tmp_path / "pics"),
                  "--field", "image=file", "--field", "text=caption", "-q")
    assert result.exit_code == 0
    assert read_lengths(out).tokens("vision").tolist() == [get_rule("qwen2-vl").count_image(448, 448).encoder_tokens]


def test_list_valued_param_overrides_the_rule(tmp_path):
    """``--param image_grid_pinpoints=[[h, w], ...]``: a JSON list reaches the rule (was an unhashable crash)."""
    out = tmp_path / "x.parquet"
    result = _run(str(SAMPLE / "llava.jsonl"), "-o", str(out), "--model", "llava-next", "-q",
                  "--param", "image_grid_pinpoints=[[336, 672], [672, 336]]")
    assert result.exit_code == 0, result.output
    assert read_lengths(out).metadata["model"]["params"]["pinpoints"] == [[336, 672], [672, 336]]
