"""Normalize one dataset record (LLaVA, OpenAI/Qwen ``messages``, plain text) into turns and media.

Recognized fields (rename any with a field mapping, e.g. ``{"image": "file_name"}``):

- ``conversations``: LLaVA turns ``{"from": "human"|"gpt"|"system", "value": text}`` whose text holds
  ``<image>`` / ``<video>`` / ``<audio>`` placeholders. Without any placeholder the media go first
  in the first user turn (``<image>\\n``), as LLaVA's preprocessing does.
- ``messages``: ``{"role", "content"}`` with ``content`` a string (placeholders as above) or a list of
  parts ``{"type": "text", "text"}``, ``{"type": "image"|"image_url"|"video"|"audio", ...}``; a media
  part without its own path takes the next item of the record's ``images``/``videos``/``audios``.
- ``question`` + ``answer``, or ``text``: one user (and assistant) turn.
- media: ``image``/``images``, ``video``/``videos``, ``audio``/``audios``: a path, a list of paths, a
  dict (``path``/``image``/``file_name``/``url``, ``bytes`` (Hugging Face ``Image``/``Video``/``Audio``),
  ``width``, ``height``, ``duration``, ``num_frames``, ``fps``, ``sampling_rate``; a decoded Hugging
  Face ``Audio`` dict's ``array`` + ``sampling_rate`` give the duration) or a list of dicts.
- sizes: record-level ``width``/``height`` (the only image, else the only video), or
  ``image_sizes``: a list of ``[w, h]`` or ``{"width", "height"}``, one per image. Record-level
  ``duration``/``num_frames``/``fps`` describe the only video (else the only audio clip).

Example:
    >>> s = parse_record({"image": "a.png", "width": 640, "height": 480,
    ...                   "conversations": [{"from": "human", "value": "<image>\\nWhat?"},
    ...                                     {"from": "gpt", "value": "A cat."}]})
    >>> [(role, [getattr(p, "kind", p) for p in parts]) for role, parts in s.turns]
    [('user', ['image', '\\nWhat?']), ('assistant', ['A cat.'])]
    >>> s.media[0].width, s.media[0].ref
    (640, 'a.png')
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from balancer_cli.scan.tar_window import MemberRef

__all__ = ["FIELD_LIMITS", "FIELD_NAMES", "BadRecord", "Media", "RecordError", "Sample", "decode_record",
           "parse_record"]

#: Canonical field names a field mapping may rename.
FIELD_NAMES = ("conversations", "messages", "image", "images", "video", "videos", "audio", "audios",
               "width", "height", "image_sizes", "duration", "num_frames", "fps", "question", "answer", "text")

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
          "bot": "assistant", "system": "system"}
_PLACEHOLDER = re.compile(r"<(image|video|audio)>")
_PATH_KEYS = ("path", "image", "video", "audio", "file", "file_name", "filename", "url", "image_url")


class RecordError(Exception):
    """A record that cannot be measured; ``kind`` as in :class:`~balancer_cli.errors.SampleError`."""

    def __init__(self, message: str, kind: str = "malformed_record", fix: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.fix = fix  # None: the kind's own (``measure._KIND_FIXES``)


@dataclass(frozen=True)
class BadRecord:
    """A reader's stand-in for a record it could not build (a JSONL line that is not JSON, a tar
    sample without ``json``/``txt``, a truncated member): :func:`parse_record` raises its error,
    so the sample keeps its row."""

    message: str
    kind: str = "malformed_record"
    fix: str | None = None


def decode_record(raw: str | bytes, what: str) -> Any:
    """One JSON value from text or UTF-8 bytes, or the :class:`BadRecord` saying why not, naming
    ``what`` (``line``, ``member k.json``); never raises.

    Example:
        >>> decode_record('{"text": "a"}', "line"), decode_record("[1,", "line")
        ({'text': 'a'}, BadRecord(message='line is not valid JSON (Expecting value)', kind='malformed_record', fix=None))
    """
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        reason = str(getattr(exc, "msg", exc))
    except RecursionError:
        reason = "nested too deeply"
    except ValueError as exc:  # e.g. an integer literal of more digits than Python converts
        reason = ascii(str(exc))[1:-1][:80]
    return BadRecord(f"{what} is not valid JSON ({reason})")


@dataclass
class Media:
    """One image, video or audio clip of a sample; ``ref`` is a path, raw bytes, a tar member
    (:class:`~balancer_cli.scan.tar_window.MemberRef`), or None."""

    kind: str
    ref: str | bytes | MemberRef | None = None
    width: int | None = None
    height: int | None = None
    duration: float | None = None
    num_frames: int | None = None
    fps: float | None = None
    sample_rate: int | None = None


@dataclass
class Sample:
    """A record as turns of (role, parts) with media parts in order, plus the media list."""

    turns: list[tuple[str, list[Any]]]
    media: list[Media] = field(default_factory=list)


#: The largest value each numeric record field may hold: every count derived from it must fit the
#: lengths table's int32 columns, and a frame count the size of the int32 range would make the
#: rules build multi-gigabyte lists. Far above any real media (a 1,048,576-pixel side, 1,000,000
#: frames, 30 days of audio).
FIELD_LIMITS = {"width": 1 << 20, "height": 1 << 20, "num_frames": 1_000_000, "duration": 30 * 86400.0,
                "fps": 10_000.0, "sampling_rate": 10_000_000}


def _number(value: Any, name: str, kind: type) -> Any:
    """``value`` as a finite, non-negative ``kind`` within :data:`FIELD_LIMITS` (None stays None)."""
    if value is None:
        return value
    if type(value) is not kind:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if not isinstance(value, (str, bytes)) and not hasattr(value, "__float__"):
                raise RecordError(f"{name} is a {type(value).__name__}, not a number")
            try:
                value = float(value)
            except (TypeError, ValueError, OverflowError):
                raise RecordError(f"{name}={str(value)[:40]!r} is not a number") from None
        if kind is int:
            if isinstance(value, float) and not math.isfinite(value):
                raise RecordError(f"{name}={value!r} is not a finite number")
            if value != int(value):
                raise RecordError(f"{name}={value!r} is not an integer")
            value = int(value)
        else:
            value = float(value)
    if kind is float and not math.isfinite(value):
        raise RecordError(f"{name}={value!r} is not a finite number")
    limit = FIELD_LIMITS.get(name)
    if value < 0 or (limit is not None and value > limit):
        raise RecordError(f"{name}={value!r} is out of range (0..{limit:,})")
    return value


def _media_item(kind: str, value: Any) -> Media:
    if isinstance(value, (str, MemberRef)):
        return Media(kind, value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return Media(kind, bytes(value))
    if isinstance(value, Mapping):
        ref = value.get("bytes")
        if ref is None:
            for key in _PATH_KEYS:
                candidate = value.get(key)
                if isinstance(candidate, Mapping):  # OpenAI {"image_url": {"url": ...}}
                    candidate = candidate.get("url")
                if isinstance(candidate, (str, MemberRef)):
                    ref = candidate
                    break
        width = value.get("width", value.get("img_width"))
        height = value.get("height", value.get("img_height"))
        rate = _number(value.get("sampling_rate", value.get("sample_rate")), "sampling_rate", int)
        duration = _number(value.get("duration"), "duration", float)
        array = value.get("array")
        if duration is None and rate and isinstance(array, (list, tuple)):  # decoded HF Audio
            frames = len(array[0] if array and isinstance(array[0], (list, tuple)) else array)
            duration = _number(frames / rate, "duration", float)
        return Media(kind, ref if ref is None or isinstance(ref, (str, MemberRef)) else bytes(ref),
                     _number(width, "width", int), _number(height, "height", int), duration,
                     _number(value.get("num_frames", value.get("nframes")), "num_frames", int),
                     _number(value.get("fps"), "fps", float), rate)
    if kind == "video" and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return Media(kind, value[0] if value else None, num_frames=len(value))  # a list of frame files
    raise RecordError(f"{kind} entry {str(value)[:60]!r} is not a path, bytes or an object")


def _media_list(kind: str, value: Any) -> list[Media]:
    if value is None:
        return []
    if isinstance(value, list):  # several items (a nested list is one video given as frame files)
        return [_media_item(kind, v) for v in value if v is not None]
    return [_media_item(kind, value)]


def _split_placeholders(text: str) -> list[Any]:
    if "<" not in text:  # the common case: no placeholder
        return [text] if text else []
    parts: list[Any] = []
    pos = 0
    for match in _PLACEHOLDER.finditer(text):
        if match.start() > pos:
            parts.append(text[pos:match.start()])
        parts.append(_Slot(match.group(1)))
        pos = match.end()
    if pos < len(text):
        parts.append(text[pos:])
    return parts


@dataclass
class _Slot:
    """A placeholder in text waiting for its media item."""

    kind: str


def _role(raw: Any) -> str:
    if not isinstance(raw, str):
        raise RecordError(f"turn role {raw!r} is not a string")
    return _ROLES.get(raw.lower(), raw.lower())


def _llava_turns(conversations: Any) -> list[tuple[str, list[Any]]]:
    if not isinstance(conversations, list):
        raise RecordError("'conversations' is not a list")
    turns = []
    for i, turn in enumerate(conversations):
        if not isinstance(turn, Mapping) or not isinstance(turn.get("value"), str):
            raise RecordError(f"conversations[{i}] is not {{'from': ..., 'value': str}}")
        turns.append((_role(turn.get("from", "human")), _split_placeholders(turn["value"])))
    return turns


def _message_turns(messages: Any) -> list[tuple[str, list[Any]]]:
    if not isinstance(messages, list):
        raise RecordError("'messages' is not a list")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise RecordError(f"messages[{i}] is not an object")
        content = message.get("content")
        if content is None:
            content = ""
        if isinstance(content, str):
            parts = _split_placeholders(content)
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                parts.extend(_content_part(part, f"messages[{i}].content[{j}]"))
        else:
            raise RecordError(f"messages[{i}].content is neither a string nor a list of parts")
        turns.append((_role(message.get("role", "user")), parts))
    return turns


def _content_part(part: Any, where: str) -> list[Any]:
    if isinstance(part, str):
        return [part]
    if not isinstance(part, Mapping):
        raise RecordError(f"{where} is not an object")
    kind = part.get("type")
    if kind == "image_url":
        kind = "image"
    if kind is None:
        kind = next((k for k in ("image", "video", "audio", "text") if k in part), None)
    if kind == "text":
        text = part.get("text", "")
        if not isinstance(text, str):
            raise RecordError(f"{where}.text is not a string")
        return [text]
    if kind in ("image", "video", "audio"):
        has_ref = any(isinstance(part.get(k), (str, Mapping, bytes)) for k in _PATH_KEYS + ("bytes",))
        return [_media_item(kind, part) if has_ref else _Slot(kind)]
    raise RecordError(f"{where} has unknown type {kind!r}")


def _bind(turns: list[tuple[str, list[Any]]], pools: dict[str, list[Media]]) -> list[Media]:
    """Replace placeholders by the record's media, in order; returns every media item in order."""
    slots: list[tuple[list[Any], int, str]] = []  # (parts, index, kind) of each placeholder
    has_inline = False
    for _, parts in turns:
        for index, part in enumerate(parts):
            kind = type(part)
            if kind is _Slot:
                slots.append((parts, index, part.kind))
            elif kind is Media:
                has_inline = True
    counts = {"image": 0, "video": 0, "audio": 0}
    for _, _, kind in slots:
        counts[kind] += 1
    for kind, pool in pools.items():
        if counts[kind] > len(pool):
            raise RecordError(f"{counts[kind]} <{kind}> placeholder(s) but {len(pool)} {kind}(s) in the record")
        if 0 < counts[kind] < len(pool):
            raise RecordError(f"{len(pool)} {kind}(s) but only {counts[kind]} <{kind}> placeholder(s)")
    cursor = {"image": 0, "video": 0, "audio": 0}
    for parts, index, kind in slots:
        parts[index] = pools[kind][cursor[kind]]
        cursor[kind] += 1
    # Media without any placeholder go first in the first user turn, each followed by "\n".
    missing = [m for kind, pool in pools.items() if counts[kind] == 0 for m in pool]
    if missing:
        target = next((i for i, (role, _) in enumerate(turns) if role == "user"), None)
        if target is None:
            turns.insert(0, ("user", []))
            target = 0
        prefix: list[Any] = []
        for item in missing:
            prefix += [item, "\n"]
        turns[target] = (turns[target][0], prefix + turns[target][1])
    if not has_inline and not missing:
        return [parts[index] for parts, index, _ in slots]
    return [part for _, parts in turns for part in parts if type(part) is Media]


