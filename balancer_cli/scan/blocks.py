"""The scan's unit of work: :class:`RecordBlock` s, and the split of the inputs into them.

A block is a frozen, picklable description of a run of records (input file, format, byte or row
range, first sample index, source name, image root; a tar shard's block carries its samples'
member index, :class:`~balancer_cli.scan.webdataset.TarSample` s, so no worker reads a header twice). The main process walks the inputs once with
:func:`iter_blocks` (constant memory: JSONL line by line, JSON lists with an incremental decoder,
Parquet and ``datasets`` by row counts) and any worker reads a block's records with
:func:`~balancer_cli.scan.readers.read_block`. Any engine that measures the blocks and
concatenates them in order produces the same table.

Example:
    >>> import json, pathlib, tempfile
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "d.jsonl"
    >>> _ = p.write_text(json.dumps({"text": "a"}) + "\\n\\n" + json.dumps({"text": "b"}) + "\\n")
    >>> [(b.first_sample, b.num_records, b.first_line) for b in iter_blocks([str(p)], block_size=1)]
    [(0, 1, 1), (1, 1, 3)]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from balancer_cli.errors import InputError, UsageError
from balancer_cli.scan.hf_datasets import open_dataset
from balancer_cli.scan.inputs import (
    RECORD_FORMATS,
    InputSpec,
    expand_inputs,
    open_input,
)
from balancer_cli.scan.jsonlist import iter_json_list
from balancer_cli.scan.webdataset import TarSample, iter_tar_samples

__all__ = ["MAX_REPEAT", "RecordBlock", "iter_blocks", "repeat_plan"]

#: One block's records: ``(start, stop, first_line, text, lines, count)`` (see :class:`RecordBlock`).
_Range = tuple[int, int, int, str | None, tuple[int, ...], int]


@dataclass(frozen=True, kw_only=True)
class RecordBlock:
    """A run of consecutive records of one input, measurable by any worker.

    Attributes:
        path: the input file (or ``datasets`` folder) as given.
        format: one of :data:`~balancer_cli.scan.inputs.RECORD_FORMATS`.
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
    samples: tuple[TarSample, ...] = ()

    def __post_init__(self) -> None:
        if self.format not in RECORD_FORMATS:
            raise ValueError(f"RecordBlock.format {self.format!r} is not one of {RECORD_FORMATS}")
        if self.first_sample < 0 or self.num_records < 0 or not 0 <= self.start <= self.stop:
            raise ValueError(f"RecordBlock of {self.path}: first_sample={self.first_sample}, "
                             f"num_records={self.num_records}, range {self.start}..{self.stop} out of bounds")


def iter_blocks(inputs: Sequence[str] | Sequence[InputSpec], block_size: int = 2048) -> Iterator[RecordBlock]:
    """Split the inputs into blocks of at most ``block_size`` records, in sample order.

    ``inputs`` are paths (formats detected) or :class:`~balancer_cli.scan.inputs.InputSpec` s from
    :func:`~balancer_cli.scan.inputs.expand_inputs`.

    Example:
        >>> next(iter_blocks(["x.jsonl"], block_size=0))
        Traceback (most recent call last):
        ...
        balancer_cli.errors.UsageError: --block-size 0 must be >= 1; fix: e.g. --block-size 2048
    """
    if block_size < 1:
        raise UsageError(f"--block-size {block_size} must be >= 1", fix="e.g. --block-size 2048")
    specs: list[InputSpec] = []
    for item in inputs:
        specs += [item] if isinstance(item, InputSpec) else expand_inputs([str(item)])
    first_sample = 0
    for spec in specs:
        whole, limit = repeat_plan(spec.repeat, spec.path, lambda spec=spec: _count_records(spec))
        for _ in range(whole if limit != 0 else 0):
            for block in _blocks_once(spec, block_size, first_sample, limit):
                first_sample += block.num_records
                yield block


def repeat_plan(repeat: float, path: str, count: Callable[[], int]) -> tuple[int, int | None]:
    """``(passes, first_records)`` of an input under InternVL's ``repeat_time``, as its loader
    (``LazySupervisedDataset.__init__``) applies it to the annotation's records::

        if repeat_time < 1: raw_data = raw_data[:int(len(raw_data) * repeat_time)]
        if repeat_time > 1: assert isinstance(repeat_time, int); raw_data = raw_data * repeat_time

    A fraction keeps the first ``int(n * repeat)`` records (truncated, so possibly none), an
    integer above 1 repeats the whole input; ``count()`` (the input's record count) is called
    only for a fraction. ``first_records`` is None for every record.

    Example:
        >>> repeat_plan(0.5, "d.jsonl", lambda: 5), repeat_plan(0.1, "d.jsonl", lambda: 5), repeat_plan(3, "d.jsonl", lambda: 5)
        ((1, 2), (1, 0), (3, None))
    """
    if not (isinstance(repeat, (int, float)) and math.isfinite(repeat) and repeat > 0) or isinstance(repeat, bool):
        raise InputError(f"{path}: repeat_time={repeat!r} is not a positive number",
                         fix="give repeat_time as a positive number (a fraction below 1 keeps the first records)")
    if repeat < 1:
        return 1, int(count() * repeat)
    if repeat != int(repeat):
        raise InputError(f"{path}: repeat_time={repeat} (a fraction above 1, which InternVL's loader refuses)",
                         fix="use an integer repeat_time above 1, or a fraction below 1")
    if int(repeat) > MAX_REPEAT:
        raise InputError(f"{path}: repeat_time={repeat} is above {MAX_REPEAT:,}",
                         fix=f"use a repeat_time of at most {MAX_REPEAT:,}")
    return int(repeat), None


