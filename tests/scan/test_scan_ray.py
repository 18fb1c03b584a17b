"""The Ray Data scan engine: same bytes as the local engine, resumable, retrying failed blocks.

The session's small local Ray cluster (``ray_cluster`` in tests/conftest.py) serves these tests;
Ray is an extra, so everything skips cleanly when it is not installed (CI installs it).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from balancer_cli._ray import import_ray
from balancer_cli.errors import InputError, SampleError, UsageError
from balancer_cli.lengths import write_lengths
from balancer_cli.scan import measure as measure_module
from balancer_cli.scan.engines.ray import RayOptions, parts_dir_for
from balancer_cli.scan.measure import ScanConfig
from balancer_cli.scan.pipeline import scan

BLOCK_SIZE = 16
_real_measure_job = measure_module.measure_job


@pytest.fixture(scope="module")
def ray_session(ray_cluster):
    # Functions of this module (the failing measures below) travel to workers by value.
    ray_cluster.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ray_cluster


def _write_image(path: Path, size: tuple[int, int], fmt: str) -> None:
    from PIL import Image

    Image.new("RGB", size, (120, 30, 200)).save(path, format=fmt)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> list[str]:
    """Two JSONL inputs: image files, size fields, text-only, messages, and bad records of each kind."""
    root = tmp_path_factory.mktemp("ray_ds")
    sizes = [(64, 48), (640, 480), (1000, 333), (28, 900), (1280, 720), (300, 300)]
    for i, size in enumerate(sizes):
        _write_image(root / f"img{i}.{'png' if i % 2 else 'jpg'}", size, "PNG" if i % 2 else "JPEG")
    (root / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not really a jpeg")
    turns = [{"from": "human", "value": "<image>\nWhat is shown here, in detail?"}, {"from": "gpt", "value": ""}]
    lines: list[str] = []
    for i in range(120):
        kind = i % 8
        answer = "a long answer " * (i % 17 + 1)
        convo = [turns[0], {"from": "gpt", "value": answer}]
        if kind == 0:
            j = i % len(sizes)
            record = {"image": f"img{j}.{'png' if j % 2 else 'jpg'}", "conversations": convo}
        elif kind == 1:
            record = {"image": "remote.jpg", "width": 200 + 37 * i, "height": 150 + 11 * i, "conversations": convo}
        elif kind == 2:
            record = {"text": "plain pretraining text " * (i + 1)}
        elif kind == 3:
            record = {"messages": [{"role": "user", "content": "Why? " * (i % 5 + 1)},
                                   {"role": "assistant", "content": answer}]}
        elif kind == 4:
            record = {"image": "nowhere.png", "conversations": convo}  # missing file
        elif kind == 5:
            record = {"image": "corrupt.jpg", "conversations": convo}  # corrupt image
        elif kind == 6:
            record = {"image": "x.png", "width": "wide", "height": 10, "conversations": convo}  # bad size field
        else:
            record = {"question": "How many? " * (i % 3 + 1), "answer": str(i)}
        lines.append(json.dumps(record))
        if i == 37:
            lines.append("{this line is not json")
    first = root / "mix.jsonl"
    first.write_text("\n".join(lines[:70]) + "\n")
    second = root / "more.jsonl"
    second.write_text("\n".join(lines[70:]) + "\n")
    return [str(first), str(second)]


def _scan(dataset, engine, parts_dir=None, strict=False, retries=3):
    options = RayOptions(parts_dir=str(parts_dir) if parts_dir else None, block_retries=retries)
    return scan(dataset, ScanConfig(strict=strict), jobs=1, engine=engine, block_size=BLOCK_SIZE,
                engine_options=options if engine == "ray" else None)


def _cli(args: list[str]) -> dict:
    from click.testing import CliRunner

    from balancer_cli.cli import main

    result = CliRunner().invoke(main, ["scan", *args, "--model", "qwen2-vl", "--block-size", str(BLOCK_SIZE),
                                       "-j", "1", "--json", "--quiet"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def local_file(dataset, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("local") / "lengths.parquet"
    _cli([*dataset, "-o", str(out)])
    return out


def test_cli_ray_output_is_byte_identical_to_local(ray_session, dataset, local_file, tmp_path):
    out = tmp_path / "lengths.parquet"
    summary = _cli([*dataset, "-o", str(out), "--engine", "ray", "--keep-parts"])
    assert out.read_bytes() == local_file.read_bytes()
    # The dataset really exercises every path: header reads, size fields, text-only, errors.
    errors = summary["errors"]
    assert summary["samples"] == 121
    assert {"missing_file", "malformed_record"} <= set(errors) and len(errors) >= 3  # + the corrupt image
    assert summary["modules"]["vision"]["items"] > 0
    assert summary["samples"] - summary["measured"] == sum(errors.values())
    # --keep-parts keeps one shard per block, named by block index (removed by default).
    shards = sorted(p.name for p in parts_dir_for(out).glob("block-*.parquet"))
    assert shards == [f"block-{i:08d}.parquet" for i in range(9)]

    again = tmp_path / "again.parquet"
    _cli([*dataset, "-o", str(again), "--engine", "ray"])
    assert again.read_bytes() == local_file.read_bytes() and not parts_dir_for(again).exists()


def test_ray_options_without_ray_engine_are_a_usage_error(dataset, tmp_path):
    from click.testing import CliRunner

    from balancer_cli.cli import main

    result = CliRunner().invoke(main, ["scan", *dataset, "-o", str(tmp_path / "x.parquet"), "--model", "qwen2-vl",
                                       "--ray-address", "auto"])
    assert result.exit_code == 2 and "--engine ray" in result.output


def _fail_from(first_sample: int):
    def measure(block, config):
        if block.first_sample >= first_sample:
            raise OSError(f"simulated crash at sample {block.first_sample}")
        return _real_measure_job(block, config)
    return measure


def test_interrupted_run_resumes_without_redoing_finished_blocks(ray_session, dataset, local_file, tmp_path,
                                                                 monkeypatch):
    out = tmp_path / "lengths.parquet"
    parts = parts_dir_for(out)
    # "Crash" every block from sample 64 on (4 of 9 blocks done), without retries.
    monkeypatch.setattr(measure_module, "measure_job", _fail_from(64))
    with pytest.raises(InputError) as info:
        _scan(dataset, "ray", parts, retries=0)
    message = str(info.value)
    assert "5 of 9 blocks failed" in message and "simulated crash at sample 64" in message
    assert "mix.jsonl" in message and "rerun the same command" in message
    done = {p.name: p.stat().st_mtime_ns for p in parts.glob("block-*.parquet")}
    assert len(done) == 4
    # Also lose one finished shard, as if its write never happened.
    lost = parts / "block-00000001.parquet"
    lost.unlink()
    del done[lost.name]

    monkeypatch.setattr(measure_module, "measure_job", _real_measure_job)
    result = _scan(dataset, "ray", parts)
    write_lengths(result.lengths, out)
    assert out.read_bytes() == local_file.read_bytes()
    after = {p.name: p.stat().st_mtime_ns for p in parts.glob("block-*.parquet")}
    assert all(after[name] == mtime for name, mtime in done.items()), "finished shards were measured again"
    assert len(after) == 9 and not list(parts.glob("*.error"))


def _fail_once(marker_dir: str, first_sample: int):
    def measure(block, config):
        marker = Path(marker_dir) / f"failed-{block.first_sample}"
        if block.first_sample == first_sample and not marker.exists():
            marker.write_text(str(os.getpid()))
            raise ConnectionError("shared storage hiccup")
        return _real_measure_job(block, config)
    return measure


def test_block_failing_once_is_retried(ray_session, dataset, local_file, tmp_path, monkeypatch):
    monkeypatch.setattr(measure_module, "measure_job", _fail_once(str(tmp_path), 32))
    out = tmp_path / "lengths.parquet"
    result = _scan(dataset, "ray", parts_dir_for(out), retries=2)
    write_lengths(result.lengths, out)
    assert (tmp_path / "failed-32").is_file(), "the block did not fail: the test proves nothing"
    assert out.read_bytes() == local_file.read_bytes()


def test_strict_raises_the_first_bad_sample_like_local(ray_session, dataset, tmp_path):
    with pytest.raises(SampleError) as local:
        _scan(dataset, "local", strict=True)
    with pytest.raises(SampleError) as remote:
        _scan(dataset, "ray", tmp_path / "parts", strict=True)
    assert str(remote.value) == str(local.value)
    assert (remote.value.kind, remote.value.file, remote.value.line) == (local.value.kind, local.value.file,
                                                                          local.value.line)


def test_missing_ray_is_a_usage_error_with_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(UsageError) as info:
        import_ray()
    assert "pip install 'balancer_cli[ray]'" in str(info.value)