def _apply_record_sizes(record: Mapping[str, Any], get: Any, pools: dict[str, list[Media]]) -> None:
    images, videos, audios = pools["image"], pools["video"], pools["audio"]
    if not (images or videos or audios):
        return
    sizes = get("image_sizes")
    if sizes is not None:
        if not isinstance(sizes, list) or len(sizes) != len(images):
            raise RecordError(f"'image_sizes' must list one size per image ({len(images)})")
        for image, size in zip(images, sizes):
            if isinstance(size, Mapping):
                size = (size.get("width"), size.get("height"))
            if not isinstance(size, (list, tuple)) or len(size) != 2:
                raise RecordError(f"image size {size!r} is not [width, height]")
            image.width, image.height = _number(size[0], "width", int), _number(size[1], "height", int)
    width, height = _number(get("width"), "width", int), _number(get("height"), "height", int)
    if width is not None or height is not None:
        target = images[0] if len(images) == 1 else (videos[0] if not images and len(videos) == 1 else None)
        if target is None and images:
            raise RecordError(f"record-level width/height but {len(images)} images; use 'image_sizes'")
        if target is not None:
            target.width = target.width if target.width is not None else width
            target.height = target.height if target.height is not None else height
    if not (videos or audios):
        return
    timing = {name: get(name) for name in ("duration", "num_frames", "fps")}
    if any(v is not None for v in timing.values()):
        target = videos[0] if len(videos) == 1 else (audios[0] if not videos and len(audios) == 1 else None)
        if target is not None:
            if target.duration is None:
                target.duration = _number(timing["duration"], "duration", float)
            if target.num_frames is None and target.kind == "video":
                target.num_frames = _number(timing["num_frames"], "num_frames", int)
            if target.fps is None and target.kind == "video":
                target.fps = _number(timing["fps"], "fps", float)


