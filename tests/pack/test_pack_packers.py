"""Property and edge-case tests for the packers (ISF and ours): conservation, caps, determinism."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer_cli.errors import InputError, UsageError
from balancer_cli.pack.bounds import groups_lower_bound
from balancer_cli.pack.packers.balanced import (
    BalancedOptions,
    deal_balanced,
    pack_balanced,
)
from balancer_cli.pack.packers.isf import pack_isf
from balancer_cli.pack.types import check_packing, group_sums

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def loads(draw, max_n=120):
    """(load_NK, caps_K): K in 1..3, some samples possibly over a cap."""
    n = draw(st.integers(1, max_n))
    k = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    load = np.stack([rng.integers(0, draw(st.integers(1, 20)), n) for _ in range(k)], axis=1)
    load[:, -1] += 1  # every sample has some LLM tokens
    caps = np.array([draw(st.integers(1, 40)) for _ in range(k)])
    return load.astype(np.int64), caps


def _pack(name, load, caps, **kw):
    if name == "isf":
        bounds = np.maximum(caps - 1, 0)
        return pack_isf(load, caps, bounds, iterations=5, **kw)
    if name == "balanced-mix":  # per-source counts join the objective (3 sources, seeded)
        source = np.random.default_rng(len(load)).integers(0, 3, len(load))
        return pack_balanced(load, caps, source_N=source, options=BalancedOptions(passes=2, max_sources=2), **kw)
    return pack_balanced(load, caps, options=BalancedOptions(passes=2), **kw)


@pytest.mark.parametrize("name", ["isf", "balanced", "balanced-mix"])
@SETTINGS
@given(data=loads(), oversize=st.sampled_from(["isolate", "drop"]), seed=st.integers(0, 3))
def test_conservation_caps_determinism(name, data, oversize, seed):
    load, caps = data
    ids = np.arange(len(load)) * 3 + 7  # rows map to arbitrary sample ids
    p = _pack(name, load, caps, oversize=oversize, seed=seed, sample_ids=ids)
    # Map back to row indices for the invariant check.
    row_of = {int(s): r for r, s in enumerate(ids)}
    rows = type(p)(np.array([row_of[int(s)] for s in p.order], np.int64), p.group_offsets, p.isolated,
                   np.array([row_of[int(s)] for s in p.dropped], np.int64), p.dropped_reason)
    check_packing(rows, len(load), load, caps)
    over = (load > caps).any(axis=1)
    if oversize == "drop":
        assert set(rows.dropped.tolist()) == set(np.flatnonzero(over).tolist())
        assert all(r.startswith("oversize: ") and "> cap" in r for r in p.dropped_reason)
    else:
        assert len(p.dropped) == 0 and int(p.isolated.sum()) == int(over.sum())
    again = _pack(name, load, caps, oversize=oversize, seed=seed, sample_ids=ids)
    assert np.array_equal(p.order, again.order) and np.array_equal(p.group_offsets, again.group_offsets)
    assert np.array_equal(p.isolated, again.isolated) and np.array_equal(p.dropped, again.dropped)


@SETTINGS
@given(data=loads(), multiple=st.integers(1, 8))
def test_balanced_group_multiple(data, multiple):
    load, caps = data
    fit = int((~(load > caps).any(axis=1)).sum())
    p = pack_balanced(load, caps, group_multiple=multiple, options=BalancedOptions(passes=1))
    packed = p.num_groups - int(p.isolated.sum())
    if fit:
        # A multiple (isolated groups included) unless that needs more groups than samples.
        assert p.num_groups % multiple == 0 or packed == fit
        assert packed >= groups_lower_bound(load[~(load > caps).any(axis=1)], caps)


@pytest.mark.parametrize("name", ["isf", "balanced"])
@SETTINGS
@given(data=loads(), seed=st.integers(0, 3))
def test_lower_bound_counts_an_isolated_sample_as_one_group(name, data, seed):
    """Every packing that isolates its oversize samples has at least the bound's groups, and the
    bound is the fitting samples' bound plus one group each for the others (not their load: a
    3x-cap sample counted three, and steps came out below 1.0x their bound)."""
    load, caps = data
    over = (load > caps).any(axis=1)
    bound = groups_lower_bound(load, caps)
    assert _pack(name, load, caps, seed=seed).num_groups >= bound
    fit = load[~over]
    assert bound == int(over.sum()) + (groups_lower_bound(fit, caps) if len(fit) else 0)
    assert groups_lower_bound(np.array([[10_991]] + [[100]] * 40), np.array([3763])) == 1 + 2


@SETTINGS
@given(data=loads(), seed=st.integers(0, 3), multiple=st.integers(1, 4), passes=st.integers(0, 3),
       sources=st.integers(0, 3))
def test_dealt_groups_finish_as_pack_balanced_does_any_number_of_times(data, seed, multiple, passes, sources):
    """deal_balanced(...).finish(...) is pack_balanced(...) byte for byte, and finishing leaves the
    dealt groups as they were (the search refines the groups it dealt for pruning)."""
    load, caps = data
    source = np.random.default_rng(seed).integers(0, sources, len(load)) if sources else None
    options = BalancedOptions(passes=passes, max_sources=2)
    kw = {"seed": seed, "group_multiple": multiple, "cost_NK": load * 1.5 + 1}
    want = pack_balanced(load, caps, source_N=source, options=options, **kw)
    dealt = deal_balanced(load, caps, **kw)
    before = [t.copy() for t in dealt.tables or ()]
    for _ in range(2):
        got = dealt.finish(source_N=source, options=options)
        for field in ("order", "group_offsets", "isolated", "dropped"):
            assert np.array_equal(getattr(got, field), getattr(want, field))
        assert all(np.array_equal(a, b) for a, b in zip(before, dealt.tables or ()))
    assert dealt.nbytes >= sum(t.nbytes for t in before)


@pytest.mark.parametrize("name", ["isf", "balanced"])
def test_empty_input_is_an_error(name):
    with pytest.raises(InputError, match="no samples"):
        _pack(name, np.zeros((0, 2), np.int64), np.array([9, 4096]))


@pytest.mark.parametrize("name", ["isf", "balanced"])
def test_cap_smaller_than_every_sample(name):
    load = np.array([[5, 100], [6, 200], [7, 300]])
    caps = np.array([4, 4096])
    p = _pack(name, load, caps, oversize="isolate")
    assert p.num_groups == 3 and p.isolated.all()
    p = _pack(name, load, caps, oversize="drop", module_names=("vision", "llm"))
    assert p.num_groups == 0 and p.dropped.tolist() == [0, 1, 2]
    assert p.dropped_reason[0] == "oversize: vision 5 > cap 4"
    with pytest.raises(InputError, match=r"sample 0 has vision load 5 > cap 4.*fix: raise the cap"):
        _pack(name, load, caps, oversize="error", module_names=("vision", "llm"))


def test_bad_arguments():
    load = np.array([[1, 10]])
    with pytest.raises(UsageError, match="caps"):
        pack_balanced(load, np.array([1]))
    with pytest.raises(UsageError, match="oversize"):
        pack_balanced(load, np.array([2, 20]), oversize="keep")
    with pytest.raises(UsageError, match="bounds"):
        pack_isf(load, np.array([2, 20]), np.array([3, 20]))
    with pytest.raises(UsageError, match="iterations"):
        pack_isf(load, np.array([2, 20]), np.array([2, 20]), iterations=0)
    with pytest.raises(InputError, match="negative"):
        pack_balanced(np.array([[1, -1]]), np.array([2, 20]))


def _reference_isf(token_lengths, vit_max, llm_max, vit_min, llm_min, seed, iter_time):
    """A plain transcription of the published algorithm (list based) for small hand cases,
    without its two defects (oversize samples never occur here; the last group is kept)."""

    def one_round(items, s):
        rng = np.random.RandomState(s)
        index = list(range(len(items)))
        rng.shuffle(index)
        groups, cur, v_sum, t_sum = [], [], 0, 0
        for sid in index:
            v, t = items[sid][1], items[sid][2]
            v_sum += v
            t_sum += t
            if v_sum > vit_max or t_sum > llm_max:
                groups.append(cur)
                cur, v_sum, t_sum = [items[sid]], v, t
            else:
                cur.append(items[sid])
        if cur:
            groups.append(cur)
        return groups

    groups = one_round(token_lengths, seed)
    out = []
    for i in range(iter_time - 1):
        rest = []
        for g in groups:
            if sum(x[1] for x in g) == vit_min or sum(x[2] for x in g) >= llm_min:
                out.append(g)
            else:
                rest.extend(g)
        groups = one_round(rest, seed + i)
    out.extend(groups)
    return [[x[0] for x in g] for g in out]


@pytest.mark.parametrize("seed", [0, 1, 1024])
def test_isf_matches_the_published_algorithm(seed):
    rng = np.random.default_rng(seed)
    n = 60
    vit = rng.choice([1, 3, 4, 5], n)
    tok = 256 * vit + rng.integers(20, 300, n)
    ref = _reference_isf([[i, int(vit[i]), int(tok[i])] for i in range(n)], 9, 4096, 9, 2600, seed, 6)
    p = pack_isf(np.stack([vit, tok], 1), np.array([9, 4096]), np.array([9, 2600]), iterations=6, seed=seed)
    assert [g.tolist() for g in p.groups()] == ref


def test_isf_hand_case_accepts_on_either_bound():
    # caps 9 items / 1000 tokens; bounds 9 items or >= 900 tokens.
    load = np.array([[5, 100], [4, 100], [1, 950], [2, 50], [2, 50]])
    p = pack_isf(load, np.array([9, 1000]), np.array([9, 900]), iterations=50, seed=0)
    groups = sorted(sorted(g.tolist()) for g in p.groups())
    sums = group_sums(p, load)
    assert [0, 1] in groups  # 5 + 4 = 9 items: accepted on the vision bound
    assert any(s[1] >= 900 for s in sums)  # the 950-token sample forms an accepted group
    check_packing(p, 5, load, np.array([9, 1000]))


def test_isf_keeps_the_trailing_group():
    load = np.array([[1, 10]] * 7)
    p = pack_isf(load, np.array([3, 100]), np.array([3, 100]), iterations=1, seed=0)
    assert p.group_sizes().tolist() == [3, 3, 1]


def test_balanced_groups_are_nearly_identical():
    rng = np.random.default_rng(0)
    items = rng.integers(0, 6, 3000)
    tokens = 256 * items + rng.integers(20, 400, 3000)
    load = np.stack([items, tokens], 1)
    p = pack_balanced(load, np.array([24, 8192]), group_multiple=8, seed=0)
    sums = group_sums(p, load)
    assert p.num_groups % 8 == 0
    assert p.num_groups <= 1.05 * groups_lower_bound(load, np.array([24, 8192])) + 8
    assert sums[:, 1].std() / sums[:, 1].mean() < 0.01
    assert np.ptp(sums[:, 0]) <= 2


def test_balanced_uses_costs_when_given():
    rng = np.random.default_rng(1)
    load = np.stack([rng.integers(1, 4, 400), rng.integers(50, 500, 400)], 1)
    cost = load * np.array([[1000.0, 1.0]])  # vision items weigh 1000 each
    p = pack_balanced(load, np.array([12, 4096]), cost_NK=cost, seed=0)
    check_packing(p, 400, load, np.array([12, 4096]))
    assert group_sums(p, cost)[:, 0].std() / group_sums(p, cost)[:, 0].mean() < 0.1


def test_kernels_pure_python_fallback_gives_identical_packings(monkeypatch):
    """numba is an accelerator only: the same kernels run as plain Python give the same groups."""
    from balancer_cli._jit import HAVE_NUMBA
    from balancer_cli.pack.packers import (
        _balanced_refine,
        _fill_kernels,
        _refine_kernels,
        balanced,
        baselines,
        isf,
    )

    if not HAVE_NUMBA:
        pytest.skip("numba absent: the pure-Python kernels are what every other test runs")
    monkeypatch.setattr(_balanced_refine, "BLOCK_GROUPS", 8)  # renumbered groups, passes in blocks
    monkeypatch.setattr(_balanced_refine, "BLOCKS_FROM", 16)
    rng = np.random.default_rng(5)
    load = np.stack([rng.integers(0, 6, 300), rng.integers(20, 900, 300)], 1)
    caps = np.array([12, 3000])
    source = rng.integers(0, 3, 300)  # source terms and the class-mix swaps run too
    fast = (pack_balanced(load, caps, group_multiple=4, seed=1, source_N=source),
            pack_isf(load, caps, np.array([12, 2900]), iterations=4), baselines.pack_llm_ffd(load, caps, seed=1))
    import balancer_cli._sort as sort
    from balancer_cli.pack.packers import _class_mix, _table_kernels

    # The pure-Python deal calls the compiled stable_argsort: compile it before its callee is
    # patched (a kernel loaded from numba's cache may not have compiled it in this process).
    sort.stable_argsort(np.array([1.0, 0.0]))

    for user, kernels, names in ((balanced, _fill_kernels, ("deal_rounds", "first_fit", "row_shares")),
                                 (_class_mix, _class_mix, ("_swap_pairs",)),
                                 (sort, sort, ("fix_cut_ties",)),
                                 (balanced, _table_kernels, ("group_tables", "load_sums", "suffix_min")),
                                 (_balanced_refine, _table_kernels, ("compact_rows", "expand_rows", "grid_cells")),
                                 (baselines, _fill_kernels, ("first_fit_tree",)),
                                 (_balanced_refine, _refine_kernels, ("refine_pass", "targeted_pass")),
                                 (isf, _fill_kernels, ("greedy_close",))):
        for name in names:
            monkeypatch.setattr(user, name, getattr(kernels, name).py_func)
    slow = (pack_balanced(load, caps, group_multiple=4, seed=1, source_N=source),
            pack_isf(load, caps, np.array([12, 2900]), iterations=4), baselines.pack_llm_ffd(load, caps, seed=1))
    for a, b in zip(fast, slow):
        assert np.array_equal(a.order, b.order) and np.array_equal(a.group_offsets, b.group_offsets)


def test_stranded_rows_join_extra_groups_and_every_row_is_placed_once():
    """Tight item caps strand the last dealt rows; they go to extra first-fit groups, every row is
    placed exactly once, caps hold and the group count stays within 1.03x the lower bound."""
    from balancer_cli.pack.packers._fill_kernels import deal_rounds

    rng = np.random.default_rng(3)
    n = 3000
    items = rng.choice([1, 3, 4, 5], n, p=[0.05, 0.45, 0.3, 0.2])  # few small fillers
    load = np.stack([items, 256 * items + rng.integers(20, 400, n)], 1)
    caps = np.array([18, 8000])
    G = int(-(-items.sum() // 18))
    queue = np.argsort(-items, kind="stable")
    gid = deal_rounds(queue, np.column_stack([load, np.ones(n, np.int64)]), load.astype(float),
                      np.append(caps, 40), G, 1.0 / (load.sum(0) / G), 64)
    assert (gid < 0).any(), "this case must strand rows (else it tests nothing)"
    p = pack_balanced(load, caps, group_multiple=8, seed=0)
    check_packing(p, n, load, caps)
    assert np.array_equal(np.sort(p.order), np.arange(n))
    assert p.num_groups % 8 == 0 and p.num_groups <= -(-int(np.ceil(1.03 * G)) // 8) * 8


def test_sources_even_out_per_group_source_mix():
    """Item counts that correlate with sources: with source_N each group holds a similar mix,
    and item balance is kept."""
    rng = np.random.default_rng(0)
    n = 4000
    source = rng.integers(0, 2, n)  # source 0: 1-3 tiles, source 1: 2-5 tiles
    items = np.where(source == 0, rng.integers(1, 4, n), rng.integers(2, 6, n))
    tokens = 256 * items + rng.integers(20, 600, n)
    load = np.stack([items, tokens], 1)
    caps = np.array([18, 6000])

    def share_spread(p):
        gid = p.group_ids()
        share = np.bincount(gid, source[p.order] == 0) / np.bincount(gid)
        return share.std(), group_sums(p, load)

    plain, sums_plain = share_spread(pack_balanced(load, caps, cost_NK=load, group_multiple=8, seed=0))
    mixed, sums_mixed = share_spread(pack_balanced(load, caps, cost_NK=load, group_multiple=8, seed=0, source_N=source))
    assert mixed < 0.8 * plain
    assert np.ptp(sums_mixed[:, 0]) <= np.ptp(sums_plain[:, 0]) + 1
    with pytest.raises(UsageError):
        pack_balanced(load, caps, source_N=source[:-1])


def test_lower_bound_counts_items_that_long_texts_waste():
    """Tokens = 256 per item + text: a 4000-token text leaves room for 9 of 18 items."""
    load = np.array([[0, 4000]] * 4 + [[6, 1536 + 10]] * 12)  # 72 items = 4 groups by the item sum
    caps = np.array([18, 6400])
    assert int(np.ceil(72 / 18)) == 4
    # a = 1546 / 6 tokens per item: each long text wastes (4000 - (6400 - 18 a)) / a = 8.7 items -> 6
    assert groups_lower_bound(load, caps) == 6
    p = pack_balanced(load, caps)
    assert p.num_groups >= groups_lower_bound(load, caps)


@given(n=st.integers(1, 300), seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([np.int16, np.int32, np.int64]),
       masked=st.booleans(), tiles=st.booleans())
@settings(max_examples=60, deadline=None)
def test_the_two_module_bound_is_the_general_bound(n, seed, dtype, masked, tiles):
    """The two-column kernel gives :func:`_bound_kernel`'s bound: rows over a cap, over half a cap,
    without items, items of LLM tokens per tile, subsets of the rows and every integer type."""
    from balancer_cli.pack.bounds import _bound_kernel, _two_module_bound

    rng = np.random.default_rng(seed)
    items = rng.integers(0, 4 if tiles else int(rng.integers(1, 40)), n)
    llm = (256 * items if tiles else 0) + rng.integers(0, int(rng.integers(1, 5000)), n)
    load = np.stack([items, llm], 1).astype(dtype)
    caps = np.array([int(rng.integers(1, 30)), int(rng.integers(1, 6000))])
    mask = rng.random(n) < 0.7 if masked else np.zeros(0, np.bool_)
    assert _two_module_bound(load, caps, mask) == _bound_kernel(load, caps, mask)


def test_balanced_options_are_validated():
    assert BalancedOptions().passes is None and BalancedOptions(passes=0, max_sources=1).max_sources == 1
    for bad in (dict(passes=-1), dict(passes=1.5), dict(passes=True), dict(max_sources=0)):
        with pytest.raises(UsageError, match="must be an integer"):
            BalancedOptions(**bad)


def test_oversize_error_names_parameters_the_cli_spells_as_flags():
    load = np.array([[5, 100]])
    with pytest.raises(InputError) as info:
        pack_balanced(load, np.array([4, 4096]), oversize="error", module_names=("vision", "llm"))
    assert "raise the cap (caps[vision]), or pass oversize isolate" in str(info.value)
    flags = {"caps[vision]": "--max-vision-items", "oversize": "--oversize"}
    assert "raise the cap (--max-vision-items), or pass --oversize isolate (own group) or --oversize drop" in (
        info.value.for_flags(flags))


def test_a_probed_fill_share_that_fails_in_full_deals_the_later_shares(monkeypatch):
    """Above the probe size the subsample picks the first share; if it needs too many groups on the
    full data (near the limit), the later shares are dealt before first fit's unmixed groups."""
    import balancer_cli.pack.packers.balanced as balanced

    rng = np.random.default_rng(3)
    tiles = np.where(rng.random(4000) < 0.3, 0, rng.integers(1, 14, 4000))
    load = np.stack([tiles, np.clip(rng.lognormal(5.5, 0.8, 4000), 8, 6000).astype(np.int64) + 256 * tiles], 1)
    caps = np.array([23, 6001])  # share 0.15 deals 1101 groups (limit 1079), share 0.5 1079
    unprobed = pack_balanced(load, caps, group_multiple=4, seed=0)
    shares = []
    deal = balanced._deal
    monkeypatch.setattr(balanced, "_deal", lambda *a: shares.append(a[-1]) or deal(*a))
    monkeypatch.setattr(balanced, "_PROBE_ABOVE", 0)
    monkeypatch.setattr(balanced, "_probe_fill_share", lambda *a: balanced._FILL_SHARES[0])  # the probe passed
    probed = pack_balanced(load, caps, group_multiple=4, seed=0)
    assert shares == [0.15, 0.5]
    assert np.array_equal(probed.order, unprobed.order) and np.array_equal(probed.group_offsets, unprobed.group_offsets)


