"""Ranks that differ on a discrete module (tiles) trade samples until each step's ranks hold the same.

The assigner balances a discrete module (few distinct group sums, e.g. tiles x 256 tokens)
exactly where a cell's groups fill whole blocks; the last leftovers are cut where the other
modules spread most, so a block can hold 18- and 19-tile groups and a step's ranks then hold 36
and 37 tiles. No trade of equal rows can fix it (a step's total is not a multiple of its ranks),
and the polish moves samples within a step only. Here two samples that differ by whole quanta of
the module (a tile, or as many as the ranks must give and take) and are of one *kind* otherwise
(source, presence of each sparse module, cost on every other discrete module: so every step
keeps its source mix exactly) swap groups:
the sample with more goes from a rank above its step's target to one below. Targets are whole
quanta a rank, each step's nearest to its mean, so that what the steps above give the steps
below take. Of the candidates, the pair whose other modules differ least (normalized) swaps,
within every cap. Where no pair of the two ranks fits the caps (with one micro-batch a rank is
one group, often a few tokens under the LLM cap), the quantum goes through a third rank on
target: two swaps, giver to it and it to taker, which leave its load as it was.

Example:
    >>> import numpy as np
    >>> from balancer_cli.pack.types import Assignment, Packing, group_sums
    >>> cost = np.array([[512., 900.], [512., 700.], [512., 880.], [256., 690.],   # steps 0 and 1,
    ...                  [512., 500.], [256., 760.], [256., 780.], [256., 505.]])  # 2 samples a group
    >>> load = np.column_stack([cost[:, 0] // 256, cost[:, 1]]).astype(np.int64)  # tiles, LLM tokens
    >>> p = Packing(order=np.arange(8), group_offsets=np.array([0, 2, 4, 6, 8]), isolated=np.zeros(4, bool),
    ...             dropped=np.zeros(0, np.int64), dropped_reason=())
    >>> a = Assignment(step=np.array([0, 0, 1, 1]), rank=np.array([0, 1, 0, 1]), micro=np.zeros(4, np.int64),
    ...                num_steps=2)
    >>> (group_sums(p, cost)[:, 0] / 256).tolist()  # ranks of 4 and 3 tiles, then 3 and 2
    [4.0, 3.0, 3.0, 2.0]
    >>> q = even_discrete_steps(p, a, cost, load, np.array([8, 4000]), np.zeros(8, np.int64))
    >>> (group_sums(q, cost)[:, 0] / 256).tolist()  # a 2-tile and a 1-tile sample swapped steps
    [4.0, 4.0, 2.0, 2.0]
"""

from __future__ import annotations

import numpy as np

from balancer_cli._index import sum_rows
from balancer_cli.pack._blocks import discrete_modules, sparse_modules
from balancer_cli.pack._discrete_kernel import chain_quanta, give_quanta
from balancer_cli.pack._layout import rank_layout
from balancer_cli.pack.step_trade import row_kinds
from balancer_cli.pack.types import Assignment, Packing

__all__ = ["DISCRETE_MAX_SWAPS", "MAX_QUANTA", "even_discrete_steps"]

#: Swaps one window may make (each a search of its giver's takers): where more would be needed, the
#: module is far from exact and the first swaps already take its worst steps.
DISCRETE_MAX_SWAPS = 20_000
#: Quanta one sample may hold for its module to count as tiles (the bench families hold at most 13;
#: token counts of gcd 1 or FLOPs hold thousands to millions, and are balanced as costs instead).
MAX_QUANTA = 1024
#: Through a third rank (:meth:`_Swapper._chain`): candidates per sample, pool positions at most,
#: and windows above this many rows skip it (its setup reads every row: 1.2M, 0.13 s, for a
#: Dist Ratio of 0.0000 either way; the polish stops at the same size).
CHAIN_NEAR = 16
CHAIN_POOL = 200_000
CHAIN_MAX_ROWS = 600_000


def even_discrete_steps(packing: Packing, assignment: Assignment, cost_NK: np.ndarray, load_NK: np.ndarray,
                        caps_K: np.ndarray, source_N: np.ndarray) -> Packing:
    """The packing with samples swapped so that each dense discrete module is even over every
    step's ranks (see the module docstring).

    Groups keep their index (so their slot), their size, their source counts and whether they hold
    each sparse module; isolated oversize groups and groups not placed are not touched.

    Args:
        packing: groups (G of them) as the assigner placed them.
        assignment: the groups' slots.
        cost_NK: (N, K) per-sample cost, encoders first, LLM last.
        load_NK: (N, K) per-sample integer load, checked against ``caps_K``.
        caps_K: (K,) caps per group.
        source_N: (N,) source code of each sample.

    Returns:
        A :class:`Packing` of the same samples, groups and slots (``packing`` itself when no
        discrete module is uneven).
    """
    if len(packing.order) < 2 or assignment.num_steps < 1:
        return packing
    layout = rank_layout(packing, assignment, np.asarray(cost_NK))
    cost, csum_GK, S, R = np.asarray(cost_NK), layout.csum_GK, layout.num_steps, layout.world_size
    held_GK = csum_GK[layout.movable_G]
    sparse_K, discrete_K = sparse_modules(held_GK), discrete_modules(held_GK)
    swapper = None
    for k in np.flatnonzero(~sparse_K & discrete_K):
        load_SR = layout.rank_loads(k).reshape(S, R)
        if (load_SR.max(axis=1) == load_SR.min(axis=1)).all():
            continue  # every step even already (most windows): no pass over the rows
        quantum = _quantum(cost[:, k])
        if quantum is None:
            continue
        dev_SR = _deviations(np.rint(load_SR / quantum).astype(np.int64))
        if not dev_SR.any():
            continue
        if swapper is None:
            swapper = _Swapper(layout, cost, load_NK, caps_K, source_N, held_GK)
        swapper.even(k, quantum, dev_SR.reshape(-1))
    if swapper is None or not swapper.swapped:
        return packing
    return Packing(order=swapper.order, group_offsets=layout.offsets, isolated=packing.isolated,
                   dropped=packing.dropped, dropped_reason=packing.dropped_reason)


