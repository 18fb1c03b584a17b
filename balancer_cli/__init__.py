"""balancer_cli: balanced mini-batches for multimodal LLM training.

The package is pure data engineering: it measures per-sample encoder and LLM token counts
(``scan``), searches caps and acceptance bounds (``search``), packs balanced mini-batches into a
Parquet manifest (``pack``), reports their balance (``report``), and plans pipeline partitions and
recomputation. The PyTorch runtime that replays a manifest lives in :mod:`balancer_cli.runtime`
and is the only part that imports torch.

Example:
    >>> import balancer_cli
    >>> balancer_cli.__version__
    '0.1.0'
"""

from balancer_cli.errors import BalancerError, InputError, UsageError

__version__ = "0.1.0"

__all__ = ["BalancerError", "InputError", "UsageError", "__version__"]
