"""PyTorch adapters of balancer_cli (need the ``torch`` extra): manifest replay and dispatch.

This is the only part of balancer_cli that imports torch; ``import balancer_cli`` never does.
The replay itself is torch-free (:mod:`balancer_cli.replay`); here it becomes a PyTorch batch
sampler (:mod:`~balancer_cli.runtime.sampler`), ranks come from ``torch.distributed``
(:mod:`~balancer_cli.runtime.ranks`), and post-balancing plans run as all-to-alls
(:mod:`~balancer_cli.runtime.dispatch`). Submodules load on first use
(``balancer_cli.runtime.dispatch`` does not load the sampler and vice versa); the names below
resolve lazily.

Example:
    >>> from balancer_cli.runtime import ManifestBatchSampler  # doctest: +SKIP
    >>> sampler = ManifestBatchSampler("OUT", lengths="lengths.parquet")  # doctest: +SKIP
    >>> loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)  # doctest: +SKIP
"""

from __future__ import annotations

import importlib

__all__ = ["ManifestBatchSampler", "resolve_rank"]

_LAZY = {
    "ManifestBatchSampler": "balancer_cli.runtime.sampler",
    "resolve_rank": "balancer_cli.runtime.ranks",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'balancer_cli.runtime' has no attribute {name!r}")
