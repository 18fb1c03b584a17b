"""Benchmark: video/audio header parses per second per core against the raw cost of reading the
same header bytes, and a scan of records without durations against that limit.

For each media kind one file is encoded (PyAV; audio with ``wave``/soundfile/PyAV) and copied
``--files`` times. The bytes a header parse reads are recorded once through a counting file object
(every ``read`` at its offset: the first 4 KiB and the ``moov`` box of an mp4/m4a, the first 4 KiB
of a Matroska, FLAC, MP3 or WAV file, the ``hdrl`` list of an AVI, the first pages and the last
page of an Ogg file); the limit is a loop that opens each copy and ``os.pread``s exactly those
ranges, with no parsing. Then per kind:

- ``header/s``: :func:`read_video_info` / :func:`read_audio_info` over the copies (by path);
- ``raw/s``: the pread loop; ``ratio``: raw/s over header/s (the issue's target: <= 2x);
- ``scan/s``: :func:`~balancer_cli.scan.measure.measure_block` over a JSONL of one record per copy
  without any duration (template, tokenizer and rule included), and its ratio to ``raw/s``;
- ``fields/s``: the same records carrying the header's values as fields (no file opened: the
  scan's own cost), and ``scan/fields``, what reading the headers adds to a scan. The two scans
  give the same tokens (checked).

Rates are per core: process CPU time (the files sit in the page cache, so I/O waits do not count).

Usage:
    python bench/bench_media_header.py [--files 200] [--repeat 3] [--seconds 10] [--json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tempfile
import time
import wave
from fractions import Fraction
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from balancer_cli.scan.blocks import RecordBlock  # noqa: E402
from balancer_cli.scan.measure import ScanConfig, measure_block  # noqa: E402
from balancer_cli.scan.media_header import read_audio_info, read_video_info  # noqa: E402

VIDEOS = [  # (name, codec, movflags)
    ("h264.mp4", "libx264", ""), ("h264-faststart.mp4", "libx264", "faststart"), ("h264.mkv", "libx264", ""),
    ("vp8.webm", "libvpx", ""), ("vp9.webm", "libvpx-vp9", ""), ("mpeg4.avi", "mpeg4", ""), ("mpeg4.mov", "mpeg4", ""),
]
AUDIOS = ["pcm.wav", "pcm.flac", "vorbis.ogg", "opus.ogg", "lame.mp3", "aac.m4a", "opus.webm"]


class Recorder(io.FileIO):
    """A file that records the ``(offset, length)`` of every read."""

    def __init__(self, path: str) -> None:
        super().__init__(path, "rb")
        self.ranges: list[tuple[int, int]] = []

    def read(self, n: int = -1) -> bytes:
        at = self.tell()
        data = super().read(n)
        if data:
            self.ranges.append((at, len(data)))
        return data

    def readinto(self, buffer) -> int:
        at = self.tell()
        n = super().readinto(buffer)
        if n:
            self.ranges.append((at, n))
        return n


def _video(path: Path, codec: str, movflags: str, seconds: float) -> None:
    import av

    out = av.open(str(path), "w", options={"movflags": movflags} if movflags else {})
    stream = out.add_stream(codec, rate=Fraction(30))
    stream.width, stream.height, stream.pix_fmt = 320, 240, "yuv420p"
    x = np.arange(320)[None, :, None]
    for i in range(int(30 * seconds)):  # a moving gradient: compresses like real footage, not like noise
        pixels = ((x + 4 * i + np.arange(240)[:, None, None]) % 256 * np.ones((1, 1, 3))).astype(np.uint8)
        for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)
    out.close()


def _audio(path: Path, seconds: float, name: str) -> None:
    import av
    import soundfile as sf

    rate = 48000 if path.suffix == ".webm" else 16000  # Opus: FFmpeg reports 48 kHz whatever was stored
    tone = (0.3 * np.sin(np.arange(int(rate * seconds)) / 7.0)).astype(np.float32)
    if path.suffix == ".wav":
        with wave.open(str(path), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(rate)
            w.writeframes((tone * 32767).astype("<i2").tobytes())
    elif path.suffix in (".flac", ".ogg"):
        subtype = "OPUS" if name.startswith("opus") else "VORBIS"
        sf.write(path, tone, rate, **({"format": "OGG", "subtype": subtype} if path.suffix == ".ogg" else {}))
    else:
        out = av.open(str(path), "w")
        codec = {".mp3": "libmp3lame", ".webm": "libopus"}.get(path.suffix, "aac")
        stream = out.add_stream(codec, rate=rate)
        stream.layout = "mono"
        step = stream.codec_context.frame_size or 1024
        fmt = "flt" if codec == "libopus" else "fltp"
        for start in range(0, len(tone), step):
            frame = av.AudioFrame.from_ndarray(tone[None, start:start + step], format=fmt, layout="mono")
            frame.sample_rate, frame.pts = rate, start
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
        out.close()


def _best(func, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        func()
        best = min(best, time.process_time() - start)
    return best


def _raw(paths: list[Path], ranges: list[tuple[int, int]]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            for at, n in ranges:
                os.pread(fd, n, at)
        finally:
            os.close(fd)


def _scan_block(folder: Path, paths: list[Path], kind: str, fields: dict, name: str) -> RecordBlock:
    records = folder / name
    tag = f"<{kind}>"
    records.write_text("".join(json.dumps({kind: p.name, **fields, "conversations": [
        {"from": "human", "value": f"{tag}\nWhat happens here?"}, {"from": "gpt", "value": "A test."}]}) + "\n"
        for p in paths))
    return RecordBlock(path=str(records), format="jsonl", source=records.name, first_sample=0,
                       num_records=len(paths), stop=records.stat().st_size, image_root=str(folder))


def _case(tmp: Path, name: str, kind: str, files: int, repeat: int, seconds: float) -> dict:
    folder = tmp / name.replace(".", "-")
    folder.mkdir()
    first = folder / f"0{Path(name).suffix}"
    (_video(first, *next((c, m) for n, c, m in VIDEOS if n == name), seconds) if kind == "video"
     else _audio(first, seconds, name))
    paths = [first] + [folder / f"{i}{first.suffix}" for i in range(1, files)]
    for path in paths[1:]:
        shutil.copyfile(first, path)
    reader = read_video_info if kind == "video" else read_audio_info
    with Recorder(str(first)) as recorder:
        expected = reader(recorder)
    ranges = recorder.ranges
    assert reader(first) == expected
    header = _best(lambda: [reader(p) for p in paths], repeat)
    raw = _best(lambda: _raw(paths, ranges), repeat)
    config = ScanConfig()
    block = _scan_block(folder, paths, kind, {}, "bare.jsonl")
    known = {"duration": expected.duration}
    if kind == "video":
        known.update(num_frames=expected.num_frames, fps=expected.fps, width=expected.width, height=expected.height)
    with_fields = _scan_block(folder, paths, kind, known, "fields.jsonl")
    tables = [measure_block(b, config) for b in (block, with_fields)]  # also warms the tokenizer and rule
    assert tables[0].column("error").null_count == files, tables[0].column("error").to_pylist()[:2]
    assert tables[0].drop(["source"]).equals(tables[1].drop(["source"]))  # same tokens as the true fields
    scan = _best(lambda: measure_block(block, config), repeat)
    fields = _best(lambda: measure_block(with_fields, config), repeat)
    return {"kind": kind, "file": name, "file_bytes": first.stat().st_size,
            "header_bytes": sum(n for _, n in ranges), "reads": len(ranges),
            "header_per_s": round(files / header), "raw_per_s": round(files / raw),
            "ratio": round(header / raw, 2), "scan_per_s": round(files / scan), "scan_ratio": round(scan / raw, 2),
            "fields_scan_per_s": round(files / fields), "scan_vs_fields": round(scan / fields, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=200, help="copies per media kind")
    parser.add_argument("--repeat", type=int, default=3, help="timing repeats (best is kept)")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each encoded clip")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, _, _ in VIDEOS:
            rows.append(_case(Path(tmp), name, "video", args.files, args.repeat, args.seconds))
        for name in AUDIOS:
            rows.append(_case(Path(tmp), name, "audio", args.files, args.repeat, args.seconds))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'file':<20}{'bytes':>9}{'read':>8}{'header/s':>10}{'raw/s':>9}{'ratio':>8}{'scan/s':>9}{'ratio':>8}"
          f"{'fields/s':>10}{'scan/fields':>12}")
    for r in rows:
        print(f"{r['file']:<20}{r['file_bytes']:>9}{r['header_bytes']:>8}{r['header_per_s']:>10}{r['raw_per_s']:>9}"
              f"{r['ratio']:>7.1f}x{r['scan_per_s']:>9}{r['scan_ratio']:>7.1f}x{r['fields_scan_per_s']:>10}"
              f"{r['scan_vs_fields']:>11.2f}x")


if __name__ == "__main__":
    main()
