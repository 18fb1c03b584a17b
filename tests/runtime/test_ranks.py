"""resolve_rank and mesh_rank: the data-parallel rank from explicit values, a process group, a DeviceMesh
or the environment, and the refusals where the global rank would silently be taken for a data-parallel one.

No processes here: process groups and meshes are stand-ins with the API that is read; real ones on two
gloo processes are in test_trainers_loops.py.
"""

from __future__ import annotations

import sys
import types

import pytest

torch = pytest.importorskip("torch")

from replay_util import pack_random  # noqa: E402

from balancer_cli.errors import UsageError  # noqa: E402
from balancer_cli.runtime.ranks import mesh_rank, resolve_rank  # noqa: E402
from balancer_cli.runtime.sampler import ManifestBatchSampler  # noqa: E402


class Mesh:
    """A DeviceMesh as mesh_rank reads it: dimension names, this process's coordinate, sizes."""

    def __init__(self, names, shape, coordinate):
        self.mesh_dim_names, self.shape, self.coordinate, self.ndim = names, shape, coordinate, len(shape)

    def get_coordinate(self):
        return self.coordinate

    def size(self, dim):
        return self.shape[dim]


def test_explicit_values_then_the_environment_then_one_process(env):
    assert resolve_rank() == (0, 1)
    assert resolve_rank(2, 3) == (2, 3)
    env.setenv("RANK", "3")
    env.setenv("WORLD_SIZE", "4")
    assert resolve_rank() == (3, 4) and resolve_rank(rank=1) == (1, 4) and resolve_rank(world_size=4) == (3, 4)
    assert resolve_rank(1, 2) == (1, 2)  # both explicit: the environment is not consulted
    with pytest.raises(UsageError, match="rank 5 is not in 0..3"):
        resolve_rank(rank=5)


def test_world_size_alone_that_is_not_the_environments_is_refused(env):
    """Under TP=2 on 4 processes, world_size=2 with the global RANK would give TP peers different data."""
    env.setenv("RANK", "1")
    env.setenv("WORLD_SIZE", "4")
    with pytest.raises(UsageError, match="world_size 2 was given but the rank would be the global one, of 4"):
        resolve_rank(world_size=2)


def test_world_size_without_rank_before_the_process_group_is_refused(env):
    """Lightning's launcher sets WORLD_SIZE and LOCAL_RANK, not RANK, and joins the group only in fit()."""
    env.setenv("WORLD_SIZE", "2")
    env.setenv("LOCAL_RANK", "1")
    with pytest.raises(UsageError, match="RANK is not set and torch.distributed is not initialized") as error:
        resolve_rank()
    assert "train_dataloader()" in str(error.value)
    env.setenv("WORLD_SIZE", "1")
    assert resolve_rank() == (0, 1)


def test_the_process_group_when_initialized(env):
    env.setattr(torch.distributed, "is_initialized", lambda: True)
    env.setattr(torch.distributed, "get_rank", lambda group=None: 1 if group is None else group["rank"])
    env.setattr(torch.distributed, "get_world_size", lambda group=None: 4 if group is None else group["size"])
    assert resolve_rank() == (1, 4)
    # dp_group: its rank and size; explicit values must agree; its size must divide the job's.
    group = {"rank": 0, "size": 2}
    assert resolve_rank(dp_group=group) == (0, 2) and resolve_rank(0, 2, dp_group=group) == (0, 2)
    with pytest.raises(UsageError, match="world_size 4 disagrees with dp_group, which says 2"):
        resolve_rank(world_size=4, dp_group=group)
    with pytest.raises(UsageError, match="rank 1 disagrees with dp_group, which says 0"):
        resolve_rank(rank=1, dp_group=group)
    with pytest.raises(UsageError, match="dp_group has 3 data-parallel ranks, which does not divide the 4"):
        resolve_rank(dp_group={"rank": 0, "size": 3})
    with pytest.raises(UsageError, match="this process is not in dp_group"):
        resolve_rank(dp_group={"rank": -1, "size": 2})


