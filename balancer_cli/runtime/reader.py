"""Lazy, validated access to a manifest's groups, one row group at a time.

The runtime never holds a whole manifest: it reads the row group that holds the step it needs
(row groups hold whole steps, see :mod:`balancer_cli.manifest`), validates it with a few
vectorized checks, and keeps the last two row groups decoded. Seeking to any step costs one row
group read, whatever the step.

Example:
    >>> import numpy as np, tempfile
    >>> from balancer_cli.manifest import ManifestRows, write_manifest
    >>> out = tempfile.mkdtemp()
    >>> rows = ManifestRows(step=np.array([0, 0, 0]), rank=np.array([0, 0, 1]), micro=np.array([0, 0, 0]),
    ...                     sample=np.array([2, 0, 1]))
    >>> _ = write_manifest(out, rows, dropped_sample=np.array([], np.int64), dropped_reason=[],
    ...                    meta={"world_size": 2, "micro_batches": 1, "num_samples": 3, "seed": 0})
    >>> reader = ManifestReader(out)
    >>> reader.rank_batches(0, 1), [g.tolist() for g in reader.step_groups(0)]
    ([[1]], [[2, 0], [1]])
"""

from __future__ import annotations

import bisect
import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from balancer_cli.errors import ManifestError
from balancer_cli.fsutil import bytes_fingerprint
from balancer_cli.manifest import ManifestFile, open_manifest

__all__ = ["ManifestReader", "manifest_fingerprint"]

_CACHED_ROW_GROUPS = 2


def manifest_fingerprint(manifest: ManifestFile) -> str:
    """Fingerprint of a manifest: its metadata (parameters, lengths fingerprint, metrics) and size.

    Cheap (no data read); stored in sampler states so a resume against another manifest fails.
    """
    meta = json.dumps(dict(manifest.meta), sort_keys=True).encode()
    rows = manifest._file.metadata.num_rows  # noqa: SLF001 (the footer is already in memory)
    return bytes_fingerprint(meta, str(rows).encode())


@dataclass(frozen=True)
class _RowGroup:
    """One decoded row group: samples plus group offsets, ``groups_per_step`` groups per step."""

    first_step: int
    num_steps: int
    sample: np.ndarray  # (P,) int64
    offsets: np.ndarray  # (G+1,) int64, G = num_steps * groups_per_step
    rank_batches: dict = field(default_factory=dict)  # rank -> its batches as lists, all steps


