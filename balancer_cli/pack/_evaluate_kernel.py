"""One compiled pass over slot-sorted rows for :func:`balancer_cli.pack.evaluate.evaluate_rows`.

Every per-row metric is a sum over rows, groups or (step, rank) cells, so a single pass in row
order fills them all: the rows' cost and load (gathered whole, a sample's columns share a cache
line), the (S, R) loads of each module (and of its phase ranks), each group's largest cost and
load sums, and each step's source mix distance (counted in (O,) scratch while the step's rows
pass: an (S, O) table of counts was 0.2 GB at 10M samples of 500 sources, and its distances'
temporaries 0.5 GB more, past a 1 GiB budget). numpy needed a gather per table, a ``bincount``
per module, a ``reduceat`` per module and a sort key per block: a 10M-row evaluation took 1.0 s,
with this pass (0.4 s, the rows' random reads prefetched) 0.7 s, and a default ``balancer pack``
evaluates five packings. Per-cell sums are added in row
order, as ``bincount`` adds them, so the loads are the same to the bit.

Example:
    >>> import numpy as np
    >>> out = new_tally(num_modules=1, num_steps=1, world_size=2, num_phases=0)
    >>> z = np.zeros(3, np.int64)
    >>> error = tally_rows(z, np.array([0, 1, 1]), z, np.array([0, 1, 2]), np.array([[2.0], [3.0], [4.0]]),
    ...                    np.array([[2], [3], [4]]), z, z, np.ones(1), np.zeros((0, 3), np.int64), np.full(1, -1),
    ...                    np.array([5]), 2, *out)
    >>> error, out[0][0].tolist(), out[3].tolist(), out[6].tolist()  # loads; padded; groups, samples, over
    (0, [[2.0, 7.0]], [10.0], [2, 3, 1, 1])
"""

from __future__ import annotations

import numpy as np

from balancer_cli._jit import njit, prefetch
from balancer_cli.pack.packers._table_kernels import ROWS_AHEAD

__all__ = ["code_counts", "new_tally", "tally_rows"]


def new_tally(*, num_modules: int, num_steps: int, world_size: int, num_phases: int) -> tuple:
    """Zeroed outputs of :func:`tally_rows`: ``(loads_KSR, post_QSR, dist_2S, padded_K, total_K, held_K,
    groups_4)``; ``dist_2S`` holds each step's source mix distance, then that of the shuffle, and
    ``groups_4`` = (groups, samples, over-cap groups, over-cap groups of several samples)."""
    K, S, R = num_modules, num_steps, world_size
    return (np.zeros((K, S, R)), np.zeros((num_phases, S, R)), np.zeros((2, S)), np.zeros(K),
            np.zeros(K), np.zeros(K, np.int64), np.zeros(4, np.int64))


