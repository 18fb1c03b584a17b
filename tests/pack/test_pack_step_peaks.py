"""Each step's heaviest rank gives load to lighter ranks: samples equal on every other module swap."""

from __future__ import annotations

from unittest import mock

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pack_util import three_modules

from balancer_cli.errors import InputError
from balancer_cli.metrics import dist_ratio, step_loads
from balancer_cli.pack import step_peaks
from balancer_cli.pack.assign import assign_groups, split_to_multiple
from balancer_cli.pack.contract import MAX_DIST_RATIO
from balancer_cli.pack.packers.balanced import BalancedOptions, pack_balanced
from balancer_cli.pack.polish import polish_steps
from balancer_cli.pack.step_peaks import shave_step_peaks
from balancer_cli.pack.types import Assignment, Packing, check_packing, group_sums


def _placed(load, cost, source, caps, R, M, seed, polish=True):
    p = pack_balanced(load, caps, seed=seed, cost_NK=cost, group_multiple=R * M, source_N=source,
                      options=BalancedOptions(passes=2, class_mix=False))
    p = split_to_multiple(p, cost[:, -1], R * M)
    a = assign_groups(group_sums(p, cost), world_size=R, micro_batches=M, seed=seed)
    return (polish_steps(p, a, cost, load, caps, seed=seed) if polish else p), a


def _rank_loads(p, a, cost, R):
    """(K, S, R) each module's load of each rank in each step (its M groups' sum)."""
    gid = p.group_ids()
    return np.stack([step_loads(a.step[gid], a.rank[gid], cost[p.order, k], num_steps=a.num_steps, world_size=R)
                     for k in range(cost.shape[1])])


def _per_group(p, values):
    return [sorted(values[g].tolist()) for g in p.groups()]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(80, 1500), R=st.integers(2, 8), M=st.sampled_from([1, 2, 3]),
       sources=st.integers(1, 4), oversize=st.booleans(), polish=st.booleans())
def test_swaps_keep_every_group_its_size_sources_caps_and_other_modules(seed, n, R, M, sources, oversize, polish):
    load, cost, source = three_modules(seed, n, sources, tiles=tuple(range(1, 9)), tiled_every_other=True)
    caps = np.array([24, 6, 6000])
    if oversize:  # over the LLM cap on their own: isolated groups, which run on their rank but never swap
        load[:2, 2] = caps[2] + 1
        cost[:2, 2] = load[:2, 2]
    try:
        p, a = _placed(load, cost, source, caps, R, M, seed, polish)
    except InputError:  # too few samples for whole steps of R x M groups
        assume(False)
    with mock.patch.object(step_peaks, "PEAKS_LOOSE_ABOVE", np.inf):  # the guarded attempt alone
        guarded = shave_step_peaks(p, a, cost, load, caps, source)
    q = shave_step_peaks(p, a, cost, load, caps, source)
    for r in (guarded, q):
        _check_swaps_kept_the_rest(p, a, r, cost, load, caps, source, n)
    assert np.array_equal(shave_step_peaks(p, a, cost, load, caps, source).order, q.order)  # deterministic
    # The guarded attempt: no step's heaviest rank grows on any module and no module's Dist Ratio
    # rises (the LLM's by the guard's slack at most, where the audio swaps move its steps' means).
    before, after = _rank_loads(p, a, cost, R), _rank_loads(guarded, a, cost, R)
    assert (after.max(axis=2) <= before.max(axis=2) + 1e-9).all()
    for k in range(cost.shape[1]):
        assert dist_ratio(after[k]) <= dist_ratio(before[k]) + step_peaks.PEAKS_SLACK + 1e-12
    # A loosened attempt is kept only where it takes no module over the Dist bound newly, with
    # fewer over or a lower worst one.
    over_q, worst_q = _over_and_worst(_rank_loads(q, a, cost, R))
    over_g, worst_g = _over_and_worst(after)
    assert over_q <= over_g and (len(over_q) < len(over_g) or worst_q <= worst_g + 1e-12)


def _over_and_worst(loads_KSR):
    dists = [dist_ratio(load_SR) for load_SR in loads_KSR]
    return {k for k, d in enumerate(dists) if d > MAX_DIST_RATIO}, max(dists)


