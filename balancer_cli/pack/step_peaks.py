"""Each step's heaviest rank gives load to lighter ranks: samples equal on every other module swap.

The polish (:mod:`balancer_cli.pack.polish`) lowers each step's squared spread with random
partners from the step; where a rank is one group of a few samples (one micro-batch), few of its
exchanges keep the other modules and the caps, and the step's heaviest rank, which alone sets
its Dist Ratio ``(max - mean) / max``, often has none left that lowers the squares of the pair.
The trade (:mod:`balancer_cli.pack.step_trade`) searches across steps for squares too, and is
kept only where the maxima fell, which at one micro-batch they rarely do (``speech`` 35k at
``--dp 32``: LLM 0.0081 before and after it).

Here each step's heaviest rank gives, aimed at its excess over the step's mean: one of its
samples swaps with a sample of the same *kind* (the same source and the same cost on every other
module, so every other module's rank loads, every group's size and every step's source mix stay
exactly as they were) that is lighter on the module, from a rank below its own step's mean, in
the same step or any other, whose step's maximum it does not raise. Of the candidates (the
samples of each sample's kind nearest to the excess), the swap that lowers the squared spread
over steps most (each step's deviations from its own mean, step means moved too) is made, within
every cap; then the step's new heaviest rank, until its idle share is at a goal or it finds none.
Steps are visited worst first, in sweeps, in rounds of more candidates and a lower goal where
the window is still uneven (:data:`PEAKS_ROUNDS`). A module is kept as swapped only where its
Dist Ratio fell. Measured in docs/packing.md ("Step peaks").

An encoder whose tokens are part of the LLM sequence (audio) swaps under a guard: no rank's LLM
load may pass its step's maximum. Where that leaves the encoder uneven (one micro-batch, many
ranks: few of its samples' pairs keep the LLM too), the window is shaved again with the LLM's
ranks allowed past their maxima (:data:`PEAKS_LOOSE_ROOMS`), the LLM's own round after the
encoder's evening out what it can; an attempt is kept where it takes no module over the
contract's Dist bound newly and leaves fewer over or a lower worst Dist Ratio.

Example:
    >>> import numpy as np
    >>> from balancer_cli.pack.types import Assignment, Packing, group_sums
    >>> cost = np.array([[0., 900.], [0., 300.], [0., 500.], [0., 500.],   # step 0: ranks of 1200 and 1000
    ...                  [0., 700.], [0., 300.], [0., 500.], [0., 300.]])  # step 1: 1000 and 800
    >>> p = Packing(order=np.arange(8), group_offsets=np.array([0, 2, 4, 6, 8]), isolated=np.zeros(4, bool),
    ...             dropped=np.zeros(0, np.int64), dropped_reason=())
    >>> a = Assignment(step=np.array([0, 0, 1, 1]), rank=np.array([0, 1, 0, 1]), micro=np.zeros(4, np.int64),
    ...                num_steps=2)
    >>> q = shave_step_peaks(p, a, cost, cost.astype(np.int64), np.array([1, 2000]), np.zeros(8, np.int64))
    >>> group_sums(q, cost)[:, 1].tolist()  # the 700 of step 1 and a 500 of step 0 swapped: both even
    [1200.0, 1200.0, 800.0, 800.0]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from balancer_cli.metrics import dist_ratio, dist_ratio_per_step
from balancer_cli.pack._blocks import discrete_modules, sparse_modules
from balancer_cli.pack._layout import rank_layout
from balancer_cli.pack._peaks_kernel import shave_steps
from balancer_cli.pack.contract import MAX_DIST_RATIO
from balancer_cli.pack.types import Assignment, Packing, dense_ids, group_sums, row_ids

__all__ = ["PEAKS_BUDGET", "PEAKS_LOOSE_ABOVE", "PEAKS_LOOSE_ROOMS", "PEAKS_LOOSE_ROUNDS", "PEAKS_MAX_ROWS",
           "PEAKS_MAX_SWAPS", "PEAKS_ROUNDS", "PEAKS_SLACK", "shave_step_peaks"]

#: Rounds of sweeps over the uneven steps, each ``(above, near, goal, sweeps)``: it runs where the
#: window's Dist Ratio on the module is still above ``above``; ``near`` pool candidates per sample
#: of the heaviest rank (the nearest in value to its excess); a step whose idle share
#: ``(max - mean) / max`` is at most ``goal`` is done; the pool of lighter ranks is found again
#: before each sweep. The second round only for the windows the first leaves over 40% of the
#: bound (with one micro-batch, few samples a rank): 4x the candidates, a goal 5x lower.
PEAKS_ROUNDS = ((0.0, 16, 0.0005, 3), (0.002, 64, 0.0001, 8))
#: An encoder's swaps are kept only where the guarded LLM's Dist Ratio rises by at most this
#: (its steps' means move; the LLM's own round follows).
PEAKS_SLACK = 0.0005
#: Where a guarded encoder's Dist Ratio stays above this (the second round's threshold) and a
#: module is over the Dist bound, the window is shaved again with the LLM's ranks let past their
#: steps' maxima (:data:`PEAKS_LOOSE_ROOMS`), and an attempt that takes no module over the Dist bound newly,
#: with fewer over or a lower worst Dist Ratio, kept (``speech`` 104, 81k at ``--dp 64`` x 1:
#: audio 0.0142 -> 0.0048, LLM 0.0009 -> 0.0004; where the LLM's round cannot repair what the
#: encoder's swaps did, the guarded attempt).
PEAKS_LOOSE_ABOVE = 0.002
#: The LLM's room in those attempts, in order, as a share of its step's maximum; the first that
#: leaves no module over the bound ends them (with :data:`PEAKS_ROUNDS` in every attempt:
#: ``speech`` 105, 281k at 32 x 1, audio / LLM 0.0050 / 0.0008 guarded, 0.0026 / 0.0030 with
#: 0.2%, 0.0021 / 0.0089 unguarded; 104: 0.0127 / 0.0010 with 0.2%, 0.0067 / 0.0004 unguarded).
PEAKS_LOOSE_ROOMS = (0.002, np.inf)
#: The rounds of those attempts: the second with 1,024 candidates a sample and 32 sweeps, since
#: only a few windows get there (``speech`` 104 / 102 / 204 at 64 x 1, audio: 0.0067 / 0.0105 /
#: 0.0053 with :data:`PEAKS_ROUNDS`, 0.0051 / 0.0092 / 0.0046 with 256 and 16, 0.0048 / 0.0085
#: with these).
PEAKS_LOOSE_ROUNDS = ((0.0, 16, 0.0005, 3), (0.002, 1024, 0.0001, 32))
#: Swaps per module and window at most.
PEAKS_MAX_SWAPS = 100_000
#: Pool entries the searches of one module in one attempt may read, at most (a search under way
#: runs to its end, so a budget never reached changes nothing): 2^29, a few seconds. Many ranks
#: with a few samples each made each search read most of ``near`` per sample for little gain
#: (`dynamic` 2 resampled to 1.2M at 256 x 4: 36 rounds, 317 s in this kernel of the pack's
#: 355 s; 184 s at this budget, 132 s at 2^28, the same Dist and mix at both). The four families'
#: rounds read at most 377M (`sparse` 8001, whose LLM Dist 2^28 took from 0.0028 to 0.0034), most
#: under 50M; of 48 `dynamic` draws, two reach 2^29 (12: the same Dist; 30: vision 0.0013 -> 0.0016).
PEAKS_BUDGET = 1 << 29
#: Windows above this many rows are left as they are where every module's Dist Ratio is within the
#: contract's bound (as the polish leaves them: 1.2M and 10M at ``--dp 64``, 0.003); past it they
#: are shaved (1.2M InternVL at ``--dp 2048``: a step's heaviest of 2,048 ranks lies further out,
#: LLM 0.0051 -> 0.0029, and the pick, within every bound now, needs no fallback: 14.3 s -> 10.3 s).
PEAKS_MAX_ROWS = 600_000


def shave_step_peaks(packing: Packing, assignment: Assignment, cost_NK: np.ndarray, load_NK: np.ndarray,
                     caps_K: np.ndarray, source_N: np.ndarray) -> Packing:
    """The packing with each step's heaviest ranks lightened on every dense continuous module
    (see the module docstring).

    Groups keep their index (so their slot), their size, their source counts and their cost on
    every module but the one evened out; isolated oversize groups and groups not placed are not
    touched (an isolated group's load still counts on its rank).

    Args:
        packing: groups (G of them) as the assigner placed them.
        assignment: the groups' slots.
        cost_NK: (N, K) per-sample cost, encoders first, LLM last.
        load_NK: (N, K) per-sample integer load, checked against ``caps_K``.
        caps_K: (K,) caps per group.
        source_N: (N,) source code of each sample.

    Returns:
        A :class:`Packing` of the same samples, groups and slots (``packing`` itself where no
        swap is kept).
    """
    if len(packing.order) < 2 or assignment.num_steps < 1:
        return packing
    cost = np.asarray(cost_NK, dtype=np.float64)
    layout = rank_layout(packing, assignment, cost)
    held_GK = layout.csum_GK[layout.movable_G]
    modules = np.flatnonzero(~sparse_modules(held_GK) & ~discrete_modules(held_GK)).tolist()
    if not modules or (len(packing.order) > PEAKS_MAX_ROWS and not _over(
            {k: dist_ratio(layout.rank_loads(k).reshape(layout.num_steps, layout.world_size)) for k in modules})):
        return packing
    state = _State.of(packing, layout, load_NK, caps_K, source_N)
    order, dist_K = _shave(state, layout, cost, modules, room=0.0)
    guarded = [k for k in modules if k < cost.shape[1] - 1]
    if guarded and max(dist_K[k] for k in guarded) > PEAKS_LOOSE_ABOVE and _over(dist_K):
        # The LLM's guard held the encoder back and a module is over the bound: try again with
        # the LLM's ranks free to rise (its own round follows) and keep an attempt that takes no
        # module over the Dist bound newly, with fewer over or a less uneven worst module; one
        # that leaves none over ends the attempts.
        for room in PEAKS_LOOSE_ROOMS:
            loose, loose_K = _shave(state, layout, cost, modules, room=room)
            if _better(loose_K, dist_K):
                order, dist_K = loose, loose_K
                if not _over(dist_K):
                    break
    if order is None:
        return packing
    return Packing(order=order, group_offsets=layout.offsets, isolated=packing.isolated, dropped=packing.dropped,
                   dropped_reason=packing.dropped_reason)


def _over(dist_K: dict) -> set:
    """The modules whose Dist Ratio is over the contract's bound."""
    return {k for k, d in dist_K.items() if d > MAX_DIST_RATIO}


def _better(new_K: dict, old_K: dict) -> bool:
    """Whether an attempt takes no module over the Dist bound that ``old_K`` keeps within it (the
    LLM's balance is not traded for an encoder's, as no retry of
    :func:`~balancer_cli.pack.step_stages.place_steps` breaks a bound newly), with fewer modules
    over or, as many, a lower worst Dist Ratio."""
    over, old_over = _over(new_K), _over(old_K)
    return over <= old_over and (len(over), max(new_K.values())) < (len(old_over), max(old_K.values()))


@dataclass(frozen=True, kw_only=True)
class _State:
    """What every attempt reads and never changes: positions, slots, loads and caps."""

    group_P: np.ndarray
    slot_P: np.ndarray
    live: np.ndarray
    slot_pos: np.ndarray
    slot_first: np.ndarray
    load: np.ndarray
    gload_GK: np.ndarray
    caps: np.ndarray
    source: np.ndarray

    @classmethod
    def of(cls, packing, layout, load_NK, caps_K, source_N) -> _State:
        S, R, G = layout.num_steps, layout.world_size, len(layout.slot_G)
        group_P = np.repeat(np.arange(G), np.diff(layout.offsets))
        slot_P = layout.slot_G[group_P]
        live = np.flatnonzero(layout.movable_G[group_P])
        slot_pos = live[np.argsort(slot_P[live], kind="stable")]
        load = np.ascontiguousarray(load_NK).astype(np.int64, copy=False)
        gload_GK = np.ascontiguousarray(group_sums(packing, load))
        return cls(group_P=group_P, slot_P=slot_P, live=live, slot_pos=slot_pos,
                   slot_first=np.searchsorted(slot_P[slot_pos], np.arange(S * R + 1)), load=load,
                   gload_GK=gload_GK, caps=np.asarray(caps_K, dtype=np.int64), source=np.asarray(source_N).reshape(-1))


def _shave(state: _State, layout, cost: np.ndarray, modules: list[int], *, room: float) -> tuple:
    """One attempt over ``modules`` in order: ``(order or None where no swap is kept, {k: Dist Ratio
    after})``. With ``room`` > 0 the LLM's guard lets a rank pass its step's maximum by that share
    and an encoder's swaps are kept whatever the LLM's Dist (the caller compares the attempts)."""
    loose = room > 0
    S, R, P = layout.num_steps, layout.world_size, len(layout.order)
    live, slot_P, group_P = state.live, state.slot_P, state.group_P
    new_order, gload_GK = layout.order.copy(), state.gload_GK.copy()
    kept, dist_K = 0, {}
    moved_X = {}  # the LLM's rank loads once an encoder's kept swaps have moved them
    for k in modules:
        load_X = moved_X[k].copy() if k in moved_X else layout.rank_loads(k)
        idle_S = dist_ratio_per_step(load_X.reshape(S, R))
        dist_K[k] = float(idle_S.mean())
        if not (idle_S > min(goal for _, _, goal, _ in PEAKS_ROUNDS)).any():
            continue
        # A sample's kind: its source and its cost on every other module (so those stay as they are)
        # but the LLM's for an encoder: its tokens are part of the LLM sequence too (audio clips),
        # so the LLM is guarded instead: no rank's LLM load passes its step's maximum.
        guard = cost.shape[1] - 1 if k < cost.shape[1] - 1 else -1
        key = [dense_ids(state.source[new_order[live]])]
        key += [dense_ids(cost[new_order[live], j]) for j in range(cost.shape[1]) if j not in (k, guard)]
        kind_P = np.full(P, -1, np.int64)
        kind_P[live] = row_ids(np.column_stack(key))
        value_P = np.ascontiguousarray(cost[new_order, k])
        sum_S = load_X.reshape(S, R).sum(axis=1)
        norm_S = np.maximum(sum_S / R, 1e-12)
        guard_P, guard_X, guard_peak_S, guard_before = np.zeros(0), np.zeros(0), np.zeros(0), 0.0  # none
        if guard >= 0:
            guard_P = np.ascontiguousarray(cost[new_order, guard])
            guard_X = moved_X[guard].copy() if guard in moved_X else layout.rank_loads(guard)
            guard_peak_S = guard_X.reshape(S, R).max(axis=1)
            guard_before = dist_ratio(guard_X.reshape(S, R))
        before = (new_order.copy(), gload_GK.copy(), float(idle_S.mean()))
        swaps = 0
        budget = np.array([PEAKS_BUDGET], np.int64)
        for above, near, goal, sweeps in PEAKS_LOOSE_ROUNDS if loose else PEAKS_ROUNDS:
            if idle_S.mean() <= above or budget[0] <= 0:
                break
            steps = np.flatnonzero(idle_S > goal)
            steps = steps[np.argsort(-idle_S[steps], kind="stable")]  # the worst first
            for _ in range(sweeps):
                if len(steps) == 0:
                    break
                # The pool: positions on ranks below their step's mean, by kind, then value.
                pool = live[load_X[slot_P[live]] < sum_S[slot_P[live] // R] / R]
                pool = pool[np.lexsort((value_P[pool], kind_P[pool]))]
                kind_first = np.searchsorted(kind_P[pool], np.arange(int(kind_P.max()) + 2))
                pool_at_P = np.full(P, -1, np.int64)
                pool_at_P[pool] = np.arange(len(pool))
                slot_F = slot_P[pool]
                made = shave_steps(steps, R, load_X, sum_S, load_X.reshape(S, R).max(axis=1), norm_S,
                                   state.slot_first, state.slot_pos, kind_first, pool,
                                   np.ascontiguousarray(value_P[pool]), slot_F, slot_F // R,
                                   np.ones(len(pool), np.bool_), pool_at_P,
                                   kind_P, value_P, new_order, group_P, slot_P, gload_GK, state.load, state.caps,
                                   goal, near, PEAKS_MAX_SWAPS - swaps, guard_P, guard_X, guard_peak_S,
                                   1.0 + room, budget)
                swaps += made
                idle_S = dist_ratio_per_step(load_X.reshape(S, R))
                steps = steps[idle_S[steps] > goal]
                if made == 0 or budget[0] <= 0:
                    break
        guard_ok = guard < 0 or loose or dist_ratio(guard_X.reshape(S, R)) <= guard_before + PEAKS_SLACK
        if swaps and idle_S.mean() < before[2] and guard_ok:
            kept += swaps
            dist_K[k] = float(idle_S.mean())
            if guard >= 0:
                moved_X[guard] = guard_X
        else:  # no better by the Dist Ratio (the squares can fall while a tied maximum stays)
            new_order[:], gload_GK[:] = before[0], before[1]
    return (new_order if kept else None), dist_K
