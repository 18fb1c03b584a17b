"""The balanced packer's last step: the same source mix in every class of groups the assigner keeps apart.

With one micro-batch a step's R groups come from one class of equal discrete encoder sums
(exact encoder balance: :func:`balancer_cli.pack.assign.assign_groups`), so a class whose groups
hold more of a source than the data does biases every step drawn from it. Per-group source
terms in the refinement do not remove that bias: on the real InternVL lengths the 18-tile groups
hold 3-4 points more of the tile-heavy sources than the 17-tile ones, whatever their weight,
and random batching's distance falls with the step size while the bias does not (70k at
``--dp 32``: steps 1.14x less mixed than random batching; 0.86x after these swaps).

:func:`even_class_mix` swaps two rows with the same encoder loads and weights (so every group
keeps its class and its encoder sums) and different sources, in groups of different classes,
where the swap moves both classes' source counts toward their share of the global mix. The LLM
weights of the two rows differ by at most ``tolerance`` x the mean group LLM weight, and both
groups stay within the LLM cap. Deterministic: no random draws.

Example:
    Group 0 (rows 0, 1: 3 tiles) holds only source 0, group 1 (rows 2, 3: 4 tiles) only source 1;
    rows 0 and 2 have the same tiles and tokens, so they trade places:

    >>> import numpy as np
    >>> load = np.array([[2, 100], [1, 50], [2, 100], [2, 100]])
    >>> order = np.arange(4); offsets = np.array([0, 2, 4])
    >>> even_class_mix(order, offsets, load.astype(float), load, np.array([4, 300]), np.array([0, 0, 1, 1]))
    1
    >>> order.tolist()
    [2, 1, 0, 3]
"""

from __future__ import annotations

import numpy as np

from balancer_cli._index import sum_rows, take_rows
from balancer_cli._jit import njit
from balancer_cli._sort import lexsort_order
from balancer_cli.metrics import random_mix_distance
from balancer_cli.pack.types import dense_ids, row_ids, top_codes

__all__ = ["even_class_mix", "class_bias_ratio", "CLASS_MIX_TOLERANCE", "CLASS_MIX_MIN_BIAS"]

#: Largest difference of the two rows' LLM weights, as a share of the mean group LLM weight.
CLASS_MIX_TOLERANCE = 0.002
#: The swaps run where the classes' source bias is at least this share of random batching's
#: step distance (so where the step mix would be at least ~0.6x random batching's).
CLASS_MIX_MIN_BIAS = 0.6
#: An encoder module whose group sums take at most this many values is keyed exactly (as the
#: assigner's ``discrete_levels``); others only by whether a group holds it.
_DISCRETE_LEVELS = 32


