"""PyTorch adapters of balancer_cli (need the ``torch`` extra): manifest replay, collation and dispatch.

This is the only part of balancer_cli that imports torch; ``import balancer_cli`` never does.
The replay itself is torch-free (:mod:`balancer_cli.replay`); here it becomes a PyTorch batch
sampler (:mod:`~balancer_cli.runtime.sampler`) or an ``IterableDataset``
(:mod:`~balancer_cli.runtime.iterable`), a group becomes one padding-free sequence
(:mod:`~balancer_cli.runtime.collate`), the data-parallel rank comes from ``torch.distributed``,
a process group or a ``DeviceMesh`` (:mod:`~balancer_cli.runtime.ranks`), trainers that would
shard the batches again are kept from it (:mod:`~balancer_cli.runtime.trainers`: accelerate,
Lightning), post-balancing plans run as all-to-alls (:mod:`~balancer_cli.runtime.dispatch`), and
samples scanned from WebDataset tar shards are read back by offset (:mod:`~balancer_cli.runtime.shards`).
Submodules load on first use (``balancer_cli.runtime.dispatch`` does not load the sampler and
vice versa); the names below resolve lazily. ``sampler_state_from_loader`` (torch-free, from
:mod:`balancer_cli.replay.loader_state`) takes the sampler's state out of a torchdata
``StatefulDataLoader`` state, for a resume with another number of workers.

Example:
    >>> from balancer_cli.runtime import ManifestBatchSampler, PackedCollator  # doctest: +SKIP
    >>> sampler = ManifestBatchSampler("OUT", lengths="lengths.parquet")  # doctest: +SKIP
    >>> loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=PackedCollator())  # doctest: +SKIP
"""

from __future__ import annotations

import importlib

__all__ = [
    "ManifestBatchSampler",
    "ManifestIterableDataset",
    "PackedCollator",
    "ShardDataset",
    "mesh_rank",
    "prepare_manifest_loader",
    "resolve_rank",
    "sampler_state_from_loader",
]

_LAZY = {
    "ManifestBatchSampler": "balancer_cli.runtime.sampler",
    "ManifestIterableDataset": "balancer_cli.runtime.iterable",
    "PackedCollator": "balancer_cli.runtime.collate",
    "ShardDataset": "balancer_cli.runtime.shards",
    "mesh_rank": "balancer_cli.runtime.ranks",
    "prepare_manifest_loader": "balancer_cli.runtime.trainers",
    "resolve_rank": "balancer_cli.runtime.ranks",
    "sampler_state_from_loader": "balancer_cli.replay.loader_state",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'balancer_cli.runtime' has no attribute {name!r}")
