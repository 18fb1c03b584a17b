"""A real two-process torch.distributed job (gloo on CPU) replaying manifests through DataLoader + DDP."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dist_util import free_tcp_init_method, shutdown, spawn  # noqa: E402
from replay_util import pack_random, random_lengths  # noqa: E402

from balancer_cli.manifest import open_manifest  # noqa: E402

pytestmark = pytest.mark.dist


class _Dataset(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i)])


def _worker(rank: int, world: int, init_method: str, manifests: list[str], out: str) -> None:
    import torch.distributed as dist

    from balancer_cli.runtime import ManifestBatchSampler

    torch.set_num_threads(1)  # two ranks share the CPU cores
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        result = {}
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
        for manifest in manifests:
            lengths = str(Path(manifest) / "lengths.parquet")
            # rank and world size come from torch.distributed.
            sampler = ManifestBatchSampler(manifest, lengths=lengths)
            loader = torch.utils.data.DataLoader(_Dataset(sampler.num_samples), batch_sampler=sampler, num_workers=0)
            samples, batches = [], 0
            for step_index, batch in enumerate(loader):
                step = step_index // sampler.batches_per_step
                tokens = sampler.step_tokens(step).normalizer
                loss = model(batch).sum() * world / tokens
                loss.backward()  # a DDP all-reduce per batch: unequal batch counts would hang here
                samples += batch[:, 0].long().tolist()
                batches += 1
            gathered = [None] * world
            dist.all_gather_object(gathered, {"samples": samples, "batches": batches})
            result[manifest] = gathered
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        shutdown(dist)


def test_two_process_gloo_job_replays_native_and_elastic_manifests(tmp_path):
    lengths = random_lengths(240, seed=3)
    native = pack_random(tmp_path / "native", num_samples=240, world_size=2, micro_batches=2, lengths=lengths)
    elastic = pack_random(tmp_path / "elastic", num_samples=240, world_size=3, micro_batches=1, lengths=lengths)
    out = tmp_path / "result.json"
    spawn(_worker, (2, free_tcp_init_method(), [str(native), str(elastic)], str(out)), 2)
    result = json.loads(out.read_text())
    for manifest in (native, elastic):
        per_rank = result[str(manifest)]
        assert per_rank[0]["batches"] == per_rank[1]["batches"] > 0
        got = np.sort(per_rank[0]["samples"] + per_rank[1]["samples"])
        assert np.array_equal(got, np.sort(open_manifest(manifest).read_all().sample))