@pytest.mark.parametrize("first_fits", [True, False])
def test_the_probe_deals_the_shares_before_the_last_only(monkeypatch, first_fits):
    """The probe's answer is the last share whether that share's deal fits or not: it deals the
    shares before it, stopping at the first that fits, and never the last."""
    from balancer_cli.pack.packers import balanced

    rng = np.random.default_rng(5)
    load = np.stack([rng.integers(0, 14, 3000), rng.integers(8, 4000, 3000)], 1)
    load_c = np.column_stack([load, np.ones(len(load), np.int64)])
    caps_c = np.array([23, 6001, 40])
    dealt = []
    deal = balanced._deal

    def counted(rows, load, weight, caps, G, rng, share):
        dealt.append(share)
        queue, gid = deal(rows, load, weight, caps, G, rng, share)
        return queue, np.zeros_like(gid) if first_fits else gid + 10 * G  # one group (fits), or far too many

    monkeypatch.setattr(balanced, "_deal", counted)
    monkeypatch.setattr(balanced, "_PROBE_SIZE", 1000)
    share = balanced._probe_fill_share(np.arange(3000), load_c, load_c[:, :2].astype(float), caps_c, 0)
    assert dealt == list(balanced._FILL_SHARES[:1 if first_fits else -1])
    assert share == balanced._FILL_SHARES[0 if first_fits else -1]


