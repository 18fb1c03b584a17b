"""Refinement of the balanced packer's groups (step 3 of :mod:`balancer_cli.pack.packers.balanced`).

Builds what the local-search kernels (:mod:`balancer_cli.pack.packers._refine_kernels`) need: the
per-module targets, a grid of rows by normalized weight for targeted swaps, candidate partner
groups, and optional per-source columns that make groups equal source mixes; then runs the
passes. All randomness comes from the caller's generator, in a fixed order, so results are
reproducible.

Large inputs (at least :data:`BLOCKS_FROM` groups) run each random-partner pass in blocks of
:data:`BLOCK_GROUPS`: the groups are renumbered in a seeded random order once, so that a block
of consecutive numbers is a random subset of groups whose tables lie side by side in memory,
small enough for the cache, and every group takes its partners within its block. Odd passes shift the blocks by
half a block, so groups meet other partners. Blocks share no group: two threads run them side by
side where two cores are free (the kernels release the GIL), and the result does not depend on it.
"""

from __future__ import annotations

import itertools

import numpy as np

from balancer_cli._columns import column_max, column_sums, project
from balancer_cli._index import take_rows
from balancer_cli._jit import HAVE_NUMBA
from balancer_cli._procs import usable_cores
from balancer_cli._shuffle import permutation
from balancer_cli._sort import stable_order
from balancer_cli.errors import UsageError
from balancer_cli.pack._blocks import sparse_modules
from balancer_cli.pack.packers._refine_kernels import refine_pass, targeted_pass
from balancer_cli.pack.packers._table_kernels import (
    compact_rows,
    expand_rows,
    grid_cells,
)
from balancer_cli.pack.types import dense_ids, top_codes

__all__ = ["refine", "PARTNERS", "CELL_WIDTH", "SCAN", "MIX_WEIGHT", "TARGETED_MIN_SHARE", "TARGETED_MAX_ROWS",
           "BLOCK_GROUPS", "BLOCKS_FROM", "HOLD_WEIGHT"]

#: Candidate partner groups per group and random-partner pass (half random, half opposite).
PARTNERS = 3
#: Grid cell of targeted swaps, as a share of a group's target per module.
CELL_WIDTH = 0.01
#: Samples tried per grid cell lookup of targeted swaps.
SCAN = 8
#: Weight of the per-source terms in the squared objective (the modules' weigh 1): more costs
#: LLM balance where sources differ a lot (docs/packing.md, the ``mix_weight`` table).
MIX_WEIGHT = 1e-2
#: Targeted swaps stop once a pass improves fewer than this share of the groups.
TARGETED_MIN_SHARE = 0.01
#: Targeted swaps only for at most this many rows: each candidate is a random row of the whole
#: table, so past ~1M rows every lookup misses the cache (3M rows: 6 s a pass against 1.8 s for
#: a random-partner pass), for the same Dist Ratio and steps (docs/packing.md).
TARGETED_MAX_ROWS = 1_000_000
#: Groups per block of a random-partner pass (module docstring): ~1.7 MB of tables, about what a
#: core's own (L2) cache holds, where a pass over all groups reads random groups of ~75 MB (1.2M
#: rows, 211k groups). 770k rows, three passes, CPU time: 0.73-0.80 s with blocks of 16,384
#: (~7 MB, the shared cache), 0.56-0.66 s; on two threads 0.81 s -> 0.60 s (docs/packing.md).
BLOCK_GROUPS = 4_096
#: Passes run in blocks from this many groups on (~190k samples): below, every table fits the
#: shared cache and a group's partners come from all groups.
BLOCKS_FROM = 32_768
#: Weight of a ``hold_N`` column's squared term: a changed code count costs this much, far more
#: than a module term ``((sum - t) / t)^2`` can gain (the caller checks the counts anyway).
HOLD_WEIGHT = 1e9
#: A group whose objective term is at most this is on target (the passes skip it).
_TOL = 1e-12
#: Targeted swaps' grid keeps offsets for its occupied cells only past this many cells a row
#: (:func:`~balancer_cli.pack.packers._table_kernels.grid_cells`; the same swaps either way).
_SPARSE_CELLS_PER_ROW = 8