@njit
def tally_rows(step_P, rank_P, micro_P, sample_P, cost_NK, load_NK, source_N, shuffled_P, share_O, phase_QP,
               phase_of_K, caps_K, world_size, loads_KSR, post_QSR, dist_2S, padded_K, total_K, held_K,
               groups_4):  # pragma: no cover - compiled
    """Add rows sorted by (step, rank, micro) into the outputs of :func:`new_tally`.

    Args:
        step_P, rank_P, micro_P, sample_P: the rows; a group is a run of one (step, rank, micro).
        cost_NK, load_NK: per-sample cost and capped load.
        source_N: per-sample source code; ``shuffled_P``: the rows' source codes in a seeded
            shuffle (random batching of the same steps), measured into ``dist_2S[1]``.
        share_O: every source's share of the rows: a step's distance is the total variation
            ``0.5 * sum_o |count_o / rows - share_o|`` of its counts (a step never seen keeps its value).
        phase_QP, phase_of_K: phase ranks of the modules with ``phase_of_K[k] >= 0`` (row
            ``phase_of_K[k]`` of ``phase_QP``), summed into ``post_QSR``.
        caps_K: caps (a group over any is over-cap).
        world_size: R.

    Returns:
        0, or 1 where a row's step or rank lies outside the outputs (nothing is written past them).
    """
    K = cost_NK.shape[1]
    S = loads_KSR.shape[1]
    largest = np.zeros(K)
    gload = np.zeros(K, np.int64)
    size = 0
    # The step's source counts (placed, shuffled) and the sources each has seen in it.
    count_2O = np.zeros((2, len(share_O)), np.int64)
    seen_2O = np.zeros((2, len(share_O) + 1), np.int64)  # + 1: _count's spare column
    seen_2 = np.zeros(2, np.int64)
    in_step = 0
    shares = share_O.sum()
    for i in range(len(sample_P) + 1):
        if in_step > 0 and (i == len(sample_P) or step_P[i] != step_P[i - 1]):
            _close_step(step_P[i - 1], in_step, share_O, shares, count_2O, seen_2O, seen_2, dist_2S)
            in_step = 0
        if size > 0 and (i == len(sample_P) or step_P[i] != step_P[i - 1] or rank_P[i] != rank_P[i - 1]
                         or micro_P[i] != micro_P[i - 1]):
            over = False
            for k in range(K):  # close the group of rows i - size .. i - 1
                padded_K[k] += largest[k] * size
                if largest[k] > 0:
                    held_K[k] += 1
                if gload[k] > caps_K[k]:
                    over = True
                largest[k] = 0.0
                gload[k] = 0
            groups_4[0] += 1
            groups_4[1] += size
            if over:
                groups_4[2] += 1
                if size > 1:
                    groups_4[3] += 1
            size = 0
        if i == len(sample_P):
            break
        if i + ROWS_AHEAD < len(sample_P):  # the rows' samples are random reads: keep several in flight
            ahead = sample_P[i + ROWS_AHEAD]
            prefetch(cost_NK, ahead * K)
            prefetch(load_NK, ahead * K)
            prefetch(source_N, ahead)
        s, r, n = step_P[i], rank_P[i], sample_P[i]
        if s < 0 or s >= S or r < 0 or r >= world_size:
            return 1
        for k in range(K):
            c = np.float64(cost_NK[n, k])
            loads_KSR[k, s, r] += c
            total_K[k] += c
            largest[k] = max(largest[k], c)
            gload[k] += load_NK[n, k]
            q = phase_of_K[k]
            if q >= 0:
                p = phase_QP[q, i]
                if p < 0 or p >= world_size:
                    return 1
                post_QSR[q, s, p] += c
        _count(0, source_N[n], count_2O, seen_2O, seen_2)
        _count(1, shuffled_P[i], count_2O, seen_2O, seen_2)
        in_step += 1
        size += 1
    return 0


@njit
def _count(t, o, count_2O, seen_2O, seen_2):  # pragma: no cover - compiled
    """Count a row of source ``o`` into stream ``t`` (0 placed, 1 shuffled) of the open step.

    Branch-free: ``o`` is written at the end of the seen list every time and kept (the list grows)
    only where it is new, so ``seen_2O`` has a spare column. With the branch, every row waited on
    its stores (10M rows: 0.93 -> 0.63 s).
    """
    seen_2O[t, seen_2[t]] = o
    seen_2[t] += count_2O[t, o] == 0
    count_2O[t, o] += 1


@njit
def _close_step(s, rows, share_O, shares, count_2O, seen_2O, seen_2, dist_2S):  # pragma: no cover - compiled
    """Step ``s``'s distances from its counts, then the counts cleared: sources the step lacks add
    their share each, so only the seen ones are visited (``shares``, the sum of all, is the rest)."""
    for t in range(2):
        off = 0.0  # sum over the seen sources of |mix - share| - share
        for j in range(seen_2[t]):
            o = seen_2O[t, j]
            off += abs(count_2O[t, o] / rows - share_O[o]) - share_O[o]
            count_2O[t, o] = 0
        seen_2[t] = 0
        dist_2S[t, s] = 0.5 * (shares + off)


@njit
def code_counts(code_P, num_codes, lowest=0):  # pragma: no cover - compiled
    """``np.bincount(code_P - lowest, minlength=num_codes)`` of codes in ``lowest .. lowest +
    num_codes - 1``, without bincount's (P,) int64 copy of narrow codes (10M int8 rows: 80 MB,
    ~150 ms of page faults in a run).

    Example:
        >>> code_counts(np.array([2, 0, 2], np.int8), 4).tolist(), code_counts(np.array([-1, 1]), 3, -1).tolist()
        ([1, 0, 2, 0], [1, 0, 1])
    """
    counts = np.zeros(num_codes, np.int64)
    for i in range(len(code_P)):
        counts[code_P[i] - lowest] += 1
    return counts
