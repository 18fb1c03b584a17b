"""Driver-side cost of a huge scan: assembling and writing N samples from per-block tables.

Whatever the engine, the driver ends a scan by concatenating the measured blocks in order
(:func:`balancer_cli.scan.pipeline.assemble`) and writing one lengths table. This measures that step
alone on synthetic block tables (the schema ``measure_block`` returns, one image per sample), so the
driver of a 100M-sample cluster scan can be sized: run it under ``/usr/bin/time -v`` for peak memory.

Example:
    /usr/bin/time -v python bench/bench_scan_assemble.py --num-samples 10000000
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from balancer_cli.lengths import write_lengths  # noqa: E402
from balancer_cli.scan.pipeline import assemble  # noqa: E402
from balancer_cli.scan.measure import MODULES, block_schema  # noqa: E402


def block_table(rng: np.random.Generator, rows: int, source: str) -> pa.Table:
    """A measured block as ``measure_block`` returns it: one image per sample, no video/audio."""
    llm = rng.integers(50, 4000, rows, dtype=np.int32)
    tokens = rng.integers(4, 16384, rows, dtype=np.int32)
    columns = {"source": pa.array([source] * rows, pa.string()), "llm_tokens": pa.array(llm)}
    for module in MODULES:
        if module == "vision":
            columns["vision_tokens"] = pa.array(tokens)
            columns["vision_items"] = pa.array(np.ones(rows, np.int32))
            columns["vision_seqlens"] = pa.ListArray.from_arrays(pa.array(np.arange(rows + 1, dtype=np.int32)),
                                                                 pa.array(tokens))
        else:
            columns[f"{module}_tokens"] = pa.array(np.zeros(rows, np.int32))
            columns[f"{module}_items"] = pa.array(np.zeros(rows, np.int32))
            columns[f"{module}_seqlens"] = pa.ListArray.from_arrays(pa.array(np.zeros(rows + 1, np.int32)),
                                                                    pa.array([], pa.int32()))
    columns["error"] = pa.nulls(rows, pa.string())
    return pa.table(columns, schema=block_schema())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-samples", type=int, default=10_000_000)
    parser.add_argument("--block-size", type=int, default=2048)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    tables = []
    for first in range(0, args.num_samples, args.block_size):
        tables.append(block_table(rng, min(args.block_size, args.num_samples - first), f"part{first // 10_000_000}"))
    made = time.perf_counter()
    lengths = assemble(tables, {"synthetic": True})
    del tables
    assembled = time.perf_counter()
    out = Path(tempfile.mkdtemp()) / "lengths.parquet"
    write_lengths(lengths, out)
    written = time.perf_counter()
    print(f"{args.num_samples:,} samples in {len(range(0, args.num_samples, args.block_size)):,} blocks: "
          f"make blocks {made - start:.1f} s, assemble {assembled - made:.1f} s, write {written - assembled:.1f} s "
          f"({out.stat().st_size / 2**20:.0f} MiB, table {lengths.table.nbytes / 2**20:.0f} MiB in memory)")


if __name__ == "__main__":
    main()