class ManifestReader:
    """Reads and validates a manifest's steps lazily.

    Args:
        manifest_dir: the manifest directory (or its ``manifest.parquet``).

    Attributes:
        manifest: the opened :class:`~balancer_cli.manifest.ManifestFile`.
        world_size, micro_batches, num_steps, num_samples: from the metadata.
    """

    def __init__(self, manifest_dir: str | os.PathLike) -> None:
        self.manifest = open_manifest(manifest_dir)
        meta = self.manifest.meta
        for key in ("world_size", "micro_batches", "num_samples", "num_steps", "row_group_first_steps"):
            if key not in meta:
                raise ManifestError(f"{self.manifest.path}: metadata lacks '{key}'", fix="re-run `balancer pack`")
        self.world_size = int(meta["world_size"])
        self.micro_batches = int(meta["micro_batches"])
        self.num_steps = int(meta["num_steps"])
        self.num_samples = int(meta["num_samples"])
        self.groups_per_step = self.world_size * self.micro_batches
        self._starts = np.asarray(meta["row_group_first_steps"] + [self.num_steps], dtype=np.int64)
        self._starts_list = self._starts.tolist()
        if len(self._starts) - 1 != self.manifest._file.num_row_groups:  # noqa: SLF001
            raise ManifestError(f"{self.manifest.path}: row group index does not match the file",
                                fix="re-run `balancer pack`; the file was rewritten by another tool")
        self._cache: OrderedDict[int, _RowGroup] = OrderedDict()
        self._step_samples: np.ndarray | None = None

    def __getstate__(self) -> dict:
        # A ParquetFile handle does not pickle; reopen by path (DataLoader workers, spawn).
        return {"path": str(self.manifest.path)}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])

    @property
    def fingerprint(self) -> str:
        return manifest_fingerprint(self.manifest)

    def _row_group(self, step: int) -> _RowGroup:
        if not 0 <= step < self.num_steps:
            raise IndexError(f"step {step} out of range 0..{self.num_steps - 1}")
        index = bisect.bisect_right(self._starts_list, step) - 1
        cached = self._cache.get(index)
        if cached is not None:
            self._cache.move_to_end(index)
            return cached
        # One thread: the columns are small, and thread start-up costs more than it saves.
        table = self.manifest._file.read_row_group(index, columns=["step", "rank", "micro", "sample"],  # noqa: SLF001
                                                   use_threads=False)
        first, last = int(self._starts[index]), int(self._starts[index + 1])
        group = self._decode(table, first, last - first)
        self._cache[index] = group
        if len(self._cache) > _CACHED_ROW_GROUPS:
            self._cache.popitem(last=False)
        return group

    def _decode(self, table, first: int, num_steps: int) -> _RowGroup:
        where = f"{self.manifest.path}: row group of steps {first}..{first + num_steps - 1}"
        # Zero-copy views of the int32 key columns; only ``sample`` is kept, as int64.
        step, rank, micro, sample = (np.asarray(table.column(i)) for i in range(4))
        R, M = self.world_size, self.micro_batches
        fix = "re-run `balancer pack`; the manifest is corrupt or was written by another tool"
        if len(step) == 0 or step[0] < first or step[-1] >= first + num_steps:
            raise ManifestError(f"{where}: holds rows of other steps", fix=fix)
        for name, values, bound in (("rank", rank, R), ("micro", micro, M), ("sample", sample, self.num_samples)):
            if values.min() < 0 or values.max() >= bound:
                bad = int(np.flatnonzero((values < 0) | (values >= bound))[0])
                raise ManifestError(f"{where}: {name} {values[bad]} at step {step[bad]} is outside 0..{bound - 1}",
                                    fix=fix)
        # Group key, in range once rank and micro are (steps are checked through the sort order:
        # the key is non-decreasing and the first and last steps are in range).
        key = (step.astype(np.int64) - first) * (R * M)
        key += rank * M
        key += micro
        delta = np.diff(key)
        if len(delta) and delta.min() < 0:
            raise ManifestError(f"{where}: rows are not sorted by (step, rank, micro)", fix=fix)
        # Every (step, rank, micro) group of the row group, in order, must hold rows: then the
        # group starts are exactly where the key changes, and there are num_steps * R * M of them.
        starts = np.flatnonzero(delta) + 1
        num_groups = num_steps * R * M
        if len(starts) + 1 != num_groups or key[0] != 0:
            per_step = np.bincount(key[np.concatenate([[0], starts])] // (R * M), minlength=num_steps)
            s = int(np.flatnonzero(per_step != R * M)[0])
            raise ManifestError(f"{where}: step {first + s} has {per_step[s]} groups, expected {R} ranks x {M} micro-batches",
                                fix=fix)
        offsets = np.empty(num_groups + 1, dtype=np.int64)
        offsets[0], offsets[1:-1], offsets[-1] = 0, starts, len(sample)
        return _RowGroup(first, num_steps, sample.astype(np.int64, copy=False), offsets)

    def rank_batches(self, step: int, rank: int) -> list[list[int]]:
        """The ``micro_batches`` groups of ``rank`` at ``step``, as lists of sample indices.

        The first call for a row group converts all of the rank's groups in it at once (one
        gather, one ``tolist``), so the per-batch cost is a list slice.
        """
        group = self._row_group(step)
        i = (step - group.first_step) * self.micro_batches
        return self._rank_lists(group, rank)[i:i + self.micro_batches]

    def rank_span(self, first: int, last: int, rank: int) -> tuple[list[list[int]], int]:
        """``rank``'s groups of the steps ``first .. end - 1`` that share ``first``'s row group.

        Returns:
            ``(batches, end)``: ``micro_batches`` lists per step, in step order, and
            ``end = min(last, first step of the next row group)``, where the next span starts.
        """
        group = self._row_group(first)
        end = min(last, group.first_step + group.num_steps)
        M = self.micro_batches
        batches = self._rank_lists(group, rank)
        i, j = (first - group.first_step) * M, (end - group.first_step) * M
        return (batches if i == 0 and j == len(batches) else batches[i:j]), end

    def rank_steps(self, steps: np.ndarray, rank: int) -> list[list[int]]:
        """``rank``'s groups of the given steps (any order), ``micro_batches`` lists per step.

        Each row group the steps touch is read and converted once, in file order, however the
        steps are shuffled (a reshuffled epoch), so the cost is that of the row groups touched.
        """
        steps = np.asarray(steps, dtype=np.int64)
        if len(steps) and (steps.min() < 0 or steps.max() >= self.num_steps):
            raise IndexError(f"steps out of range 0..{self.num_steps - 1}")
        M = self.micro_batches
        index = np.searchsorted(self._starts, steps, side="right") - 1
        by_group = np.argsort(index, kind="stable")
        cuts = np.flatnonzero(np.diff(index[by_group])) + 1
        out: list = [None] * len(steps)
        for slots in np.split(by_group, cuts) if len(steps) else []:
            first = int(steps[slots[0]])
            group = self._row_group(first)
            batches = self._rank_lists(group, rank)
            for slot, i in zip(slots.tolist(), ((steps[slots] - group.first_step) * M).tolist()):
                out[slot] = batches[i:i + M]
        return [b for per_step in out for b in per_step]

    def _rank_lists(self, group: _RowGroup, rank: int) -> list[list[int]]:
        batches = group.rank_batches.get(rank)
        if batches is None:
            batches = group.rank_batches[rank] = self._convert_rank(group, rank)
        return batches

    def _convert_rank(self, group: _RowGroup, rank: int) -> list[list[int]]:
        # A rank's rows of one step are contiguous (rows are sorted by step, then rank), so its
        # rows in the row group are num_steps runs: one gather, one tolist, then list slices.
        R, M = self.world_size, self.micro_batches
        g0 = np.arange(group.num_steps, dtype=np.int64) * (R * M) + rank * M  # rank's first group per step
        bounds_SM = group.offsets[g0[:, None] + np.arange(M + 1)]  # (steps, M+1) row bounds
        lo, hi = bounds_SM[:, 0], bounds_SM[:, -1]
        sizes = hi - lo
        base = np.cumsum(sizes) - sizes  # where each step's run starts in the gathered rows
        rows = np.arange(int(base[-1] + sizes[-1]), dtype=np.int64) + np.repeat(lo - base, sizes)
        samples = group.sample[rows].tolist()
        bounds = (bounds_SM[:, :M] - (lo - base)[:, None]).ravel().tolist()
        bounds.append(len(samples))
        return [samples[a:b] for a, b in zip(bounds, bounds[1:])]

    def step_groups(self, step: int) -> list[np.ndarray]:
        """All ``world_size * micro_batches`` groups of ``step`` in (rank, micro) order."""
        group = self._row_group(step)
        g0 = (step - group.first_step) * self.groups_per_step
        bounds = group.offsets[g0:g0 + self.groups_per_step + 1]
        return [group.sample[a:b] for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]

    def step_samples(self, step: int) -> np.ndarray:
        """(n,) int64 samples of ``step`` (all ranks) in manifest order."""
        group = self._row_group(step)
        g0 = (step - group.first_step) * self.groups_per_step
        return group.sample[group.offsets[g0]:group.offsets[g0 + self.groups_per_step]]

    def step_sample_counts(self) -> np.ndarray:
        """(num_steps,) int64 samples per step; one pass over the ``step`` column, cached."""
        if self._step_samples is None:
            counts = np.zeros(self.num_steps, dtype=np.int64)
            parquet = self.manifest._file  # noqa: SLF001
            for index in range(parquet.num_row_groups):
                step = parquet.read_row_group(index, columns=["step"]).column("step").to_numpy()
                counts += np.bincount(step, minlength=self.num_steps)[: self.num_steps]
            self._step_samples = counts
        return self._step_samples
