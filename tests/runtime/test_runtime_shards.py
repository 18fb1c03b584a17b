"""ShardDataset: tar shards scanned by `balancer scan`, packed by `balancer pack`, and replayed through
ManifestBatchSampler in a DataLoader (0 and 2 workers): every rank gets exactly the manifest's samples,
each member's exact bytes; a shard changed since the scan is an error naming shard, key and the fix."""

from __future__ import annotations

import io
import json
import pickle
import tarfile
from pathlib import Path

import pyarrow as pa
import pytest

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402
from PIL import Image  # noqa: E402
from runtime_util import manifest_batches, snippet  # noqa: E402

from balancer_cli.cli import main  # noqa: E402
from balancer_cli.errors import InputError  # noqa: E402
from balancer_cli.lengths import make_lengths_table, read_lengths  # noqa: E402
from balancer_cli.manifest import read_dropped  # noqa: E402
from balancer_cli.runtime import ManifestBatchSampler, ShardDataset  # noqa: E402

WORLD = 2


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _png(side: int, shade: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side // 2 + 8), (shade, 10, 200)).save(buf, "PNG")
    return buf.getvalue()


def _members(i: int) -> list[tuple[str, bytes]]:
    """Sample ``i``: images and a caption, text only, or (every 11th) no record at all."""
    key = f"part{i % 3}/sample{i:03d}" + ("-" + "x" * 90 if i % 7 == 0 else "")  # some need long names
    if i % 11 == 5:
        return [(f"{key}.png", _png(64, i))]
    if i % 4 == 1:
        return [(f"{key}.txt", ("words " * (5 + i)).encode())]
    images = [(f"{key}.{j}.png", _png(32 + 24 * ((i + j) % 9), i)) for j in range(1 + i % 2)]
    question = "<image>\n" * len(images) + "Describe it. " * (1 + i % 5)
    record = {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": "Fine " * i}]}
    return [(f"{key}.json", json.dumps(record).encode()), *images, (f"{key}.cls", str(i).encode())]


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, Path, dict[tuple[str, str], dict[str, bytes]]]:
    """Two shards (PAX and GNU), scanned and packed through the CLI; the bytes of every member."""
    root = tmp_path_factory.mktemp("shards")
    (root / "shards").mkdir()
    truth: dict[tuple[str, str], dict[str, bytes]] = {}
    for s, fmt in enumerate((tarfile.PAX_FORMAT, tarfile.GNU_FORMAT)):
        path = root / "shards" / f"{s:03d}.tar"
        with tarfile.open(path, "w", format=fmt) as tar:
            for i in range(s * 30, s * 30 + 30):
                for name, data in _members(i):
                    _add(tar, name, data)
                    key, ext = name.split(".", 1)  # (no dot in the folder names)
                    truth.setdefault((str(path), key), {})[ext] = data
    runner = CliRunner()
    result = runner.invoke(main, ["scan", str(root / "shards"), "-o", str(root / "lengths.parquet"),
                                  "--model", "qwen2-vl", "-q"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["pack", str(root / "lengths.parquet"), "-o", str(root / "out"), "--dp", str(WORLD),
                                  "--micro-batches", "1", "--max-llm-tokens", "4000", "--max-vision-items", "6",
                                  "--baselines", "none"])
    assert result.exit_code == 0, result.output
    return root / "out", root / "lengths.parquet", truth


def _keep(batch: list) -> list:
    return batch


@pytest.mark.parametrize("workers", [0, 2])
def test_every_rank_reads_exactly_its_samples_with_their_bytes(packed, workers):
    out, lengths_path, truth = packed
    lengths = read_lengths(lengths_path, members=True)
    keys = lengths.table.column("key").to_pylist()
    shards = lengths.table.column("shard").to_pylist()
    dataset = ShardDataset(lengths_path)
    assert len(dataset) == lengths.num_samples == 60
    dropped, _ = read_dropped(out)
    assert len(dropped) == 60 - int(lengths.ok_mask().sum()) > 0  # the samples without a record
    seen = []
    for rank in range(WORLD):
        sampler = ManifestBatchSampler(out, rank=rank, world_size=WORLD, lengths=lengths_path, dataset=dataset)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=_keep, num_workers=workers)
        got = [[(s["__shard__"], s["__key__"]) for s in batch] for batch in loader]
        want = [[(shards[i], keys[i]) for i in group] for group in manifest_batches(out, rank, 0)]
        assert got == want
        for batch in loader:
            for sample in batch:
                members = {k: v for k, v in sample.items() if not k.startswith("__")}
                assert members == truth[(sample["__shard__"], sample["__key__"])]
                seen.append(sample["__key__"])
    assert sorted(seen) == sorted(k for i, k in enumerate(keys) if lengths.ok_mask()[i])


def test_decode_and_pickling(packed):
    _, lengths_path, truth = packed
    dataset = ShardDataset(read_lengths(lengths_path, members=True), decode=lambda s: sorted(k for k in s if not k.startswith("__")))
    first = dataset[0]
    clone = pickle.loads(pickle.dumps(ShardDataset(lengths_path)))  # after a read: no descriptor travels
    raw = clone[len(clone) - 1]
    assert first == sorted(truth[(dataset.shard_of(0), dataset.raw(0)["__key__"])])
    assert {k: v for k, v in raw.items() if not k.startswith("__")} == truth[(raw["__shard__"], raw["__key__"])]
    with pytest.raises(IndexError):
        dataset[60]


def test_a_changed_shard_is_an_error_naming_shard_key_and_fix(packed, tmp_path):
    _, lengths_path, _ = packed
    table = read_lengths(lengths_path, members=True).table
    shard = table.column("shard").to_pylist()[0]
    moved = tmp_path / "000.tar"
    data = Path(shard).read_bytes()
    moved.write_bytes(bytes(512) + data)  # every member 512 bytes later
    shards = table.column("shard").to_pylist()
    rebased = table.set_column(table.column_names.index("shard"), "shard",
                               pa.array([str(moved) if s == shard else s for s in shards]))
    dataset = ShardDataset(rebased)
    key = table.column("key").to_pylist()[0]
    with pytest.raises(InputError) as info:
        dataset[0]
    assert str(info.value).startswith(f"{moved}:{key}: member ") and "scan the shards again" in str(info.value)
    moved.write_bytes(data[:len(data) // 3])  # cut short
    with pytest.raises(InputError, match="not where the lengths table says"):
        [dataset[i] for i in range(30)]


def test_tables_of_other_formats(packed):
    with pytest.raises(InputError, match="not scanned from tar shards"):
        ShardDataset(make_lengths_table([10, 20]))
    table = read_lengths(packed[1], members=True).table  # as if sample 0 came from a JSONL input of the same scan
    shards = table.column("shard").to_pylist()
    mixed = ShardDataset(table.set_column(table.column_names.index("shard"), "shard", pa.array([None] + shards[1:])))
    with pytest.raises(InputError, match="sample 0 is not from a tar shard"):
        mixed[0]
    assert mixed[1]["__key__"] == table.column("key")[1].as_py()


def test_shards_snippet_of_the_doc_replays_every_sample_once(packed, tmp_path, monkeypatch):
    """docs/runtime.md's ``shards`` snippet, as written, in a folder holding ``lengths.parquet`` and
    ``out/`` (one process: the 2-rank manifest replays elastically on 1 rank, every sample once)."""
    out, lengths_path, truth = packed
    (tmp_path / "lengths.parquet").symlink_to(lengths_path)
    (tmp_path / "out").symlink_to(out, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    code = snippet("shards").replace("for batch in loader:\n", "seen = []\nfor batch in loader:\n")
    code += "    seen += [(sample['__shard__'], sample['__key__']) for sample in batch]\n"
    scope: dict = {}
    exec(code, scope)
    lengths = read_lengths(lengths_path, members=True)
    ok = lengths.ok_mask()
    keys, shards = lengths.table.column("key").to_pylist(), lengths.table.column("shard").to_pylist()
    assert sorted(scope["seen"]) == sorted((shards[i], keys[i]) for i in range(len(keys)) if ok[i])
    assert scope["keys"] and all(isinstance(k, str) for k in scope["keys"])
