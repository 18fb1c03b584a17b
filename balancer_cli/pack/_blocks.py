"""Blocks of R groups for the assigner (steps 1-2 of :mod:`balancer_cli.pack.assign`).

A block is the R groups that run side by side on the R ranks (one micro-batch slot of a step):
its groups must be equal on every module, and together they should be a random-like source mix.
Groups are keyed into cells of equal cost (exact discrete values, a grid for the rest); each
cell is cut into blocks in source-paired rounds; a cell's leftovers (< R) are paired again on
coarser grids; and the last leftovers, which no grid level gathers (outlier groups, few steps),
are cut both in cell-key order and like a k-d tree, keeping the cut whose blocks idle less.

Example:
    >>> import numpy as np
    >>> cost = np.array([[4., 10.], [4., 11.], [0., 9.], [0., 8.]])
    >>> blocks = form_blocks(cost, np.zeros((4, 1)), 2, np.random.default_rng(0), 0.006, 32, 10.0)
    >>> sorted(sorted(b) for b in blocks.tolist())  # the two vision-bearing groups side by side
    [[0, 1], [2, 3]]
"""

from __future__ import annotations

import numpy as np

from balancer_cli._columns import column_sums, project
from balancer_cli._index import take_rows
from balancer_cli._sort import int_order, lexsort_order
from balancer_cli.metrics import dist_ratio, utilization
from balancer_cli.pack._blocks_kernel import pair_rounds
from balancer_cli.pack.types import row_ids

__all__ = ["form_blocks", "paired_rounds", "kd_blocks", "block_idle", "sparse_modules", "sparse_shares",
           "discrete_modules", "principal_axis"]

#: A module held by at most this share of the groups is sparse (aligned to whole steps, coarse grid).
_SPARSE_BELOW = 0.9
#: A cell's leftovers are paired again on a grid this many times coarser, for up to this many levels.
_COARSEN = 2.0
_LEVELS = 4
#: Power iterations of :func:`principal_axis` at most, and the change of the unit axis that ends them.
_POWER_STEPS = 200
_POWER_TOL = 1e-12


def sparse_modules(cost_GK: np.ndarray) -> np.ndarray:
    """(K,) bool: modules that a real share of the groups lack (at most ``_SPARSE_BELOW`` hold them).

    A module nearly every group holds (vision with a few text-only groups) is dense: its few
    groups without it get cells of their own, instead of the whole module a coarse grid.

    Example:
        >>> sparse_modules(np.array([[1., 0., 5.], [1., 2., 5.], [0., 0., 5.]] + [[1., 0., 5.]] * 17)).tolist()
        [False, True, False]
    """
    share_K = np.count_nonzero(cost_GK > 0, axis=0) / len(cost_GK) if len(cost_GK) else np.zeros(cost_GK.shape[1])
    return sparse_shares(share_K)


def sparse_shares(share_K: np.ndarray) -> np.ndarray:
    """(K,) bool: :func:`sparse_modules` from each module's share of the groups that hold it.

    Example:
        >>> sparse_shares(np.array([1.0, 0.45, 0.0])).tolist()
        [False, True, False]
    """
    share_K = np.asarray(share_K, dtype=np.float64)
    return (share_K > 0) & (share_K <= _SPARSE_BELOW)


def discrete_modules(cost_GK: np.ndarray, levels: int = 32) -> np.ndarray:
    """(K,) bool: the encoder modules whose group sums take at most ``levels`` values (tiles x 256
    tokens); the LLM (the last module) never is.

    Example:
        >>> discrete_modules(np.array([[512., 900.], [768., 880.], [512., 870.]]), levels=2).tolist()
        [True, False]
    """
    discrete_K = np.zeros(cost_GK.shape[1], bool)
    discrete_K[:-1] = [len(np.unique(cost_GK[:, k])) <= levels for k in range(cost_GK.shape[1] - 1)]
    return discrete_K


