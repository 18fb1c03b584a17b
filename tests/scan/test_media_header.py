"""Video and audio measured from their own headers: exact values on real encoded files, rotation,
broken files as sample errors, bytes input, and scans of records without durations."""

from __future__ import annotations

import io
import json
import os
import struct
import threading
import wave
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from balancer_cli.errors import SampleError
from balancer_cli.lengths import read_lengths
from balancer_cli.run import scan_to_file
from balancer_cli.scan import media_header
from balancer_cli.scan.measure import ScanConfig
from balancer_cli.scan.media_header import read_audio_info, read_video_info
from balancer_cli.scan.mov_header import read_moov, video_track

av = pytest.importorskip("av")
sf = pytest.importorskip("soundfile")

from media_util import encode_video  # noqa: E402

# (file name, codec, frame rate, frames): containers with a frame count (mp4/mov/avi) and without (mkv/webm).
VIDEOS = [
    ("h264.mp4", "libx264", Fraction(2), 5),
    ("mpeg4.mp4", "mpeg4", Fraction(30000, 1001), 10),
    ("h264.mkv", "libx264", Fraction(30), 7),
    ("vp8.webm", "libvpx", Fraction(25), 6),
    ("vp9.webm", "libvpx-vp9", Fraction(24), 12),
    ("mpeg4.avi", "mpeg4", Fraction(10), 4),
    ("mpeg4.mov", "mpeg4", Fraction(12), 9),
]
SR = 16000
N_SAMPLES = 24037  # 1.5023125 s at 16 kHz: not a whole number of codec frames


_encode_video = encode_video


def _video(path: Path, codec: str, rate: Fraction, frames: int, **kwargs) -> Path:
    if codec not in av.codecs_available:
        pytest.skip(f"PyAV has no {codec} encoder here")
    _encode_video(str(path), codec, rate, frames, **kwargs)
    return path


def _decoded(source) -> tuple[int, int, int, int]:
    """What decoding gives: (frames, width, height, rotation of the first frame)."""
    with av.open(source) as container:
        decoded = list(container.decode(video=0))
    return len(decoded), decoded[0].width, decoded[0].height, decoded[0].rotation


def _wav(path: Path, samples: int = N_SAMPLES, rate: int = SR) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(bytes(2 * samples))
    return path


def _tone(samples: int = N_SAMPLES) -> np.ndarray:
    return (0.3 * np.sin(np.arange(samples) / 7.0)).astype(np.float32)


def _m4a(path: Path) -> Path:
    out = av.open(str(path), "w")
    stream = out.add_stream("aac", rate=SR)
    stream.layout = "mono"
    tone = _tone()
    for start in range(0, len(tone), 1024):
        frame = av.AudioFrame.from_ndarray(tone[None, start:start + 1024], format="fltp", layout="mono")
        frame.sample_rate = SR
        for packet in stream.encode(frame):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)
    out.close()
    return path


@pytest.mark.parametrize("name,codec,rate,frames", VIDEOS)
def test_video_header_values_match_decoding(tmp_path, name, codec, rate, frames):
    path = _video(tmp_path / name, codec, rate, frames)
    info = read_video_info(path)
    assert (info.num_frames, info.fps, info.width, info.height, info.rotation) == (frames, float(rate), 32, 24, 0)
    # mp4/mov/avi: exact stream duration; Matroska stores milliseconds.
    assert info.duration == pytest.approx(frames / rate, abs=1e-3 if name.endswith(("mkv", "webm")) else 1e-9)
    assert _decoded(str(path)) == (info.num_frames, info.width, info.height, 0)
    data = path.read_bytes()
    with open(path, "rb") as stream:
        assert read_video_info(str(path)) == read_video_info(data) == read_video_info(stream) == info