def test_mesh_rank_reads_the_data_parallel_dimension():
    # (dp=2, tp=2) seen from global rank 3: DP rank 1 of 2.
    mesh = Mesh(("dp", "tp"), (2, 2), (1, 1))
    assert mesh_rank(mesh) == (1, 2) and mesh_rank(mesh, "tp") == (1, 2)
    assert mesh_rank(Mesh(("pp", "batch", "cp", "tp"), (2, 4, 1, 2), (0, 3, 0, 1))) == (3, 4)  # torchtitan
    assert mesh_rank(Mesh(None, (8,), (5,))) == (5, 8)  # a 1-D mesh without names
    # Several dimensions flatten with the last varying fastest: (dp_replicate=2, dp_shard=3), coordinate (1, 2).
    hsdp = Mesh(("dp_replicate", "dp_shard", "tp"), (2, 3, 2), (1, 2, 0))
    assert mesh_rank(hsdp, ("dp_replicate", "dp_shard")) == (5, 6)
    with pytest.raises(UsageError, match="no data-parallel dimension named dp or batch .its dimensions: "
                                         "dp_replicate, dp_shard, tp"):
        mesh_rank(hsdp)
    with pytest.raises(UsageError, match="no dimension fsdp"):
        mesh_rank(hsdp, "fsdp")
    with pytest.raises(UsageError, match="not in the mesh"):
        mesh_rank(Mesh(("dp",), (2,), None))


def test_resolve_rank_with_a_mesh(env):
    env.setenv("RANK", "3")
    env.setenv("WORLD_SIZE", "4")
    mesh = Mesh(("dp", "tp"), (2, 2), (1, 1))
    assert resolve_rank(mesh=mesh) == (1, 2) and resolve_rank(1, 2, mesh=mesh, mesh_dim="dp") == (1, 2)
    with pytest.raises(UsageError, match="rank 3 disagrees with the mesh, which says 1"):
        resolve_rank(rank=3, mesh=mesh)
    with pytest.raises(UsageError, match="the mesh has 3 data-parallel ranks, which does not divide the 4"):
        resolve_rank(mesh=Mesh(("dp",), (3,), (0,)))
    with pytest.raises(UsageError, match="both dp_group and mesh"):
        resolve_rank(dp_group=object(), mesh=mesh)
    with pytest.raises(UsageError, match="mesh_dim 'dp' was given without a mesh"):
        resolve_rank(mesh_dim="dp")


def _megatron(env, initialized: bool, dp_size: int) -> None:
    state = types.SimpleNamespace(model_parallel_is_initialized=lambda: initialized,
                                  get_data_parallel_world_size=lambda: dp_size, get_data_parallel_rank=lambda: 0)
    env.setitem(sys.modules, "megatron.core.parallel_state", state)


def test_megatrons_parallel_state_refuses_the_global_rank(env):
    """TP=2 on 4 processes: 2 data-parallel ranks. The default global rank would replay over 4."""
    env.setenv("RANK", "2")
    env.setenv("WORLD_SIZE", "4")
    _megatron(env, initialized=True, dp_size=2)
    with pytest.raises(UsageError, match="of 4 processes, but Megatron's parallel state has 2 data-parallel") as error:
        resolve_rank()
    assert "rank=mpu.get_data_parallel_rank()" in str(error.value)
    assert resolve_rank(1, 2) == (1, 2)  # what the Megatron snippet passes
    _megatron(env, initialized=True, dp_size=4)  # pure data parallelism: the global rank is the DP rank
    assert resolve_rank() == (2, 4)
    _megatron(env, initialized=False, dp_size=2)  # imported but not set up: nothing to compare with
    assert resolve_rank() == (2, 4)


def test_the_sampler_takes_its_rank_from_a_mesh(env, tmp_path):
    manifest = pack_random(tmp_path, num_samples=80, world_size=2, micro_batches=1)
    env.setenv("RANK", "3")
    env.setenv("WORLD_SIZE", "4")
    sampler = ManifestBatchSampler(manifest, mesh=Mesh(("dp", "tp"), (2, 2), (1, 1)))
    assert (sampler.rank, sampler.world_size) == (1, 2)
    assert list(sampler) == list(ManifestBatchSampler(manifest, rank=1, world_size=2))
    with pytest.raises(UsageError, match="world_size 2 was given"):
        ManifestBatchSampler(manifest, world_size=2)