@pytest.mark.parametrize("seed", range(4))
def test_first_fit_keeps_the_binding_caps_order_where_the_first_is_over_the_bound_or_it_saves_1pct(monkeypatch, seed):
    """Where dealing needs too many groups, first fit decreasing runs in the order of the rows'
    summed cap shares and in that of the binding cap's share (the LLM's here, which packs ~1%
    tighter): the packing keeps the second only where the first is over 1.03x the bound or the
    second has 1% fewer groups (it clusters sources more), every sample once."""
    from balancer_cli.pack.packers import balanced
    from balancer_cli.pack.packers._fill_kernels import first_fit
    from balancer_cli.pack.packers._table_kernels import suffix_min
    from balancer_cli.pack.types import check_packing

    rng = np.random.default_rng(seed)
    n = 3000
    tiles = np.where(rng.random(n) < 0.8, rng.integers(4, 13, n), 0)
    clips = np.where(rng.random(n) < 0.2, rng.integers(1, 4, n), 0)
    load = np.stack([tiles, clips, np.clip(rng.lognormal(7.7, 0.4, n), 300, 4100).astype(np.int64)], 1)
    caps = np.array([46, 4, 11538])
    deal, by_size, seen = balanced._deal, balanced.first_fit_orders, []
    # Dealing "needs" one group per row: past the limit, so first fit decides.
    monkeypatch.setattr(balanced, "_deal", lambda rows, *a: (deal(rows, *a)[0], np.arange(len(rows))))

    def recorded(rows, load_c, caps_c, rng, binding=None):
        if binding is not None:  # first fit alone (dealing's stranded rows take the size order only)
            seen.append((rows, load_c, caps_c, dict(rng.bit_generator.state), binding))
        return by_size(rows, load_c, caps_c, rng, binding)

    monkeypatch.setattr(balanced, "first_fit_orders", recorded)
    p = balanced.pack_balanced(load, caps, seed=seed, options=balanced.BalancedOptions(passes=0))
    check_packing(p, num_samples=n)
    assert (group_sums(p, load) <= caps).all()
    (rows, load_c, caps_c, state, binding), = seen
    assert binding == 2  # the LLM's total needs the most groups
    rng, fits = np.random.default_rng(), []
    rng.bit_generator.state = state
    for order in by_size(rows, load_c, caps_c, rng, binding):
        fits.append(first_fit(order, load_c, caps_c, suffix_min(order, load_c), balanced.LOOKBACK,
                              np.zeros((0, load_c.shape[1]), np.int64))[1])
    limit = int(np.ceil(balanced.groups_lower_bound(load, caps) * balanced.MAX_STEP_EXCESS))
    kept = fits[1] if fits[0] > limit or fits[1] < 0.99 * fits[0] else fits[0]
    assert p.num_groups == kept and fits[1] < fits[0], (fits, limit)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 400), groups=st.integers(2, 40), sources=st.integers(1, 5),
       tiles=st.integers(1, 6))
