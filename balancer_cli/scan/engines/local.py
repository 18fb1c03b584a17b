"""The scan engine: blocks over a process pool, concatenated in order into a lengths table.

:func:`scan` walks the inputs once in the main process (:func:`~balancer_cli.scan.readers.iter_blocks`,
constant memory), measures blocks in ``jobs`` worker processes (at most ``2 * jobs`` blocks in
flight, so memory does not grow with the dataset), and assembles the results in block order with
:func:`assemble`.

Engines are pluggable: ``engine="NAME"`` other than ``local`` imports
``balancer_cli.scan.engine_NAME`` and calls its ``run_blocks(blocks, config, jobs)`` (plus
``options=`` when ``scan`` gets ``engine_options``), which must yield ``(block, table)`` in the
order of ``blocks``, each table from :func:`measure_job` (a block's
``measure_block`` result, or a bad sample's parts under ``--strict``) passed through
:func:`unwrap_job`. Everything else (block splitting, ordering checks, metadata, assembly) is
shared, so every engine writes a byte-identical table.

Example:
    >>> import json, pathlib, tempfile
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "d.jsonl"
    >>> _ = p.write_text(json.dumps({"text": "hello"}) + "\\n")
    >>> result = scan([str(p)], ScanConfig(), jobs=1)
    >>> result.lengths.num_samples, result.summary["errors"]
    (1, {})
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import itertools
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from balancer_cli import __version__
from balancer_cli.errors import InputError, SampleError, UsageError
from balancer_cli._fsutil import bytes_fingerprint, file_fingerprint
from balancer_cli.lengths import SCHEMA_VERSION, LengthsTable, lengths_fingerprint
from balancer_cli.scan.measure import (
    AUDIO_FRAMES_PER_S,
    AUDIO_LLM_POOL,
    MODULES,
    ScanConfig,
    error_kind,
    measure_block,
)
from balancer_cli.scan.readers import (
    InputSpec,
    RecordBlock,
    builder_files,
    expand_inputs,
    iter_blocks,
)
from balancer_cli.scan.text import load_tokenizer

__all__ = ["ScanResult", "assemble", "default_jobs", "measure_job", "scan", "scan_metadata", "unwrap_job"]
DEFAULT_BLOCK_SIZE = 2048
# Below this many records in total, measuring in this process beats starting worker processes.
_MIN_POOL_RECORDS = 4096


@dataclass(frozen=True)
class ScanResult:
    """A scan's lengths table (with metadata) and its summary (counts, errors by kind)."""

    lengths: LengthsTable
    summary: dict[str, Any]


