"""The lengths table: one row per sample with its encoder and LLM token counts.

This is the contract between ``scan`` (which writes it) and ``search``/``pack``/``report``/the
runtime (which read it). Columns, in sample order:

- ``sample`` int64 (0..N-1) and ``source`` string (dictionary-encoded).
- ``llm_tokens`` int32: the full LLM sequence length, media placeholder tokens included.
- per encoder module ``<m>``: ``<m>_tokens`` int32, ``<m>_items`` int32 and optionally
  ``<m>_seqlens`` list<int32>.
- ``error`` string: null when measured, else why not. Such samples are never packed.
- optional, for samples of WebDataset tar shards (null for other samples): ``shard`` string
  (dictionary-encoded), ``key`` string, and ``member_names`` list<string>, ``member_offsets``
  list<int64>, ``member_sizes`` list<int64> (each member's extension, data offset and size in
  the shard); see :data:`MEMBER_COLUMNS`.

The file metadata key ``balancer`` holds JSON provenance (schema version, tool version, presets,
input files with sizes and fingerprints). OmniBal/InternVL token-length JSON
(``[{"vit_num": .., "token_num": ..}]``) reads as a lengths table with module ``vision``
(:mod:`balancer_cli.omnibal_json`).

Example:
    >>> import numpy as np
    >>> lt = make_lengths_table(np.array([300, 40]), {"vision": (np.array([1024, 0]), np.array([1, 0]))})
    >>> lt.modules, lt.num_samples, lt.tokens("vision").tolist()
    (('vision',), 2, [1024, 0])
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from balancer_cli import __version__
from balancer_cli._arrow import arrow_of, arrow_repeat, numpy_of
from balancer_cli._fsutil import atomic_path
from balancer_cli.errors import InputError
from balancer_cli.omnibal_json import read_omnibal_json

__all__ = ["SCHEMA_VERSION", "METADATA_KEY", "COLUMNS_FIX", "LLM", "DEFAULT_SOURCE", "MEMBER_COLUMNS", "LengthsTable",
           "make_lengths_table", "encoder_modules", "lengths_fingerprint", "read_lengths", "read_omnibal_json",
           "write_lengths"]

SCHEMA_VERSION = 1
METADATA_KEY = b"balancer"
#: How to fix a column a lengths table may not hold.
COLUMNS_FIX = "rename or remove it; columns are sample, source, llm_tokens, <m>_tokens, <m>_items, <m>_seqlens, error"
#: The name of the language-model module in reports, costs and manifests.
LLM = "llm"
#: The source of samples that name none (no ``source`` column, or a null in it).
DEFAULT_SOURCE = "data"

_PARQUET_MAGIC = b"PAR1"
#: The optional tar-member columns and their types (``shard`` is stored dictionary-encoded).
MEMBER_COLUMNS = {"shard": pa.string(), "key": pa.string(), "member_names": pa.list_(pa.string()),
                  "member_offsets": pa.list_(pa.int64()), "member_sizes": pa.list_(pa.int64())}


def encoder_modules(column_names: Sequence[str]) -> tuple[str, ...]:
    """Encoder modules present in a table: every ``<m>`` with both ``<m>_tokens`` and ``<m>_items``.

    Returned in column order, so the result is deterministic.

    Example:
        >>> encoder_modules(["sample", "llm_tokens", "vision_tokens", "vision_items", "audio_tokens"])
        ('vision',)
    """
    names = set(column_names)
    modules = []
    for name in column_names:
        if name.endswith("_tokens") and name != "llm_tokens":
            module = name[: -len("_tokens")]
            if f"{module}_items" in names:
                modules.append(module)
    return tuple(modules)


def lengths_fingerprint(table: pa.Table) -> str:
    """Content fingerprint of a lengths table (independent of Parquet encoding or metadata).

    Covers ``llm_tokens``, every module's tokens and items, and which samples have errors; the
    manifest stores it so the runtime can check it replays against the same data. Columns are
    hashed a block at a time (the digest of the whole int64 column, without its copy).
    """
    names = ["llm_tokens"] + [f"{m}_{s}" for m in encoder_modules(table.column_names) for s in ("tokens", "items")]
    columns: list[tuple[bytes, Any]] = [(name.encode(), table.column(name)) for name in names]
    if "error" in table.column_names:
        columns.append((b"error", table.column("error")))
    digest = hashlib.blake2b(digest_size=16)
    for name, column in columns:
        digest.update(len(name).to_bytes(8, "little"))
        digest.update(name)
        itemsize = 1 if name == b"error" else 8
        digest.update((len(column) * itemsize).to_bytes(8, "little"))
        for lo in range(0, len(column), _HASH_BLOCK):
            block = column.slice(lo, _HASH_BLOCK)
            # The arrays' own buffers: the same bytes as ``tobytes()``, without its copy.
            if name == b"error":
                digest.update(np.ascontiguousarray(numpy_of(block.is_null()), dtype=bool))
            else:
                digest.update(np.ascontiguousarray(_as_int64(block)))
    return digest.hexdigest()


#: Rows hashed at a time by :func:`lengths_fingerprint`.
_HASH_BLOCK = 1 << 20


def _as_int64(column: pa.ChunkedArray | pa.Array, stored: bool = False) -> np.ndarray:
    """Integer values (nulls as 0) as int64, or with ``stored`` in the column's own type: no copy
    of a column in one chunk without nulls (10M: an (N,) int64 copy page-faults ~0.1 s)."""
    if column.null_count:  # else no fill (a copy of the column)
        column = column.fill_null(0)
    return np.asarray(numpy_of(column), dtype=None if stored else np.int64)


@dataclass(frozen=True)
class LengthsTable:
    """A validated lengths table plus its provenance metadata.

    Attributes:
        table: the Arrow table (columns as in the module docstring).
        metadata: the decoded ``balancer`` metadata (may be empty for imported JSON).
        fingerprint: :func:`lengths_fingerprint` of ``table``.
    """

    table: pa.Table
    metadata: Mapping[str, Any] = field(default_factory=dict)
    fingerprint: str = ""

    @property
    def num_samples(self) -> int:
        return self.table.num_rows

    @property
    def modules(self) -> tuple[str, ...]:
        """Encoder modules (``vision``, ``audio``, ...); the LLM is implicit."""
        return encoder_modules(self.table.column_names)

    def llm_tokens(self, *, stored: bool = False) -> np.ndarray:
        """LLM tokens per sample, int64 (0 where the sample has an error); with ``stored``, in the
        column's own integer type (a read-only view of the table where it can be)."""
        return _as_int64(self.table.column("llm_tokens"), stored)

    def tokens(self, module: str, *, stored: bool = False) -> np.ndarray:
        """Encoder tokens of ``module`` per sample, int64; ``tokens("llm")`` is ``llm_tokens()``."""
        return self.llm_tokens(stored=stored) if module == LLM else _as_int64(
            self.table.column(f"{module}_tokens"), stored)

    def items(self, module: str, *, stored: bool = False) -> np.ndarray:
        """Encoder items (images/tiles/clips) of ``module`` per sample, int64."""
        return _as_int64(self.table.column(f"{module}_items"), stored)

    def item_sumsq(self, module: str) -> np.ndarray:
        """Sum over each sample's items of its squared item tokens, (N,) float64: from
        ``<m>_seqlens`` when the table has it, else ``tokens^2 / items`` (items of equal size);
        0 for samples with an error (the attention term of an encoder's cost).
        """
        ok = self.ok_mask()
        column = f"{module}_seqlens"
        if column in self.table.column_names:
            seqlens = self.table.column(column).combine_chunks()
            flat = np.asarray(numpy_of(pa.compute.list_flatten(seqlens).cast(pa.float64())))
            offsets = np.asarray(numpy_of(seqlens.offsets), dtype=np.int64)
            cum = np.concatenate([[0.0], np.cumsum(flat * flat)])
            return np.where(ok, cum[offsets[1:]] - cum[offsets[:-1]], 0.0)
        items = np.where(ok, self.items(module), 0).astype(np.float64)
        tokens = np.where(ok, self.tokens(module), 0).astype(np.float64)
        return np.divide(tokens * tokens, items, out=np.zeros_like(tokens), where=items > 0)

    def sources(self) -> np.ndarray:
        """Source name per sample (object array of str)."""
        return np.asarray(self.table.column("source").cast(pa.string()).to_numpy(zero_copy_only=False))

    def errors(self) -> np.ndarray:
        """Error text per sample (object array; ``None`` where the sample was measured)."""
        return np.asarray(self.table.column("error").to_numpy(zero_copy_only=False), dtype=object)

    def ok_mask(self) -> np.ndarray:
        """Boolean mask of samples that were measured (no error) and can be packed."""
        return np.asarray(numpy_of(self.table.column("error").is_null()), dtype=bool)


