"""`balancer scan` over WebDataset tar shards: grouping as WebDataset does, media measured inside the
tar, the member columns, the engines, and every count equal to the scan of the extracted files."""

from __future__ import annotations

import gzip
import io
import json
import re
import sys
import tarfile
import wave
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from balancer_cli.cli import main
from balancer_cli.errors import InputError
from balancer_cli.lengths import read_lengths
from balancer_cli.scan import tar_window
from balancer_cli.scan.inputs import expand_inputs
from balancer_cli.scan.measure import ScanConfig
from balancer_cli.scan.pipeline import scan
from balancer_cli.scan.webdataset import group_members, iter_tar_members, media_kind

COUNTS = ["llm_tokens", "vision_tokens", "vision_items", "vision_seqlens", "video_tokens", "video_items",
          "video_seqlens", "audio_tokens", "audio_items", "audio_seqlens"]
LONG = "deep/" + "a-very-long-directory-name-" * 5 + "/sample-with-a-long-key"  # > 100 bytes: GNU/PAX records


def _add(tar: tarfile.TarFile, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE) -> None:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def _image(size: tuple[int, int], fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (90, 20, 200)).save(buf, fmt)
    return buf.getvalue()


def _wav(seconds: float, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as clip:
        clip.setnchannels(1)
        clip.setsampwidth(2)
        clip.setframerate(rate)
        clip.writeframes(bytes(2 * int(rate * seconds)))
    return buf.getvalue()


def _mp4() -> bytes | None:
    try:
        import av
        import numpy as np
    except ImportError:
        return None
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(6):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), 30 * i, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def _conv(question: str, answer: str = "An answer.") -> dict:
    return {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}


def _js(record: dict) -> bytes:
    return json.dumps(record).encode()


