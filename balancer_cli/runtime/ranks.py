"""Which data-parallel rank this process is, and how many there are.

A manifest is packed for data-parallel (DP) ranks. Without tensor, pipeline or context
parallelism every process is one, and the global ``RANK``/``WORLD_SIZE`` are right. With them,
several processes (the model-parallel peers of one DP rank) must replay the same batches, so
the DP rank comes from the DP process group (``dp_group=``) or the data-parallel dimension of a
``DeviceMesh`` (``mesh=``), or is passed as ``rank``/``world_size``. Nothing here communicates.

Example:
    >>> resolve_rank(1, 4)
    (1, 4)
"""

from __future__ import annotations

import operator
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from balancer_cli.errors import UsageError
from balancer_cli.replay.cursor import check_rank

__all__ = ["resolve_rank", "mesh_rank"]

#: Mesh dimensions that hold the data-parallel rank, tried in order when ``mesh_dim`` is not given:
#: accelerate's and older torchtitan's flattened ``dp``, current torchtitan's data-loading ``batch``.
DP_DIM_NAMES = ("dp", "batch")


def resolve_rank(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    dp_group: Any = None,
    mesh: Any = None,
    mesh_dim: str | Sequence[str] | None = None,
) -> tuple[int, int]:
    """``(rank, world_size)`` of this process's data-parallel replica.

    Sources, first match wins: ``dp_group`` (``torch.distributed.get_rank(group)`` and
    ``get_world_size(group)``) or ``mesh`` (its data-parallel dimension, see :func:`mesh_rank`);
    else explicit values, filled in from ``RANK``/``WORLD_SIZE``, else ``torch.distributed``,
    else rank 0 of 1.

    Args:
        rank, world_size: the data-parallel rank and size; with ``dp_group``/``mesh`` they
            must agree with it (a check, not a second source).
        dp_group: the data-parallel ``ProcessGroup`` (Megatron's
            ``mpu.get_data_parallel_group()``, DeepSpeed's ``engine.data_parallel_group``).
        mesh: a ``torch.distributed.DeviceMesh`` whose ``mesh_dim`` is the data-parallel one.
        mesh_dim: a dimension name, or several whose flattened index is the DP rank; default
            ``dp`` or ``batch``, or the only dimension of a 1-D mesh.

    Raises:
        UsageError: ``rank`` or ``world_size`` not an integer (a bool, a float, a string), or
            ``rank`` outside ``0..world_size-1``; ``dp_group`` and ``mesh`` both given; a
            group or mesh that this process is not in, that disagrees with an explicit value, or
            whose size does not divide the global world size; only ``world_size`` given and it is
            not ``WORLD_SIZE`` (the global rank would be taken for a data-parallel one);
            ``WORLD_SIZE`` > 1 without ``RANK``, or ``RANK`` > 0 without ``WORLD_SIZE``, before
            torch.distributed is initialized (Lightning's launcher sets the first); ``RANK`` or
            ``WORLD_SIZE`` not an integer, or outside ``0 <= RANK < WORLD_SIZE``; the default
            global rank while Megatron's parallel state has fewer data-parallel ranks.

    Example:
        >>> resolve_rank(1, 4)
        (1, 4)
    """
    rank, world_size = _integer("rank", rank), _integer("world_size", world_size)
    if dp_group is not None and mesh is not None:
        raise UsageError("both dp_group and mesh were given", fix="pass one of them")
    if mesh_dim is not None and mesh is None:
        raise UsageError(f"mesh_dim {mesh_dim!r} was given without a mesh", fix="pass the DeviceMesh as mesh=")
    if dp_group is not None or mesh is not None:
        source = "dp_group" if dp_group is not None else "the mesh"
        dp = _group_rank(dp_group) if dp_group is not None else mesh_rank(mesh, mesh_dim)
        for name, given, got in (("rank", rank, dp[0]), ("world_size", world_size, dp[1])):
            if given is not None and given != got:
                raise UsageError(f"{{{name}}} {given} disagrees with {source}, which says {got}",
                                 fix=f"drop {{{name}}} (it comes from {source}) or pass the matching {source}")
        world = _global_rank()[1]
        if world % dp[1]:
            raise UsageError(f"{source} has {dp[1]} data-parallel ranks, which does not divide the {world} "
                             f"processes of the job (WORLD_SIZE or torch.distributed)",
                             fix=f"pass the data-parallel {source}, not another one")
        return check_rank(*dp)
    if rank is None or world_size is None:
        env_rank, env_world = _global_rank()
        if rank is None and world_size is not None and world_size != env_world:
            raise UsageError(f"{{world_size}} {world_size} was given but the rank would be the global one, "
                             f"of {env_world} processes (RANK/WORLD_SIZE or torch.distributed)",
                             fix="pass the data-parallel {rank} as well, or dp_group= or mesh=")
        if rank is None and world_size is None:
            _check_no_model_parallel(env_world)
        rank = env_rank if rank is None else rank
        world_size = env_world if world_size is None else world_size
    return check_rank(rank, world_size, fix="pass {rank} in 0..{world_size}-1, or set RANK and WORLD_SIZE")


