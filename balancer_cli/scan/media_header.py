"""Video and audio metadata from container headers only: no frame or sample is ever decoded.

:func:`read_video_info`: mp4/mov from the ``moov`` box (:mod:`~balancer_cli.scan.mov_header`),
mkv/webm from the EBML header elements (:mod:`~balancer_cli.scan.mkv_header`), avi from the
``hdrl`` list (:mod:`~balancer_cli.scan.avi_header`), with FFmpeg's arithmetic and no package
needed; flv, mpeg-ts/ps, asf, ogg, and the files those parsers leave to FFmpeg (edit lists it
would apply, no ``Duration``...) through PyAV's stream metadata: duration in the stream's time base (else
the container's), the average frame rate, the frame count the container declares (else
``round(duration * fps)``, as for Matroska), the size, and the display rotation. PyAV's open runs
FFmpeg's probe with every video frame discarded (``skip_frame=all``), stopping after the first
packet (``probesize=32``) where the header says it all. A sample table past the end of the file
(a cut download) is an error.

:func:`read_audio_info`: PCM/float WAV from its chunk headers (:mod:`~balancer_cli.scan.wav_header`),
FLAC's ``STREAMINFO``, Ogg Vorbis/Opus pages, an MP3's Xing/LAME frame, Matroska/WebM audio
tracks and AAC m4a's ``moov`` box (:mod:`~balancer_cli.scan.audio_header`), each giving the
counts libsndfile (PyAV, for Matroska and m4a) gives; everything else libsndfile reads (aiff,
plain CBR mp3, what the parsers leave) by ``soundfile.info``, and the rest by PyAV.

Both take a path (a regular file only: a FIFO or device could block), the bytes, or a seekable
binary stream, and raise :class:`~balancer_cli.errors.SampleError` naming the file: ``missing_file``,
``corrupt_video``/``corrupt_audio`` (not media, truncated, no such stream, a zero, NaN or absurd
value), ``unsupported_video``/``unsupported_audio`` (another container), and
``missing_video_metadata``/``missing_audio_duration`` when the optional package it needs is absent.

Example:
    >>> import io, wave
    >>> buf = io.BytesIO()
    >>> with wave.open(buf, "wb") as w:
    ...     w.setnchannels(1); w.setsampwidth(2); w.setframerate(16000); w.writeframes(bytes(2 * 24000))
    >>> info = read_audio_info(buf.getvalue())
    >>> info.duration, info.sample_rate, info.num_samples
    (1.5, 16000, 24000)
    >>> read_video_info("no/such/clip.mp4")
    Traceback (most recent call last):
    ...
    balancer_cli.errors.SampleError: no/such/clip.mp4: video file not found; fix: check the media root / paths of the dataset
"""

from __future__ import annotations

import functools
import io
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO, Union

from balancer_cli.errors import SampleError
from balancer_cli.scan._sndfile import muted_stderr, sndfile_reason
from balancer_cli.scan.audio_header import AUDIO_HEAD_BYTES, audio_from_header
from balancer_cli.scan.avi_header import avi_video
from balancer_cli.scan.image_header import open_regular
from balancer_cli.scan.mkv_header import mkv_video
from balancer_cli.scan.mov_header import MOV_DEMUXER, looks_like_mov, normalize_rotation, read_moov, video_track

__all__ = ["AUDIO_DEMUXERS", "VIDEO_DEMUXERS", "AudioInfo", "MediaSource", "VideoInfo", "read_audio_info",
           "read_video_info"]

MediaSource = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, BinaryIO]

#: FFmpeg demuxers a video may come in (``format_whitelist``: nothing else is probed, so no
#: playlist or concat file can make FFmpeg open other files).
VIDEO_DEMUXERS = ("mov", "mp4", "matroska", "webm", "avi", "flv", "mpegts", "mpeg", "asf", "ogg")
#: FFmpeg demuxers of the PyAV fallback for audio (libsndfile reads wav/flac/ogg/mp3 first).
AUDIO_DEMUXERS = ("wav", "flac", "ogg", "mp3", "aac", "mov", "mp4", "m4a", "matroska", "webm", "asf", "aiff",
                  "caf", "w64")
