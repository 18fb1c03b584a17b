"""The random-partner pass's exchange bounds: true lower bounds, and skipping by them changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer_cli._jit import HAVE_NUMBA
from balancer_cli.pack.packers import _refine_kernels
from balancer_cli.pack.packers._exchange_bounds import column_ranges, partner_bound, quadratic_min, row_bound, vertices


@st.composite
def pairs(draw):
    """Two groups' rows (weights, sources) and the pair's terms, as the pass builds them."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    K, O = draw(st.integers(1, 3)), draw(st.integers(0, 3))
    ng, nh, X = draw(st.integers(0, 6)), draw(st.integers(0, 6)), 8
    w_XK = [np.zeros((X + 1, K)), np.zeros((X + 1, K))]
    c_X = [np.full(X + 1, O), np.full(X + 1, O)]
    for t, n in enumerate((ng, nh)):
        w_XK[t][:n] = rng.exponential(rng.uniform(0.1, 10), (n, K)) * (rng.random((n, K)) > 0.2)
        c_X[t][:n] = rng.integers(0, max(O, 1), n) if O else O
    inv_t2 = rng.uniform(0, 1, K + O) * (rng.random(K + O) > 0.1)
    e = rng.normal(0, 3, K + O) * inv_t2
    return w_XK, c_X, ng, nh, K, O, e, inv_t2


def _cost(w_XK, c_X, a, b, K, O, e, inv_t2):
    """The pass's cost of exchanging g's row a with h's row b (n: "no row"), as it computes it."""
    gain = np.append(e[K:] + inv_t2[K:], 0.0)
    lose = np.append(inv_t2[K:] - e[K:], 0.0)
    d = w_XK[1][b] - w_XK[0][a]
    ci, cj = c_X[0][a], c_X[1][b]
    return float(np.sum(d * (e[:K] + d * inv_t2[:K]))) + (gain[cj] + lose[ci]) * (ci != cj)


@settings(max_examples=200, deadline=None)
@given(pairs())
def test_bounds_never_exceed_an_exchange_cost(case):
    w_XK, c_X, ng, nh, K, O, e, inv_t2 = case
    glo, ghi, hlo, hhi = (np.zeros(K) for _ in range(4))
    column_ranges(w_XK[0], ng, glo, ghi)
    column_ranges(w_XK[1], nh, hlo, hhi)
    gain_low = min(0.0, float((e[K:] + inv_t2[K:]).min(initial=0.0)))
    lose_low = min(0.0, float((inv_t2[K:] - e[K:]).min(initial=0.0)))
    costs = np.array([[_cost(w_XK, c_X, a, b, K, O, e, inv_t2) for b in range(nh + 1)] for a in range(ng + 1)])
    slack = 1e-9 * (1 + np.abs(costs).max())
    v = np.zeros(K)
    vertices(e, inv_t2, v)
    assert partner_bound(v, e, inv_t2, glo, ghi, hlo, hhi, gain_low + lose_low) <= costs.min() + slack
    lose_O = np.append(inv_t2[K:] - e[K:], 0.0)
    for a in range(ng + 1):
        bound = row_bound(v, e, inv_t2, w_XK[0], a, hlo, hhi, gain_low + min(0.0, lose_O[c_X[0][a]]))
        assert bound <= costs[a].min() + slack


@given(st.floats(-1e3, 1e3), st.floats(0, 1e2), st.floats(-1e3, 1e3), st.floats(0, 1e3))
def test_quadratic_min_is_the_minimum_on_the_interval(e, w, lo, width):
    hi = lo + width
    grid = np.linspace(lo, hi, 2001)
    assert quadratic_min(e, w, lo, hi) <= (grid * (e + grid * w)).min() + 1e-6 * (1 + abs(e) * (abs(lo) + width))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 3))
def test_skipping_by_the_bounds_leaves_the_pass_unchanged(seed, O):
    """The compiled pass (skips on) and its Python twin with bounds that never skip agree exactly."""
    if not HAVE_NUMBA:
        pytest.skip("numba absent: the pass runs as Python with the bounds")
    rng = np.random.default_rng(seed)
    G, X, K, N = 12, 7, 2, 50
    load_NK = np.stack([rng.integers(0, 5, N), rng.integers(10, 500, N)], 1)
    weight_NK = load_NK * rng.uniform(0.5, 1.5, (N, K))
    group = np.sort(np.concatenate([np.arange(G), rng.integers(0, G, N - G)]))
    count_G = np.bincount(group, minlength=G)
    members_GX = np.full((G, max(X, int(count_G.max())) + 2), -1)
    for g in range(G):
        members_GX[g, :count_G[g]] = np.flatnonzero(group == g)
    code_N = rng.integers(0, max(O, 1), N) if O else np.zeros(0, np.int64)
    msum = np.zeros((G, O))
    for g in range(G):
        for i in members_GX[g, :count_G[g]]:
            if O:
                msum[g, code_N[i]] += 1
    sum_GK = np.hstack([np.array([weight_NK[members_GX[g, :count_G[g]]].sum(0) for g in range(G)]), msum])
    lsum_GK = np.array([load_NK[members_GX[g, :count_G[g]]].sum(0) for g in range(G)])
    caps_K = lsum_GK.max(0) + 3
    target_K = sum_GK.mean(0)
    inv_t2_K = np.divide(1.0, target_K**2, out=np.zeros_like(target_K), where=target_K > 0)
    inv_t2_K[K:] *= 1e-2
    order_G, cand_GC = rng.permutation(G), rng.integers(0, G, (G, 3))
    results = []
    for fast in (True, False):
        state = [members_GX.copy(), count_G.copy(), sum_GK.copy(), lsum_GK.copy()]
        if fast:
            n = _refine_kernels.refine_pass(order_G, cand_GC, *state[:2], state[2], state[3], weight_NK, code_N,
                                            load_NK, caps_K, target_K, inv_t2_K, 1e-12)
        else:
            never = {"partner_bound": lambda *a: -np.inf, "row_bound": lambda *a: -np.inf}
            saved = {k: getattr(_refine_kernels, k) for k in never}
            try:
                for k, f in never.items():
                    setattr(_refine_kernels, k, f)
                n = _refine_kernels.refine_pass.py_func(order_G, cand_GC, *state[:2], state[2], state[3], weight_NK,
                                                        code_N, load_NK, caps_K, target_K, inv_t2_K, 1e-12)
            finally:
                for k, f in saved.items():
                    setattr(_refine_kernels, k, f)
        results.append((n, state))
    (n0, s0), (n1, s1) = results
    assert n0 == n1
    for a, b in zip(s0, s1):
        assert np.array_equal(a, b)
