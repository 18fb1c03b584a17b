"""Write a lengths table and a balanced manifest to try the runtime before running ``balancer pack``.

A stand-in packer for demos and tests of the runtime: it reads real lengths (OmniBal/InternVL
JSON or a lengths Parquet), takes ``--samples`` of them, and for each step deals
``--samples-per-step`` random samples into ``world_size x micro_batches`` groups by
longest-processing-time first on (vision + LLM) tokens. ``balancer pack`` balances better (caps,
ISF); use its output for real runs.

    python examples/make_demo_manifest.py ../shared/data/internvl-lengths/ai2d_train_12k_wh_token_lengths.json \\
        -o /tmp/demo --world-size 2 --samples 2048 --samples-per-step 32
"""

from __future__ import annotations

import argparse
import heapq
from pathlib import Path

import numpy as np
from balancer_cli.cost.samples import sample_costs
from balancer_cli.lengths import make_lengths_table, read_lengths, write_lengths
from balancer_cli.manifest import ManifestRows, write_manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lengths", nargs="+")
    parser.add_argument("-o", "--out", required=True)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--samples-per-step", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    full = read_lengths(args.lengths)
    rng = np.random.default_rng(args.seed)
    keep = np.sort(rng.choice(full.num_samples, size=min(args.samples, full.num_samples), replace=False))
    lengths = make_lengths_table(full.llm_tokens()[keep], {m: (full.tokens(m)[keep], full.items(m)[keep])
                                                           for m in full.modules}, source=full.sources()[keep])
    out = Path(args.out)
    write_lengths(lengths, out / "lengths.parquet")
    cost = np.sum(list(sample_costs(lengths).values()), axis=0)
    G = args.world_size * args.micro_batches
    order = rng.permutation(lengths.num_samples)
    num_steps = len(order) // args.samples_per_step
    rows = {"step": [], "rank": [], "micro": [], "sample": []}
    for step in range(num_steps):
        chunk = order[step * args.samples_per_step:(step + 1) * args.samples_per_step]
        bins = [(0.0, g) for g in range(G)]
        members = [[] for _ in range(G)]
        for s in chunk[np.argsort(-cost[chunk], kind="stable")]:
            load, g = heapq.heappop(bins)
            members[g].append(int(s))
            heapq.heappush(bins, (load + cost[s], g))
        for g in range(G):
            rank, micro = divmod(g, args.micro_batches)
            for s in members[g]:
                for key, value in (("step", step), ("rank", rank), ("micro", micro), ("sample", s)):
                    rows[key].append(value)
    placed = order[:num_steps * args.samples_per_step]
    dropped = np.sort(order[num_steps * args.samples_per_step:])
    write_manifest(out, ManifestRows(**{k: np.array(v) for k, v in rows.items()}),
                   dropped_sample=dropped, dropped_reason=["remainder"] * len(dropped),
                   meta={"world_size": args.world_size, "micro_batches": args.micro_batches,
                         "num_samples": lengths.num_samples, "seed": args.seed, "algorithm": "demo-lpt",
                         "lengths_fingerprint": lengths.fingerprint})
    print(f"{out}: {len(placed)} samples in {num_steps} steps for {args.world_size} ranks x {args.micro_batches} "
          f"micro-batches ({len(dropped)} left over); lengths in {out / 'lengths.parquet'}")


if __name__ == "__main__":
    main()
