"""ManifestBatchSampler: a torch Sampler over ManifestReplay (same batches, lengths, states and
tokens), ranks from the environment, its log, pickling for workers, and a prefetching DataLoader.

The replay itself (exactness, conservation, epochs, resume, elastic) is tested without torch in
tests/replay/test_replay_cursor.py; the real multi-process job is in test_runtime_dist.py.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from replay_util import pack_random, random_lengths, simulate  # noqa: E402

from balancer_cli.errors import UsageError  # noqa: E402
from balancer_cli.replay.cursor import ManifestReplay  # noqa: E402
from balancer_cli.runtime import ManifestBatchSampler  # noqa: E402

R, M = 4, 2


@pytest.fixture(scope="module")
def lengths():
    return random_lengths(300, seed=1, loss_tokens=True)


@pytest.fixture(scope="module")
def manifest(tmp_path_factory, lengths):
    return pack_random(tmp_path_factory.mktemp("m"), num_samples=300, world_size=R, micro_batches=M, epochs=2,
                       lengths=lengths, extra=True)


@pytest.mark.parametrize("world", [R, 3])
def test_the_sampler_is_the_replay_as_a_torch_sampler(manifest, lengths, world):
    sampler = ManifestBatchSampler(manifest, rank=1, world_size=world, epoch=1, lengths=lengths)
    replay = ManifestReplay(manifest, rank=1, world_size=world, epoch=1, lengths=lengths)
    assert isinstance(sampler, torch.utils.data.Sampler)
    for name in ("rank", "world_size", "manifest_world_size", "micro_batches", "batches_per_step", "num_samples",
                 "fingerprint", "num_epochs_packed", "epoch", "steps_per_epoch", "next_step", "next_micro"):
        assert getattr(sampler, name) == getattr(replay, name), name
    assert (sampler.elastic_report is None) == (world == R) and sampler.elastic_report == replay.elastic_report
    assert len(sampler) == len(replay) and list(sampler) == list(replay)
    assert [sampler.step_tokens(s) for s in range(3)] == [replay.step_tokens(s) for s in range(3)]
    assert [sampler.batches_in_step(s) for s in range(3)] == [replay.batches_in_step(s) for s in range(3)]
    sampler.set_epoch(0)
    replay.set_epoch(0)
    its = iter(sampler), iter(replay)
    for it in its:
        for _ in range(M + 1):
            next(it)
    assert sampler.state_dict() == replay.state_dict() and sampler.state_dict(step=2) == replay.state_dict(step=2)
    assert (sampler.next_step, sampler.next_micro) == (replay.next_step, replay.next_micro)
    resumed = ManifestBatchSampler(manifest, rank=1, world_size=world, lengths=lengths)
    resumed.load_state_dict(json.loads(json.dumps(replay.state_dict())))
    assert list(resumed) == list(its[1])


def test_elastic_report_is_logged_once(manifest, caplog):
    with caplog.at_level("INFO", logger="balancer_cli.runtime"):
        sampler = ManifestBatchSampler(manifest, rank=0, world_size=3)
        list(sampler)
        list(sampler)
    lines = [r.message for r in caplog.records if "elastic replay" in r.message]
    assert len(lines) == 1 and "packed for 4 ranks" in lines[0] and "replaying on 3 ranks" in lines[0]


def test_rank_and_world_size_come_from_the_environment(manifest, monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    sampler = ManifestBatchSampler(manifest)
    assert (sampler.rank, sampler.world_size) == (2, 3)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert (ManifestBatchSampler(manifest).rank, ManifestBatchSampler(manifest).world_size) == (0, 1)


def test_a_rank_outside_the_world_is_a_usage_error(manifest):
    with pytest.raises(UsageError, match="rank 4 is not in 0..3") as error:
        ManifestBatchSampler(manifest, rank=4, world_size=R)
    assert "set RANK and WORLD_SIZE" in str(error.value)


def test_sampler_pickles_for_worker_processes(manifest):
    import pickle

    sampler = ManifestBatchSampler(manifest, rank=1, world_size=R)
    assert list(pickle.loads(pickle.dumps(sampler))) == list(sampler)


@pytest.mark.parametrize("world", [R, 3])
def test_state_for_a_step_lets_a_prefetching_loop_resume_exactly(manifest, lengths, world):
    """With DataLoader workers the sampler runs ahead; state_dict(step=s) resumes at step s."""
    full = simulate(manifest, world, lengths=lengths)
    sampler = ManifestBatchSampler(manifest, rank=1, world_size=world, lengths=lengths)
    k = sampler.batches_per_step
    loader = torch.utils.data.DataLoader(list(range(300)), batch_sampler=sampler, num_workers=2,
                                         collate_fn=lambda b: b)
    it = iter(loader)
    for _ in range(2 * k):
        next(it)
    assert sampler.next_step > 2, "the workers have prefetched ahead"
    state = sampler.state_dict(step=2)
    del it
    resumed = ManifestBatchSampler(manifest, rank=1, world_size=world, lengths=lengths)
    resumed.load_state_dict(state)
    assert (resumed.next_step, resumed.next_micro) == (2, 0)
    assert list(resumed) == full[1][2 * k:]
    assert [resumed.batches_in_step(s) for s in range(resumed.steps_per_epoch)] == [k] * resumed.steps_per_epoch
