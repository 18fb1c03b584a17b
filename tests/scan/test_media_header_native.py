"""The pure-Python header parsers (Matroska/WebM video and audio, AVI, FLAC, Ogg Vorbis/Opus,
MP3, AAC m4a) give what the PyAV/libsndfile path gives, on many encoded variants, cut files and
seekable windows; unusual files go to that path; random and truncated bytes give a value or a
SampleError, nothing else."""

from __future__ import annotations

import io
import os
import struct
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from balancer_cli.errors import SampleError
from balancer_cli.scan import media_header
from balancer_cli.scan.audio_header import audio_from_header, flac_frames, ogg_frames
from balancer_cli.scan.avi_header import avi_video
from balancer_cli.scan.media_header import read_audio_info, read_video_info
from balancer_cli.scan.mkv_header import av_reduce, mkv_video
from balancer_cli.scan.mov_header import audio_track, video_track

av = pytest.importorskip("av")
sf = pytest.importorskip("soundfile")
from media_util import encode_video, finish  # noqa: E402


class Window(io.RawIOBase):
    """A seekable read-only view of ``length`` bytes at ``start`` of another file (a tar member)."""

    def __init__(self, fp, start: int, length: int) -> None:
        self.fp, self.start, self.length, self.pos = fp, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = max(0, offset + (0, self.pos, self.length)[whence])
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        self.fp.seek(self.start + self.pos)
        data = self.fp.read(n)
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


def _windowed(tmp_path: Path, path: Path):
    """``path``'s bytes inside a bigger file, as a :class:`Window` (closed by the caller)."""
    big = tmp_path / f"{path.name}.tar"
    big.write_bytes(b"x" * 1000 + path.read_bytes() + b"y" * 777)
    return Window(open(big, "rb"), 1000, path.stat().st_size)


def _old(reader, source, monkeypatch):
    """What ``reader`` gave before these parsers: PyAV/libsndfile (WAV and mp4/mov video as before)."""
    with monkeypatch.context() as patch:
        patch.setattr(media_header, "mkv_video", lambda *args: None)
        patch.setattr(media_header, "avi_video", lambda *args: None)
        real = media_header.audio_from_header

        def wav_only(read, size):
            got = real(read, size)
            return got if got and got[4] == "wav" else None

        patch.setattr(media_header, "audio_from_header", wav_only)
        return _outcome(reader, source)


def _outcome(reader, source):
    try:
        info = reader(source)
    except SampleError as exc:
        return exc.kind
    if reader is read_video_info:
        return info.duration, info.fps, info.num_frames, info.width, info.height, info.rotation, info.container
    return info.duration, info.sample_rate, info.num_samples, info.channels


def _read_of(path: Path):
    data = path.read_bytes()
    return (lambda n, at: data[at:at + n]), len(data), data


def _video(path: Path, codec: str, rate: Fraction, frames: int, width: int = 32, height: int = 24) -> Path:
    encode_video(path, codec, rate, frames, width, height)
    return path


MKV_CASES = [(Fraction(30000, 1001), 10, 32, 24), (Fraction(25), 1, 34, 18), (Fraction(24), 7, 64, 48),
             (Fraction(60), 3, 32, 24), (Fraction(2), 4, 48, 16), (Fraction(24000, 1001), 5, 32, 24),
             (Fraction(60000, 1001), 6, 32, 24)]


@pytest.mark.parametrize("codec,ext", [("libx264", "mkv"), ("libvpx", "webm"), ("libvpx-vp9", "webm"),
                                       ("mpeg4", "mkv"), ("mjpeg", "mkv")])
def test_matroska_elements_give_pyavs_values(tmp_path, monkeypatch, codec, ext):
    for i, (rate, frames, width, height) in enumerate(MKV_CASES):
        path = _video(tmp_path / f"{i}.{ext}", codec, rate, frames, width, height)
        read, size, data = _read_of(path)
        native = mkv_video(read, size)
        assert native is not None, path  # read without PyAV
        assert native == _old(read_video_info, path, monkeypatch)
        info = read_video_info(path)
        assert native == _outcome(read_video_info, path) == _outcome(read_video_info, data)
        assert (info.num_frames, info.width, info.height, info.container) == (frames, width, height, "matroska,webm")
        assert info.fps == float(rate) or rate.numerator > 30000  # FFmpeg's av_reduce(..., 30000)
        with _windowed(tmp_path, path) as window:
            assert read_video_info(window) == info


