"""Measure one block of records: encoder and LLM token counts per sample, errors as text.

:func:`measure_block` is deterministic and keeps no state besides per-process caches of the
tokenizer and the vision rule, so any engine (the local process pool, Ray Data) can call it in any
worker and concatenate the results in block order.

Per sample:

- images: size from the record (``width``/``height``, ``image_sizes``, Hugging Face ``Image``
  bytes) or else from the image file's header (never decoded); the model's vision rule gives the
  encoder tokens, items (images or tiles), per-item sequence lengths and LLM placeholder tokens.
- videos: size, ``duration``/``num_frames``/``fps`` from the record; a video without
  ``duration`` and ``num_frames`` gets them, its frame rate and its size from its file's container
  header (:mod:`~balancer_cli.scan.media_header`, never decoded; fields the record has win).
  A video with a duration but no size is assumed to be ``ScanConfig.video_size`` (default
  640x360, ``--video-size``) and its file is not opened.
- audio clips (``duration`` in seconds, else from the file's header), a Whisper-style rule: 16 kHz
  log-mel at 100 frames/s, halved by the encoder's stride-2 convolution: ``audio_tokens =
  ceil(50 * duration)`` encoder frames per clip (``audio_items`` = clips); the LLM receives
  ``ceil(audio_tokens / 2)`` placeholder tokens per clip (Qwen2-Audio's stride-2 pooling).
- ``llm_tokens``: the sample rendered with the chat template (role and turn tokens, default system
  prompt), text counted with the real tokenizer in one batch per block, each media placeholder
  replaced by the rule's ``llm_tokens``.

Errors (missing/corrupt/unsupported image, path escaping the image root, malformed record, model
rejection) become the sample's ``error`` text ``"<kind>: <file>:<line>: <what>"``; with
``ScanConfig.strict`` the first one is raised as :class:`~balancer_cli.errors.SampleError`.

Example:
    >>> from balancer_cli.scan.blocks import RecordBlock
    >>> import json, pathlib, tempfile
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "d.jsonl"
    >>> _ = p.write_text(json.dumps({"image": "a.png", "width": 448, "height": 448,
    ...     "conversations": [{"from": "human", "value": "<image>\\nHi"}, {"from": "gpt", "value": "Hello"}]}))
    >>> block = RecordBlock(path=str(p), format="jsonl", source="d", first_sample=0, num_records=1,
    ...                     stop=p.stat().st_size, image_root=str(p.parent))
    >>> measure_block(block, ScanConfig()).select(["llm_tokens", "vision_tokens", "vision_items"]).to_pylist()
    [{'llm_tokens': 282, 'vision_tokens': 1024, 'vision_items': 1}]
"""

from __future__ import annotations

import base64
import functools
import math
import os
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from balancer_cli.errors import SampleError
from balancer_cli.scan.blocks import MalformedLine, RecordBlock
from balancer_cli.scan.readers import read_block
from balancer_cli.scan.records import Media, RecordError, parse_record
from balancer_cli.scan.templates import DEFAULT_TEMPLATE, check_template, render
from balancer_cli.scan.text import load_tokenizer

__all__ = [
    "AUDIO_FRAMES_PER_S",
    "AUDIO_LLM_POOL",
    "MODULES",
    "ScanConfig",
    "block_schema",
    "error_kind",
    "measure_block",
    "measure_job",
    "unwrap_job",
]

#: Encoder modules a scan measures, in column order.
MODULES = ("vision", "video", "audio")
_MODULE_INDEX = {module: index for index, module in enumerate(MODULES)}
#: Whisper encoder frames per second of audio (100 mel frames/s after the stride-2 conv).
AUDIO_FRAMES_PER_S = 50
#: Encoder frames per LLM placeholder token (Qwen2-Audio pools by 2).
AUDIO_LLM_POOL = 2


