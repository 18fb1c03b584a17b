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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction

__all__ = ["MOV_DEMUXER", "MovVideo", "looks_like_mov", "normalize_rotation", "read_moov", "video_track"]

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


def read_moov(read: Callable[..., bytes], size: int, seek: Callable[[int], object] | None = None) -> bytes | None:
    """The ``moov`` box's payload of a file of ``size`` bytes (``read(n)`` after ``seek(offset)``), or None.

    ``seek`` may be omitted when ``read`` is ``read(n, offset)`` (``os.pread`` bound to a descriptor).
    """
    def read_at(offset: int, n: int) -> bytes:
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


def _boxes(data: bytes, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
    """``(type, payload_start, box_end)`` of the boxes in ``data[start:end]``."""
    pos = start
    while pos + 8 <= end:
        length, kind = struct.unpack_from(">I4s", data, pos)
        header = 8
        if length == 1 and pos + 16 <= end:
            length, header = struct.unpack_from(">Q", data, pos + 8)[0], 16
        elif length == 0:
            length = end - pos
        if length < header or pos + length > end:
            return
        yield kind, pos + header, pos + length
        pos += length


def _children(data: bytes, start: int, end: int) -> dict[bytes, tuple[int, int]]:
    found: dict[bytes, tuple[int, int]] = {}
    for kind, s, e in _boxes(data, start, end):
        found.setdefault(kind, (s, e))
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


def _video_track(moov: bytes) -> MovVideo | None:
    top = _children(moov, 0, len(moov))
    movie_at = _full_box_offset(moov, top[b"mvhd"][0], 36, 48) if b"mvhd" in top else None
    for kind, start, end in _boxes(moov, 0, len(moov)):
        if kind != b"trak":
            continue
        trak = _children(moov, start, end)
        mdia = _children(moov, *trak[b"mdia"]) if b"mdia" in trak else {}
        if b"hdlr" not in mdia or moov[mdia[b"hdlr"][0] + 8:mdia[b"hdlr"][0] + 12] != b"vide":
            continue
        s, _ = mdia[b"mdhd"]
        at = _full_box_offset(moov, s, 12, 20)
        timescale, media_ts = struct.unpack_from(">IQ" if moov[s] == 1 else ">II", moov, at)
        stbl = _children(moov, *_children(moov, *mdia[b"minf"])[b"stbl"])
        stts = stbl[b"stts"][0]
        (entries,) = struct.unpack_from(">I", moov, stts + 4)
        pairs = struct.unpack_from(f">{2 * entries}I", moov, stts + 8)
        counts, deltas = pairs[0::2], pairs[1::2]
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