def even_class_mix(order_P: np.ndarray, offsets_G1: np.ndarray, weight_NK: np.ndarray, load_NK: np.ndarray,
                   caps_K: np.ndarray, source_N: np.ndarray, *, max_sources: int = 16, step_groups: int = 1,
                   sums_GKO: np.ndarray | None = None, tolerance: float = CLASS_MIX_TOLERANCE) -> int:
    """Swap rows of ``order_P`` (groups cut by ``offsets_G1``) in place; returns the swaps made.

    Args:
        order_P: (P,) rows group by group, updated.
        offsets_G1: (G + 1,) group boundaries in ``order_P`` (no group empty).
        weight_NK: (N, K) balanced weight of every row (LLM last).
        load_NK: (N, K) capped load of every row (LLM last).
        caps_K: (K,) caps; only the LLM's can change.
        source_N: (N,) source code of every row.
        max_sources: sources tracked: the ``max_sources - 1`` most frequent, the rest as one.
        step_groups: groups per step (R x M): with ``sums_GKO``, the swaps run only where the
            classes' bias is at least :data:`CLASS_MIX_MIN_BIAS` x random batching's step distance.
        sums_GKO: (G, K + O) the groups' weight sums and per-source counts (what the refinement
            returns), for that test; None: always swap.
        tolerance: see :data:`CLASS_MIX_TOLERANCE`.
    """
    G, K = len(offsets_G1) - 1, weight_NK.shape[1]
    if K < 2 or G < 2 or len(order_P) == 0:
        return 0
    if sums_GKO is not None and sums_GKO.shape[1] > K and not _biased(sums_GKO[:, :K], sums_GKO[:, K:], step_groups):
        return 0
    rows = np.asarray(order_P, dtype=np.int64)
    gid_P = np.repeat(np.arange(G), np.diff(offsets_G1))
    weight_PK = take_rows(weight_NK, rows)
    wsum_GK = np.add.reduceat(weight_PK, offsets_G1[:-1], axis=0)
    class_G = _classes(wsum_GK[:, :-1])
    if class_G.max() == 0:
        return 0
    code_P = dense_ids(np.asarray(source_N)[rows])
    column, _ = top_codes(code_P, max_sources)
    src_P = column[code_P]
    O, C = int(src_P.max()) + 1, int(class_G.max()) + 1
    if O < 2:
        return 0
    # Rows that may trade places: the same loads (the key) and weights (checked per pair) on every
    # encoder module.
    load_PK = take_rows(load_NK, rows)
    key_P = row_ids(load_PK[:, :-1])
    tok_P = load_PK[:, -1].astype(np.int64)
    lsum_G = np.add.reduceat(tok_P, offsets_G1[:-1])
    wsum_G = np.ascontiguousarray(wsum_GK[:, -1])
    class_P = class_G[gid_P]
    counts_CO = np.bincount(class_P * O + src_P, minlength=C * O).reshape(C, O).astype(np.float64)
    excess_CO = counts_CO - counts_CO.sum(axis=1, keepdims=True) * (counts_CO.sum(axis=0) / counts_CO.sum())
    limit = tolerance * float(wsum_G.mean())
    # Positions by (class, source, key, LLM weight): each (class, source) is one slice. One pass:
    # a second one over the rows left found no more swaps (real 70k and 142k, 1.2M). The walks
    # read the rows' tables copied in that order (``sorted_P``), sequentially.
    cell_P = class_P * O + src_P
    by_P = lexsort_order(weight_PK[:, -1], cell_P * (int(key_P.max()) + 1) + key_P)
    start = np.searchsorted(cell_P[by_P], np.arange(C * O + 1))
    sorted_P = (np.take(key_P, by_P), take_rows(weight_PK, by_P), np.take(tok_P, by_P), np.take(gid_P, by_P))
    taken_P = np.zeros(len(rows), np.bool_)
    # (c1, c2, a, b): class c1 has too much of source a and too little of b, class c2 the reverse.
    e = excess_CO
    need = np.minimum(np.minimum(e[:, None, :, None], -e[:, None, None, :]),
                      np.minimum(e[None, :, None, :], -e[None, :, :, None]))
    swaps = 0
    for c1, c2, a, b in np.argwhere(need >= 1.0):
        now = min(e[c1, a], -e[c1, b], e[c2, b], -e[c2, a])  # earlier swaps moved it
        if now < 1.0:
            continue
        done = _swap_pairs(start[c1 * O + a], start[c1 * O + a + 1], start[c2 * O + b], start[c2 * O + b + 1],
                           *sorted_P, by_P, rows, lsum_G, wsum_G, int(caps_K[-1]), limit, int(now), taken_P)
        e[c1, a] -= done
        e[c1, b] += done
        e[c2, b] -= done
        e[c2, a] += done
        swaps += done
    order_P[:] = rows
    return swaps


def _biased(wsum_GK: np.ndarray, mix_GO: np.ndarray, step_groups: int) -> bool:
    """Whether the classes' source bias is worth the swaps (:func:`class_bias_ratio` of the
    groups' encoder sums at least :data:`CLASS_MIX_MIN_BIAS`)."""
    return class_bias_ratio(wsum_GK[:, :-1], mix_GO, step_groups) >= CLASS_MIX_MIN_BIAS