@dataclass(frozen=True, kw_only=True)
class ScanConfig:
    """Everything a worker needs to measure a block; small, frozen and cheap to pickle.

    Attributes:
        model: vision-rule preset (``qwen2-vl``, ``internvl``, ...).
        model_params: rule parameter overrides as sorted ``(name, value)`` pairs.
        processor_config: a local ``preprocessor_config.json`` (or model folder) for the rule.
        tokenizer: tokenizer spec (see :func:`~balancer_cli.scan.text.load_tokenizer`).
        template: chat template name; None uses the model's released template.
        strict: raise on the first bad sample instead of recording its error.
        video_size: ``(width, height)`` assumed for videos whose records carry no size.
        fields: field mapping ``(canonical, record_key)`` pairs (see ``records.FIELD_NAMES``).
    """

    model: str = "qwen2-vl"
    model_params: tuple[tuple[str, Any], ...] = ()
    processor_config: str | None = None
    tokenizer: str = "qwen2"
    template: str | None = None
    strict: bool = False
    video_size: tuple[int, int] = (640, 360)
    fields: tuple[tuple[str, str], ...] = ()

    @property
    def template_name(self) -> str:
        """The template used: ``template``, else the model's default."""
        return check_template(self.template or DEFAULT_TEMPLATE.get(self.model.lower(), "plain"))

    def rule(self, extra: tuple[tuple[str, Any], ...] = ()) -> Any:
        """The vision rule with ``model_params`` and ``extra`` (per-input) overrides applied."""
        params = {**dict(self.model_params), **dict(extra)}
        return _load_rule(self.model, self.processor_config,
                          tuple(sorted((name, _hashable(value)) for name, value in params.items())))


def _hashable(value: Any) -> Any:
    """A parameter value as a key of the rule cache: JSON lists (``image_grid_pinpoints``) become tuples."""
    return tuple(_hashable(item) for item in value) if isinstance(value, (list, tuple)) else value


@functools.lru_cache(maxsize=32)
def _load_rule(model: str, processor_config: str | None, params: tuple[tuple[str, Any], ...]) -> Any:
    import dataclasses

    from balancer_cli.scan.rules.registry import get_rule, rule_from_processor_config

    if processor_config:
        # The config's parameters first, then explicit overrides (validated by get_rule).
        base = rule_from_processor_config(model, processor_config)
        from_config = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.name != "name"}
        return get_rule(model, **{**from_config, **dict(params)})
    return get_rule(model, **dict(params))


def block_schema() -> pa.Schema:
    """Columns of :func:`measure_block`'s table (every module, even if absent from the data).

    Example:
        >>> block_schema().names[:5]
        ['source', 'llm_tokens', 'vision_tokens', 'vision_items', 'vision_seqlens']
    """
    fields = [pa.field("source", pa.string()), pa.field("llm_tokens", pa.int32())]
    for module in MODULES:
        fields += [pa.field(f"{module}_tokens", pa.int32()), pa.field(f"{module}_items", pa.int32()),
                   pa.field(f"{module}_seqlens", pa.list_(pa.int32()))]
    return pa.schema(fields + [pa.field("error", pa.string())])


def error_kind(error_text: str) -> str:
    """The kind prefix of an ``error`` cell.

    Example:
        >>> error_kind("missing_file: data.jsonl:3: image not found: a.png")
        'missing_file'
    """
    return error_text.split(":", 1)[0]


def _resolve(ref: str, root: str, kind: str = "image") -> str:
    """Absolute path of ``ref`` under ``root``; raises path_escape when it leaves the root.

    The check is lexical (``..`` and absolute paths), so symlinked data folders stay allowed.
    """
    ref = ref.removeprefix("file://")
    base = os.path.normpath(os.path.abspath(root))
    full = os.path.normpath(os.path.join(base, ref))
    if full != base and not full.startswith(base.rstrip(os.sep) + os.sep):
        raise SampleError(f"{kind} path {ref!r} escapes the image root {root!r}", kind="path_escape",
                          fix=f"keep {kind} paths inside --image-root (or pass a wider --image-root)")
    return full


#: The record fields that spare opening each kind of media file (named when a remote file lacks them).
_SIZE_FIELDS = {"image": "width/height", "video": "duration (and width/height)", "audio": "duration"}


def _media_source(media: Media, root: str) -> str | bytes:
    """The path (resolved under ``root``) or the bytes of a media item (``data:`` URLs decoded)."""
    kind, ref = media.kind, media.ref
    if isinstance(ref, str) and ref.startswith("data:") and ";base64," in ref:
        try:
            return base64.b64decode(ref.split(";base64,", 1)[1], validate=True)
        except ValueError:
            raise SampleError(f"{kind} data URL is not valid base64", kind=f"corrupt_{kind}") from None
    if isinstance(ref, str):
        if ref.startswith(("http://", "https://")):
            raise SampleError(f"remote {kind} {ref[:80]!r} has no {_SIZE_FIELDS[kind]} fields",
                              kind=f"unsupported_{kind}",
                              fix=f"add {_SIZE_FIELDS[kind]} to the record (the scan never downloads)")
        return _resolve(ref, root, kind)
    return ref


