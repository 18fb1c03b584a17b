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

import functools
import math
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from balancer_cli.errors import InputError, SampleError, UsageError, is_int
from balancer_cli.scan.blocks import RecordBlock
from balancer_cli.scan.inputs import MAX_DYNAMIC_PATCH
from balancer_cli.scan.media_paths import fill_from_header, image_size
from balancer_cli.scan.readers import read_block
from balancer_cli.scan.records import FIELD_LIMITS, Media, RecordError, parse_record
from balancer_cli.scan.templates import DEFAULT_TEMPLATE, check_template, render
from balancer_cli.scan.text import load_tokenizer

__all__ = [
    "AUDIO_FRAMES_PER_S",
    "AUDIO_LLM_POOL",
    "INT32_MAX",
    "MODULES",
    "RULE_PARAM_LIMITS",
    "ScanConfig",
    "block_schema",
    "error_kind",
    "measure_block",
    "measure_job",
    "unwrap_job",
]

#: The largest value of rule parameters whose cost grows with them (tiles, frames per video).
RULE_PARAM_LIMITS = {"max_tiles": MAX_DYNAMIC_PATCH, "min_tiles": MAX_DYNAMIC_PATCH,
                     "max_frames": FIELD_LIMITS["num_frames"], "min_frames": FIELD_LIMITS["num_frames"]}
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
        media_roots: folders outside the image root that symlinks in the dataset may lead into
            (a data folder symlinked onto another disk); any other symlink leaving the root is a
            ``path_escape`` error.
    """

    model: str = "qwen2-vl"
    model_params: tuple[tuple[str, Any], ...] = ()
    processor_config: str | None = None
    tokenizer: str = "qwen2"
    template: str | None = None
    strict: bool = False
    video_size: tuple[int, int] = (640, 360)
    fields: tuple[tuple[str, str], ...] = ()
    media_roots: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name, value in self.model_params:
            if isinstance(value, float) and not math.isfinite(value):
                raise UsageError(f"rule parameter {name}={value!r} is not a finite number",
                                 fix="give a finite value")
            limit = RULE_PARAM_LIMITS.get(name)
            if limit is not None and is_int(value) and value > limit:
                # the tiling families enumerate every tile grid up to max_tiles: 10**6 never ends
                raise UsageError(f"rule parameter {name}={value:,} is above {limit:,}",
                                 fix=f"give {name} of at most {limit:,}")
        width, height = self.video_size
        if not (is_int(width) and is_int(height) and 1 <= width <= 1 << 20 and 1 <= height <= 1 << 20):
            raise UsageError(f"video size {width}x{height} is out of range", fix="give WxH, each side in 1..1048576")

    @property
    def template_name(self) -> str:
        """The template used: ``template``, else the model's default."""
        default = self.model if self.model.startswith("hf:") else DEFAULT_TEMPLATE.get(self.model.lower(), "plain")
        return check_template(self.template or default)

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
    if getattr(rule, "counts_audio", False):  # Qwen2.5-Omni / Qwen3-Omni presets and hf:DIR folders
        count = rule.count_audio(media.duration)
        return "audio", count.encoder_tokens, count.items, count.seqlens, count.llm_tokens
    frames = math.ceil(media.duration * AUDIO_FRAMES_PER_S)
    return "audio", frames, 1, (frames,), math.ceil(frames / AUDIO_LLM_POOL)


# The scan's media reading under its former names (scan.verify reads sizes the same way).
_image_size, _fill_from_header = image_size, fill_from_header

#: The largest value of the table's int32 columns.
INT32_MAX = (1 << 31) - 1


def _check_fits(llm: int, tokens: list[int], items: list[int], seqlens: tuple[list[int], ...]) -> None:
    """Raise ``too_large`` unless every count of one sample fits the table's int32 columns."""
    values = [llm, *tokens, *items, *(max(s) for s in seqlens if s)]
    if max(values) > INT32_MAX or min(values) < 0:
        raise RecordError(f"counts {max(values):,} outside the int32 range of the lengths table",
                          kind="too_large")


