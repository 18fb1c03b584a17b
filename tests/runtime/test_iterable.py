"""ManifestIterableDataset: a DataLoader over it with 0-3 workers yields exactly the sampler's batches in
manifest order, over epochs, after a resume (plain and torchdata loaders), and on two real gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dist_util import free_tcp_init_method, shutdown, spawn  # noqa: E402
from replay_util import pack_random, random_lengths  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from balancer_cli.errors import ManifestError, UsageError  # noqa: E402
from balancer_cli.manifest import open_manifest  # noqa: E402
from balancer_cli.runtime.collate import PackedCollator  # noqa: E402
from balancer_cli.runtime.iterable import ManifestIterableDataset  # noqa: E402
from balancer_cli.runtime.sampler import ManifestBatchSampler  # noqa: E402

N, R, M = 240, 2, 2
# The tests run 3 workers on machines with 2 cores on purpose (W > cores changes nothing in the order).
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


class Samples(torch.utils.data.Dataset):
    """Sample i: its index and 1 + i % 5 token ids; the loading process is recorded."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        return {"index": i, "input_ids": torch.arange(1 + i % 5) + i, "worker": None if info is None else info.id}


def indices(item):
    return [s["index"] for s in item]


def loader(dataset, workers, **kwargs):
    return DataLoader(dataset, batch_size=None, num_workers=workers, **kwargs)


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    lengths = random_lengths(N, seed=5)
    return pack_random(tmp_path_factory.mktemp("iter"), num_samples=N, world_size=R, micro_batches=M, epochs=2,
                       lengths=lengths)


@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_any_number_of_workers_yields_the_sampler_batches_in_order(manifest, workers):
    expected = list(ManifestBatchSampler(manifest, rank=1, world_size=R))
    dataset = ManifestIterableDataset(Samples(), manifest, rank=1, world_size=R)
    assert len(dataset) == len(expected) == len(loader(dataset, workers))
    got = list(loader(dataset, workers))
    assert [indices(item) for item in got] == expected
    # Group g was loaded by worker g mod W: the work is split, the order is kept.
    if workers:
        assert [{s["worker"] for s in item} for item in got] == [{g % workers} for g in range(len(got))]


def test_more_workers_than_groups(tmp_path):
    small = pack_random(tmp_path, num_samples=6, world_size=1, micro_batches=1, drop=0)
    expected = list(ManifestBatchSampler(small))
    assert len(expected) == 2
    samples = [{"index": i} for i in range(6)]
    assert [indices(item) for item in loader(ManifestIterableDataset(samples, small), 3)] == expected


@pytest.mark.parametrize("workers", [0, 3])
def test_two_epochs_and_a_collate_fn(manifest, workers):
    dataset = ManifestIterableDataset(Samples(), manifest, rank=0, world_size=R,
                                      collate_fn=PackedCollator(list_keys=("index", "worker")))
    for epoch in (0, 1, 2):  # epoch 2 replays packed epoch 0 in a new step order
        dataset.set_epoch(epoch)
        expected = list(ManifestBatchSampler(manifest, rank=0, world_size=R, epoch=epoch))
        got = list(loader(dataset, workers))
        assert [batch["index"] for batch in got] == expected
        for batch, group in zip(got, expected):
            assert batch["input_ids"].tolist() == [torch.cat([Samples()[i]["input_ids"] for i in group]).tolist()]
    assert expected != list(ManifestBatchSampler(manifest, rank=0, world_size=R, epoch=0))


def test_resume_without_workers_continues_after_the_last_group(manifest):
    expected = list(ManifestBatchSampler(manifest, rank=0, world_size=R, epoch=1))
    dataset = ManifestIterableDataset(Samples(), manifest, rank=0, world_size=R, epoch=1)
    it = iter(dataset)
    head = [indices(next(it)) for _ in range(5)]
    state = json.loads(json.dumps(dataset.state_dict()))
    resumed = ManifestIterableDataset(Samples(), manifest, rank=0, world_size=R)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)  # the usual epoch loop keeps the resume point
    assert len(resumed) == len(expected) - 5
    assert head + [indices(item) for item in resumed] == expected


