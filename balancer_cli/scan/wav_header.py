"""WAV (RIFF/WAVE, PCM or float) frame count and sample rate from the first chunk headers.

:func:`wav_frames` walks the RIFF chunks to ``fmt `` and ``data`` in the file's first bytes and
returns what libsndfile reports for the same file: ``frames = data bytes // block_align``, the
data bytes capped by what the file holds (a cut download counts the frames it still has). Anything
else (compressed formats such as ADPCM, RF64, RIFX, chunks beyond the bytes given) returns None
and is left to libsndfile.

Example:
    >>> import io, wave
    >>> buf = io.BytesIO()
    >>> with wave.open(buf, "wb") as w:
    ...     w.setnchannels(2); w.setsampwidth(2); w.setframerate(8000); w.writeframes(bytes(4 * 100))
    >>> data = buf.getvalue()
    >>> wav_frames(data[:64], len(data)), wav_frames(data[:64], len(data) - 41)
    ((100, 8000, 2), (89, 8000, 2))
"""

from __future__ import annotations

import struct

__all__ = ["WAV_HEAD_BYTES", "wav_frames"]

#: Bytes to read for :func:`wav_frames` (``fmt `` and ``data`` follow the RIFF header in WAVs that
#: encoders write; LIST/INFO chunks before ``data`` fit too).
WAV_HEAD_BYTES = 4096
_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE


def wav_frames(head: bytes, size: int) -> tuple[int, int, int] | None:
    """``(frames, sample_rate, channels)`` of a PCM/float WAV of ``size`` bytes starting with ``head``.

    Returns None when ``head`` is not such a WAV or does not reach its ``data`` chunk.
    """
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    pos, fmt = 12, None
    while pos + 8 <= len(head):
        kind, length = struct.unpack_from("<4sI", head, pos)
        body = pos + 8
        if kind == b"fmt ":
            if length < 16 or body + length > len(head):
                return None
            tag, channels, rate, _, align, bits = struct.unpack_from("<HHIIHH", head, body)
            if tag == _EXTENSIBLE and length >= 26:
                (tag,) = struct.unpack_from("<H", head, body + 24)  # the sub-format GUID's first bytes
            if tag not in (_PCM, _FLOAT) or not channels or not align or align != channels * ((bits + 7) // 8):
                return None
            fmt = (rate, channels, align)
        elif kind == b"data":
            if fmt is None:
                return None
            if length in (0, 0xFFFFFFFF):  # a streamed WAV's unknown length: libsndfile guesses
                return None
            rate, channels, align = fmt
            return min(length, max(size - body, 0)) // align, rate, channels
        pos = body + length + (length & 1)  # chunks are word-aligned
    return None
