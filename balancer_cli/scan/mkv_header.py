"""Matroska/WebM video metadata from the EBML header elements, as FFmpeg's matroska demuxer reads them.

:func:`mkv_video` reads the segment's ``Info`` (``TimecodeScale``, ``Duration``) and ``Tracks``
(the first video track's ``PixelWidth``/``PixelHeight`` and ``DefaultDuration``) from the file's
first bytes, or where the ``SeekHead`` points: a few small reads, never a cluster. The values are
those FFmpeg gives: the container duration ``Duration x TimecodeScale`` truncated to microseconds,
``average_rate`` = ``av_reduce(1e9, DefaultDuration, 30000)``, and no frame count (Matroska stores
none: the caller's ``round(duration * fps)``). Anything FFmpeg would derive otherwise (no
``Duration`` or ``DefaultDuration``, an unknown-size segment, a track time scale, cropping, a
``rotate`` tag, a duration that is no whole number of track ticks, cues past the end of the file)
returns None and is left to PyAV. Element walks are bounded by the bytes read.

Example:
    >>> mkv_video(lambda n, at: b"", 0) is None
    True
    >>> av_reduce(1_000_000_000, 33_366_667, 30_000)
    (30000, 1001)
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

__all__ = ["EBML_MAGIC", "HEAD_BYTES", "MATROSKA_DEMUXER", "av_reduce", "mkv_audio", "mkv_video"]

#: The first four bytes of every Matroska/WebM file (the EBML header's ID).
EBML_MAGIC = b"\x1a\x45\xdf\xa3"
#: FFmpeg's name of the demuxer (``container.format.name``).
MATROSKA_DEMUXER = "matroska,webm"
HEAD_BYTES = 4096  # FFmpeg's and mkvmerge's Info and Tracks sit in the first kilobytes
_MAX_ELEMENT = 1 << 20  # an Info/Tracks/Tags element read through the SeekHead: bigger goes to PyAV
_SEGMENT, _SEEKHEAD, _SEEK, _SEEK_ID, _SEEK_POS = 0x18538067, 0x114D9B74, 0x4DBB, 0x53AB, 0x53AC
_INFO, _SCALE, _DURATION = 0x1549A966, 0x2AD7B1, 0x4489
_TRACKS, _ENTRY, _TYPE, _DEFAULT_DURATION, _TRACK_SCALE, _VIDEO = 0x1654AE6B, 0xAE, 0x83, 0x23E383, 0x23314F, 0xE0
_WIDTH, _HEIGHT = 0xB0, 0xBA
_CODEC, _AUDIO, _RATE, _OUT_RATE, _CHANNELS = 0x86, 0xE1, 0xB5, 0x78B5, 0x9F
# Audio codecs whose stored rate and channels FFmpeg reports as they are (AAC may double its rate: SBR).
_PLAIN_AUDIO = (b"A_OPUS", b"A_VORBIS", b"A_FLAC", b"A_PCM/", b"A_MPEG/L3")
_CROPS = frozenset({0x54AA, 0x54BB, 0x54CC, 0x54DD})
_TAGS, _CLUSTER = 0x1254C367, 0x1F43B675
_DOCTYPE, _DOCTYPES = 0x4282, (b"matroska", b"webm")
_AV_TIME_BASE = 1_000_000
# Bytes of a variable-length integer, by its first byte (0: invalid, a length over 8).
_VINT_LEN = bytes(0 if b == 0 else 9 - b.bit_length() for b in range(256))


def av_reduce(num: int, den: int, limit: int) -> tuple[int, int]:
    """FFmpeg's ``av_reduce``: ``num/den`` as the nearest fraction with both terms <= ``limit``.

    Example:
        >>> av_reduce(1_000_000_000, 40_000_000, 30_000)
        (25, 1)
    """
    g = math.gcd(num, den)
    if g:
        num, den = num // g, den // g
    if num <= limit and den <= limit:
        return num, den
    a0n, a0d, a1n, a1d = 0, 1, 1, 0
    while den:
        x = num // den
        next_den = num - den * x
        a2n, a2d = x * a1n + a0n, x * a1d + a0d
        if a2n > limit or a2d > limit:
            if a1n:
                x = (limit - a0n) // a1n
            if a1d:
                x = min(x, (limit - a0d) // a1d)
            if den * (2 * x * a1d + a0d) > num * a1d:
                a1n, a1d = x * a1n + a0n, x * a1d + a0d
            break
        a0n, a0d, a1n, a1d = a1n, a1d, a2n, a2d
        num, den = den, next_den
    return a1n, a1d


def _element(buf: bytes, pos: int, end: int) -> tuple[int, int, int]:
    """``(id, data_start, size)`` of the element at ``pos`` (size -1: unknown); ValueError if cut."""
    if pos >= end:
        raise ValueError("no element")
    n = _VINT_LEN[buf[pos]]
    if not n or n > 4 or pos + n >= end:
        raise ValueError("bad element id")
    ident = int.from_bytes(buf[pos:pos + n], "big")
    pos += n
    b = buf[pos]
    if b & 0x80:
        return ident, pos + 1, -1 if b == 0xFF else b & 0x7F
    m = _VINT_LEN[b]
    if not m or pos + m > end:
        raise ValueError("bad element size")
    mask = (1 << (7 * m)) - 1
    size = int.from_bytes(buf[pos:pos + m], "big") & mask
    return ident, pos + m, -1 if size == mask else size


def _children(buf: bytes, start: int, end: int) -> list[tuple[int, int, int]]:
    """``(id, data_start, data_end)`` of every element in ``buf[start:end]`` (ValueError/IndexError
    if one is cut or of unknown size). One- and two-byte IDs and one-byte sizes, nearly all of a
    header's, take the inline path."""
    out = []
    pos = start
    while pos < end:
        b = buf[pos]
        if b & 0x80:
            ident, pos = b, pos + 1
        elif b & 0x40:
            ident, pos = (b << 8) | buf[pos + 1], pos + 2
        else:
            n = _VINT_LEN[b]
            if not n or n > 4:
                raise ValueError("bad element id")
            ident, pos = int.from_bytes(buf[pos:pos + n], "big"), pos + n
        b = buf[pos]
        if b & 0x80 and b != 0xFF:
            size, pos = b & 0x7F, pos + 1
        else:
            m = _VINT_LEN[b]
            mask = (1 << (7 * m)) - 1
            size = int.from_bytes(buf[pos:pos + m], "big") & mask
            if not m or size == mask:
                raise ValueError("bad or unknown element size")
            pos += m
        stop = pos + size
        if stop > end:
            raise ValueError("element runs past its parent")
        out.append((ident, pos, stop))
        pos = stop
    return out


