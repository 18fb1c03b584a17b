"""A window's groups placed on steps: the assignment, the step stages, and coarser cells where the
steps mix worse than random batching."""

from __future__ import annotations

import dataclasses
from unittest import mock

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pack_util import three_modules

from balancer_cli.errors import InputError
from balancer_cli.manifest import StepShape
from balancer_cli.pack import step_stages
from balancer_cli.pack.assign import check_assignment, split_to_multiple
from balancer_cli.pack.packers.balanced import BalancedOptions, pack_balanced
from balancer_cli.pack.step_stages import place_steps, window_broken
from balancer_cli.pack.types import Assignment, Packing, check_packing, group_sums

MODULES = ("llm",)


def _two_recipes(num_groups: int, per_group: int, gap: int):
    """Groups of ``per_group`` samples of one source each: half of source 0 at ~1,000 LLM tokens a
    group, half of source 1 at ~1,000 + ``gap`` (the assigner's fine cells keep them apart; the
    tokens vary by a few, so the LLM is no module of few values)."""
    half = num_groups // 2
    rng = np.random.default_rng(0)
    tokens = np.concatenate([np.full(half * per_group, 1000 // per_group),
                             np.full(half * per_group, (1000 + gap) // per_group)])
    tokens += rng.integers(0, 4, len(tokens))
    source = np.repeat([0, 1], half * per_group)
    n = len(tokens)
    packing = Packing(np.arange(n), np.arange(0, n + 1, per_group), np.zeros(num_groups, bool),
                      np.array([], np.int64), ())
    return packing, tokens[:, None].astype(np.float64), tokens[:, None].astype(np.int64), source


def _shape(R: int) -> StepShape:
    return StepShape(world_size=R, micro_batches=1)


def _place(packing, cost, load, source, R, M=1, caps=(2000,)):
    return place_steps(packing, cost, load, np.array(caps), source, StepShape(world_size=R, micro_batches=M),
                       seeds=(1, 2, 3), polish_passes=2, modules=MODULES)


def test_steps_of_one_recipe_are_placed_again_loose_or_on_coarser_cells():
    # Two samples a group: the stages re-balance a step holding both recipes (a 500 and a 515 trade
    # groups), so the coarser cells' steps meet every bound where the fine cells' were one source each;
    # so do the loose trades' (groups whose LLM weights differ by 30 of ~1,000 trade steps).
    packing, cost, load, source = _two_recipes(64, 2, 30)
    with mock.patch.object(step_stages, "RETRIES", ()):
        first = _place(packing, cost, load, source, R=8)
    assert window_broken(*first, cost, source, _shape(8), MODULES) == ("mix",)
    for retries in (step_stages.RETRIES, [r for r in step_stages.RETRIES if not r[1]]):  # with loose trades or not
        with mock.patch.object(step_stages, "RETRIES", retries):
            q, a = _place(packing, cost, load, source, R=8)
        assert window_broken(q, a, cost, source, _shape(8), MODULES) == ()
        check_packing(q, num_samples=len(source))
        check_assignment(a, q.num_groups, 8, 1)


def test_a_retry_that_breaks_another_bound_is_not_kept():
    # One sample a group: nothing re-balances a step holding both recipes (Dist ~0.015 > 0.005), so the
    # first placement stands, byte for byte.
    packing, cost, load, source = _two_recipes(64, 1, 30)
    with mock.patch.object(step_stages, "RETRIES", ()):
        first_p, first_a = _place(packing, cost, load, source, R=8)
    with mock.patch.object(step_stages, "RETRIES", ((0.15, 0.0),)):
        retried = _place(packing, cost, load, source, R=8)
    assert set(window_broken(*retried, cost, source, _shape(8), MODULES)) == {"mix"}
    p, a = _place(packing, cost, load, source, R=8)
    assert np.array_equal(p.order, first_p.order) and np.array_equal(a.step, first_a.step)
    assert np.array_equal(a.rank, first_a.rank)


@pytest.mark.parametrize("polish_passes", [0, 2])
def test_loose_retries_run_only_where_the_polish_evens_the_ranks_after_them(polish_passes):
    packing, cost, load, source = _two_recipes(64, 2, 30)
    tried = []
    real = step_stages._placed

    def spy(*args):
        tried.append(args[10] if len(args) > 10 else None)  # the retries' loose share (None: the first)
        return real(*args)

    with mock.patch.object(step_stages, "_placed", spy), mock.patch.object(step_stages, "MAX_STEP_MIX", 0.0):
        place_steps(packing, cost, load, np.array([2000]), source, _shape(8), seeds=(1, 2, 3),
                    polish_passes=polish_passes, modules=MODULES)
    if polish_passes:  # the first retry is the loosest, and here it meets every bound
        assert tried == [None, step_stages.RETRIES[0][1]] and tried[1] > 0
    else:
        assert tried == [None] + [loose for _, loose in step_stages.RETRIES if not loose]


def test_window_broken_names_each_bound():
    packing, cost, _, source = _two_recipes(16, 1, 400)
    # 4 steps of 4 groups: two of each recipe a step (mixed, but uneven), then one recipe a step.
    a = Assignment(step=np.tile([0, 1, 2, 3], 4), rank=np.repeat(np.arange(4), 4), micro=np.zeros(16, np.int64),
                   num_steps=4)
    assert window_broken(packing, a, cost, source, _shape(4), MODULES) == ("dist:llm",)
    a = Assignment(step=np.repeat(np.arange(4), 4), rank=np.tile(np.arange(4), 4), micro=np.zeros(16, np.int64),
                   num_steps=4)
    assert window_broken(packing, a, cost, source, _shape(4), MODULES) == ("mix",)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(80, 1200), R=st.integers(1, 8), M=st.sampled_from([1, 2]),
       sources=st.integers(1, 4), retry=st.booleans())
def test_every_sample_keeps_one_slot_and_the_placement_is_deterministic(seed, n, R, M, sources, retry):
    load, cost, source = three_modules(seed, n, sources, tiles=tuple(range(1, 9)), tiled_every_other=True)
    caps = np.array([24, 6, 6000])
    try:
        p = pack_balanced(load, caps, seed=seed, cost_NK=cost, group_multiple=R * M, source_N=source,
                          options=BalancedOptions(passes=2, class_mix=False))
        p = split_to_multiple(p, cost[:, -1], R * M)
    except InputError:  # too few samples for whole steps of R x M groups
        assume(False)
    assume(p.num_groups >= R * M)
    shape = StepShape(world_size=R, micro_batches=M)
    order, offsets = p.order.copy(), p.group_offsets.copy()
    # retry: every placement retried (the mix bound 0: always broken), so the retries' path runs too.
    with mock.patch.object(step_stages, "MAX_STEP_MIX", 0.0 if retry else step_stages.MAX_STEP_MIX):
        q, a = place_steps(p, cost, load, caps, source, shape, seeds=(seed, 1, 2), polish_passes=1)
        q2, a2 = place_steps(p, cost, load, caps, source, shape, seeds=(seed, 1, 2), polish_passes=1)
    assert np.array_equal(p.order, order) and np.array_equal(p.group_offsets, offsets)  # the input untouched
    check_packing(q, num_samples=n)
    check_assignment(a, q.num_groups, R, M)
    assert q.num_groups == p.num_groups and np.array_equal(q.isolated, p.isolated)  # samples move, groups stay
    assert np.array_equal(q.order, q2.order) and np.array_equal(a.step, a2.step) and np.array_equal(a.rank, a2.rank)
    within = (group_sums(p, load) <= caps).all(axis=1)
    assert (group_sums(q, load)[within] <= caps).all()


def _in_order(S: int, R: int, per_group: int):
    """Groups of ``per_group`` consecutive samples, R a step in order over S steps (micro-batch 0)."""
    G = S * R
    packing = Packing(np.arange(G * per_group), np.arange(0, G * per_group + 1, per_group), np.zeros(G, bool),
                      np.array([], np.int64), ())
    return packing, Assignment(step=np.repeat(np.arange(S), R), rank=np.tile(np.arange(R), S),
                               micro=np.zeros(G, np.int64), num_steps=S)


def test_large_windows_pass_well_mixed_steps_without_the_exact_measure():
    rng = np.random.default_rng(0)
    S, R, per_group = 200, 16, 5
    G = S * R
    packing, a = _in_order(S, R, per_group)
    even = np.tile(np.arange(4), G * per_group // 4)  # every step holds the global mix exactly
    by_step = np.repeat(rng.integers(0, 4, S), R * per_group)  # one source a step
    cost = np.ones((G * per_group, 1))
    exact = mock.Mock(wraps=step_stages.step_mix_ratio)
    with mock.patch.object(step_stages, "GATE_ROWS", 0), mock.patch.object(step_stages, "step_mix_ratio", exact):
        assert not step_stages._retries(packing, a, cost, even, 1)
        assert exact.call_count == 0
        assert step_stages._retries(packing, a, cost, by_step, 1) == step_stages.RETRIES
        assert exact.call_count == 1


def _metrics(vision, llm, mix, vision_util=1.0):
    return {"modules": {"vision": {"dist_ratio": vision, "utilization": vision_util, "sparse": vision_util < 1},
                        "llm": {"dist_ratio": llm, "utilization": 1.0, "sparse": False}},
            "steps": {"vs_lower_bound": 1.0}, "step_mix": {"vs_random": mix}}


def test_a_retry_is_kept_only_where_it_breaks_fewer_bounds_or_the_same_less_far_and_none_more():
    modules = ("vision", "llm")
    improves = step_stages._improves
    assert improves(_metrics(0.001, 0.002, 0.8), _metrics(0.001, 0.001, 1.2), modules)  # the mix fixed
    assert not improves(_metrics(0.001, 0.006, 0.8), _metrics(0.001, 0.001, 1.2), modules)  # the LLM newly broken
    assert improves(_metrics(0.001, 0.001, 1.1), _metrics(0.001, 0.001, 1.2), modules)  # still over, less far
    assert not improves(_metrics(0.001, 0.001, 1.3), _metrics(0.001, 0.001, 1.2), modules)  # further
    assert not improves(_metrics(0.001, 0.001, 1.2), _metrics(0.001, 0.001, 1.2), modules)  # no gain
    # The mix much less far past: kept where the vision Dist is less far too, not where it is further.
    assert improves(_metrics(0.0051, 0.001, 1.01), _metrics(0.006, 0.001, 3.0), modules)
    assert not improves(_metrics(0.007, 0.001, 1.01), _metrics(0.006, 0.001, 3.0), modules)
    # sample_data: both over the vision bound, the retry further (0.058 -> 0.094): not kept.
    assert not improves(_metrics(0.094, 0.001, 0.7), _metrics(0.058, 0.001, 1.01), modules)
    assert improves(_metrics(0.05, 0.001, 0.7), _metrics(0.058, 0.001, 1.01), modules)
    # A sparse module's utilization likewise.
    assert not improves(_metrics(0.0, 0.001, 0.7, 0.85), _metrics(0.0, 0.001, 1.01, 0.88), modules)


@pytest.mark.parametrize("looser, gentler_runs", [
    (_metrics(0.001, 0.001, 1.1), False),  # the looser trades broke nothing new, only left the mix over
    (_metrics(0.001, 0.009, 0.5), True),  # they broke the LLM's Dist: the gentler ones may keep it
])
def test_the_gentler_loose_retry_runs_only_for_a_bound_the_looser_one_broke(looser, gentler_runs):
    packing, cost, load, source = _two_recipes(64, 2, 30)
    tried = []

    def placed(*args):
        tried.append(args[10] if len(args) > 10 else None)
        return "packing", "assignment"

    metrics = iter([_metrics(0.001, 0.001, 1.2), looser] + [_metrics(0.001, 0.001, 1.2)] * 4)
    with mock.patch.object(step_stages, "_placed", placed), \
            mock.patch.object(step_stages, "_retries", lambda *args: step_stages.RETRIES), \
            mock.patch.object(step_stages, "window_metrics", lambda *args: next(metrics)):
        place_steps(packing, cost, load, np.array([2000]), source, _shape(8), seeds=(1, 2, 3), polish_passes=2,
                    modules=("vision", "llm"))
    assert [x for x in tried[1:] if x] == ([0.1, 0.03] if gentler_runs else [0.1])
    assert len([x for x in tried[1:] if x == 0]) == 2  # the coarser cells run either way


def test_one_micro_batch_steps_bound_to_a_sparse_module_are_not_retried():
    # A quarter of the groups hold audio, all of source 1, and fill whole steps (as the assigner's
    # classes place them at one micro-batch at any cell size): the classes alone force a mean step
    # distance far above random batching's, so no retry runs; at two micro-batches a step could mix.
    S, R, per_group = 20, 4, 2
    G = S * R
    packing, a = _in_order(S, R, per_group)
    audio = np.repeat(np.arange(G) < G // 4, per_group)
    source = audio.astype(np.int64)
    cost = np.column_stack([100.0 * audio, np.full(G * per_group, 500.0)])
    counts_SO = np.bincount(np.repeat(np.arange(S), R * per_group) * 2 + source, minlength=2 * S).reshape(S, 2)
    assert step_stages._class_floor(counts_SO, np.array([0.75, 0.25]), np.arange(S) < S // 4) == 0.375
    assert not step_stages._retries(packing, a, cost, source, 1)
    assert step_stages._retries(packing, a, cost, source, 2) == step_stages.RETRIES


def test_steps_held_apart_by_samples_over_a_cap_retry_the_loose_trades_only():
    # A quarter of the groups are samples over a cap, all of source 1, filling whole steps (a step
    # balanced on them holds their like at any cell size): their steps alone keep the mix past
    # random batching's, so coarser cells are not tried, the loose trades are. The same steps with
    # one such group or none: their mix is the cells', so every retry runs.
    S, R, per_group = 20, 4, 1
    G = S * R
    packing, a = _in_order(S, R, per_group)
    over = np.arange(G) < G // 4
    cost = np.where(over, 9000.0, 500.0)[:, None]
    source = np.where(over, 1, np.arange(G) % 2 * 2)  # the others: sources 0 and 2 in turn
    isolated = dataclasses.replace(packing, isolated=over)
    assert step_stages._retries(isolated, a, cost, source, 1) == tuple(r for r in step_stages.RETRIES if r[1])
    assert step_stages._retries(isolated, a, cost, source, 2) == tuple(r for r in step_stages.RETRIES if r[1])
    assert step_stages._retries(packing, a, cost, source, 2) == step_stages.RETRIES
    one = dataclasses.replace(packing, isolated=np.arange(G) == 0)
    assert step_stages._retries(one, a, cost, source, 1) == step_stages.RETRIES
