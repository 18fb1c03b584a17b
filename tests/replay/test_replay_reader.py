"""The replay's fast paths: row-group spans, reshuffled epochs in windows, the lazily synced cursor,
and the manifest's decode-friendly encoding (LZ4, dictionaries only on the key columns).

Each fast path is checked against a slow reference computed straight from the manifest rows.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from replay_util import pack_random

from balancer_cli.manifest import MANIFEST_FILE, open_manifest
from balancer_cli.replay import epoch_plan
from balancer_cli.replay.cursor import ManifestReplay
from balancer_cli.replay.reader import ManifestReader

R, M = 3, 2


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    # Small row groups (many per epoch) so spans and windows cross row-group boundaries.
    return pack_random(tmp_path_factory.mktemp("m"), num_samples=400, world_size=R, micro_batches=M, epochs=2,
                       rows_per_row_group=24, seed=3)


def reference_batches(manifest, steps, rank):
    """``rank``'s groups of ``steps`` (in that order) from the raw rows."""
    rows = open_manifest(manifest).read_all()
    out = []
    for step in steps:
        for micro in range(M):
            keep = (rows.step == step) & (rows.rank == rank) & (rows.micro == micro)
            out.append(rows.sample[keep].tolist())
    return out


def test_rank_span_and_rank_steps_match_the_rows(manifest):
    reader = ManifestReader(manifest)
    assert len(reader.manifest._file.metadata.to_dict()["row_groups"]) > 4  # noqa: SLF001
    for rank in range(R):
        first, got = 0, []
        while first < reader.num_steps:
            samples, bounds, first = reader.rank_span(first, reader.num_steps, rank)
            got += [samples[a:b] for a, b in zip(bounds, bounds[1:])]
        assert got == reference_batches(manifest, range(reader.num_steps), rank)
        steps = np.random.default_rng(rank).permutation(reader.num_steps)[:17]
        samples, bounds = reader.rank_steps(steps, rank)
        assert [samples[a:b] for a, b in zip(bounds, bounds[1:])] == reference_batches(manifest, steps, rank)
        assert reader.rank_batches(int(steps[0]), rank) == reference_batches(manifest, steps[:1], rank)
    assert reader.rank_steps(np.array([], np.int64), 0) == ([], [0])


@pytest.mark.parametrize("window_samples", [1, 7, 1 << 20])
def test_reshuffled_epoch_is_the_documented_permutation(manifest, window_samples, monkeypatch):
    monkeypatch.setattr(epoch_plan, "_WINDOW_SAMPLES", window_samples)
    m = open_manifest(manifest)
    starts = np.concatenate([[0], np.cumsum(m.epoch_num_steps)])
    for epoch in (2, 5):
        base = epoch % 2
        order = starts[base] + np.random.default_rng([m.meta["seed"], epoch]).permutation(m.epoch_num_steps[base])
        for rank in range(R):
            got = list(ManifestReplay(manifest, rank=rank, world_size=R, epoch=epoch))
            assert got == reference_batches(manifest, order, rank)


def test_resume_inside_a_reshuffled_epoch(manifest, monkeypatch):
    monkeypatch.setattr(epoch_plan, "_WINDOW_SAMPLES", 5)
    full = list(ManifestReplay(manifest, rank=1, world_size=R, epoch=3))
    for cut in range(0, len(full) + 1, 5):
        replay = ManifestReplay(manifest, rank=1, world_size=R, epoch=3)
        it = iter(replay)
        for _ in range(cut):
            next(it)
        state = json.loads(json.dumps(replay.state_dict()))
        assert (state["step"], state["batch_in_step"]) == divmod(cut, M)
        assert (replay.next_step, replay.next_micro) == divmod(cut, M)
        resumed = ManifestReplay(manifest, rank=1, world_size=R)
        resumed.load_state_dict(state)
        assert list(resumed) == full[cut:]


def test_the_cursor_detaches_from_an_abandoned_iterator(manifest):
    replay = ManifestReplay(manifest, rank=0, world_size=R)
    it = iter(replay)
    for _ in range(3):
        next(it)
    assert replay.state_dict()["batch_in_step"] == 1 and replay.state_dict()["step"] == 1
    replay.set_epoch(1)
    next(it)  # the old iterator no longer moves the replay's position
    assert (replay.next_step, replay.next_micro, replay.epoch) == (0, 0, 1)
    again = iter(replay)
    first = next(again)
    assert replay.next_micro == 1 and first == list(ManifestReplay(manifest, rank=0, world_size=R, epoch=1))[0]


def test_manifest_is_lz4_with_dictionaries_only_on_key_columns_and_byte_deterministic(tmp_path):
    paths = [pack_random(tmp_path / name, num_samples=150, world_size=2, extra=True) for name in ("a", "b")]
    digests = {hashlib.sha256((p / MANIFEST_FILE).read_bytes()).hexdigest() for p in paths}
    assert len(digests) == 1
    meta = pq.ParquetFile(paths[0] / MANIFEST_FILE).metadata
    for index in range(meta.num_row_groups):
        for c in range(meta.num_columns):
            column = meta.row_group(index).column(c)
            assert column.compression == "LZ4"
            assert ("RLE_DICTIONARY" in column.encodings) == (column.path_in_schema != "sample")
