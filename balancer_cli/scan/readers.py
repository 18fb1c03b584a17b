"""Input formats of ``balancer scan``: detection, block splitting, and streaming record readers.

The scan is split into :class:`RecordBlock` s: frozen, picklable descriptions of a run of records
(input file, format, byte or row range, first sample index, source name, image root). The main
process walks the inputs once with :func:`iter_blocks` (constant memory: JSONL line by line, JSON
lists with an incremental decoder, Parquet and ``datasets`` by row counts) and any worker process
reads a block's records with :func:`read_block`. Any engine that measures the blocks and
concatenates them in order produces the same table.

Formats (:func:`detect_format`; ``--format`` forces one):

- ``jsonl``: one JSON object per line; blank lines are skipped (they are not samples).
- ``json``: a JSON list of records (decoded incrementally; the main process parses the list once to
  find record boundaries, so a syntax error anywhere makes the whole file unreadable).
- ``internvl-meta``: InternVL's meta JSON ``{name: {"root", "annotation", "repeat_time", ...}}``:
  each dataset's annotation file is scanned with ``root`` as its image root and the dataset name as
  its source, ``repeat_time`` times (a fraction keeps the first ``int(n * repeat_time)`` records);
  a per-dataset ``max_dynamic_patch`` overrides the rule's ``max_tiles`` for that dataset.
- ``parquet``: rows of a Parquet file (only the columns the scan understands are read).
- ``hf``: a ``datasets.Dataset.save_to_disk`` folder (a ``DatasetDict`` folder takes ``--split``,
  default ``train``), or a ``datasets`` cache ``.arrow`` file (what ``load_dataset`` over local
  files writes).

Example:
    >>> import json, pathlib, tempfile
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "d.jsonl"
    >>> _ = p.write_text(json.dumps({"text": "a"}) + "\\n\\n" + json.dumps({"text": "b"}) + "\\n")
    >>> [b.num_records for b in iter_blocks([str(p)], block_size=1)]
    [1, 1]
    >>> [line for line, _ in read_block(next(iter_blocks([str(p)])))]
    [1, 3]
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from balancer_cli.errors import InputError, UsageError
from balancer_cli.scan.hf_datasets import (
    HF_BUILDERS,
    builder_files,
    check_builder_input,
    open_dataset,
)
from balancer_cli.scan.jsonlist import iter_json_list
from balancer_cli.scan.records import FIELD_NAMES

__all__ = ["FORMATS", "HF_BUILDERS", "InputSpec", "RecordBlock", "builder_files", "detect_format", "expand_inputs",
           "iter_blocks", "read_block"]

FORMATS = ("jsonl", "json", "internvl-meta", "parquet", "hf")
_WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class InputSpec:
    """One concrete input after expanding meta files: what to read and how to name its samples."""

    path: str
    format: str
    source: str
    image_root: str
    repeat: float = 1.0
    rule_overrides: tuple[tuple[str, Any], ...] = ()
    split: str | None = None
    builder: str | None = None


@dataclass(frozen=True)
class RecordBlock:
    """A run of consecutive records of one input, measurable by any worker.

    Attributes:
        path: the input file (or ``datasets`` folder) as given.
        format: one of :data:`FORMATS` (never ``internvl-meta``: metas expand to their files).
        source: the ``source`` column value of these samples.
        first_sample: index of the first record in the scan's concatenation of all inputs.
        num_records: records in the block.
        start, stop: byte range (``jsonl``) or row range (``parquet``, ``hf``) of the records.
        first_line: 1-based line of the first record (``jsonl``/``json``) or row number.
        text: the block's elements of a JSON list, joined by NUL (``json`` only; JSON text never
            holds a raw NUL).
        lines: the first line of each element (``json`` only).
        image_root: folder relative image paths resolve against (and may not escape).
        rule_overrides: vision-rule parameters for this input only (InternVL meta).
        split: the ``DatasetDict`` split (``hf`` only).
        builder: the ``datasets.load_dataset`` builder of ``path`` (``hf`` over local files only).
    """

    path: str
    format: str
    source: str
    first_sample: int
    num_records: int
    start: int = 0
    stop: int = 0
    first_line: int = 1
    text: str | None = None
    lines: tuple[int, ...] = ()
    image_root: str = "."
    rule_overrides: tuple[tuple[str, Any], ...] = ()
    split: str | None = None
    builder: str | None = None


def _open_error(path: str, exc: OSError) -> InputError:
    return InputError(f"{path}: cannot read input ({exc.strerror or exc})",
                      fix="check the path and its permissions")


def detect_format(path: str) -> str:
    """Detect an input's format from its content (not its name); raises InputError if unknown.

    Example:
        >>> import pathlib, tempfile
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "x.json"
        >>> _ = p.write_text('[{"text": "hi"}]')
        >>> detect_format(str(p))
        'json'
    """
    target = Path(path)
    if target.is_dir():
        if (target / "dataset_dict.json").is_file() or (target / "state.json").is_file():
            return "hf"
        raise InputError(f"{path}: a folder that is not a `datasets` save_to_disk folder",
                         fix="pass the data files themselves (JSONL, JSON, Parquet) or a save_to_disk folder")
    if not target.exists():
        raise InputError(f"{path}: no such file", fix="check the path")
    try:
        with open(target, "rb") as handle:
            head = handle.read(1 << 16)
    except OSError as exc:
        raise _open_error(path, exc) from None
    if head.startswith(b"PAR1"):
        return "parquet"
    if target.suffix == ".arrow":
        return "hf"
    text = head.decode("utf-8", errors="replace").lstrip(_WHITESPACE + "\ufeff")
    if not text:
        raise InputError(f"{path}: the input file is empty", fix="pass a file with at least one record")
    if text[0] == "[":
        return "json"
    if text[0] == "{":
        first_line = text.split("\n", 1)[0]
        try:
            obj = json.loads(first_line)
        except json.JSONDecodeError:
            obj = _load_small_json(target)  # a pretty-printed object: only meta files are objects
        return "internvl-meta" if _is_meta(obj) else "jsonl"
    raise InputError(f"{path}: cannot detect the input format (starts with {text[:20]!r})",
                     fix="pass JSONL, a JSON list, an InternVL meta JSON, Parquet, or a datasets folder "
                         "(or force one with --format " + "|".join(FORMATS) + ")")


def _load_small_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: neither JSONL nor a valid JSON document ({exc})",
                         fix="fix the JSON, or write one record per line (JSONL)") from None


def _is_meta(obj: Any) -> bool:
    return (isinstance(obj, dict) and bool(obj)
            and all(isinstance(v, dict) and "annotation" in v for v in obj.values()))


def _meta_inputs(path: str, image_root: str | None, split: str | None) -> list[InputSpec]:
    meta = _load_small_json(Path(path))
    if not _is_meta(meta):
        raise InputError(f"{path}: not an InternVL meta JSON ({{name: {{'root', 'annotation', ...}}}})",
                         fix="drop --format internvl-meta, or fix the file")
    base = Path(path).parent
    specs = []
    for name, entry in meta.items():
        annotation = _relative_to(str(entry["annotation"]), base)
        root = image_root or _relative_to(str(entry.get("root", "")), base)
        repeat = entry.get("repeat_time", 1)
        if isinstance(repeat, bool) or not isinstance(repeat, (int, float)) or repeat <= 0:
            raise InputError(f"{path}: dataset {name!r} has repeat_time={repeat!r}",
                             fix="repeat_time must be a positive number")
        overrides = (("max_tiles", int(entry["max_dynamic_patch"])),) if "max_dynamic_patch" in entry else ()
        fmt = detect_format(annotation)
        if fmt == "internvl-meta":
            raise InputError(f"{path}: dataset {name!r} points at another meta file", fix="flatten the meta file")
        specs.append(InputSpec(annotation, fmt, str(name), root, float(repeat), overrides, split))
    return specs


def _relative_to(value: str, base: Path) -> str:
    # InternVL resolves meta paths against the working directory; fall back to the meta's folder.
    if not value or os.path.isabs(value) or os.path.exists(value):
        return value or "."
    return str(base / value)


def _builder_spec(path: str, builder: str, image_root: str | None, split: str | None) -> InputSpec:
    check_builder_input(path, builder)
    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    name = Path(path).name or str(folder)
    return InputSpec(path, "hf", name, image_root or str(folder), 1.0, (), split, builder)


def expand_inputs(paths: Sequence[str], *, image_root: str | None = None, format: str | None = None,
                  split: str | None = None, builder: str | None = None) -> list[InputSpec]:
    """Detect each input's format and expand meta files into their annotation files, in order.

    Relative image paths resolve against ``image_root``, else the InternVL ``root``, else the
    input file's folder. With ``builder`` (one of :data:`HF_BUILDERS`) every input is a local
    file, glob or folder loaded by ``datasets.load_dataset(builder, ...)``.
    """
    if not paths:
        raise UsageError("no input given", fix="pass one or more dataset files: balancer scan DATA.jsonl ...")
    if format is not None and format not in FORMATS:
        raise UsageError(f"unknown --format {format!r}", fix="use one of: " + ", ".join(FORMATS))
    if builder is not None:
        if format is not None:
            raise UsageError("--format and --hf-builder cannot be combined",
                             fix="--hf-builder already says how to read the inputs; drop --format")
        return [_builder_spec(str(path), builder, image_root, split) for path in paths]
    specs: list[InputSpec] = []
    for path in paths:
        fmt = format or detect_format(path)
        if not os.path.exists(path):
            raise InputError(f"{path}: no such file", fix="check the path")
        if fmt == "internvl-meta":
            specs += _meta_inputs(path, image_root, split)
            continue
        root = image_root or str(Path(path).parent if not Path(path).is_dir() else Path(path))
        specs.append(InputSpec(path, fmt, Path(path).name, root, 1.0, (), split))
    return specs


def _count_records(spec: InputSpec) -> int:
    """Records of one input, in constant memory (a pass over the file for JSON formats)."""
    if spec.format == "json":
        return sum(1 for _ in iter_json_list(spec.path))
    if spec.format == "jsonl":
        return sum(count for *_, count in _jsonl_ranges(spec.path, 1 << 16, None))
    return _table_rows(spec)


def iter_blocks(inputs: Sequence[str] | Sequence[InputSpec], block_size: int = 2048) -> Iterator[RecordBlock]:
    """Split the inputs into blocks of at most ``block_size`` records, in sample order.

    ``inputs`` are paths (formats detected) or :class:`InputSpec` s from :func:`expand_inputs`.
    """
    if block_size < 1:
        raise UsageError(f"--block-size {block_size} must be >= 1")
    specs = [s if isinstance(s, InputSpec) else None for s in inputs]
    if any(s is None for s in specs):
        specs = expand_inputs([str(p) for p in inputs])  # type: ignore[misc]
    first_sample = 0
    for spec in specs:  # type: ignore[union-attr]
        assert spec is not None
        whole, fraction = int(spec.repeat), spec.repeat - int(spec.repeat)
        if spec.repeat < 1:
            whole, limit = 1, int(_count_records(spec) * spec.repeat)
        else:
            if fraction:
                raise InputError(f"{spec.path}: repeat_time={spec.repeat} (a fraction above 1)",
                                 fix="use an integer repeat_time above 1, or a fraction below 1")
            limit = None
        for _ in range(whole):
            for block in _blocks_once(spec, block_size, first_sample, limit):
                first_sample += block.num_records
                yield block


def _blocks_once(spec: InputSpec, block_size: int, first_sample: int,
                 limit: int | None = None) -> Iterator[RecordBlock]:
    common = {"path": spec.path, "format": spec.format, "source": spec.source, "image_root": spec.image_root,
              "rule_overrides": spec.rule_overrides, "split": spec.split, "builder": spec.builder}
    if spec.format == "jsonl":
        chunks = _jsonl_ranges(spec.path, block_size, limit)
    elif spec.format == "json":
        chunks = _json_list_ranges(spec.path, block_size, limit)
    else:
        total = _table_rows(spec)
        total = total if limit is None else min(total, limit)
        chunks = ((start, min(start + block_size, total), start + 1, None, (), min(block_size, total - start))
                  for start in range(0, total, block_size))
    for start, stop, first_line, text, lines, count in chunks:
        yield RecordBlock(first_sample=first_sample, num_records=count, start=start, stop=stop,
                          first_line=first_line, text=text, lines=lines, **common)
        first_sample += count


def _jsonl_ranges(path: str, block_size: int, limit: int | None) -> Iterator[tuple]:
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise _open_error(path, exc) from None
    with handle:
        offset, line_no, count, start, first_line, total = 0, 0, 0, 0, 1, 0
        for raw in handle:
            line_no += 1
            if raw.strip():
                if count == 0:
                    start, first_line = offset, line_no
                count += 1
                total += 1
            offset += len(raw)
            if count == block_size or (limit is not None and total == limit and count):
                yield start, offset, first_line, None, (), count
                count = 0
                if limit is not None and total == limit:
                    return
        if count:
            yield start, offset, first_line, None, (), count


def _json_list_ranges(path: str, block_size: int, limit: int | None) -> Iterator[tuple]:
    elements: list[str] = []
    lines: list[int] = []
    total = 0
    for line, element in iter_json_list(path):
        elements.append(element)
        lines.append(line)
        total += 1
        if len(elements) == block_size or total == limit:
            yield 0, 0, lines[0], "\x00".join(elements), tuple(lines), len(elements)
            elements, lines = [], []
            if total == limit:
                return
    if elements:
        yield 0, 0, lines[0], "\x00".join(elements), tuple(lines), len(elements)


def _table_rows(spec: InputSpec) -> int:
    if spec.format == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(spec.path).metadata.num_rows
        except Exception as exc:  # pyarrow raises several types for corrupt files
            raise InputError(f"{spec.path}: unreadable Parquet ({str(exc)[:120]})", fix="check the file") from None
    return len(open_dataset(spec.path, spec.split, spec.builder))


def _wanted_columns(names: Sequence[str], fields: dict[str, str]) -> list[str]:
    keep = set(FIELD_NAMES) | set(fields.values())
    return [name for name in names if name in keep]


def read_block(block: RecordBlock, fields: dict[str, str] | None = None) -> Iterator[tuple[int, Any]]:
    """Yield ``(line, record)`` for each record of ``block``, in order.

    A JSONL line that is not valid JSON yields ``(line, MALFORMED)`` so the sample keeps its row.
    ``line`` is the 1-based line (JSONL, JSON list: the element's first line) or row number.
    """
    fields = fields or {}
    if block.format == "jsonl":
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
                    yield line, MalformedLine(str(getattr(exc, "msg", exc)))
            line += 1
        return
    if block.format == "json":
        for line, element in zip(block.lines, (block.text or "").split("\x00")):
            yield line, json.loads(element)
        return
    if block.format == "parquet":
        import pyarrow.parquet as pq

        handle = pq.ParquetFile(block.path)
        columns = _wanted_columns(handle.schema_arrow.names, fields)
        table = _read_rows(handle, block.start, block.stop, columns)
    else:
        dataset = open_dataset(block.path, block.split, block.builder)
        columns = _wanted_columns(dataset.column_names, fields)
        table = dataset.select_columns(columns).with_format("arrow")[block.start:block.stop]
    for offset, row in enumerate(table.to_pylist()):
        yield block.start + offset + 1, row


def _read_rows(handle: Any, start: int, stop: int, columns: list[str]) -> Any:
    import pyarrow as pa

    # Read only the row groups overlapping [start, stop), then slice.
    tables, offset = [], 0
    for index in range(handle.num_row_groups):
        rows = handle.metadata.row_group(index).num_rows
        if offset + rows > start and offset < stop:
            group = handle.read_row_group(index, columns=columns)
            tables.append(group.slice(max(0, start - offset), min(stop, offset + rows) - max(start, offset)))
        offset += rows
        if offset >= stop:
            break
    return pa.concat_tables(tables) if tables else handle.schema_arrow.empty_table().select(columns)


@dataclass(frozen=True)
class MalformedLine:
    """A JSONL line that is not valid JSON (the reason is the decoder's message)."""

    reason: str