def _read_header(media: Media, source: str | bytes, reader: Any) -> Any:
    """``reader(source)``, its errors naming the file as the record does (the table must not
    depend on where it was scanned)."""
    try:
        return reader(source)
    except SampleError as exc:
        if not isinstance(source, str):
            raise
        ref = media.ref
        if exc.kind == "missing_file" and "not found" in exc.message:
            raise SampleError(f"{media.kind} not found: {ref}", kind="missing_file",
                              fix="check --image-root or the record's path") from None
        message = exc.message.replace(source, ref) if source in exc.message else f"{ref}: {exc.message}"
        raise SampleError(message, kind=exc.kind, fix=exc.fix) from None
    except OSError as exc:  # a read failing after the open (the readers report failed opens)
        raise SampleError(f"{media.kind} unreadable: {media.ref} ({exc.strerror or exc})",
                          kind="unreadable_file") from None


def _image_size(media: Media, root: str) -> tuple[int, int]:
    from balancer_cli.scan.image_header import read_image_size

    if media.width is not None and media.height is not None:
        return media.width, media.height
    if media.ref is None:
        raise RecordError("image without a path, bytes or width/height")
    return _read_header(media, _media_source(media, root), read_image_size)


def _fill_from_header(media: Media, root: str) -> None:
    """Give a video without ``duration``/``num_frames`` (an audio clip without ``duration``) the
    values of its file's header; fields the record has win."""
    from balancer_cli.scan.media_header import read_audio_info, read_video_info

    if media.duration is not None or (media.kind == "video" and media.num_frames):
        return
    if media.ref is None:
        return  # _measure_media reports the missing metadata
    source = _media_source(media, root)
    if media.kind == "video":
        info = _read_header(media, source, read_video_info)
        media.num_frames = media.num_frames or info.num_frames
        media.fps = media.fps or info.fps
        media.width = media.width or info.width
        media.height = media.height or info.height
    else:
        info = _read_header(media, source, read_audio_info)
        media.sample_rate = media.sample_rate or info.sample_rate
    media.duration = info.duration


def _measure_media(media: Media, rule: Any, config: ScanConfig, image_count: Any) -> tuple[str, int, int, tuple, int]:
    """``(module, encoder_tokens, items, seqlens, llm_tokens)`` of one media item.

    Images were counted per sample beforehand (``image_count``): some models process a sample
    with several images differently.
    """
    if media.kind == "image":
        return "vision", image_count.encoder_tokens, image_count.items, image_count.seqlens, image_count.llm_tokens
    if media.kind == "video":
        if media.duration is None and not media.num_frames:
            raise RecordError("video without a file and without 'duration' or 'num_frames'",
                              kind="missing_video_metadata")
        width = media.width or config.video_size[0]
        height = media.height or config.video_size[1]
        count = rule.count_video(media.num_frames or 0, width, height, fps=media.fps, duration_s=media.duration)
        return "video", count.encoder_tokens, count.items, count.seqlens, count.llm_tokens
    if media.duration is None or media.duration < 0:
        raise RecordError("audio clip without a file and without a non-negative 'duration' (seconds)",
                          kind="missing_audio_duration")
    frames = math.ceil(media.duration * AUDIO_FRAMES_PER_S)
    return "audio", frames, 1, (frames,), math.ceil(frames / AUDIO_LLM_POOL)


def _sample_error(exc: Exception, block: RecordBlock, line: int) -> SampleError:
    if isinstance(exc, SampleError):
        return SampleError(exc.message, kind=exc.kind, file=block.path, line=line, fix=exc.fix)
    kind = getattr(exc, "kind", "malformed_record")
    return SampleError(str(exc), kind=kind, file=block.path, line=line)