def test_class_mix_swaps_keep_rows_encoder_sums_and_caps_and_even_the_classes(seed, n, groups, sources, tiles):
    """Swaps only exchange rows of equal encoder loads between groups: every row stays placed once,
    every group keeps its encoder sums and its LLM cap, and no class's source excess grows."""
    from balancer_cli.pack.packers._class_mix import _classes, even_class_mix

    rng = np.random.default_rng(seed)
    groups = min(groups, n)
    items = rng.integers(0, tiles + 1, n)
    load = np.stack([items, 100 * items + rng.choice([10, 20, 30], n)], 1).astype(np.int64)
    source = rng.integers(0, sources, n)
    order = rng.permutation(n)
    offsets = np.concatenate([[0], np.sort(rng.choice(np.arange(1, n), groups - 1, replace=False)), [n]])
    caps = np.array([10**6, int(np.add.reduceat(load[order, 1], offsets[:-1]).max())])

    def state(o):
        sums = np.add.reduceat(load[o], offsets[:-1], axis=0)
        cls = _classes(sums[:, :1].astype(float))
        share = np.bincount(source, minlength=sources) / n
        gid = np.repeat(np.arange(groups), np.diff(offsets))
        counts = np.zeros((cls.max() + 1, sources))
        np.add.at(counts, (cls[gid], source[o]), 1)
        return sums, np.abs(counts - counts.sum(1, keepdims=True) * share).sum()

    before, excess = state(order)
    swapped = order.copy()
    made = even_class_mix(swapped, offsets, load.astype(float), load, caps, source, tolerance=1.0)
    after, excess_after = state(swapped)
    assert np.array_equal(np.sort(swapped), np.arange(n))
    assert np.array_equal(after[:, 0], before[:, 0]) and (after[:, 1] <= caps[1]).all()
    assert excess_after <= excess + 1e-9 and (made == 0) == np.array_equal(swapped, order)
    again = order.copy()
    even_class_mix(again, offsets, load.astype(float), load, caps, source, tolerance=1.0)
    assert np.array_equal(again, swapped)


