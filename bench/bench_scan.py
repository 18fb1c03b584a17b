"""Benchmark: ``balancer scan`` throughput for size-field records and for header reading.

Generates, in a temporary folder, LLaVA JSONL records with real caption text (COCO captions from
``../shared/data`` when present, synthetic text otherwise) and real image files of many sizes, then
measures in this process:

- ``size_fields``: records carrying ``width``/``height`` (no file opened): samples/s per core
  (CPU time of one process, ``-j 1``) and wall-clock samples/s with all cores (``-j N``);
- ``headers``: records with image paths only: the scan (``-j 1``) against a bare Pillow loop
  ``Image.open(path).size`` over the same files (the baseline), as a ratio of per-sample time.

Usage:
    python bench/bench_scan.py [--samples 40000] [--images 2000] [--jobs N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from balancer_cli.scan.pipeline import default_jobs, scan
from balancer_cli.scan.measure import ScanConfig

COCO = ROOT.parent / "shared" / "data" / "coco-val2017" / "captions_val2017.json"
SIZES = [(32, 32), (224, 224), (320, 240), (640, 427), (640, 480), (1024, 768), (1280, 720), (1920, 1080),
         (300, 2000), (4000, 1000), (2048, 1536), (800, 600)]


def _captions(n: int, rng: random.Random) -> list[str]:
    if COCO.is_file():
        pool = [a["caption"] for a in json.loads(COCO.read_text())["annotations"]]
    else:
        words = ["a", "man", "woman", "dog", "cat", "sits", "on", "the", "table", "next", "to", "red", "blue", "car", "street", "with", "two", "people"]
        pool = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 16))) for _ in range(5000)]
    return [pool[i % len(pool)] for i in range(n)]


def _record(caption: str, image: str, size: tuple[int, int] | None) -> str:
    record = {"image": image, "conversations": [{"from": "human", "value": "<image>\nDescribe the image briefly."},
                                                {"from": "gpt", "value": caption}]}
    if size:
        record.update(width=size[0], height=size[1])
    return json.dumps(record)


def _cpu_with_children() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=40000, help="size-field records")
    parser.add_argument("--images", type=int, default=2000, help="image files (and header records)")
    parser.add_argument("--jobs", type=int, default=default_jobs(), help="workers for the parallel run")
    parser.add_argument("--tokenizer", default="qwen2")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    rng = random.Random(0)
    config = ScanConfig(model="qwen2-vl", tokenizer=args.tokenizer)
    results: dict = {"jobs": args.jobs, "tokenizer": args.tokenizer, "model": config.model}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        captions = _captions(args.samples, rng)
        sized = folder / "sized.jsonl"
        sized.write_text("\n".join(_record(c, f"img/{i}.jpg", rng.choice(SIZES)) for i, c in enumerate(captions)) + "\n")
        (folder / "img").mkdir()
        paths = []
        for i in range(args.images):
            width, height = SIZES[i % len(SIZES)]
            path = folder / "img" / f"{i}.{'png' if i % 2 else 'jpg'}"
            Image.new("RGB", (width, height), (i % 256, 80, 160)).save(path)
            paths.append(path)
        headers = folder / "headers.jsonl"
        headers.write_text("\n".join(_record(captions[i % len(captions)], f"img/{p.name}", None)
                                     for i, p in enumerate(paths)) + "\n")

        scan([str(headers)], config, jobs=1)  # warm up: tokenizer load, page cache
        wall, cpu = _timed(lambda: scan([str(sized)], config, jobs=1))
        results["size_fields_per_core"] = {"samples": args.samples, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                                           "samples_per_s_per_core": round(args.samples / cpu)}
        cpu_before = _cpu_with_children()
        wall_parallel, _ = _timed(lambda: scan([str(sized)], config, jobs=args.jobs, block_size=2048))
        cpu_parallel = _cpu_with_children() - cpu_before  # workers included (reaped at pool shutdown)
        results["size_fields_parallel"] = {"jobs": args.jobs, "wall_s": round(wall_parallel, 3),
                                           "samples_per_s": round(args.samples / wall_parallel),
                                           "cpu_s_all_processes": round(cpu_parallel, 3),
                                           "samples_per_cpu_s": round(args.samples / cpu_parallel),
                                           "load_average_1min": round(os.getloadavg()[0], 1)}

        def bare_loop() -> None:
            for path in paths:
                with Image.open(path) as image:
                    image.size  # noqa: B018 - the header read is the point

        base_wall, base_cpu = min((_timed(bare_loop) for _ in range(3)), key=lambda t: t[1])
        scan_wall, scan_cpu = min((_timed(lambda: scan([str(headers)], config, jobs=1)) for _ in range(3)),
                                  key=lambda t: t[1])
        results["headers"] = {
            "images": args.images,
            "scan_samples_per_s_per_core": round(args.images / scan_cpu),
            "bare_pil_per_s_per_core": round(args.images / base_cpu),
            "ratio_scan_to_bare_pil": round(scan_cpu / base_cpu, 2),
            "cpu_s": {"scan": round(scan_cpu, 3), "bare_pil": round(base_cpu, 3)},
        }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    size, par, head = results["size_fields_per_core"], results["size_fields_parallel"], results["headers"]
    print(f"size-field records : {size['samples_per_s_per_core']:>9,} samples/s per core "
          f"({args.samples:,} samples, {size['cpu_s']} s CPU, tokenizer {args.tokenizer})")
    print(f"  with -j {par['jobs']:<10}: {par['samples_per_s']:>9,} samples/s wall, "
          f"{par['samples_per_cpu_s']:,} samples per CPU-second over all processes "
          f"(load average {par['load_average_1min']})")
    print(f"header reading     : {head['scan_samples_per_s_per_core']:>9,} samples/s per core "
          f"(bare PIL loop {head['bare_pil_per_s_per_core']:,}/s; scan/bare time ratio "
          f"{head['ratio_scan_to_bare_pil']}x)")
    print(f"(machine: {os.cpu_count()} cores visible; per-core numbers use process CPU time)")


if __name__ == "__main__":
    main()
