"""mp4/mov (ISO-BMFF) video metadata from the ``moov`` box alone, as FFmpeg's mov demuxer reads it.

:func:`read_moov` finds the ``moov`` box wherever it sits (top-level box headers only: a few small
reads) and reads it in one piece; :func:`video_track` parses its first video track: ``mdhd``
(time scale), ``stts`` (frame durations), ``stsz`` (frame count), the ``stsd`` sample entry
(coded size), ``tkhd`` x ``mvhd`` (display matrix), ``elst`` (edit list), ``stco``/``stsc`` (where
the last frame ends, to spot a cut file). The values are those FFmpeg derives (``stream.duration``
= the ``stts`` total in the ``mdhd`` time base, ``average_rate`` = frames x time scale / total,
``frames`` = the ``stsz`` count, the rotation ``av_display_rotation_get`` gives); a track with
anything FFmpeg would adjust (a trimming edit list, several edits, fragments, a zero duration,
FFmpeg's last-frame duration fix-up) is reported as not ``simple`` and left to PyAV.

Example:
    >>> import io
    >>> f = io.BytesIO(b"\\x00\\x00\\x00\\x08free")
    >>> read_moov(f.read, 8, f.seek) is None  # no moov box
    True
    >>> normalize_rotation(270.0), normalize_rotation(180.0), normalize_rotation(-89.9)
    (-90, -180, -90)
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

__all__ = ["MOV_DEMUXER", "MovAudio", "MovVideo", "audio_track", "looks_like_mov", "normalize_rotation", "read_moov",
           "video_track"]

#: FFmpeg's name of the mov/mp4 demuxer (what PyAV reports as ``container.format.name``).
MOV_DEMUXER = "mov,mp4,m4a,3gp,3g2,mj2"
_TOP_LEVEL = {b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot", b"uuid", b"meta", b"pdin", b"styp"}
_MAX_MOOV = 256 << 20  # a bigger moov (days of video) goes through PyAV
_IDENTITY = ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0))
_IDENTITY_BYTES = struct.pack(">9i", 1 << 16, 0, 0, 0, 1 << 16, 0, 0, 0, 1 << 30)  # most files: no rotation


@dataclass(frozen=True)
class MovVideo:
    """The first video track of a ``moov`` box (see the module docstring).

    Attributes:
        duration_ts, timescale: the ``stts`` total in ``mdhd`` units (FFmpeg's ``stream.duration``
            and ``1/time_base``); frames: the ``stsz`` count; fps: frames x timescale / duration_ts.
        width, height: the sample entry's coded size; rotation: degrees counter-clockwise.
        last_sample_end: the byte just past the last frame (None if the tables do not say).
        simple: False where FFmpeg would adjust these values (use PyAV instead).
    """

    duration_ts: int
    timescale: int
    frames: int
    fps: Fraction
    width: int
    height: int
    rotation: int
    last_sample_end: int | None
    simple: bool


@dataclass(frozen=True)
class MovAudio:
    """The first audio track of a ``moov`` box, where it is plain AAC-LC FFmpeg reads as stored.

    Attributes:
        duration_ts, timescale: FFmpeg's ``stream.duration`` (after a priming-skip edit list) and
            ``1/time_base`` (the ``mdhd`` time scale, equal to the sample rate); sample_rate,
            channels: the AAC configuration's.
    """

    duration_ts: int
    timescale: int
    sample_rate: int
    channels: int


_AAC_RATES = (96000, 88200, 64000, 48000, 44100, 32000, 24000, 22050, 16000, 12000, 11025, 8000, 7350)


def normalize_rotation(degrees: float) -> int:
    """``degrees`` (counter-clockwise) as the nearest multiple of 90 in [-180, 180), as PyAV reports them.

    Example:
        >>> normalize_rotation(90.0004)
        90
    """
    quarter = round(degrees / 90.0) % 4
    return (quarter * 90 + 180) % 360 - 180


def looks_like_mov(head: bytes) -> bool:
    """Whether the first bytes of a file start an ISO-BMFF box FFmpeg's mov demuxer would take.

    Example:
        >>> looks_like_mov(b"\\x00\\x00\\x00\\x20ftypisom"), looks_like_mov(b"RIFF....WAVE")
        (True, False)
    """
    return len(head) >= 8 and head[4:8] in _TOP_LEVEL


def read_moov(read: Callable[..., bytes], size: int, seek: Callable[[int], object] | None = None,
              head: bytes = b"") -> bytes | None:
    """The ``moov`` box's payload of a file of ``size`` bytes (``read(n)`` after ``seek(offset)``), or None.

    ``seek`` may be omitted when ``read`` is ``read(n, offset)`` (``os.pread`` bound to a descriptor).
    ``head``, the file's first bytes if already read, saves the reads it covers (a faststart file's
    ``moov`` often sits wholly in its first kilobytes).
    """
    def read_at(offset: int, n: int) -> bytes:
        if offset + n <= len(head):
            return head[offset:offset + n]
        if seek is None:
            return read(n, offset)
        seek(offset)
        return read(n)

    pos = 0
    while pos + 8 <= size:
        head = read_at(pos, 16)
        if len(head) < 8 or head[4:8] not in _TOP_LEVEL:
            return None
        length, header = struct.unpack(">I", head[:4])[0], 8
        if length == 1:
            if len(head) < 16:
                return None
            length, header = struct.unpack(">Q", head[8:16])[0], 16
        elif length == 0:
            length = size - pos
        if length < header:
            return None
        if head[4:8] == b"moov":
            if length > _MAX_MOOV:
                return None
            body = read_at(pos + header, length - header)
            return body if len(body) == length - header else None
        pos += length
    return None


_BOX = struct.Struct(">I4s")


def _box_list(data: bytes, start: int, end: int) -> list[tuple[bytes, int, int]]:
    """``(type, payload_start, box_end)`` of the boxes in ``data[start:end]`` (a list: one pass, no generator)."""
    out = []
    pos, unpack = start, _BOX.unpack_from
    while pos + 8 <= end:
        length, kind = unpack(data, pos)
        header = 8
        if length == 1 and pos + 16 <= end:
            length, header = struct.unpack_from(">Q", data, pos + 8)[0], 16
        elif length == 0:
            length = end - pos
        if length < header or pos + length > end:
            break
        out.append((kind, pos + header, pos + length))
        pos += length
    return out


def _children(data: bytes, start: int, end: int) -> dict[bytes, tuple[int, int]]:
    found: dict[bytes, tuple[int, int]] = {}
    for kind, s, e in _box_list(data, start, end):
        if kind not in found:
            found[kind] = (s, e)
    return found


def _matrix(data: bytes, at: int) -> tuple[tuple[float, ...], ...]:
    values = struct.unpack_from(">9i", data, at)  # a b u / c d v / x y w: 16.16 except u, v, w (2.30)
    return tuple(tuple(values[3 * i + j] / (1 << (30 if j == 2 else 16)) for j in range(3)) for i in range(3))


def _rotation(track: tuple[tuple[float, ...], ...], movie: tuple[tuple[float, ...], ...]) -> int:
    """``av_display_rotation_get`` of ``track x movie`` (FFmpeg's mov demuxer multiplies them)."""
    res = [[sum(track[i][e] * movie[e][j] for e in range(3)) for j in range(2)] for i in range(2)]
    scale0, scale1 = math.hypot(res[0][0], res[1][0]), math.hypot(res[0][1], res[1][1])
    if not scale0 or not scale1:
        return 0
    return normalize_rotation(-math.degrees(math.atan2(res[0][1] / scale1, res[0][0] / scale0)))


def _full_box_offset(data: bytes, start: int, v0: int, v1: int) -> int:
    return start + (v1 if data[start] == 1 else v0)


def _last_sample_end(data: bytes, stbl: dict[bytes, tuple[int, int]], sizes: tuple[int, int, int]) -> int | None:
    """Byte offset just past the last sample: last chunk offset + the sizes of the samples in it."""
    offsets = stbl.get(b"stco") or stbl.get(b"co64")
    stsc = stbl.get(b"stsc")
    if offsets is None or stsc is None:
        return None
    wide = b"co64" in stbl and offsets == stbl[b"co64"]
    (chunks,) = struct.unpack_from(">I", data, offsets[0] + 4)
    (entries,) = struct.unpack_from(">I", data, stsc[0] + 4)
    if not chunks or not entries:
        return None
    last = offsets[0] + 8 + (chunks - 1) * (8 if wide else 4)
    (chunk_at,) = struct.unpack_from(">Q" if wide else ">I", data, last)
    (per_chunk,) = struct.unpack_from(">I", data, stsc[0] + 8 + (entries - 1) * 12 + 4)
    fixed, count, table = sizes
    if fixed:
        return chunk_at + per_chunk * fixed
    if per_chunk > count:
        return None
    tail = struct.unpack_from(f">{per_chunk}I", data, table + 4 * (count - per_chunk))
    return chunk_at + sum(tail)


def video_track(moov: bytes) -> MovVideo | None:
    """The first video track of a ``moov`` payload (None: no video track, or tables cut short).

    Example:
        >>> video_track(b"") is None
        True
    """
    try:
        return _video_track(moov)
    except (struct.error, IndexError, KeyError, ValueError, ZeroDivisionError):  # tables cut short or absent
        return None


def _top(moov: bytes) -> tuple[list[tuple[bytes, int, int]], dict[bytes, tuple[int, int]]]:
    """The ``moov`` payload's boxes, as a list and as a first-of-each-type map (one walk)."""
    boxes = _box_list(moov, 0, len(moov))
    top: dict[bytes, tuple[int, int]] = {}
    for kind, s, e in boxes:
        if kind not in top:
            top[kind] = (s, e)
    return boxes, top


def _tracks(moov: bytes, boxes: list, handler: bytes):
    """``(trak, stbl, timescale, media_ts, counts, deltas)`` of each track whose handler is
    ``handler`` (``vide``, ``soun``), in file order: its boxes, ``mdhd``'s time scale and duration,
    and its ``stts`` run lengths and sample durations."""
    for kind, start, end in boxes:
        if kind != b"trak":
            continue
        trak = _children(moov, start, end)
        mdia = _children(moov, *trak[b"mdia"]) if b"mdia" in trak else {}
        if b"hdlr" not in mdia or moov[mdia[b"hdlr"][0] + 8:mdia[b"hdlr"][0] + 12] != handler:
            continue
        s, _ = mdia[b"mdhd"]
        at = _full_box_offset(moov, s, 12, 20)
        timescale, media_ts = struct.unpack_from(">IQ" if moov[s] == 1 else ">II", moov, at)
        stbl = _children(moov, *_children(moov, *mdia[b"minf"])[b"stbl"])
        stts = stbl[b"stts"][0]
        (entries,) = struct.unpack_from(">I", moov, stts + 4)
        pairs = struct.unpack_from(f">{2 * entries}I", moov, stts + 8)
        yield trak, stbl, timescale, media_ts, pairs[0::2], pairs[1::2]


def _video_track(moov: bytes) -> MovVideo | None:
    boxes, top = _top(moov)
    movie_at = _full_box_offset(moov, top[b"mvhd"][0], 36, 48) if b"mvhd" in top else None
    for trak, stbl, timescale, media_ts, counts, deltas in _tracks(moov, boxes, b"vide"):
        entries = len(counts)
        frames_stts, stts_ts = sum(counts), sum(c * d for c, d in zip(counts, deltas))
        duration_ts = min(media_ts, stts_ts)  # FFmpeg: the shorter of mdhd's and the frames' durations
        stsz = stbl.get(b"stsz")
        fixed, count = struct.unpack_from(">II", moov, stsz[0] + 4) if stsz else (0, 0)
        entry = stbl[b"stsd"][0] + 8  # version/flags, entry count, then the first sample entry
        width, height = struct.unpack_from(">HH", moov, entry + 8 + 24)
        track_at = _full_box_offset(moov, trak[b"tkhd"][0], 40, 52)
        rotation = 0
        if moov[track_at:track_at + 36] != _IDENTITY_BYTES or (
                movie_at is not None and moov[movie_at:movie_at + 36] != _IDENTITY_BYTES):
            rotation = _rotation(_matrix(moov, track_at), _IDENTITY if movie_at is None else _matrix(moov, movie_at))
        # FFmpeg shortens an outlier last duration (mov_read_stts, at 10x the mean): this test
        # catches more, and leaves those tracks to FFmpeg.
        outlier = entries > 1 and counts[-1] == 1 and frames_stts > 100 and \
            deltas[-1] * (frames_stts - 1) > 2 * (stts_ts - deltas[-1])
        simple = (b"mvex" not in top and stsz is not None and count == frames_stts > 0 and duration_ts > 0
                  and timescale > 0 and not outlier and 0 < min(deltas) <= max(deltas) < 1 << 31
                  and _plain_edit(moov, trak, stbl, timescale, duration_ts, top))
        end = _last_sample_end(moov, stbl, (fixed, count, stsz[0] + 12)) if stsz else None
        fps = Fraction(timescale * frames_stts, stts_ts) if stts_ts and timescale else Fraction(0)
        return MovVideo(duration_ts, timescale, count or frames_stts, fps, width, height, rotation, end, simple)
    return None


def _plain_edit(moov: bytes, trak: dict, stbl: dict, timescale: int, duration_ts: int, top: dict) -> bool:
    """No edit list, or one edit that keeps every frame: starting at 0 or at the first frame's
    composition offset (B-frame delay), at normal rate, lasting the whole track."""
    if b"edts" not in trak:
        return True
    elst = _children(moov, *trak[b"edts"]).get(b"elst")
    if elst is None:
        return True
    version = moov[elst[0]]
    (entries,) = struct.unpack_from(">I", moov, elst[0] + 4)
    if entries != 1:
        return False
    span, media_time, rate = struct.unpack_from(">QqI" if version == 1 else ">IiI", moov, elst[0] + 8)
    delay = 0
    if b"ctts" in stbl and struct.unpack_from(">I", moov, stbl[b"ctts"][0] + 4)[0]:
        delay = struct.unpack_from(">i", moov, stbl[b"ctts"][0] + 12)[0]
    (movie_scale,) = struct.unpack_from(">I", moov, _full_box_offset(moov, top[b"mvhd"][0], 12, 20)) \
        if b"mvhd" in top else (0,)
    covers = movie_scale > 0 and span * timescale >= (duration_ts - timescale / movie_scale) * movie_scale
    return rate == 0x10000 and media_time in (0, delay) and covers


def audio_track(moov: bytes) -> MovAudio | None:
    """The first audio track of a ``moov`` payload where FFmpeg reports it as stored: AAC-LC in an
    ``mp4a`` entry, ``mdhd`` time scale = the entry's and the configuration's sample rate, at most
    one edit, no fragments; None for anything else (PyAV then reads the file).

    Example:
        >>> audio_track(b"") is None
        True
    """
    try:
        return _audio_track(moov)
    except (struct.error, IndexError, KeyError, ValueError, ZeroDivisionError):
        return None


def _descriptor(data: bytes, pos: int) -> tuple[int, int, int]:
    """``(tag, payload_start, payload_end)`` of the MPEG-4 descriptor at ``pos`` (a 1-4 byte size)."""
    tag, size, pos = data[pos], 0, pos + 1
    for _ in range(4):
        byte = data[pos]
        size, pos = (size << 7) | (byte & 0x7F), pos + 1
        if not byte & 0x80:
            break
    return tag, pos, pos + size


def _aac_config(data: bytes, start: int, end: int) -> tuple[int, int] | None:
    """``(sample_rate, channels)`` of an ``esds`` box's AAC-LC AudioSpecificConfig (None: another codec)."""
    tag, pos, _ = _descriptor(data, start + 4)  # after version/flags: the ES descriptor
    if tag != 3:
        return None
    flags = data[pos + 2]
    pos += 3 + (2 if flags & 0x80 else 0) + (data[pos + 3] + 1 if flags & 0x40 else 0) + (2 if flags & 0x20 else 0)
    tag, pos, _ = _descriptor(data, pos)
    if tag != 4 or data[pos] != 0x40:  # DecoderConfigDescriptor of MPEG-4 audio
        return None
    tag, pos, stop = _descriptor(data, pos + 13)
    if tag != 5 or stop - pos < 2 or stop > end:
        return None
    bits = (data[pos] << 8) | data[pos + 1]
    kind, index, channels = bits >> 11, (bits >> 7) & 15, (bits >> 3) & 15
    if kind != 2 or index >= len(_AAC_RATES) or not 1 <= channels <= 6:
        return None
    return _AAC_RATES[index], channels


def _audio_track(moov: bytes) -> MovAudio | None:
    boxes, top = _top(moov)
    if b"mvex" in top:
        return None
    for trak, stbl, timescale, media_ts, counts, deltas in _tracks(moov, boxes, b"soun"):
        duration_ts = min(media_ts, sum(c * d for c, d in zip(counts, deltas)))
        entry = stbl[b"stsd"][0] + 8
        length, fourcc, version = struct.unpack_from(">I4s8xH", moov, entry)
        if fourcc != b"mp4a" or version != 0 or duration_ts <= 0 or timescale <= 0:
            return None
        (rate,) = struct.unpack_from(">I", moov, entry + 32)
        esds = _children(moov, entry + 36, entry + length).get(b"esds")
        config = _aac_config(moov, *esds) if esds else None
        if config is None or not config[0] == rate >> 16 == timescale:
            return None
        duration_ts = _edited_duration(moov, trak, timescale, duration_ts, top)
        return MovAudio(duration_ts, timescale, config[0], config[1]) if duration_ts else None
    return None


def _edited_duration(moov: bytes, trak: dict, timescale: int, duration_ts: int, top: dict) -> int | None:
    """FFmpeg's ``stream.duration`` of an audio track after its edit list (mov_fix_index): one edit
    at normal rate from ``media_time`` (an AAC encoder's priming samples, skipped) lasting ``span``
    movie ticks gives ``min(duration, rescale(span))``; None for anything else (several edits,
    an empty edit, another rate)."""
    elst = _children(moov, *trak[b"edts"]).get(b"elst") if b"edts" in trak else None
    if elst is None:
        return duration_ts
    (entries,) = struct.unpack_from(">I", moov, elst[0] + 4)
    (movie_scale,) = struct.unpack_from(">I", moov, _full_box_offset(moov, top[b"mvhd"][0], 12, 20)) \
        if b"mvhd" in top else (0,)
    if entries != 1 or movie_scale <= 0:
        return None
    span, media_time, rate = struct.unpack_from(">QqI" if moov[elst[0]] == 1 else ">IiI", moov, elst[0] + 8)
    if rate != 0x10000 or not 0 <= media_time < duration_ts or span <= 0:
        return None
    return min(duration_ts, (span * timescale + movie_scale // 2) // movie_scale)  # av_rescale_q, to nearest
