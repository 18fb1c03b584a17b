"""Ray Data runs the media-header scan unchanged: videos and audio without durations, measured
from their files' headers on Ray workers, give the local engine's bytes (errors included)."""

from __future__ import annotations

import json
import wave
from fractions import Fraction
from pathlib import Path

import pytest
from click.testing import CliRunner

from balancer_cli.cli import main
from balancer_cli.lengths import read_lengths

av = pytest.importorskip("av")
from media_util import encode_video  # noqa: E402


def _video(path: Path, codec: str, rate: Fraction, frames: int) -> None:
    encode_video(path, codec, rate, frames, width=64, height=48)


def _wav(path: Path, seconds: float, rate: int = 16000) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(bytes(2 * int(seconds * rate)))


def _conv(tag: str, i: int) -> list[dict]:
    return [{"from": "human", "value": f"{tag}\nWhat happens in clip {i}?"},
            {"from": "gpt", "value": "Something happens. " * (i % 5 + 1)}]


@pytest.fixture(scope="module")
def media_dataset(tmp_path_factory) -> Path:
    """60 records over 4 videos and 3 clips, none with a duration, plus a missing and a bad file."""
    root = tmp_path_factory.mktemp("ray_media")
    media = root / "media"
    media.mkdir()
    videos = [("a.mp4", "libx264", Fraction(10), 40), ("b.mkv", "libx264", Fraction(5), 22),
              ("c.mov", "mpeg4", Fraction(8), 30), ("d.avi", "mpeg4", Fraction(4), 13)]
    for name, codec, rate, frames in videos:
        _video(media / name, codec, rate, frames)
    for i, seconds in enumerate((1.5, 4.0, 0.3)):
        _wav(media / f"s{i}.wav", seconds)
    (media / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypisom" + b"\x00" * 40)
    records = []
    for i in range(60):
        if i % 3 == 0:
            records.append({"audio": f"media/s{(i // 3) % 3}.wav", "conversations": _conv("<audio>", i)})
        else:
            records.append({"video": f"media/{videos[i % 4][0]}", "conversations": _conv("<video>", i)})
    records[17] = {"video": "media/gone.mp4", "conversations": _conv("<video>", 17)}
    records[31] = {"video": "media/broken.mp4", "conversations": _conv("<video>", 31)}
    path = root / "media.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _scan(inputs: Path, out: Path, *extra: str) -> dict:
    result = CliRunner().invoke(main, ["scan", str(inputs), "-o", str(out), "--model", "qwen2.5-omni",
                                       "--block-size", "8", "--json", "--quiet", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_ray_scan_of_media_headers_is_byte_identical_to_local(ray_cluster, media_dataset, tmp_path):
    local = tmp_path / "local.parquet"
    summary = _scan(media_dataset, local, "-j", "1")
    ray_out = tmp_path / "ray.parquet"
    _scan(media_dataset, ray_out, "--engine", "ray")
    assert ray_out.read_bytes() == local.read_bytes()
    # The headers were really read: every video and clip has tokens, the two bad files are errors.
    table = read_lengths(local).table.to_pydict()
    errors = list(read_lengths(local).errors())
    assert summary["samples"] == 60 and sorted(summary["errors"]) == ["corrupt_video", "missing_file"]
    for i in range(60):
        if i in (17, 31):
            assert errors[i] is not None
        elif i % 3 == 0:
            assert errors[i] is None and table["audio_tokens"][i] > 0
        else:
            assert errors[i] is None and table["video_tokens"][i] > 0
