"""PyTorch runtime of balancer_cli (needs the ``torch`` extra): manifest replay and dispatch.

This is the only part of balancer_cli that imports torch; ``import balancer_cli`` never does.
Submodules load on first use (``balancer_cli.runtime.dispatch`` does not load the sampler and
vice versa); the names below resolve lazily.

Example:
    >>> from balancer_cli.runtime import ManifestBatchSampler  # doctest: +SKIP
    >>> sampler = ManifestBatchSampler("OUT", lengths="lengths.parquet")  # doctest: +SKIP
    >>> loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)  # doctest: +SKIP
"""

from __future__ import annotations

import importlib

__all__ = ["ManifestBatchSampler", "StepTokens", "ElasticReport", "resolve_rank"]

_LAZY = {
    "ManifestBatchSampler": "balancer_cli.runtime.sampler",
    "StepTokens": "balancer_cli.runtime.sampler",
    "resolve_rank": "balancer_cli.runtime.ranks",
    "ElasticReport": "balancer_cli.replay.elastic",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'balancer_cli.runtime' has no attribute {name!r}")
