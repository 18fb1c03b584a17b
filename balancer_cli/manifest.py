"""The manifest: which sample goes to which (step, rank, micro-batch), as Parquet.

A manifest directory holds:

- ``manifest.parquet``: one row per placed sample, sorted by (``step``, ``rank``, ``micro``,
  order within the group): ``step`` int32, ``rank`` int32, ``micro`` int32, ``sample`` int64, plus
  optional extra int32 columns (e.g. ``<m>_rank``: the rank that runs module m's phase for that
  sample, written by post-balancing). Row groups hold whole steps so a reader seeks to any step.
  Steps are numbered globally across epochs: epoch e owns the steps
  ``sum(epoch_num_steps[:e]) .. sum(epoch_num_steps[:e+1]) - 1``.
- ``dropped.parquet``: ``sample`` int64, ``reason`` string, for every sample not placed.
- ``report.json``/``report.md``/``report.png``: written by ``balancer pack``/``report``.
- ``_COMMIT.json``: every file's size and checksum, written last (:mod:`balancer_cli.commit`);
  :func:`open_manifest` refuses a folder whose record is missing or does not match.

The ``balancer`` metadata key of ``manifest.parquet`` is JSON with ``schema_version``,
``world_size``, ``micro_batches``, ``num_steps``, ``epoch_num_steps``, ``num_samples``, ``seed``,
``algorithm``, ``params``, ``lengths_fingerprint``, ``summary`` and ``row_group_first_steps``.

Example:
    >>> import numpy as np, tempfile
    >>> rows = ManifestRows(step=np.array([0, 0]), rank=np.array([0, 1]), micro=np.array([0, 0]),
    ...                     sample=np.array([1, 0]))
    >>> out = tempfile.mkdtemp()
    >>> _ = write_manifest(out, rows, dropped_sample=np.array([2]), dropped_reason=["oversize"],
    ...                meta={"world_size": 2, "micro_batches": 1, "num_samples": 3, "seed": 0})
    >>> m = open_manifest(out)
    >>> m.num_steps, m.read_steps(0, 1).sample.tolist()
    (1, [1, 0])
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from balancer_cli import __version__
from balancer_cli._arrow import arrow_of, arrow_strings, numpy_of
from balancer_cli._fsutil import atomic_path
from balancer_cli._index import run_blocks, search_sorted, sorted_runs
from balancer_cli._memory import release_freed_memory
from balancer_cli.commit import verify_commit, write_commit
from balancer_cli.errors import ManifestError, check_int
from balancer_cli.manifest_meta import KEY_COLUMNS as _KEY_COLUMNS
from balancer_cli.manifest_meta import METADATA_KEY, read_meta

__all__ = ["SCHEMA_VERSION", "MANIFEST_FILE", "DROPPED_FILE", "REPORT_JSON", "REPORT_MD", "REPORT_PNG", "StepShape",
           "ManifestRows", "ManifestFile", "write_manifest", "is_slot_sorted", "open_manifest", "read_dropped"]

#: 2: epochs, packer, assigner and search draw from independent named random streams
#: (:func:`balancer_cli.pack.config.stream_seed`); 1 seeded each with ``seed + epoch``. The layout
#: is the same, so both are read.
SCHEMA_VERSION = 2
MANIFEST_FILE = "manifest.parquet"
DROPPED_FILE = "dropped.parquet"
REPORT_JSON = "report.json"
REPORT_MD = "report.md"
REPORT_PNG = "report.png"
#: Target rows per row group; a row group always ends at a step boundary.
DEFAULT_ROWS_PER_ROW_GROUP = 1 << 16
#: Every rank decodes every row it replays, so the manifest favours decode speed: LZ4 (about 3x
#: faster to decode than zstd here), dictionary encoding only for the small key columns (long
#: runs: a few bytes per row group), and plain ``sample`` values (unique, so a dictionary only
#: adds a lookup). The file is still smaller than zstd with default dictionaries.
MANIFEST_COMPRESSION = "lz4"


@dataclass(frozen=True, kw_only=True, slots=True)
class StepShape:
    """The shape of one optimizer step: R data-parallel ranks x M micro-batches (groups) each.

    Every (step, rank, micro) is one *slot*; a manifest holds one group per slot. This object is
    the one place that computes groups per step, slot numbers and the row sort key.

    Args:
        world_size: data-parallel ranks R (>= 1).
        micro_batches: groups per rank per step M (>= 1).

    Example:
        >>> shape = StepShape(world_size=2, micro_batches=3)
        >>> shape.groups_per_step
        6
        >>> [a.tolist() for a in shape.slots(np.arange(7))]
        [[0, 0, 0, 0, 0, 0, 1], [0, 0, 0, 1, 1, 1, 0], [0, 1, 2, 0, 1, 2, 0]]
        >>> shape.slot_number(np.array([0, 1]), np.array([1, 0]), np.array([2, 2])).tolist()
        [5, 8]
    """

    world_size: int
    micro_batches: int

    #: Most ranks, and most micro-batches (2M each: int32 columns with room to spare).
    MOST = (1 << 21) - 1

    def __post_init__(self) -> None:
        for name in ("world_size", "micro_batches"):
            check_int(name, getattr(self, name), least=1, most=self.MOST, fix=f"give a positive {{{name}}}")

    @classmethod
    def covering(cls, rank: np.ndarray, micro: np.ndarray) -> StepShape:
        """The smallest shape holding every ``rank`` and ``micro`` (1 x 1 if none): it sorts rows of any shape."""
        return cls(world_size=int(np.max(rank, initial=0)) + 1, micro_batches=int(np.max(micro, initial=0)) + 1)

    @property
    def groups_per_step(self) -> int:
        """R x M: the groups one step holds."""
        return self.world_size * self.micro_batches

    def slots(self, slot_G: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(step, rank, micro) int32 of consecutive slot numbers, as a plain data loader fills them."""
        slot_G = np.asarray(slot_G, dtype=np.int64)
        per_step = self.groups_per_step
        return ((slot_G // per_step).astype(np.int32), ((slot_G % per_step) // self.micro_batches).astype(np.int32),
                (slot_G % self.micro_batches).astype(np.int32))

    def slot_number(self, step: np.ndarray, rank: np.ndarray, micro: np.ndarray) -> np.ndarray:
        """(N,) int64 ``(step x R + rank) x M + micro``, the inverse of :meth:`slots`: sorts like (step, rank,
        micro) for ranks < R, micro < M (a bit field per column overflowed from 2^21 steps: 10M at ``--dp 1``)."""
        return ((np.asarray(step, dtype=np.int64) * self.world_size + np.asarray(rank, dtype=np.int64))
                * self.micro_batches + np.asarray(micro, dtype=np.int64))


@dataclass(frozen=True)
class ManifestRows:
    """Placement of samples, one entry per placed sample, in manifest order.

    Attributes:
        step, rank, micro: (P,) int arrays.
        sample: (P,) int64 sample indices.
        extra: optional ``{name: (P,) int array}`` columns (e.g. ``vision_rank``).
    """

    step: np.ndarray
    rank: np.ndarray
    micro: np.ndarray
    sample: np.ndarray
    extra: Mapping[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.sample)

    def slot_numbers(self) -> np.ndarray:
        """(P,) int64 keys sorting the rows by (step, rank, micro): the smallest covering shape's slot numbers."""
        return StepShape.covering(self.rank, self.micro).slot_number(self.step, self.rank, self.micro)

    def to_table(self, lo: int = 0, hi: int | None = None) -> pa.Table:
        """Rows ``lo:hi`` (default: all) in the manifest file's column types, converted a slice at a
        time (whole, an int32 ``sample`` widened at once cost 76 MB at 10M rows)."""
        part = slice(lo, hi)
        columns = {
            "step": arrow_of(np.asarray(self.step[part], dtype=np.int32)),
            "rank": arrow_of(np.asarray(self.rank[part], dtype=np.int32)),
            "micro": arrow_of(np.asarray(self.micro[part], dtype=np.int32)),
            "sample": arrow_of(np.asarray(self.sample[part], dtype=np.int64)),
        }
        for name in sorted(self.extra):
            columns[name] = arrow_of(np.asarray(self.extra[name][part], dtype=np.int32))
        return pa.table(columns)

    @classmethod
    def from_table(cls, table: pa.Table) -> ManifestRows:
        return cls.from_columns({name: numpy_of(table.column(name)) for name in table.column_names})

    @classmethod
    def from_columns(cls, columns: Mapping[str, np.ndarray]) -> ManifestRows:
        """Rows from ``{column name: (P,) array}`` as a manifest file names them."""
        extra = {n: c for n, c in columns.items() if n not in _KEY_COLUMNS}
        return cls(columns["step"], columns["rank"], columns["micro"], columns["sample"], extra)


def is_slot_sorted(rows: ManifestRows) -> bool:
    """Whether ``rows`` are sorted by (step, rank, micro), checked a block at a time (:func:`sorted_runs`).

    Example:
        >>> is_slot_sorted(ManifestRows(np.array([0, 0, 1]), np.array([0, 1, 0]), np.zeros(3, int), np.arange(3)))
        True
    """
    shape = StepShape.covering(rows.rank, rows.micro)

    def key_of(lo: int, hi: int) -> np.ndarray:
        return shape.slot_number(rows.step[lo:hi], rows.rank[lo:hi], rows.micro[lo:hi])

    return sorted_runs(key_of, len(rows)) is not None


def write_manifest(
    out_dir: str | os.PathLike,
    rows: ManifestRows,
    *,
    dropped_sample: np.ndarray,
    dropped_reason: Sequence[str],
    meta: Mapping[str, Any],
    epoch_num_steps: Sequence[int] | None = None,
    rows_per_row_group: int = DEFAULT_ROWS_PER_ROW_GROUP,
    commit: bool = True,
) -> Path:
    """Write ``manifest.parquet`` and ``dropped.parquet`` into ``out_dir``, each atomically, then
    (``commit``) the folder's ``_COMMIT.json`` listing every file in it.

    Args:
        out_dir: the manifest directory (created if needed).
        rows: placements sorted by (step, rank, micro, order within group).
        dropped_sample: (D,) samples not placed.
        dropped_reason: (D,) reason per dropped sample.
        meta: metadata to store (``world_size``, ``micro_batches``, ``num_samples``, ``seed``,
            ``algorithm``, ``params``, ``lengths_fingerprint``, ``summary``, ...). ``num_steps``,
            ``epoch_num_steps``, ``schema_version`` and ``row_group_first_steps`` are filled in.
        epoch_num_steps: steps of each epoch (default: one epoch with all steps).
        rows_per_row_group: target rows per row group (groups still end at step boundaries).

    Returns:
        The path of ``manifest.parquet``.
    """
    if not is_slot_sorted(rows):
        raise ManifestError("manifest rows are not sorted by (step, rank, micro)",
                            fix="sort placements before writing (this is a bug in the packer)")
    out = Path(out_dir)
    step = rows.step
    num_steps = int(step[-1]) + 1 if len(step) else 0  # sorted: the last row has the largest step
    epochs = list(epoch_num_steps) if epoch_num_steps is not None else [num_steps]
    if sum(epochs) != num_steps:
        raise ManifestError(f"epoch_num_steps {epochs} does not add up to {num_steps} steps")
    # Step boundaries: start row of every step, then cut row groups at the first step boundary
    # at or after each multiple of rows_per_row_group.
    step_start = search_sorted(step, np.arange(num_steps + 1))
    cuts = run_blocks(step_start, rows_per_row_group)
    full_meta = {
        **dict(meta),
        "schema_version": SCHEMA_VERSION,
        "tool_version": __version__,
        "num_steps": num_steps,
        "epoch_num_steps": epochs,
        "row_group_first_steps": cuts[:-1],
    }
    schema = rows.to_table(0, 0).schema.with_metadata({METADATA_KEY: json.dumps(full_meta, sort_keys=True).encode()})
    path = out / MANIFEST_FILE
    with atomic_path(path) as tmp:
        dictionary = [name for name in schema.names if name != "sample"]
        with pq.ParquetWriter(tmp, schema, compression=MANIFEST_COMPRESSION, use_dictionary=dictionary) as writer:
            if num_steps == 0:
                writer.write_table(rows.to_table())
            for first, last in zip(cuts[:-1], cuts[1:]):
                lo, hi = int(step_start[first]), int(step_start[last])
                writer.write_table(rows.to_table(lo, hi), row_group_size=max(hi - lo, 1))
    dropped = pa.table({
        "sample": arrow_of(np.asarray(dropped_sample, dtype=np.int64)),
        "reason": arrow_strings(dropped_reason),
    })
    with atomic_path(out / DROPPED_FILE) as tmp:
        pq.write_table(dropped, tmp, compression="zstd")
    if commit:
        write_commit(out)
    return path


@dataclass(frozen=True)
class ManifestFile:
    """An opened manifest: metadata in memory, rows read on demand by step range.

    Attributes:
        path: the manifest directory.
        meta: the decoded ``balancer`` metadata.
    """

    path: Path
    meta: Mapping[str, Any]
    _file: pq.ParquetFile = field(repr=False, compare=False)

    @property
    def num_steps(self) -> int:
        return int(self.meta["num_steps"])

    @property
    def world_size(self) -> int:
        return int(self.meta["world_size"])

    @property
    def shape(self) -> StepShape:
        """The step shape the manifest was packed for."""
        return StepShape(world_size=self.world_size, micro_batches=self.micro_batches)

    def check_lengths(self, fingerprint: str, origin: str = "the lengths table", *, required: bool = True) -> None:
        """Raise :class:`ManifestError` unless ``fingerprint`` is the lengths table this was packed from.

        The one check every reader of a manifest plus lengths makes (report, replay, planners).
        ``required=False`` accepts a manifest that records no fingerprint (one not written by
        ``balancer pack``); a recorded one must always match.
        """
        expected = self.meta.get("lengths_fingerprint")
        if expected is None and not required:
            return
        if expected != fingerprint:
            raise ManifestError(
                f"{origin} (fingerprint {fingerprint[:12]}) is not the one {self.path} was packed from "
                f"(fingerprint {str(expected)[:12]})",
                fix="pass the same lengths files, in the same order, that `balancer pack` read")

    @property
    def micro_batches(self) -> int:
        return int(self.meta["micro_batches"])

    @property
    def epoch_num_steps(self) -> list[int]:
        return [int(s) for s in self.meta.get("epoch_num_steps", [self.num_steps])]

    @property
    def num_samples(self) -> int:
        """The samples each epoch places: opening leaves the field optional, a reader that counts them asks here."""
        if "num_samples" not in self.meta:
            raise ManifestError(f"{self.path}: metadata field 'num_samples' is missing", fix="re-run `balancer pack`")
        return int(self.meta["num_samples"])

    def read_steps(self, first: int, last: int) -> ManifestRows:
        """Rows of steps ``first .. last - 1``, reading only the row groups that hold them."""
        first, last = max(first, 0), min(last, self.num_steps)
        if first >= last:
            return ManifestRows.from_table(self._file.schema_arrow.empty_table())
        starts = list(self.meta["row_group_first_steps"])
        lo = int(np.searchsorted(starts, first, side="right")) - 1
        hi = int(np.searchsorted(starts, last, side="left"))
        table = self.read_row_groups(list(range(lo, hi)))
        step = numpy_of(table.column("step"))
        a, b = search_sorted(step, [first, last])
        return ManifestRows.from_table(table.slice(int(a), int(b - a)))

    def read_row_groups(self, indices: list[int], **options: Any) -> pa.Table:
        """Row groups of the file (``pq.ParquetFile.read_row_groups``); damage that keeps the file's size
        (the commit record checksums files over 8 MiB only on a full check) is a ManifestError."""
        try:
            return self._file.read_row_groups(indices, **options)
        except (OSError, pa.ArrowException, ValueError) as exc:  # ValueError: a page's bytes, not UTF-8
            raise ManifestError(f"{self.path / MANIFEST_FILE}: unreadable rows ({' '.join(str(exc).split())[:160]})",
                                fix="re-run `balancer pack` (the file was changed after it was written)") from None

    def read_all(self) -> ManifestRows:
        """All rows (every epoch), a row group at a time into arrays of their final size and type."""
        f, narrow = self._file, self.meta.get("num_samples", 2**31) < 2**31  # narrow: ids fit int32
        columns = {name: np.empty(f.metadata.num_rows, dtype=np.int32 if name == "sample" and narrow else
                                  f.schema_arrow.field(name).type.to_pandas_dtype()) for name in f.schema_arrow.names}
        at = 0
        for i in range(f.num_row_groups):
            table = self.read_row_groups([i], use_threads=False)
            for name, target in columns.items():
                values = numpy_of(table.column(name))
                if values.dtype != target.dtype and not (  # ids that are not int32 (not our file): kept exact
                        values.dtype.kind in "iu" and (values.astype(target.dtype) == values).all()):
                    columns[name] = target = target.astype(values.dtype)  # for the checks to see them
                target[at:at + table.num_rows] = values
            at += table.num_rows
            del table
        release_freed_memory()  # the row groups' buffers
        return ManifestRows.from_columns(columns)


def open_manifest(manifest_dir: str | os.PathLike, *, full: bool = False) -> ManifestFile:
    """Open a manifest directory, checking its commit record and its schema version.

    ``full`` checksums ``manifest.parquet`` too (else only its size; see :mod:`balancer_cli.commit`).

    Raises:
        ManifestError: missing folder or file, bad commit record, unreadable Parquet, schema or version.
    """
    path = Path(manifest_dir)
    file = path / MANIFEST_FILE if path.is_dir() else path
    if not file.is_file():
        raise ManifestError(f"{path}: no {MANIFEST_FILE} there", fix="run `balancer pack ... -o DIR` first")
    verify_commit(file.parent, names=(file.name, DROPPED_FILE), full=full)
    parquet, meta = read_meta(file)
    return ManifestFile(path=file.parent, meta=meta, _file=parquet)


def read_dropped(manifest_dir: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """``(sample (D,) int64, reason (D,) object)`` of a manifest's ``dropped.parquet``."""
    file = Path(manifest_dir) / DROPPED_FILE
    if not file.is_file():
        raise ManifestError(f"{manifest_dir}: no {DROPPED_FILE} there", fix="re-run `balancer pack`")
    try:
        with pq.ParquetFile(file) as parquet:  # not pq.read_table: its dataset layer imports pandas
            table = parquet.read()
        sample, reason = table.column("sample"), table.column("reason")
        if not pa.types.is_integer(sample.type) or not pa.types.is_string(reason.type):
            raise TypeError(f"columns sample {sample.type}, reason {reason.type}")
        reasons = np.empty(len(reason), dtype=object)  # to_numpy of strings imports pandas
        reasons[:] = reason.to_pylist()
        return numpy_of(sample), reasons
    except (OSError, pa.ArrowException, KeyError, TypeError) as exc:  # KeyError: a column missing
        raise ManifestError(f"{file}: not a list of dropped samples ({' '.join(str(exc).split())[:200]})",
                            fix="re-run `balancer pack`") from None
