"""The compiled swap loops of the tile stage (:mod:`balancer_cli.pack._discrete_kernel`) make the
same swaps as plain numpy searches written apart: a lookup per count of quanta for the givers'
own takers, and the chains through a third rank with the takers' codes sorted again each time."""

from __future__ import annotations

from unittest import mock

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pack_util import three_modules

from balancer_cli.errors import InputError
from balancer_cli.pack import step_discrete
from balancer_cli.pack.assign import assign_groups, split_to_multiple
from balancer_cli.pack.packers.balanced import BalancedOptions, pack_balanced
from balancer_cli.pack.step_discrete import even_discrete_steps
from balancer_cli.pack.types import group_sums


def _delta(load_NK, order_P, a, b):
    return load_NK[order_P[a]].astype(np.int64) - load_NK[order_P[b]]


def _gap(cost_NK, order_P, a, b, others_K, weight_K):
    return (np.abs(cost_NK[order_P[a]][..., others_K] - cost_NK[order_P[b]][..., others_K])
            * weight_K[others_K]).sum(-1)


def _swap(x, y, order_P, quanta_P, gload_GK, group_P, load_NK):
    d = _delta(load_NK, order_P, x, y)
    gload_GK[group_P[x]] -= d
    gload_GK[group_P[y]] += d
    order_P[x], order_P[y] = order_P[y], order_P[x]
    quanta_P[x], quanta_P[y] = quanta_P[y], quanta_P[x]


def give_by_quanta(slots_S, first_S, end_S, pos_V, dev_X, key_T, pos_T, kind_P, quanta_P, span, slot_P, group_P,
                   order_P, load_NK, gload_GK, caps_K, cost_NK, others_K, weight_K, max_swaps, swapped):
    """``give_quanta`` with each giver's takers looked up one count of quanta at a time (the least
    gap of each count, then the least per quantum over the counts: fewer quanta on a tie)."""

    def best_taker(x, dev):
        best = None
        for step_by in range(1, min(dev, int(quanta_P[x])) + 1):
            want = kind_P[x] * span + quanta_P[x] - step_by
            lo, hi = np.searchsorted(key_T, [want, want + 1])
            cand = pos_T[lo:hi]
            cand = cand[(quanta_P[cand] == quanta_P[x] - step_by) & (dev_X[slot_P[cand]] <= -step_by)]
            d = _delta(load_NK, order_P, x, cand)
            fits = ((gload_GK[group_P[cand]] + d <= caps_K).all(axis=1)
                    & (gload_GK[group_P[x]] - d <= caps_K).all(axis=1))
            if not fits.any():
                continue
            gap = np.where(fits, _gap(cost_NK, order_P, x, cand, others_K, weight_K), np.inf)
            j = int(np.argmin(gap))
            if best is None or gap[j] / step_by < best[0]:
                best = (float(gap[j]) / step_by, int(cand[j]), step_by)
        return best

    for i, slot in enumerate(slots_S.tolist()):
        mine = pos_V[first_S[i]:end_S[i]]
        while dev_X[slot] > 0 and swapped < max_swaps:
            best = None
            for x in mine[quanta_P[mine] > 0].tolist():
                found = best_taker(x, int(dev_X[slot]))
                if found is not None and (best is None or found[0] < best[0]):
                    best = (found[0], x, *found[1:])
            if best is None:
                break
            _, x, y, step_by = best
            _swap(x, y, order_P, quanta_P, gload_GK, group_P, load_NK)
            dev_X[slot] -= step_by
            dev_X[slot_P[y]] += step_by
            swapped += 1
    return swapped


