"""Window membership in two counting passes (:func:`balancer_cli.pack.windows.window_members`).

A stable sort of the shuffled samples by source, then of the samples by window, are both counting
sorts of small integers: one compiled pass each instead of two argsorts and their gathers of
(N,) index arrays (10M samples: the index arrays alone are 80 MB each).

Example:
    >>> import numpy as np
    >>> out = np.empty(6, np.int64)
    >>> deal_to_windows(np.array([3, 0, 5, 1, 4, 2]), np.array([0, 0, 0, 0, 1, 1]), 0, 2, 2, out).tolist()
    [0, 3, 6]
    >>> out.tolist()  # window 0, then window 1, positions ascending in each
    [1, 3, 5, 0, 2, 4]
"""

from __future__ import annotations

import numpy as np

from balancer_cli._jit import njit

__all__ = ["deal_to_windows"]


@njit
def deal_to_windows(order_N, code_N, lowest, num_codes, windows, out_N):  # pragma: no cover - compiled
    """Deal the samples round-robin over ``windows``, source after source, each in ``order_N``;
    write every window's positions (ascending) into ``out_N``, window after window.

    Equals ``by_source = order_N[argsort(code_N[order_N], stable)]``, ``window_of[by_source] =
    arange(N) % windows`` and ``out_N = argsort(window_of, stable)``.

    Args:
        order_N: (N,) a permutation of the positions 0..N-1 (the deal's order within a source).
        code_N: (N,) source code of each position, in ``lowest .. lowest + num_codes - 1``.
        lowest, num_codes: the codes' range.
        windows: the number of windows (>= 1).
        out_N: (N,) filled with the positions of window 0, then window 1, ...

    Returns:
        (windows + 1,) int64 offsets of each window's positions in ``out_N``.
    """
    n = len(order_N)
    start = np.zeros(num_codes + 1, np.int64)  # where each source's run begins in the dealt order
    for p in range(n):
        start[code_N[p] - lowest + 1] += 1
    for c in range(num_codes):
        start[c + 1] += start[c]
    window_of = np.empty(n, np.int32)
    for i in range(n):
        p = order_N[i]
        c = code_N[p] - lowest
        window_of[p] = start[c] % windows
        start[c] += 1
    bounds = np.zeros(windows + 1, np.int64)
    for p in range(n):
        bounds[window_of[p] + 1] += 1
    for w in range(windows):
        bounds[w + 1] += bounds[w]
    fill = bounds[:windows].copy()
    for p in range(n):
        w = window_of[p]
        out_N[fill[w]] = p
        fill[w] += 1
    return bounds
