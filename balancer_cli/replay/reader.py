"""Lazy, validated access to a manifest's groups, one row group at a time.

The runtime never holds a whole manifest: it reads the row group that holds the step it needs
(row groups hold whole steps, see :mod:`balancer_cli.manifest`), validates it with a few
vectorized checks, and keeps the last two row groups decoded. Seeking to any step costs one row
group read, whatever the step. Opening one checks the folder's commit record (sizes, small
files' checksums) and the whole manifest against its metadata and the conservation contract
(:func:`~balancer_cli.replay.integrity.check_manifest`, a few vectorized passes).

Example:
    >>> import numpy as np, tempfile
    >>> from balancer_cli.manifest import StepShape, ManifestRows, write_manifest
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

from balancer_cli._fsutil import bytes_fingerprint
from balancer_cli._index import concat_ranges
from balancer_cli.errors import ManifestError
from balancer_cli.manifest import ManifestFile, open_manifest
from balancer_cli.replay.integrity import check_manifest

__all__ = ["ManifestReader", "manifest_fingerprint"]

_CACHED_ROW_GROUPS = 2


def manifest_fingerprint(manifest: ManifestFile) -> str:
    """Fingerprint of a manifest: its metadata (parameters, lengths fingerprint, metrics) and size.

    Cheap (no data read); stored in sampler states so a resume against another manifest fails.

    Example:
        >>> import tempfile
        >>> from balancer_cli.manifest import StepShape, ManifestRows, write_manifest
        >>> out, one = tempfile.mkdtemp(), np.zeros(1, int)
        >>> _ = write_manifest(out, ManifestRows(step=one, rank=one, micro=one, sample=one), dropped_sample=one[:0],
        ...                    dropped_reason=[], meta={"world_size": 1, "micro_batches": 1, "num_samples": 1, "seed": 0})
        >>> fingerprint = manifest_fingerprint(open_manifest(out))
        >>> len(fingerprint), fingerprint == ManifestReader(out).fingerprint
        (32, True)
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
    rank_rows: dict = field(default_factory=dict)  # rank -> (its samples (n,), batch bounds (num_steps*M+1,))