def _quantum(cost_N: np.ndarray) -> float | None:
    """The module's quantum: the greatest common divisor of its per-sample costs (one tile's
    tokens), or None where the costs are not whole numbers or a sample holds more than
    :data:`MAX_QUANTA` of it (FLOPs, float32 multiples of 2^17: a swap per unit of rounding)."""
    values = cost_N[cost_N > 0]
    if len(values) == 0 or not np.array_equal(values, np.rint(values)) or values.max() >= 2.0**53:
        return None
    quantum = float(np.gcd.reduce(values.astype(np.int64)))
    return quantum if values.max() <= MAX_QUANTA * quantum else None


def _deviations(load_SR: np.ndarray) -> np.ndarray:
    """(S, R) each rank's load less its step's target, in quanta: every rank of a step holds the
    same whole number, the nearest to the step's mean, except that steps are moved up or down a
    quantum (those closest to halfway first) until what steps above their targets give is what
    the steps below take, to within half a step's ranks."""
    R = load_SR.shape[1]
    total_S = load_SR.sum(axis=1)
    base_S = total_S // R
    rem_S = total_S - base_S * R
    up_S = rem_S * 2 > R  # the target a quantum over the floor: the step takes R - rem
    net = int(np.where(up_S, rem_S - R, rem_S).sum())
    if net * 2 >= R:  # too much to give: the steps of most remainder among those giving take instead
        down = np.flatnonzero(~up_S & (rem_S > 0))
        flip = down[np.argsort(-rem_S[down], kind="stable")][: (net + R // 2) // R]
        up_S[flip] = True
    elif -net * 2 >= R:
        up = np.flatnonzero(up_S)
        flip = up[np.argsort(rem_S[up], kind="stable")][: (-net + R // 2) // R]
        up_S[flip] = False
    return load_SR - (base_S + up_S)[:, None]


class _Swapper:
    """The swap search's state: which sample sits at each position of ``order`` and the groups'
    load sums, updated swap by swap."""

    def __init__(self, layout, cost, load_NK, caps_K, source_N, held_GK):
        order, offsets = layout.order, layout.offsets
        self.order = order.copy()
        self.swapped = 0
        self.offsets = offsets
        self.group_P = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
        self.slot_P = layout.slot_G[self.group_P]
        self.live_P = layout.movable_G[self.group_P]
        self.cost = cost
        self.load = np.asarray(load_NK)
        self.caps = np.asarray(caps_K, dtype=np.int64)
        self.gload_GK = np.zeros((len(offsets) - 1, self.load.shape[1]), np.int64)  # filled where needed
        mean_K = held_GK.mean(axis=0) if len(held_GK) else np.ones(cost.shape[1])
        self.weight_K = np.divide(1.0, mean_K, out=np.zeros_like(mean_K), where=mean_K > 0)
        self.held_GK = held_GK
        self.source_N = np.asarray(source_N).reshape(-1)

    def _kinds(self, k, pos):
        """(len(pos),) the kind of the sample at each of positions ``pos``: its source (every one
        apart: a step keeps its mix exactly), presence of each sparse module and cost on each
        discrete module but ``k``."""
        return row_kinds(self.cost, self.source_N, self.held_GK, rows=self.order[pos], skip=k, max_sources=None)

    def even(self, k, quantum, dev_X):
        """Swap samples a quantum of module ``k`` apart from slots over their target (``dev_X`` > 0)
        to slots under it, the pair whose other modules differ least first."""
        # Only the positions of uneven slots take part (few, where the assigner's blocks were whole).
        pos_U = np.flatnonzero(self.live_P & (dev_X[np.maximum(self.slot_P, 0)] != 0))
        # The loads of the groups these positions fill (a group lies in one slot: all its rows are here).
        group_U = self.group_P[pos_U]
        self.gload_GK[np.unique(group_U)] = 0
        np.add.at(self.gload_GK, group_U, self.load[self.order[pos_U]].astype(np.int64))
        kind_P = np.full(len(self.order), -1, np.int64)
        kind_P[pos_U] = self._kinds(k, pos_U)
        quanta_P = np.zeros(len(self.order), np.int64)
        quanta_P[pos_U] = np.rint(self.cost[self.order[pos_U], k] / quantum)
        span = int(quanta_P.max()) + 2
        # The positions of taker slots, by (kind, quanta): a query's candidates are one range.
        pos_T = pos_U[dev_X[self.slot_P[pos_U]] < 0]
        key_T = kind_P[pos_T] * span + quanta_P[pos_T]
        by_key = np.argsort(key_T, kind="stable")
        others = np.ones(self.cost.shape[1], bool)
        others[k] = False
        pos_V = pos_U[dev_X[self.slot_P[pos_U]] > 0]
        pos_V = pos_V[np.argsort(self.slot_P[pos_V], kind="stable")]  # the givers' positions, slot by slot
        slots = np.flatnonzero(dev_X > 0)
        first, end = (np.searchsorted(self.slot_P[pos_V], edge) for edge in (slots, slots + 1))
        # Each giver sample's takers of 1 .. min(dev, its quanta) quanta less are one range of
        # keys; the least gap per quantum swaps (ties: fewer quanta, less gap, the earlier).
        self.swapped = give_quanta(slots, first, end, pos_V, dev_X, key_T[by_key], pos_T[by_key], kind_P, quanta_P,
                                   span, self.slot_P, self.group_P, self.order, self.load, self.gload_GK, self.caps,
                                   self.cost, others, self.weight_K, DISCRETE_MAX_SWAPS, self.swapped)
        if (dev_X > 0).any() and (dev_X < 0).any() and len(self.order) <= CHAIN_MAX_ROWS:
            self._chain(k, quantum, dev_X, others)

    def _chain(self, k, quantum, dev_X, others):
        """Where no pair of a giver's and a taker's samples fits the caps (a rank's one group at
        the LLM cap), a quantum goes through a third rank ``n`` whose load is on target: the
        giver's x swaps with n's y (one quantum less), and n's x' with the taker's y' (one less),
        so n keeps its load; both pairs are of one kind, and the four samples' groups keep their caps.
        Candidates are the :data:`CHAIN_NEAR` samples of n's kind and quanta nearest in LLM cost."""
        live = np.flatnonzero(self.live_P)
        P = len(self.order)
        kind_P = np.full(P, -1, np.int64)
        kind_P[live] = self._kinds(k, live)
        quanta_P = np.zeros(P, np.int64)
        quanta_P[live] = np.rint(self.cost[self.order[live], k] / quantum)
        span = int(quanta_P.max()) + 2
        self.gload_GK = sum_rows(self.group_P[live], self.load[self.order[live]].astype(np.float64),
                                 len(self.gload_GK)).astype(np.int64)
        # The pool: positions of ranks on target (every few ranks where they are many), by kind,
        # quanta and LLM cost, so that a query's nearest candidates are a window of one range.
        pool = live[dev_X[self.slot_P[live]] == 0]
        if len(pool) > CHAIN_POOL:
            pool = pool[self.slot_P[pool] % -(-len(pool) // CHAIN_POOL) == 0]
        if len(pool) == 0:
            return
        llm_P = self.cost[self.order, -1]
        top = float(llm_P[pool].max(initial=0.0)) + 1.0
        key = (kind_P[pool] * span + quanta_P[pool]) * top + llm_P[pool]
        by = np.argsort(key, kind="stable")
        pool, key = pool[by], key[by]

        # The positions of uneven ranks, slot by slot (a rank only moves towards its target).
        uneven = live[dev_X[self.slot_P[live]] != 0]
        uneven = uneven[np.argsort(self.slot_P[uneven], kind="stable")]
        slot_U = self.slot_P[uneven]
        # The takers' positions ordered by (kind, quanta), ties in ``uneven`` order, as one sorted
        # code per taker: ``key * U + index``. Only a taker's own y' changes its quanta (one more),
        # so its code moves up in place instead of the takers being sorted again each chain (at
        # ``--dp 1024`` those sorts were half this stage's time). No slot becomes a taker here.
        U = len(uneven)
        at_U = np.flatnonzero(dev_X[slot_U] < 0)
        code_T = np.sort((kind_P[uneven[at_U]] * span + quanta_P[uneven[at_U]]) * U + at_U)
        index_P = np.full(P, -1, np.int64)
        index_P[uneven] = np.arange(U)
        slots = np.flatnonzero(dev_X > 0)
        first, end = (np.searchsorted(slot_U, edge) for edge in (slots, slots + 1))
        self.swapped = chain_quanta(slots, first, end, uneven, slot_U, code_T, index_P, kind_P, quanta_P, span, pool,
                                    key, llm_P, top, CHAIN_NEAR, self.slot_P, self.group_P, self.offsets, self.order,
                                    self.load, self.gload_GK, self.caps, self.cost, others, self.weight_K, dev_X,
                                    DISCRETE_MAX_SWAPS, self.swapped)
