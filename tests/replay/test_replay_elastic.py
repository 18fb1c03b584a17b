"""Property tests of elastic replay: the planning functions and ManifestReplay resumed anywhere (pure numpy)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer_cli.errors import ManifestError
from balancer_cli.replay.elastic import batches_per_rank, form_runs, plan_step
from balancer_cli.replay.group_plan import adjust_group_count, assign_groups

group_sizes = st.lists(st.integers(1, 9), min_size=1, max_size=24)


def make_groups(sizes, seed):
    order = np.random.default_rng(seed).permutation(sum(sizes))
    return np.split(order, np.cumsum(sizes)[:-1]), np.random.default_rng(seed + 1).uniform(0, 100, sum(sizes))


@settings(max_examples=60, deadline=None)
@given(sizes=group_sizes, target=st.integers(1, 60), seed=st.integers(0, 10**6))
def test_adjust_group_count_conserves_samples_and_order(sizes, target, seed):
    groups, cost = make_groups(sizes, seed)
    if target > sum(sizes):
        with pytest.raises(ManifestError):
            adjust_group_count(groups, cost, target)
        return
    out, splits, merges = adjust_group_count(groups, cost, target)
    assert len(out) == target and all(len(g) for g in out)
    assert np.array_equal(np.sort(np.concatenate(out)), np.sort(np.concatenate(groups)))
    assert splits - merges == target - len(groups)
    if splits and not merges:
        # Splits keep samples in manifest order: concatenating the groups gives the input back.
        assert np.array_equal(np.concatenate(out), np.concatenate(groups))


@settings(max_examples=60, deadline=None)
@given(sizes=group_sizes, world=st.integers(1, 12), k=st.integers(1, 4), seed=st.integers(0, 10**6))
def test_plan_step_gives_every_rank_the_same_number_of_batches(sizes, world, k, seed):
    groups, cost = make_groups(sizes, seed)
    plan = plan_step(groups, cost, world, k)
    assert len(plan) == world and len({len(b) for b in plan}) == 1
    if sum(sizes) < world:
        # Fewer samples than ranks: one batch per rank, sample i of the step on rank i, then empty ones.
        flat = np.concatenate(groups).tolist()
        assert [[b.tolist() for b in batches] for batches in plan] == [[[s]] for s in flat] + [[[]]] * (world - len(flat))
        return
    assert len(plan[0]) == min(k, sum(sizes) // world)
    assert all(len(b) for batches in plan for b in batches)
    flat = np.concatenate([b for batches in plan for b in batches])
    assert np.array_equal(np.sort(flat), np.arange(sum(sizes)))
    again = plan_step(groups, cost, world, k)
    assert all(np.array_equal(a, b) for x, y in zip(plan, again) for a, b in zip(x, y))


@settings(max_examples=60, deadline=None)
@given(costs=st.lists(st.floats(0, 1000), min_size=1, max_size=40), world=st.integers(1, 8))
def test_assign_groups_respects_cardinality_and_lpt_bound(costs, world):
    k = -(-len(costs) // world)
    costs = np.array(costs + [0.0] * (k * world - len(costs)))
    taken = assign_groups(costs, world, k)
    assert sorted(g for t in taken for g in t) == list(range(len(costs)))
    assert all(len(t) == k for t in taken)
    loads = np.array([costs[t].sum() for t in taken])
    # Cardinality-constrained LPT stays within the mean plus the largest group.
    assert loads.max() <= costs.sum() / world + costs.max() + 1e-6


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(1, 20), max_size=30), need=st.integers(1, 25), head=st.integers(0, 24))
def test_form_runs_covers_every_step_with_big_enough_runs(counts, need, head):
    head = min(head, need - 1)
    bounds = form_runs(np.array(counts, dtype=np.int64), need, head)
    assert bounds[0] == 0 and bounds[-1] == len(counts) and (np.diff(bounds) >= 0).all()
    if not counts and not head:
        assert bounds.tolist() == [0]
        return
    csum = np.concatenate([[0], np.cumsum(counts)])
    sizes = csum[bounds[1:]] - csum[bounds[:-1]]
    sizes[0] += head
    assert (np.diff(bounds)[1:] > 0).all()
    if len(sizes) > 1 or sum(counts) + head >= need:
        assert (sizes >= need).all()


def test_batches_per_rank():
    assert batches_per_rank(8, 1, 8) == 1
    assert batches_per_rank(8, 1, 3) == 3
    assert batches_per_rank(8, 2, 16) == 1
    assert batches_per_rank(2, 1, 16) == 1


@settings(max_examples=12, deadline=None)
@given(world=st.integers(1, 4), micro=st.integers(1, 3), new_world=st.integers(1, 9), cut=st.integers(0, 12),
       seed=st.integers(0, 1000))
def test_any_resume_at_any_world_size_yields_every_sample_once(tmp_path_factory, world, micro, new_world, cut, seed):
    """Random manifest, random cut, random new world size: conservation and equal batch counts."""
    from replay_util import pack_random

    from balancer_cli.manifest import open_manifest
    from balancer_cli.replay.cursor import ManifestReplay

    manifest = pack_random(tmp_path_factory.mktemp("h"), num_samples=60 + seed % 40, world_size=world,
                           micro_batches=micro, drop=seed % 3, seed=seed, rows_per_row_group=16)
    replays = [ManifestReplay(manifest, rank=r, world_size=world) for r in range(world)]
    its = [iter(s) for s in replays]
    cut = min(cut, len(replays[0]))
    before = [i for it in its for _ in range(cut) for i in next(it)]
    state = replays[0].state_dict()
    everything = np.sort(open_manifest(manifest).read_all().sample)
    # Fewer samples left than new ranks: the first ranks take one each, the others an empty batch.
    after = []
    for rank in range(new_world):
        resumed = ManifestReplay(manifest, rank=rank, world_size=new_world)
        resumed.load_state_dict(state)
        after.append(list(resumed))
    assert len({len(b) for b in after}) == 1
    got = np.sort(before + [i for batches in after for b in batches for i in b])
    assert np.array_equal(got, everything)
