"""Helpers for the replay and runtime tests (no torch): random manifests written with ``write_manifest``
and every rank of a replay simulated in one process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from balancer_cli.lengths import LengthsTable, make_lengths_table, write_lengths
from balancer_cli.manifest import ManifestRows, write_manifest
from balancer_cli.replay.cursor import ManifestReplay


def random_lengths(num_samples: int, seed: int = 0, loss_tokens: bool = False) -> LengthsTable:
    """A lengths table with a long-tailed LLM length and 0-6 image tiles of 256 tokens per sample."""
    rng = np.random.default_rng(seed)
    llm = rng.lognormal(6.0, 0.8, num_samples).astype(np.int64) + 16
    items = rng.integers(0, 7, num_samples)
    lt = make_lengths_table(llm, {"vision": (items * 256, items)})
    if loss_tokens:
        loss = (llm * rng.uniform(0.2, 0.9, num_samples)).astype(np.int32)
        lt = LengthsTable(lt.table.append_column("loss_tokens", pa.array(loss)), lt.metadata, lt.fingerprint)
    return lt


def pack_random(
    out: Path,
    num_samples: int = 200,
    world_size: int = 4,
    micro_batches: int = 2,
    epochs: int = 1,
    drop: int = 5,
    seed: int = 0,
    rows_per_row_group: int = 64,
    lengths: LengthsTable | None = None,
    extra: bool = False,
) -> Path:
    """Pack random groups of random sizes into a manifest (every rank gets ``micro_batches`` groups a step)."""
    rng = np.random.default_rng(seed)
    G = world_size * micro_batches
    steps, ranks, micros, samples, epoch_steps = [], [], [], [], []
    dropped = rng.choice(num_samples, size=drop, replace=False) if drop else np.array([], np.int64)
    placed = np.setdiff1d(np.arange(num_samples), dropped)
    step0 = 0
    for _ in range(epochs):
        order = rng.permutation(placed)
        num_steps = max(1, len(order) // (G * 3))
        num_groups = num_steps * G
        # Random cut points give groups of 1+ samples each.
        cuts = np.sort(rng.choice(np.arange(1, len(order)), size=num_groups - 1, replace=False))
        for g, group in enumerate(np.split(order, cuts)):
            step, rest = divmod(g, G)
            rank, micro = divmod(rest, micro_batches)
            steps += [step0 + step] * len(group)
            ranks += [rank] * len(group)
            micros += [micro] * len(group)
            samples += group.tolist()
        epoch_steps.append(num_steps)
        step0 += num_steps
    rows = ManifestRows(np.array(steps), np.array(ranks), np.array(micros), np.array(samples),
                        extra={"vision_rank": np.array(ranks)[::-1].copy()} if extra else {})
    meta = {"world_size": world_size, "micro_batches": micro_batches, "num_samples": num_samples, "seed": seed,
            "algorithm": "random-test"}
    if lengths is not None:
        meta["lengths_fingerprint"] = lengths.fingerprint
        write_lengths(lengths, out / "lengths.parquet")
    write_manifest(out, rows, dropped_sample=dropped, dropped_reason=["test"] * len(dropped), meta=meta,
                   epoch_num_steps=epoch_steps, rows_per_row_group=rows_per_row_group)
    return out


def simulate(manifest: Path, world_size: int, epoch: int = 0, **kwargs) -> list[list[list[int]]]:
    """Every rank's batches of one epoch, each rank computed by its own replay."""
    return [list(ManifestReplay(manifest, rank=rank, world_size=world_size, epoch=epoch, **kwargs))
            for rank in range(world_size)]
