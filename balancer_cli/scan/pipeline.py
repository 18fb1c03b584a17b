"""The scan pipeline: dataset inputs + a :class:`~balancer_cli.scan.measure.ScanConfig` -> lengths table.

:func:`scan` expands the inputs (:func:`~balancer_cli.scan.inputs.expand_inputs`), walks them once
in this process (:func:`~balancer_cli.scan.blocks.iter_blocks`, constant memory), hands the blocks
to an engine (:mod:`balancer_cli.scan.engines`: ``local`` processes or ``ray``), checks that they
come back in order, and assembles them with :func:`assemble` into the lengths table, with the
metadata of :func:`scan_metadata` and a summary (counts, errors by kind).

Example:
    >>> import json, pathlib, tempfile
    >>> from balancer_cli.scan.measure import ScanConfig
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "d.jsonl"
    >>> _ = p.write_text(json.dumps({"text": "hello"}) + "\\n")
    >>> result = scan([str(p)], ScanConfig(), jobs=1)
    >>> result.lengths.num_samples, result.summary["errors"]
    (1, {})
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from balancer_cli import __version__
from balancer_cli._fsutil import bytes_fingerprint, file_fingerprint
from balancer_cli._procs import usable_cores
from balancer_cli.errors import InputError
from balancer_cli.lengths import MEMBER_COLUMNS, SCHEMA_VERSION, LengthsTable, lengths_fingerprint
from balancer_cli.scan.blocks import RecordBlock, iter_blocks
from balancer_cli.scan.engines import get_engine
from balancer_cli.scan.hf_datasets import builder_files
from balancer_cli.scan.inputs import InputSpec, expand_inputs
from balancer_cli.scan.measure import (
    AUDIO_FRAMES_PER_S,
    AUDIO_LLM_POOL,
    MODULES,
    ScanConfig,
    error_kind,
)
from balancer_cli.scan.text import load_tokenizer

__all__ = ["DEFAULT_BLOCK_SIZE", "ScanResult", "assemble", "member_columns",
           "rule_summary", "scan", "scan_metadata"]

#: Records per block: the unit of work and of in-flight memory.
DEFAULT_BLOCK_SIZE = 2048


@dataclass(frozen=True, kw_only=True)
class ScanResult:
    """A scan's lengths table (with metadata) and its summary (counts, errors by kind)."""

    lengths: LengthsTable
    summary: dict[str, Any]


#: The optional columns of samples from tar shards (null for other samples), in column order.
_MEMBER_SCHEMA = pa.schema(list(MEMBER_COLUMNS.items()))


def member_columns(block: RecordBlock, table: pa.Table) -> pa.Table:
    """``table`` (one measured block) with the :data:`~balancer_cli.lengths.MEMBER_COLUMNS` of its samples: the shard
    and key of each, and its members' extensions, data offsets and sizes (tar blocks only).

    Example:
        >>> from balancer_cli.scan.webdataset import TarSample
        >>> block = RecordBlock(path="s.tar", format="webdataset", source="s", first_sample=0, num_records=1,
        ...                     samples=(TarSample("a", ("json", "jpg"), (512, 1536), (20, 900)),))
        >>> member_columns(block, pa.table({"llm_tokens": [5]})).to_pylist()[0]["member_offsets"]
        [512, 1536]
    """
    samples = block.samples
    values = [[block.path] * len(samples), [s.key for s in samples], [list(s.names) for s in samples],
              [list(s.offsets) for s in samples], [list(s.sizes) for s in samples]]
    for field, column in zip(_MEMBER_SCHEMA, values):
        table = table.append_column(field, pa.array(column, field.type))
    return table


def _with_member_columns(tables: Sequence[pa.Table]) -> list[pa.Table]:
    """Every table with the member columns when some has them (nulls for other formats)."""
    if not any("shard" in t.column_names for t in tables):
        return list(tables)
    out = []
    for table in tables:
        if "shard" not in table.column_names:
            for field in _MEMBER_SCHEMA:
                table = table.append_column(field, pa.nulls(table.num_rows, field.type))
        out.append(table)
    return out


def assemble(tables: Sequence[pa.Table], metadata: dict[str, Any]) -> LengthsTable:
    """Concatenate measured blocks (in sample order) into the lengths table.

    ``vision`` columns are always kept; ``video_*``/``audio_*`` only when some sample has such
    media. ``source`` is dictionary-encoded in order of first appearance. Samples of tar shards
    add the :data:`~balancer_cli.lengths.MEMBER_COLUMNS` (``shard`` dictionary-encoded; null for other samples).

    Example:
        >>> from balancer_cli.scan.measure import block_schema
        >>> row = {"source": "a", "llm_tokens": 7, "error": None, **{f"{m}_{s}": [] if s == "seqlens" else 0
        ...        for m in MODULES for s in ("tokens", "items", "seqlens")}}
        >>> assemble([pa.Table.from_pylist([row], schema=block_schema())], {}).table.column_names
        ['sample', 'source', 'llm_tokens', 'vision_tokens', 'vision_items', 'vision_seqlens', 'error']
    """
    if not tables or sum(t.num_rows for t in tables) == 0:
        raise InputError("the inputs hold no samples", fix="pass files with at least one record")
    table = pa.concat_tables(_with_member_columns(tables)).combine_chunks()
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
    if "shard" in table.column_names:
        columns["shard"] = table.column("shard").dictionary_encode()
        for field in _MEMBER_SCHEMA.names[1:]:
            columns[field] = table.column(field)
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