def make_lengths_table(
    llm_tokens: np.ndarray,
    modules: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
    *,
    source: Sequence[str] | np.ndarray | str = DEFAULT_SOURCE,
    error: Sequence[str | None] | None = None,
    seqlens: Mapping[str, Sequence[Sequence[int]]] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> LengthsTable:
    """Build and validate a lengths table from arrays.

    Args:
        llm_tokens: (N,) LLM tokens per sample.
        modules: ``{module: (tokens_N, items_N)}`` for each encoder.
        source: one source name for all samples, or (N,) names.
        error: (N,) error text or None per sample.
        seqlens: ``{module: per-sample list of per-item token counts}``.
        metadata: provenance stored under the ``balancer`` key.

    Returns:
        The validated :class:`LengthsTable`.
    """
    n = len(llm_tokens)
    columns: dict[str, pa.Array] = {
        "source": arrow_repeat(source, n) if isinstance(source, str) else pa.array(list(source), pa.string()),
        "llm_tokens": _int_array(llm_tokens),
    }
    for module, (tokens, items) in (modules or {}).items():
        columns[f"{module}_tokens"] = _int_array(tokens)
        columns[f"{module}_items"] = _int_array(items)
        if seqlens and module in seqlens:
            columns[f"{module}_seqlens"] = pa.array(list(seqlens[module]), pa.list_(pa.int32()))
    columns["error"] = pa.array([None] * n if error is None else list(error), pa.string())
    return _finish(pa.table(columns), dict(metadata or {}), origin="<arrays>")


def _int_array(values) -> pa.Array:
    """Integer values as they are (the table's checks then name a value past int32 instead of
    seeing it wrapped); anything else as int64, truncated as before."""
    array = np.asarray(values)
    return pa.array(array if array.dtype.kind in "iu" else array.astype(np.int64))


def _finish(table: pa.Table, metadata: dict, origin: str) -> LengthsTable:
    table = _normalize(table, origin)
    return LengthsTable(table=table, metadata=metadata, fingerprint=lengths_fingerprint(table))


def _normalize(table: pa.Table, origin: str) -> pa.Table:
    """Check the contract and cast columns to their canonical types (raises :class:`InputError`)."""
    if table.num_rows == 0:
        raise InputError(f"{origin}: the lengths table is empty", fix="scan a dataset with at least one sample")
    twice = next((c for c in table.column_names if table.column_names.count(c) > 1), None)
    if twice is not None:
        raise InputError(f"{origin}: column '{twice}' appears {table.column_names.count(twice)} times",
                         fix="keep one column of each name")
    if "llm_tokens" not in table.column_names:
        raise InputError(
            f"{origin}: column 'llm_tokens' is missing (columns: {', '.join(table.column_names)})",
            fix="write lengths with `balancer scan`, or name the LLM length column 'llm_tokens'",
        )
    n = table.num_rows
    if "error" not in table.column_names:
        table = table.append_column("error", pa.nulls(n, pa.string()))
    if "source" not in table.column_names:
        table = table.append_column("source", arrow_repeat(DEFAULT_SOURCE, n))
    ok = np.asarray(numpy_of(table.column("error").is_null()), dtype=bool)
    int_columns = ["llm_tokens"] + [f"{m}_{s}" for m in encoder_modules(table.column_names) for s in ("tokens", "items")]
    for name in int_columns:
        column = table.column(name)
        if not pa.types.is_integer(column.type):
            raise InputError(f"{origin}: column '{name}' has type {column.type}, expected integers",
                             fix="store token and item counts as integers")
        if column.null_count:
            nulls = np.asarray(numpy_of(column.is_null()), dtype=bool) & ok
            if nulls.any():
                row = int(np.flatnonzero(nulls)[0])
                raise InputError(f"{origin}: sample {row} has no value in '{name}' but no error either",
                                 fix="fill the value or set the row's 'error' column")
            column = column.fill_null(0)
        # Range checks by Arrow's kernels: no int64 copy of the column (80 MB per 10M samples).
        low, high = (x.as_py() for x in pc.min_max(column).values())
        if low is not None and low < 0:
            values = _as_int64(column)
            bad = (values < 0) & ok
            if bad.any():
                row = int(np.flatnonzero(bad)[0])
                raise InputError(f"{origin}: sample {row} has negative '{name}' = {values[row]}",
                                 fix="lengths must be >= 0; re-run `balancer scan`")
        if high is not None and high > np.iinfo(np.int32).max:
            row = pc.index(column, high).as_py()
            raise InputError(f"{origin}: sample {row} has '{name}' = {high}, past int32 ({np.iinfo(np.int32).max})",
                             fix="check the length column; no real sample has that many tokens or items")
        if low is not None and low < np.iinfo(np.int32).min:
            column = arrow_of(np.maximum(_as_int64(column), np.iinfo(np.int32).min).astype(np.int32))
        table = table.set_column(table.column_names.index(name), name, column.cast(pa.int32()))
    table = table.set_column(table.column_names.index("error"), "error", table.column("error").cast(pa.string()))
    source = table.column("source")
    if source.null_count:  # no source is the default source, as when the column is absent (a null code would be 0)
        source = source.cast(pa.string()).fill_null(DEFAULT_SOURCE)
    if not pa.types.is_dictionary(source.type):
        source = source.cast(pa.string()).dictionary_encode()
    table = table.set_column(table.column_names.index("source"), "source", source)
    for name, kind in MEMBER_COLUMNS.items():
        if name in table.column_names:
            column = table.column(name)
            column = column.cast(pa.string()).dictionary_encode() if name == "shard" else column.cast(kind)
            table = table.set_column(table.column_names.index(name), name, column)
    # Sample ids are positions 0..N-1: checked where given (and kept: the same values, without a
    # new (N,) int64 column, 0.2 s of page faults at 10M), numbered where not.
    if "sample" in table.column_names:
        column = table.column("sample")
        if column.null_count or not all(  # a block at a time: no (N,) int64 copies next to the table
                np.array_equal(_as_int64(column.slice(lo, _HASH_BLOCK)), np.arange(lo, min(lo + _HASH_BLOCK, n)))
                for lo in range(0, n, _HASH_BLOCK)):
            raise InputError(f"{origin}: column 'sample' is not 0..{n - 1} in order",
                             fix="keep rows in sample order, one per sample")
        if column.type != pa.int64():
            table = table.set_column(table.column_names.index("sample"), "sample", column.cast(pa.int64()))
    else:
        table = table.add_column(0, "sample", arrow_of(np.arange(n, dtype=np.int64)))
    return table.replace_schema_metadata(None)


def _read_one(path: Path) -> tuple[pa.Table, dict]:
    if not path.is_file():  # a folder, device or pipe is no lengths file (reading a pipe would block)
        raise InputError(f"{path}: {'not a regular file' if path.exists() else 'no such file'}", fix="check the path")
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic == _PARQUET_MAGIC:
        try:
            pf = pq.ParquetFile(path)
            table = pf.read()
        except (OSError, pa.ArrowException) as exc:
            raise InputError(f"{path}: unreadable Parquet ({exc})", fix="re-run `balancer scan`") from None
        raw = (pf.schema_arrow.metadata or {}).get(METADATA_KEY)
        try:
            meta = json.loads(raw) if raw else {}
        except ValueError as exc:  # not JSON, or not UTF-8: named in the error below
            meta = exc
        if not isinstance(meta, dict):
            raise InputError(f"{path}: its '{METADATA_KEY.decode()}' metadata is not a JSON object ({meta})",
                             fix="re-run `balancer scan`, or remove that key from the file's metadata")
        return table, meta
    return read_omnibal_json(path), {"imported_from": "omnibal-json"}


def read_lengths(paths: str | os.PathLike | Sequence[str | os.PathLike], *, members: bool = False) -> LengthsTable:
    """Read one or several lengths files (Parquet or OmniBal JSON) as one table, in order.

    Several files concatenate: ``sample`` indexes the concatenation. A module missing from one
    file counts as 0 tokens and 0 items for its samples (e.g. a text-only source); its item sizes
    (``<m>_seqlens``) are kept where every file with the module has them. The tar
    member columns (:data:`MEMBER_COLUMNS`) are read only with ``members=True`` (the runtime's
    ``ShardDataset``): packing and reports read the counts alone.

    Raises:
        InputError: unreadable or empty input, missing columns, negative or missing lengths.
    """
    path_list = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]
    if not path_list:
        raise InputError("no lengths file given", fix="pass a lengths Parquet or OmniBal JSON file")
    tables, metas = [], []
    for path in path_list:
        table, meta = _read_one(path)
        if not members:
            table = table.drop_columns([name for name in MEMBER_COLUMNS if name in table.column_names])
        tables.append(_normalize(table, str(path)))
        metas.append(meta)
    if len(tables) == 1:
        return LengthsTable(tables[0], metas[0], lengths_fingerprint(tables[0]))
    modules = list(dict.fromkeys(m for t in tables for m in encoder_modules(t.column_names)))
    aligned = []
    for path, table in zip(path_list, tables):
        n = table.num_rows
        columns = {
            "source": table.column("source").cast(pa.string()),
            "llm_tokens": table.column("llm_tokens"),
        }
        for module in modules:
            for suffix in ("tokens", "items"):
                name = f"{module}_{suffix}"
                columns[name] = table.column(name) if name in table.column_names else arrow_of(np.zeros(n, np.int32))
            name = f"{module}_seqlens"  # kept where every file with the module has them (no items elsewhere)
            if all(name in t.column_names for t in tables if f"{module}_items" in t.column_names):
                kind = pa.list_(pa.int32())
                columns[name] = (table.column(name).cast(kind) if name in table.column_names
                                 else pa.ListArray.from_arrays(np.zeros(n + 1, np.int32), pa.array([], pa.int32())))
        columns["error"] = table.column("error")
        for name, kind in MEMBER_COLUMNS.items():  # kept when any file has them (null elsewhere)
            if any(name in t.column_names for t in tables):
                columns[name] = (table.column(name).cast(kind) if name in table.column_names
                                 else pa.nulls(n, kind))
        left = [c for c in table.column_names if c not in columns and c != "sample" and not c.endswith("_seqlens")]
        if left:  # as one file's would be refused (balancer_cli.pack.inputs), not dropped unseen
            raise InputError(f"{path}: unknown column '{left[0]}'", fix=COLUMNS_FIX)
        aligned.append(pa.table(columns))
    merged = _normalize(pa.concat_tables(aligned).combine_chunks(), " + ".join(map(str, path_list)))
    return LengthsTable(merged, {"inputs": metas}, lengths_fingerprint(merged))


def write_lengths(lengths: LengthsTable, path: str | os.PathLike) -> None:
    """Write a lengths table to Parquet atomically, with its metadata and fingerprint."""
    meta = {"schema_version": SCHEMA_VERSION, "tool_version": __version__, **dict(lengths.metadata),
            "fingerprint": lengths.fingerprint}
    table = lengths.table.replace_schema_metadata({METADATA_KEY: json.dumps(meta, sort_keys=True).encode()})
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")