@pytest.mark.parametrize("ext", ["mp4", "mov"])
@pytest.mark.parametrize("faststart", [False, True])
def test_rotation_from_the_display_matrix(tmp_path, ext, faststart):
    if not hasattr(av.video.stream.VideoStream, "set_display_rotation"):
        pytest.skip("this PyAV cannot write a display matrix")
    for degrees, expected in ((90, 90), (-90, -90), (270, -90), (180, -180), (0, 0)):
        path = _video(tmp_path / f"r{degrees}.{ext}", "libx264", Fraction(5), 5, width=48, height=16,
                      rotation=degrees, faststart=faststart)
        info = read_video_info(path)
        frames, width, height, rotation = _decoded(str(path))
        assert info.rotation == rotation == expected  # what decoders read from the same matrix
        assert (width, height) == (48, 16)  # frames come out coded: torchcodec then rotates them
        assert (info.width, info.height) == ((16, 48) if expected in (90, -90) else (48, 16))
        stored = read_video_info(path.read_bytes(), apply_rotation=False)
        assert (stored.width, stored.height, stored.rotation) == (48, 16, expected)
        assert info.num_frames == frames == 5


def _by_pyav(path: Path) -> tuple:
    """``read_video_info``'s values as PyAV (FFmpeg's demuxer) gives them, moov parsing bypassed."""
    data = path.read_bytes()
    with open(path, "rb") as fp:
        moov = read_moov(fp.read, len(data), fp.seek)
    return media_header._probe_video(av, str(path), len(data), moov)


@pytest.mark.parametrize("ext", ["mp4", "mov"])
def test_moov_parsing_gives_ffmpegs_numbers(tmp_path, ext):
    cases = [("libx264", Fraction(2), 5, {}), ("libx264", Fraction(30000, 1001), 31, {}),
             ("libx264", Fraction(24), 50, {"faststart": True}), ("mpeg4", Fraction(25), 13, {}),
             ("libx264", Fraction(15), 9, {"rotation": 90, "width": 48, "height": 16}),
             ("libx264", Fraction(60), 7, {"rotation": 180, "faststart": True})]
    for i, (codec, rate, frames, kwargs) in enumerate(cases):
        path = _video(tmp_path / f"{i}.{ext}", codec, rate, frames, **kwargs)
        with open(path, "rb") as fp:
            track = video_track(read_moov(fp.read, path.stat().st_size, fp.seek))
        assert track is not None and track.simple and track.frames == frames
        info = read_video_info(path, apply_rotation=False)
        assert (info.duration, info.fps, info.num_frames, info.width, info.height, info.rotation,
                info.container) == _by_pyav(path)


