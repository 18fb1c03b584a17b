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
    [(1, {'text': 'a'}), (3, MalformedLine(reason='Expecting value'))]
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from balancer_cli.scan.blocks import MalformedLine, RecordBlock
from balancer_cli.scan.hf_datasets import open_dataset
from balancer_cli.scan.records import FIELD_NAMES

__all__ = ["READERS", "read_block"]


def read_block(block: RecordBlock, fields: dict[str, str] | None = None) -> Iterator[tuple[int, Any]]:
    """Yield ``(line, record)`` for each record of ``block``, in order.

    A JSONL line that is not valid JSON yields ``(line, MalformedLine(...))`` so the sample keeps
    its row. ``line`` is the 1-based line (JSONL, JSON list: the element's first line) or row
    number. ``fields`` (canonical name -> record key) says which table columns to read.

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
    with open(block.path, "rb") as handle:
        handle.seek(block.start)
        data = handle.read(block.stop - block.start)
    try:
        lines: list[str] | list[bytes] = data.decode("utf-8").split("\n")  # str: json skips detection
    except UnicodeDecodeError:
        lines = data.split(b"\n")  # rare: find the bad line(s) one by one
    line = block.first_line
    for raw in lines:
        if raw.strip():
            try:
                yield line, json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                yield line, MalformedLine(reason=str(getattr(exc, "msg", exc)))
        line += 1


def _read_json_list(block: RecordBlock, fields: dict[str, str]) -> Iterator[tuple[int, Any]]:
    for line, element in zip(block.lines, (block.text or "").split("\x00")):
        yield line, json.loads(element)


def _wanted_columns(names: Sequence[str], fields: dict[str, str]) -> list[str]:
    keep = set(FIELD_NAMES) | set(fields.values())
    return [name for name in names if name in keep]


def _rows(block: RecordBlock, table: Any) -> Iterator[tuple[int, Any]]:
    for offset, row in enumerate(table.to_pylist()):
        yield block.start + offset + 1, row


def _read_parquet(block: RecordBlock, fields: dict[str, str]) -> Iterator[tuple[int, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    handle = pq.ParquetFile(block.path)
    columns = _wanted_columns(handle.schema_arrow.names, fields)
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
    yield from _rows(block, pa.concat_tables(tables) if tables else handle.schema_arrow.empty_table().select(columns))


def _read_dataset(block: RecordBlock, fields: dict[str, str]) -> Iterator[tuple[int, Any]]:
    dataset = open_dataset(block.path, block.split, block.builder)
    columns = _wanted_columns(dataset.column_names, fields)
    yield from _rows(block, dataset.select_columns(columns).with_format("arrow")[block.start:block.stop])


#: record format -> ``reader(block, fields)`` yielding the block's ``(line, record)`` pairs.
READERS: dict[str, Callable[[RecordBlock, dict[str, str]], Iterator[tuple[int, Any]]]] = {
    "jsonl": _read_jsonl,
    "json": _read_json_list,
    "parquet": _read_parquet,
    "hf": _read_dataset,
}