def measure_block(block: RecordBlock, config: ScanConfig) -> pa.Table:
    """Measure every record of ``block``; one row per record, in order (schema :func:`block_schema`).

    Raises:
        SampleError: the first bad sample, only with ``config.strict``.
        UsageError: unknown model preset, tokenizer or template (before any record is read).
    """
    from balancer_cli.scan.rules.base import count_images

    rule = config.rule(block.rule_overrides)
    tokenizer = load_tokenizer(config.tokenizer)
    template = config.template_name
    fields = dict(config.fields)
    llm: list[int] = []
    tokens: list[list[int]] = [[] for _ in MODULES]
    items: list[list[int]] = [[] for _ in MODULES]
    seqlens: list[list[list[int]]] = [[] for _ in MODULES]
    errors: list[str | None] = []
    pieces: list[str] = []
    owners: list[int] = []
    for line, record in read_block(block, fields):
        sample_tokens, sample_items, sample_seqlens, sample_llm = [0, 0, 0], [0, 0, 0], ([], [], []), 0
        try:
            if isinstance(record, MalformedLine):
                raise RecordError(f"line is not valid JSON ({record.reason})")
            sample = parse_record(record, fields)
            if sample.media:
                sizes = [_image_size(m, block.image_root) for m in sample.media if m.kind == "image"]
                image_counts = iter(count_images(rule, sizes) if sizes else ())
                for media in sample.media:
                    if media.kind != "image":
                        _fill_from_header(media, block.image_root)
                    module, n_tokens, n_items, item_seqlens, n_llm = _measure_media(
                        media, rule, config, next(image_counts) if media.kind == "image" else None)
                    m = _MODULE_INDEX[module]
                    sample_tokens[m] += n_tokens
                    sample_items[m] += n_items
                    sample_seqlens[m].extend(item_seqlens)
                    sample_llm += n_llm
            rendered = render(template, sample.turns)
        except (RecordError, SampleError) as exc:
            error = _sample_error(exc, block, line)
            if config.strict:
                raise error from None
            sample_tokens, sample_items, sample_seqlens, sample_llm = [0, 0, 0], [0, 0, 0], ([], [], []), 0
            errors.append(f"{error.kind}: {error}")
        else:
            sample_llm += rendered.num_special
            pieces.extend(rendered.pieces)
            owners.extend([len(llm)] * len(rendered.pieces))
            errors.append(None)
        llm.append(sample_llm)
        for m in range(len(MODULES)):
            tokens[m].append(sample_tokens[m])
            items[m].append(sample_items[m])
            seqlens[m].append(sample_seqlens[m])
    for owner, n in zip(owners, tokenizer.count_batch(pieces)):
        llm[owner] += n
    columns: dict[str, pa.Array] = {
        "source": pa.array([block.source] * len(llm), pa.string()),
        "llm_tokens": pa.array(llm, pa.int32()),
    }
    for m, module in enumerate(MODULES):
        columns[f"{module}_tokens"] = pa.array(tokens[m], pa.int32())
        columns[f"{module}_items"] = pa.array(items[m], pa.int32())
        columns[f"{module}_seqlens"] = pa.array(seqlens[m], pa.list_(pa.int32()))
    columns["error"] = pa.array(errors, pa.string())
    return pa.table(columns, schema=block_schema())


def measure_job(block: RecordBlock, config: ScanConfig) -> pa.Table | tuple:
    """:func:`measure_block` for any engine's worker: a table, or under ``config.strict`` the first
    bad sample as a plain tuple, which :func:`unwrap_job` raises again in the driver.

    SampleError itself pickles whole (``BalancerError.__reduce__``); the tuple is kept because it is
    plain JSON-able data: the Ray engine stores it next to the block's shard, so a resumed run
    re-raises the same error without measuring again, and every engine handles results one way.

    Example:
        >>> import pathlib, tempfile
        >>> from balancer_cli.scan.blocks import RecordBlock
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "d.jsonl"
        >>> _ = p.write_text("[1]\\n")
        >>> block = RecordBlock(path=str(p), format="jsonl", source="d", first_sample=0, num_records=1, stop=4)
        >>> measure_job(block, ScanConfig(strict=True))[:3]
        ('sample_error', 'record is a JSON list, expected an object', 'malformed_record')
        >>> unwrap_job(measure_job(block, ScanConfig())).column("error").to_pylist()  # doctest: +ELLIPSIS
        ['malformed_record: ...d.jsonl:1: record is a JSON list, expected an object']
    """
    try:
        return measure_block(block, config)
    except SampleError as exc:
        return ("sample_error", exc.message, exc.kind, exc.file, exc.line, exc.fix)


def unwrap_job(result: pa.Table | tuple) -> pa.Table:
    """The table of a :func:`measure_job` result; raises its SampleError if it carries one.

    Example:
        >>> unwrap_job(("sample_error", "image not found: a.png", "missing_file", "d.jsonl", 3, None))
        Traceback (most recent call last):
        ...
        balancer_cli.errors.SampleError: d.jsonl:3: image not found: a.png
    """
    if isinstance(result, tuple):
        _, message, kind, file, line, fix = result
        raise SampleError(message, kind=kind, file=file, line=line, fix=fix)
    return result