def chain_by_arrays(slots_S, first_S, end_S, uneven_U, slot_U, code_T, index_P, kind_P, quanta_P, span, pool_F,
                    key_F, llm_P, top, near, slot_P, group_P, offsets_G, order_P, load_NK, gload_GK, caps_K, cost_NK,
                    others_K, weight_K, dev_X, max_swaps, swapped):
    """``chain_quanta`` as array searches: every (x, y, x', y') of a round at once, the least gap
    the first, and the takers' codes sorted again after each chain."""
    U = len(uneven_U)

    def nearest(pos):
        want = (kind_P[pos] * span + quanta_P[pos] - 1).astype(np.float64)
        lo, hi = np.searchsorted(key_F, want * top), np.searchsorted(key_F, (want + 1) * top)
        mid = np.searchsorted(key_F, want * top + llm_P[pos])
        start = np.clip(mid - near // 2, lo, np.maximum(hi - near, lo))
        at = start[:, None] + np.arange(near)[None, :]
        cand = np.where(at < hi[:, None], pool_F[np.minimum(at, len(pool_F) - 1)], -1)
        stale = (cand >= 0) & (quanta_P[np.maximum(cand, 0)] != (quanta_P[pos] - 1)[:, None])
        return np.where(stale, -1, cand)

    def ranges(starts, sizes):
        return np.concatenate([np.arange(s, s + n) for s, n in zip(starts, sizes)] + [np.zeros(0, np.int64)])

    for i, slot in enumerate(slots_S.tolist()):
        while dev_X[slot] > 0 and swapped + 2 <= max_swaps:
            mine = uneven_U[first_S[i]:end_S[i]]
            mine = mine[quanta_P[mine] > 0]
            code_T = code_T[dev_X[slot_U[code_T % U]] < 0]
            if len(mine) == 0 or len(code_T) == 0:
                break
            x_A, y_A = np.repeat(mine, near), nearest(mine).reshape(-1)
            x_A, y_A = x_A[y_A >= 0], y_A[y_A >= 0]
            ok = (gload_GK[group_P[x_A]] - _delta(load_NK, order_P, x_A, y_A) <= caps_K).all(axis=1)
            x_A, y_A = x_A[ok], y_A[ok]
            if len(x_A) == 0:
                break
            n_A = group_P[y_A]
            size_A = offsets_G[n_A + 1] - offsets_G[n_A]
            a_J, xp_J = np.repeat(np.arange(len(x_A)), size_A), ranges(offsets_G[n_A], size_A)
            takers, tkey = uneven_U[code_T % U], code_T // U
            want = kind_P[xp_J] * span + quanta_P[xp_J] - 1
            lo, hi = np.searchsorted(tkey, want), np.searchsorted(tkey, want, "right")
            hi = np.where(quanta_P[xp_J] > 0, np.minimum(hi, lo + near), lo)
            j_L = np.repeat(np.arange(len(xp_J)), hi - lo)
            x, y, xp, yp = x_A[a_J[j_L]], y_A[a_J[j_L]], xp_J[j_L], takers[ranges(lo, hi - lo)]
            given = _delta(load_NK, order_P, xp, yp)
            n_fits = (gload_GK[group_P[y]] + _delta(load_NK, order_P, x, y) - given <= caps_K).all(axis=1)
            fits = (xp != y) & n_fits & (gload_GK[group_P[yp]] + given <= caps_K).all(axis=1)
            if not fits.any():
                break
            score = np.where(fits, _gap(cost_NK, order_P, x, y, others_K, weight_K)
                             + _gap(cost_NK, order_P, xp, yp, others_K, weight_K), np.inf)
            j = int(np.argmin(score))
            _swap(int(x[j]), int(y[j]), order_P, quanta_P, gload_GK, group_P, load_NK)
            _swap(int(xp[j]), int(yp[j]), order_P, quanta_P, gload_GK, group_P, load_NK)
            swapped += 2
            dev_X[slot] -= 1
            dev_X[slot_P[int(yp[j])]] += 1
            taker = int(yp[j])
            old = (kind_P[taker] * span + quanta_P[taker] - 1) * U + index_P[taker]
            code_T = np.sort(np.where(code_T == old, old + U, code_T))
    return swapped


def _placed(seed, n, R, M, sources, top, llm_cap, dtype=np.float64):
    load, cost, source = three_modules(seed, n, sources, tiles=tuple(range(1, top + 1)), tiled_every_other=True)
    cost = cost.astype(dtype)
    caps = np.array([3 * top, 6, llm_cap])
    p = pack_balanced(load, caps, seed=seed, cost_NK=cost, group_multiple=R * M, source_N=source,
                      options=BalancedOptions(passes=2, class_mix=False))
    p = split_to_multiple(p, cost[:, -1], R * M)
    return load, cost, source, caps, p, assign_groups(group_sums(p, cost), world_size=R, micro_batches=M, seed=seed)


def _counted(kernel, calls):
    def run(*args):
        before = args[-1]
        made = kernel(*args)
        calls.append(made - before)
        return made
    return run


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(200, 3000), R=st.integers(2, 16), M=st.sampled_from([1, 1, 2]),
       sources=st.integers(1, 3), top=st.integers(2, 12), llm_cap=st.sampled_from([3000, 6000]),
       dtype=st.sampled_from([np.float64, np.float32]))
