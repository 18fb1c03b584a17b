"""Elastic plans kept beside the manifest: read back, they are exactly the plans computed as the
replay goes, in every epoch and after a resume; a folder that cannot be written or a file that is
not a plan file only means planning as the replay goes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from resume_util import run

from balancer_cli.replay import epoch_plan
from balancer_cli.replay.cursor import ManifestReplay
from balancer_cli.replay.plan_cache import PLANS_DIR


def every_rank(manifest, world, epoch=0, **kwargs):
    return [list(ManifestReplay(manifest, rank=r, world_size=world, epoch=epoch, **kwargs)) for r in range(world)]


@pytest.mark.parametrize("world", [1, 3, 5, 8])
@pytest.mark.parametrize("use_lengths", [True, False])
def test_plans_read_from_the_file_are_the_plans_computed_live(capped, world, use_lengths, monkeypatch):
    manifest, lengths = capped
    kwargs = {"lengths": lengths} if use_lengths else {}
    live = [every_rank(manifest, world, epoch, plan_cache=False, **kwargs) for epoch in (0, 1, 2)]
    assert not (manifest / PLANS_DIR).exists()
    assert every_rank(manifest, world, **kwargs) == live[0]  # rank 0 writes the file on its first pass
    assert len(list((manifest / PLANS_DIR).glob(f"R{world}-*.npy"))) == 1
    planned = []
    original = epoch_plan.plan_units
    monkeypatch.setattr(epoch_plan, "plan_units", lambda *a, **k: planned.append(1) or original(*a, **k))
    for epoch in (0, 1, 2):  # epoch 2 reshuffles the steps of epoch 0
        replays = [ManifestReplay(manifest, rank=r, world_size=world, epoch=epoch, **kwargs) for r in range(world)]
        for replay in replays:
            assert replay.elastic_report is not None  # (its first steps are planned to measure them)
        planned.clear()
        assert [list(replay) for replay in replays] == live[epoch]
        assert not planned, "every step was read from the plan file"


def test_a_resume_inside_a_step_plans_that_step_and_reads_the_rest(capped):
    manifest, lengths = capped
    for saved, new in ((4, 3), (3, 5), (5, 3)):
        _, state = run(manifest, saved, cut=3, lengths=lengths, plan_cache=False)
        live, _ = run(manifest, new, state=state, lengths=lengths, plan_cache=False)
        every_rank(manifest, new, lengths=lengths)  # writes the plan file of `new` ranks
        cached, _ = run(manifest, new, state=state, lengths=lengths)
        assert cached == live


def test_a_folder_that_cannot_be_written_plans_as_the_replay_goes(capped, tmp_path):
    manifest, lengths = capped
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    live = every_rank(manifest, 3, lengths=lengths, plan_cache=False)
    assert every_rank(manifest, 3, lengths=lengths, plan_cache=blocked / "plans") == live
    assert every_rank(manifest, 3, lengths=lengths, plan_cache=False) == live
    assert not (manifest / PLANS_DIR).exists()


def test_a_file_that_is_not_a_plan_file_is_replaced(capped):
    manifest, lengths = capped
    live = every_rank(manifest, 3, lengths=lengths, plan_cache=False)
    every_rank(manifest, 3, lengths=lengths)
    (path,) = (manifest / PLANS_DIR).glob("R3-*.npy")
    for garbage in (b"garbage", np.arange(10).tobytes()):
        path.write_bytes(garbage)
        assert every_rank(manifest, 3, lengths=lengths) == live
        replay = ManifestReplay(manifest, rank=1, world_size=3, lengths=lengths)
        assert replay._planner.plan_cache(3) is not None  # rank 0 wrote it again  # noqa: SLF001


def test_each_lengths_table_and_world_size_has_its_own_file(capped):
    manifest, lengths = capped
    for world in (3, 5):
        every_rank(manifest, world, lengths=lengths)
        every_rank(manifest, world)
    names = sorted(p.name for p in (manifest / PLANS_DIR).iterdir())
    assert len(names) == 4 and sum(n.startswith("R3-") for n in names) == 2, names


def test_a_pickled_replay_maps_the_file_again(capped):
    import pickle

    manifest, lengths = capped
    every_rank(manifest, 3, lengths=lengths)
    replay = ManifestReplay(manifest, rank=2, world_size=3, lengths=lengths)
    it = iter(replay)
    first = [next(it) for _ in range(4)]
    copy = pickle.loads(pickle.dumps(replay))
    assert json.dumps(copy.state_dict()) == json.dumps(replay.state_dict())
    assert first + list(copy) == every_rank(manifest, 3, lengths=lengths, plan_cache=False)[2]
