"""The compiled loop of :func:`balancer_cli.pack._blocks.paired_rounds`: items meet bins, round by round.

Compiled by the shared optional-numba decorator (:func:`balancer_cli._jit.njit`): numba when
importable, the same code as plain Python otherwise. No randomness: the directions come drawn,
and every sort is stable, so ties keep the order the items and bins come in.

One round of numpy (a projection, two ``lexsort`` calls and two gathers) cost ~25 us of overhead
whatever its size: the threshold search assigns ~15 subsamples of ~2,700 groups at 64 ranks, 64
rounds each, and spent 0.13 s of its 0.45 s there (1.2M samples, ``--dp 64``).
"""

from __future__ import annotations

import numpy as np

from balancer_cli._jit import njit
from balancer_cli._sort import stable_argsort

__all__ = ["pair_rounds"]

#: Segments up to this long are sorted by insertion (stable, no allocation); longer ones by
#: :func:`~balancer_cli._sort.stable_argsort`.
_INSERTION_MAX = 24


@njit
def _stable_order(key_X):  # pragma: no cover
    """(X,) ``np.argsort(key_X, kind="stable")``: equal keys keep their order."""
    X = key_X.shape[0]
    if X > _INSERTION_MAX:
        return stable_argsort(key_X)
    out = np.empty(X, np.int64)
    for x in range(X):
        j = x
        while j > 0 and key_X[out[j - 1]] > key_X[x]:
            out[j] = out[j - 1]
            j -= 1
        out[j] = x
    return out


@njit
def _project(table_XD, row, direction_D):  # pragma: no cover
    """``table_XD[row] @ direction_D``, summed in column order."""
    acc = 0.0
    for d in range(direction_D.shape[0]):
        acc += table_XD[row, d] * direction_D[d]
    return acc


@njit
def pair_rounds(items, ends, cell_I, dev_ID, first_round, direction_TD, bins_C, bin_first_C, sum_BD,
                bin_I):  # pragma: no cover
    """Rounds ``first_round .. first_round + len(direction_TD) - 1`` of item-to-bin pairing, in place.

    Round t's items are ``items[ends[t - 1]:ends[t]]`` (``ends[-1]`` read as 0), cell by cell in
    ascending cell order, each cell's ``bins_C[c]`` items in their drawn order. Within a cell they
    are sorted by decreasing projection of their deviation on the round's direction, the cell's
    bins by increasing projection of their summed deviation, and the i-th item goes to the i-th
    bin (both sorts stable); then the bins' sums take the items' deviations.

    Args:
        items: (I',) the items of every round, round by round.
        ends: (T + 1,) end of each round's items in ``items`` (rounds past the last are not read).
        cell_I: (I,) cell of every item.
        dev_ID: (I, D) deviation of every item.
        first_round: the first round to run.
        direction_TD: (T', D) the direction of each round run.
        bins_C: (C,) bins per cell (a cell's items per round).
        bin_first_C: (C,) first bin of each cell (bins are numbered cell by cell).
        sum_BD: (B, D) summed deviation of every bin, updated.
        bin_I: (I,) bin of every item, set for the items of the rounds run.

    Example:
        Two rounds of one cell of two bins: the first pairs the larger deviation with bin 0 (ties
        keep the bins' order), the second gives bin 0 the smaller one.

        >>> import numpy as np
        >>> dev = np.array([[3.0], [1.0], [2.0], [0.0]]); sums = np.zeros((2, 1)); bins = np.full(4, -1)
        >>> pair_rounds(np.array([0, 1, 2, 3]), np.array([2, 4]), np.zeros(4, np.int64), dev, 0,
        ...             np.ones((2, 1)), np.array([2]), np.array([0]), sums, bins)
        >>> bins.tolist(), sums.ravel().tolist()
        ([0, 1, 1, 0], [3.0, 3.0])
    """
    D = dev_ID.shape[1]
    for r in range(direction_TD.shape[0]):
        t = first_round + r
        direction = direction_TD[r]
        i = ends[t - 1] if t > 0 else 0
        while i < ends[t]:
            c = cell_I[items[i]]
            nb = bins_C[c]
            base = bin_first_C[c]
            neg_X = np.empty(nb)
            key_X = np.empty(nb)
            for x in range(nb):
                neg_X[x] = -_project(dev_ID, items[i + x], direction)
                key_X[x] = _project(sum_BD, base + x, direction)
            by_item = _stable_order(neg_X)
            by_bin = _stable_order(key_X)
            for x in range(nb):
                item = items[i + by_item[x]]
                b = base + by_bin[x]
                bin_I[item] = b
                for d in range(D):
                    sum_BD[b, d] += dev_ID[item, d]
            i += nb