@pytest.mark.parametrize("world", [R, 3])
def test_resume_at_a_step_with_prefetching_workers(manifest, world):
    """Workers run ahead of training; a state at a replay step resumes at that step's first group."""
    expected = list(ManifestBatchSampler(manifest, rank=1, world_size=world))
    dataset = ManifestIterableDataset(Samples(), manifest, rank=1, world_size=world)
    k = dataset.sampler.batches_per_step
    it = iter(loader(dataset, 2))
    for _ in range(3 * k):
        next(it)
    state = dataset.state_dict(step=3)
    del it
    resumed = ManifestIterableDataset(Samples(), ManifestBatchSampler(manifest, rank=1, world_size=world))
    resumed.load_state_dict(state)
    assert [indices(item) for item in loader(resumed, 3)] == expected[3 * k:]
    # A bare sampler state loads too.
    bare = ManifestIterableDataset(Samples(), manifest, rank=1, world_size=world)
    bare.load_state_dict(state["sampler"])
    assert [indices(item) for item in bare] == expected[3 * k:]


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("stop", [1, 4, 8])
def test_torchdata_stateful_loader_resumes_every_worker_exactly(manifest, stop):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    expected = list(ManifestBatchSampler(manifest, rank=0, world_size=R))

    def make():
        return stateful.StatefulDataLoader(ManifestIterableDataset(Samples(), manifest, rank=0, world_size=R),
                                           batch_size=None, num_workers=3)

    first = make()
    head = []
    for item in first:
        head.append(indices(item))
        if len(head) == stop:
            state = first.state_dict()
            break
    resumed = make()
    resumed.load_state_dict(state)
    assert head + [indices(item) for item in resumed] == expected


def test_bad_arguments(manifest):
    sampler = ManifestBatchSampler(manifest, rank=0, world_size=R)
    with pytest.raises(UsageError, match="rank, epoch given with a sampler, which has its own; fix: pass them"):
        ManifestIterableDataset(Samples(), sampler, rank=0, epoch=1)
    with pytest.raises(UsageError, match="manifest is a int, neither a manifest directory nor a sampler"):
        ManifestIterableDataset(Samples(), 3)
    with pytest.raises(ManifestError, match="the dataset has 10 samples"):
        ManifestIterableDataset(list(range(10)), sampler)
    with pytest.raises(ManifestError, match="the dataset has 10 samples"):
        ManifestIterableDataset(list(range(10)), manifest)


def _worker(rank: int, world: int, init_method: str, manifest: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks share the CPU cores
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        dataset = ManifestIterableDataset(Samples(), manifest)  # rank and world size from torch.distributed
        epochs = []
        for epoch in (0, 1):
            dataset.set_epoch(epoch)
            # fork: in a spawned rank, workers would be spawned too, each importing torch again (slow).
            epochs.append([indices(item) for item in loader(dataset, 2, multiprocessing_context="fork")])
        gathered = [None] * world
        dist.all_gather_object(gathered, {"rank": dataset.sampler.rank, "epochs": epochs})
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    finally:
        shutdown(dist)


@pytest.mark.dist
def test_two_gloo_ranks_each_get_their_manifest_batches(manifest, tmp_path):
    out = tmp_path / "result.json"
    spawn(_worker, (R, free_tcp_init_method(), str(manifest), str(out)), R)
    result = json.loads(out.read_text())
    rows = open_manifest(manifest).read_all()
    placed = np.sort(np.unique(rows.sample))
    for rank, got in enumerate(result):
        assert got["rank"] == rank
        for epoch in (0, 1):
            assert got["epochs"][epoch] == list(ManifestBatchSampler(manifest, rank=rank, world_size=R, epoch=epoch))
    for epoch in (0, 1):
        every = np.sort([i for got in result for batch in got["epochs"][epoch] for i in batch])
        assert np.array_equal(every, placed) and len(placed) == N - 5  # every placed sample once per epoch