def test_unusual_matroska_goes_to_pyav(tmp_path, monkeypatch):
    data = _video(tmp_path / "v.mkv", "libx264", Fraction(25), 10).read_bytes()
    at = data.index(b"\x44\x89")  # Duration: ID, size 0x88, an 8-byte float
    assert data[at + 2] == 0x88
    no_duration = data[:at] + b"\xec\x89" + bytes(9) + data[at + 11:]  # the same bytes as a Void element
    segment = data.index(b"\x18\x53\x80\x67") + 4
    live = data[:segment] + b"\x01" + b"\xff" * 7 + data[segment + 8:]  # an unknown-size segment
    half = data[:len(data) // 2]
    at = data.index(b"\x23\xe3\x83\x84")  # DefaultDuration: ID, size 0x84, 4 bytes
    no_rate = data[:at] + b"\xec\x86" + bytes(6) + data[at + 8:]
    for name, broken in (("no_duration", no_duration), ("live", live), ("half", half), ("no_rate", no_rate)):
        assert len(broken) == len(data) or name == "half"
        assert mkv_video(lambda n, pos, data=broken: data[pos:pos + n], len(broken)) is None, name
        path = tmp_path / f"{name}.mkv"
        path.write_bytes(broken)
        assert _outcome(read_video_info, path) == _old(read_video_info, path, monkeypatch), name


@pytest.mark.parametrize("codec", ["mpeg4", "mjpeg", "libx264"])
def test_avi_headers_give_pyavs_values(tmp_path, monkeypatch, codec):
    for i, (rate, frames, width, height) in enumerate(MKV_CASES):
        path = _video(tmp_path / f"{i}.avi", codec, rate, frames, width, height)
        read, size, data = _read_of(path)
        native = avi_video(read, size)
        assert native is not None, path
        assert native == _old(read_video_info, path, monkeypatch) == _outcome(read_video_info, data)
        assert native[1:5] == (float(rate), frames, width, height)
        with _windowed(tmp_path, path) as window:
            assert _outcome(read_video_info, window) == native


def test_unusual_avi_goes_to_pyav(tmp_path, monkeypatch):
    data = _video(tmp_path / "v.avi", "mpeg4", Fraction(10), 20).read_bytes()
    at = data.index(b"strh") + 8 + 32  # dwLength
    no_length = data[:at] + bytes(4) + data[at + 4:]
    for name, broken in (("cut", data[:len(data) * 2 // 3]), ("no_length", no_length)):
        assert avi_video(lambda n, pos, data=broken: data[pos:pos + n], len(broken)) is None, name
        path = tmp_path / f"{name}.avi"
        path.write_bytes(broken)
        assert _outcome(read_video_info, path) == _old(read_video_info, path, monkeypatch), name


def test_av_reduce_is_ffmpegs():
    assert av_reduce(1_000_000_000, 33_366_667, 30_000) == (30000, 1001)
    assert av_reduce(1_000_000_000, 41_708_333, 30_000) == (24000, 1001)
    assert av_reduce(1_000_000_000, 16_683_333, 30_000) == (19001, 317)  # 60000/1001 is over the limit
    assert av_reduce(1_000_000_000, 40_000_000, 30_000) == (25, 1)
    assert av_reduce(1_000_000_000, 3, 30_000) == (30000, 1)  # clamped to the limit


def _sound(path: Path, samples: int, rate: int, channels: int, **kwargs) -> Path:
    tone = (0.3 * np.sin(np.arange(samples * channels) / 7.0)).reshape(samples, channels).astype(np.float32)
    sf.write(path, tone, rate, **kwargs)
    return path


def _aac(path: Path, samples: int, rate: int, channels: int, pts: bool = False) -> Path:
    """An AAC file; with ``pts`` FFmpeg's muxer writes an edit list skipping the encoder's priming."""
    out = av.open(str(path), "w")
    stream = out.add_stream("aac", rate=rate)
    stream.layout = "mono" if channels == 1 else "stereo"
    tone = np.tile((0.3 * np.sin(np.arange(samples) / 7.0)).astype(np.float32), (channels, 1))
    for start in range(0, samples, 1024):
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(tone[:, start:start + 1024]), format="fltp",
                                           layout=stream.layout.name)
        frame.sample_rate = rate
        if pts:
            frame.pts = start
        for packet in stream.encode(frame):
            out.mux(packet)
    finish(out, stream)
    return path


def _check_audio(tmp_path: Path, path: Path, monkeypatch, reader: str) -> None:
    read, size, data = _read_of(path)
    native = audio_from_header(read, size)
    assert native is not None and native[4] == reader, path
    old = _old(read_audio_info, path, monkeypatch)
    assert _outcome(read_audio_info, path) == _outcome(read_audio_info, data) == old, path
    if reader != "mov":
        info = sf.info(path)
        assert native[:3] == (info.frames, info.samplerate, info.channels)
    with _windowed(tmp_path, path) as window:
        assert _outcome(read_audio_info, window) == old
    for cut in (size - 1, size // 2, size // 5, 60):  # cut downloads: whatever the old path said
        part = tmp_path / f"cut{path.suffix}"
        part.write_bytes(data[:cut])
        assert _outcome(read_audio_info, part) == _old(read_audio_info, part, monkeypatch), (path, cut)


@pytest.mark.parametrize("subtype", ["PCM_16", "PCM_24"])
def test_flac_streaminfo_gives_libsndfiles_count(tmp_path, monkeypatch, subtype):
    for rate, channels, samples in ((8000, 1, 100), (11025, 2, 24037), (16000, 1, 16000), (22050, 2, 5000),
                                    (44100, 1, 44101), (48000, 2, 1), (96000, 1, 30000)):
        path = _sound(tmp_path / f"{rate}.flac", samples, rate, channels, subtype=subtype)
        _check_audio(tmp_path, path, monkeypatch, "flac")
    if "flac" in av.codecs_available:  # FFmpeg's FLAC muxer too
        out = av.open(str(tmp_path / "ff.flac"), "w")
        stream = out.add_stream("flac", rate=16000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 5000), np.int16), format="s16", layout="mono")
        frame.sample_rate = 16000
        for packet in [*stream.encode(frame), *stream.encode()]:
            out.mux(packet)
        out.close()
        _check_audio(tmp_path, tmp_path / "ff.flac", monkeypatch, "flac")


@pytest.mark.parametrize("subtype,rates", [("VORBIS", (8000, 11025, 16000, 22050, 44100, 48000)),
                                           ("OPUS", (8000, 12000, 16000, 24000, 48000))])
def test_ogg_pages_give_libsndfiles_count(tmp_path, monkeypatch, subtype, rates):
    for rate in rates:
        for channels, samples in ((1, 24037), (2, 777), (1, 100_000)):
            path = _sound(tmp_path / f"{rate}-{channels}-{samples}.ogg", samples, rate, channels, format="OGG",
                          subtype=subtype)
            _check_audio(tmp_path, path, monkeypatch, "ogg")


def test_opus_by_ffmpeg_and_other_ogg(tmp_path, monkeypatch):
    if "libopus" in av.codecs_available:
        out = av.open(str(tmp_path / "ff.opus"), "w", format="ogg")
        stream = out.add_stream("libopus", rate=48000)
        stream.layout = "mono"
        for start in range(0, 30000, 960):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 960), np.float32), format="flt", layout="mono")
            frame.sample_rate, frame.pts = 48000, start
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
        out.close()
        path = tmp_path / "ff.opus"
        read, size, _ = _read_of(path)
        assert audio_from_header(read, size) is not None
        assert _outcome(read_audio_info, path) == _old(read_audio_info, path, monkeypatch)
    # two logical streams, one after the other (a chained file): libsndfile decides
    one = _sound(tmp_path / "one.ogg", 5000, 16000, 1, format="OGG", subtype="VORBIS").read_bytes()
    chained = tmp_path / "chained.ogg"
    chained.write_bytes(one + one.replace(struct.pack("<I", struct.unpack_from("<I", one, 14)[0]), b"\x01\x02\x03\x04"))
    assert ogg_frames(*_read_of(chained)[:2], chained.read_bytes()[:4096]) is None
    assert _outcome(read_audio_info, chained) == _old(read_audio_info, chained, monkeypatch)


