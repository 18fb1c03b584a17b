"""Even out the source mix of the steps: samples of equal loads trade places between steps.

The assigner balances each step's source mix within a cell of similar groups, and the class mix
(:mod:`balancer_cli.pack.packers._class_mix`) the mix across classes of equal encoder sums; what
is left is the cells' own spread, which grows with the groups per step (a step of 256 groups
draws from many cells: 163k samples at ``--dp 128`` x 2 micro-batches left steps 1.30x less mixed
than random batching). :func:`even_step_mix` swaps two samples of different sources whose encoder
loads and weights are equal and whose LLM weights differ by at most ``tolerance`` x the mean group
LLM weight, in groups of different steps, when the swap brings both steps' source counts closer
to their share of the global mix. Every group keeps its encoder sums (so its cell and its rank's
balance); the LLM sums move by at most the tolerance and stay within the cap. Deterministic: no
random draws. It runs only where the steps are less mixed than :data:`STEP_MIX_ABOVE` x random
batching's expected distance (so it costs nothing where the mix is already good).

Example:
    Steps 0 and 1 hold only source 0 and only source 1; rows 0 and 2 have the same loads:

    >>> import numpy as np
    >>> from balancer_cli.pack.types import Assignment, Packing
    >>> p = Packing(np.arange(4), np.array([0, 2, 4]), np.zeros(2, bool), np.array([], np.int64), ())
    >>> a = Assignment(step=np.array([0, 1]), rank=np.array([0, 0]), micro=np.array([0, 0]), num_steps=2)
    >>> load = np.array([[1, 100], [1, 100], [1, 100], [1, 100]])
    >>> even_step_mix(p, a, load.astype(float), load, np.array([4, 300]), np.array([0, 0, 1, 1])).order.tolist()
    [2, 1, 0, 3]
"""

from __future__ import annotations

import dataclasses

import numpy as np

from balancer_cli._jit import njit
from balancer_cli.pack.packers._class_mix import CLASS_MIX_TOLERANCE
from balancer_cli.pack.types import Assignment, Packing, dense_ids, row_ids, top_codes

__all__ = ["even_step_mix", "STEP_MIX_ABOVE", "LOOKAHEAD"]

#: The swaps run when the steps' mean distance to the global mix is at least this share of a
#: random step's expected distance (the measured step mix ratio is then about this or more).
STEP_MIX_ABOVE = 0.8
#: Rows further on in (key, LLM weight) order tried as a row's partner.
LOOKAHEAD = 64


def even_step_mix(packing: Packing, assignment: Assignment, weight_nK: np.ndarray, load_nK: np.ndarray,
                  caps_K: np.ndarray, source_n: np.ndarray, *, max_sources: int = 16,
                  tolerance: float = CLASS_MIX_TOLERANCE) -> Packing:
    """The packing with rows traded between groups of different steps (see the module docstring).

    Args:
        packing: groups of the window's rows 0..n-1 (order and offsets).
        assignment: the step of every group.
        weight_nK, load_nK: (n, K) balanced weights and capped loads (LLM last).
        caps_K: (K,) caps; only the LLM's can be approached.
        source_n: (n,) source of every row.
        max_sources: sources tracked: the ``max_sources - 1`` most frequent, the rest as one.
        tolerance: largest LLM weight difference of two swapped rows, as a share of the mean
            group LLM weight.

    Returns:
        The same packing object when nothing moved, else a copy with a new ``order``.
    """
    G, K = packing.num_groups, np.asarray(load_nK).shape[1]
    order = np.asarray(packing.order, dtype=np.int64)
    if K < 1 or G < 2 or assignment.num_steps < 2 or len(order) == 0:
        return packing
    code_P = dense_ids(np.asarray(source_n)[order])
    column, O = top_codes(code_P, max_sources)
    if O < 2:
        return packing
    src_P = np.ascontiguousarray(column[code_P], dtype=np.int64)
    gid_P = packing.group_ids()
    step_P = np.asarray(assignment.step, dtype=np.int64)[gid_P]
    S = int(assignment.num_steps)
    counts_SO = np.bincount(step_P * O + src_P, minlength=S * O).reshape(S, O).astype(np.float64)
    size_S = counts_SO.sum(axis=1)
    share_O = counts_SO.sum(axis=0) / counts_SO.sum()
    excess_SO = counts_SO - size_S[:, None] * share_O[None, :]
    if not _biased(excess_SO, size_S, share_O):
        return packing
    weight = np.asarray(weight_nK, dtype=np.float64)
    enc_PE = np.ascontiguousarray(weight[order, :-1])
    wtok_P = np.ascontiguousarray(weight[order, -1])
    tok_P = np.ascontiguousarray(np.asarray(load_nK)[order, -1], dtype=np.int64)
    starts = np.asarray(packing.group_offsets[:-1], dtype=np.int64)
    lsum_G = np.add.reduceat(tok_P, starts) if len(starts) else np.zeros(0, np.int64)
    limit = tolerance * float(np.add.reduceat(wtok_P, starts).mean())
    # Positions by (encoder loads, LLM weight): partners are neighbours in this order.
    key_P = row_ids(np.asarray(load_nK)[order, :-1]) if K > 1 else np.zeros(len(order), np.int64)
    by = np.lexsort((wtok_P, key_P))
    rows = order.copy()
    swaps = _swap_across_steps(by, key_P, enc_PE, wtok_P, tok_P, gid_P, step_P, src_P, rows, excess_SO, lsum_G,
                               int(np.asarray(caps_K)[-1]), limit, LOOKAHEAD)
    if swaps == 0:
        return packing
    return dataclasses.replace(packing, order=rows.astype(np.asarray(packing.order).dtype, copy=False))


