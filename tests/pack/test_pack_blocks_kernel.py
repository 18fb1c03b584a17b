"""The compiled pairing rounds of the assigner's blocks against a plain numpy reference."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer_cli._columns import project
from balancer_cli._sort import lexsort_order
from balancer_cli.pack._blocks import _direction, paired_rounds, principal_axis


def _reference(cell_I, dev_ID, bins_C, rounds, rng, principal):
    """Round by round with numpy's ``lexsort``: every round's items and bins sorted whole."""
    I = len(cell_I)
    order = lexsort_order(rng.random(I), cell_I)
    cell_sorted = cell_I[order]
    first_C = np.searchsorted(cell_sorted, np.arange(len(bins_C)))
    position = np.arange(I) - first_C[cell_sorted]
    nb = bins_C[cell_sorted]
    round_I = np.where(nb > 0, position // np.maximum(nb, 1), rounds)
    bin_cell = np.repeat(np.arange(len(bins_C)), bins_C)
    sum_BD = np.zeros((len(bin_cell), dev_ID.shape[1]))
    bin_I = np.full(I, -1, dtype=np.int64)
    for t in range(rounds):
        items = order[round_I == t]  # round_I is by position in the drawn order
        dev_XD = dev_ID[items]
        direction = _direction(sum_BD if t else dev_XD, rng) if principal else rng.standard_normal(dev_ID.shape[1])
        by_item = np.lexsort((-project(dev_XD, direction), cell_I[items]))
        items = items[by_item]
        bins = np.lexsort((project(sum_BD, direction), bin_cell))
        bin_I[items] = bins
        sum_BD[bins] += dev_XD[by_item]
    return bin_I


@settings(max_examples=60, deadline=None)
@given(I=st.integers(0, 400), C=st.integers(1, 6), rounds=st.integers(1, 9), D=st.integers(1, 5),
       ties=st.booleans(), principal=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_pairing_rounds_are_the_numpy_rounds_and_fill_every_bin_once_a_round(I, C, rounds, D, ties, principal, seed):
    data = np.random.default_rng(seed)
    cell_I = data.integers(0, C, I)
    # Ties: deviations of few values, so equal projections must keep the drawn order.
    dev_ID = data.integers(-1, 2, (I, D)).astype(float) if ties else data.standard_normal((I, D))
    bins_C = np.bincount(cell_I, minlength=C) // rounds
    got = paired_rounds(cell_I, dev_ID, bins_C, rounds, np.random.default_rng(seed), principal)
    want = _reference(cell_I, dev_ID, bins_C, rounds, np.random.default_rng(seed), principal)
    assert got.tolist() == want.tolist()
    # Every bin takes exactly one item a round, of its own cell; the rest are left over (-1).
    bin_cell = np.repeat(np.arange(C), bins_C)
    placed = got >= 0
    assert np.bincount(got[placed], minlength=len(bin_cell)).tolist() == [rounds] * len(bin_cell)
    assert (bin_cell[got[placed]] == cell_I[placed]).all()
    assert int((~placed).sum()) == I - rounds * int(bins_C.sum())


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(2, 40), st.integers(1, 9))
def test_principal_axis_is_the_top_eigenvector_found_without_lapack(seed, X, D):
    """What power iteration guarantees: a unit axis, the same bits on a second call, a value between
    the scatter's largest diagonal (where it starts; the Rayleigh quotient only rises) and its top
    eigenvalue, and, where that eigenvalue stands clear of the next (at least twice it), the top
    eigenvector itself (up to the sign eigh leaves open) and its eigenvalue. Near-equal top
    eigenvalues converge slowly, to an axis that spreads the rows about as far: good enough for
    a pairing direction, which the random part jitters anyway."""
    rng = np.random.default_rng(seed)
    table = np.round(rng.standard_normal((X, D)) * rng.random(D) * 4, int(rng.integers(0, 3)))
    centered = table - table.mean(axis=0)
    axis, value = principal_axis(centered)
    again = principal_axis(centered.copy())
    assert again[1] == value and np.array_equal(again[0], axis)
    scatter = centered.T @ centered
    eigenvalues, vectors = np.linalg.eigh(scatter)
    top = max(1.0, eigenvalues[-1])
    if eigenvalues[-1] <= 1e-12 * top:  # no spread (but the mean's rounding)
        assert 0.0 <= value <= 1e-12 * top
        return
    assert abs(float(np.sqrt((axis * axis).sum())) - 1.0) < 1e-9
    assert np.diagonal(scatter).max() - 1e-9 * top <= value <= eigenvalues[-1] + 1e-9 * top
    if D == 1 or eigenvalues[-2] <= 0.5 * eigenvalues[-1]:
        assert abs(abs(float(axis @ vectors[:, -1])) - 1.0) < 1e-6
        assert abs(value - eigenvalues[-1]) <= 1e-7 * top


def test_project_adds_the_columns_in_order():
    """``project`` is the in-order sum of the columns' products (what ``@`` may round otherwise)."""
    rng = np.random.default_rng(3)
    table, v = rng.standard_normal((1000, 5)), rng.standard_normal(5)
    expected = table[:, 0] * v[0]
    for k in range(1, 5):
        expected = expected + table[:, k] * v[k]
    assert np.array_equal(project(table, v), expected)
    assert np.allclose(project(table, v), table @ v, rtol=0, atol=1e-12)


def test_principal_axis_of_rows_without_spread_is_any_unit_axis_of_value_zero():
    """Equal rows (or spreads past what a float holds) give the first axis and value 0, never NaN."""
    for centered in (np.zeros((4, 3)), np.array([[1e200, 1e200], [-1e200, -1e200]])):
        with np.errstate(over="ignore", invalid="ignore"):
            axis, value = principal_axis(centered)
        assert value == 0.0 and axis.tolist() == [1.0] + [0.0] * (centered.shape[1] - 1)
