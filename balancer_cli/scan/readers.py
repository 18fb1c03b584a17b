"""Record readers of ``balancer scan``: the records of one :class:`~balancer_cli.scan.blocks.RecordBlock`.

:data:`READERS` maps each record format (:data:`~balancer_cli.scan.inputs.RECORD_FORMATS`) to the
function that yields a block's ``(line, record)`` pairs, and :func:`read_block` dispatches on the
block's format. Workers call it: a block carries everything its reader needs (path, byte or row
range, the JSON list's elements), so no reader keeps state between blocks besides the per-process
``datasets`` cache.

Example:
    >>> import json, pathlib, tempfile
    >>> from balancer_cli.scan.blocks import iter_blocks
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "d.jsonl"
    >>> _ = p.write_text(json.dumps({"text": "a"}) + "\\n\\nnot json\\n")
    >>> list(read_block(next(iter_blocks([str(p)]))))
    [(1, {'text': 'a'}), (3, BadRecord(message='line is not valid JSON (Expecting value)', kind='malformed_record', fix=None))]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from balancer_cli.errors import InputError
from balancer_cli.scan.blocks import RecordBlock
from balancer_cli.scan.hf_datasets import open_dataset
from balancer_cli.scan.inputs import open_input
from balancer_cli.scan.records import FIELD_NAMES, decode_record
from balancer_cli.scan.webdataset import sample_record

__all__ = ["READERS", "read_block"]


def read_block(block: RecordBlock, fields: dict[str, str] | None = None) -> Iterator[tuple[int, Any]]:
    """Yield ``(line, record)`` for each record of ``block``, in order.

    A JSONL line that is not valid JSON yields ``(line, BadRecord(...))`` so the sample keeps
    its row. ``line`` is the 1-based line (JSONL, JSON list: the element's first line) or row
    number, or a tar sample's key (errors name ``SHARD:KEY``). ``fields`` (canonical name -> record key) says which table columns to read.

    Example:
        >>> import pathlib, tempfile
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "x.json"
        >>> _ = p.write_text('[{"text": "a"},\\n {"text": "b"}]')
        >>> block = RecordBlock(path=str(p), format="json", source="x.json", first_sample=0, num_records=2,
        ...                     text='{"text": "a"}\\x00{"text": "b"}', lines=(1, 2))
        >>> list(read_block(block))
        [(1, {'text': 'a'}), (2, {'text': 'b'})]
    """
    return READERS[block.format](block, fields or {})


def _read_jsonl(block: RecordBlock, fields: dict[str, str]) -> Iterator[tuple[int, Any]]:
    with open_input(block.path) as handle:  # a file gone since the split is an InputError naming it
        handle.seek(block.start)
        data = handle.read(block.stop - block.start)
    if block.start == 0 and data.startswith(_BOM):
        data = data[len(_BOM):]  # a UTF-8 byte order mark is not part of the first record
    try:
        lines: list[str] | list[bytes] = data.decode("utf-8").split("\n")  # str: json skips detection
    except UnicodeDecodeError:
        lines = data.split(b"\n")  # rare: find the bad line(s) one by one
    line = block.first_line
    for raw in lines:
        # Blank as the block split sees it (ASCII whitespace only: str.strip() would also drop
        # a line of U+3000 or U+001C, which the split counted as a record).
        if raw.strip(_BLANK if isinstance(raw, str) else None):
            yield line, decode_record(raw, "line")
        line += 1


_BLANK = " \t\n\r\x0b\x0c"


#: The UTF-8 byte order mark some editors write at the start of a file.
_BOM = b"\xef\xbb\xbf"


def _read_json_list(block: RecordBlock, fields: dict[str, str]) -> Iterator[tuple[int, Any]]:
    for line, element in zip(block.lines, (block.text or "").split("\x00")):
        yield line, decode_record(element, "line")


def _wanted_columns(names: Sequence[str], fields: dict[str, str], path: str) -> list[str]:
    keep = set(FIELD_NAMES) | set(fields.values())
    wanted = [name for name in names if name in keep]
    shown = ", ".join(map(str, names[:8])) + (", ..." if len(names) > 8 else "")
    if not wanted:  # reading no column would give rows without records: refuse the file
        raise InputError(f"{path}: no column the scan understands (columns: {shown or 'none'})",
                         fix="map one with --field, e.g. --field text=caption --field image=file_name")
    absent = [f"{name}={key}" for name, key in sorted(fields.items()) if key not in names]
    if absent:  # a table's columns are known: a mapping to none of them is a typo, not records without it
        raise InputError(f"{path}: --field {absent[0]} names no column of the table (columns: {shown})",
                         fix="map an existing column, or scan this input with its own --field options")
    return wanted


def _rows(block: RecordBlock, table: Any) -> Iterator[tuple[int, Any]]:
    for offset, row in enumerate(table.to_pylist()):
        yield block.start + offset + 1, row


def _read_parquet(block: RecordBlock, fields: dict[str, str]) -> Iterator[tuple[int, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        handle = pq.ParquetFile(block.path)
        columns = _wanted_columns(handle.schema_arrow.names, fields, block.path)
        # Read only the row groups overlapping [start, stop), then slice.
        tables, offset = [], 0
        for index in range(handle.num_row_groups):
            rows = handle.metadata.row_group(index).num_rows
            if offset + rows > block.start and offset < block.stop:
                group = handle.read_row_group(index, columns=columns)
                tables.append(group.slice(max(0, block.start - offset),
                                          min(block.stop, offset + rows) - max(block.start, offset)))
            offset += rows
            if offset >= block.stop:
                break
        table = pa.concat_tables(tables) if tables else handle.schema_arrow.empty_table().select(columns)
        rows = table.to_pylist()
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 (pyarrow raises OSError, ArrowInvalid, ... for a corrupt page)
        raise InputError(f"{block.path}: unreadable Parquet rows {block.start + 1}..{block.stop} "
                         f"({type(exc).__name__}: {ascii(str(exc))[1:-1][:120]})",
                         fix="re-write or re-download the file (pyarrow cannot decode it)") from None
    if len(rows) != block.stop - block.start:
        raise InputError(f"{block.path}: rows {block.start + 1}..{block.stop} read back as {len(rows)} rows",
                         fix="re-write the file")
    for offset, row in enumerate(rows):
        yield block.start + offset + 1, row


def _read_dataset(block: RecordBlock, fields: dict[str, str]) -> Iterator[tuple[int, Any]]:
    dataset = open_dataset(block.path, block.split, block.builder)
    columns = _wanted_columns(dataset.column_names, fields, block.path)
    try:
        table = dataset.select_columns(columns).with_format("arrow")[block.start:block.stop]
    except Exception as exc:  # noqa: BLE001 (a corrupt .arrow file raises pyarrow's or datasets' own types)
        raise InputError(f"{block.path}: unreadable dataset rows {block.start + 1}..{block.stop} "
                         f"({type(exc).__name__}: {ascii(str(exc))[1:-1][:120]})",
                         fix="re-save or re-download the dataset") from None
    yield from _rows(block, table)


def _read_tar(block: RecordBlock, fields: dict[str, str]) -> Iterator[tuple[int | str, Any]]:
    with open_input(block.path) as handle:  # a shard gone since the split is an InputError naming it
        fd = handle.fileno()
        for sample in block.samples:
            yield sample.key, sample_record(block.path, sample, fd, fields)


#: record format -> ``reader(block, fields)`` yielding the block's ``(line, record)`` pairs.
READERS: dict[str, Callable[[RecordBlock, dict[str, str]], Iterator[tuple[int, Any]]]] = {
    "jsonl": _read_jsonl,
    "json": _read_json_list,
    "parquet": _read_parquet,
    "hf": _read_dataset,
    "webdataset": _read_tar,
}