def refine(members_GX: np.ndarray, count_G: np.ndarray, wsum_GK: np.ndarray, lsum_GK: np.ndarray,
           weight_NK: np.ndarray, load_NK: np.ndarray, caps_K: np.ndarray, rows: np.ndarray, *, passes: int,
           source_N: np.ndarray | None, max_sources: int, rng: np.random.Generator,
           threads: int | None = None, hold_N: np.ndarray | None = None, settled_cv: float = 0.0) -> np.ndarray:
    """Even out the groups in place: ``passes`` rounds of targeted, then random-partner swaps.

    Stops early when a round changes nothing. ``members_GX`` and ``count_G`` hold the result;
    the sums are updated along (with ``source_N``, on extended copies of ``wsum_GK``).

    Returns:
        (G, K + O) the final sums: the K weight columns, then (with ``source_N``) each group's
        sample count of each of the O tracked sources.

    Args:
        members_GX: (G, X) member rows of each group (-1 padded), updated.
        count_G: (G,) members per group, updated.
        wsum_GK: (G, K) weight sums per group (float).
        lsum_GK: (G, K) load sums per group (int64), updated.
        weight_NK: (N, K) balanced weight of every row.
        load_NK: (N, K) capped load of every row (int64).
        caps_K: (K,) caps (int64).
        rows: (F,) the rows in the groups.
        passes: rounds to run (>= 1).
        source_N: (N,) source of every row, or None (no source terms).
        max_sources: sources tracked (the ``max_sources - 1`` most frequent, the rest as one).
        rng: draws the visiting orders and the partner groups.
        threads: threads for the blocks of a large pass (None: two where two cores are usable);
            the result does not depend on it.
        hold_N: (N,) instead of ``source_N``: a code per row; every group keeps its count of
            each code, so rows only trade places with rows of their own code and none moves
            alone (:mod:`balancer_cli.pack.step_trade`). The returned sums then end with one
            constant column per code.
        settled_cv: stop after the second pass once every module that most groups hold has a
            coefficient of variation of its group sums of at most this (0: run every pass).

    Example:
        >>> import numpy as np
        >>> members_GX = np.array([[0, 1], [2, 3]]); count_G = np.array([2, 2])
        >>> load_NK = np.array([[4], [3], [1], [0]]); wsum_GK = np.array([[7.0], [1.0]])
        >>> sums = refine(members_GX, count_G, wsum_GK, np.array([[7], [1]]), load_NK.astype(float), load_NK,
        ...               np.array([9]), np.arange(4), passes=2, source_N=None, max_sources=16,
        ...               rng=np.random.default_rng(0))
        >>> wsum_GK.ravel().tolist(), sorted(map(sorted, members_GX.tolist()))
        ([4.0, 4.0], [[0, 3], [1, 2]])
    """
    G, K = wsum_GK.shape
    if source_N is not None and hold_N is not None:
        raise UsageError("refine takes source_N or hold_N, not both", fix="pass one of them")
    codes_N = source_N if hold_N is None else hold_N
    if codes_N is not None and len(codes_N) != len(load_NK):
        name = "source_N" if hold_N is None else "hold_N"
        raise UsageError(f"{name} has {len(codes_N)} rows, loads {len(load_NK)}", fix="pass one value per sample")
    # The kernels read each visited group's rows many times: on rows renumbered in group order
    # (compact copies of their weights and loads) a group's rows are neighbours in memory, which
    # halves a pass at 1M rows (random reads of (N, K) tables were its cost, not the arithmetic).
    # In blocks, the groups are renumbered too (new group n is group order_G[n]).
    blocks = G >= max(BLOCKS_FROM, 2 * BLOCK_GROUPS)
    order_G = permutation(rng, G) if blocks else np.arange(G)
    rows_F, local_GX, weight_FK, load_FK, source_F = compact_rows(
        members_GX, count_G, np.ascontiguousarray(weight_NK, dtype=np.float64), np.ascontiguousarray(load_NK),
        np.zeros(0, np.int8) if codes_N is None else dense_ids(np.asarray(codes_N).reshape(-1)), order_G)
    count_n, wsum_n, lsum_n = (take_rows(t, order_G) for t in (count_G, wsum_GK, lsum_GK)) if blocks else (
        count_G, wsum_GK, lsum_GK)
    target_K = column_sums(wsum_n) / G
    inv_t = np.divide(1.0, target_K, out=np.zeros_like(target_K), where=target_K > 0)
    inv_t2 = inv_t**2
    targeted = len(rows_F) <= TARGETED_MAX_ROWS
    grid = _weight_grid(weight_FK, inv_t, CELL_WIDTH) if targeted else None
    wsum, code = wsum_n, np.zeros(0, np.int8)
    if source_N is not None:
        # Per-source sample counts join the objective with a small weight: groups become
        # equal mixes of sources too, so whatever class of groups the assigner puts in a step
        # (e.g. equal item counts), the step stays a random-like mix.
        code, wsum, target_K, inv_t, inv_t2 = _with_sources(source_F, count_n, wsum_n, max_sources)
    elif hold_N is not None:
        code, wsum, target_K, inv_t, inv_t2 = _held(source_F, wsum_n)
    for index in range(passes):
        changed = 0
        if targeted:
            group_of, pos = _membership(local_GX, count_n)
            changed = targeted_pass(permutation(rng, G), local_GX, count_n, group_of, pos, wsum, lsum_n, weight_FK,
                                    code, load_FK, caps_K, target_K, inv_t, inv_t2, *grid, SCAN, _TOL)
            # Under tight caps (full groups) targeted swaps find no room in either group: once a pass
            # improves fewer than TARGETED_MIN_SHARE of the groups, later passes skip it (~45% of a pass).
            targeted = changed >= TARGETED_MIN_SHARE * G
        tables = (local_GX, count_n, wsum, lsum_n, weight_FK, code, load_FK, caps_K, target_K, inv_t2, _TOL)
        changed += _partner_pass(wsum[:, :K], target_K[:K], inv_t[:K], tables, rng, threads, blocks=blocks,
                                 shifted=index % 2 == 1)
        if changed == 0 or (settled_cv > 0 and 1 <= index < passes - 1
                            and _settled(wsum[:, :K], target_K[:K], settled_cv)):
            break
    expand_rows(local_GX, count_n, rows_F, members_GX, order_G)
    if not blocks:
        return wsum
    count_G[order_G], lsum_GK[order_G], wsum_GK[order_G] = count_n, lsum_n, wsum[:, :K]
    sums = np.empty_like(wsum)
    sums[order_G] = wsum
    return sums


