"""Hand-written training loops on two gloo processes: the docs' plain, torchdata, torchtitan-style
(``DeviceMesh``), DeepSpeed and Megatron-LM snippets, and ``dp_group=``, each replaying the manifest.

One spawn runs them all (processes are slow to start). DeepSpeed and Megatron-LM are not installed
here: their snippets run against stand-ins of the API they use (``deepspeed.initialize`` returning
an engine with ``data_parallel_group``; Megatron's ``parallel_state`` with the data-parallel rank,
size and group), backed by the real gloo process group. Each process's batches are compared with
the manifest's rows over two epochs of a manifest packed with ``--epochs 2``.
"""

from __future__ import annotations

import json
import multiprocessing
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dist_util import free_tcp_init_method, shutdown, spawn  # noqa: E402
from replay_util import random_lengths  # noqa: E402

from balancer_cli.lengths import write_lengths  # noqa: E402
from balancer_cli.manifest import open_manifest, read_dropped  # noqa: E402
from balancer_cli.pack.config import PackConfig  # noqa: E402
from balancer_cli.replay.cursor import ManifestReplay  # noqa: E402
from balancer_cli.run import pack_to_dir  # noqa: E402

pytestmark = pytest.mark.dist

DOC = Path(__file__).resolve().parents[2] / "docs" / "runtime.md"
WORLD, MICRO, SAMPLES = 2, 2, 120


