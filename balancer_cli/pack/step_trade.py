"""Rows of one kind trade groups across steps, so that each step's groups equal their own mean.

The assigner puts side by side groups that are nearly equal. Where the packer cannot make every
group equal (a module whose samples come in few large pieces: 1-3 audio clips of 50-1,500 tokens
under a clip cap, whose tokens are part of the LLM sequence too), a step's R groups still differ,
and the polish (:mod:`balancer_cli.pack.polish`), which trades only within a step, finds too few
rows there to even them out. Here a group trades with groups of *every* step: the packer's local
search (:func:`~balancer_cli.pack.packers._balanced_refine.refine`, targeted and random-partner
swaps) on group sums shifted by their step's mean, so that a group's deviation from the target
is its deviation from its own step's mean, and an exchange lowers the spread of both steps.

Only two rows of one *kind* trade places (``hold_N``): the same source (the 15 most frequent
apart, the rest as one, as every source tally of the packer counts them), the same cost on
every discrete module (few distinct group sums, e.g. tiles x 256) and the same presence of every
sparse module. So every group keeps its source counts (every step its source mix, exactly), its
discrete sums (the assigner's exact classes) and whether it holds a sparse module; no row moves
alone, so the group sizes stay too. The step means move as rows cross steps: the shifts are
computed again every round.

With M micro-batches a rank runs its M groups one after another, so what must be even is their
sum: a group's deviation is then its *rank's* deviation from the step's mean rank load, a 1/M
share of it to each of the rank's groups (with one micro-batch, the group's own).

It runs after the polish on windows of at most 500k rows (one round within :data:`TRADE_ROWS`),
where a dense module that rows can even out (not a discrete one: rows keep their discrete
costs) is still uneven: its mean idle share ``(max - mean) / max`` over the ranks above
:data:`TRADE_ABOVE`. The search lowers squared deviations, while the Dist Ratio and utilization
are set by each step's *largest* group; with many ranks the squares can fall while a few groups
a step grow. So the traded groups are polished again and kept only where they are better by
those measures (:func:`_better`); the search stops at the first round that is not better than
the one before. Measured on three-module inputs in docs/packing.md ("Trades across steps").

Example:
    >>> import numpy as np
    >>> from balancer_cli.pack.types import Assignment, Packing, group_sums
    >>> cost = np.array([[0., 8.], [0., 4.], [0., 4.], [0., 4.], [0., 6.], [0., 6.], [0., 6.], [0., 2.]])
    >>> p = Packing(order=np.arange(8), group_offsets=np.array([0, 2, 4, 6, 8]), isolated=np.zeros(4, bool),
    ...             dropped=np.zeros(0, np.int64), dropped_reason=())
    >>> a = Assignment(step=np.array([0, 0, 1, 1]), rank=np.array([0, 1, 0, 1]), micro=np.zeros(4, np.int64),
    ...                num_steps=2)
    >>> group_sums(p, cost)[:, 1].tolist()  # steps of 12 + 8 twice; no swap within a step evens them out
    [12.0, 8.0, 12.0, 8.0]
    >>> q = trade_across_steps(p, a, cost, cost.astype(np.int64), np.array([1, 20]), np.zeros(8, np.int64))
    >>> group_sums(q, cost)[:, 1].tolist()  # an 8 and a 6, then a 4 and a 6 traded steps
    [10.0, 10.0, 10.0, 10.0]
"""

from __future__ import annotations

import numpy as np

from balancer_cli._index import concat_ranges, sum_rows
from balancer_cli.metrics import dist_ratio, step_loads
from balancer_cli.pack._blocks import discrete_modules, sparse_modules
from balancer_cli.pack.assign import MAX_SOURCES
from balancer_cli.pack.packers._balanced_refine import refine
from balancer_cli.pack.packers._table_kernels import group_tables
from balancer_cli.pack.polish import polish_steps
from balancer_cli.pack.types import (
    Assignment,
    Packing,
    dense_ids,
    group_sums,
    row_ids,
    top_codes,
)