# Values no real file has: a header declaring them is broken (or hostile).
_MAX_SECONDS = 1e6       # 11.6 days
_MAX_FPS = 10_000.0
_MIN_FPS = 0.01        # one frame per 100 s
_MAX_SIDE = 1 << 16
_MAX_SAMPLE_RATE = 10_000_000
_AV_TIME_BASE = 1_000_000
_PROBE = ({"probesize": "32"}, {})  # first packet only; then FFmpeg's default budget
# Containers whose header states rate, size and duration (mpeg-ts/ps, asf, ogg need packets: their
# first-packet guesses are off, e.g. 50 fps for 25 fps interlaced-capable streams).
_HEADER_FORMATS = frozenset({"mov", "matroska", "avi", "flv"})


@dataclass(frozen=True)
class VideoInfo:
    """A video stream's header metadata.

    Attributes:
        duration: seconds (stream time base, else the container's duration).
        fps: average frame rate (``stream.average_rate``, else the guessed or base rate).
        num_frames: frames the container declares, else ``round(duration * fps)``.
        width, height: the size decoders return: after a 90/270-degree rotation the sides swap
            (unless ``apply_rotation=False``, which gives the coded size).
        rotation: display rotation in degrees counter-clockwise (0, 90, -90, -180), as PyAV's
            ``VideoFrame.rotation`` and torchcodec's ``metadata.rotation`` report it.
        container: FFmpeg's demuxer name (``mov,mp4,m4a,3gp,3g2,mj2``, ``matroska,webm``, ``avi``...).
    """

    duration: float
    fps: float
    num_frames: int
    width: int
    height: int
    rotation: int = 0
    container: str = ""


@dataclass(frozen=True)
class AudioInfo:
    """An audio stream's header metadata: ``duration`` (s) = ``num_samples / sample_rate``."""

    duration: float
    sample_rate: int
    num_samples: int
    channels: int
    container: str = ""
    reader: str = ""  # a header parser ("wav", "flac", "ogg", "mp3", "mkv", "mov"), "soundfile" or "av"


class _Bad(Exception):
    """Internal: the header is unusable (becomes a corrupt_* SampleError)."""


