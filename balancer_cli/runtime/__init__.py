"""The PyTorch runtime: replay a manifest in a training job (needs the ``torch`` extra).

This is the only part of balancer_cli that imports torch; ``import balancer_cli`` never does.

Example:
    >>> from balancer_cli.runtime import ManifestBatchSampler  # doctest: +SKIP
    >>> sampler = ManifestBatchSampler("OUT", lengths="lengths.parquet")  # doctest: +SKIP
    >>> loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)  # doctest: +SKIP
"""

from balancer_cli.runtime.elastic import ElasticReport
from balancer_cli.runtime.sampler import ManifestBatchSampler, StepTokens, resolve_rank

__all__ = ["ManifestBatchSampler", "StepTokens", "ElasticReport", "resolve_rank"]