def _classes(cost_GK: np.ndarray, R: int, discrete_levels: int) -> np.ndarray:
    """(G,) class id: which sparse modules a group holds, plus the value of discrete modules.

    A discrete module only joins the key while its classes stay large (at least 4 blocks of R
    per distinct value on average), so leftovers (< R per class) stay few. So the classes are a
    subset of :func:`discrete_modules` (which the trade and the tile swaps test: they keep or even
    out every module of few group sums, whatever its classes' sizes), any module included.
    """
    G, K = cost_GK.shape
    present = cost_GK > 0
    key = [present[:, k].astype(np.int64) for k in np.flatnonzero(sparse_modules(cost_GK))]
    n_classes = 1 << len(key)
    for k in range(K):
        # A module of many values shows it in its first rows already: no sort of the whole column.
        if len(np.unique(cost_GK[: 4 * discrete_levels, k])) > discrete_levels:
            continue
        levels = np.unique(cost_GK[:, k])
        if 1 < len(levels) <= discrete_levels and G >= 4 * R * n_classes * len(levels):
            key.append(np.searchsorted(levels, cost_GK[:, k]))  # the value's rank: the same order
            n_classes *= len(levels)
    if not key:
        return np.zeros(G, np.int64)
    return row_ids(np.stack(key, axis=1))


def _cells(cost_GK, rows, R, discrete_levels, tolerance, sparse_factor, exact_discrete, sparse_K, mean_K):
    """(len(rows),) cell id of each of ``rows`` (step 1) and their (len(rows), K) grid coordinates.

    The grid is relative to each module's mean over *all* groups (``mean_K``), so cells of
    successive levels nest; ``exact_discrete`` keys discrete modules by their exact value (the
    first level); ``sparse_K``: :func:`sparse_modules` of all groups.
    """
    tol_K = np.where(sparse_K, tolerance * sparse_factor, tolerance)
    scale_K = np.divide(1.0, tol_K * mean_K, out=np.zeros_like(mean_K), where=mean_K > 0)
    picked_GK = take_rows(cost_GK, rows)  # (len(rows), K)
    grid = np.floor(picked_GK * scale_K)
    if exact_discrete:
        classes = _classes(cost_GK, R, discrete_levels)[rows]
    else:  # which sparse modules a group holds stays in the key at every level
        classes = (picked_GK[:, sparse_K] > 0) @ (1 << np.arange(int(sparse_K.sum()), dtype=np.int64))
    key = np.column_stack([classes, grid])
    return row_ids(key), key