def _partner_pass(wsum_GK, target_K, inv_t_K, tables, rng, threads, blocks, shifted):
    """One random-partner pass over all groups (``tables``: :func:`refine_pass`'s arguments after
    the partners); with ``blocks`` (:func:`refine` renumbered the groups), in blocks of
    :data:`BLOCK_GROUPS` (shifted by half a block with ``shifted``; module docstring)."""
    G = len(wsum_GK)
    edges = [0, G]  # one block: every group
    if blocks:
        count = -(-G // BLOCK_GROUPS)
        size = -(-G // count)
        starts = np.arange(size // 2 if shifted else 0, G, size)
        edges = np.unique(np.concatenate([[0], starts, [G]])).tolist()
    cand = np.empty((G, PARTNERS), np.int64)
    visits = []
    for lo, hi in itertools.pairwise(edges):  # partners within the block
        cand[lo:hi] = lo + _partners(wsum_GK[lo:hi], target_K, inv_t_K, rng)
        visits.append(lo + permutation(rng, hi - lo))

    def run(visit):
        return refine_pass(visit, cand, *tables)

    if threads is None:
        threads = 2 if HAVE_NUMBA and usable_cores() > 1 else 1
    if threads < 2 or len(visits) < 2:
        return sum(map(run, visits))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2, thread_name_prefix="balancer-refine") as pool:
        return sum(pool.map(run, visits))


def _settled(wsum_GK, target_K, max_cv):
    """Whether every dense module's group sums (held by most groups; :func:`sparse_modules`) have a
    coefficient of variation ``sqrt(mean((sum - target)^2)) / target`` of at most ``max_cv``."""
    dense_K = ~sparse_modules(wsum_GK) & (target_K > 0)
    cv_K = np.sqrt(((wsum_GK[:, dense_K] - target_K[dense_K]) ** 2).mean(axis=0)) / target_K[dense_K]
    return bool((cv_K <= max_cv).all())


def _with_sources(source_F, count_G, wsum_GK, max_sources):
    """Per-source columns of the group sums (the ``max_sources - 1`` most frequent sources, the
    rest as one); their objective terms get :data:`MIX_WEIGHT`.

    A row's source is one column of ones, so the kernels take its column index (``code``)
    instead of an (F, O) one-hot block.

    Args:
        source_F: (F,) source of each packed row, rows in group order (group 0's first).
        count_G: (G,) rows per group.
        wsum_GK: (G, K) weight sums per group.
        max_sources: sources tracked.

    Returns:
        (code_F, wsum, target, inv_t, inv_t2): each row's source column (int8 up to 127
        columns), and the sums, targets and weights extended by the O source columns.
    """
    code = dense_ids(np.asarray(source_F).reshape(-1))
    col, O = top_codes(code, max_sources)
    code_F = col[code].astype(np.int8 if O <= 127 else np.int32)
    G, K = wsum_GK.shape
    msum_GO = np.bincount(np.repeat(np.arange(G), count_G) * O + code_F, minlength=G * O).reshape(G, O)
    wsum = np.ascontiguousarray(np.hstack([wsum_GK, msum_GO.astype(np.float64)]))
    target_K = column_sums(wsum) / G
    inv_t = np.divide(1.0, target_K, out=np.zeros_like(target_K), where=target_K > 0)
    inv_t2 = inv_t**2
    inv_t2[K:] *= MIX_WEIGHT
    return code_F, wsum, target_K, inv_t, inv_t2


def _held(code_F, wsum_GK):
    """Like :func:`_with_sources`, for ``hold_N``: one column per code, the same value (1) in every
    group and a weight of :data:`HOLD_WEIGHT`. An exchange of two rows of one code leaves the
    columns as they are (the kernels add no term for it); any other exchange or move changes a
    column by one, which costs more than any module term can gain."""
    O = int(code_F.max()) + 1 if len(code_F) else 0
    G, K = wsum_GK.shape
    wsum = np.ascontiguousarray(np.hstack([wsum_GK, np.ones((G, O))]))
    target_K = np.concatenate([column_sums(wsum_GK) / G, np.ones(O)])
    inv_t = np.divide(1.0, target_K, out=np.zeros_like(target_K), where=target_K > 0)
    inv_t2 = inv_t**2
    inv_t2[K:] = HOLD_WEIGHT
    return code_F.astype(np.int8 if O <= 127 else np.int32), wsum, target_K, inv_t, inv_t2


def _membership(members_GX, count_G):
    """(group_of_F, pos_F): each row's group and position in it (rows numbered 0 .. F-1)."""
    G, X = members_GX.shape
    mask = np.arange(X)[None, :] < count_G[:, None]
    rows = members_GX[mask]
    group_of = np.empty(len(rows), dtype=np.int64)
    pos = np.empty(len(rows), dtype=np.int64)
    group_of[rows] = np.repeat(np.arange(G), count_G)
    pos[rows] = np.nonzero(mask)[1]
    return group_of, pos


def _weight_grid(weight_FK, inv_t_K, width):
    """Bucket rows by normalized weight (cells of ``width`` per module, at most ~2M cells; offsets
    for the occupied cells only where the grid has over :data:`_SPARSE_CELLS_PER_ROW` cells a row)."""
    top = column_max(weight_FK) * inv_t_K  # the largest normalized weight (inv_t_K >= 0)
    while np.prod(np.floor(top / width) + 1) > 2**21:
        width *= 1.5
    dims = (np.floor(top / width) + 1).astype(np.int64)
    sparse = float(np.prod(dims.astype(np.float64))) > _SPARSE_CELLS_PER_ROW * len(weight_FK)
    keys, cell_start, order = grid_cells(weight_FK, inv_t_K, float(width), dims, sparse)
    return keys, cell_start, order, float(width), dims


def _partners(wsum_GK, target_K, inv_t_K, rng):
    """(G, C) candidate partners: half random, half opposite along a random direction."""
    G, K = wsum_GK.shape
    n_opp = PARTNERS // 2
    cand = rng.integers(0, G, size=(G, PARTNERS))
    if n_opp and G > 1:
        dev = (wsum_GK - target_K) * inv_t_K
        key = project(dev, rng.standard_normal(K))  # in column order: the same near-ties on every machine
        by_key = stable_order(key)
        rank = np.empty(G, dtype=np.int64)
        rank[by_key] = np.arange(G)
        mirror = G - 1 - rank
        offs = np.arange(n_opp) - n_opp // 2
        pos = np.clip(mirror[:, None] + offs[None, :], 0, G - 1)
        cand[:, :n_opp] = by_key[pos]
    return cand
