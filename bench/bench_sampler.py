"""Benchmark the manifest runtime: iteration cost per sample and seek time on a 1M-sample manifest.

Targets: iterating ``ManifestBatchSampler`` costs < 1 microsecond per sample; opening a
1M-sample manifest and getting the batches of its last step (a resume there) takes < 100 ms.
Baselines run in the same process: iterating a plain Python list of lists with the same groups,
and reading the whole manifest file.

    python bench/bench_sampler.py [--samples 1000000] [--world-size 8] [--micro-batches 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from balancer_cli.manifest import ManifestRows, write_manifest
from balancer_cli.runtime import ManifestBatchSampler


def build(out: Path, num_samples: int, world: int, micro: int, group_size: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    order = rng.permutation(num_samples)
    sizes = rng.integers(1, 2 * group_size, size=num_samples // group_size + 1)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    G = world * micro
    num_groups = int(np.searchsorted(offsets, num_samples, side="right")) - 1
    num_groups -= num_groups % G
    placed = offsets[num_groups]
    group = np.repeat(np.arange(num_groups), sizes[:num_groups])
    step, rest = np.divmod(group, G)
    rank, micro_idx = np.divmod(rest, micro)
    rows = ManifestRows(step, rank, micro_idx, order[:placed])
    write_manifest(out, rows, dropped_sample=order[placed:], dropped_reason=["bench"] * (num_samples - placed),
                   meta={"world_size": world, "micro_batches": micro, "num_samples": num_samples, "seed": seed})


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8, help="mean samples per group")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    out = Path(tempfile.mkdtemp()) / "manifest"
    t0 = time.perf_counter()
    build(out, args.samples, args.world_size, args.micro_batches, args.group_size)
    print(f"built a {args.samples:,}-sample manifest for {args.world_size} ranks x {args.micro_batches} "
          f"micro-batches in {time.perf_counter() - t0:.1f} s")

    # 1. Iteration cost per sample, this rank's whole epoch, vs a plain list of the same lists.
    sampler = ManifestBatchSampler(out, rank=0, world_size=args.world_size)
    batches = list(sampler)
    per_rank_samples = sum(len(b) for b in batches)
    plain = [list(b) for b in batches]
    t_sampler = best_of(args.repeats, lambda: sum(1 for _ in ManifestBatchSampler(out, rank=0, world_size=args.world_size)))
    t_plain = best_of(args.repeats, lambda: sum(1 for _ in iter(plain)))
    t_copy = best_of(args.repeats, lambda: sum(1 for b in plain for _ in [list(b)]))
    us = t_sampler / per_rank_samples * 1e6
    placed = int(pq.ParquetFile(out / "manifest.parquet").metadata.num_rows)
    print(f"iterate rank 0 of {args.world_size}: {len(batches):,} batches, {per_rank_samples:,} samples: "
          f"{us:.3f} us per sample yielded, {t_sampler / placed * 1e6:.3f} us per manifest sample (target < 1; "
          f"every rank decodes every row of a row group), {t_sampler * 1e3:.1f} ms incl. opening; plain list of lists "
          f"{t_plain / per_rank_samples * 1e6:.3f} us/sample, copying each list {t_copy / per_rank_samples * 1e6:.3f} "
          f"us/sample; ratio sampler/copy {t_sampler / t_copy:.2f}x")

    # 1b. Elastic replay on another world size (re-planned per step).
    world2 = args.world_size - 1
    t_elastic = best_of(1, lambda: sum(1 for _ in ManifestBatchSampler(out, rank=0, world_size=world2)))
    print(f"iterate elastic ({args.world_size} -> {world2} ranks): {t_elastic * 1e3:.0f} ms, "
          f"{t_elastic / (placed / world2) * 1e6:.3f} us per sample yielded, {t_elastic / placed * 1e6:.3f} us per "
          f"manifest sample (every rank re-plans every step)")

    # 2. Open + seek to the last step vs reading the whole file.
    state = sampler.state_dict()
    state.update(step=sampler.steps_per_epoch - 1, position=sampler.steps_per_epoch - 1)

    def open_and_seek() -> None:
        s = ManifestBatchSampler(out, rank=0, world_size=args.world_size)
        s.load_state_dict(state)
        assert len(next(iter(s))) > 0

    t_seek = best_of(args.repeats, open_and_seek)
    t_read = best_of(args.repeats, lambda: pq.read_table(out / "manifest.parquet"))
    print(f"open + seek to the last step: {t_seek * 1e3:.1f} ms (target < 100); reading the whole file "
          f"{t_read * 1e3:.1f} ms; ratio seek/read-all {t_seek / t_read:.3f}x")


if __name__ == "__main__":
    main()
