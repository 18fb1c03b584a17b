"""Elastic plan files are verified when opened, never trusted: an edited, truncated or foreign file is
not read (one warning), rank 0 plans it again and every rank replays exactly the live plan, so every
sample is placed once per epoch; plans that do not fit the manifest are refused even under a valid
checksum."""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import pytest

from balancer_cli.replay import plan_cache
from balancer_cli.replay.cursor import ManifestReplay
from balancer_cli.replay.plan_cache import (
    PLANS_DIR,
    PlanCache,
    PlanFileInvalid,
    write_plan_cache,
)

WORLD = 3


def every_rank(manifest, world=WORLD, **kwargs):
    return [list(ManifestReplay(manifest, rank=r, world_size=world, **kwargs)) for r in range(world)]


def plan_file(manifest):
    (path,) = (manifest / PLANS_DIR).glob(f"R{WORLD}-*.npy")
    return path


def edit(path, change):
    array = np.load(path, mmap_mode="r+")
    S, C, R, k = (int(v) for v in array[2:6])
    change(array, 8 + S + C * R * k + 1)  # (the first sample's word)
    array.flush()
    del array


def set_word(at, value):
    def change(array, first_sample):
        array[at(array, first_sample)] = value(array, first_sample)
    return change


EDITS = {
    "a sample twice": set_word(lambda a, p: p, lambda a, p: a[p + 1]),
    "a sample id past the table": set_word(lambda a, p: p, lambda a, p: 10**9),
    "a negative sample id": set_word(lambda a, p: p, lambda a, p: -5),
    "a slot out of range": set_word(lambda a, p: 8, lambda a, p: 10**6),
    "a batch bound out of range": set_word(lambda a, p: p - 2, lambda a, p: 10**9),
    "a planned-step count": set_word(lambda a, p: 3, lambda a, p: a[3] + 1),
    "no checksum (an earlier format)": set_word(lambda a, p: 7, lambda a, p: 0),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_an_edited_plan_file_is_planned_again_and_replays_the_live_plan(capped, name, caplog):
    manifest, lengths = capped
    live = every_rank(manifest, lengths=lengths, plan_cache=False)
    assert every_rank(manifest, lengths=lengths) == live
    path = plan_file(manifest)
    edit(path, EDITS[name])
    with caplog.at_level(logging.WARNING):
        assert every_rank(manifest, lengths=lengths) == live
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) >= 1 and all("\n" not in w for w in warnings), warnings
    assert f"elastic plan file {path} is not used" in warnings[0] and "planning it again" in warnings[0]
    placed = Counter(s for rank in live for batch in rank for s in batch)
    assert set(placed.values()) == {1}  # what is replayed: each sample once in the epoch
    caplog.clear()
    replay = ManifestReplay(manifest, rank=1, world_size=WORLD, lengths=lengths)
    assert replay._planner.plan_cache(WORLD) is not None  # rank 0 wrote it again
    assert not caplog.records


def test_a_rank_that_does_not_write_plans_as_it_goes_and_warns_once(capped, caplog):
    manifest, lengths = capped
    live = every_rank(manifest, lengths=lengths, plan_cache=False)
    every_rank(manifest, lengths=lengths)
    path = plan_file(manifest)
    edit(path, EDITS["a sample twice"])
    edited = path.read_bytes()
    replay = ManifestReplay(manifest, rank=2, world_size=WORLD, lengths=lengths)
    with caplog.at_level(logging.WARNING):
        for epoch in (0, 0, 1):
            replay.set_epoch(epoch)
            assert list(replay) == every_rank(manifest, lengths=lengths, plan_cache=False, epoch=epoch)[2]
    assert list(replay.__class__(manifest, rank=2, world_size=WORLD, lengths=lengths, epoch=0)) == live[2]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "planning as the replay goes" in warnings[0], warnings  # one per replay
    assert path.read_bytes() == edited  # only rank 0 writes


