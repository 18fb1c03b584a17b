"""Index arithmetic shared across layers: the rows of many ranges at once, without a Python loop,
and row gathers and per-row sums without numpy's slow paths for them.

numpy's fancy indexing of a 2-D array by an integer array (``cost_NK[rows]``) goes through its
general indexing machinery: 40-110 ms for 1.2M rows of 2-5 columns (numpy 2.4), against 4-30 ms
for :func:`numpy.take` along axis 0, which copies whole rows; ``cost_NK[rows, k]`` likewise
(20 ms against 3 ms for a take of the column). ``np.add.at`` over 2-D values is slower still
(0.4 s for 1.2M rows of 3 columns) where one :func:`numpy.bincount` per column adds the same
values in the same order. :func:`numpy.searchsorted` casts the sorted array and the values to
one type, so an int32 column searched for a Python int or an int64 array is copied whole on
every call (10M rows: 17 ms and a 76 MB transient at the peak of a pack); :func:`search_sorted`
searches in the column's own type. The results are identical, element for element.

Example:
    >>> concat_ranges(np.array([5, 0]), np.array([2, 3])).tolist()
    [5, 6, 0, 1, 2]
    >>> take_rows(np.array([[1, 2], [3, 4], [5, 6]]), np.array([2, 0])).tolist()
    [[5, 6], [1, 2]]
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["RUNS_BLOCK", "concat_ranges", "run_blocks", "search_sorted", "sorted_runs", "sum_rows", "take_column", "take_rows"]

#: Rows whose keys :func:`sorted_runs` computes at a time (~8 MB of int64 keys at any size).
RUNS_BLOCK = 1 << 20


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


def run_blocks(starts: np.ndarray, rows_per_block: int) -> list[int]:
    """Cut S runs of rows (``starts``: each run's first row, then the row count; S + 1 ascending
    values) into blocks of whole runs: each block ends at the first run boundary at least
    ``rows_per_block`` rows past its start (one run at least). Returns the runs that start a
    block, then S.

    Example:
        >>> run_blocks(np.array([0, 3, 5, 9, 10]), 4)  # runs of 3, 2, 4 and 1 rows: blocks of 5, 4 and 1
        [0, 2, 3, 4]
    """
    S = len(starts) - 1
    cuts = [0]
    while cuts[-1] < S:
        after = int(np.searchsorted(starts, starts[cuts[-1]] + rows_per_block, side="left"))
        cuts.append(min(max(after, cuts[-1] + 1), S))
    return cuts


def search_sorted(sorted_a: np.ndarray, values, side: str = "left") -> np.ndarray:
    """``np.searchsorted(sorted_a, values, side)`` without a copy of an integer ``sorted_a``: integer
    values that fit its type are cast to it first (module docstring).

    Example:
        >>> search_sorted(np.array([0, 0, 2, 5], np.int32), [0, 3, 2**40]).tolist()
        [0, 3, 4]
    """
    a, v = np.asarray(sorted_a), np.asarray(values)
    if a.dtype.kind in "iu" and v.dtype.kind in "iu" and v.dtype != a.dtype and v.size:
        info = np.iinfo(a.dtype)
        if info.min <= v.min() and v.max() <= info.max:
            v = v.astype(a.dtype)
    return np.searchsorted(a, v, side=side)


def take_rows(array: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``array[index]`` for an integer ``index`` array of any shape (negative entries count from the
    end; out of range raises IndexError), gathered whole rows at a time (module docstring).

    Example:
        >>> take_rows(np.arange(6).reshape(3, 2), np.array([[0, -1]])).shape
        (1, 2, 2)
    """
    return np.take(array, index, axis=0)


def take_column(array: np.ndarray, index: np.ndarray, column: int) -> np.ndarray:
    """``array[index, column]`` for an integer ``index`` array: one column's entries of those rows.

    Example:
        >>> take_column(np.array([[1, 2], [3, 4], [5, 6]]), np.array([2, 2, 0]), 1).tolist()
        [6, 6, 2]
    """
    return np.take(array[:, column], index)


def sum_rows(index_N: np.ndarray, values_NK: np.ndarray, num_rows: int) -> np.ndarray:
    """(num_rows, K) float64: row ``a`` sums the ``values_NK`` rows whose ``index_N`` is ``a``, in
    order from 0.0, so exactly ``np.add.at(np.zeros((num_rows, K)), index_N, values_NK)`` (one
    :func:`numpy.bincount` a column; module docstring). Raises ValueError for an index outside
    [0, num_rows).

    Example:
        >>> sum_rows(np.array([1, 1, 0]), np.array([[1, 2], [3, 4], [5, 6]]), 2).tolist()
        [[5.0, 6.0], [4.0, 6.0]]
    """
    index = np.asarray(index_N, dtype=np.int64).reshape(-1)
    values = np.asarray(values_NK)
    values = values[:, None] if values.ndim == 1 else values
    if len(index) and (index.min() < 0 or index.max() >= num_rows):
        raise ValueError(f"row index out of range [0, {num_rows})")
    out = np.zeros((num_rows, values.shape[1]))
    for k in range(values.shape[1]):
        out[:, k] = np.bincount(index, weights=values[:, k], minlength=num_rows)
    return out


def sorted_runs(key_of: Callable[[int, int], np.ndarray], num_rows: int) -> int | None:
    """How many runs of equal keys rows ``0..num_rows`` hold when their keys never decrease, else
    None; ``key_of(lo, hi)`` gives the keys of rows ``lo:hi``. A block of :data:`RUNS_BLOCK` rows
    at a time, one row of overlap so that the order across blocks is checked too: no (P,) int64
    keys next to the rows (0.3 GB of temporaries for a 10M-row manifest).

    Example:
        >>> key = np.array([0, 1, 1, 4])
        >>> sorted_runs(lambda lo, hi: key[lo:hi], 4), sorted_runs(lambda lo, hi: key[::-1][lo:hi], 4)
        (3, None)
    """
    runs = int(num_rows > 0)
    for lo in range(0, num_rows, RUNS_BLOCK):
        key = key_of(lo, lo + RUNS_BLOCK + 1)
        if (key[1:] < key[:-1]).any():
            return None
        runs += int(np.count_nonzero(key[1:] != key[:-1]))
    return runs