def _lame(path: Path, samples: int, rate: int, channels: int, vbr: bool) -> Path:
    if "libmp3lame" not in av.codecs_available:
        pytest.skip("PyAV has no libmp3lame encoder here")
    out = av.open(str(path), "w")
    stream = out.add_stream("libmp3lame", rate=rate)
    stream.layout = "mono" if channels == 1 else "stereo"
    if vbr:
        stream.codec_context.qscale = 4
        stream.codec_context.flags |= av.codec.context.Flags.qscale
    tone = np.tile((0.3 * np.sin(np.arange(samples) / 7.0)).astype(np.float32), (channels, 1))
    for start in range(0, samples, 1152):
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(tone[:, start:start + 1152]), format="fltp",
                                           layout=stream.layout.name)
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            out.mux(packet)
    finish(out, stream)
    return path


@pytest.mark.parametrize("vbr", [False, True])
def test_mp3_xing_and_lame_tags_give_libsndfiles_count(tmp_path, monkeypatch, vbr):
    for rate, channels, samples in ((8000, 1, 100), (11025, 2, 5000), (16000, 1, 24037), (22050, 1, 30000),
                                    (32000, 2, 777), (44100, 2, 44100), (48000, 1, 1153)):
        path = _lame(tmp_path / f"{rate}-{channels}.mp3", samples, rate, channels, vbr)
        _check_audio(tmp_path, path, monkeypatch, "mp3")
    if "MP3" in sf.available_formats():  # libsndfile's own (lame) encoder
        for rate, channels in ((16000, 1), (44100, 2)):
            path = _sound(tmp_path / f"sf{rate}.mp3", 20000, rate, channels, format="MP3")
            _check_audio(tmp_path, path, monkeypatch, "mp3")


