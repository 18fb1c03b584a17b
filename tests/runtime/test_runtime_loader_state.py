"""Resuming a torchdata ``StatefulDataLoader`` with another number of workers: the sampler's part of
the loader's state (``sampler_state_from_loader``) resumes exactly; the rest is left behind.

Needs torch and torchdata (skipped without them; ``sampler_state_from_loader`` itself is torch-free).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
stateful = pytest.importorskip("torchdata.stateful_dataloader")
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create", "ignore:'set_vital' is deprecated")

from replay_util import pack_random, random_lengths  # noqa: E402

from balancer_cli.errors import UsageError  # noqa: E402
from balancer_cli.replay.loader_state import sampler_state_from_loader  # noqa: E402
from balancer_cli.runtime import ManifestBatchSampler  # noqa: E402


def collate(batch):
    return list(batch)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    lengths = random_lengths(200, seed=6)
    manifest = pack_random(tmp_path_factory.mktemp("m"), num_samples=200, world_size=2, micro_batches=2,
                           lengths=lengths, seed=6)
    return manifest, lengths


def loader(manifest, lengths, world, workers, **kwargs):
    sampler = ManifestBatchSampler(manifest, rank=1, world_size=world, lengths=lengths)
    return sampler, stateful.StatefulDataLoader(list(range(200)), batch_sampler=sampler, collate_fn=collate,
                                                num_workers=workers, **kwargs)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("saved_workers, new_workers, every", [(2, 0, 1), (0, 3, 1), (2, 3, 3)])
def test_the_samplers_part_resumes_with_another_number_of_workers(setup, world, saved_workers, new_workers, every):
    manifest, lengths = setup
    full = list(ManifestBatchSampler(manifest, rank=1, world_size=world, lengths=lengths))
    for cut in (0, 3, 5, len(full)):
        _, first = loader(manifest, lengths, world, saved_workers, snapshot_every_n_steps=every)
        it = iter(first)
        seen = [next(it) for _ in range(cut)]
        state = first.state_dict()
        del it
        sampler, resumed = loader(manifest, lengths, world, new_workers)
        sampler.load_state_dict(sampler_state_from_loader(state))  # not resumed.load_state_dict(state)
        assert seen + list(resumed) == full, (cut, saved_workers, new_workers)


def test_the_same_number_of_workers_resumes_through_the_loader(setup):
    manifest, lengths = setup
    full = list(ManifestBatchSampler(manifest, rank=1, world_size=3, lengths=lengths))
    _, first = loader(manifest, lengths, 3, 2)
    it = iter(first)
    seen = [next(it) for _ in range(4)]
    state = first.state_dict()
    del it
    _, resumed = loader(manifest, lengths, 3, 2)
    resumed.load_state_dict(state)
    assert seen + list(resumed) == full


def test_what_is_not_a_loader_state_is_a_usage_error():
    with pytest.raises(UsageError, match="not a StatefulDataLoader state"):
        sampler_state_from_loader({"version": 2})
    with pytest.raises(UsageError, match="saved no state"):
        sampler_state_from_loader({"_index_sampler_state": None, "_num_yielded": 3})
