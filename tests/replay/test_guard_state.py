"""Sampler state validation: every field of a state checked (type, range, identity) before a resume."""

from __future__ import annotations

import pytest
from replay_util import pack_random, random_lengths

from balancer_cli.errors import ManifestError
from balancer_cli.replay.cursor import ManifestReplay
from balancer_cli.replay.state import MAX_HEAD_DEPTH

R, M = 2, 2


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    lengths = random_lengths(60, seed=3)
    return pack_random(tmp_path_factory.mktemp("m"), num_samples=60, world_size=R, micro_batches=M, epochs=1,
                       lengths=lengths)


@pytest.fixture()
def saved(manifest):
    replay = ManifestReplay(manifest, rank=0, world_size=R)
    batches = iter(replay)
    next(batches), next(batches), next(batches)
    return replay.state_dict()


BAD_FIELDS = [
    ("position", -5), ("batch_in_step", -1), ("step", -1), ("epoch", -1), ("world_size", 0),
    ("position", 1.5), ("position", "3"), ("position", True), ("batch_in_step", None), ("step", [1]),
    ("position", 10**9), ("batch_in_step", 10**9), ("version", True), ("version", 99), ("version", "2"),
    ("fingerprint", "0" * 32), ("fingerprint", None), ("lengths", 5), ("caps", "vision"),
    ("caps", {"vision": "x"}), ("caps", {"vision": -1}), ("head", 7), ("head", {"step": 0}),
]


@pytest.mark.parametrize(("key", "value"), BAD_FIELDS, ids=[f"{k}={v!r}"[:40] for k, v in BAD_FIELDS])
def test_a_bad_field_is_refused_and_the_replay_keeps_its_position(manifest, saved, key, value):
    replay = ManifestReplay(manifest, rank=0, world_size=R)
    expected = list(ManifestReplay(manifest, rank=0, world_size=R))
    with pytest.raises(ManifestError):
        replay.load_state_dict(dict(saved, **{key: value}))
    assert list(replay) == expected  # a refused state changed nothing


def test_a_missing_field_or_a_non_dict_is_refused(manifest, saved):
    replay = ManifestReplay(manifest, rank=0, world_size=R)
    for key in ("position", "batch_in_step", "world_size", "epoch", "step", "head"):
        with pytest.raises(ManifestError, match=key):
            replay.load_state_dict({k: v for k, v in saved.items() if k != key})
    for state in ([1, 2], "state", None):
        with pytest.raises(ManifestError):
            replay.load_state_dict(state)


def test_a_head_chain_deeper_than_the_limit_is_refused_without_recursion_error(manifest, saved):
    head = None
    for _ in range(MAX_HEAD_DEPTH + 5000):
        head = {"world_size": 1, "step": 0, "position": 0, "batch_in_step": 0, "head": head}
    replay = ManifestReplay(manifest, rank=0, world_size=R)
    with pytest.raises(ManifestError, match="nests more than"):
        replay.load_state_dict(dict(saved, head=head))


def test_the_saved_state_itself_resumes_exactly(manifest, saved):
    first = ManifestReplay(manifest, rank=0, world_size=R)
    full = list(first)
    resumed = ManifestReplay(manifest, rank=0, world_size=R)
    resumed.load_state_dict(saved)
    assert list(resumed) == full[3:]