def default_jobs() -> int:
    """All cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def measure_job(block: RecordBlock, config: ScanConfig) -> pa.Table | tuple:
    """:func:`~balancer_cli.scan.measure.measure_block` for any worker: a table, or under ``--strict``
    the first bad sample as a plain tuple, which :func:`unwrap_job` raises again in the driver.

    SampleError itself pickles whole (``BalancerError.__reduce__``); the tuple is kept because it is
    plain JSON-able data: the Ray engine stores it next to the block's shard, so a resumed run
    re-raises the same error without measuring again, and every engine handles results one way."""
    try:
        return measure_block(block, config)
    except SampleError as exc:
        return ("sample_error", exc.message, exc.kind, exc.file, exc.line, exc.fix)


def unwrap_job(result: pa.Table | tuple) -> pa.Table:
    """The table of a :func:`measure_job` result; raises its SampleError if it carries one."""
    if isinstance(result, tuple):
        _, message, kind, file, line, fix = result
        raise SampleError(message, kind=kind, file=file, line=line, fix=fix)
    return result


def _start_method() -> str:
    """``fork`` where available: workers start in milliseconds, and scans from notebooks or
    ``python -`` work (``spawn`` re-imports ``__main__``). All workers fork when the pool starts,
    before this process has measured or decoded anything; only ``spawn`` exists elsewhere."""
    return "fork" if "fork" in multiprocessing.get_all_start_methods() and sys.platform == "linux" else "spawn"


def _run_local(blocks: Iterator[RecordBlock], config: ScanConfig, jobs: int) -> Iterator[tuple[RecordBlock, pa.Table]]:
    head = list(itertools.islice(blocks, jobs + 2))
    blocks = itertools.chain(head, blocks)
    small = len(head) <= jobs + 1 and sum(b.num_records for b in head) < _MIN_POOL_RECORDS
    if jobs <= 1 or len(head) < 2 or small:  # starting workers would cost more than it saves
        for block in blocks:
            yield block, unwrap_job(measure_job(block, config))
        return
    context = multiprocessing.get_context(_start_method())
    pending: collections.deque[tuple[RecordBlock, Future]] = collections.deque()
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        try:
            for block in blocks:
                pending.append((block, pool.submit(measure_job, block, config)))
                while len(pending) >= 2 * jobs:
                    done_block, future = pending.popleft()
                    yield done_block, unwrap_job(future.result())
            while pending:
                done_block, future = pending.popleft()
                yield done_block, unwrap_job(future.result())
        except BaseException:
            for _, future in pending:
                future.cancel()
            raise


def _engine(name: str) -> Callable[[Iterator[RecordBlock], ScanConfig, int], Iterator[tuple[RecordBlock, pa.Table]]]:
    if name == "local":
        return _run_local
    if not name.isidentifier():
        raise UsageError(f"unknown --engine {name!r}", fix="use --engine local")
    try:
        module = importlib.import_module(f"balancer_cli.scan.engines.{name}")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("balancer_cli"):
            raise UsageError(f"unknown --engine {name!r}", fix="use --engine local") from None
        raise UsageError(f"--engine {name} needs {exc.name!r}, which is not installed",
                         fix=f"pip install 'balancer_cli[{name}]'") from None
    return module.run_blocks


def assemble(tables: Sequence[pa.Table], metadata: dict[str, Any]) -> LengthsTable:
    """Concatenate measured blocks (in sample order) into the lengths table.

    ``vision`` columns are always kept; ``video_*``/``audio_*`` only when some sample has such
    media. ``source`` is dictionary-encoded in order of first appearance.
    """
    if not tables or sum(t.num_rows for t in tables) == 0:
        raise InputError("the inputs hold no samples", fix="pass files with at least one record")
    table = pa.concat_tables(tables).combine_chunks()
    n = table.num_rows
    columns: dict[str, Any] = {
        "sample": pa.array(np.arange(n, dtype=np.int64)),
        "source": table.column("source").dictionary_encode(),
        "llm_tokens": table.column("llm_tokens"),
    }
    for module in MODULES:
        items = table.column(f"{module}_items")
        if module == "vision" or pc.sum(items).as_py():
            for suffix in ("tokens", "items", "seqlens"):
                columns[f"{module}_{suffix}"] = table.column(f"{module}_{suffix}")
    columns["error"] = table.column("error")
    out = pa.table(columns).combine_chunks()
    return LengthsTable(out, metadata, lengths_fingerprint(out))


def _input_record(spec: InputSpec, num_samples: int) -> dict[str, Any]:
    path = Path(spec.path)
    if path.is_dir() or (spec.builder is not None and not path.is_file()):
        files = builder_files(spec.path)  # a folder's files, or those a --hf-builder glob matches
        base = path if path.is_dir() else None
        size = sum(p.stat().st_size for p in files)
        fingerprint = bytes_fingerprint(*(f"{p.relative_to(base) if base else p}={file_fingerprint(p)}".encode()
                                          for p in files))
    else:
        size, fingerprint = path.stat().st_size, file_fingerprint(path)
    record = {"path": spec.path, "format": spec.format, "source": spec.source, "size_bytes": size,
              "file_fingerprint": fingerprint, "num_samples": num_samples}
    if spec.builder is not None:
        record["builder"] = spec.builder
    if spec.repeat != 1.0:
        record["repeat_time"] = spec.repeat
    if spec.rule_overrides:
        record["rule_overrides"] = dict(spec.rule_overrides)
    return record


def scan_metadata(config: ScanConfig, specs: Sequence[InputSpec], samples_per_input: Sequence[int]) -> dict[str, Any]:
    """The ``balancer`` metadata of a scan: model preset and parameters, tokenizer, template, inputs."""
    rule = config.rule()
    params = asdict(rule) if is_dataclass(rule) else {}
    return {
        "schema_version": SCHEMA_VERSION,
        "tool_version": __version__,
        "command": "scan",
        "model": {"preset": config.model, "overrides": dict(config.model_params),
                  "processor_config": config.processor_config, "params": params},
        "tokenizer": load_tokenizer(config.tokenizer).description,
        "template": config.template_name,
        "video_default_size": list(config.video_size),
        "audio_rule": {"encoder_frames_per_s": AUDIO_FRAMES_PER_S, "llm_pool": AUDIO_LLM_POOL},
        "fields": dict(config.fields),
        "inputs": [_input_record(s, n) for s, n in zip(specs, samples_per_input)],
    }


def scan(inputs: Sequence[str], config: ScanConfig, jobs: int | None = None, engine: str = "local", *,
         block_size: int = DEFAULT_BLOCK_SIZE, image_root: str | None = None, format: str | None = None,
         split: str | None = None, hf_builder: str | None = None, progress: Callable[[int], None] | None = None,
         engine_options: Any = None) -> ScanResult:
    """Scan ``inputs`` into a lengths table (``sample`` indexes their concatenation, in order).

    Args:
        inputs: dataset files / folders (formats detected, see :mod:`balancer_cli.scan.readers`).
        config: what to measure and how.
        jobs: worker processes (default: all cores); 1 measures in this process.
        engine: ``local`` (a process pool) or ``ray`` (Ray Data, :mod:`~balancer_cli.scan.engines.ray`).
        block_size: records per block (the unit of work and of in-flight memory).
        image_root, format, split: see :func:`~balancer_cli.scan.readers.expand_inputs`.
        hf_builder: read every input with ``datasets.load_dataset(hf_builder, ...)`` over local files
            (``builder`` of :func:`~balancer_cli.scan.readers.expand_inputs`).
        progress: called with the number of samples of each finished block (e.g. a tqdm update).
        engine_options: passed to the engine's ``run_blocks`` as ``options`` (e.g. ``RayOptions``).

    Raises:
        UsageError: bad options (unknown model, tokenizer, template, engine).
        InputError: unreadable, undetectable or empty inputs.
        SampleError: the first bad sample, with ``config.strict``.
    """
    run_blocks = _engine(engine)
    jobs = default_jobs() if jobs is None or jobs <= 0 else jobs
    config.rule()  # fail fast on a bad preset/tokenizer/template, before any worker starts
    load_tokenizer(config.tokenizer)
    _ = config.template_name
    specs = expand_inputs(inputs, image_root=image_root, format=format, split=split, builder=hf_builder)
    per_spec = [0] * len(specs)
    owners: collections.deque[int] = collections.deque()  # spec of each block, in submission order
    tables: list[pa.Table] = []

    def blocks() -> Iterator[RecordBlock]:
        offset = 0
        for index, spec in enumerate(specs):
            for block in iter_blocks([spec], block_size):
                owners.append(index)
                # iter_blocks numbers each input from 0: make first_sample global.
                yield dataclasses.replace(block, first_sample=offset)
                offset += block.num_records

    first_sample = 0
    extra = {} if engine_options is None else {"options": engine_options}
    for block, table in run_blocks(blocks(), config, jobs, **extra):
        if block.first_sample != first_sample or table.num_rows != block.num_records:
            raise RuntimeError(f"block {block.path}@{block.first_sample} out of order or short")  # engine bug
        first_sample += block.num_records
        per_spec[owners.popleft()] += block.num_records
        tables.append(table)
        if progress is not None:
            progress(block.num_records)
    metadata = scan_metadata(config, specs, per_spec)
    lengths = assemble(tables, metadata)
    return ScanResult(lengths, _summary(lengths, metadata))


def _summary(lengths: LengthsTable, metadata: dict[str, Any]) -> dict[str, Any]:
    errors = [e for e in lengths.errors() if e is not None]
    by_kind = collections.Counter(error_kind(e) for e in errors)
    first = {}
    for e in errors:
        first.setdefault(error_kind(e), e)
    ok = lengths.ok_mask()
    summary: dict[str, Any] = {
        "samples": lengths.num_samples,
        "measured": int(ok.sum()),
        "errors": dict(sorted(by_kind.items())),
        "first_error_by_kind": dict(sorted(first.items())),
        "llm_tokens": int(lengths.llm_tokens()[ok].sum()),
        "modules": {},
        "sources": [i["source"] for i in metadata["inputs"]],
        "model": metadata["model"]["preset"],
        "tokenizer": metadata["tokenizer"]["spec"],
        "template": metadata["template"],
        "fingerprint": lengths.fingerprint,
    }
    for module in lengths.modules:
        summary["modules"][module] = {"tokens": int(lengths.tokens(module)[ok].sum()),
                                      "items": int(lengths.items(module)[ok].sum())}
    return summary