def test_mp3_without_a_xing_header_goes_to_libsndfile(tmp_path, monkeypatch):
    data = _lame(tmp_path / "a.mp3", 24037, 16000, 1, False).read_bytes()
    plain = tmp_path / "plain.mp3"
    plain.write_bytes(data.replace(b"Info", b"Nope", 1))
    read, size, _ = _read_of(plain)
    assert audio_from_header(read, size) is None
    assert _outcome(read_audio_info, plain) == _old(read_audio_info, plain, monkeypatch)


@pytest.mark.parametrize("pts", [False, True])
def test_aac_m4a_from_the_moov_box(tmp_path, monkeypatch, pts):
    for rate in (8000, 16000, 22050, 44100, 48000):
        for channels, samples in ((1, 24037), (2, 1024), (2, 100)):
            path = _aac(tmp_path / f"{rate}-{channels}-{samples}.m4a", samples, rate, channels, pts)
            _check_audio(tmp_path, path, monkeypatch, "mov")
    if pts:  # the priming skip: FFmpeg's duration is the edit's, shorter than the samples stored
        data = path.read_bytes()
        assert data.find(b"elst") > 0 and struct.unpack_from(">i", data, data.index(b"elst") + 16)[0] == 1024


def _mka(path: Path, codec: str, samples: int, rate: int, channels: int) -> Path:
    if codec not in av.codecs_available:
        pytest.skip(f"PyAV has no {codec} encoder here")
    out = av.open(str(path), "w")
    stream = out.add_stream(codec, rate=rate)
    stream.layout = "mono" if channels == 1 else "stereo"
    fmt = stream.codec_context.codec.audio_formats[0].name
    step = stream.codec_context.frame_size or 1024
    kind = np.float32 if "flt" in fmt else np.int16 if "s16" in fmt else np.int32
    for start in range(0, samples, step):
        n = min(step, samples - start)
        frame = av.AudioFrame.from_ndarray(np.zeros((channels, n) if fmt.endswith("p") else (1, n * channels), kind),
                                           format=fmt, layout=stream.layout.name)
        frame.sample_rate, frame.pts = rate, start
        for packet in stream.encode(frame):
            out.mux(packet)
    finish(out, stream)
    return path


@pytest.mark.parametrize("codec,ext,rate,channels,native", [
    ("libopus", "webm", 48000, 1, True), ("libopus", "webm", 48000, 2, True), ("flac", "mka", 22050, 2, True),
    ("flac", "mka", 96000, 1, True), ("pcm_s16le", "mka", 8000, 1, True), ("libmp3lame", "mka", 16000, 1, True),
    ("aac", "mkv", 44100, 1, False), ("libopus", "webm", 16000, 1, False)])
