"""The compiled pairing rounds of the assigner's blocks against a plain numpy reference."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer_cli._sort import lexsort_order
from balancer_cli.pack._blocks import _direction, paired_rounds


def _projection(table_XD, direction_D):
    """``table_XD @ direction_D`` summed in column order (as the kernel does; BLAS may not)."""
    out = np.zeros(len(table_XD))
    for d in range(len(direction_D)):
        out = out + table_XD[:, d] * direction_D[d]
    return out


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
        by_item = np.lexsort((-_projection(dev_XD, direction), cell_I[items]))
        items = items[by_item]
        bins = np.lexsort((_projection(sum_BD, direction), bin_cell))
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