@pytest.mark.parametrize("seed", [0, 3])
def test_block_partner_passes_give_the_same_groups_on_one_or_two_threads(monkeypatch, seed):
    """From BLOCKS_FROM groups a random-partner pass runs in blocks that share no group:
    one thread or two give byte-identical groups, every row is placed once, caps hold, and the
    passes still even the groups out."""
    from balancer_cli.pack.packers import _balanced_refine, balanced

    monkeypatch.setattr(_balanced_refine, "BLOCK_GROUPS", 64)
    monkeypatch.setattr(_balanced_refine, "BLOCKS_FROM", 128)
    rng = np.random.default_rng(seed)
    n = 4000
    load = np.stack([rng.integers(0, 6, n), rng.integers(20, 900, n)], 1)
    caps = np.array([12, 3000])
    source = rng.integers(0, 4, n)
    refine = _balanced_refine.refine
    runs = []
    for threads in (1, 2):
        monkeypatch.setattr(balanced, "refine", lambda *a, _t=threads, **k: refine(*a, **k, threads=_t))
        runs.append(pack_balanced(load, caps, group_multiple=4, seed=seed, source_N=source,
                                  options=BalancedOptions(passes=3)))
    one, two = runs
    assert one.num_groups >= 3 * 64  # blocks, and shifted blocks that differ from them
    assert np.array_equal(one.order, two.order) and np.array_equal(one.group_offsets, two.group_offsets)
    check_packing(two, n, load, caps)
    assert np.array_equal(np.sort(two.order), np.arange(n))
    unrefined = pack_balanced(load, caps, group_multiple=4, seed=seed, source_N=source,
                              options=BalancedOptions(passes=0, class_mix=False))
    cv = [group_sums(p, load)[:, 1].std() / group_sums(p, load)[:, 1].mean() for p in (unrefined, two)]
    assert cv[1] < 0.5 * cv[0]