def scan_metadata(config: ScanConfig, specs: Sequence[InputSpec], samples_O: Sequence[int]) -> dict[str, Any]:
    """The ``balancer`` metadata of a scan: model preset and parameters, tokenizer, template, inputs.

    ``samples_O`` holds the samples each input (``specs``) contributed.

    Example:
        >>> meta = scan_metadata(ScanConfig(), [], [])
        >>> meta["command"], meta["model"]["preset"], meta["template"]
        ('scan', 'qwen2-vl', 'qwen2-vl')
    """
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
        "inputs": [_input_record(s, n) for s, n in zip(specs, samples_O)],
    }


def scan(inputs: Sequence[str], config: ScanConfig, jobs: int | None = None, engine: str = "local", *,
         block_size: int = DEFAULT_BLOCK_SIZE, image_root: str | None = None, format: str | None = None,
         split: str | None = None, hf_builder: str | None = None, progress: Callable[[int], None] | None = None,
         engine_options: Any = None, verify: int = 0, verify_seed: int = 0) -> ScanResult:
    """Scan ``inputs`` into a lengths table (``sample`` indexes their concatenation, in order).

    Args:
        inputs: dataset files / folders (formats detected, see :mod:`balancer_cli.scan.inputs`).
        config: what to measure and how.
        jobs: worker processes (default: all cores); 1 measures in this process.
        engine: a name of :data:`~balancer_cli.scan.engines.ENGINES`: ``local`` (a process pool) or
            ``ray`` (Ray Data, :mod:`~balancer_cli.scan.engines.ray`).
        block_size: records per block (the unit of work and of in-flight memory).
        image_root, format, split: see :func:`~balancer_cli.scan.inputs.expand_inputs`.
        hf_builder: read every input with ``datasets.load_dataset(hf_builder, ...)`` over local files
            (``builder`` of :func:`~balancer_cli.scan.inputs.expand_inputs`).
        progress: called with the number of samples of each finished block (e.g. a tqdm update).
        engine_options: passed to the engine's ``run_blocks`` as ``options`` (e.g. ``RayOptions``).
        verify: cross-check this many random measured samples against transformers
            (:func:`~balancer_cli.scan.verify.verify_scan`; one more read pass over the inputs);
            the result is the summary's ``verify`` entry. The table does not change.
        verify_seed: seed of the samples drawn for ``verify``.

    Raises:
        UsageError: bad options (unknown model, tokenizer, template, engine).
        InputError: unreadable, undetectable or empty inputs.
        SampleError: the first bad sample, with ``config.strict``.

    Example:
        >>> scan(["x.jsonl"], ScanConfig(), engine="warp")
        Traceback (most recent call last):
        ...
        balancer_cli.errors.UsageError: unknown --engine 'warp'; fix: use --engine local
    """
    run_blocks = get_engine(engine)
    jobs = usable_cores() if jobs is None or jobs <= 0 else jobs
    config.rule()  # fail fast on a bad preset/tokenizer/template, before any worker starts
    load_tokenizer(config.tokenizer)
    _ = config.template_name
    specs = expand_inputs(inputs, image_root=image_root, format=format, split=split, builder=hf_builder)
    samples_O = [0] * len(specs)
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
        samples_O[owners.popleft()] += block.num_records
        tables.append(member_columns(block, table) if block.samples else table)
        if progress is not None:
            progress(block.num_records)
    metadata = scan_metadata(config, specs, samples_O)
    lengths = assemble(tables, metadata)
    summary = _summary(lengths, metadata)
    summary["rule"] = rule_summary(config.rule())
    if verify > 0:
        from balancer_cli.scan.verify import draw_samples, verify_scan

        chosen = draw_samples(lengths.ok_mask(), verify, verify_seed)
        offsets = np.cumsum([0] + samples_O[:-1])
        walk = (dataclasses.replace(b, first_sample=int(offsets[i]) + b.first_sample)
                for i, spec in enumerate(specs) for b in iter_blocks([spec], block_size))
        summary["verify"] = verify_scan(walk, chosen, config.rule(), config)
    return ScanResult(lengths=lengths, summary=summary)


#: Rule fields that are names, not knobs.
_NOT_KNOBS = {"name", "image_token", "video_token", "audio_token", "fast", "path", "notes", "specials"}


def rule_summary(rule: Any) -> dict[str, Any]:
    """What counted the media: the rule's class, who counts (preset or transformers) and its knobs.

    Example:
        >>> from balancer_cli.scan.rules.registry import get_rule
        >>> s = rule_summary(get_rule("qwen2-vl"))
        >>> s["rule"], s["counted_by"], s["knobs"]["fps"], s["knobs"]["cap_pixels_per_frame"]
        ('QwenVLRule', 'preset', 2.0, False)
    """
    knobs = {k: v for k, v in (asdict(rule) if is_dataclass(rule) else {}).items() if k not in _NOT_KNOBS}
    out = {"name": rule.name, "rule": type(rule).__name__, "counted_by": "preset", "knobs": knobs}
    if getattr(rule, "counted_by", None) == "transformers":
        out["counted_by"] = f"transformers ({rule.processor_class})"
    elif getattr(rule, "fast", None) is not None:
        out["counted_by"] = f"preset {rule.fast_preset} with the folder's values"
        out["knobs"] = {k: v for k, v in asdict(rule.fast).items() if k not in _NOT_KNOBS}
    if getattr(rule, "notes", ()):
        out["notes"] = list(rule.notes)
    return out


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