def _write_shards(folder: Path) -> dict[str, Path]:
    """Three shards: PAX (images, long and non-ASCII names, skipped members), GNU (audio, video,
    upper-case extensions, a key coming back), and one cut inside its last member."""
    folder.mkdir()
    video = _mp4()
    with tarfile.open(folder / "000.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        _add(tar, "__meta__", b"{}")  # WebDataset skips __*__ names
        _add(tar, "imgs", kind=tarfile.DIRTYPE)  # and everything that is not a regular file
        _add(tar, "s0.json", _js(_conv("<image>\n<image>\nCompare these two.")))
        _add(tar, "s0.0.jpg", _image((640, 480), "JPEG"))
        _add(tar, "s0.1.png", _image((100, 900), "PNG"))
        _add(tar, "s1.txt", "plain pretraining text, no media at all ".encode() * 3)
        _add(tar, "s2.json", _js({"messages": [{"role": "user", "content": [{"type": "image"},
                                                                          {"type": "text", "text": "What?"}]},
                                               {"role": "assistant", "content": "A square."}]}))
        _add(tar, "s2.webp", _image((300, 300), "WEBP"))
        _add(tar, "s3.jpg", _image((50, 50), "JPEG"))  # no json, no txt: malformed_record
        _add(tar, "s4.json", _js(_conv("<image>\nBroken?")))
        _add(tar, "s4.jpg", b"\xff\xd8\xff\xe0 not really a jpeg")  # corrupt_image
        _add(tar, f"{LONG}.json", _js(_conv("<image>\nLong name.")))
        _add(tar, f"{LONG}.png", _image((1000, 333), "PNG"))
        _add(tar, "imgs/ünïcode-kéy.json", _js({"text": "<image> caption", "width": 448, "height": 448}))
        _add(tar, "imgs/ünïcode-kéy.gif", _image((20, 20), "GIF"))  # the record's size wins
        _add(tar, "s5.json", _js({"text": "sized by dicts", "images": [{"width": 280, "height": 560}]}))
        _add(tar, "s5.jpg", _image((10, 10), "JPEG"))
    with tarfile.open(folder / "001.tar", "w", format=tarfile.GNU_FORMAT) as tar:
        _add(tar, "a0.json", _js(_conv("<audio>\nTranscribe.")))
        _add(tar, "a0.WAV", _wav(1.5))
        _add(tar, "a1.json", _js({"text": "<audio> timed", "duration": 4.0}))  # the record's duration wins
        _add(tar, "a1.flac.wav", _wav(0.5))
        _add(tar, f"{LONG}2.txt", b"a long key in GNU format")
        _add(tar, "a0.txt", b"the key a0 again, not next to its first members: a new sample")
        if video is not None:
            _add(tar, "v0.json", _js(_conv("<video>\nWhat happens?")))
            _add(tar, "v0.mp4", video)
        _add(tar, "d0.json", _js({"text": "twice"}))
        _add(tar, "d0.JSON", _js({"text": "twice"}))  # an extension twice: malformed_record
    with tarfile.open(folder / "002.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        _add(tar, "t0.json", _js(_conv("<image>\nBefore the cut.")))
        _add(tar, "t0.png", _image((64, 64), "PNG"))
        _add(tar, "t1.json", _js(_conv("<image>\nCut.")))
        _add(tar, "t1.png", _image((256, 256), "PNG") + bytes(4000))
    data = (folder / "002.tar").read_bytes()
    cut = tarfile.open(folder / "002.tar")
    last = cut.getmembers()[-1]
    cut.close()
    (folder / "002.tar").write_bytes(data[:last.offset_data + 1000])  # inside t1.png's data
    (folder / "notes.md").write_text("other files in the folder are ignored")
    return {"video": video is not None}


def reference_samples(path: Path) -> list[tuple[str, list[tuple[str, bytes]]]]:
    """WebDataset's grouping, straightforwardly: tarfile's member list, extracted bodies."""
    samples: list[tuple[str, list[tuple[str, bytes]]]] = []
    with tarfile.open(path) as tar:
        try:
            members = tar.getmembers()
        except tarfile.ReadError:  # a cut shard: what tarfile listed
            members = tar.members
        for member in members:
            name = member.name
            if not member.isreg() or ("/" not in name and name.startswith("__") and name.endswith("__")) \
                    or re.match(r"__[^/]*__($|/)", name):
                continue
            match = re.match(r"^((?:.*/|)[^.]+)[.]([^/]*)$", name)
            if not match:
                continue
            key, ext = match.group(1), match.group(2).lower()
            if not samples or samples[-1][0] != key:
                samples.append((key, []))
            body = tar.fileobj
            body.seek(member.offset_data)
            samples[-1][1].append((ext, body.read(member.size)))
    return samples


def _oracle_record(key: str, members: list[tuple[str, bytes]], media_dir: Path, index: int) -> object:
    """The JSONL record of a sample extracted to files (None: a sample that cannot be a record)."""
    exts = [ext for ext, _ in members]
    if len(set(exts)) != len(exts):
        return None
    found = dict(members)
    if "json" in found:
        record = json.loads(found["json"])
    elif "txt" in found:
        record = {"text": found["txt"].decode()}
    else:
        return None
    for kind in ("image", "video", "audio"):
        files = []
        for ext in sorted(found):
            if media_kind(ext) == kind:
                path = media_dir / f"{index}.{ext}"
                path.write_bytes(found[ext])
                files.append(f"media/{path.name}")
        if files:
            listed = record.pop(kind, None) or record.pop(kind + "s", None) or []
            if len(listed) == len(files) and all(isinstance(item, dict) for item in listed):
                files = [{**item, "path": f} for item, f in zip(listed, files)]
            record[kind + "s"] = files
    return record


def _cli(*args: str) -> dict:
    result = CliRunner().invoke(main, ["scan", *map(str, args), "--model", "qwen2-vl", "--json", "-q"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("wds")
    return root / "shards", _write_shards(root / "shards")


@pytest.fixture(scope="module")
def scanned(shards, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wds_out") / "lengths.parquet"
    _cli(shards[0], "-o", out, "-j", "1")
    return out


def test_tar_scan_equals_the_scan_of_the_extracted_files(shards, scanned, tmp_path):
    folder, made = shards
    expected = [(path, key, members) for path in sorted(folder.glob("*.tar")) for key, members in
                reference_samples(path)]
    (tmp_path / "media").mkdir()
    lines = [json.dumps(_oracle_record(key, members, tmp_path / "media", i))
             for i, (_, key, members) in enumerate(expected)]
    (tmp_path / "oracle.jsonl").write_text("\n".join(lines) + "\n")
    _cli(tmp_path / "oracle.jsonl", "-o", tmp_path / "oracle.parquet", "-j", "1")
    tar_rows = read_lengths(scanned, members=True).table.to_pylist()
    oracle = read_lengths(tmp_path / "oracle.parquet").table.to_pylist()
    assert len(tar_rows) == len(oracle) == len(expected) == (16 if made["video"] else 15)
    for row, want, (path, key, members) in zip(tar_rows, oracle, expected):
        assert (row["shard"], row["key"]) == (str(path), key)
        assert row["member_names"] == [ext for ext, _ in members]
        data = path.read_bytes()
        assert [data[o:o + n] for o, n in zip(row["member_offsets"], row["member_sizes"])] == \
            [body for _, body in members]
        assert row["source"] == "shards"
        if key == "t1":  # cut inside its image: its own error; t0 before it scans
            assert row["error"].startswith("corrupt_image: ") and "truncated" in row["error"]
            assert f"{path}:t1: " in row["error"]
            continue
        assert (row["error"] or "").split(":")[0] == (want["error"] or "").split(":")[0], (key, row["error"])
        assert {c: row[c] for c in COUNTS if c in row} == {c: want[c] for c in COUNTS if c in want}, key
    by_key: dict = {}
    for row in tar_rows:
        by_key.setdefault(row["key"], row)  # (a0's first sample)
    assert by_key["s3"]["error"] == (f"malformed_record: {folder / '000.tar'}:s3: sample 's3' has no json or "
                                     "txt member (members: jpg); fix: add s3.json (the record) or s3.txt (its text) "
                                     "to the shard")
    assert by_key["s4"]["error"].startswith(f"corrupt_image: {folder / '000.tar'}:s4: s4.jpg: corrupt")
    assert by_key["d0"]["error"].startswith("malformed_record: ") and "twice" in by_key["d0"]["error"]
    assert by_key["s0"]["vision_items"] == 2 and by_key["a0"]["audio_tokens"] == 75
    assert by_key["a1"]["audio_tokens"] == 200  # duration 4.0 from the record, not the 0.5 s header
    assert by_key["imgs/ünïcode-kéy"]["vision_tokens"] == 1024  # 448x448 from the record, not 20x20
    assert [r["key"] for r in tar_rows].count("a0") == 2
    if made["video"]:
        assert by_key["v0"]["video_tokens"] > 0 and by_key["v0"]["error"] is None
    else:
        pytest.skip("PyAV is not installed: the video sample was not made (every other sample checked)")


def test_jobs_and_blocks_give_byte_identical_tables(shards, scanned, tmp_path):
    out = tmp_path / "lengths.parquet"
    _cli(shards[0], "-o", out, "-j", "2", "--block-size", "2")
    assert out.read_bytes() == scanned.read_bytes()


def test_a_shard_alone_and_mixed_with_jsonl(shards, tmp_path):
    folder = shards[0]
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    out = tmp_path / "mixed.parquet"
    _cli(folder / "001.tar", tmp_path / "d.jsonl", "-o", out)
    rows = read_lengths(out, members=True).table.to_pylist()
    assert rows[0]["source"] == "001.tar" and rows[0]["shard"] == str(folder / "001.tar")
    assert rows[-1]["source"] == "d.jsonl" and rows[-1]["shard"] is None and rows[-1]["member_offsets"] is None
    # A lengths file without the member columns concatenates with one that has them.
    _cli(tmp_path / "d.jsonl", "-o", tmp_path / "plain.parquet")
    both = read_lengths([out, tmp_path / "plain.parquet"], members=True).table
    assert "key" not in read_lengths([out, tmp_path / "plain.parquet"]).table.column_names  # (what pack reads)
    assert both.column("key").to_pylist()[-2:] == [None, None] and both.num_rows == len(rows) + 1
    assert read_lengths(tmp_path / "plain.parquet").table.column_names[-1] == "error"
    # An InternVL meta file whose annotation is a folder of shards: each shard, the dataset's source.
    (tmp_path / "meta.json").write_text(json.dumps({"mine": {"root": str(folder), "annotation": str(folder)}}))
    specs = expand_inputs([str(tmp_path / "meta.json")])
    assert [(Path(s.path).name, s.source, s.format) for s in specs] == \
        [(f"00{i}.tar", "mine", "webdataset") for i in range(3)]


@pytest.mark.parametrize("name, content", [("x.tar.gz", "tar"), ("x.tgz", "tar"), ("x.tar", "gzip")])
def test_compressed_shards_are_refused(shards, tmp_path, name, content):
    raw = (shards[0] / "000.tar").read_bytes()
    path = tmp_path / name
    path.write_bytes(gzip.compress(raw) if content == "gzip" or name != "x.tar" else raw)
    for target in (path, tmp_path):  # the file itself, or a folder holding it
        with pytest.raises(InputError) as info:
            expand_inputs([str(target)])
        assert str(info.value).startswith(f"{path}: a compressed tar shard (")
        assert "decompress it" in str(info.value) and "\n" not in str(info.value)


def test_a_file_that_is_no_tar_and_an_empty_folder(tmp_path):
    (tmp_path / "bad.tar").write_bytes(b"x" * 700)
    with pytest.raises(InputError, match=r"bad.tar: not a tar file"):
        scan([str(tmp_path / "bad.tar")], ScanConfig(), jobs=1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="holds no .tar shards"):
        expand_inputs([str(tmp_path / "empty")])


def test_media_headers_read_a_few_bytes_of_a_large_member(tmp_path, monkeypatch):
    big = _image((4000, 3000), "PNG") + bytes(20 << 20)  # a 20 MB member
    with tarfile.open(tmp_path / "big.tar", "w") as tar:
        _add(tar, "k.json", _js(_conv("<image>\nBig.")))
        _add(tar, "k.png", big)
        _add(tar, "k2.json", _js(_conv("<audio>\nLong clip.")))
        _add(tar, "k2.wav", _wav(300.0))
    read: list[int] = []
    real = tar_window.os.pread

    def counting(fd, n, offset):
        read.append(n)
        return real(fd, n, offset)

    monkeypatch.setattr(tar_window.os, "pread", counting)
    result = scan([str(tmp_path / "big.tar")], ScanConfig(), jobs=1)
    assert result.summary["errors"] == {} and result.summary["modules"]["vision"]["items"] == 1
    assert result.lengths.table.column("audio_tokens").to_pylist() == [0, 15000]
    assert 0 < sum(read) < 1 << 17, sum(read)


def test_ray_engine_writes_the_local_table(ray_cluster, shards, scanned, tmp_path):
    out = tmp_path / "ray.parquet"
    _cli(shards[0], "-o", out, "--engine", "ray", "-j", "1", "--block-size", "3")
    assert out.read_bytes() == scanned.read_bytes()


# -- the grouping, over random shards ------------------------------------------------------------

_KEYS = st.sampled_from(["a", "b", "dir/c", "d.e/f", "__x__", "g"])
_EXTS = st.sampled_from(["jpg", "JPG", "0.png", "json", "txt", "", "tar.gz", "cls"])
_ENTRY = st.tuples(_KEYS, _EXTS, st.integers(0, 1200), st.sampled_from(["file", "file", "file", "dir"]))


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=st.lists(_ENTRY, min_size=1, max_size=14), fmt=st.sampled_from([tarfile.PAX_FORMAT,
                                                                              tarfile.GNU_FORMAT]))
def test_grouping_equals_the_reference_grouping(tmp_path_factory, entries, fmt):
    path = tmp_path_factory.mktemp("prop") / "s.tar"
    with tarfile.open(path, "w", format=fmt) as tar:
        for i, (key, ext, size, kind) in enumerate(entries):
            name = f"{key}.{ext}" if ext else f"{key}"
            if kind == "dir":
                _add(tar, f"{name}{i}", kind=tarfile.DIRTYPE)
            else:
                _add(tar, name, bytes([i % 251]) * size)
    got = list(group_members(iter_tar_members(str(path))))
    want = reference_samples(path)
    assert [(s.key, list(s.names)) for s in got] == [(k, [e for e, _ in m]) for k, m in want]
    data = path.read_bytes()
    assert [[data[o:o + n] for o, n in zip(s.offsets, s.sizes)] for s in got] == [[b for _, b in m] for _, m in want]
    for sample in got:  # a duplicate extension is the sample's error, as WebDataset raises
        assert (sample.error is not None) == (len(set(sample.names)) != len(sample.names))
    # Every member of the tar is in exactly one sample, or skipped as WebDataset skips it.
    with tarfile.open(path) as tar:
        kept = [m.offset_data for m in tar.getmembers() if m.isreg() and re.match(r"^((?:.*/|)[^.]+)[.]([^/]*)$", m.name)
                and not re.match(r"__[^/]*__($|/)", m.name)
                and not ("/" not in m.name and m.name.startswith("__") and m.name.endswith("__"))]
    assert sorted(o for s in got for o in s.offsets) == sorted(kept)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