def parse_record(record: Any, fields: Mapping[str, str] | None = None) -> Sample:
    """Turn one raw record into a :class:`Sample` (raises :class:`RecordError`).

    Args:
        record: the decoded JSON object / table row.
        fields: canonical field name -> the record's key (see :data:`FIELD_NAMES`).

    Example:
        >>> parse_record({"text": "hi", "audio": {"path": "a.wav", "duration": 2.5}}).media
        [Media(kind='audio', ref='a.wav', width=None, height=None, duration=2.5, num_frames=None, fps=None, sample_rate=None)]
    """
    if isinstance(record, BadRecord):
        raise RecordError(record.message, record.kind, record.fix)
    if not isinstance(record, Mapping):
        raise RecordError(f"record is a JSON {type(record).__name__}, expected an object")
    if fields:
        def get(name: str) -> Any:
            return record.get(fields.get(name, name))
    else:
        get = record.get

    pools = {}
    for kind in ("image", "video", "audio"):
        value = get(kind)
        pools[kind] = _media_list(kind, value if value is not None else get(kind + "s"))
    _apply_record_sizes(record, get, pools)
    if get("conversations") is not None:
        turns = _llava_turns(get("conversations"))
    elif get("messages") is not None:
        turns = _message_turns(get("messages"))
    elif get("question") is not None or get("answer") is not None:
        turns = [("user", _split_placeholders(str(get("question") or ""))),
                 ("assistant", _split_placeholders(str(get("answer") or "")))]
    elif get("text") is not None:
        turns = [("user", _split_placeholders(str(get("text"))))]
    elif any(pools.values()):
        turns = [("user", [])]
    else:
        raise RecordError("record has no 'conversations', 'messages', 'question'/'answer', 'text' or media field")
    return Sample(turns, _bind(turns, pools))
