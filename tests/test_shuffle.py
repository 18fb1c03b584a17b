"""The compiled seeded shuffles (balancer_cli._shuffle): a permutation, seeded, the same compiled or
not and in any block size, and every order about as likely."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer_cli import _shuffle
from balancer_cli._jit import HAVE_NUMBA


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 300), seed=st.integers(0, 2**32 - 1),
       dtype=st.sampled_from(["int8", "int16", "int32", "int64", "float64"]))
def test_a_shuffle_keeps_every_value_once_and_its_seed_decides_it(n, seed, dtype):
    values = np.random.default_rng(seed ^ 1).integers(-100, 100, n).astype(dtype)
    out = _shuffle.shuffled(np.random.default_rng(seed), values)
    assert out.dtype == values.dtype and sorted(out.tolist()) == sorted(values.tolist())
    order = _shuffle.permutation(np.random.default_rng(seed), n)
    assert order.dtype == np.int64 and sorted(order.tolist()) == list(range(n))
    assert out.tolist() == values[order].tolist()  # the same swaps, on values or on positions
    again = values.copy()
    _shuffle.shuffle(np.random.default_rng(seed), again)
    assert again.tolist() == out.tolist()


def test_draws_a_block_at_a_time_and_in_plain_python_give_the_same_order(monkeypatch):
    expected = _shuffle.permutation(np.random.default_rng(7), 1000)
    monkeypatch.setattr(_shuffle, "_BLOCK", 7)  # the generator's stream cut anywhere: the same doubles
    assert _shuffle.permutation(np.random.default_rng(7), 1000).tolist() == expected.tolist()
    if HAVE_NUMBA:
        monkeypatch.setattr(_shuffle, "_swap_down", _shuffle._swap_down.py_func)
        assert _shuffle.permutation(np.random.default_rng(7), 1000).tolist() == expected.tolist()


def test_every_order_is_about_as_likely():
    rng = np.random.default_rng(0)
    index = {order: i for i, order in enumerate(itertools.permutations(range(4)))}
    counts = np.zeros(len(index))
    draws = 24_000
    for _ in range(draws):
        counts[index[tuple(_shuffle.permutation(rng, 4).tolist())]] += 1
    chi2 = float((((counts - draws / 24) ** 2) / (draws / 24)).sum())
    assert chi2 < 60  # 23 degrees of freedom: P(chi2 > 60) < 1e-4
    # Past one block of draws too: each value lands in each tenth of the positions about as often.
    spread = np.zeros(100)
    for _ in range(100):
        order = _shuffle.permutation(rng, 200_000)
        spread += np.bincount(np.arange(200_000) // 20_000 * 10 + order // 20_000, minlength=100)
    share = spread.reshape(10, 10) / spread.reshape(10, 10).sum(axis=1, keepdims=True)
    assert np.abs(share - 0.1).max() < 0.002  # 2M draws a row: a share's deviation is ~2e-4


def test_a_table_is_refused():
    with pytest.raises(ValueError, match="1-D"):
        _shuffle.shuffle(np.random.default_rng(0), np.zeros((2, 2)))
