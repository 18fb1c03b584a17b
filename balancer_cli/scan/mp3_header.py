"""MP3 sample counts from the Xing/Info frame and its LAME tag, as libsndfile (mpg123) counts them.

:func:`mp3_frames` skips an ID3v2 tag, reads the first MPEG audio frame's header (Layer III:
sample rate, channels, samples per frame) and the Xing/Info header inside that frame: frames x
samples per frame minus the encoder delay and padding of the LAME tag, which is the gapless count
mpg123 (libsndfile's decoder) and a decode give. Files without that header (plain CBR files,
VBRI, other encoders' tags), or holding fewer bytes than it declares (a cut download), return
None and are left to libsndfile.

Example:
    >>> mp3_frames(lambda n, at: b"", 0, b"ID3") is None
    True
"""

from __future__ import annotations

import struct
from collections.abc import Callable

__all__ = ["mp3_frames"]

_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}  # by MPEG version
_ENCODERS = (b"LAME", b"Lavf", b"Lavc")  # LAME-tag writers: lame, FFmpeg (through libmp3lame)
_FRAMES, _BYTES, _TOC, _QUALITY = 1, 2, 4, 8


def mp3_frames(read: Callable[[int, int], bytes], size: int, head: bytes) -> tuple[int, int, int] | None:
    """``(frames, sample rate, channels)`` of an MP3 with a Xing/Info header and a LAME tag, or None.

    Args:
        read: ``read(n, offset)`` gives up to ``n`` bytes at ``offset`` (a large ID3v2 tag is skipped by it).
        size: the file's size; head: its first bytes.

    Example:
        >>> mp3_frames(lambda n, at: b"", 4, b"\\xff\\xfb\\x90\\x64") is None  # a frame header, no Xing frame
        True
    """
    try:
        return _mp3_frames(read, size, head)
    except (struct.error, IndexError, ValueError):
        return None


def _mp3_frames(read: Callable[[int, int], bytes], size: int, head: bytes) -> tuple[int, int, int] | None:
    start = 0
    if head[:3] == b"ID3":
        if len(head) < 10 or any(b & 0x80 for b in head[6:10]):
            return None
        tag = (head[6] << 21) | (head[7] << 14) | (head[8] << 7) | head[9]
        start = 10 + tag + (10 if head[5] & 0x10 else 0)  # a footer follows the tag
    frame = head[start:start + 200] if start + 200 <= len(head) else read(200, start)
    if len(frame) < 200 or frame[0] != 0xFF or frame[1] & 0xE0 != 0xE0:
        return None
    version, layer, crc = (frame[1] >> 3) & 3, (frame[1] >> 1) & 3, not frame[1] & 1
    rate_index, mode = (frame[2] >> 2) & 3, frame[3] >> 6
    if version == 1 or layer != 1 or rate_index == 3 or frame[2] >> 4 in (0, 15):
        return None  # reserved, not Layer III, or a free-format/bad bitrate
    rate, channels = _RATES[version][rate_index], 1 if mode == 3 else 2
    side = (32 if channels == 2 else 17) if version == 3 else (17 if channels == 2 else 9)
    at = 4 + side + (2 if crc else 0)
    if frame[at:at + 4] not in (b"Xing", b"Info"):
        return None
    (flags,) = struct.unpack_from(">I", frame, at + 4)
    if not (flags & _FRAMES and flags & _BYTES):
        return None
    frames, stream_bytes = struct.unpack_from(">II", frame, at + 8)
    lame = at + 16 + (100 if flags & _TOC else 0) + (4 if flags & _QUALITY else 0)
    if frame[lame:lame + 4] not in _ENCODERS or start + stream_bytes > size:
        return None  # no LAME tag (mpg123 would count otherwise), or a cut file
    delay = (frame[lame + 21] << 4) | (frame[lame + 22] >> 4)
    padding = ((frame[lame + 22] & 15) << 8) | frame[lame + 23]
    total = frames * (1152 if version == 3 else 576) - delay - padding
    return (total, rate, channels) if frames and total > 0 else None
