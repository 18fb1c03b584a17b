"""The compiled re-planning kernels plan every step exactly as the former numpy implementation did
(tests/replay/replan_reference.py, kept as the oracle), and as their own Python source does."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replan_reference import plan_window as reference_plan_window

from balancer_cli.replay import cut_kernels, elastic_kernels, replan
from balancer_cli.replay.replan import plan_window, plan_window_rank


def random_window(seed: int, units: int, world: int, k: int, modules: int, caps: bool, zeros: bool):
    """Random steps (each at least ``k * world`` samples) with random group cuts, costs and loads."""
    rng = np.random.default_rng(seed)
    sizes = [int(max(rng.integers(1, 60), world * k)) for _ in range(units)]
    n = sum(sizes) + 7
    samples = np.split(rng.permutation(n)[:sum(sizes)], np.cumsum(sizes)[:-1])
    offsets = [np.unique(np.concatenate([[0], np.sort(rng.integers(0, s + 1, 4)), [s]])) for s in sizes]
    cost = None if modules == 0 else rng.lognormal(3.0, 1.0, (n, modules))
    if zeros and cost is not None:  # text-only samples: no cost in the first module, ties in it
        cost[rng.random(n) < 0.4, 0] = 0.0
    load = caps_K = None
    if caps:
        load = np.stack([rng.integers(0, 7, n), rng.lognormal(4.5, 1.0, n).astype(np.int64) + 1], axis=1)
        caps_K = np.array([int(rng.integers(6, 20)), int(rng.integers(300, 2000))])
    return samples, offsets, cost, np.full(units, k), load, caps_K


def as_lists(plan):
    return [[[b.tolist() for b in batches] for batches in step] for step in plan]


window_cases = dict(seed=st.integers(0, 10**6), units=st.integers(1, 5), world=st.integers(1, 9),
                    k=st.integers(1, 3), modules=st.integers(0, 3), caps=st.booleans(), zeros=st.booleans())


@settings(max_examples=150, deadline=None)
@given(**window_cases)
def test_kernels_plan_exactly_as_the_former_implementation(seed, units, world, k, modules, caps, zeros):
    samples, offsets, cost, batches, load, caps_K = random_window(seed, units, world, k, modules, caps, zeros)
    want = as_lists(reference_plan_window(samples, offsets, cost, world, batches, load, caps_K))
    assert as_lists(plan_window(samples, offsets, cost, world, batches, load, caps_K)) == want
    for rank in range(world):
        flat, bounds = plan_window_rank(samples, offsets, cost, world, batches, rank, load, caps_K)
        assert [flat[a:b] for a, b in zip(bounds, bounds[1:])] == [b for step in want for b in step[rank]]


def test_dense_ties_in_every_module_plan_as_before():
    # Many equal costs (the swap search's windows are full of ties): still the same swaps.
    rng = np.random.default_rng(5)
    samples = [rng.permutation(120)[:96]]
    offsets = [np.arange(0, 97, 8)]
    cost = rng.integers(1, 4, (120, 3)).astype(np.float64) * 256.0
    for world in (3, 5, 7):
        want = as_lists(reference_plan_window(samples, offsets, cost, world, np.array([2])))
        assert as_lists(plan_window(samples, offsets, cost, world, np.array([2]))) == want


@settings(max_examples=25, deadline=None)
@given(**window_cases)
def test_compiled_kernels_match_their_python_source(seed, units, world, k, modules, caps, zeros):
    from balancer_cli._jit import HAVE_NUMBA

    if not HAVE_NUMBA:
        pytest.skip("numba is not installed: the Python source is the only implementation")
    samples, offsets, cost, batches, load, caps_K = random_window(seed, units, world, k, modules, caps, zeros)
    compiled = as_lists(plan_window(samples, offsets, cost, world, batches, load, caps_K))
    with pytest.MonkeyPatch.context() as patch:
        for module in (elastic_kernels, cut_kernels):
            for name in dir(module):
                if hasattr(getattr(module, name), "py_func"):
                    patch.setattr(module, name, getattr(module, name).py_func)
        for name in ("assign_units", "cut_units", "cap_units", "rank_batches"):
            patch.setattr(replan, name, getattr(replan, name).py_func)
        python = as_lists(plan_window(samples, offsets, cost, world, batches, load, caps_K))
    assert python == compiled