def _biased(excess_SO: np.ndarray, size_S: np.ndarray, share_O: np.ndarray) -> bool:
    """Whether the steps' mean distance to the global mix is at least :data:`STEP_MIX_ABOVE` x a
    random step's (``E|share - p| ~ sqrt(2 / pi) sqrt(p (1 - p) / size)`` per source)."""
    sizes = np.maximum(size_S, 1.0)
    distance = 0.5 * float((np.abs(excess_SO).sum(axis=1) / sizes).mean())
    random = 0.5 * float((np.sqrt(2.0 / np.pi) * np.sqrt(share_O * (1.0 - share_O))[None, :]
                          / np.sqrt(sizes)[:, None]).sum(axis=1).mean())
    return distance >= STEP_MIX_ABOVE * random


@njit
def _swap_across_steps(by, key_P, enc_PE, wtok_P, tok_P, gid_P, step_P, src_P, rows_P, excess_SO, lsum_G, cap,
                       limit, lookahead):  # pragma: no cover - compiled
    """Walk the positions in (key, LLM weight) order; swap each untaken one with the first of the
    next ``lookahead`` (same key and encoder weights, LLM weight within ``limit``, another step
    and source, both groups within ``cap``) whose swap lowers both steps' summed |excess|."""
    n = len(by)
    taken = np.zeros(n, np.bool_)
    swaps = 0
    for u in range(n):
        x = by[u]
        if taken[x]:
            continue
        s, a = step_P[x], src_P[x]
        if excess_SO[s, a] < 0.5:  # x's step has no surplus of x's source to give
            continue
        for v in range(u + 1, min(n, u + 1 + lookahead)):
            y = by[v]
            if key_P[y] != key_P[x] or wtok_P[y] - wtok_P[x] > limit:
                break
            t, b = step_P[y], src_P[y]
            if taken[y] or t == s or b == a:
                continue
            # |e| summed over the four entries the swap changes: s loses a, gains b; t the reverse.
            before = (abs(excess_SO[s, a]) + abs(excess_SO[s, b]) + abs(excess_SO[t, a]) + abs(excess_SO[t, b]))
            after = (abs(excess_SO[s, a] - 1) + abs(excess_SO[s, b] + 1) + abs(excess_SO[t, a] + 1)
                     + abs(excess_SO[t, b] - 1))
            if after >= before - 1e-9:
                continue
            same = True
            for e in range(enc_PE.shape[1]):
                same = same and enc_PE[x, e] == enc_PE[y, e]
            g, h = gid_P[x], gid_P[y]
            d = tok_P[y] - tok_P[x]
            if not same or lsum_G[g] + d > cap or lsum_G[h] - d > cap:
                continue
            rows_P[x], rows_P[y] = rows_P[y], rows_P[x]
            lsum_G[g] += d
            lsum_G[h] -= d
            excess_SO[s, a] -= 1
            excess_SO[s, b] += 1
            excess_SO[t, a] += 1
            excess_SO[t, b] -= 1
            taken[x] = True
            taken[y] = True
            swaps += 1
            break
    return swaps