def _check_swaps_kept_the_rest(p, a, q, cost, load, caps, source, n):
    """A swap changes the module it evens out (and for audio the LLM), the two samples equal on
    every other: every group keeps its size, its sources and its tiles, every module its total, and
    groups within the caps stay within them; isolated and unplaced groups never move."""
    check_packing(q, num_samples=n)
    assert np.array_equal(q.group_offsets, p.group_offsets)  # every group keeps its size (and slot)
    assert np.array_equal(q.isolated, p.isolated) and np.array_equal(q.dropped, p.dropped)
    assert _per_group(q, source) == _per_group(p, source)  # so every step keeps its source mix
    before_g, after_g = list(p.groups()), list(q.groups())
    for g in np.flatnonzero(p.isolated | (a.step < 0)):
        assert after_g[g].tolist() == before_g[g].tolist()
    within = (group_sums(p, load) <= caps).all(axis=1)
    assert (group_sums(q, load)[within] <= caps).all()
    assert np.array_equal(group_sums(q, cost)[:, 0], group_sums(p, cost)[:, 0])
    assert np.allclose(group_sums(q, cost).sum(axis=0), group_sums(p, cost).sum(axis=0))


def test_where_the_guard_holds_audio_back_a_loosened_attempt_is_kept():
    # Half the samples speak (1-3 clips): audio is dense, and the LLM's guard (no rank past its
    # step's maximum) leaves audio swaps undone that an attempt with the LLM let past makes, the
    # LLM's round after them keeping it within the bound.
    load, cost, source = three_modules(0, 6000, 2, tiles=tuple(range(1, 9)), tiled_every_other=True)
    caps = np.array([20, 5, 5000])
    p, a = _placed(load, cost, source, caps, 32, 1, 0)
    with mock.patch.object(step_peaks, "PEAKS_LOOSE_ABOVE", np.inf):
        guarded = shave_step_peaks(p, a, cost, load, caps, source)
    q = shave_step_peaks(p, a, cost, load, caps, source)
    (g_audio, _), (q_audio, q_llm) = (_rank_loads(r, a, cost, 32)[1:] for r in (guarded, q))
    assert dist_ratio(q_audio) < dist_ratio(g_audio) - 0.002
    assert dist_ratio(q_llm) <= MAX_DIST_RATIO
    assert q_audio.max(axis=1).sum() < g_audio.max(axis=1).sum()  # the audio steps' time falls
    with mock.patch.object(step_peaks, "PEAKS_LOOSE_ABOVE", 1.0):  # never tried: the guarded attempt
        assert np.array_equal(shave_step_peaks(p, a, cost, load, caps, source).order, guarded.order)


def test_one_micro_batch_steps_lose_their_peaks_after_the_polish():
    # One group a rank, a few samples a group: the polish's pairs leave the heaviest ranks (measured:
    # LLM Dist 0.0062 -> 0.0009 at --dp 16 over 209 steps, 0.0116 -> 0.0018 at --dp 64 over 53 and
    # 0.0180 -> 0.0028 at --dp 128 over 27, where the first round alone leaves 0.0032 and the second
    # runs: more candidates, a lower goal).
    load, cost, source = three_modules(5, 12000, 4, tiles=tuple(range(1, 9)), tiled_every_other=True)
    caps = np.array([20, 5, 5000])
    for R in (16, 64, 128):
        p, a = _placed(load, cost, source, caps, R, 1, 5)
        q = shave_step_peaks(p, a, cost, load, caps, source)
        before, after = dist_ratio(_rank_loads(p, a, cost, R)[2]), dist_ratio(_rank_loads(q, a, cost, R)[2])
        assert after < 0.5 * before, (R, before, after)
        if R == 128:
            with mock.patch.object(step_peaks, "PEAKS_ROUNDS", step_peaks.PEAKS_ROUNDS[:1]):
                first = dist_ratio(_rank_loads(shave_step_peaks(p, a, cost, load, caps, source), a, cost, R)[2])
            assert first > step_peaks.PEAKS_ROUNDS[1][0]  # the second round runs here
            assert after < 0.9 * first, (first, after)


def _two_steps(cost):
    p = Packing(order=np.arange(8), group_offsets=np.array([0, 2, 4, 6, 8]), isolated=np.zeros(4, bool),
                dropped=np.zeros(0, np.int64), dropped_reason=())
    a = Assignment(step=np.array([0, 0, 1, 1]), rank=np.array([0, 1, 0, 1]), micro=np.zeros(4, np.int64),
                   num_steps=2)
    return p, a