def test_trimming_edit_lists_are_left_to_ffmpeg(tmp_path):
    data = _video(tmp_path / "v.mp4", "mpeg4", Fraction(10), 20, faststart=True).read_bytes()
    span = struct.unpack_from(">I", data, data.index(b"elst") + 12)[0]  # version/flags, count, then the edit
    trimmed = tmp_path / "trimmed.mp4"
    trimmed.write_bytes(_patch(data, b"elst", 8, span // 2))  # an edit that shows the first half only
    with open(trimmed, "rb") as fp:
        assert not video_track(read_moov(fp.read, len(data), fp.seek)).simple
    info = read_video_info(trimmed, apply_rotation=False)
    assert (info.duration, info.fps, info.num_frames, info.width, info.height, info.rotation,
            info.container) == _by_pyav(trimmed)
    assert info.duration == pytest.approx(1.0)  # FFmpeg applies the edit


def test_moov_parser_guards():
    assert read_moov(io.BytesIO(b"").read, 0, io.BytesIO(b"").seek) is None
    cut = io.BytesIO(b"\x00\x00\x00\x01moov")  # a 64-bit size cut short
    assert read_moov(cut.read, 8, cut.seek) is None
    junk = io.BytesIO(b"\x00\x00\x00\x10junkjunkjunk")
    assert read_moov(junk.read, 16, junk.seek) is None
    assert video_track(b"") is None and video_track(struct.pack(">I4s", 12, b"trak") + bytes(4)) is None


def _kind(source) -> tuple[str, str]:
    with pytest.raises(SampleError) as caught:
        (read_audio_info if str(source).endswith((".wav", ".flac")) else read_video_info)(source)
    return caught.value.kind, caught.value.message


def test_broken_videos_are_sample_errors_naming_the_file(tmp_path):
    moov_last = _video(tmp_path / "full.mp4", "libx264", Fraction(10), 20)
    faststart = _video(tmp_path / "fast.mp4", "libx264", Fraction(10), 20, faststart=True)
    (tmp_path / "cut_moov.mp4").write_bytes(moov_last.read_bytes()[: moov_last.stat().st_size // 2])
    (tmp_path / "cut_data.mp4").write_bytes(faststart.read_bytes()[: faststart.stat().st_size // 2])
    (tmp_path / "text.mp4").write_text("this is not a video\n" * 20)
    png = io.BytesIO()
    from PIL import Image
    Image.new("RGB", (8, 8)).save(png, "PNG")
    (tmp_path / "image.mp4").write_bytes(png.getvalue())
    (tmp_path / "folder.mp4").mkdir()
    cases = {
        "cut_moov.mp4": ("corrupt_video", "Invalid data"),
        "cut_data.mp4": ("corrupt_video", "truncated: its sample table reaches byte"),
        "text.mp4": ("corrupt_video", "Invalid data"),
        "image.mp4": ("unsupported_video", "not a video container"),
        "folder.mp4": ("missing_file", "is a directory"),
        "absent.mp4": ("missing_file", "video file not found"),
    }
    for name, (kind, words) in cases.items():
        got_kind, message = _kind(str(tmp_path / name))
        assert got_kind == kind and words in message and name in message, (name, got_kind, message)
    assert _kind(b"")[0] == "corrupt_video" and "<video bytes>" in _kind(b"")[1]
    audio_only = _m4a(tmp_path / "sound.m4a")
    assert _kind(str(audio_only)) == ("corrupt_video", f"{audio_only}: unusable video header (no video stream)")


def _patch(data: bytes, box: bytes, offset: int, value: int) -> bytes:
    """``data`` with the 32-bit field at ``offset`` bytes into ``box``'s payload set to ``value``."""
    at = data.index(box) + 4 + offset
    return data[:at] + struct.pack(">I", value) + data[at + 4:]


def test_absurd_and_zero_values_are_corrupt(tmp_path):
    data = _video(tmp_path / "v.mp4", "libx264", Fraction(10), 10, faststart=True).read_bytes()
    # mdhd (version 0): version/flags, creation, modification, timescale, duration; stts: version/flags,
    # entry count, then (sample count, sample delta) pairs.
    fast = _patch(_patch(data, b"stts", 12, 1), b"mdhd", 12, 1_000_000)  # a frame every microsecond
    slow = _patch(data, b"mdhd", 12, 1)  # a frame every 1024 s
    for broken, words in ((fast, "1e+06 fps"), (slow, "0.000976562 fps")):
        kind, message = _kind(broken)
        assert kind == "corrupt_video" and "absurd values" in message and words in message, message
    kind, message = _kind(_patch(data, b"mdhd", 16, 0))
    assert kind == "corrupt_video" and "no duration" in message


def test_a_fifo_is_never_opened(tmp_path):
    fifo = tmp_path / "pipe.mp4"
    os.mkfifo(fifo)
    results: list = []

    def run() -> None:
        for reader in (read_video_info, read_audio_info):
            try:
                reader(fifo)
            except SampleError as exc:
                results.append((exc.kind, "not a regular file" in exc.message))

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "opening a FIFO blocked"
    assert results == [("missing_file", True), ("missing_file", True)]


def test_audio_headers_match_decoding(tmp_path):
    tone = _tone()
    sf.write(tmp_path / "a.flac", tone, SR)
    sf.write(tmp_path / "a.ogg", tone, SR, format="OGG", subtype="VORBIS")
    sf.write(tmp_path / "opus.ogg", tone, 48000, format="OGG", subtype="OPUS")
    files = {"a.wav": SR, "a.flac": SR, "a.ogg": SR, "opus.ogg": 48000}
    _wav(tmp_path / "a.wav")
    if "MP3" in sf.available_formats():
        sf.write(tmp_path / "a.mp3", tone, SR, format="MP3")
        files["a.mp3"] = SR
    for name, rate in files.items():
        path = tmp_path / name
        info = read_audio_info(path)
        reader = name.rsplit(".", 1)[1]  # the header parsers
        assert (info.num_samples, info.sample_rate, info.channels, info.reader) == (N_SAMPLES, rate, 1, reader)
        assert info.duration == N_SAMPLES / rate
        assert len(sf.read(path)[0]) == N_SAMPLES  # decoding gives the same count
        assert read_audio_info(path.read_bytes()) == info
    m4a = read_audio_info(_m4a(tmp_path / "a.m4a"))  # libsndfile cannot read it: the moov box, as PyAV reads it
    with av.open(str(tmp_path / "a.m4a")) as container:
        decoded = sum(frame.samples for frame in container.decode(audio=0))
    assert m4a.reader == "mov" and m4a.sample_rate == SR
    assert N_SAMPLES <= m4a.num_samples <= decoded and decoded - m4a.num_samples < 1024  # within one AAC frame
    assert m4a.duration == m4a.num_samples / SR
    assert read_audio_info((tmp_path / "a.m4a").read_bytes()) == m4a


@pytest.mark.parametrize("subtype,channels", [("PCM_U8", 1), ("PCM_16", 2), ("PCM_24", 1), ("PCM_32", 3),
                                              ("FLOAT", 2), ("DOUBLE", 1)])
def test_wav_chunk_headers_agree_with_libsndfile(tmp_path, subtype, channels):
    path = tmp_path / "a.wav"
    sf.write(path, np.zeros((N_SAMPLES, channels), np.float32), 22050, subtype=subtype)
    info = read_audio_info(path)
    assert info.reader == "wav"
    sfi = sf.info(path)
    assert (info.num_samples, info.sample_rate, info.channels) == (sfi.frames, sfi.samplerate, sfi.channels)
    data = path.read_bytes()
    for cut in (len(data) - 1, len(data) - 1001, 200):  # cut downloads: the frames still there
        (tmp_path / "cut.wav").write_bytes(data[:cut])
        assert read_audio_info(tmp_path / "cut.wav").num_samples == sf.info(tmp_path / "cut.wav").frames
    # WAVE_FORMAT_EXTENSIBLE (soundfile writes it for more than 2 channels) and a LIST chunk before data
    listed = data[:12] + b"LIST" + struct.pack("<I", 5) + b"INFOx\x00" + data[12:]
    listed = listed[:4] + struct.pack("<I", len(listed) - 8) + listed[8:]
    (tmp_path / "list.wav").write_bytes(listed)
    assert read_audio_info(tmp_path / "list.wav").num_samples == sf.info(tmp_path / "list.wav").frames == N_SAMPLES


def test_broken_audio_are_sample_errors(tmp_path):
    wav = _wav(tmp_path / "a.wav").read_bytes()
    (tmp_path / "cut.wav").write_bytes(wav[:30])
    (tmp_path / "empty.wav").write_bytes(wav[:44])
    (tmp_path / "text.wav").write_text("not audio at all\n" * 10)
    (tmp_path / "short.wav").write_bytes(wav[:44 + 2 * 1000])  # cut inside the data: what is there counts
    assert read_audio_info(tmp_path / "short.wav").num_samples == 1000
    for name, words in (("cut.wav", "corrupt or truncated audio header"), ("empty.wav", "no samples"),
                        ("text.wav", "libsndfile: Format not recognised")):
        kind, message = _kind(str(tmp_path / name))
        assert kind == "corrupt_audio" and words in message and name in message, (name, kind, message)
    assert _kind(str(tmp_path / "absent.wav"))[0] == "missing_file"


def test_missing_packages_say_what_to_install(tmp_path, monkeypatch):
    mp4 = _video(tmp_path / "v.mp4", "libx264", Fraction(10), 4)
    mkv = _video(tmp_path / "v.mkv", "libx264", Fraction(10), 4)
    video = _video(tmp_path / "v.ts", "libx264", Fraction(10), 4, fmt="mpegts")
    m4a = _m4a(tmp_path / "a.m4a")
    wav = _wav(tmp_path / "a.wav")
    real = media_header._import
    monkeypatch.setattr(media_header, "_import", lambda name: None if name == "av" else real(name))
    with pytest.raises(SampleError, match="needs PyAV.*pip install av") as caught:
        read_video_info(video)
    assert caught.value.kind == "missing_video_metadata"
    assert read_video_info(mp4).num_frames == 4  # mp4/mov: read from the moov box, no PyAV needed
    assert read_video_info(mkv).num_frames == 4  # mkv/webm: from the EBML elements
    assert read_video_info(_video(tmp_path / "v.avi", "mpeg4", Fraction(10), 4)).num_frames == 4  # avi: hdrl
    assert read_audio_info(m4a).reader == "mov"  # AAC m4a: from the moov box
    with pytest.raises(SampleError, match="libsndfile cannot read.*pip install av") as caught:
        read_audio_info(video)
    assert caught.value.kind == "unsupported_audio"
    assert read_audio_info(wav).num_samples == N_SAMPLES
    flac = tmp_path / "a.flac"
    sf.write(flac, _tone(), SR)
    monkeypatch.setattr(media_header, "_import", lambda name: None)
    with pytest.raises(SampleError, match="pip install soundfile av") as caught:
        read_audio_info(video)
    assert caught.value.kind == "missing_audio_duration"
    assert read_audio_info(wav).reader == "wav"  # the header parsers need no package
    assert read_audio_info(flac).reader == "flac" and read_audio_info(flac).num_samples == N_SAMPLES


def _conv(tag: str) -> list[dict]:
    return [{"from": "human", "value": f"{tag}\nWhat happens?"}, {"from": "gpt", "value": "Something."}]


def _scan(tmp_path: Path, name: str, records: list[dict]):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    scan_to_file([path], tmp_path / f"{name}.parquet", ScanConfig(), jobs=1)
    return read_lengths(tmp_path / f"{name}.parquet")


COLUMNS = ["llm_tokens", "video_tokens", "video_items", "video_seqlens", "audio_tokens", "audio_items"]


def _rows(lengths) -> list[dict]:
    return lengths.table.select([c for c in COLUMNS if c in lengths.table.column_names]).to_pylist()


def test_scan_of_records_without_durations_matches_true_durations(tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    videos = [("a.mp4", "libx264", Fraction(10), 40), ("b.mkv", "libx264", Fraction(5), 22),
              ("c.webm", "libvpx", Fraction(8), 30), ("d.avi", "mpeg4", Fraction(4), 13)]
    bare, full, short = [], [], []
    for name, codec, rate, frames in videos:
        _video(media / name, codec, rate, frames, width=64, height=48)
        info = read_video_info(media / name)
        bare.append({"video": f"media/{name}", "conversations": _conv("<video>")})
        full.append({**bare[-1], "duration": float(frames / rate), "num_frames": frames, "fps": float(rate),
                     "width": 64, "height": 48})
        short.append({**bare[-1], "duration": info.duration, "width": 64, "height": 48})
    _wav(media / "a.wav")
    bare.append({"audio": "media/a.wav", "conversations": _conv("<audio>")})
    full.append({**bare[-1], "duration": N_SAMPLES / SR})
    short.append(full[-1])
    bad = [{"video": "media/none.mp4", "conversations": _conv("<video>")},
           {"video": "media/a.wav", "conversations": _conv("<video>")},
           {"audio": "../outside.wav", "conversations": _conv("<audio>")}]
    got = _scan(tmp_path, "bare.jsonl", bare + bad)
    want = _scan(tmp_path, "full.jsonl", full)
    table = _rows(got)
    assert table[:len(full)] == _rows(want)
    assert table[:len(full)] == _rows(_scan(tmp_path, "short.jsonl", short))
    assert all(row["video_tokens"] > 0 for row in table[:4]) and table[4]["audio_tokens"] == 76  # ceil(50 * 1.5023125 s)
    errors = list(got.errors())
    assert errors[:len(full)] == [None] * len(full)
    assert errors[-3].startswith("missing_file: ") and "bare.jsonl:6: video not found: media/none.mp4" in errors[-3]
    assert errors[-2].startswith("unsupported_video: ") and "bare.jsonl:7: media/a.wav: not a video container" in errors[-2]
    assert str(media / "a.wav") not in errors[-2]  # named as the record names it
    assert errors[-1].startswith("path_escape: ") and "audio path '../outside.wav'" in errors[-1]


def test_record_fields_win_over_the_header(tmp_path):
    _video(tmp_path / "v.mp4", "libx264", Fraction(10), 40, width=64, height=48)
    _wav(tmp_path / "a.wav")
    records = [{"video": "v.mp4", "duration": 100.0, "conversations": _conv("<video>")},
               {"video": "v.mp4", "width": 640, "height": 360, "conversations": _conv("<video>")},
               {"audio": "a.wav", "duration": 7.0, "conversations": _conv("<audio>")}]
    nofile = [{"video": "gone.mp4", "duration": 100.0, "conversations": _conv("<video>")},
              {"video": "gone.mp4", "duration": 4.0, "num_frames": 40, "fps": 10.0, "width": 640, "height": 360,
               "conversations": _conv("<video>")},
              {"audio": "gone.wav", "duration": 7.0, "conversations": _conv("<audio>")}]
    assert _rows(_scan(tmp_path, "r.jsonl", records)) == _rows(_scan(tmp_path, "n.jsonl", nofile))


def test_media_bytes_in_parquet_and_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    _video(tmp_path / "v.mp4", "libx264", Fraction(10), 30, width=64, height=48)
    _video(tmp_path / "w.webm", "libvpx", Fraction(6), 20, width=64, height=48)
    _wav(tmp_path / "a.wav")
    names = ["v.mp4", "w.webm"]
    by_path = [{"video": n, "audio": "a.wav", "conversations": _conv("<video><audio>")} for n in names]
    want = _rows(_scan(tmp_path, "paths.jsonl", by_path))
    rows = {"video": [{"bytes": (tmp_path / n).read_bytes(), "path": n} for n in names],
            "audio": [{"bytes": (tmp_path / "a.wav").read_bytes(), "path": None}] * 2,
            "conversations": [r["conversations"] for r in by_path]}
    pq.write_table(pa.table(rows), tmp_path / "bytes.parquet")
    scan_to_file([tmp_path / "bytes.parquet"], tmp_path / "pq.lengths.parquet", ScanConfig(), jobs=1)
    assert _rows(read_lengths(tmp_path / "pq.lengths.parquet")) == want
    ds = datasets.Dataset.from_dict(rows)
    ds = ds.cast_column("audio", datasets.Audio()).cast_column("video", datasets.Video())
    ds.save_to_disk(str(tmp_path / "hf"))
    scan_to_file([tmp_path / "hf"], tmp_path / "hf.lengths.parquet", ScanConfig(), jobs=1)
    got = read_lengths(tmp_path / "hf.lengths.parquet")
    assert _rows(got) == want and list(got.errors()) == [None, None]


def test_decoded_hf_audio_dicts_give_their_duration(tmp_path):
    records = [{"audio": {"array": [0.0] * 8000, "sampling_rate": 16000}, "conversations": _conv("<audio>")},
               {"audio": {"path": "x.wav", "duration": 0.5}, "conversations": _conv("<audio>")}]
    rows = _rows(_scan(tmp_path, "d.jsonl", records))
    assert rows[0] == rows[1] and rows[0]["audio_tokens"] == 25


def test_libsndfiles_mp3_warnings_stay_off_the_terminal(tmp_path, capfd):
    """libsndfile reads MP3 through libmpg123, which printed four warning lines to file descriptor
    2 for an ID3 tag without audio (``-q`` or not), and libsndfile called the file it could not
    place one that "does not exist or is not a regular file"."""
    clip = tmp_path / "z.mp3"
    clip.write_bytes(b"ID3\x04" + bytes(306))
    with pytest.raises(SampleError) as info:
        read_audio_info(clip)
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    assert info.value.kind == "corrupt_audio" and "does not exist" not in str(info.value)