def small_plan(tmp_path, samples, slot_S=(0, -1), bnd=(0, 1, 3, 4, 6)):
    path = tmp_path / "R2-test.npy"
    write_plan_cache(path, np.array(slot_S), len(samples), 2, 2, [(np.array(samples), np.array(bnd))])
    return path


def open_small(path, step_samples=(6, 3), epoch_starts=(0, 2), num_samples=9):
    return PlanCache.open(path, step_samples=np.array(step_samples), epoch_starts=np.array(epoch_starts),
                          num_samples=num_samples, world_size=2, batches=2)


def test_plans_that_do_not_fit_the_manifest_are_refused_under_a_valid_checksum(tmp_path):
    good = [5, 1, 2, 0, 3, 4]
    assert open_small(small_plan(tmp_path, good)).rank_steps(np.array([0]), 0)[0].tolist() == [5, 1, 2]
    cases = [
        ({"samples": [5, 1, 2, 0, 3, 5]}, {}, "placed twice in epoch 0"),
        ({"samples": [5, 1, 2, 0, 3, 9]}, {}, "sample id 9 in epoch 0 is outside 0..8"),
        ({"samples": [5, 1, 2, 0, 3, -1]}, {}, "sample id -1"),
        ({"samples": good}, {"step_samples": (7, 3)}, "step 0 has 6 samples, the manifest 7"),
        ({"samples": good}, {"step_samples": (6, 4)}, "plans 1 steps, the manifest has 2 steps of at least 4"),
        ({"samples": good, "slot_S": (-1, 0)}, {}, "plans 1 steps"),
        ({"samples": good, "slot_S": (0, -2)}, {}, "plans 1 steps"),
        ({"samples": good, "bnd": (0, 3, 1, 4, 6)}, {}, "batch bounds do not rise"),
        ({"samples": good}, {"step_samples": (6, 3, 1)}, "header"),
    ]
    for written, expected, message in cases:
        path = small_plan(tmp_path, **written)
        with pytest.raises(PlanFileInvalid, match=message):
            open_small(path, **expected)
    # In every epoch on its own: the same sample in two epochs is what a 2-epoch manifest holds.
    path = small_plan(tmp_path, [5, 1, 2, 0, 3, 4, 5, 1, 2, 0, 3, 4], slot_S=(0, 1),
                      bnd=(0, 1, 3, 4, 6, 7, 9, 10, 12))
    assert open_small(path, step_samples=(6, 6), epoch_starts=(0, 1, 2)) is not None
    with pytest.raises(PlanFileInvalid, match="placed twice in epoch 0"):
        open_small(path, step_samples=(6, 6), epoch_starts=(0, 2))


def test_files_that_are_not_plan_files_are_refused_and_an_absent_one_is_none(tmp_path):
    path = tmp_path / "R2-test.npy"
    assert open_small(path) is None
    for content in (b"garbage", b""):
        path.write_bytes(content)
        with pytest.raises(PlanFileInvalid, match="not an array file"):
            open_small(path)
    np.save(path, np.arange(4.0))
    with pytest.raises(PlanFileInvalid, match="not a plan file"):
        open_small(path)
    good = small_plan(tmp_path, [5, 1, 2, 0, 3, 4])
    words = np.load(good)
    np.save(path, words[:-1])  # truncated: the header no longer fits
    with pytest.raises(PlanFileInvalid, match="words, the header gives"):
        open_small(path)
    words[-1] = 1  # same shape, one word changed
    np.save(path, words)
    with pytest.raises(PlanFileInvalid, match="checksum does not match"):
        open_small(path)


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path):
    path = small_plan(tmp_path, [5, 1, 2, 0, 3, 4])
    before = path.read_bytes()
    with pytest.raises(ValueError, match="plans cover"):
        write_plan_cache(path, np.array([0, -1]), 7, 2, 2, [(np.arange(6), np.array([0, 1, 3, 4, 6]))])
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert plan_cache._checksum(np.load(path)) == int(np.load(path)[7])