def _uint(buf: bytes, start: int, end: int) -> int:
    if end - start > 8:
        raise ValueError("integer longer than 8 bytes")
    return int.from_bytes(buf[start:end], "big")


def _float(buf: bytes, start: int, end: int) -> float:
    if end - start == 4:
        return struct.unpack_from(">f", buf, start)[0]
    if end - start == 8:
        return struct.unpack_from(">d", buf, start)[0]
    raise ValueError("float of odd length")


def _doc_type_ok(head: bytes) -> int | None:
    """Where the segment starts after a Matroska/WebM EBML header (None: another document type)."""
    ident, data, size = _element(head, 0, len(head))
    if ident != 0x1A45DFA3 or size < 0 or data + size > len(head):
        return None
    if any(head.find(doc, data, data + size) > 0 for doc in (b"\x42\x82\x88matroska", b"\x42\x82\x84webm")):
        return data + size  # what muxers write: the walk below is for the rest
    doc = {i: (s, e) for i, s, e in _children(head, data, data + size)}.get(_DOCTYPE)
    return data + size if (head[doc[0]:doc[1]] if doc else b"matroska") in _DOCTYPES else None


def mkv_video(read: Callable[[int, int], bytes], size: int,
              head: bytes | None = None) -> tuple[float, float, int, int, int, int, str] | None:
    """``(seconds, fps, frames, width, height, rotation, container)`` of the first video track as
    :func:`~balancer_cli.scan.media_header.read_video_info` reports it through PyAV (``frames`` =
    ``round(seconds * fps)``: Matroska has no count; rotation 0), or None where PyAV must read the file.

    Args:
        read: ``read(n, offset)`` gives up to ``n`` bytes at ``offset``.
        size: the file's size in bytes.
        head: the file's first bytes when already read (at least :data:`HEAD_BYTES` of them, or all).

    Example:
        >>> mkv_video(lambda n, at: b"\\x1a\\x45\\xdf\\xa3"[at:at + n], 4) is None  # an EBML magic, nothing more
        True
    """
    try:
        return _mkv_video(read, size, head if head is not None else read(HEAD_BYTES, 0))
    except (ValueError, IndexError, struct.error, OverflowError, ZeroDivisionError):
        return None