def form_blocks(cost_GK, dev_GO, R, rng, tolerance, discrete_levels, sparse_factor, held_apart=False):
    """(G / R, R) blocks (step 2): source-paired within cells; a cell's leftovers (< R groups) are
    paired again on a grid ``_COARSEN`` times coarser, up to ``_LEVELS`` levels; the last few are
    cut in cell-key order and like a k-d tree (:func:`kd_blocks`), and the cut whose blocks idle
    less (:func:`block_idle`) is kept; with ``held_apart`` (one micro-batch: a block is a step)
    both are also made keeping apart the groups without a dense module (:func:`_held_classes`),
    and the four compared alike."""
    rest = np.arange(len(cost_GK))
    blocks = []
    key = np.zeros((0, 1))
    sparse_K, mean_K = sparse_modules(cost_GK), cost_GK.mean(axis=0)  # of all groups, at every level
    for level in range(_LEVELS):
        cell, key = _cells(cost_GK, rest, R, discrete_levels, tolerance * _COARSEN**level, sparse_factor,
                           level == 0, sparse_K, mean_K)
        block = paired_rounds(cell, take_rows(dev_GO, rest), np.bincount(cell) // R, R, rng)
        placed = np.flatnonzero(block >= 0)
        blocks.append(rest[placed[int_order(block[placed])]].reshape(-1, R))
        keep = block < 0
        rest, key = rest[keep], key[keep]
        if len(rest) == 0:
            break
    if len(rest):
        # Two cuts of the last leftovers; the blocks that idle less are kept. Cut in the order of
        # their coarsest cell key (classes, then each module's grid: the first module decides
        # most), a block could span far-apart costs of a later module (18-tile groups of ~7,000
        # tokens with 19-tile ones of ~5,850: Dist 0.25 in that step); cut like a k-d tree, the
        # first module can lose instead (sample_data, 4 modules: Dist 0.08-0.10 -> 0.10-0.11).
        # 48 random inputs: Dist Ratio over 0.005 in 7 -> 2 of them.
        cuts = _last_cuts(cost_GK, rest, key, R, key[:, 0])
        if held_apart:  # the same cuts with held classes, kept only where their blocks idle less
            held_I = _held_classes(cost_GK, rest, key[:, 0], sparse_K)
            cuts += _last_cuts(cost_GK, rest, key, R, held_I) if not np.array_equal(held_I, key[:, 0]) else []
        blocks.append(min(cuts, key=lambda b: block_idle(cost_GK, b, sparse_K)))
    return np.concatenate(blocks)


def _last_cuts(cost_GK, rows, key, R, class_I):
    """``[by_kd, by_key]``: ``rows`` cut like a k-d tree (:func:`kd_blocks`) and in the order of
    their cell ``key`` (its first column replaced by ``class_I``), in blocks of R."""
    by_key = rows[np.lexsort(np.column_stack([class_I, key[:, 1:]]).T[::-1])].reshape(-1, R)
    return [kd_blocks(rows, cost_GK, R, class_I), by_key]


def _held_classes(cost_GK, rows, class_I, sparse_K):
    """(len(rows),) ``class_I`` (which sparse modules a group holds) refined by which of the dense
    modules that some groups lack each of ``rows`` holds: the last cuts keep those groups apart
    too, in blocks of their own where their count allows. At one micro-batch a group without a
    module in a block of groups with it idles its rank for that module's whole phase (``speech``
    4007, 21k at ``--dp 64``: audio held by 91.5% of the groups, its 384 groups without it, six
    blocks' worth, cut into 7 steps with audio groups: audio Dist 0.087, 0.058 of it from those
    steps). The caller keeps these cuts only where their blocks idle less: the classes cost the
    cuts' freedom on the other modules (``sample_data`` at ``--dp 4``, step utilization 0.787 ->
    0.667 kept always), and with more micro-batches a rank's other groups hold the module (three
    modules at 8 x 3: tiles 0.0062 -> 0.0202)."""
    held_K = cost_GK > 0
    partial_K = held_K.any(axis=0) & ~held_K.all(axis=0) & ~sparse_K
    if not partial_K.any():
        return class_I
    bits = take_rows(cost_GK, rows)[:, partial_K] > 0
    return row_ids(np.column_stack([class_I, bits @ (1 << np.arange(int(partial_K.sum()), dtype=np.int64))]))


def block_idle(cost_GK, blocks_BR, sparse_K=None):
    """Sum over modules of the blocks' idle share: the mean of ``(max - mean) / max`` over blocks
    (their Dist Ratio), and for ``sparse_K`` modules ``1 - utilization`` (idle work over the
    blocks that hold them: a mean over all blocks would count the many without the module as
    balanced and hide a sparse module's idle behind a dense one's).

    Example:
        >>> import numpy as np
        >>> float(block_idle(np.array([[2.0], [1.0], [4.0], [4.0]]), np.array([[0, 1], [2, 3]])))
        0.125
        >>> float(block_idle(np.array([[2.0], [1.0], [0.0], [0.0]]), np.array([[0, 1], [2, 3]]), np.array([True])))
        0.25
    """
    sparse_K = np.zeros(cost_GK.shape[1], bool) if sparse_K is None else sparse_K
    return sum(1.0 - utilization(cost_GK[blocks_BR, k]) if sparse_K[k] else dist_ratio(cost_GK[blocks_BR, k])
               for k in range(cost_GK.shape[1]))


def kd_blocks(rows, cost_GK, R, class_I):
    """(len(rows) / R, R) blocks of ``rows`` cut like a k-d tree: a part (a multiple of R groups)
    is sorted along the module whose normalized cost spreads most in it and cut at the multiple
    of R nearest its middle, until parts hold R groups; groups of different ``class_I`` (which
    sparse modules they hold) share a block only where the class sizes leave no other way.

    Example:
        >>> import numpy as np
        >>> cost = np.array([[1., 9.], [5., 1.], [1., 8.], [5., 2.]])
        >>> sorted(sorted(b) for b in kd_blocks(np.arange(4), cost, 2, np.zeros(4)).tolist())
        [[0, 2], [1, 3]]
    """
    mean = cost_GK.mean(axis=0)
    norm = take_rows(cost_GK, rows) * np.divide(1.0, mean, out=np.zeros_like(mean), where=mean > 0)
    # The class as a first coordinate far wider than any cost spread: split on before the costs.
    norm = np.column_stack([np.asarray(class_I, dtype=np.float64) * (1.0 + 2.0 * np.abs(norm).max()), norm])
    out = []
    stack = [np.arange(len(rows))]
    while stack:
        part = stack.pop()
        if len(part) <= R:
            out.append(part)
            continue
        values = norm[part]
        spread = values.max(axis=0) - values.min(axis=0)
        k = int(np.argmax(spread))
        if k == 0:
            # A cut of classes takes each class in the order of its own widest cost, so the parts
            # on either side of the cut keep neighbouring costs together; in its prior order the
            # cut would split a class's costs at random, each part spanning all of them.
            part = part[np.lexsort((_widest_cost(values), values[:, 0]))]
        else:
            part = part[np.argsort(values[:, k], kind="stable")]
        cut = max(1, int(round(len(part) / R / 2))) * R
        stack += [part[cut:], part[:cut]]
    return rows[np.concatenate(out)].reshape(-1, R)


def _widest_cost(values_IX: np.ndarray) -> np.ndarray:
    """(I,) each row's cost in the module that spreads most within its class (column 0: the
    class, the rest the normalized costs).

    Example:
        >>> _widest_cost(np.array([[0., 1., 5.], [0., 2., 9.], [1., 4., 0.], [1., 8., 0.]])).tolist()
        [5.0, 9.0, 4.0, 8.0]
    """
    out = np.empty(len(values_IX))
    for c in np.unique(values_IX[:, 0]):
        rows = np.flatnonzero(values_IX[:, 0] == c)
        costs = values_IX[rows, 1:]
        out[rows] = costs[:, int(np.argmax(costs.max(axis=0) - costs.min(axis=0)))]
    return out


def paired_rounds(cell_I, dev_ID, bins_C, rounds, rng, principal=False):
    """Deal items into bins of ``rounds`` items each, within their cell; -1 for leftovers.

    Cell c has ``bins_C[c]`` bins. In round t every bin of a cell takes one item of the cell:
    items sorted by a random projection of their deviation (largest first) meet bins sorted by
    their summed deviation (smallest first), so bin sums tend to the cell's mean. The rounds run
    compiled (:func:`~balancer_cli.pack._blocks_kernel.pair_rounds`), all in one call unless
    ``principal`` draws each round's direction from the bins' sums so far.

    Returns:
        (I,) bin id of every item, bins numbered cell by cell; -1 for items left over.
    """
    I = len(cell_I)
    order = lexsort_order(rng.random(I), cell_I)  # cell by cell, random within a cell
    cell_sorted = cell_I[order]
    first_C = np.searchsorted(cell_sorted, np.arange(len(bins_C)))
    position = np.arange(I) - first_C[cell_sorted]
    nb = bins_C[cell_sorted]
    round_I = np.where(nb > 0, position // np.maximum(nb, 1), rounds)
    bins_C = np.asarray(bins_C, dtype=np.int64)
    sum_BD = np.zeros((int(bins_C.sum()), dev_ID.shape[1]))
    bin_I = np.full(I, -1, dtype=np.int64)
    # The items of every round at once, each round's in the order above (a stable sort of the rounds):
    # one pass instead of a (I,) mask per round.
    by_round = order[np.argsort(round_I, kind="stable")]
    ends = np.cumsum(np.bincount(round_I, minlength=rounds + 1))
    dev = np.ascontiguousarray(dev_ID, dtype=np.float64)
    bin_first = np.concatenate([[0], np.cumsum(bins_C)[:-1]]).astype(np.int64)
    tables = (by_round, ends, cell_I.astype(np.int64, copy=False), dev)
    if not principal:  # the directions depend on nothing the rounds change: all rounds in one call
        # One draw: the same values, in the same order, as one draw a round (C order).
        directions = rng.standard_normal((rounds, dev.shape[1]))
        pair_rounds(*tables, 0, directions, bins_C, bin_first, sum_BD, bin_I)
        return bin_I
    for t in range(rounds):
        if t == 0:
            first = by_round[: ends[0]]
            direction = _direction(take_rows(dev, first), rng)
        else:
            direction = _direction(sum_BD, rng)
        pair_rounds(*tables, t, direction[None, :], bins_C, bin_first, sum_BD, bin_I)
    return bin_I


def _direction(dev_XD: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(D,) the pairing direction: the deviations' principal axis, jittered by a random draw.

    Pairing along the axis where the bins' sums (the items', in the first round) spread most
    cancels the largest deviations first; the random part varies the axis between rounds.
    """
    noise = rng.standard_normal(dev_XD.shape[1])
    if dev_XD.shape[1] < 2 or len(dev_XD) < 2:
        return noise
    top, value = principal_axis(dev_XD - dev_XD.mean(axis=0))
    scale = float(np.sqrt(max(value, 0.0) / len(dev_XD)))
    return top * max(scale, 1e-12) + 0.3 * scale * noise / np.sqrt(dev_XD.shape[1])


def principal_axis(centered_XD: np.ndarray) -> tuple[np.ndarray, float]:
    """``(axis, value)``: the unit (D,) axis along which the rows of ``centered_XD`` spread most and
    their summed squares along it (the top eigenvector and eigenvalue of ``centered.T @ centered``).

    By power iteration in IEEE products and in-order sums, from the scatter's column of the
    largest diagonal: the same bits, and the same sign, on every machine. ``np.linalg.eigh``
    leaves both to the LAPACK and BLAS build (the sign of an eigenvector is arbitrary), and the
    pairing sorts by the projection, so a near-tie or a flipped sign paired other groups.

    Example:
        >>> axis, value = principal_axis(np.array([[1.0, 1.0], [-1.0, -1.0], [0.5, -0.5], [-0.5, 0.5]]))
        >>> np.round(axis, 6).tolist(), round(value, 6)
        ([0.707107, 0.707107], 4.0)
    """
    D = centered_XD.shape[1]
    scatter = np.stack([column_sums(centered_XD * centered_XD[:, [d]]) for d in range(D)])
    axis = _unit(scatter[:, int(np.argmax(np.diagonal(scatter)))])
    if axis is None:  # no spread (or none a float holds): any axis
        return np.eye(D)[0], 0.0
    for _ in range(_POWER_STEPS):
        step = _unit(project(scatter, axis))
        if step is None:  # underflow or overflow: keep the axis so far
            break
        done = float(np.abs(step - axis).max()) <= _POWER_TOL
        axis = step
        if done:
            break
    return axis, float((axis * project(scatter, axis)).sum())


def _unit(v_D: np.ndarray) -> np.ndarray | None:
    """``v_D`` scaled to length 1, or None where its length is 0 or past what a float holds."""
    length = float(np.sqrt((v_D * v_D).sum()))
    return v_D / length if 0.0 < length < np.inf else None