def snippet(name: str) -> str:
    match = re.search(rf"<!-- snippet: {name} -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert match, f"docs/runtime.md has no snippet {name!r}"
    return match.group(1)


def manifest_batches(manifest, rank: int, epoch: int) -> list[list[int]]:
    """Rank ``rank``'s groups of epoch ``epoch``, read from the manifest's rows (step, then micro)."""
    m = open_manifest(manifest)
    rows, first = m.read_all(), sum(m.epoch_num_steps[:epoch])
    keep = (rows.step >= first) & (rows.step < first + m.epoch_num_steps[epoch]) & (rows.rank == rank)
    groups: dict[tuple[int, int], list[int]] = {}
    for step, micro, sample in zip(rows.step[keep], rows.micro[keep], rows.sample[keep]):
        groups.setdefault((int(step), int(micro)), []).append(int(sample))
    return [groups[key] for key in sorted(groups)]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A manifest of the real packer, ``balancer pack --dp 2 --micro-batches 2 --epochs 2``."""
    tmp = tmp_path_factory.mktemp("loops")
    write_lengths(random_lengths(SAMPLES, seed=6), tmp / "lengths.parquet")
    pack_to_dir([tmp / "lengths.parquet"], tmp / "out",
                PackConfig(world_size=WORLD, micro_batches=MICRO, epochs=2), baselines=())
    return tmp / "out", tmp / "lengths.parquet"


class Indexed(torch.utils.data.Dataset):
    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return i


def collate(indices):
    return {"index": list(indices), "x": torch.tensor(indices, dtype=torch.float32)[:, None] + 1}


class Recorder(torch.nn.Module):
    """Its summed 'loss' is sum(x); it records the samples of every batch."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.seen = []

    def forward(self, batch):
        self.seen.append(batch["index"])
        return (self.w * batch["x"]).sum()


class FakeEngine:
    """What the DeepSpeed snippet uses of an engine; the optimizer 'steps' every gradient_accumulation_steps."""

    def __init__(self, model, config):
        self.module, self.accumulation = model, config["gradient_accumulation_steps"]
        self.data_parallel_group = torch.distributed.group.WORLD
        self.micro_steps = self.optimizer_steps = 0

    def __call__(self, batch):
        return self.module(batch)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.micro_steps += 1
        self.optimizer_steps += self.micro_steps % self.accumulation == 0


def _fake_megatron(dp_rank: int, dp_size: int) -> None:
    """Megatron's ``parallel_state`` as far as the snippet (and the sampler's check) read it."""
    state = types.ModuleType("megatron.core.parallel_state")
    state.model_parallel_is_initialized = lambda: True
    state.get_data_parallel_rank = lambda: dp_rank
    state.get_data_parallel_world_size = lambda: dp_size
    state.get_data_parallel_group = lambda: torch.distributed.group.WORLD
    core = types.ModuleType("megatron.core")
    core.parallel_state = state
    megatron = types.ModuleType("megatron")
    megatron.core = core
    sys.modules.update({"megatron": megatron, "megatron.core": core, "megatron.core.parallel_state": state})


def _worker(rank: int, world: int, init_method: str, manifest: str, lengths: str, out: str) -> None:
    import torch.distributed as dist

    from balancer_cli.runtime.sampler import ManifestBatchSampler

    torch.set_num_threads(1)
    # The plain and torchdata snippets use DataLoader workers; fork them as a torchrun job would
    # (a spawned process inherits the spawn method, and each spawned worker re-imports torch).
    multiprocessing.set_start_method("fork", force=True)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        base = {"manifest_dir": manifest, "lengths_path": lengths, "dataset": Indexed(), "collate": collate,
                "num_epochs": 2}
        result = {}
        # Plain DataLoader: rank and world size from torch.distributed.
        plain = {**base, "model": Recorder(), "checkpoint": None}
        exec(snippet("plain"), plain)
        result["plain"] = plain["model"].seen
        # torchdata: stops after 5 batches, resumes from the loader's state.
        data = {**base}
        exec(snippet("torchdata"), data)
        result["torchdata"] = [batch["index"] for batch in data["seen"] + data["rest"]]
        # torchtitan-style: a 1-D "dp" mesh, then (dp=1, tp=2), where both processes are one DP rank.
        for name, shape, names in (("mesh_dp", (world,), ("dp",)), ("mesh_tp", (1, world), ("dp", "tp"))):
            loop = {**base, "model": Recorder(), "device_type": "cpu", "mesh_shape": shape, "mesh_dim_names": names}
            exec(snippet("torchtitan"), loop)
            result[name] = loop["model"].seen
            result[name + "_rank"] = [loop["sampler"].rank, loop["sampler"].world_size]
        # dp_group=: the group's rank and size.
        group = dist.new_group(list(range(world)))
        result["dp_group"] = list(ManifestBatchSampler(manifest, dp_group=group))
        # DeepSpeed: the engine's data-parallel group.
        sys.modules["deepspeed"] = types.SimpleNamespace(
            initialize=lambda model, model_parameters, config: (FakeEngine(model, config), None, None, None))
        deep = {**base, "model": Recorder(), "ds_config": {"gradient_accumulation_steps": MICRO}}
        exec(snippet("deepspeed"), deep)
        result["deepspeed"] = deep["model"].seen
        result["deepspeed_steps"] = deep["engine"].optimizer_steps
        # Megatron-LM: the data-parallel rank and size from mpu, two epochs pulled from its iterator.
        _fake_megatron(dist.get_rank(), world)
        mega = {**base}
        exec(snippet("megatron"), mega)
        micro_batches, _, _ = mega["train_valid_test_datasets_provider"]([SAMPLES, 0, 0])
        per_epoch = len(ManifestBatchSampler(manifest, rank=rank, world_size=world))
        result["megatron"] = [next(micro_batches)["index"] for _ in range(2 * per_epoch)]
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        shutdown(dist)


def test_hand_written_loops_replay_the_manifest_on_two_processes(packed, tmp_path):
    pytest.importorskip("torchdata")
    manifest, lengths = packed
    spawn(_worker, (WORLD, free_tcp_init_method(), str(manifest), str(lengths), str(tmp_path)), WORLD)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    expected = [[manifest_batches(manifest, r, e) for e in range(2)] for r in range(WORLD)]
    assert expected[0][0] != expected[0][1]  # the packed epochs differ: replaying epoch 0 twice would show
    # (dp=1, tp=2): both processes are DP rank 0 of 1, the manifest replayed elastically on one rank.
    one_rank = [list(ManifestReplay(manifest, 0, 1, epoch=e, lengths=lengths)) for e in range(2)]
    dropped, _ = read_dropped(manifest)
    placed = np.setdiff1d(np.arange(SAMPLES), dropped)
    for rank, result in enumerate(results):
        both = expected[rank][0] + expected[rank][1]
        assert result["torchdata"] == expected[rank][0]
        assert result["dp_group"] == expected[rank][0]
        for name in ("plain", "mesh_dp", "deepspeed", "megatron"):
            assert result[name] == both, name
        assert result["mesh_dp_rank"] == [rank, WORLD] and result["mesh_tp_rank"] == [0, 1]
        assert result["mesh_tp"] == one_rank[0] + one_rank[1]
        assert result["deepspeed_steps"] == len(both) // MICRO
    first = len(expected[0][0])  # batches of epoch 0, the same on every rank (MICRO groups a step)
    for name in ("plain", "mesh_dp", "deepspeed", "megatron"):
        for epoch in (slice(None, first), slice(first, None)):
            got = np.concatenate([b for r in results for b in r[name][epoch]])
            assert np.array_equal(np.sort(got), placed), name  # every placed sample exactly once per epoch
    for batches in one_rank:
        assert np.array_equal(np.sort(np.concatenate(batches)), placed)