def _top_level(head: bytes, segment: int) -> dict[int, tuple[int, int]]:
    """The segment's elements whole in ``head``, ``id: (start, end)`` (the first of each kind)."""
    found: dict[int, tuple[int, int]] = {}
    pos = segment
    for _ in range(64):  # bounded: the head holds a few dozen elements at most
        try:
            ident, data, length = _element(head, pos, len(head))
        except (ValueError, IndexError):
            break
        if ident == _CLUSTER or length < 0 or data + length > len(head):
            break
        found.setdefault(ident, (data, data + length))
        pos = data + length
    return found


def _seek_head(head: bytes, found: dict[int, tuple[int, int]], segment: int) -> dict[int, int]:
    """The SeekHead's ``id: file offset`` map (empty without one in the head)."""
    seeks: dict[int, int] = {}
    for kind, s, e in _children(head, *found[_SEEKHEAD]) if _SEEKHEAD in found else ():
        if kind == _SEEK:
            entry = {i: (a, b) for i, a, b in _children(head, s, e)}
            if _SEEK_ID in entry and _SEEK_POS in entry:
                seeks.setdefault(_uint(head, *entry[_SEEK_ID]), segment + _uint(head, *entry[_SEEK_POS]))
    return seeks


def _fetch(read: Callable[[int, int], bytes], head: bytes, found: dict, seeks: dict, ident: int,
           size: int) -> tuple[bytes, int, int] | None:
    """``(buffer, start, end)`` of the element ``ident``: in the head, else read where the SeekHead points."""
    if ident in found:
        return (head, *found[ident])
    at = seeks.get(ident)
    if at is None or at >= size:
        return None
    top = read(16, at)
    kind, data, length = _element(top, 0, len(top))
    if kind != ident or length < 0 or length > _MAX_ELEMENT or at + data + length > size:
        return None
    body = read(length, at + data)
    return (body, 0, length) if len(body) == length else None


def _segment(read: Callable[[int, int], bytes], size: int, head: bytes,
             video: bool) -> tuple[int, tuple[bytes, int, int]] | None:
    """``(container duration in microseconds, the Tracks element)`` of a Matroska file, or None."""
    if head[:4] != EBML_MAGIC:
        return None
    segment_at = _doc_type_ok(head)
    if segment_at is None:
        return None
    ident, segment, length = _element(head, segment_at, len(head))
    if ident != _SEGMENT or length < 0:  # a live stream's unknown-size segment: FFmpeg reads on
        return None
    if segment + length > size:  # a cut file: its cues (FFmpeg's index) may be gone
        return None
    found = _top_level(head, segment)
    seeks = {} if _INFO in found and _TRACKS in found and _TAGS in found else _seek_head(head, found, segment)
    info = _fetch(read, head, found, seeks, _INFO, size)
    tracks = _fetch(read, head, found, seeks, _TRACKS, size)
    if info is None or tracks is None:
        return None
    if video and (_TAGS in found or _TAGS in seeks):
        tags = _fetch(read, head, found, seeks, _TAGS, size)
        if tags is None or tags[0].find(b"rotate", tags[1], tags[2]) >= 0:
            return None  # FFmpeg reports a "rotate" tag as the stream's rotation: let it
    fields = {i: (s, e) for i, s, e in _children(*info)}
    buf = info[0]
    scale = _uint(buf, *fields[_SCALE]) if _SCALE in fields else 1_000_000
    if _DURATION not in fields or scale <= 0:
        return None
    duration = _float(buf, *fields[_DURATION])
    if not (math.isfinite(duration) and duration > 0):
        return None
    container_us = int(duration * float(scale) * 1000 / _AV_TIME_BASE)  # FFmpeg's double arithmetic
    if container_us <= 0 or (container_us * 1000) % scale:
        return None  # the stream duration (whole ticks) and the container's would differ
    return container_us, tracks


