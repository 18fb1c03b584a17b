"""Elastic replay keeps the packer's caps (encoder items, LLM tokens per batch) when lengths are known."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer_cli.lengths import make_lengths_table
from balancer_cli.manifest import ManifestRows, write_manifest
from balancer_cli.replay.elastic import batches_per_rank
from balancer_cli.replay.replan import plan_window, plan_window_rank

CAPS_K = np.array([12, 900], dtype=np.int64)  # vision items, llm tokens per group


def packed_manifest(seed: int, world: int, micro: int, steps: int):
    """A random manifest packed under ``CAPS_K`` like the packer does: groups filled in a random
    order until the next sample would exceed a cap; a sample alone over a cap is an isolated
    group of its own. Returns per-step samples and group offsets, and the (N, 2) load."""
    rng = np.random.default_rng(seed)
    G = world * micro
    n = steps * G * 6
    load = np.stack([rng.integers(0, 7, n), rng.lognormal(4.5, 1.0, n).astype(np.int64) + 1], axis=1)
    over = rng.random(n) < 0.03
    load[over, 1] = CAPS_K[1] + rng.integers(1, 500, int(over.sum()))
    groups, cur, acc = [], [], np.zeros(2, np.int64)
    for i in rng.permutation(n).tolist():
        if cur and ((acc + load[i]) > CAPS_K).any():
            groups.append(cur)
            cur, acc = [], np.zeros(2, np.int64)
        cur.append(i)
        acc = acc + load[i]
    groups.append(cur)
    steps = len(groups) // G
    samples, offsets = [], []
    for s in range(steps):
        gs = groups[s * G:(s + 1) * G]
        samples.append(np.concatenate(gs).astype(np.int64))
        offsets.append(np.concatenate([[0], np.cumsum([len(g) for g in gs])]).astype(np.int64))
    return samples, offsets, load


def assert_within_caps(batch: np.ndarray, load: np.ndarray) -> None:
    # A batch may exceed a cap only when it is one sample that alone exceeds it.
    assert len(batch) == 1 or (load[batch].sum(axis=0) <= CAPS_K).all(), (batch.tolist(), load[batch].sum(axis=0))


@settings(max_examples=40, deadline=None)
@given(world=st.integers(1, 4), micro=st.integers(1, 3), seed=st.integers(0, 10**6),
       new_world_pick=st.sampled_from(["1", "2", "3", "R+1", "2R"]))
def test_elastic_batches_respect_the_packers_caps(world, micro, seed, new_world_pick):
    samples, offsets, load = packed_manifest(seed, world, micro, steps=3)
    if not samples:
        return
    new_world = {"1": 1, "2": 2, "3": 3, "R+1": world + 1, "2R": 2 * world}[new_world_pick]
    k = batches_per_rank(world, micro, new_world)
    # Steps with fewer than k*R' samples are merged into runs by the replay (epoch_plan); the guarantee is
    # stated for steps that keep k batches per rank (k*R' >= R*M groups: the fallback only splits).
    kept = [(s, o) for s, o in zip(samples, offsets) if len(s) >= k * new_world]
    samples, offsets = [s for s, _ in kept], [o for _, o in kept]
    if not samples:
        return
    batches = np.full(len(samples), k, dtype=np.int64)
    cost = np.stack([load[:, 0] * 256.0, load[:, 1].astype(np.float64)], axis=1)
    plan = plan_window(samples, offsets, cost, new_world, batches, load, CAPS_K)
    for u, step in enumerate(plan):
        assert [len(b) for b in step] == [int(batches[u])] * new_world
        flat = np.concatenate([b for bs in step for b in bs])
        assert np.array_equal(np.sort(flat), np.sort(samples[u]))  # conservation
        for bs in step:
            for b in bs:
                assert len(b) and b.dtype.kind == "i"
                assert_within_caps(b, load)
    for rank in range(new_world):  # each rank alone computes the same batches
        got, bounds = plan_window_rank(samples, offsets, cost, new_world, batches, rank, load, CAPS_K)
        want = [b.tolist() for step in plan for b in step[rank]]
        assert [got[a:b] for a, b in zip(bounds, bounds[1:])] == want


def test_without_caps_batches_are_cut_by_cost_only():
    # The documented behaviour without lengths/caps: the equal-cost cut ignores the caps (1000
    # LLM tokens in a batch, cap 900); with them the cut moves so both batches fit.
    samples = [np.arange(4, dtype=np.int64)]
    offsets = [np.array([0, 1, 2, 3, 4])]
    load = np.array([[0, 100], [0, 100], [0, 200], [0, 800]])
    free = plan_window(samples, offsets, None, 1, np.array([2]))
    assert [b.tolist() for b in free[0][0]] == [[0, 1], [2, 3]]
    capped = plan_window(samples, offsets, None, 1, np.array([2]), load, CAPS_K)
    assert [b.tolist() for b in capped[0][0]] == [[0, 1, 2], [3]]


def test_a_step_that_cannot_fit_under_the_caps_falls_back_to_whole_groups_on_every_rank():
    # On 3 ranks x 2 batches, sample LPT leaves some rank with samples that no 2 batches hold
    # under 900 tokens, so the whole step (every rank) takes the group plan: each batch is a
    # packed group or a piece of one (the 3-sample group is split into [0] and [1, 2]).
    samples = [np.arange(7, dtype=np.int64)]
    offsets = [np.array([0, 3, 4, 5, 6, 7])]
    load = np.stack([np.zeros(7, np.int64), np.array([450, 100, 100, 800, 600, 800, 450])], axis=1)
    free = plan_window(samples, offsets, None, 3, np.array([2]))
    assert any(load[b, 1].sum() > 900 for bs in free[0] for b in bs)
    plan = plan_window(samples, offsets, None, 3, np.array([2]), load, CAPS_K)
    assert [[b.tolist() for b in bs] for bs in plan[0]] == [[[1, 2], [6]], [[0], [4]], [[3], [5]]]
    for rank in range(3):
        got, bounds = plan_window_rank(samples, offsets, None, 3, np.array([2]), rank, load, CAPS_K)
        assert [got[a:b] for a, b in zip(bounds, bounds[1:])] == [b.tolist() for b in plan[0][rank]]


@pytest.mark.parametrize("new_world", [3, 5])
def test_replay_respects_manifest_caps(tmp_path, new_world):
    from balancer_cli.replay.cursor import ManifestReplay

    world, micro = 4, 2
    samples, offsets, load = packed_manifest(7, world, micro, steps=4)
    G = world * micro
    step_of, group_of, sample = [], [], []
    for s, (samp, off) in enumerate(zip(samples, offsets)):
        for g in range(G):
            members = samp[off[g]:off[g + 1]]
            step_of += [s] * len(members)
            group_of += [g] * len(members)
            sample += members.tolist()
    n = len(load)
    placed = np.zeros(n, bool)
    placed[sample] = True
    lengths = make_lengths_table(load[:, 1], {"vision": (load[:, 0] * 256, load[:, 0])})
    group = np.asarray(group_of)
    rows = ManifestRows(np.asarray(step_of), group // micro, group % micro, np.asarray(sample))
    write_manifest(tmp_path / "m", rows, dropped_sample=np.flatnonzero(~placed),
                   dropped_reason=["tail"] * int((~placed).sum()),
                   meta={"world_size": world, "micro_batches": micro, "num_samples": n, "seed": 0,
                         "algorithm": "test", "lengths_fingerprint": lengths.fingerprint,
                         "params": {"caps": {"vision": int(CAPS_K[0]), "llm": int(CAPS_K[1])}}},
                   epoch_num_steps=[len(samples)])
    seen = []
    for rank in range(new_world):
        replay = ManifestReplay(tmp_path / "m", rank=rank, world_size=new_world, lengths=lengths)
        for batch in replay:
            assert_within_caps(np.asarray(batch), load)
            seen += list(batch)
    assert sorted(seen) == sorted(sample)