class ManifestReader:
    """Reads and validates a manifest's steps lazily.

    Args:
        manifest_dir: the manifest directory (or its ``manifest.parquet``).
        verify: check the whole manifest on opening (:func:`~balancer_cli.replay.integrity.check_manifest`);
            copies in DataLoader workers skip it (the process that made them checked it).

    Attributes:
        manifest: the opened :class:`~balancer_cli.manifest.ManifestFile`.
        world_size, micro_batches, num_steps, num_samples: from the metadata.
    """

    def __init__(self, manifest_dir: str | os.PathLike, *, verify: bool = True) -> None:
        # Opening checked the shape, the step counts and the row groups' first steps against the file
        # (manifest_meta.check_meta); num_samples, which it leaves optional, is asked for here.
        self.manifest = open_manifest(manifest_dir)
        self.num_samples = self.manifest.num_samples
        if verify:
            check_manifest(self.manifest)
        self.world_size, self.micro_batches = self.manifest.world_size, self.manifest.micro_batches
        self.num_steps = self.manifest.num_steps
        self.groups_per_step = self.manifest.shape.groups_per_step
        self._starts = np.asarray(self.manifest.meta["row_group_first_steps"] + [self.num_steps], dtype=np.int64)
        self._starts_list = self._starts.tolist()
        self._cache: OrderedDict[int, _RowGroup] = OrderedDict()
        self._step_samples: np.ndarray | None = None
        self._counted: set[int] = set()  # row groups counted by step_sample_counts

    def __getstate__(self) -> dict:
        # A ParquetFile handle does not pickle; reopen by path (DataLoader workers, spawn).
        return {"path": str(self.manifest.path)}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], verify=False)

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
        table = self.manifest.read_row_groups([index], columns=["step", "rank", "micro", "sample"], use_threads=False)
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
        per_step = self.groups_per_step  # R x M
        num_groups = num_steps * per_step
        # int32 arithmetic (half the memory traffic) whenever the keys fit, as they do in any
        # real row group.
        small = num_groups < np.iinfo(np.int32).max and step.dtype.itemsize <= 4
        kind = np.int32 if small else np.int64
        key = (step.astype(kind) - kind(first)) * kind(per_step)
        key += rank.astype(kind, copy=False) * kind(M)
        key += micro.astype(kind, copy=False)
        delta = np.diff(key)
        if len(delta) and delta.min() < 0:
            raise ManifestError(f"{where}: rows are not sorted by (step, rank, micro)", fix=fix)
        # Every (step, rank, micro) group of the row group, in order, must hold rows: then the
        # group starts are exactly where the key changes, and there are num_steps * R * M of them.
        starts = np.flatnonzero(delta) + 1
        if len(starts) + 1 != num_groups or key[0] != 0:
            groups_S = np.bincount(key[np.concatenate([[0], starts])] // per_step, minlength=num_steps)
            s = int(np.flatnonzero(groups_S != per_step)[0])
            raise ManifestError(f"{where}: step {first + s} has {groups_S[s]} groups, expected {R} ranks x {M} micro-batches",
                                fix=fix)
        offsets = np.empty(num_groups + 1, dtype=np.int64)
        offsets[0], offsets[1:-1], offsets[-1] = 0, starts, len(sample)
        return _RowGroup(first, num_steps, sample.astype(np.int64, copy=False), offsets)

    def rank_batches(self, step: int, rank: int) -> list[list[int]]:
        """The ``micro_batches`` groups of ``rank`` at ``step``, as lists of sample indices."""
        samples, bounds, _ = self.rank_span(step, step + 1, rank)
        return [samples[a:b] for a, b in zip(bounds, bounds[1:])]

    def rank_span(self, first: int, last: int, rank: int) -> tuple[list[int], list[int], int]:
        """``rank``'s groups of the steps ``first .. end - 1`` that share ``first``'s row group.

        The groups come flat, as one list of samples and the bounds of each group in it
        (``micro_batches`` groups per step): one ``tolist`` for the whole span. Slicing a batch
        out when it is needed keeps it short-lived, so building batches never grows the garbage
        collector's older generations.

        Returns:
            ``(samples, bounds, end)``: group ``i`` is ``samples[bounds[i]:bounds[i + 1]]``;
            ``end = min(last, first step of the next row group)``, where the next span starts.
        """
        group = self._row_group(first)
        end = min(last, group.first_step + group.num_steps)
        samples, bounds = self._rank_rows(group, rank)
        i, j = (first - group.first_step) * self.micro_batches, (end - group.first_step) * self.micro_batches
        lo, hi = int(bounds[i]), int(bounds[j])
        return samples[lo:hi].tolist(), (bounds[i:j + 1] - lo).tolist(), end

    def rank_steps(self, steps: np.ndarray, rank: int) -> tuple[list[int], list[int]]:
        """``rank``'s groups of the given steps (any order), flat as in :meth:`rank_span`.

        Each row group the steps touch is read and converted once, in file order, however the
        steps are shuffled (a reshuffled epoch), so the cost is that of the row groups touched.
        """
        steps = np.asarray(steps, dtype=np.int64)
        if not len(steps):
            return [], [0]
        if steps.min() < 0 or steps.max() >= self.num_steps:
            raise IndexError(f"steps out of range 0..{self.num_steps - 1}")
        M = self.micro_batches
        index = np.searchsorted(self._starts, steps, side="right") - 1
        by_group = np.argsort(index, kind="stable")
        gathered, slots_all, sizes_all = [], [], []
        for slots in np.split(by_group, np.flatnonzero(np.diff(index[by_group])) + 1):
            group = self._row_group(int(steps[slots[0]]))
            samples, bounds = self._rank_rows(group, rank)
            i = (steps[slots] - group.first_step) * M  # first group of each step
            lo, hi = bounds[i], bounds[i + M]
            gathered.append(samples[concat_ranges(lo, hi - lo)])
            slots_all.append(slots)
            sizes_all.append(bounds[i[:, None] + np.arange(1, M + 1)] - bounds[i[:, None] + np.arange(M)])  # (k, M)
        # Back from row-group order to the requested order, one gather.
        slots, sizes_SM = np.concatenate(slots_all), np.concatenate(sizes_all)
        step_sizes = sizes_SM.sum(axis=1)
        step_start = np.cumsum(step_sizes) - step_sizes  # in the gathered (row-group order) samples
        order = np.argsort(slots, kind="stable")
        samples = np.concatenate(gathered)[concat_ranges(step_start[order], step_sizes[order])]
        bounds = np.zeros(len(steps) * M + 1, dtype=np.int64)
        np.cumsum(sizes_SM[order].ravel(), out=bounds[1:])
        return samples.tolist(), bounds.tolist()

    def _rank_rows(self, group: _RowGroup, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """``rank``'s samples in a row group and the bounds of its groups in them (cached)."""
        cached = group.rank_rows.get(rank)
        if cached is not None:
            return cached
        # A rank's rows of one step are contiguous (rows are sorted by step, then rank), so its
        # rows in the row group are num_steps runs: one vectorized gather.
        M = self.micro_batches
        # the rank's first group of each step
        g0 = np.arange(group.num_steps, dtype=np.int64) * self.groups_per_step + rank * M
        bounds_SM = group.offsets[g0[:, None] + np.arange(M + 1)]  # (steps, M+1) row bounds
        lo, sizes = bounds_SM[:, 0], bounds_SM[:, -1] - bounds_SM[:, 0]
        base = np.cumsum(sizes) - sizes  # where each step's run starts in the gathered rows
        rows = concat_ranges(lo, sizes)
        bounds = np.empty(group.num_steps * M + 1, dtype=np.int64)
        bounds[:-1], bounds[-1] = (bounds_SM[:, :M] - (lo - base)[:, None]).ravel(), len(rows)
        cached = group.rank_rows[rank] = (group.sample[rows], bounds)
        return cached

    def step_groups(self, step: int) -> list[np.ndarray]:
        """All ``world_size * micro_batches`` groups of ``step`` in (rank, micro) order."""
        group = self._row_group(step)
        g0 = (step - group.first_step) * self.groups_per_step
        bounds = group.offsets[g0:g0 + self.groups_per_step + 1]
        return [group.sample[a:b] for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]

    def step_flat(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """``(samples, offsets)`` of ``step``: (n,) int64 samples in manifest order and the
        (G+1,) int64 offsets of its groups into them (``[0, .., n]``)."""
        group = self._row_group(step)
        g0 = (step - group.first_step) * self.groups_per_step
        offsets = group.offsets[g0:g0 + self.groups_per_step + 1]
        return group.sample[offsets[0]:offsets[-1]], offsets - offsets[0]

    def steps_flat(self, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every rank's groups of the given steps (any order), flat and vectorized.

        Returns:
            ``(samples, step_S1, group_G1)``: the (P,) int64 samples of each step in turn (in
            manifest order), the (S+1,) bounds of each step in them, and the (S*G+1,) start of
            each of the steps' ``G = world_size * micro_batches`` groups, then ``P``.

        Example:
            >>> import tempfile
            >>> from balancer_cli.manifest import ManifestRows, write_manifest
            >>> out = tempfile.mkdtemp()
            >>> rows = ManifestRows(step=np.array([0, 0, 1, 1]), rank=np.array([0, 1, 0, 1]), micro=np.zeros(4, int),
            ...                     sample=np.array([3, 2, 1, 0]))
            >>> _ = write_manifest(out, rows, dropped_sample=np.array([], np.int64), dropped_reason=[],
            ...                    meta={"world_size": 2, "micro_batches": 1, "num_samples": 4, "seed": 0})
            >>> [a.tolist() for a in ManifestReader(out).steps_flat(np.array([1, 0]))]
            [[1, 0, 3, 2], [0, 2, 4], [0, 1, 2, 3, 4]]
        """
        steps = np.asarray(steps, dtype=np.int64)
        G = self.groups_per_step
        if not len(steps):
            return np.empty(0, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64)
        if steps.min() < 0 or steps.max() >= self.num_steps:
            raise IndexError(f"steps out of range 0..{self.num_steps - 1}")
        index = np.searchsorted(self._starts, steps, side="right") - 1
        slots_all, gathered, sizes_all = [], [], []
        for slots in np.split(np.argsort(index, kind="stable"), np.flatnonzero(np.diff(np.sort(index))) + 1):
            group = self._row_group(int(steps[slots[0]]))
            g0 = (steps[slots] - group.first_step) * G  # first group of each step
            bounds_SG1 = group.offsets[g0[:, None] + np.arange(G + 1)]
            gathered.append(group.sample[concat_ranges(bounds_SG1[:, 0], bounds_SG1[:, -1] - bounds_SG1[:, 0])])
            sizes_all.append(np.diff(bounds_SG1, axis=1))
            slots_all.append(slots)
        # Back from row-group order to the requested order, one gather.
        slots, sizes_SG = np.concatenate(slots_all), np.concatenate(sizes_all)
        step_sizes = sizes_SG.sum(axis=1)
        step_start = np.cumsum(step_sizes) - step_sizes
        order = np.argsort(slots, kind="stable")
        samples = np.concatenate(gathered)[concat_ranges(step_start[order], step_sizes[order])]
        group_G1 = np.zeros(len(steps) * G + 1, dtype=np.int64)
        np.cumsum(sizes_SG[order].ravel(), out=group_G1[1:])
        step_S1 = group_G1[::G].copy()
        return samples, step_S1, group_G1

    def step_samples(self, step: int) -> np.ndarray:
        """(n,) int64 samples of ``step`` (all ranks) in manifest order."""
        group = self._row_group(step)
        g0 = (step - group.first_step) * self.groups_per_step
        return group.sample[group.offsets[g0]:group.offsets[g0 + self.groups_per_step]]

    def step_sample_counts(self, first: int = 0, last: int | None = None) -> np.ndarray:
        """(num_steps,) int64 samples per step, exact for steps ``first .. last - 1`` (default all).

        Reads only the ``step`` column of the row groups that hold those steps (each once, then
        cached), so planning the rest of an epoch after a resume reads no earlier row group.
        Steps outside the range are 0 unless an earlier call counted them.

        Example:
            >>> import tempfile
            >>> from balancer_cli.manifest import ManifestRows, write_manifest
            >>> out = tempfile.mkdtemp()
            >>> rows = ManifestRows(step=np.array([0, 0, 1]), rank=np.array([0, 0, 0]), micro=np.zeros(3, int),
            ...                     sample=np.array([0, 1, 2]))
            >>> _ = write_manifest(out, rows, dropped_sample=np.array([], np.int64), dropped_reason=[],
            ...                    meta={"world_size": 1, "micro_batches": 1, "num_samples": 3, "seed": 0})
            >>> ManifestReader(out).step_sample_counts().tolist()
            [2, 1]
        """
        last = self.num_steps if last is None else last
        if self._step_samples is None:
            self._step_samples = np.zeros(self.num_steps, dtype=np.int64)
        if first >= last:
            return self._step_samples
        lo = bisect.bisect_right(self._starts_list, first) - 1
        hi = bisect.bisect_right(self._starts_list, last - 1) - 1
        for index in range(lo, hi + 1):
            if index in self._counted:
                continue
            step = self.manifest.read_row_groups([index], columns=["step"], use_threads=False).column("step").to_numpy()
            a, b = self._starts_list[index], self._starts_list[index + 1]
            # Rows are sorted by step (checked when the row group is decoded): counts are the
            # distances between the first rows of consecutive steps.
            self._step_samples[a:b] = np.diff(np.searchsorted(step, np.arange(a, b + 1, dtype=step.dtype)))
            self._counted.add(index)
        return self._step_samples
