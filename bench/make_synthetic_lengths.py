"""Write a large synthetic lengths table drawn from the real InternVL length distribution.

Used to measure ``balancer pack`` at 10M and 100M samples on one machine (see docs/scaling.md):
each synthetic sample is a uniformly drawn row of the four OmniBal/InternVL token-length files
(``../shared/data/internvl-lengths``), so caps, group sizes and drop rates are those of real data.
Rows are generated and written in chunks, so memory stays near the final table's size.

Example:
    python bench/make_synthetic_lengths.py --num-samples 10000000 --out /tmp/lengths_10m.parquet
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from balancer_cli.lengths import LengthsTable, lengths_fingerprint, read_lengths, write_lengths  # noqa: E402

_CHUNK = 5_000_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-samples", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    real = read_lengths(sorted((ROOT.parent / "shared" / "data" / "internvl-lengths").glob("*.json")))
    llm, tokens, items = real.llm_tokens(), real.tokens("vision"), real.items("vision")
    # Keep each drawn row's source, so step-mix measures see the real four-source mixture.
    names, codes = np.unique(real.sources(), return_inverse=True)
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    chunks = []
    for first in range(0, args.num_samples, _CHUNK):
        pick = rng.integers(0, real.num_samples, size=min(_CHUNK, args.num_samples - first))
        chunks.append(pa.table({
            "sample": pa.array(np.arange(first, first + len(pick), dtype=np.int64)),
            "source": pa.DictionaryArray.from_arrays(pa.array(codes[pick].astype(np.int32)),
                                                     pa.array(names.tolist())),
            "llm_tokens": pa.array(llm[pick].astype(np.int32)),
            "vision_tokens": pa.array(tokens[pick].astype(np.int32)),
            "vision_items": pa.array(items[pick].astype(np.int32)),
            "error": pa.nulls(len(pick), pa.string()),
        }))
    table = pa.concat_tables(chunks)
    lengths = LengthsTable(table, {"synthetic": {"from": "internvl-lengths", "seed": args.seed}},
                           lengths_fingerprint(table))
    write_lengths(lengths, args.out)
    print(f"wrote {args.num_samples:,} samples to {args.out} "
          f"({args.out.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
