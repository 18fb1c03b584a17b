"""Benchmark the manifest runtime: iteration cost per sample and seek time on a 1M-sample manifest.

Targets: iterating ``ManifestBatchSampler`` costs < 1 microsecond per sample yielded (also at 8
ranks, where every rank decodes all rows of the row groups it reads); opening a 1M-sample
manifest and getting the batches of its last step (a resume there) takes < 100 ms.
Baselines run in the same process: iterating a plain Python list of lists with the same groups,
reading the whole manifest file, and decoding the same rows written with zstd (the codec
manifests used before LZ4).

With ``lengths=`` (section 3: a synthetic lengths table and the packer's caps in the manifest):
iteration <= 1 us per sample yielded and resume <= 10 ms, natively and elastic (8 -> 7 ranks,
with the plan file beside the manifest); elastic replay planned as it goes (no plan file, or
the pass that writes it) is measured too.

    python -m bench.bench_sampler [--samples 1000000] [--world-size 8] [--micro-batches 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from balancer_cli.lengths import LengthsTable, make_lengths_table, write_lengths
from balancer_cli.manifest import ManifestRows, open_manifest, write_manifest
from balancer_cli.replay.cursor import ManifestReplay
from balancer_cli.runtime import ManifestBatchSampler
from bench.synthetic import make_synthetic


def build(out: Path, num_samples: int, world: int, micro: int, group_size: int, seed: int = 0,
          lengths: LengthsTable | None = None) -> None:
    """A manifest of random groups (mean ``group_size`` samples); with ``lengths``, its metadata
    records the table's fingerprint and, as caps, the largest group's LLM tokens and vision items
    (every packed group fits, as after ``balancer pack``)."""
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
    meta = {"world_size": world, "micro_batches": micro, "num_samples": num_samples, "seed": seed}
    if lengths is not None:
        sample = order[:placed]
        caps = {"llm": int(np.bincount(group, weights=lengths.llm_tokens()[sample]).max()),
                "vision": int(np.bincount(group, weights=lengths.items("vision")[sample]).max())}
        meta.update(lengths_fingerprint=lengths.fingerprint, params={"caps": caps})
    write_manifest(out, rows, dropped_sample=order[placed:], dropped_reason=["bench"] * (num_samples - placed),
                   meta=meta)


def synthetic_lengths(num_samples: int, seed: int = 0) -> LengthsTable:
    """bench.synthetic's samples (30% text-only, 1 to 13 tiles of 256 vision tokens) as a lengths table."""
    data = make_synthetic(num_samples, seed=seed)
    load, cost = data["load_NK"], data["cost_NK"]
    return make_lengths_table(load[:, -1], {"vision": (cost[:, 0].astype(np.int64), load[:, 0])})


def best_of(repeats: int, fn, clock=time.perf_counter) -> float:
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
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
    def iterate() -> int:
        return sum(1 for _ in ManifestBatchSampler(out, rank=0, world_size=args.world_size))

    t_sampler = best_of(args.repeats, iterate)
    # CPU time too: on a shared machine the wall clock also counts other processes' turns.
    t_sampler_cpu = best_of(args.repeats, iterate, clock=time.process_time)
    t_plain = best_of(args.repeats, lambda: sum(1 for _ in iter(plain)))
    t_copy = best_of(args.repeats, lambda: sum(1 for b in plain for _ in [list(b)]))
    us = t_sampler / per_rank_samples * 1e6
    placed = int(pq.ParquetFile(out / "manifest.parquet").metadata.num_rows)
    print(f"iterate rank 0 of {args.world_size}: {len(batches):,} batches, {per_rank_samples:,} samples: "
          f"{us:.3f} us per sample yielded ({t_sampler_cpu / per_rank_samples * 1e6:.3f} us of CPU time), "
          f"{t_sampler / placed * 1e6:.3f} us per manifest sample (target < 1 per sample yielded; "
          f"every rank decodes every row of a row group), {t_sampler * 1e3:.1f} ms incl. opening; plain list of lists "
          f"{t_plain / per_rank_samples * 1e6:.3f} us/sample, copying each list {t_copy / per_rank_samples * 1e6:.3f} "
          f"us/sample; ratio sampler/copy {t_sampler / t_copy:.2f}x")

    # 1b. A reshuffled epoch (beyond the packed ones): steps in a permuted order.
    def reshuffled() -> int:
        s = ManifestBatchSampler(out, rank=0, world_size=args.world_size, epoch=1)
        return sum(1 for _ in s)

    t_shuffled = best_of(args.repeats, reshuffled)
    print(f"iterate rank 0, reshuffled epoch 1: {t_shuffled / per_rank_samples * 1e6:.3f} us per sample yielded, "
          f"ratio reshuffled/packed order {t_shuffled / t_sampler:.2f}x")

    # 1c. Decoding the rows as written vs the same rows written with zstd and default encodings.
    def read_row_groups(path: Path) -> None:
        parquet = pq.ParquetFile(path)
        for index in range(parquet.num_row_groups):
            parquet.read_row_group(index, use_threads=False)

    zstd_path = out.parent / "manifest-zstd.parquet"
    source = pq.ParquetFile(out / "manifest.parquet")
    with pq.ParquetWriter(zstd_path, source.schema_arrow, compression="zstd") as writer:
        for index in range(source.num_row_groups):
            writer.write_table(source.read_row_group(index))
    t_lz4 = best_of(args.repeats, lambda: read_row_groups(out / "manifest.parquet"))
    t_zstd = best_of(args.repeats, lambda: read_row_groups(zstd_path))
    size_lz4, size_zstd = (out / "manifest.parquet").stat().st_size, zstd_path.stat().st_size
    print(f"decode every row group: {t_lz4 * 1e3:.1f} ms as written ({size_lz4 / 1e6:.2f} MB), {t_zstd * 1e3:.1f} ms "
          f"as zstd with default dictionaries ({size_zstd / 1e6:.2f} MB); ratio {t_lz4 / t_zstd:.2f}x")

    # 1d. Elastic replay on another world size (re-planned per step).
    world2 = max(args.world_size - 1, 2)
    # The first run also loads the compiled re-planning kernels (numba); later runs are warm. Planned
    # as it goes: no plan file (section 3 measures the plan file).
    t_cold = best_of(1, lambda: sum(1 for _ in ManifestReplay(out, 0, world2, plan_cache=False)))
    t_elastic = best_of(args.repeats, lambda: sum(1 for _ in ManifestReplay(out, 0, world2, plan_cache=False)))
    print(f"iterate elastic ({args.world_size} -> {world2} ranks): {t_elastic * 1e3:.0f} ms, "
          f"{t_elastic / (placed / world2) * 1e6:.3f} us per sample yielded, {t_elastic / placed * 1e6:.3f} us per "
          f"manifest sample (every rank re-plans every step); first run in the process {t_cold * 1e3:.0f} ms; "
          f"ratio elastic/native {t_elastic / (placed / world2) / (t_sampler / per_rank_samples):.1f}x")

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

    with_lengths(out.parent / "with-lengths", args, world2)