__all__ = [
    "TRADE_ABOVE",
    "TRADE_MAX_KINDS",
    "TRADE_PASSES",
    "TRADE_ROUNDS",
    "TRADE_ROWS",
    "TRADE_SLACK",
    "row_kinds",
    "trade_across_steps",
]

#: Rounds of the search; each computes the step means again, then runs ``TRADE_PASSES`` passes.
TRADE_ROUNDS = 4
TRADE_PASSES = 2
#: Row-passes a window's trade may cost (fewer rounds above 125k rows): a targeted pass costs
#: ~2 us a row (76k rows, three modules: 0.15 s), and without targeted swaps the trade gains
#: little (docs/packing.md).
TRADE_ROWS = 1_000_000
#: A window's polished steps are traded when a dense module's mean idle share over the ranks
#: exceeds this (60% of the Dist Ratio bound; below, they keep the bound with a margin).
TRADE_ABOVE = 0.003
#: More kinds than this: no trade (the kernels tally every kind per group and exchange).
TRADE_MAX_KINDS = 256
#: A trade is kept only where no module's idle share rises by more than this (:func:`_better`).
TRADE_SLACK = 0.0005


def trade_across_steps(packing: Packing, assignment: Assignment, cost_NK: np.ndarray, load_NK: np.ndarray,
                       caps_K: np.ndarray, source_N: np.ndarray, *, seed: int = 0,
                       rounds: int = TRADE_ROUNDS, polish_passes: int = 0, polish_seed: int = 0) -> Packing:
    """The packing with rows of one kind traded between steps (see the module docstring).

    Groups keep their index (so their slot), their size, their source counts and their discrete
    sums; isolated oversize groups and groups the assigner left out are not touched.

    Args:
        packing: groups (G of them) as the assigner placed them.
        assignment: the groups' slots.
        cost_NK: (N, K) per-sample cost to balance, encoders first, LLM last.
        load_NK: (N, K) per-sample integer load, checked against ``caps_K``.
        caps_K: (K,) caps per group.
        source_N: (N,) source code of each sample.
        seed: seeds the search's visiting orders and partners.
        rounds: rounds of :data:`TRADE_PASSES` passes (fewer where :data:`TRADE_ROWS` says so).
        polish_passes: the traded groups are polished with this many passes
            (:func:`~balancer_cli.pack.polish.polish_steps`, seeded with ``polish_seed``) before
            they are judged.

    Returns:
        A :class:`Packing` of the same samples, groups and slots: the traded one where it is
        better (:func:`_better`), else ``packing`` itself.
    """
    order = np.asarray(packing.order, dtype=np.int64)
    offsets = np.asarray(packing.group_offsets, dtype=np.int64)
    step = np.asarray(assignment.step, dtype=np.int64)
    rank = np.asarray(assignment.rank, dtype=np.int64)
    count = np.diff(offsets)
    rounds = min(rounds, TRADE_ROWS // (TRADE_PASSES * max(len(order), 1)))
    if rounds < 1 or len(order) < 2 or assignment.num_steps < 2:
        return packing
    M = int(np.asarray(assignment.micro).max(initial=0)) + 1
    R = int(rank.max(initial=0)) + 1
    cost = np.ascontiguousarray(cost_NK, dtype=np.float64)
    csum_GK = group_sums(packing, cost)
    placed = step >= 0
    traded_G = placed & ~np.asarray(packing.isolated, dtype=bool) & (count > 0)
    # The dense modules the trade can even out: rows keep their discrete costs (the kinds), so a
    # module of few group sums stays as it is (its step spread is the assigner's classes').
    traded_GK = csum_GK[traded_G]
    tradable_K = ~sparse_modules(traded_GK) & ~discrete_modules(traded_GK)
    before_K = _idle_share(csum_GK[placed], step[placed], rank[placed], assignment.num_steps)
    if not traded_G.any() or before_K[tradable_K].max(initial=0.0) <= TRADE_ABOVE:
        return packing
    kind_N = row_kinds(cost, source_N, traded_GK)
    if kind_N.max(initial=0) + 1 > TRADE_MAX_KINDS:
        return packing
    groups_J = np.flatnonzero(traded_G)
    J = len(groups_J)
    rows_F = order[concat_ranges(offsets[groups_J], count[groups_J])]
    local_F = np.repeat(np.arange(J), count[groups_J])
    load = np.ascontiguousarray(load_NK).astype(np.int64, copy=False)
    members_JX, count_J, wsum_JK, lsum_JK = group_tables(rows_F, local_F, J, int(count.max()) + 1, cost, load)
    before = _kind_counts(members_JX, count_J, kind_N)
    step_J = step[groups_J]
    # The search weighs module k by 1 / target_k^2 (a group's deviation is taken from its step's
    # mean whatever the target): the mean of the groups that hold k, so that a sparse module
    # (audio in 5% of the groups, a small global mean) does not outweigh the LLM.
    held_JK = wsum_JK > 0
    target_K = np.where(held_JK.any(axis=0), (wsum_JK * held_JK).sum(axis=0) / np.maximum(held_JK.sum(axis=0), 1),
                        0.0)
    rng = np.random.default_rng(seed)
    caps = np.asarray(caps_K, dtype=np.int64)
    last_K = before_K
    for index in range(rounds):
        # A group's deviation is its rank's load (its own sum and its rank's other groups') less
        # the step's mean rank load, shared by the rank's M groups: each exchange evens out a 1/M
        # share of it. With one micro-batch: its own sum less the step's mean group (the last
        # two terms are 0). Every placed group counts (isolated ones run beside the others).
        others_GK, mean_SK = _rank_loads(csum_GK, step, rank, placed, assignment.num_steps, R)
        shift_JK = (mean_SK[step_J] / M - target_K) + wsum_JK * (1.0 - 1.0 / M) - others_GK[groups_J] / M
        shifted_JK = np.ascontiguousarray(wsum_JK - shift_JK)
        sums = refine(members_JX, count_J, shifted_JK, lsum_JK, cost, load, caps, rows_F, passes=TRADE_PASSES,
                      source_N=None, max_sources=MAX_SOURCES, rng=rng, threads=1, hold_N=kind_N)
        wsum_JK = sums[:, : cost.shape[1]] + shift_JK
        csum_GK[groups_J] = wsum_JK
        # Unpolished, a round's groups are judged against the last round's, not against the
        # polished input (the polish would favour the input: speech 81k at --dp 16 is kept after
        # 4 rounds, LLM Dist 0.0034 -> 0.0020, but its first round looks worse than the input).
        round_K = _idle_share(csum_GK[placed], step[placed], rank[placed], assignment.num_steps)
        if index > 0 and not _better(last_K, round_K, tradable_K):
            break  # the largest groups stopped shrinking (see _better)
        last_K = round_K
    if not np.array_equal(_kind_counts(members_JX, count_J, kind_N), before):
        return packing  # a safety net: HOLD_WEIGHT makes a changed kind count cost more than any gain
    new_order = order.copy()
    mask = np.arange(members_JX.shape[1])[None, :] < count_J[:, None]
    new_order[concat_ranges(offsets[groups_J], count_J)] = members_JX[mask]
    traded = Packing(order=new_order, group_offsets=offsets, isolated=packing.isolated, dropped=packing.dropped,
                     dropped_reason=packing.dropped_reason)
    if polish_passes > 0:
        traded = polish_steps(traded, assignment, cost, load, caps, seed=polish_seed, passes=polish_passes)
    after_K = _idle_share(group_sums(traded, cost)[placed], step[placed], rank[placed], assignment.num_steps)
    return traded if _better(before_K, after_K, tradable_K) else packing


def _better(before_K, after_K, tradable_K):
    """Whether idle shares ``after_K`` beat ``before_K``: the worst of the modules the trade evens
    out (``tradable_K``: dense, not discrete) is lower and no module's rises by more than
    :data:`TRADE_SLACK`. The search lowers squared deviations from
    the step means; the Dist Ratio and utilization are set by each step's *largest* group, and
    with many ranks the squares can fall while a few groups per step grow (``speech`` 94k at
    ``--dp 64``: squared LLM spread -10%, its Dist Ratio 0.0061 -> 0.0130)."""
    if not tradable_K.any() or after_K[tradable_K].max() >= before_K[tradable_K].max():
        return False
    return bool((after_K <= before_K + TRADE_SLACK).all())


def row_kinds(cost_NK: np.ndarray, source_N: np.ndarray, cost_GK: np.ndarray, *, rows: np.ndarray | None = None,
              skip: int | None = None, max_sources: int | None = MAX_SOURCES) -> np.ndarray:
    """(N,) kind of every row: its source (the 15 most frequent apart), its cost on every discrete
    module and whether it holds each sparse module (both judged on the groups' sums ``cost_GK``).

    Args:
        cost_NK: (N, K) per-sample cost, encoders first, LLM last.
        source_N: (N,) source code of each sample.
        cost_GK: (G, K) the groups' sums, which decide the sparse and discrete modules.
        rows: the rows to key (default all): the kinds are of these, in their order.
        skip: an encoder module left out of the key (the tile swaps change it).
        max_sources: sources kept apart (the rest as one; default the assigner's source tallies,
            :data:`~balancer_cli.pack.assign.MAX_SOURCES`); None keeps every source apart.

    Example:
        >>> cost = np.array([[256., 10.], [256., 30.], [512., 10.], [256., 12.]])
        >>> groups = np.array([[512., 40.], [768., 22.]])  # vision takes few values: discrete
        >>> row_kinds(cost, np.array([0, 0, 0, 1]), groups).tolist()
        [0, 0, 1, 2]
        >>> row_kinds(cost, np.array([0, 0, 0, 1]), groups, skip=0).tolist()
        [0, 0, 0, 1]
    """
    picked = slice(None) if rows is None else rows
    source = dense_ids(np.asarray(source_N).reshape(-1)[picked])
    key = [source if max_sources is None else top_codes(source, max_sources)[0][source]]
    sparse_K = sparse_modules(cost_GK)
    discrete_K = discrete_modules(cost_GK)
    for k in range(cost_NK.shape[1] - 1):  # encoders; the LLM is never discrete
        if k == skip:
            continue
        if sparse_K[k]:
            key.append((cost_NK[picked, k] > 0).astype(np.int64))
        elif discrete_K[k]:
            key.append(dense_ids(cost_NK[picked, k]))
    return row_ids(np.column_stack(key))


def _rank_loads(cost_GK, step_G, rank_G, placed_G, num_steps, world_size):
    """((G, K), (S, K)): what the other groups of each placed group's rank hold in its step (0 with
    one micro-batch, and for groups not placed), and each step's mean rank load (its sum over R)."""
    slot = step_G[placed_G] * world_size + rank_G[placed_G]
    others_GK = np.zeros_like(cost_GK)
    others_GK[placed_G] = sum_rows(slot, cost_GK[placed_G], num_steps * world_size)[slot] - cost_GK[placed_G]
    return others_GK, sum_rows(step_G[placed_G], cost_GK[placed_G], num_steps) / world_size


def _idle_share(cost_GK, step_G, rank_G, num_steps):
    """(K,) each module's Dist Ratio (:func:`~balancer_cli.metrics.dist_ratio`: the mean over
    steps of ``(max - mean) / max`` over the ranks' loads, each the sum of its groups)."""
    R = int(rank_G.max(initial=0)) + 1
    return np.array([dist_ratio(step_loads(step_G, rank_G, cost_GK[:, k], num_steps=num_steps, world_size=R))
                     for k in range(cost_GK.shape[1])])


def _kind_counts(members_JX, count_J, kind_N):
    """(J, kinds) each group's count of rows of each kind."""
    J, X = members_JX.shape
    mask = np.arange(X)[None, :] < count_J[:, None]
    kinds = int(kind_N.max(initial=0)) + 1
    return np.bincount(np.repeat(np.arange(J), count_J) * kinds + kind_N[members_JX[mask]], minlength=J * kinds)
