"""Index arithmetic shared across layers: the rows of many ranges at once, without a Python loop.

Example:
    >>> concat_ranges(np.array([5, 0]), np.array([2, 3])).tolist()
    [5, 6, 0, 1, 2]
"""

from __future__ import annotations

import numpy as np

__all__ = ["concat_ranges"]


def concat_ranges(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """(sum(sizes),) int64: ``arange(start, start + size)`` for each pair, concatenated in order.

    Example:
        >>> concat_ranges(np.array([3]), np.array([0])).tolist()
        []
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if len(ends) else 0
    return np.arange(total, dtype=np.int64) + np.repeat(np.asarray(starts, dtype=np.int64) - (ends - sizes), sizes)