@pytest.mark.parametrize("seed", [0, 5])
def test_large_inputs_stop_refining_after_two_passes_once_groups_are_settled(monkeypatch, seed):
    """Above ``_SETTLE_ABOVE`` rows the refinement stops after its second pass when every dense
    module's group sums vary by at most ``_SETTLED_CV`` (exactly the two-pass packing), and runs
    its passes on while they vary more; either way every row is placed once within the caps."""
    from balancer_cli.pack.packers import _balanced_refine, balanced

    rng = np.random.default_rng(seed)
    n = 3000
    load = np.stack([rng.integers(0, 6, n), rng.integers(20, 900, n)], 1)
    caps = np.array([12, 3000])
    source = rng.integers(0, 4, n)
    passes_run = []
    partner_pass = _balanced_refine._partner_pass
    monkeypatch.setattr(_balanced_refine, "_partner_pass",
                        lambda *a, **k: passes_run.append(1) or partner_pass(*a, **k))
    monkeypatch.setattr(balanced, "_SETTLE_ABOVE", 0)

    def pack(cv, passes=None):
        passes_run.clear()
        monkeypatch.setattr(balanced, "_SETTLED_CV", cv)
        packing = pack_balanced(load, caps, group_multiple=4, seed=seed, source_N=source,
                                options=BalancedOptions(passes=passes))
        check_packing(packing, n, load, caps)
        return packing, len(passes_run)

    settled, count = pack(1.0)  # 3,000 rows: 8 passes unless settled
    two, _ = pack(1.0, passes=2)
    assert count == 2 and np.array_equal(settled.order, two.order)
    assert np.array_equal(settled.group_offsets, two.group_offsets)
    unsettled, count = pack(1e-9)
    assert count > 2 and not np.array_equal(unsettled.order, two.order)