#: The largest ``repeat_time`` accepted: each pass re-reads the input.
MAX_REPEAT = 10_000


def _blocks_once(spec: InputSpec, block_size: int, first_sample: int,
                 limit: int | None = None) -> Iterator[RecordBlock]:
    common = {"path": spec.path, "format": spec.format, "source": spec.source, "image_root": spec.image_root,
              "rule_overrides": spec.rule_overrides, "split": spec.split, "builder": spec.builder}
    if spec.format == "webdataset":
        for first_line, samples in _tar_ranges(spec, block_size, limit):
            yield RecordBlock(first_sample=first_sample, num_records=len(samples), start=samples[0].start,
                              stop=samples[-1].stop, first_line=first_line, samples=samples, **common)
            first_sample += len(samples)
        return
    for start, stop, first_line, text, lines, count in _RANGES[spec.format](spec, block_size, limit):
        yield RecordBlock(first_sample=first_sample, num_records=count, start=start, stop=stop,
                          first_line=first_line, text=text, lines=lines, **common)
        first_sample += count


def _count_records(spec: InputSpec) -> int:
    """Records of one input, in constant memory (a pass over the file for JSON formats)."""
    if spec.format == "json":  # counting elements, not joining them into blocks
        return sum(1 for _ in iter_json_list(spec.path))
    return sum(count for *_, count in _RANGES[spec.format](spec, 1 << 16, None))


def _jsonl_ranges(spec: InputSpec, block_size: int, limit: int | None) -> Iterator[_Range]:
    with open_input(spec.path) as handle:
        offset, line_no, count, start, first_line, total = 0, 0, 0, 0, 1, 0
        for raw in handle:
            line_no += 1
            if raw.strip() and not (line_no == 1 and raw.startswith(b"\xef\xbb\xbf") and not raw[3:].strip()):
                # (a first line holding only a UTF-8 byte order mark is blank, as the reader sees it)
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


def _json_list_ranges(spec: InputSpec, block_size: int, limit: int | None) -> Iterator[_Range]:
    elements: list[str] = []
    lines: list[int] = []
    total = 0
    for line, element in iter_json_list(spec.path):
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


def _parquet_rows(spec: InputSpec) -> int:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(spec.path).metadata.num_rows
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise InputError(f"{spec.path}: unreadable Parquet ({str(exc)[:120]})", fix="check the file") from None


def _dataset_rows(spec: InputSpec) -> int:
    return len(open_dataset(spec.path, spec.split, spec.builder))


def _row_ranges(rows: Callable[[InputSpec], int]) -> Callable[[InputSpec, int, int | None], Iterator[_Range]]:
    """The block ranges of a table format whose row count ``rows`` gives."""

    def ranges(spec: InputSpec, block_size: int, limit: int | None) -> Iterator[_Range]:
        total = rows(spec)
        total = total if limit is None else min(total, limit)
        for start in range(0, total, block_size):
            yield start, min(start + block_size, total), start + 1, None, (), min(block_size, total - start)

    return ranges


def _tar_ranges(spec: InputSpec, block_size: int, limit: int | None) -> Iterator[tuple[int, tuple[TarSample, ...]]]:
    """``(first sample number in the shard, samples)`` of each block: whole samples, in order."""
    chunk: list[TarSample] = []
    first, total = 1, 0
    for sample in iter_tar_samples(spec.path):
        if limit is not None and total == limit:
            break
        chunk.append(sample)
        total += 1
        if len(chunk) == block_size:
            yield first, tuple(chunk)
            first, chunk = first + len(chunk), []
    if chunk:
        yield first, tuple(chunk)


#: format -> the ranges of its blocks, ``(spec, block_size, limit) -> ranges`` (the first ``limit`` records).
_RANGES: dict[str, Callable[[InputSpec, int, int | None], Iterator[_Range]]] = {
    "jsonl": _jsonl_ranges,
    "json": _json_list_ranges,
    "parquet": _row_ranges(_parquet_rows),
    "hf": _row_ranges(_dataset_rows),
    "webdataset": lambda spec, block_size, limit: (  # (blocks are built from samples: see _blocks_once)
        (s[0].start, s[-1].stop, first, None, (), len(s)) for first, s in _tar_ranges(spec, block_size, limit)),
}
