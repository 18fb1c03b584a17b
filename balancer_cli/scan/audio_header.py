"""FLAC and Ogg (Vorbis, Opus) sample counts from their headers, as libsndfile reports them.

:func:`flac_frames` reads ``STREAMINFO`` (the first metadata block: sample rate, channels, total
samples); :func:`ogg_frames` reads the identification header on the first page (sample rate,
channels, Opus pre-skip) and the granule position of the last page, found in the file's tail:
Vorbis ``frames = last granule``, Opus ``frames = (last granule - pre-skip) / (48000 / rate)``, the
counts ``soundfile.info`` (and a decode) gives. Each returns ``(frames, sample_rate, channels)`` or
None where libsndfile might count otherwise (an unknown total, ID3 tags before ``fLaC``, several
logical streams, a stream not starting at granule 0, trailing bytes after the last page, an Opus
input rate libsndfile does not decode at): the caller then asks libsndfile. Loops are bounded by
the bytes read.

Example:
    >>> streaminfo = bytes(7) + b"\\x00\\x00\\x10" + bytes([0x03, 0xE8, 0x00, 0xF0, 0, 0, 0x3E, 0x80]) + bytes(16)
    >>> head = b"fLaC" + bytes([0x80, 0, 0, 34]) + streaminfo
    >>> flac_frames(lambda n, at: b"", 42 + 16, head + bytes(16))
    (16000, 16000, 1)
    >>> ogg_frames(lambda n, at: b"", 0, b"OggS") is None
    True
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from balancer_cli.scan.mkv_header import EBML_MAGIC, MATROSKA_DEMUXER, mkv_audio
from balancer_cli.scan.mov_header import MOV_DEMUXER, audio_track, looks_like_mov, read_moov
from balancer_cli.scan.mp3_header import mp3_frames
from balancer_cli.scan.wav_header import WAV_HEAD_BYTES, wav_frames

__all__ = ["AUDIO_HEAD_BYTES", "FLAC_MAGIC", "OGG_MAGIC", "audio_from_header", "flac_frames", "ogg_frames"]

#: Bytes :func:`audio_from_header` reads first: the headers of most files of every kind.
AUDIO_HEAD_BYTES = max(WAV_HEAD_BYTES, 4096)

FLAC_MAGIC = b"fLaC"
OGG_MAGIC = b"OggS"
_TAIL_BYTES = 8192
_MAX_BLOCKS = 128  # metadata blocks walked to find where the frames start
_MAX_PAGE = 27 + 255 + 255 * 255  # the largest Ogg page
_OPUS_RATES = frozenset({8000, 12000, 16000, 24000, 48000})  # what libsndfile decodes Opus at
# Samples (at 48 kHz) of one Opus frame by TOC config (RFC 6716, 3.1): SILK 10/20/40/60 ms,
# hybrid 10/20 ms, CELT 2.5/5/10/20 ms.
_OPUS_FRAME = tuple([480, 960, 1920, 2880] * 3 + [480, 960] * 2 + [120, 240, 480, 960] * 4)
# Samples of a packet by TOC byte: one frame (code 0), two (1, 2); -1: code 3 counts them in byte 2.
_TOC_SAMPLES = tuple(-1 if toc & 3 == 3 else (1 if toc & 3 == 0 else 2) * _OPUS_FRAME[toc >> 3] for toc in range(256))


def flac_frames(read: Callable[[int, int], bytes], size: int, head: bytes) -> tuple[int, int, int] | None:
    """``(total samples, sample rate, channels)`` of a FLAC file of ``size`` bytes starting with
    ``head`` (None: not FLAC with a known total at the start, or cut before its first whole frame).

    Args:
        read: ``read(n, offset)`` gives up to ``n`` bytes at ``offset`` (block headers past the head).
        size: the file's size; head: its first bytes (at least 42).

    Example:
        >>> flac_frames(lambda n, at: b"", 4, b"fLaC") is None  # no STREAMINFO
        True
    """
    try:
        return _flac_frames(read, size, head)
    except (struct.error, IndexError, ValueError):
        return None


def _flac_frames(read: Callable[[int, int], bytes], size: int, head: bytes) -> tuple[int, int, int] | None:
    if len(head) < 42 or head[:4] != FLAC_MAGIC or head[4] & 0x7F != 0 or head[5:8] != b"\x00\x00\x22":
        return None
    max_frame, packed = struct.unpack_from(">IQ", head, 14)  # rate:20 channels-1:3 bits-1:5 samples:36
    rate, channels, total = packed >> 44, ((packed >> 41) & 7) + 1, packed & ((1 << 36) - 1)
    if not (total and rate and max_frame & 0xFFFFFF):
        return None
    # libsndfile decodes the first frame on opening: a file cut before its end fails there (and
    # PyAV then reads it): count only files that hold the metadata and one largest frame.
    pos, last = 4, False
    for _ in range(_MAX_BLOCKS):
        block = head[pos:pos + 4] if pos + 4 <= len(head) else read(4, pos)
        if len(block) < 4:
            return None
        last = block[0] & 0x80
        pos += 4 + int.from_bytes(block[1:4], "big")
        if last:
            break
    if not last or size - pos < max_frame & 0xFFFFFF:
        return None
    return total, rate, channels


def _page(buf: bytes, at: int) -> tuple[int, int, int, int, list[int]] | None:
    """``(header type, granule, serial, page end, packet sizes ending on it)`` of the page at ``at``."""
    if at + 27 > len(buf) or buf[at:at + 4] != OGG_MAGIC or buf[at + 4] != 0:
        return None
    kind, granule, serial = struct.unpack_from("<BqI", buf, at + 5)
    count = buf[at + 26]
    table = buf[at + 27:at + 27 + count]
    if len(table) < count:
        return None
    packets, run = [], 0
    for lace in table:
        run += lace
        if lace < 255:
            packets.append(run)
            run = 0
    return kind, granule, serial, at + 27 + count + sum(table), packets


def _last_page(read: Callable[[int, int], bytes], size: int) -> tuple[int, int] | None:
    """``(granule, serial)`` of the page that ends the file (None: the file does not end on a page)."""
    for span in (_TAIL_BYTES, _MAX_PAGE + 1):
        n = min(size, span)
        tail = read(n, size - n)
        if len(tail) != n:
            return None
        at = tail.rfind(OGG_MAGIC)
        while at >= 0:  # each step moves left: bounded by the tail's length
            page = _page(tail, at)
            if page is not None and page[3] == n:
                return page[1], page[2]
            at = tail.rfind(OGG_MAGIC, 0, at)
        if n == size:
            return None
    return None


def _opus_samples(packet: bytes, at: int) -> int:
    """Samples (48 kHz) of the Opus packet at ``packet[at:]``, from its TOC byte (RFC 6716, 3.1)."""
    samples = _TOC_SAMPLES[packet[at]]
    return samples if samples >= 0 else (packet[at + 1] & 0x3F) * _OPUS_FRAME[packet[at] >> 3]


def ogg_frames(read: Callable[[int, int], bytes], size: int, head: bytes) -> tuple[int, int, int] | None:
    """``(frames, sample rate, channels)`` of a single-stream Ogg Vorbis or Opus file of ``size``
    bytes whose first bytes are ``head`` (None: another Ogg, or one libsndfile might count otherwise).

    Args:
        read: ``read(n, offset)`` gives up to ``n`` bytes at ``offset`` (the tail is read).
        size: the file's size; head: its first bytes (a few kilobytes: the first two pages).

    Example:
        >>> ogg_frames(lambda n, at: b"", 4, b"OggS") is None  # a page magic, no page
        True
    """
    try:
        return _ogg_frames(read, size, head)
    except (struct.error, IndexError, ValueError):
        return None


def _ogg_frames(read: Callable[[int, int], bytes], size: int, head: bytes) -> tuple[int, int, int] | None:
    first = _page(head, 0)
    if first is None or first[0] != 2 or len(first[4]) != 1:  # BOS, one whole id packet
        return None
    _, _, serial, end, (id_size,) = first
    ident = head[28:28 + id_size]
    if ident[:7] == b"\x01vorbis" and len(ident) >= 30:
        version, channels, rate = struct.unpack_from("<IBI", ident, 7)
        preskip, factor, opus = 0, 1, False
        if version != 0 or not channels or not rate:
            return None
        largest = 1 << (ident[28] >> 4)  # blocksize_1
    elif ident[:8] == b"OpusHead" and len(ident) >= 19:
        channels, preskip, rate = struct.unpack_from("<BHI", ident, 9)
        if ident[8] >> 4 or not channels or rate not in _OPUS_RATES:
            return None
        factor, opus, largest = 48000 // rate, True, 0
    else:
        return None
    pos, audio = end, None
    for _ in range(8):  # the comment (and Vorbis setup) pages, then the first audio page
        page = _page(head, pos) if pos + 282 <= len(head) else None
        if page is None:  # the page's header is past the head: read it
            page = _page(read(282, pos), 0)
            if page is None:
                return None
            page = (*page[:3], page[3] + pos, page[4])
        kind, granule, page_serial, page_end, packets = page
        if page_serial != serial or kind & 2:
            return None  # another logical stream (chained or multiplexed)
        if granule > 0:
            audio = (granule, pos, page)
            break
        pos = page_end
    if audio is None:
        return None
    granule, at, (kind, _, _, _, packets) = audio
    if kind & 1:
        return None  # a packet continued from a header page: unusual
    if opus:  # the first audio page must start the stream at granule 0
        page_bytes = audio[2][3] - at
        buf = head if at + page_bytes <= len(head) else read(page_bytes, at)
        start = at if buf is head else 0
        body, bound = start + 27 + buf[start + 26], 0
        for n in packets:
            if n:
                bound += _opus_samples(buf, body) if n > 1 else _TOC_SAMPLES[buf[body]] if buf[body] & 3 != 3 else 0
            body += n
    else:
        bound = (len(packets) - 1) * largest // 2
    if granule > bound:
        return None
    last = _last_page(read, size)
    if last is None or last[1] != serial:
        return None
    samples = last[0] - preskip
    if samples <= 0 or samples % factor:
        return None
    return samples // factor, rate, channels


def audio_from_header(read: Callable[[int, int], bytes], size: int) -> tuple[int, int, int, str, str, float] | None:
    """``(frames, sample rate, channels, container, reader, seconds)`` of a WAV, FLAC, Ogg, MP3,
    Matroska/WebM or AAC m4a file by its header parser, with the container names libsndfile (PyAV,
    for Matroska and m4a) reports; None for anything those parsers leave to libsndfile/PyAV.

    Args:
        read: ``read(n, offset)`` gives up to ``n`` bytes at ``offset``; size: the file's size.

    Example:
        >>> import io, wave
        >>> buf = io.BytesIO()
        >>> with wave.open(buf, "wb") as w:
        ...     w.setnchannels(1); w.setsampwidth(2); w.setframerate(8000); w.writeframes(bytes(2 * 4000))
        >>> data = buf.getvalue()
        >>> audio_from_header(lambda n, at: data[at:at + n], len(data))
        (4000, 8000, 1, 'WAV', 'wav', 0.5)
    """
    head = read(AUDIO_HEAD_BYTES, 0)
    magic = head[:4]
    if magic == b"RIFF":
        found, fmt = wav_frames(head[:WAV_HEAD_BYTES], size), ("WAV", "wav")
    elif magic == FLAC_MAGIC:
        found, fmt = flac_frames(read, size, head), ("FLAC", "flac")
    elif magic == OGG_MAGIC:
        found, fmt = ogg_frames(read, size, head), ("OGG", "ogg")
    elif magic[:3] == b"ID3" or magic[:1] == b"\xff":
        found, fmt = mp3_frames(read, size, head), ("MP3", "mp3")
    elif magic == EBML_MAGIC:
        found = mkv_audio(read, size, head)
        return None if found is None else (*found[:3], MATROSKA_DEMUXER, "mkv", found[3])
    elif looks_like_mov(head):
        moov = read_moov(read, size, head=head)
        track = audio_track(moov) if moov is not None else None
        if track is None:
            return None
        seconds = track.duration_ts / track.timescale  # PyAV's float(stream.duration * time_base): the same
        return round(seconds * track.sample_rate), track.sample_rate, track.channels, MOV_DEMUXER, "mov", seconds
    else:
        return None
    if found is None:
        return None
    frames, rate, channels = found
    return frames, rate, channels, fmt[0], fmt[1], frames / rate if rate else 0.0  # rate 0: the caller's error
