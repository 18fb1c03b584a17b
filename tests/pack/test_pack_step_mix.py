"""Trading samples of equal loads between steps: conservation, sums, caps, the mix, determinism."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer_cli.pack.evaluate import step_mix_distances
from balancer_cli.pack.step_mix import even_step_mix
from balancer_cli.pack.types import Assignment, Packing


def _case(seed: int, S: int, per_step: int, O: int, skew: float):
    """Steps of ``per_step`` groups of 1-4 rows with few distinct loads; sources skewed by step."""
    rng = np.random.default_rng(seed)
    G = S * per_step
    sizes = rng.integers(1, 5, G)
    n = int(sizes.sum())
    tiles = rng.integers(0, 3, n)
    tokens = 256 * tiles + rng.choice([50, 60, 70], n) + rng.integers(0, 2, n)
    load = np.stack([tiles, tokens], 1)
    step_G = np.repeat(np.arange(S), per_step)
    step_n = np.repeat(step_G, sizes)
    # Step s favours source s % O with probability ``skew``: steps less mixed than random draws.
    source = np.where(rng.random(n) < skew, step_n % O, rng.integers(0, O, n))
    packing = Packing(np.arange(n), np.concatenate([[0], np.cumsum(sizes)]), np.zeros(G, bool),
                      np.array([], np.int64), ())
    assignment = Assignment(step=step_G, rank=np.tile(np.arange(per_step), S), micro=np.zeros(G, np.int64),
                            num_steps=S)
    caps = np.array([12, int(np.add.reduceat(tokens, packing.group_offsets[:-1]).max()) + 40])
    return packing, assignment, load.astype(np.float64), load, caps, source


def _sums(packing, values):
    return np.add.reduceat(values[np.asarray(packing.order)], np.asarray(packing.group_offsets[:-1]), axis=0)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), S=st.integers(2, 12), per_step=st.integers(1, 6), O=st.integers(1, 4),
       skew=st.floats(0, 0.9))
def test_swaps_conserve_rows_keep_encoder_sums_and_caps_and_never_unmix(seed, S, per_step, O, skew):
    packing, assignment, weight, load, caps, source = _case(seed, S, per_step, O, skew)
    out = even_step_mix(packing, assignment, weight, load, caps, source)
    again = even_step_mix(packing, assignment, weight, load, caps, source)
    assert np.array_equal(out.order, again.order)  # deterministic
    assert np.array_equal(np.sort(out.order), np.arange(len(load)))  # every row placed once
    assert np.array_equal(out.group_offsets, packing.group_offsets)
    assert np.array_equal(_sums(out, load[:, 0]), _sums(packing, load[:, 0]))  # encoder sums exact
    assert (_sums(out, load[:, 1]) <= caps[1]).all()
    # a row moves only to a position of the same encoder load
    assert np.array_equal(load[np.asarray(out.order), 0], load[np.asarray(packing.order), 0])
    gid = packing.group_ids()
    step_P = assignment.step[gid]

    def excess(p):
        counts = np.bincount(step_P * O + source[np.asarray(p.order)], minlength=S * O).reshape(S, O)
        return np.abs(counts - counts.sum(1, keepdims=True) * counts.sum(0) / counts.sum()).sum()

    assert excess(out) <= excess(packing) + 1e-9


def test_a_step_biased_input_becomes_mixed_within_the_llm_tolerance():
    packing, assignment, weight, load, caps, source = _case(3, 40, 16, 4, 0.6)
    out = even_step_mix(packing, assignment, weight, load, caps, source)
    step_P = assignment.step[packing.group_ids()]
    before = step_mix_distances(step_P, source[packing.order], 40, 4).mean()
    after = step_mix_distances(step_P, source[out.order], 40, 4).mean()
    assert after < 0.5 * before
    llm_before, llm_after = _sums(packing, weight[:, 1]), _sums(out, weight[:, 1])
    assert np.abs(llm_after - llm_before).max() <= 0.002 * llm_before.mean() * 4 + 1e-9  # <= 4 swaps' worth


def test_steps_mixed_better_than_random_draws_are_left_alone():
    packing, assignment, weight, load, caps, source = _case(4, 20, 6, 3, 0.0)
    # each source in 2 of every step's 6 groups: steps far closer to the global mix than random draws
    exact = np.asarray(assignment.rank)[packing.group_ids()] % 3
    assert even_step_mix(packing, assignment, weight, load, caps, exact) is packing


def test_the_python_kernel_swaps_the_same(monkeypatch):
    from balancer_cli._jit import HAVE_NUMBA
    from balancer_cli.pack import step_mix

    if not HAVE_NUMBA:
        return  # the kernel already runs as Python everywhere else
    packing, assignment, weight, load, caps, source = _case(7, 30, 8, 3, 0.5)
    fast = even_step_mix(packing, assignment, weight, load, caps, source)
    monkeypatch.setattr(step_mix, "_swap_across_steps", step_mix._swap_across_steps.py_func)
    slow = even_step_mix(packing, assignment, weight, load, caps, source)
    assert fast is not packing and np.array_equal(fast.order, slow.order)