def _fewest_groups(load_N, cap):
    """The fewest groups of at most ``cap`` that hold ``load_N`` (n <= 10): over subsets, the fewest
    full groups and the most room left in the open one (the classic subset DP)."""
    n = len(load_N)
    best = [(n + 1, 0)] * (1 << n)
    best[0] = (1, cap)
    for mask in range(1 << n):
        groups, room = best[mask]
        for i in range(n):
            if mask >> i & 1:
                continue
            option = (groups, room - load_N[i]) if load_N[i] <= room else (groups + 1, cap - load_N[i])
            if (option[0], -option[1]) < (best[mask | 1 << i][0], -best[mask | 1 << i][1]):
                best[mask | 1 << i] = option
    return best[-1][0]


def _fewest_groups_2d(load_NK, caps_K):
    """The fewest groups under every cap (n <= 7): every partition of the samples, by recursion."""
    best = [len(load_NK)]

    def place(i, sums):
        if len(sums) >= best[0]:
            return
        if i == len(load_NK):
            best[0] = len(sums)
            return
        for g, total in enumerate(sums):
            if all(total + load_NK[i] <= caps_K):
                place(i + 1, sums[:g] + [total + load_NK[i]] + sums[g + 1:])
        place(i + 1, [*sums, load_NK[i].copy()])

    place(0, [])
    return best[0]


