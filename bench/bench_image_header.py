"""Benchmark: header-only ``read_image_size`` vs a bare Pillow ``Image.open(p).size`` loop.

Generates images of several formats and sizes in a temporary folder, then times both readers
over the same files in this process and prints reads/s and the speed-up ratio per case.
Pillow refuses images above its decompression-bomb limit (``DecompressionBombError``); those
cases are counted as failures of the baseline.

Usage:
    python bench/bench_image_header.py [--files 200] [--repeat 3] [--json]
"""

from __future__ import annotations

import argparse
import io
import json
import struct
import sys
import tempfile
import time
import warnings
import zlib
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from balancer_cli.scan.image_header import read_image_size  # noqa: E402

CASES = [  # (format, width, height, mode)
    ("PNG", 64, 64, "RGB"), ("PNG", 640, 480, "RGB"), ("PNG", 4000, 3000, "RGB"),
    ("JPEG", 640, 480, "RGB"), ("JPEG", 4000, 3000, "RGB"), ("WEBP", 640, 480, "RGB"),
    ("GIF", 640, 480, "P"), ("BMP", 640, 480, "RGB"), ("TIFF", 640, 480, "RGB"),
    ("PNG", 20000, 20000, "1"),
]


def _huge_png(width: int, height: int) -> bytes:
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    row = bytes(1 + (width + 7) // 8)
    comp = zlib.compressobj(9)
    idat = b"".join(comp.compress(row) for _ in range(height)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _encode(fmt: str, width: int, height: int, mode: str) -> bytes:
    if width * height > 100_000_000:
        return _huge_png(width, height)
    buf = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 1
    extra = {"exif": exif.tobytes()} if fmt == "JPEG" else {}  # cameras write EXIF before SOF
    Image.new(mode, (width, height), "gray" if mode != "P" else 3).save(buf, fmt, **extra)
    return buf.getvalue()


def _pil_size(path: Path) -> tuple[int, int] | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(path) as im:
                return im.size
    except Image.DecompressionBombError:
        return None


def _time(func, paths: list[Path], repeat: int) -> tuple[float, int]:
    best, failures = float("inf"), 0
    for _ in range(repeat):
        start = time.perf_counter()
        failures = sum(func(p) is None for p in paths)
        best = min(best, time.perf_counter() - start)
    return len(paths) / best, failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=200, help="files per case")
    parser.add_argument("--repeat", type=int, default=3, help="timing repeats (best is kept)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt, width, height, mode in CASES:
            data = _encode(fmt, width, height, mode)
            folder = Path(tmp) / f"{fmt}-{width}x{height}"
            folder.mkdir()
            paths = []
            for i in range(args.files):
                path = folder / f"{i}.{fmt.lower()}"
                path.write_bytes(data)
                paths.append(path)
            assert read_image_size(paths[0]) == (width, height)
            ours, _ = _time(read_image_size, paths, args.repeat)
            pil, pil_failures = _time(_pil_size, paths, args.repeat)
            rows.append({"format": fmt, "size": f"{width}x{height}", "file_bytes": len(data),
                         "header_reads_per_s": round(ours), "pillow_opens_per_s": round(pil),
                         "pillow_failures": pil_failures, "speedup": round(ours / pil, 2)})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'case':<18}{'bytes':>10}{'header/s':>12}{'pillow/s':>12}{'ratio':>8}  note")
    for r in rows:
        note = f"Pillow failed {r['pillow_failures']}/{args.files} (DecompressionBombError)" \
            if r["pillow_failures"] else ""
        print(f"{r['format'] + ' ' + r['size']:<18}{r['file_bytes']:>10}{r['header_reads_per_s']:>12}"
              f"{r['pillow_opens_per_s']:>12}{r['speedup']:>7.2f}x  {note}")


if __name__ == "__main__":
    main()
