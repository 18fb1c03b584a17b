"""AVI video metadata from the RIFF ``hdrl`` list, as FFmpeg's avi demuxer reads it.

:func:`avi_video` reads the first video stream's ``strh`` (``dwScale``/``dwRate``, ``dwLength``)
and ``strf`` (the BITMAPINFOHEADER's size) from the ``hdrl`` list at the file's start: FFmpeg's
``stream.duration`` is ``dwLength`` in a time base of ``dwScale/dwRate``, ``average_rate`` its
inverse, the frame count ``dwLength``, the size ``biWidth x |biHeight|``. Anything FFmpeg would
derive otherwise (a cut file, whose duration it rescales by the bytes present; OpenDML files; no
scale, rate or length; a start offset; stream data, ``strd``; DV or AMV files) returns None and
is left to PyAV.

Example:
    >>> avi_video(lambda n, at: b"RIFF", 4) is None
    True
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from fractions import Fraction

__all__ = ["AVI_DEMUXER", "avi_video"]

#: FFmpeg's name of the demuxer (``container.format.name``).
AVI_DEMUXER = "avi"
_MAX_HDRL = 1 << 20  # a bigger header list goes to PyAV
_SUBTITLE_TAGS = (b"DXSB", b"DXSA")  # XSUB subtitles FFmpeg finds in "vids" streams


def _chunks(buf: bytes, start: int, end: int) -> list[tuple[bytes, int, int]]:
    """``(fourcc, data_start, data_end)`` of the RIFF chunks in ``buf[start:end]`` (cut ones dropped)."""
    out = []
    pos = start
    while pos + 8 <= end:
        kind, length = struct.unpack_from("<4sI", buf, pos)
        if pos + 8 + length > end:
            break
        out.append((kind, pos + 8, pos + 8 + length))
        pos += 8 + length + (length & 1)  # chunks are word-aligned
    return out


def avi_video(read: Callable[[int, int], bytes], size: int,
              head: bytes | None = None) -> tuple[float, float, int, int, int, int, str] | None:
    """``(seconds, fps, frames, width, height, rotation, container)`` of the first video stream as
    :func:`~balancer_cli.scan.media_header.read_video_info` reports it through PyAV, or None where
    PyAV must read the file.

    Args:
        read: ``read(n, offset)`` gives up to ``n`` bytes at ``offset``.
        size: the file's size in bytes; head: its first bytes, when already read.

    Example:
        >>> avi_video(lambda n, at: b"", 0) is None
        True
    """
    try:
        return _avi_video(read, size, head if head is not None else read(4096, 0))
    except (struct.error, IndexError, ValueError, ZeroDivisionError):
        return None


def _avi_video(read: Callable[[int, int], bytes], size: int,
               head: bytes) -> tuple[float, float, int, int, int, int, str] | None:
    if len(head) < 24 or head[:4] != b"RIFF" or head[8:12] != b"AVI " or head[12:16] != b"LIST":
        return None
    (riff,) = struct.unpack_from("<I", head, 4)
    if riff + 8 > size:  # a cut file: FFmpeg scales its duration by the bytes present
        return None
    if size - riff - 8 >= 12 and read(4, riff + 8) == b"RIFF":
        return None  # an OpenDML file (AVIX chunks follow): its frames outnumber the first header's count
    length, kind = struct.unpack_from("<I4s", head, 16)
    if kind != b"hdrl" or length > _MAX_HDRL:
        return None
    buf = head if 20 + length <= len(head) else read(20 + length, 0)
    if len(buf) < 20 + length:
        return None
    lists = [(buf[s:s + 4], s, e) for name, s, e in _chunks(buf, 24, 20 + length) if name == b"LIST"]
    if any(kind == b"odml" for kind, _, _ in lists):
        return None  # OpenDML: FFmpeg reads its super index
    for kind, start, end in lists:
        if kind != b"strl":
            continue
        parts = {}
        for part, s, e in _chunks(buf, start + 4, end):
            parts.setdefault(part, (s, e))
        strh = parts.get(b"strh")
        if strh is None or strh[1] - strh[0] < 48 or buf[strh[0]:strh[0] + 4] != b"vids":
            continue
        if b"strf" not in parts or b"strd" in parts:
            return None
        scale, rate, start_frame, frames = struct.unpack_from("<4I", buf, strh[0] + 20)
        s, e = parts[b"strf"]
        if e - s < 20 or not (0 < scale < 1 << 31 and 0 < rate < 1 << 31 and frames) or start_frame:
            return None
        width, height, _, compression = struct.unpack_from("<iiI4s", buf, s + 4)
        if compression in _SUBTITLE_TAGS or width <= 0 or not height:
            return None
        fps = Fraction(rate, scale)  # FFmpeg's avg_frame_rate: 1 / time base
        return float(Fraction(frames * scale, rate)), float(fps), frames, width, abs(height), 0, AVI_DEMUXER
    return None
