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
import sys
import types
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dist_util import free_tcp_init_method, shutdown, spawn  # noqa: E402
from runtime_util import (  # noqa: E402
    MICRO,
    SAMPLES,
    WORLD,
    Indexed,
    Recorder,
    index_batch,
    manifest_epochs,
    snippet,
    two_epoch_manifest,
)

from balancer_cli.replay.cursor import ManifestReplay  # noqa: E402

pytestmark = pytest.mark.dist

packed = two_epoch_manifest("loops", seed=6)


def collate(indices):
    """The model's 'loss' is sum(x), x = index + 1."""
    return index_batch(indices, offset=1)


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
        plain = {**base, "model": Recorder(key="x"), "checkpoint": None}
        exec(snippet("plain"), plain)
        result["plain"] = plain["model"].seen
        # torchdata: stops after 5 batches, resumes from the loader's state.
        data = {**base}
        exec(snippet("torchdata"), data)
        result["torchdata"] = [batch["index"] for batch in data["seen"] + data["rest"]]
        # torchtitan-style: a 1-D "dp" mesh, then (dp=1, tp=2), where both processes are one DP rank.
        for name, shape, names in (("mesh_dp", (world,), ("dp",)), ("mesh_tp", (1, world), ("dp", "tp"))):
            loop = {**base, "model": Recorder(key="x"), "device_type": "cpu", "mesh_shape": shape,
                    "mesh_dim_names": names}
            exec(snippet("torchtitan"), loop)
            result[name] = loop["model"].seen
            result[name + "_rank"] = [loop["sampler"].rank, loop["sampler"].world_size]
        # dp_group=: the group's rank and size.
        group = dist.new_group(list(range(world)))
        result["dp_group"] = list(ManifestBatchSampler(manifest, dp_group=group))
        # DeepSpeed: the engine's data-parallel group.
        sys.modules["deepspeed"] = types.SimpleNamespace(
            initialize=lambda model, model_parameters, config: (FakeEngine(model, config), None, None, None))
        deep = {**base, "model": Recorder(key="x"), "ds_config": {"gradient_accumulation_steps": MICRO}}
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
    expected, placed = manifest_epochs(manifest)
    # (dp=1, tp=2): both processes are DP rank 0 of 1, the manifest replayed elastically on one rank.
    one_rank = [list(ManifestReplay(manifest, 0, 1, epoch=e, lengths=lengths)) for e in range(2)]
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