def class_bias_ratio(enc_GE: np.ndarray, mix_GO: np.ndarray, step_groups: int, *, sampled: bool = False,
                     by_steps: bool = False) -> float:
    """The classes' source bias over random batching's step distance: what the step mix is when
    each step holds one class (one micro-batch).

    The bias is the classes' mean total-variation distance to the global mix, weighted by their
    samples; the step distance is a random step's of as many samples as ours hold on average. The
    ratio predicts the step mix before the class mix's swaps (real 70k 0.55 / 0.78 / 1.12 / 1.58 at
    ``--dp`` 8 / 16 / 32 / 64, measured 0.60 / 0.81 / 1.14 / 1.55; 1.2M at ``--dp 64`` 0.51,
    measured 0.67).

    Args:
        enc_GE: (G, E) the groups' encoder weight sums: their class (:func:`_classes`).
        mix_GO: (G, O) samples of each source in each group.
        step_groups: groups per step (R x M).
        sampled: the groups pack a subsample: a class's distance less what its own size alone
            gives a random draw (in quadrature), so that small classes do not read as biased.
        by_steps: weigh each class by its groups (the steps it fills) over a random step of the
            class's own average size, instead of by samples over one average step.

    Example:
        >>> import numpy as np
        >>> enc = np.array([[1.0], [1.0], [2.0], [2.0]])
        >>> class_bias_ratio(enc, np.array([[2, 0], [2, 0], [0, 2], [0, 2]]), 2) > 1  # one source per class
        True
        >>> class_bias_ratio(enc, np.array([[1, 1], [1, 1], [1, 1], [1, 1]]), 2)
        0.0
    """
    class_G = _classes(enc_GE)
    counts_CO = sum_rows(class_G, mix_GO, int(class_G.max()) + 1 if len(class_G) else 0)
    total = counts_CO.sum()
    if total <= 0 or len(counts_CO) < 2:
        return 0.0
    share_O = counts_CO.sum(axis=0) / total
    in_class_C = counts_CO.sum(axis=1)
    share_CO = counts_CO / np.maximum(in_class_C, 1.0)[:, None]
    distance_C = 0.5 * np.abs(share_CO - share_O).sum(axis=1)
    if sampled:
        noise_C = random_mix_distance(share_O, np.maximum(in_class_C, 1.0))
        distance_C = np.sqrt(np.maximum(distance_C**2 - noise_C**2, 0.0))
    if not by_steps:
        bias = float((in_class_C / total * distance_C).sum())
        # A random step of as many samples as ours hold on average.
        samples = step_groups * total / len(enc_GE)
        random_distance = float(random_mix_distance(share_O, np.array([samples]))[0])
        return bias / random_distance if random_distance > 0 else 0.0
    groups_C = np.bincount(class_G, minlength=len(counts_CO)).astype(np.float64)
    random_C = random_mix_distance(share_O, step_groups * in_class_C / np.maximum(groups_C, 1.0))
    random_distance = float((groups_C * random_C).sum())
    return float((groups_C * distance_C).sum()) / random_distance if random_distance > 0 else 0.0


def _classes(enc_GE: np.ndarray) -> np.ndarray:
    """(G,) class of every group: the exact sums of discrete encoder modules, presence of the others."""
    if enc_GE.shape[1] == 0:  # text only: one class
        return np.zeros(len(enc_GE), np.int64)
    parts = []
    for e in range(enc_GE.shape[1]):
        levels, code = np.unique(enc_GE[:, e], return_inverse=True)
        parts.append(code.reshape(-1) if len(levels) <= _DISCRETE_LEVELS else (enc_GE[:, e] > 0).astype(np.int64))
    stacked = np.stack(parts, axis=1)
    return row_ids(stacked)


@njit
def _swap_pairs(x0, x1, y0, y1, key_P, weight_PK, tok_P, gid_P, by_P, rows_P, lsum_G, wsum_G, cap, limit, need,
                taken_P):  # pragma: no cover - compiled
    """Walk two runs ``[x0, x1)`` and ``[y0, y1)`` of the positions in (cell, key, LLM weight) order
    (``by_P``; ``key_P``, ``weight_PK``, ``tok_P``, ``gid_P`` and ``taken_P`` in that order too) and
    swap up to ``need`` pairs of equal key and encoder weights whose LLM weights differ by at most
    ``limit`` and whose groups keep within ``cap``: their rows trade places in ``rows_P`` (in the
    original order). A position swapped once is taken."""
    E = weight_PK.shape[1] - 1  # encoder columns; the LLM's last
    x = x0
    y = y0
    done = 0
    while x < x1 and y < y1 and done < need:
        if taken_P[x] or key_P[x] < key_P[y]:
            x += 1
            continue
        if taken_P[y] or key_P[y] < key_P[x]:
            y += 1
            continue
        dw = weight_PK[y, E] - weight_PK[x, E]
        d = tok_P[y] - tok_P[x]
        g = gid_P[x]
        h = gid_P[y]
        same = True
        for e in range(E):
            same = same and weight_PK[x, e] == weight_PK[y, e]
        if not same or abs(dw) > limit or lsum_G[g] + d > cap or lsum_G[h] - d > cap:
            if weight_PK[x, E] <= weight_PK[y, E]:  # the nearer partner of the lighter row is further on
                x += 1
            else:
                y += 1
            continue
        px = by_P[x]
        py = by_P[y]
        rows_P[px], rows_P[py] = rows_P[py], rows_P[px]
        lsum_G[g] += d
        lsum_G[h] -= d
        wsum_G[g] += dw
        wsum_G[h] -= dw
        taken_P[x] = True
        taken_P[y] = True
        done += 1
        x += 1
        y += 1
    return done