def _unexpected(exc: Exception) -> RecordError:
    """A record's error for an exception no check anticipated, named by its type (never its
    arguments' raw bytes: the text is cut and escaped)."""
    if isinstance(exc, RecursionError):
        return RecordError("record nested too deeply to measure")
    if isinstance(exc, OSError):
        return RecordError(f"unreadable file ({exc.strerror or type(exc).__name__})", kind="unreadable_file")
    if isinstance(exc, UnicodeError):
        return RecordError(f"text is not valid Unicode ({type(exc).__name__})")
    if isinstance(exc, MemoryError):
        return RecordError("record too large to measure in memory", kind="too_large")
    text = ascii(str(exc))[1:-1][:120]
    return RecordError(f"cannot measure the record ({type(exc).__name__}: {text})")


#: The fix a row error of each kind names where the check that raised it named none.
_KIND_FIXES = {
    "malformed_record": "fix the record (one JSON object with the fields of a LLaVA or messages record, "
                        "see --field), or drop it",
    "missing_video_metadata": "give the record the video's file, or its duration or num_frames",
    "missing_audio_duration": "give the record the clip's file, or its duration in seconds",
    "rejected_by_model": "fix the media size in the record or re-encode the file, or drop the sample",
    "too_large": "shorten or split the sample, or drop it",
    "unreadable_file": "check the file and its permissions",
}


def _sample_error(exc: Exception, block: RecordBlock, line: int) -> SampleError:
    kind = getattr(exc, "kind", "malformed_record")
    fix = getattr(exc, "fix", None) or _KIND_FIXES.get(kind, "fix the sample in its input, or drop it")
    message = exc.message if isinstance(exc, SampleError) else str(exc)
    return SampleError(message, kind=kind, file=block.path, line=line, fix=fix)


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
    lines: list[int] = []
    for line, record in read_block(block, fields):
        sample_tokens, sample_items, sample_seqlens, sample_llm = [0, 0, 0], [0, 0, 0], ([], [], []), 0
        try:
            try:
                sample = parse_record(record, fields)
                if sample.media:
                    roots = (block.image_root, config.media_roots)
                    sizes = [image_size(m, *roots) for m in sample.media if m.kind == "image"]
                    image_counts = iter(count_images(rule, sizes) if sizes else ())
                    for media in sample.media:
                        if media.kind != "image":
                            fill_from_header(media, *roots)
                        module, n_tokens, n_items, item_seqlens, n_llm = _measure_media(
                            media, rule, config, next(image_counts) if media.kind == "image" else None)
                        m = _MODULE_INDEX[module]
                        sample_tokens[m] += n_tokens
                        sample_items[m] += n_items
                        sample_seqlens[m].extend(item_seqlens)
                        sample_llm += n_llm
                rendered = render(template, sample.turns)
                for piece in rendered.pieces:
                    piece.encode("utf-8")  # a lone surrogate (JSON "\\ud800") fails here, not in the batch
                _check_fits(sample_llm + rendered.num_special, sample_tokens, sample_items, sample_seqlens)
            except (RecordError, SampleError):
                raise
            except Exception as exc:  # noqa: BLE001 (anything one record causes is its error)
                raise _unexpected(exc) from None
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
        lines.append(line)
        for m in range(len(MODULES)):
            tokens[m].append(sample_tokens[m])
            items[m].append(sample_items[m])
            seqlens[m].append(sample_seqlens[m])
    if len(llm) != block.num_records:  # the file changed since it was split into blocks
        raise InputError(f"{block.path}: {len(llm)} records read where {block.num_records} were counted "
                         f"(from line or row {block.first_line})",
                         fix="do not modify the inputs while they are scanned; scan again")
    for owner, n in zip(owners, tokenizer.count_batch(pieces)):
        llm[owner] += n
    for owner in sorted(set(owners)):
        if llm[owner] > INT32_MAX:
            error = SampleError(f"{llm[owner]:,} LLM tokens do not fit the int32 llm_tokens column",
                                kind="too_large", file=block.path, line=lines[owner],
                                fix="split the sample, or drop it")
            if config.strict:
                raise error
            llm[owner] = 0
            for m in range(len(MODULES)):
                tokens[m][owner], items[m][owner], seqlens[m][owner] = 0, 0, []
            errors[owner] = f"{error.kind}: {error}"
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
        ['malformed_record: ...d.jsonl:1: record is a JSON list, expected an object; fix: ...']
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
