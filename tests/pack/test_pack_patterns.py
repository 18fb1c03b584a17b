"""Groups from cutting-stock patterns (``packers._patterns``): every row placed once, every group
within every cap, and, where a module of few sizes binds, groups at its bound that dealing and
first fit could not reach."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer_cli.pack.bounds import groups_lower_bound
from balancer_cli.pack.packers import _patterns
from balancer_cli.pack.packers._patterns import pattern_groups
from balancer_cli.pack.packers.balanced import MAX_STEP_EXCESS, pack_balanced
from balancer_cli.pack.types import check_packing, group_sums


@st.composite
def _inputs(draw):
    n = draw(st.integers(1, 120))
    sizes = draw(st.lists(st.integers(1, 9), min_size=1, max_size=5, unique=True))
    share = draw(st.floats(0.0, 1.0))  # rows without the module
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    tiles = np.where(rng.random(n) < share, 0, rng.choice(sizes, n))
    llm = 256 * tiles + rng.integers(1, 900, n)
    cap = draw(st.integers(max(sizes), 30))
    caps = np.array([cap, int(max(llm.max(), draw(st.integers(1000, 12000)))), draw(st.integers(2, 12))])
    load = np.stack([tiles, llm, np.ones(n, np.int64)], 1).astype(np.int64)
    rows = np.sort(rng.choice(n, draw(st.integers(1, n)), replace=False))
    return rows, load, caps, draw(st.integers(0, 3))


@settings(max_examples=150, deadline=None)
@given(_inputs())
def test_every_row_placed_once_and_every_group_within_the_caps(case):
    rows, load, caps, seed = case
    got = pattern_groups(rows, load, caps, 0, rng=np.random.default_rng(seed), max_items=int(caps[2]))
    if got is None:  # no row with the module, or the LP's groups all round down to none: a basic
        # solution has at most one pattern per size, each under one group, so under that many caps
        sizes = np.unique(load[rows, 0])
        assert (sizes == 0).all() or load[rows, 0].sum() < (sizes > 0).sum() * caps[0]
        return
    queue, gid = got
    assert sorted(queue.tolist()) == rows.tolist()  # each row exactly once
    G = int(gid.max()) + 1
    assert np.array_equal(np.unique(gid), np.arange(G))  # no empty group
    sums = np.zeros((G, load.shape[1]), np.int64)
    np.add.at(sums, gid, load[queue])
    assert (sums <= caps).all()
    again = pattern_groups(rows, load, caps, 0, rng=np.random.default_rng(seed), max_items=int(caps[2]))
    assert np.array_equal(again[0], queue) and np.array_equal(again[1], gid)  # the seed decides


def _brute_force_maximal(sizes, cap, max_items):
    found = set()
    for combo in itertools.product(*[range(cap // s + 1) for s in sizes]):
        total, items = sum(c * s for c, s in zip(combo, sizes)), sum(combo)
        if 0 < items <= max_items and total <= cap and (cap - total < min(sizes) or items == max_items):
            found.add(combo)
    return found


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=4, unique=True), st.integers(1, 24), st.integers(1, 8))
def test_maximal_patterns_are_all_the_maximal_multisets(sizes, cap, max_items):
    sizes = sorted(s for s in sizes if s <= cap) or [cap]
    got = _patterns._maximal_patterns(np.array(sizes), cap, max_items)
    assert set(map(tuple, got.T.tolist())) == _brute_force_maximal(sizes, cap, max_items)


def _fixed_tile_sources(n, seed):
    """Tiles of a few fixed sizes (2 and 5-9: images of fixed shapes per source), a text-only
    source, LLM tokens far from their cap: the tiles bind, as in the ``harsh`` case 645."""
    rng = np.random.default_rng(seed)
    tiles = rng.choice([0, 0, 2, 5, 6, 7, 8, 9], n)
    llm = 256 * tiles + rng.integers(8, 600, n)
    return np.stack([tiles, llm], 1).astype(np.int64)


def test_a_binding_module_of_few_sizes_reaches_its_bound():
    load = _fixed_tile_sources(20_000, 0)
    caps = np.array([18, 16_000])
    lb = groups_lower_bound(load, caps)
    p = pack_balanced(load, caps, seed=0, group_multiple=32, source_N=np.arange(20_000) % 3)
    check_packing(p, len(load), load, caps)
    assert p.num_groups <= MAX_STEP_EXCESS * lb
    assert (group_sums(p, load)[:, 0] <= 18).all()
    # first fit decreasing alone, on the same rows, needs more groups than the limit
    from balancer_cli.pack.packers._fill_kernels import first_fit
    from balancer_cli.pack.packers._table_kernels import suffix_min

    order = np.lexsort((np.arange(len(load)), -(load / caps).sum(axis=1)))
    _, ffd = first_fit(order, load, caps, suffix_min(order, load), 64, np.zeros((0, 2), np.int64))
    assert ffd > MAX_STEP_EXCESS * lb


def test_python_kernels_give_the_same_groups(monkeypatch):
    """Without numba the kernels run as Python: the same groups, row for row."""
    from balancer_cli._jit import HAVE_NUMBA

    if not HAVE_NUMBA:
        import pytest

        pytest.skip("numba absent: the kernels already run as Python")
    load = np.column_stack([_fixed_tile_sources(600, 1), np.ones(600, np.int64)])
    caps = np.array([18, 3000, 9])
    fast = pattern_groups(np.arange(600), load, caps, 0, rng=np.random.default_rng(2), max_items=9)
    assert fast is not None
    for name in ("_fill_slots", "_fill_lightest", "_send_back", "_tree", "_replay", "first_fit", "suffix_min"):
        monkeypatch.setattr(_patterns, name, getattr(_patterns, name).py_func)
    from balancer_cli.pack.packers import _fill_kernels

    monkeypatch.setattr(_fill_kernels, "row_shares", _fill_kernels.row_shares.py_func)  # first_fit_orders' sizes
    slow = pattern_groups(np.arange(600), load, caps, 0, rng=np.random.default_rng(2), max_items=9)
    assert np.array_equal(fast[0], slow[0]) and np.array_equal(fast[1], slow[1])


def test_a_huge_cap_costs_neither_memory_nor_time():
    """The sizes are counted up to the largest load, not the cap, and the patterns' enumeration
    stops at MAX_PATTERNS whatever the cap (a cap of 10^12 tiles once meant a 10^12-slot count)."""
    assert _patterns._maximal_patterns(np.array([1, 2]), 10**12, 10**7) is None
    load = np.stack([np.arange(300) % 3 + 1, np.full(300, 50), np.ones(300)], 1).astype(np.int64)
    got = pattern_groups(np.arange(300), load, np.array([10**12, 10**12, 40]), 0, rng=np.random.default_rng(0),
                         max_items=40)  # the last column counts rows, as the packer's own
    assert got is not None and sorted(got[0].tolist()) == list(range(300))
    assert np.bincount(got[1]).max() <= 40


def test_loads_near_int32s_top_are_counted_without_a_table_as_long_as_the_largest():
    """Binding loads past ``_COUNT_TABLE_MAX`` (a lengths table holds up to int32's top) are counted
    by a sort: the same groups as the same sizes scaled down (no 8 GB table for loads of 1e9; the
    CLI took 85 s on 50 samples of a billion tokens)."""
    from balancer_cli.pack.packers._patterns import _COUNT_TABLE_MAX

    tiles = np.array([9, 9, 6, 6, 6, 8, 8, 2, 5, 5, 8])
    scale = 100_000_000
    assert tiles.max() * scale > _COUNT_TABLE_MAX
    load = np.stack([tiles, 100 * tiles, np.ones(11, np.int64)], 1)
    small = pattern_groups(np.arange(11), load, np.array([18, 5000, 8]), 0, rng=np.random.default_rng(0))
    load[:, 0] *= scale
    large = pattern_groups(np.arange(11), load, np.array([18 * scale, 5000, 8]), 0, rng=np.random.default_rng(0))
    assert small is not None and large is not None
    assert small[0].tolist() == large[0].tolist() and small[1].tolist() == large[1].tolist()