def test_the_compiled_swaps_are_the_array_searches_swaps(seed, n, R, M, sources, top, llm_cap, dtype):
    """Both loops, on random tiled inputs (one micro-batch near the LLM cap: chains), give the same
    packing as their array references, ties included, with float64 and float32 costs."""
    try:
        load, cost, source, caps, p, a = _placed(seed, n, R, M, sources, top, llm_cap, dtype)
    except InputError:  # too few samples for whole steps of R x M groups
        assume(False)
    q = even_discrete_steps(p, a, cost, load, caps, source)
    with (mock.patch.object(step_discrete, "give_quanta", give_by_quanta),
          mock.patch.object(step_discrete, "chain_quanta", chain_by_arrays)):
        ref = even_discrete_steps(p, a, cost, load, caps, source)
    assert np.array_equal(q.order, ref.order)


def test_chains_swap_as_their_reference_on_a_step_of_full_groups():
    """Tiles of 1-6 under a cap of 19 at one micro-batch, 16 ranks: a rank's one group rarely takes
    a pair within the LLM cap, so most quanta go through a third rank; the same swaps either way,
    and the compiled loops in plain Python (``py_func``: numba absent) too."""
    from balancer_cli.pack import _discrete_kernel

    load, cost, source = three_modules(4, 8000, 3, tiles=tuple(range(1, 7)), tiled_every_other=True)
    caps = np.array([19, 6, 8000])
    p = pack_balanced(load, caps, seed=4, cost_NK=cost, group_multiple=16, source_N=source,
                      options=BalancedOptions(passes=2, class_mix=False))
    p = split_to_multiple(p, cost[:, -1], 16)
    a = assign_groups(group_sums(p, cost), world_size=16, micro_batches=1, seed=4)
    chained = []
    with mock.patch.object(step_discrete, "chain_quanta", _counted(step_discrete.chain_quanta, chained)):
        q = even_discrete_steps(p, a, cost, load, caps, source)
    assert chained and sum(chained) >= 20  # pairs through a third rank
    with (mock.patch.object(step_discrete, "give_quanta", give_by_quanta),
          mock.patch.object(step_discrete, "chain_quanta", chain_by_arrays)):
        ref = even_discrete_steps(p, a, cost, load, caps, source)
    assert np.array_equal(q.order, ref.order)
    plain = [getattr(k, "py_func", k) for k in (_discrete_kernel.give_quanta, _discrete_kernel.chain_quanta)]
    with (mock.patch.object(step_discrete, "give_quanta", plain[0]),
          mock.patch.object(step_discrete, "chain_quanta", plain[1])):
        python = even_discrete_steps(p, a, cost, load, caps, source)
    assert np.array_equal(q.order, python.order)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.floats(0, 1e6, width=32), min_size=6, max_size=6),
       weights=st.lists(st.floats(2.0**-20, 1.0, width=32), min_size=3, max_size=3), skip=st.integers(0, 2),
       dtype=st.sampled_from([np.float64, np.float32]), weight_dtype=st.sampled_from([np.float64, np.float32]))
def test_a_gap_is_numpys_bit_for_bit_in_its_type(values, weights, skip, dtype, weight_dtype):
    """A gap adds its products in their own type, as numpy's sum of them does: with float32 costs
    two chains of near-equal gaps tie or not as in numpy (summed in float64, a `speech` input took
    another chain)."""
    from balancer_cli.pack import _discrete_kernel

    cost = np.array(values, dtype).reshape(2, 3)
    weight = np.array(weights, weight_dtype)
    others = np.arange(3) != skip
    expect = _gap(cost, np.arange(2), np.array([0]), np.array([1]), others, weight)[0]
    compiled = _discrete_kernel._gap(cost, 0, 1, others, weight)  # its float32 boxed as a Python float
    plain = getattr(_discrete_kernel._gap, "py_func", _discrete_kernel._gap)(cost, 0, 1, others, weight)
    # Compared as float64: a Python float against a float32 would be rounded to float32 first.
    assert np.float64(compiled) == np.float64(expect) and np.asarray(plain).dtype == expect.dtype
    assert np.float64(plain) == np.float64(expect)