def _import(module: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        return None


def _open_source(source: MediaSource, kind: str) -> tuple[Any, str, int, Callable[[int, int], bytes], int | None]:
    """``(what PyAV/soundfile open, name for messages, size in bytes, read(n, offset), descriptor to
    close)``; paths must be regular files (opened once: the header parsers ``pread`` that descriptor)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        return io.BytesIO(data), f"<{kind} bytes>", len(data), lambda n, at: data[at:at + n], None
    if hasattr(source, "read"):
        name = str(getattr(source, "name", f"<{kind} stream>"))
        size = source.seek(0, io.SEEK_END)
        source.seek(0)
        return source, name, size, lambda n, at: (source.seek(at), source.read(n))[1], None
    path = os.fspath(source)
    fd, info = open_regular(path, f"a {kind}", root="media", target="media")
    return path, path, info.st_size, functools.partial(os.pread, fd), fd


def _rewind(target: Any) -> Any:
    if hasattr(target, "seek"):
        target.seek(0)
    return target


def _av_open(av: Any, target: Any, demuxers: tuple[str, ...], probe: dict[str, str]) -> Any:
    options = {"format_whitelist": ",".join(demuxers), "protocol_whitelist": "file", **probe}
    return av.open(_rewind(target), "r", container_options=options, options={"skip_frame": "all"},
                   metadata_errors="replace")


def _av_failure(av: Any, exc: Exception, name: str, kind: str) -> SampleError:
    """The SampleError of a failed ``av.open`` (or stream read)."""
    if isinstance(exc, av.error.ArgumentError):  # EINVAL: the probed format is not on our list
        names = VIDEO_DEMUXERS if kind == "video" else AUDIO_DEMUXERS
        return SampleError(f"{name}: not {'an' if kind == 'audio' else 'a'} {kind} container this scan reads "
                           f"({', '.join(names)})",
                           kind=f"unsupported_{kind}", fix=f"convert the {kind} (e.g. to mp4), or drop the sample")
    if isinstance(exc, (av.error.PermissionError, av.error.FileNotFoundError)):
        return SampleError(f"{name}: cannot open {kind} ({exc})", kind="missing_file",
                           fix="check the file and its permissions")
    reason = getattr(exc, "strerror", None) or str(exc)
    return SampleError(f"{name}: corrupt or truncated {kind} header ({reason})", kind=f"corrupt_{kind}",
                       fix=f"re-encode or re-download the {kind}, or drop the sample")


def _finite(value: Any) -> float | None:
    return float(value) if value is not None and math.isfinite(float(value)) and float(value) > 0 else None


def _stream_seconds(stream: Any, container: Any) -> float | None:
    if stream.duration is not None and stream.time_base:
        seconds = _finite(stream.duration * stream.time_base)
        if seconds is not None:
            return seconds
    return _finite(container.duration / _AV_TIME_BASE) if container.duration is not None else None


def _check_truncation(stream: Any, size: int) -> None:
    entries = getattr(stream, "index_entries", None)  # PyAV >= 15
    if entries is not None and len(entries):
        _truncated(entries[len(entries) - 1].pos + max(entries[len(entries) - 1].size, 0), size)


def _moov(read: Callable[[int, int], bytes], size: int, head: bytes) -> bytes | None:
    """The ``moov`` box of an ISO-BMFF file (None for anything else), by a few small reads."""
    return read_moov(read, size, head=head) if looks_like_mov(head) else None


def _truncated(end: int | None, size: int) -> None:
    if end is not None and end > size:
        raise _Bad(f"file is truncated: its sample table reaches byte {end:,} of a {size:,}-byte file")


def _from_moov(moov: bytes | None, size: int) -> tuple[float, float, int, int, int, int, str] | None:
    """The values FFmpeg's mov demuxer gives, read from the ``moov`` box alone; None where FFmpeg
    would adjust them (then PyAV reads the file)."""
    track = video_track(moov) if moov is not None else None
    if track is None or not track.simple or not track.width or not track.height:
        return None
    _truncated(track.last_sample_end, size)
    # int / int is correctly rounded, as float(Fraction(...)) is: the same value, faster
    return (track.duration_ts / track.timescale, float(track.fps), track.frames, track.width,
            track.height, track.rotation, MOV_DEMUXER)


def _probe_video(av: Any, target: Any, size: int, moov: bytes | None) -> tuple[float, float, int, int, int, int, str]:
    """``(seconds, fps, frames, width, height, rotation, container)`` of the first video stream, by PyAV."""
    for probe in _PROBE:
        with _av_open(av, target, VIDEO_DEMUXERS, probe) as container:
            if not container.streams.video:
                raise _Bad("no video stream")
            stream = container.streams.video[0]
            fmt = container.format.name
            fps, seconds = _finite(stream.average_rate), _stream_seconds(stream, container)
            width, height, frames = stream.width or 0, stream.height or 0, int(stream.frames or 0)
            if probe is _PROBE[-1]:
                fps = fps or next((_finite(r) for r in (stream.guessed_rate, stream.base_rate) if _finite(r)), None)
            elif not (fps and seconds and width and height and fmt.split(",")[0] in _HEADER_FORMATS):
                continue  # the header alone does not say: let FFmpeg read packets (never decoding them)
            _check_truncation(stream, size)
            rotation = _rotate_tag(stream.metadata)
            break
    if not (width > 0 and height > 0):
        raise _Bad(f"video stream without a size ({width}x{height})")
    if seconds is None:
        raise _Bad("no duration in the stream or container header")
    if fps is None and frames > 0:
        fps = frames / seconds
    if fps is None:
        raise _Bad("no frame rate in the header")
    if frames <= 0:
        frames = round(seconds * fps)
    track = video_track(moov) if moov is not None and fmt == MOV_DEMUXER else None
    return seconds, fps, frames, width, height, track.rotation if track else rotation, fmt


def read_video_info(source: MediaSource, *, apply_rotation: bool = True) -> VideoInfo:
    """Duration, frame rate, frame count, size and rotation of a video, from its container header.

    mp4/mov files are read from their ``moov`` box (:mod:`~balancer_cli.scan.mov_header`), with
    FFmpeg's arithmetic and without PyAV; everything else, and mp4s whose edit list or tables
    FFmpeg would adjust, through PyAV.

    Args:
        source: a path (a regular file), the file's bytes, or a seekable binary stream.
        apply_rotation: report the size decoders that honour the display matrix return (torchcodec
            >= 0.11, FFmpeg's CLI: sides swapped for 90/270 degrees; default); False gives the
            coded size (decord, OpenCV, raw PyAV frames).

    Raises:
        SampleError: see the module docstring (kinds ``missing_file``, ``corrupt_video``,
            ``unsupported_video``, ``missing_video_metadata`` when PyAV is needed and not installed).

    Example:
        >>> import tempfile
        >>> read_video_info(tempfile.gettempdir())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        balancer_cli.errors.SampleError: ...: is a directory, not a video file; fix: point the record at the media file itself
    """
    target, name, size, read, fd = _open_source(source, "video")
    av = None
    try:
        head = read(AUDIO_HEAD_BYTES, 0)
        moov = _moov(read, size, head)
        values = _from_moov(moov, size) if moov is not None else mkv_video(read, size, head) or avi_video(
            read, size, head)
        if values is None:
            av = _import("av")
            if av is None:
                raise SampleError(f"{name}: reading this video's duration from its file needs PyAV, which is not "
                                  "installed", kind="missing_video_metadata",
                                  fix="pip install av (or give the records duration/num_frames fields)")
            values = _probe_video(av, target, size, moov)
    except _Bad as exc:
        raise SampleError(f"{name}: unusable video header ({exc})", kind="corrupt_video",
                          fix="re-encode or re-download the video, or drop the sample") from None
    except (OSError, EOFError, ValueError) as exc:  # PyAV's errors derive from these
        if av is None:
            raise SampleError(f"{name}: cannot read video ({exc})", kind="missing_file",
                              fix="check the file and its permissions") from None
        raise _av_failure(av, exc, name, "video") from None
    finally:
        if fd is not None:
            os.close(fd)
    seconds, fps, frames, width, height, rotation, fmt = values
    if (seconds > _MAX_SECONDS or not _MIN_FPS <= fps <= _MAX_FPS or frames > _MAX_SECONDS * _MAX_FPS
            or max(width, height) > _MAX_SIDE):
        raise SampleError(f"{name}: video header declares absurd values ({seconds:g} s, {fps:g} fps, {frames} frames, "
                          f"{width}x{height})", kind="corrupt_video", fix="re-encode the video, or drop the sample")
    if apply_rotation and rotation % 180:
        width, height = height, width
    return VideoInfo(seconds, fps, frames, width, height, rotation, fmt)


def _rotate_tag(metadata: dict[str, str]) -> int:
    try:
        return normalize_rotation(-float(metadata.get("rotate", 0)))  # the tag is clockwise
    except ValueError:
        return 0


def _probe_audio(av: Any, target: Any) -> tuple[float | None, int, int, str]:
    """``(seconds, sample_rate, channels, container)`` of the first audio stream, through PyAV."""
    for probe in _PROBE:
        with _av_open(av, target, AUDIO_DEMUXERS, probe) as container:
            if not container.streams.audio:
                raise _Bad("no audio stream")
            stream = container.streams.audio[0]
            context = stream.codec_context
            rate = int(getattr(context, "sample_rate", 0) or 0)
            seconds = _stream_seconds(stream, container)
            if rate and seconds and container.format.name.split(",")[0] in _HEADER_FORMATS or probe is _PROBE[-1]:
                return seconds, rate, int(getattr(context, "channels", 0) or 0), container.format.name
    raise AssertionError("unreachable")


def read_audio_info(source: MediaSource) -> AudioInfo:
    """Duration and sample rate of an audio clip from its header: a header parser, else libsndfile, else PyAV.

    Args:
        source: a path (a regular file), the file's bytes, or a seekable binary stream.

    Raises:
        SampleError: see the module docstring (kinds ``missing_file``, ``corrupt_audio``,
            ``unsupported_audio``, ``missing_audio_duration`` when neither soundfile nor PyAV is
            installed).

    Example:
        >>> read_audio_info("no/such/clip.wav")
        Traceback (most recent call last):
        ...
        balancer_cli.errors.SampleError: no/such/clip.wav: audio file not found; fix: check the media root / paths of the dataset
    """
    target, name, size, read, fd = _open_source(source, "audio")
    try:
        native = audio_from_header(read, size)
    except OSError as exc:
        raise SampleError(f"{name}: cannot read audio ({exc})", kind="missing_file",
                          fix="check the file and its permissions") from None
    finally:
        if fd is not None:
            os.close(fd)
    if native is not None:
        frames, rate, channels, fmt, reader, seconds = native
        return _checked_audio(name, seconds, rate, frames, channels, fmt, reader)
    sf, av = _import("soundfile"), _import("av")
    if sf is None and av is None:
        raise SampleError(f"{name}: reading an audio clip's duration from its file needs soundfile or PyAV, "
                          "neither of which is installed", kind="missing_audio_duration",
                          fix="pip install soundfile av (or give the records a duration field)")
    reason = None
    if sf is not None:
        try:
            with muted_stderr():  # libmpg123 warns on fd 2 (_sndfile)
                info = sf.info(_rewind(target))
        except (RuntimeError, TypeError, ValueError, OSError) as exc:  # LibsndfileError is a RuntimeError
            reason = sndfile_reason(exc)
        else:
            return _checked_audio(name, info.frames / info.samplerate if info.samplerate > 0 else None,
                                  info.samplerate, info.frames, info.channels, info.format, "soundfile")
    if av is None:
        raise SampleError(f"{name}: libsndfile cannot read this audio ({reason})", kind="unsupported_audio",
                          fix="pip install av (reads m4a/aac/webm audio), or convert the clip to wav/flac")
    try:
        seconds, rate, channels, fmt = _probe_audio(av, target)
    except _Bad as exc:
        raise SampleError(f"{name}: unusable audio header ({exc})", kind="corrupt_audio",
                          fix="re-encode or re-download the clip, or drop the sample") from None
    except (av.error.FFmpegError, OSError, EOFError, ValueError) as exc:
        failure = _av_failure(av, exc, name, "audio")
        if reason is not None and failure.kind == "corrupt_audio":
            failure = SampleError(f"{failure.message[:-1]}; libsndfile: {reason})", kind=failure.kind,
                                  fix=failure.fix)
        raise failure from None
    samples = round(seconds * rate) if seconds is not None and rate > 0 else 0
    return _checked_audio(name, seconds, rate, samples, channels, fmt, "av")


def _checked_audio(name: str, seconds: float | None, rate: int, samples: int, channels: int, fmt: str,
                   reader: str) -> AudioInfo:
    if not 0 < rate <= _MAX_SAMPLE_RATE:
        raise SampleError(f"{name}: audio header declares a sample rate of {rate}", kind="corrupt_audio",
                          fix="re-encode the clip, or drop the sample")
    if seconds is None or not math.isfinite(seconds) or seconds <= 0 or samples <= 0:
        raise SampleError(f"{name}: audio header declares no samples (duration {seconds})", kind="corrupt_audio",
                          fix="re-encode or re-download the clip, or drop the sample")
    if seconds > _MAX_SECONDS:
        raise SampleError(f"{name}: audio header declares an absurd duration of {seconds:g} s", kind="corrupt_audio",
                          fix="re-encode the clip, or drop the sample")
    return AudioInfo(seconds, int(rate), int(samples), int(channels), fmt, reader)

