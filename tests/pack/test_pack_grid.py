"""The targeted swaps' grid: offsets for every cell (dense) or for the occupied ones (sparse)
bucket the same rows in the same order, and the packings do not depend on which one is built."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer_cli.pack.packers import _balanced_refine
from balancer_cli.pack.packers._table_kernels import grid_cells
from balancer_cli.pack.packers.balanced import pack_balanced


def _buckets(keys, start, order, cells, sparse):
    """{cell: its rows in order} from either layout."""
    listed = keys.tolist() if sparse else list(range(cells))
    return {c: order[start[u]:start[u + 1]].tolist() for u, c in enumerate(listed) if start[u + 1] > start[u]}


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(0, 300), modules=st.integers(1, 4),
       cells=st.integers(1, 9), width=st.sampled_from([0.01, 0.1, 0.5, 2.0]))
def test_sparse_and_dense_grids_bucket_the_same_rows_in_the_same_order(seed, rows, modules, cells, width):
    rng = np.random.default_rng(seed)
    weight = rng.exponential(1.0, (rows, modules)) * rng.choice([0.0, 1.0], (rows, modules), p=[0.3, 0.7])
    inv_t = rng.uniform(0.1, 3.0, modules)
    dims = rng.integers(1, cells + 1, modules).astype(np.int64)  # rows past the last cell go to it
    total = int(np.prod(dims))
    dense = grid_cells(weight, inv_t, width, dims, False)
    sparse = grid_cells(weight, inv_t, width, dims, True)
    assert len(dense[0]) == 0 and len(dense[1]) == total + 1
    assert np.array_equal(dense[2], sparse[2])  # the rows by cell, ascending within a cell
    assert np.all(np.diff(sparse[0]) > 0) and len(sparse[1]) == len(sparse[0]) + 1
    assert _buckets(*dense, total, False) == _buckets(*sparse, total, True)
    assert sorted(_buckets(*sparse, total, True)) == sparse[0].tolist()  # only occupied cells are listed


def test_packings_are_the_same_with_either_grid(monkeypatch):
    """Three modules: forcing either layout gives the same groups, with targeted swaps applied."""
    rng = np.random.default_rng(0)
    n = 3000
    tiles = rng.integers(0, 7, n)
    audio = np.where(rng.random(n) < 0.5, rng.integers(1, 6, n), 0)
    load = np.stack([tiles, audio, 256 * tiles + 50 * audio + rng.integers(20, 3000, n)], 1)
    caps = np.array([40, 30, 30000])
    source = rng.integers(0, 5, n)
    swaps = []
    targeted = _balanced_refine.targeted_pass
    monkeypatch.setattr(_balanced_refine, "targeted_pass", lambda *a: swaps.append(targeted(*a)) or swaps[-1])
    packed = []
    for per_row in (0, 10**18):  # every grid sparse, then every grid dense
        monkeypatch.setattr(_balanced_refine, "_SPARSE_CELLS_PER_ROW", per_row)
        packed.append(pack_balanced(load, caps, group_multiple=4, seed=0, source_N=source))
    assert sum(swaps) > 0, "no targeted swap was applied: this case tests nothing"
    a, b = packed
    assert np.array_equal(a.order, b.order) and np.array_equal(a.group_offsets, b.group_offsets)
