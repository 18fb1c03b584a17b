"""The local search of post-balancing (``kernels.refine_bins``) against its specification.

The kernel keeps the bins sorted by load and each bin's items sorted by cost, and searches
swaps along those orders; the reference below checks every move and every swap of every
iteration the plain way. Both must pick the same step every time, ties included, so the plans
(and every rank computing them) stay the same whatever the kernel's data structures.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer_cli.replay.post_balance import kernels


def _reference(cost, bin_N, load, max_iters, num_candidates, stop_at=0.0):
    """Each iteration: the most loaded bin b (lowest index on ties), the ``num_candidates`` least
    loaded others by (load, index); the best move a -> c by (max of the two loads, candidate
    rank, a); a swap a <-> x (cost_a > cost_x) replaces it only if strictly better, the best
    swap by (max, x, a); nothing unless the maximum strictly falls. Items of cost 0 never move.
    Nothing more once the maximum is at most ``stop_at``."""
    n, num_bins = len(cost), len(load)
    k = min(num_candidates, num_bins - 1)
    applied = 0
    if k <= 0:
        return applied
    for _ in range(max_iters):
        peak = load.max()
        if peak <= stop_at:
            break
        b = int(np.flatnonzero(load == peak)[0])
        cands = [c for c in sorted(range(num_bins), key=lambda r: (load[r], r)) if c != b][:k]
        items_b = [a for a in range(n) if bin_N[a] == b and cost[a] > 0.0]
        best, move = peak * (1.0 - 1e-12), None
        for t, c in enumerate(cands):
            for a in items_b:
                pair = max(peak - cost[a], load[c] + cost[a])
                if pair < best or (pair == best and move is not None and move[0] == t and a < move[1]):
                    best, move = pair, (t, a, c)
        swap = None
        for c in cands:
            for x in (x for x in range(n) if bin_N[x] == c and cost[x] > 0.0):
                for a in items_b:
                    d = cost[a] - cost[x]
                    if d <= 0.0:
                        continue
                    pair = max(peak - d, load[c] + d)
                    if pair < best or (pair == best and swap is not None and (x, a) < swap[:2]):
                        best, swap = pair, (x, a, c)
        if swap is not None:
            x, a, c = swap
            bin_N[a], bin_N[x] = c, b
            delta = cost[a] - cost[x]
        elif move is not None:
            _, a, c = move
            bin_N[a] = c
            delta = cost[a]
        else:
            break
        load[b] -= delta
        load[c] += delta
        applied += 1
    return applied


@st.composite
def _instances(draw):
    num_bins = draw(st.integers(1, 7))
    n = draw(st.integers(0, 30))
    # small integers give many ties (loads, costs, pairs); floats give none
    value = st.integers(0, 12).map(float) if draw(st.booleans()) else st.floats(0.0, 50.0, allow_subnormal=False)
    cost = np.array(draw(st.lists(value, min_size=n, max_size=n)), dtype=np.float64)
    bin_N = np.array(draw(st.lists(st.integers(0, num_bins - 1), min_size=n, max_size=n)), dtype=np.int64)
    load = np.bincount(bin_N, weights=cost, minlength=num_bins).astype(np.float64)
    # where to stop: none, or a maximum between the mean load and the present one (ties with loads too)
    stop_at = 0.0
    if draw(st.booleans()) and len(load):
        stop_at = float(draw(st.sampled_from(sorted(set(load.tolist()) | {float(load.mean())}))))
    return cost, bin_N, load, draw(st.integers(0, 40)), draw(st.integers(1, 8)), stop_at


@settings(max_examples=300, deadline=None)
@given(_instances())
def test_refine_bins_takes_the_specified_step_every_iteration(instance):
    cost, bin_N, load, max_iters, candidates, stop_at = instance
    got_bins, got_load = bin_N.copy(), load.copy()
    got = kernels.refine_bins(cost, got_bins, got_load, max_iters, candidates, kernels.descending_order(cost),
                              stop_at)
    want_bins, want_load = bin_N.copy(), load.copy()
    want = _reference(cost, want_bins, want_load, max_iters, candidates, stop_at)
    assert got == want
    assert got_bins.tolist() == want_bins.tolist()
    assert got_load.tolist() == want_load.tolist()
    # the items stay where they are counted, and the maximum never rises
    np.testing.assert_allclose(got_load, np.bincount(got_bins, weights=cost, minlength=len(load)), atol=1e-9)
    assert got_load.max(initial=0.0) <= load.max(initial=0.0)


def test_a_full_row_grows():
    """A bin's row of items (kept by ascending cost) doubles, every row copied, when it is full."""
    items = np.array([[4, 2], [7, -1]])
    costs = np.array([[1.0, 3.0], [5.0, 0.0]])
    count = np.array([2, 1])
    items, costs = kernels._put_in(items, costs, count, 0, 9, 2.0)
    assert items.shape == (2, 4) and count.tolist() == [3, 1]
    assert items[0, :3].tolist() == [4, 9, 2] and costs[0, :3].tolist() == [1.0, 2.0, 3.0]
    assert items[1, 0] == 7 and costs[1, 0] == 5.0
    kernels._take_out(items, costs, count, 0, 4)
    assert items[0, :2].tolist() == [9, 2] and count.tolist() == [2, 1]