def test_matroska_audio_gives_pyavs_values(tmp_path, monkeypatch, codec, ext, rate, channels, native):
    for samples in (999, 24037):
        path = _mka(tmp_path / f"{samples}.{ext}", codec, samples, rate, channels)
        read, size, data = _read_of(path)
        got = audio_from_header(read, size)
        assert (got is not None) == native, path
        old = _old(read_audio_info, path, monkeypatch)
        assert _outcome(read_audio_info, path) == _outcome(read_audio_info, data) == old
        with _windowed(tmp_path, path) as window:
            assert _outcome(read_audio_info, window) == old


def test_an_mp4_with_video_and_sound(tmp_path, monkeypatch):
    path = tmp_path / "av.mp4"
    out = av.open(str(path), "w")
    video = out.add_stream("mpeg4", rate=10)
    video.width, video.height, video.pix_fmt = 32, 24, "yuv420p"
    sound = out.add_stream("aac", rate=16000)
    sound.layout = "mono"
    for i in range(10):
        for packet in video.encode(av.VideoFrame.from_ndarray(np.zeros((24, 32, 3), np.uint8), format="rgb24")):
            out.mux(packet)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1600), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 16000
        for packet in sound.encode(frame):
            out.mux(packet)
    for packet in [*video.encode(), *sound.encode()]:
        out.mux(packet)
    out.close()
    read, size, _ = _read_of(path)
    assert audio_from_header(read, size) is not None
    assert _outcome(read_audio_info, path) == _old(read_audio_info, path, monkeypatch)
    assert read_video_info(path).num_frames == 10


_MAGICS = [b"\x1a\x45\xdf\xa3", b"fLaC", b"OggS", b"\x00\x00\x00\x18ftyp", b"RIFF", b"RIFF\x00\x01\x00\x00AVI LIST",
           b"ID3\x04\x00\x00\x00\x00\x00\x00", b"\xff\xfb\x90\x64"]


@pytest.fixture(scope="module")
def real_files(tmp_path_factory) -> list[bytes]:
    folder = tmp_path_factory.mktemp("real")
    files = [_video(folder / "v.mkv", "libx264", Fraction(25), 3), _video(folder / "v.webm", "libvpx", Fraction(10), 2),
             _video(folder / "v.avi", "mpeg4", Fraction(10), 3),
             _sound(folder / "a.flac", 3000, 16000, 1), _aac(folder / "a.m4a", 3000, 16000, 1),
             _sound(folder / "a.ogg", 3000, 16000, 1, format="OGG", subtype="VORBIS"),
             _sound(folder / "o.ogg", 3000, 16000, 1, format="OGG", subtype="OPUS"),
             _lame(folder / "a.mp3", 3000, 16000, 1, True)]
    return [p.read_bytes() for p in files]


def _parsers_answer_or_refuse(data: bytes) -> None:
    def read(n: int, at: int) -> bytes:
        return data[at:at + n]

    head = data[:4096]
    for result in (mkv_video(read, len(data)), avi_video(read, len(data)), flac_frames(read, len(data), head),
                   ogg_frames(read, len(data), head), audio_from_header(read, len(data)), audio_track(data),
                   video_track(data)):
        assert result is None or isinstance(result, tuple) or hasattr(result, "timescale")
    for reader in (read_video_info, read_audio_info):
        try:
            reader(data)
        except SampleError:
            pass


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(_MAGICS), st.binary(max_size=600))
def test_random_bytes_behind_a_magic_are_a_value_or_a_sample_error(magic, body):
    _parsers_answer_or_refuse(magic + body)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.integers(0, 7), st.integers(0, 1 << 20), st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)),
                                                            max_size=6))
def test_cut_and_flipped_real_files_are_a_value_or_a_sample_error(real_files, which, cut, flips):
    data = bytearray(real_files[which][:max(1, cut % (len(real_files[which]) + 1))])
    for at, value in flips:
        data[at % len(data)] = value
    _parsers_answer_or_refuse(bytes(data))


def test_a_path_is_opened_once(tmp_path, monkeypatch):
    path = _sound(tmp_path / "a.flac", 1000, 8000, 1)
    opened = []
    real = os.open
    monkeypatch.setattr(os, "open", lambda *args, **kwargs: opened.append(args[0]) or real(*args, **kwargs))
    assert read_audio_info(path).num_samples == 1000
    assert opened == [str(path)]