def _mkv_video(read: Callable[[int, int], bytes], size: int,
               head: bytes) -> tuple[float, float, int, int, int, int, str] | None:
    segment = _segment(read, size, head, True)
    video = _first_video(segment[1]) if segment is not None else None
    if video is None:
        return None
    default_duration, width, height = video
    num, den = av_reduce(1_000_000_000, default_duration, 30_000)
    if not num or not den:
        return None
    seconds, fps = segment[0] / _AV_TIME_BASE, num / den  # as PyAV's duration / 1e6 and float(average_rate)
    return seconds, fps, round(seconds * fps), width, height, 0, MATROSKA_DEMUXER


def mkv_audio(read: Callable[[int, int], bytes], size: int, head: bytes) -> tuple[int, int, int, float] | None:
    """``(samples, sample rate, channels, seconds)`` of the first audio track as PyAV reports it
    (``samples = round(seconds * rate)``, seconds the container's duration), or None where PyAV
    must read the file (codecs whose decoder may change the rate, such as AAC with SBR).

    Example:
        >>> mkv_audio(lambda n, at: b"", 0, b"") is None
        True
    """
    try:
        segment = _segment(read, size, head, False)
        audio = _first_audio(segment[1]) if segment is not None else None
    except (ValueError, IndexError, struct.error, OverflowError):
        return None
    if audio is None:
        return None
    rate, channels = audio
    seconds = segment[0] / _AV_TIME_BASE
    return round(seconds * rate), rate, channels, seconds


def _first_entry(tracks: tuple[bytes, int, int], track_type: int) -> dict[int, tuple[int, int]] | None:
    """The elements of the first TrackEntry whose TrackType is ``track_type`` (1 video, 2 audio)."""
    buf = tracks[0]
    for ident, s, e in _children(*tracks):
        if ident != _ENTRY:
            continue
        entry = {i: (a, b) for i, a, b in _children(buf, s, e)}
        if _TYPE in entry and _uint(buf, *entry[_TYPE]) == track_type:
            return entry
    return None


def _first_audio(tracks: tuple[bytes, int, int]) -> tuple[int, int] | None:
    """``(SamplingFrequency, Channels)`` of the first audio TrackEntry, when FFmpeg reports them as stored."""
    buf, entry = tracks[0], _first_entry(tracks, 2)
    if entry is None:
        return None
    codec = buf[entry[_CODEC][0]:entry[_CODEC][1]] if _CODEC in entry else b""
    if _AUDIO not in entry or _TRACK_SCALE in entry or not codec.startswith(_PLAIN_AUDIO):
        return None
    audio = {i: (a, b) for i, a, b in _children(buf, *entry[_AUDIO])}
    if _RATE not in audio or _OUT_RATE in audio:
        return None
    rate = _float(buf, *audio[_RATE])
    channels = _uint(buf, *audio[_CHANNELS]) if _CHANNELS in audio else 1
    if not (rate == int(rate) > 0 and 0 < channels <= 64) or (codec == b"A_OPUS" and rate != 48000):
        return None
    return int(rate), channels


def _first_video(tracks: tuple[bytes, int, int]) -> tuple[int, int, int] | None:
    """``(DefaultDuration, PixelWidth, PixelHeight)`` of the first video TrackEntry (None: none or unusual)."""
    buf, entry = tracks[0], _first_entry(tracks, 1)
    if entry is None or _DEFAULT_DURATION not in entry or _VIDEO not in entry or _TRACK_SCALE in entry:
        return None
    video = {i: (a, b) for i, a, b in _children(buf, *entry[_VIDEO])}
    if _WIDTH not in video or _HEIGHT not in video or any(c in video for c in _CROPS):
        return None
    default_duration = _uint(buf, *entry[_DEFAULT_DURATION])
    if not 0 < default_duration < 1 << 62:
        return None
    return default_duration, _uint(buf, *video[_WIDTH]), _uint(buf, *video[_HEIGHT])