def mesh_rank(mesh: Any, mesh_dim: str | Sequence[str] | None = None) -> tuple[int, int]:
    """``(rank, size)`` of this process along the data-parallel dimension(s) of a ``DeviceMesh``.

    Several dimensions (e.g. ``("dp_replicate", "dp_shard")``) are flattened in order, the last
    varying fastest, as ``DeviceMesh._flatten`` numbers them.

    Args:
        mesh: a ``torch.distributed.DeviceMesh`` (or anything with ``mesh_dim_names``,
            ``get_coordinate()`` and ``size(i)``).
        mesh_dim: a name or names; default ``dp`` or ``batch``, or the only dimension of a 1-D mesh.

    Raises:
        UsageError: a name the mesh does not have, no default dimension, or a process outside the mesh.

    Example:
        >>> class Mesh:  # a (dp=2, tp=2) mesh seen from global rank 3
        ...     mesh_dim_names, ndim = ("dp", "tp"), 2
        ...     def get_coordinate(self): return (1, 1)
        ...     def size(self, i): return 2
        >>> mesh_rank(Mesh()), mesh_rank(Mesh(), ("dp", "tp"))
        ((1, 2), (3, 4))
    """
    names = tuple(mesh.mesh_dim_names or ())
    if mesh_dim is None:
        dims = [next((names.index(n) for n in DP_DIM_NAMES if n in names), None)]
        if dims[0] is None:
            if mesh.ndim != 1:
                raise UsageError(f"the mesh has no data-parallel dimension named {' or '.join(DP_DIM_NAMES)} "
                                 f"(its dimensions: {', '.join(names) or 'unnamed'})",
                                 fix="pass mesh_dim= (the data-parallel dimension's name, or several names)")
            dims = [0]
    else:
        wanted = (mesh_dim,) if isinstance(mesh_dim, str) else tuple(mesh_dim)
        missing = [n for n in wanted if n not in names]
        if missing or not wanted:
            raise UsageError(f"the mesh has no dimension {', '.join(missing) or '(none given)'} "
                             f"(its dimensions: {', '.join(names) or 'unnamed'})",
                             fix="pass mesh_dim= with names of the mesh's data-parallel dimensions")
        dims = [names.index(n) for n in wanted]
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise UsageError("this process is not in the mesh", fix="pass the mesh this process belongs to")
    rank, size = 0, 1
    for dim in dims:
        rank, size = rank * mesh.size(dim) + int(coordinate[dim]), size * mesh.size(dim)
    return rank, size


def _group_rank(group: Any) -> tuple[int, int]:
    rank = torch.distributed.get_rank(group)
    if rank < 0:  # torch.distributed's answer for a process outside the group
        raise UsageError("this process is not in dp_group", fix="pass the data-parallel group this process is in")
    return rank, torch.distributed.get_world_size(group)


def _integer(name: str, value: Any) -> int | None:
    """``value`` as an int (``None`` kept), refusing what only looks like one: a bool, a float, a string."""
    if value is None:
        return None
    # bool is an int to Python, and 1.5 or "0" would be truncated or compared as text further on.
    if not isinstance(value, (bool, np.bool_)) and getattr(value, "dtype", None) != torch.bool:
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise UsageError(f"{{{name}}} {value!r} is not an integer ({type(value).__name__})",
                     fix=f"pass {{{name}}} as an int")


def _env_integer(name: str) -> int | None:
    """The integer in environment variable ``name`` (``None`` when unset), or a UsageError naming it."""
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        raise UsageError(f"environment variable {name} is {text!r}, not an integer",
                         fix=f"set {name} to a whole number (as torchrun does), or unset it and pass "
                             "{rank} and {world_size}") from None


def _global_rank() -> tuple[int, int]:
    """``RANK``/``WORLD_SIZE``, else torch.distributed, else (0, 1) unless ``RANK``/``WORLD_SIZE`` say more."""
    env_rank, env_world = _env_integer("RANK"), _env_integer("WORLD_SIZE")
    if env_rank is not None and env_world is not None:
        if env_world < 1 or not 0 <= env_rank < env_world:
            raise UsageError(f"environment variables RANK={env_rank} and WORLD_SIZE={env_world} do not satisfy "
                             f"0 <= RANK < WORLD_SIZE", fix="set them as the launcher does, or pass {rank} and "
                                                             "{world_size}")
        return env_rank, env_world
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    if env_world is not None and env_world > 1:
        # Lightning's launcher sets WORLD_SIZE and LOCAL_RANK but not RANK, and joins the process
        # group only in fit(): a sampler built before that would be every process's rank 0 of 1.
        raise UsageError(f"WORLD_SIZE is {os.environ['WORLD_SIZE']} but RANK is not set and torch.distributed "
                         f"is not initialized, so this process's rank is unknown",
                         fix="build the sampler once the process group exists (in Lightning: inside "
                             "train_dataloader()), or pass {rank} and {world_size}")
    if env_rank is not None and env_rank != 0:
        # Rank 0 of 1 here would replay the whole epoch on every process of the job.
        raise UsageError(f"RANK is {os.environ['RANK']} but WORLD_SIZE is not set and torch.distributed is not "
                         f"initialized, so the number of processes is unknown",
                         fix="set WORLD_SIZE too (torchrun sets both), or pass {rank} and {world_size}")
    return 0, 1


def _check_no_model_parallel(world: int) -> None:
    """Refuse the global rank where a model-parallel layout says it is not the data-parallel one.

    Megatron's ``parallel_state`` is looked at only when the job imported it (never imported
    here). Other layouts (a ``DeviceMesh``, DeepSpeed's groups) are not visible from outside;
    docs/runtime.md says to pass them.
    """
    state = sys.modules.get("megatron.core.parallel_state")
    initialized = getattr(state, "model_parallel_is_initialized", None)
    if not callable(initialized) or not initialized():
        return
    dp_world = int(state.get_data_parallel_world_size())
    if dp_world != world:
        raise UsageError(f"the rank would be the global one, of {world} processes, but Megatron's parallel state "
                         f"has {dp_world} data-parallel ranks (tensor/pipeline/context-parallel peers share one)",
                         fix="pass rank=mpu.get_data_parallel_rank(), world_size=mpu.get_data_parallel_world_size() "
                             "or dp_group=mpu.get_data_parallel_group()")