def with_lengths(out: Path, args: argparse.Namespace, world2: int) -> None:
    """3. The same shape of manifest with a lengths table and the packer's caps (``lengths=``)."""
    lengths = synthetic_lengths(args.samples)
    build(out, args.samples, args.world_size, args.micro_batches, args.group_size, lengths=lengths)
    write_lengths(lengths, out.parent / "lengths.parquet")
    caps = open_manifest(out).meta["params"]["caps"]
    R, repeats = args.world_size, args.repeats
    print(f"with lengths= ({args.samples:,} synthetic samples, caps {caps}):")
    t_open = best_of(repeats, lambda: ManifestReplay(out, 0, R, lengths=out.parent / "lengths.parquet"))
    print(f"  open with lengths= a path: {t_open * 1e3:.1f} ms (reading and checking the lengths table, once "
          f"per process; a LengthsTable already in memory costs nothing here)")

    def per_sample(world: int, rank: int = 1, **kwargs) -> tuple[float, float]:
        yielded = sum(len(b) for b in ManifestReplay(out, rank, world, plan_cache=False))
        run = lambda: sum(1 for _ in ManifestReplay(out, rank, world, lengths=lengths, **kwargs))  # noqa: E731
        wall = best_of(repeats, run)
        cpu = best_of(repeats, run, clock=time.process_time)
        return wall / yielded * 1e6, cpu / yielded * 1e6

    def resume(world: int, state: dict, **kwargs) -> float:
        def once() -> None:
            replay = ManifestReplay(out, 1, world, lengths=lengths, **kwargs)
            replay.load_state_dict(state)
            assert next(iter(replay)) is not None
        return best_of(repeats, once)

    base = ManifestReplay(out, 0, R, lengths=lengths)
    last = base.state_dict(step=base.steps_per_epoch - 1)  # at the start of the last step
    it = iter(base)
    for _ in range(10 * base.batches_per_step + 1):
        next(it)
    mid = base.state_dict()  # inside step 10, one batch taken: re-planned over the new ranks on resume
    wall, cpu = per_sample(R)
    print(f"  native ({R} ranks): iterate {wall:.3f} us per sample yielded ({cpu:.3f} us CPU); open + resume at the "
          f"last step + first batch {resume(R, last) * 1e3:.1f} ms (targets <= 1 us, <= 10 ms)")

    wall, cpu = per_sample(world2, plan_cache=False)
    print(f"  elastic {R} -> {world2} ranks, planned as it goes (plan_cache=False): iterate {wall:.3f} us per sample "
          f"yielded ({cpu:.3f} us CPU); resume at the last step {resume(world2, last, plan_cache=False) * 1e3:.1f} ms, "
          f"inside step 10 of the {R}-rank replay {resume(world2, mid, plan_cache=False) * 1e3:.1f} ms")
    t0 = time.perf_counter()
    sum(1 for _ in ManifestReplay(out, 0, world2, lengths=lengths))  # rank 0 writes the plan file
    t_build = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in (out / "elastic-plans").glob(f"R{world2}-*.npy"))
    wall, cpu = per_sample(world2)
    print(f"  elastic {R} -> {world2} ranks, plan file beside the manifest: rank 0's first pass (plans every step, "
          f"writes {size / 1e6:.1f} MB) {t_build * 1e3:.0f} ms; then iterate {wall:.3f} us per sample yielded "
          f"({cpu:.3f} us CPU); resume at the last step {resume(world2, last) * 1e3:.1f} ms, inside step 10 of the "
          f"{R}-rank replay {resume(world2, mid) * 1e3:.1f} ms (targets <= 1 us, <= 10 ms)")


if __name__ == "__main__":
    main()
