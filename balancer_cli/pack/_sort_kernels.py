"""A stable argsort of large 1-D keys, faster than numpy's for the packer's float keys.

numpy's ``argsort(kind="stable")`` is a timsort for floats: 0.14 s for 1.2M random doubles,
against 0.035 s for its unstable sort. :func:`stable_argsort` takes the unstable order and puts
each run of equal keys back in index order, which is exactly the stable order whatever order
the unstable sort left ties in (so results do not depend on numpy's version or SIMD dispatch).
On the dealing keys of 1.2M resampled samples (runs of ~17 equal keys) it takes 0.06 s.

Example:
    >>> import numpy as np
    >>> stable_argsort(np.array([2.0, 1.0, 2.0, 1.0, 0.5])).tolist()
    [4, 1, 3, 0, 2]
"""

from __future__ import annotations

import numpy as np

from balancer_cli._jit import HAVE_NUMBA, njit

__all__ = ["stable_argsort"]

#: Runs of equal keys up to this long are put in order by insertion; longer ones by a sort.
_INSERTION_MAX = 64


def stable_argsort(key_N: np.ndarray) -> np.ndarray:
    """``np.argsort(key_N, kind="stable")`` for a 1-D numeric array, as int64 (NaN last, -0.0
    equal to 0.0, as numpy orders them)."""
    key_N = np.ascontiguousarray(key_N)
    if not HAVE_NUMBA or len(key_N) < 4096:  # pragma: no cover - numba absent; small: numpy is as fast
        return np.argsort(key_N, kind="stable").astype(np.int64, copy=False)
    return _order_ties(key_N, np.argsort(key_N).astype(np.int64, copy=False))


@njit
def _order_ties(key_N, order_N):  # pragma: no cover - compiled
    """Sort every run of equal keys (NaNs count as equal) in ``order_N`` by index, in place."""
    n = len(order_N)
    i = 0
    while i < n:
        v = key_N[order_N[i]]
        j = i + 1
        if v == v:
            while j < n and key_N[order_N[j]] == v:
                j += 1
        else:
            while j < n and key_N[order_N[j]] != key_N[order_N[j]]:
                j += 1
        if j - i > _INSERTION_MAX:
            order_N[i:j] = np.sort(order_N[i:j])
        else:
            for a in range(i + 1, j):
                x = order_N[a]
                b = a - 1
                while b >= i and order_N[b] > x:
                    order_N[b + 1] = order_N[b]
                    b -= 1
                order_N[b + 1] = x
        i = j
    return order_N
