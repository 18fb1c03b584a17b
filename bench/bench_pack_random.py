"""The packing contract on inputs drawn afresh: step mix <= 1.0x random batching, vision/LLM Dist
<= 0.005 and steps <= 1.03x the lower bound, through the pipeline (search + pack + assign).

Two families of seeded inputs:

- ``realistic``: the real InternVL lengths (``../shared/data/internvl-lengths``) resampled and
  the synthetic generator (:mod:`bench.synthetic`) in turn, 20k-600k samples, ``--dp`` 8-64, 1-2
  micro-batches;
- ``harsh``: 2-8 sources with random tile ranges (text-only ones among them), 3k-400k samples,
  ``--dp`` 2-128, 1-4 micro-batches.

Prints one row per input and a summary (how many inputs fail each bound, the mean step mix).

Usage:
    python -m bench.bench_pack_random --family realistic --cases 48
    python -m bench.bench_pack_random --family harsh --cases 40 --first 0
"""

from __future__ import annotations

import argparse
import glob
import time
from pathlib import Path

import numpy as np

from bench.synthetic import make_synthetic

ROOT = Path(__file__).resolve().parents[1]
BOUNDS = {"mix": 1.0, "dist": 0.005, "steps": 1.03}


def _realistic(case: int, real):
    from balancer_cli.lengths import LengthsTable, make_lengths_table

    rng = np.random.default_rng(5000 + case)
    n = int(np.exp(rng.uniform(np.log(20_000), np.log(600_000))))
    R, M = int(rng.choice([8, 16, 32, 64])), int(rng.choice([1, 1, 2]))
    if case % 2 == 0 or real is None:
        d = make_synthetic(n, seed=int(rng.integers(1 << 30)))
        table = make_lengths_table(d["load_NK"][:, -1], {"vision": (d["cost_NK"][:, 0], d["load_NK"][:, 0])},
                                   source=d["source"])
        kind = "synthetic"
    else:
        table, kind = LengthsTable(real.table.take(rng.integers(0, real.num_samples, n))), "real"
    return kind, table, R, M, int(rng.integers(1000))


def _harsh(case: int, real):
    from balancer_cli.lengths import make_lengths_table

    rng = np.random.default_rng(1000 + case)
    n = int(np.exp(rng.uniform(np.log(3000), np.log(400_000))))
    S = int(rng.integers(2, 9))
    src = rng.choice(S, n, p=rng.dirichlet(np.ones(S)))
    text, tiles = np.empty(n, np.int64), np.zeros(n, np.int64)
    for s in range(S):
        idx = np.flatnonzero(src == s)
        mu, sigma = rng.uniform(3.5, 7), rng.uniform(0.2, 1.0)
        lo = 0 if rng.random() < 0.3 else int(rng.integers(1, 6))
        hi = lo if lo == 0 else lo + int(rng.integers(0, 9))
        text[idx] = np.clip(rng.lognormal(mu, sigma, len(idx)), 8, 6000).astype(np.int64)
        if hi > 0:
            tiles[idx] = rng.integers(lo, hi + 1, len(idx))
    R, M = int(rng.choice([2, 4, 8, 16, 32, 64, 128])), int(rng.choice([1, 1, 2, 4]))
    if n // (R * M) < 60:
        R = max(1, n // (M * 200))
    names = np.array([f"s{s}" for s in range(S)])[src]
    return f"{S} sources", make_lengths_table(text + 256 * tiles, {"vision": (256 * tiles, tiles)}, source=names), R, M, 0


FAMILIES = {"realistic": _realistic, "harsh": _harsh}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=sorted(FAMILIES), default="realistic")
    ap.add_argument("--cases", type=int, default=12)
    ap.add_argument("--first", type=int, default=0)
    args = ap.parse_args(argv)
    from balancer_cli.lengths import read_lengths
    from balancer_cli.pack.config import PackConfig
    from balancer_cli.pack.evaluate import evaluate_rows
    from balancer_cli.pack.inputs import prepare_inputs
    from balancer_cli.pack.pipeline import place_packer, resolve_thresholds

    files = sorted(glob.glob(str(ROOT.parent / "shared" / "data" / "internvl-lengths" / "*.json")))
    real = read_lengths(files) if files else None
    print("| case | input | samples | dp x M | caps | vision / LLM dist | steps (vs bound) | mix vs random | s | over |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    failed = {k: 0 for k in BOUNDS}
    mixes = []
    for case in range(args.first, args.first + args.cases):
        kind, table, R, M, seed = FAMILIES[args.family](case, real)
        inputs = prepare_inputs(table)
        config = PackConfig(world_size=R, micro_batches=M, seed=seed)
        t = time.perf_counter()
        caps, bounds, _ = resolve_thresholds(inputs, config)
        placed = place_packer("balanced", inputs, config, caps, bounds)
        elapsed = time.perf_counter() - t
        m = evaluate_rows(inputs, placed.rows, placed.dropped_sample, placed.dropped_reason, caps_K=caps, world_size=R,
                          micro_batches=M, epoch_num_steps=placed.epoch_num_steps).metrics
        dist = [m["modules"][k]["dist_ratio"] for k in ("vision", "llm")]
        value = {"mix": m["step_mix"]["vs_random"], "dist": max(dist), "steps": m["steps"]["vs_lower_bound"]}
        over = [k for k, bound in BOUNDS.items() if value[k] > bound]
        for k in over:
            failed[k] += 1
        mixes.append(value["mix"])
        print(f"| {case} | {kind} | {inputs.num_samples:,} | {R} x {M} | {'/'.join(map(str, caps.tolist()))} | "
              f"{dist[0]:.4f} / {dist[1]:.4f} | {value['steps']:.3f}x | {value['mix']:.2f}x | {elapsed:.1f} | "
              f"{', '.join(over) or '-'} |", flush=True)
    print(f"\n{args.cases} {args.family} inputs: over the mix bound {failed['mix']}, the Dist bound {failed['dist']}, "
          f"the steps bound {failed['steps']}; mean step mix {np.mean(mixes):.2f}x random batching")


if __name__ == "__main__":
    main()
