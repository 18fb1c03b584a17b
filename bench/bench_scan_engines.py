"""Throughput of ``balancer scan``'s engines on the same generated dataset.

The dataset mixes what a real multimodal scan meets: records with image size fields (no file
read), records pointing at small image files (header read), text-only records, and a few bad
records. Every engine scans it with the same config and block size; the script checks the tables
are identical and prints samples/s and the ratio to the baseline (the local engine in one
process, run first in the same process). Ray runs twice: with cluster start-up (what one CLI call
costs) and on an already running cluster (the steady state that scales with cores).

Example:
    python bench/bench_scan_engines.py --records 4000 --images 300 --cpus 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from balancer_cli._ray import import_ray
from balancer_cli.scan.pipeline import scan  # noqa: E402
from balancer_cli.scan.engines.ray import RayOptions  # noqa: E402
from balancer_cli.scan.measure import ScanConfig  # noqa: E402

_WORDS = ("chart", "value", "blue", "largest", "scene", "person", "number", "bottom", "increase", "cat")


def make_dataset(folder: Path, records: int, images: int, seed: int = 0) -> Path:
    """Write ``records`` LLaVA records (a third with size fields, ``images`` with image files, the
    rest text-only, 1% malformed) and the image files; return the JSONL path."""
    from PIL import Image

    rng = random.Random(seed)
    for i in range(images):
        size = (rng.randint(32, 1600), rng.randint(32, 1600))
        fmt = "PNG" if i % 2 else "JPEG"
        Image.new("RGB", size, (i % 255, 90, 160)).save(folder / f"img{i:05d}.{fmt.lower()}", format=fmt)

    def text(n: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    path = folder / "data.jsonl"
    with open(path, "w") as handle:
        for i in range(records):
            convo = [{"from": "human", "value": "<image>\n" + text(rng.randint(5, 60))},
                     {"from": "gpt", "value": text(rng.randint(5, 300))}]
            if i % 100 == 99:
                handle.write("{malformed\n")
                continue
            if i < images:
                record = {"image": f"img{i:05d}.{'png' if i % 2 else 'jpeg'}", "conversations": convo}
            elif i % 3 == 0:
                record = {"image": f"remote/{i}.jpg", "width": rng.randint(64, 4000), "height": rng.randint(64, 4000),
                          "conversations": convo}
            else:
                record = {"text": text(rng.randint(20, 800))}
            handle.write(json.dumps(record) + "\n")
    return path


def make_kind(folder: Path, kind: str, records: int, seed: int = 0) -> Path:
    """``records`` records of one kind: ``size-fields``, ``image-files`` (headers read) or ``text-only``."""
    from PIL import Image

    rng = random.Random(seed)
    path = folder / f"{kind}.jsonl"
    with open(path, "w") as handle:
        for i in range(records):
            words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(20, 300)))
            convo = [{"from": "human", "value": "<image>\nDescribe."}, {"from": "gpt", "value": words}]
            if kind == "size-fields":
                record = {"image": f"r/{i}.jpg", "width": rng.randint(64, 4000), "height": rng.randint(64, 4000),
                          "conversations": convo}
            elif kind == "image-files":
                name = f"k{i:05d}.png"
                Image.new("RGB", (rng.randint(32, 1600), rng.randint(32, 1600))).save(folder / name)
                record = {"image": name, "conversations": convo}
            else:
                record = {"text": words}
            handle.write(json.dumps(record) + "\n")
    return path


def _timed(label: str, inputs: list[str], config: ScanConfig, block_size: int, **kwargs) -> tuple[float, object]:
    start = time.perf_counter()
    result = scan(inputs, config, block_size=block_size, **kwargs)
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=4000)
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--model", default="qwen2-vl")
    parser.add_argument("--per-kind", type=int, default=0, metavar="N",
                        help="also time the local engine (1 process) on N records of each kind")
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="bench-scan-"))
    inputs = [str(make_dataset(folder, args.records, args.images))]
    config = ScanConfig(model=args.model)
    print(f"dataset: {args.records:,} records ({args.images} image files, {folder}), block size {args.block_size}, "
          f"{args.cpus} CPUs, model {args.model}")
    rows = []
    base_s, base = _timed("local", inputs, config, args.block_size, jobs=1)
    rows.append(("local, 1 process (baseline)", base_s))
    local_s, local = _timed("local", inputs, config, args.block_size, jobs=args.cpus)
    rows.append((f"local, {args.cpus} processes", local_s))
    assert local.lengths.table.equals(base.lengths.table)

    ray = import_ray()
    parts = folder / "parts"
    cold_s, cold = _timed("ray", inputs, config, args.block_size, engine="ray",
                          engine_options=RayOptions(parts_dir=str(parts / "cold"), num_cpus=args.cpus))
    rows.append((f"ray, {args.cpus} CPUs, incl. cluster start", cold_s))
    assert cold.lengths.table.equals(base.lengths.table)
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        # The first pipeline on a fresh cluster also starts and warms the workers.
        _timed("ray", inputs, config, args.block_size, engine="ray",
               engine_options=RayOptions(parts_dir=str(parts / "warmup")))
        warm_s, warm = _timed("ray", inputs, config, args.block_size, engine="ray",
                              engine_options=RayOptions(parts_dir=str(parts / "warm")))
        rows.append((f"ray, {args.cpus} CPUs, running cluster", warm_s))
        assert warm.lengths.table.equals(base.lengths.table)
    finally:
        ray.shutdown()

    n = base.lengths.num_samples
    print(f"{'engine':44s} {'seconds':>8s} {'samples/s':>10s} {'vs baseline':>11s}")
    for label, seconds in rows:
        print(f"{label:44s} {seconds:8.2f} {n / seconds:10,.0f} {base_s / seconds:10.2f}x")
    print(f"per-core rate (local, 1 process): {n / base_s:,.0f} samples/s; tables identical across engines")
    for kind in ("size-fields", "image-files", "text-only") if args.per_kind else ():
        path = make_kind(folder, kind, args.per_kind)
        seconds, _ = _timed("local", [str(path)], config, args.block_size, jobs=1)
        print(f"  {kind:12s} {args.per_kind / seconds:8,.0f} samples/s per core (local, 1 process)")


if __name__ == "__main__":
    main()