@given(n=st.integers(1, 10), seed=st.integers(0, 2**31 - 1), cap=st.integers(1, 30), two=st.booleans())
@settings(max_examples=80, deadline=None)
def test_the_bound_never_exceeds_the_fewest_groups(n, seed, cap, two):
    """The bound (the dual feasible functions' included) is a bound: never more groups than an
    exhaustive search needs, one capped module or two."""
    rng = np.random.default_rng(seed)
    load = rng.integers(1, cap + 1, n)
    if not two:
        assert groups_lower_bound(load[:, None], np.array([cap])) <= _fewest_groups(load.tolist(), cap)
        return
    load_NK = np.stack([load, rng.integers(0, 4 * cap, n)], 1)[:7]
    caps = np.array([cap, 4 * cap])
    assert groups_lower_bound(load_NK, caps) <= _fewest_groups_2d(load_NK, caps)


def test_samples_that_fill_a_cap_badly_count_what_they_leave_unused():
    """Five samples of 5 or 6 tiles never share a group of 24: 100 of them need 25 groups, where the
    tiles' sum (540 / 24) says 23; the same with LLM tokens under a cap just short of five samples."""
    tiles = np.array([5, 6] * 50)
    assert int(np.ceil(tiles.sum() / 24)) == 23
    assert groups_lower_bound(np.stack([tiles, np.full(100, 100)], 1), np.array([24, 8192])) == 25
    assert groups_lower_bound(np.stack([tiles, np.full(100, 100), tiles], 1), np.array([24, 8192, 99])) == 25
    assert groups_lower_bound(np.stack([np.zeros(100, np.int64), 1000 + tiles], 1), np.array([1, 4999])) == 25