def test_even_steps_and_windows_past_the_row_limit_within_the_bound_are_left_alone():
    """Past ``PEAKS_MAX_ROWS`` a window is shaved only where a module is over the Dist bound."""
    cost = np.array([[0., 900.], [0., 300.], [0., 500.], [0., 500.], [0., 700.], [0., 300.], [0., 500.], [0., 300.]])
    p, a = _two_steps(cost)
    load, caps, source = cost.astype(np.int64), np.array([1, 2000]), np.zeros(8, np.int64)
    assert shave_step_peaks(p, a, cost, load, caps, source) is not p
    with mock.patch.object(step_peaks, "PEAKS_MAX_ROWS", 7):  # Dist 0.083 / 0.111 a step: over the bound
        assert shave_step_peaks(p, a, cost, load, caps, source) is not p
    near = np.array([[0., 503.], [0., 503.], [0., 500.], [0., 500.], [0., 500.], [0., 500.], [0., 500.], [0., 500.]])
    assert dist_ratio(group_sums(p, near)[:, 1].reshape(2, 2)) < MAX_DIST_RATIO  # step 0: 1006 / 1000
    assert shave_step_peaks(p, a, near, near.astype(np.int64), caps, source) is not p  # 503 and 500 swap
    with mock.patch.object(step_peaks, "PEAKS_MAX_ROWS", 7):
        assert shave_step_peaks(p, a, near, near.astype(np.int64), caps, source) is p
    even = np.array([[0., 600.], [0., 400.], [0., 500.], [0., 500.], [0., 700.], [0., 300.], [0., 500.], [0., 500.]])
    assert shave_step_peaks(p, a, even, even.astype(np.int64), caps, source) is p


def test_samples_of_different_sources_never_swap():
    # The only pair that lowers the heavy rank is of two sources (a step would change its mix): no swap.
    cost = np.array([[0., 900.], [0., 300.], [0., 500.], [0., 500.], [0., 700.], [0., 300.], [0., 500.], [0., 300.]])
    p, a = _two_steps(cost)
    source = np.array([0, 0, 1, 1, 0, 0, 1, 1])
    assert shave_step_peaks(p, a, cost, cost.astype(np.int64), np.array([1, 2000]), source) is p


def test_the_python_kernel_swaps_the_same(monkeypatch):
    from balancer_cli._jit import HAVE_NUMBA
    from balancer_cli.pack import _peaks_kernel

    if not HAVE_NUMBA:
        return  # the kernel already runs as Python everywhere else
    load, cost, source = three_modules(2, 3000, 3, tiles=tuple(range(1, 9)), tiled_every_other=True)
    caps = np.array([20, 5, 5000])
    p, a = _placed(load, cost, source, caps, 8, 1, 2)
    fast = shave_step_peaks(p, a, cost, load, caps, source)
    monkeypatch.setattr(_peaks_kernel, "_peak", _peaks_kernel._peak.py_func)
    monkeypatch.setattr(step_peaks, "shave_steps", _peaks_kernel.shave_steps.py_func)
    slow = shave_step_peaks(p, a, cost, load, caps, source)
    assert fast is not p and np.array_equal(fast.order, slow.order)


def test_a_loosened_attempt_never_takes_a_module_over_the_bound_newly():
    # {module: Dist Ratio} of a loosened attempt against the guarded one (audio 1, LLM 2).
    better = step_peaks._better
    assert not better({1: 0.004, 2: 0.006}, {1: 0.008, 2: 0.001})  # audio within, but the LLM newly over
    assert better({1: 0.004, 2: 0.003}, {1: 0.008, 2: 0.001})  # none over
    assert better({1: 0.006, 2: 0.001}, {1: 0.008, 2: 0.001})  # the same one over, less far
    assert not better({1: 0.009, 2: 0.001}, {1: 0.008, 2: 0.001})


@mock.patch.object(step_peaks, "PEAKS_LOOSE_ABOVE", np.inf)  # the guarded attempt alone
def test_a_budget_of_pool_reads_stops_the_searches_and_keeps_every_invariant():
    # Each module's round in an attempt reads at most PEAKS_BUDGET pool entries (a search under
    # way runs to its end): a budget reached stops it where it is, deterministically, with every
    # group, source mix and cap as a swap keeps them and no module less even than before; one
    # never reached changes nothing. The guarded attempt only: a loose one may trade the LLM's
    # balance for an encoder's where both are over the bound (the tests above).
    load, cost, source = three_modules(3, 1500, 3, tiles=tuple(range(1, 9)), tiled_every_other=True)
    caps = np.array([24, 6, 6000])
    p, a = _placed(load, cost, source, caps, 8, 1, 3)
    unbounded = shave_step_peaks(p, a, cost, load, caps, source)
    assert unbounded is not p
    before = _rank_loads(p, a, cost, 8)
    results = []
    for budget in (1, 300, 1 << 40):
        with mock.patch.object(step_peaks, "PEAKS_BUDGET", budget):
            q = shave_step_peaks(p, a, cost, load, caps, source)
            assert np.array_equal(shave_step_peaks(p, a, cost, load, caps, source).order, q.order)
        _check_swaps_kept_the_rest(p, a, q, cost, load, caps, source, 1500)
        after = _rank_loads(q, a, cost, 8)
        assert all(dist_ratio(after[k]) <= dist_ratio(before[k]) + step_peaks.PEAKS_SLACK + 1e-12 for k in range(3))
        results.append(q.order)
    assert np.array_equal(results[-1], unbounded.order)
    assert not np.array_equal(results[0], unbounded.order)  # one search a round: fewer swaps
