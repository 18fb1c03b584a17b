"""Property and edge-case tests for the assigner, group splitting and the threshold search."""

from __future__ import annotations

from itertools import pairwise
from unittest import mock

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from balancer_cli.errors import InputError, UsageError
from balancer_cli.metrics import dist_ratio, step_loads
from balancer_cli.pack import _search_eval as search_eval
from balancer_cli.pack import search as search_module
from balancer_cli.pack.assign import assign_groups, check_assignment, split_to_multiple
from balancer_cli.pack.packers.balanced import pack_balanced
from balancer_cli.pack.packers.isf import pack_isf
from balancer_cli.pack.search import default_caps, search_thresholds
from balancer_cli.pack.types import Packing, check_packing, group_sums

SETTINGS = settings(max_examples=40, deadline=None)


@SETTINGS
@given(
    R=st.integers(1, 8),
    M=st.integers(1, 3),
    steps=st.integers(1, 12),
    K=st.integers(1, 3),
    sparse=st.booleans(),
    sources=st.integers(0, 4),
    seed=st.integers(0, 5),
)
def test_every_slot_filled_once_and_deterministic(R, M, steps, K, sparse, sources, seed):
    G = R * M * steps
    rng = np.random.default_rng(seed)
    cost = rng.integers(0, 50, (G, K)).astype(float)
    if sparse:
        cost[rng.random(G) < 0.7, 0] = 0.0
    mix = rng.integers(0, 4, (G, sources)) if sources else None
    a = assign_groups(cost, world_size=R, micro_batches=M, seed=seed, mix_GO=mix)
    check_assignment(a, G, R, M)
    assert a.num_steps == steps
    for s in range(steps):  # every rank holds exactly M groups at every step
        assert np.bincount(a.rank[a.step == s], minlength=R).tolist() == [M] * R
    b = assign_groups(cost, world_size=R, micro_batches=M, seed=seed, mix_GO=mix)
    for x, y in zip((a.step, a.rank, a.micro), (b.step, b.rank, b.micro)):
        assert np.array_equal(x, y)


@SETTINGS
@given(R=st.integers(1, 9), blocks=st.integers(1, 12), K=st.integers(1, 3), classes=st.integers(1, 3),
       seed=st.integers(0, 10**6))
def test_kd_blocks_place_every_group_once_and_keep_classes_apart(R, blocks, K, classes, seed):
    from balancer_cli.pack._blocks import kd_blocks

    rng = np.random.default_rng(seed)
    G = R * blocks
    cost = rng.integers(0, 9, (G, K)).astype(float) * rng.choice([1.0, 100.0], K)
    class_G = rng.integers(0, classes, G)
    rows = rng.permutation(G + 5)[:G]  # any row ids
    cost_all = np.zeros((G + 5, K))
    cost_all[rows] = cost
    out = kd_blocks(rows, cost_all, R, class_G)
    assert out.shape == (blocks, R)
    assert sorted(out.ravel().tolist()) == sorted(rows.tolist())
    assert np.array_equal(out, kd_blocks(rows, cost_all, R, class_G))  # deterministic
    # A block mixes classes only across a class boundary: at most classes - 1 such blocks.
    cls = dict(zip(rows.tolist(), class_G.tolist()))
    mixed = sum(len({cls[r] for r in block}) > 1 for block in out.tolist())
    assert mixed <= classes - 1
    if K == 1:  # one module: each class's blocks are runs of the class's sorted costs
        for c in range(classes):
            pure = [b for b in out.tolist() if {cls[r] for r in b} == {c}]
            ranges = sorted((cost_all[b, 0].min(), cost_all[b, 0].max()) for b in pure)
            assert all(hi <= lo for (_, hi), (lo, _) in pairwise(ranges)), (c, ranges)


def test_last_leftovers_form_blocks_of_neighbouring_costs():
    # Groups no cell level gathers (8 tile counts, two LLM populations, 12 of each pair): cut in
    # cost order (tiles, then tokens) nearly every block straddled the LLM gap (Dist 0.085).
    rng = np.random.default_rng(0)
    tiles = rng.integers(12, 20, 96).astype(float)
    llm = np.where(rng.random(96) < 0.5, 7000.0, 5850.0) + rng.normal(0, 100, 96).round()
    cost = np.column_stack([256 * tiles, llm])
    a = assign_groups(cost, world_size=8, micro_batches=1, seed=0)
    dist_K = [dist_ratio(step_loads(a.step, a.rank, cost[:, k], num_steps=a.num_steps, world_size=8)) for k in (0, 1)]
    assert max(dist_K) < 0.05, dist_K


@pytest.mark.parametrize("seed", range(4))
def test_groups_without_a_dense_module_keep_to_blocks_of_their_own(seed):
    # ``speech`` 4007 (21k samples, --dp 64): audio in 91.5% of the groups, so dense (its Dist
    # judged); its 384 groups without audio, six blocks' worth, reached the last cut, which split
    # them over 7 steps with audio groups (each such rank idles the audio phase): audio Dist 0.087.
    rng = np.random.default_rng(seed)
    R, G = 16, 16 * 24
    audio = rng.uniform(500, 3000, G)
    audio[rng.permutation(G)[: 2 * R]] = 0.0  # 2 blocks' worth of groups without it (8%)
    cost = np.column_stack([256.0 * rng.integers(4, 20, G), audio, rng.uniform(4000, 9000, G)])
    a = assign_groups(cost, world_size=R, micro_batches=1, seed=seed)
    held_S = np.zeros((a.num_steps, R), bool)
    held_S[a.step, a.rank] = audio > 0
    assert sorted(held_S.sum(axis=1).tolist())[:3] == [0, 0, R], held_S.sum(axis=1)


def test_few_groups_of_a_sparse_module_run_side_by_side_in_blocks_of_near_equal_load():
    # ``bench/bench_pack_random.py --family sparse`` case 31: 32,225 samples, 1 of 5 sources
    # with audio (265 audio groups of 7,072), 16 ranks x 2 micro-batches. No cell gathers 16
    # audio groups, so the last leftovers' cut decides: it split the audio class at random
    # before sorting each part by audio (blocks spanning 3x loads: audio utilization 0.81, and
    # the comparison of the two cuts, by Dist Ratio over all blocks, did not see it).
    from balancer_cli.pack.config import PackConfig
    from balancer_cli.pack.inputs import prepare_inputs
    from balancer_cli.pack.pipeline import pack_inputs
    from bench.bench_pack_random import FAMILIES

    _, table, R, M, seed = FAMILIES["sparse"](31, None)
    inputs = prepare_inputs(table)
    assert (inputs.num_samples, R, M) == (32_225, 16, 2)
    m = pack_inputs(inputs, PackConfig(world_size=R, micro_batches=M, seed=seed), lengths_fingerprint="").meta["summary"]
    assert m["modules"]["audio"]["sparse"] and m["modules"]["audio"]["utilization"] >= 0.9, m["modules"]["audio"]
    assert m["contract"]["broken"] == []


@pytest.mark.parametrize("audio_source", [False, True])
def test_only_caps_the_longest_samples_raised_are_named(audio_source):
    from balancer_cli.pack.search import tail_raised, typical_caps
    from bench.synthetic import make_synthetic

    d = make_synthetic(20_000, seed=1, audio_share=0.05, audio_source=audio_source)  # 30% text-only, sparse audio
    load = d["load_NK"]
    assert tail_raised(default_caps(load), typical_caps(load), d["modules"]) == {}
    load = load.copy()
    load[:30, -1] = 10_000_000  # 0.15% of the lengths read wrong
    caps = default_caps(load)
    assert caps[-1] == 10_000_000 and caps[:-1].tolist() == default_caps(d["load_NK"])[:-1].tolist()
    assert tail_raised(caps, typical_caps(load), d["modules"]) == {"tail_raised": {"llm": typical_caps(d["load_NK"])[-1]}}


def test_groups_not_a_multiple_or_too_few_are_clear_errors():
    with pytest.raises(InputError, match=r"not a multiple.*fix: pack with group_multiple=8"):
        assign_groups(np.ones((12, 2)), world_size=4, micro_batches=2)
    with pytest.raises(InputError, match=r"3 groups cannot fill one step.*fix: lower world_size"):
        assign_groups(np.ones((3, 2)), world_size=8, micro_batches=1)
    with pytest.raises(UsageError):
        assign_groups(np.ones((4, 2)), world_size=0, micro_batches=1)


def test_sparse_module_is_aligned_to_whole_ranks():
    # 32 audio-bearing groups out of 128, 8 ranks: every step holds 0 or 8 of them.
    rng = np.random.default_rng(0)
    G, R = 128, 8
    cost = np.stack([rng.normal(100, 1, G), np.zeros(G), rng.normal(1000, 5, G)], 1)
    audio = rng.permutation(G)[:32]
    cost[audio, 1] = rng.normal(300, 3, 32)
    a = assign_groups(cost, world_size=R, micro_batches=1, seed=0)
    per_step = np.bincount(a.step[audio], minlength=a.num_steps)
    assert set(per_step.tolist()) <= {0, R}
    load_SR = step_loads(a.step, a.rank, cost[:, 1], num_steps=a.num_steps, world_size=R)
    busy = load_SR.max(axis=1) > 0
    assert dist_ratio(load_SR[busy]) < 0.05


def test_balanced_pipeline_is_balanced_on_every_module():
    rng = np.random.default_rng(3)
    n = 4000
    items = rng.integers(0, 8, n)
    tokens = 256 * items + rng.integers(30, 600, n)
    load = np.stack([items, tokens], 1)
    p = pack_balanced(load, np.array([32, 8192]), group_multiple=8, seed=0)
    a = assign_groups(group_sums(p, load.astype(float)), world_size=8, micro_batches=1)
    gid = p.group_ids()
    for k in range(2):
        load_SR = step_loads(a.step[gid], a.rank[gid], load[p.order, k], num_steps=a.num_steps, world_size=8)
        assert dist_ratio(load_SR) < 0.01


@SETTINGS
@given(n=st.integers(2, 80), multiple=st.integers(1, 6), seed=st.integers(0, 3))
def test_split_to_multiple_keeps_conservation_and_caps(n, multiple, seed):
    rng = np.random.default_rng(seed)
    load = np.stack([rng.integers(0, 4, n), rng.integers(1, 100, n)], 1)
    caps = np.array([6, 250])
    p = pack_isf(load, caps, caps, iterations=3, seed=seed)
    try:
        q = split_to_multiple(p, load[:, 1], multiple)
    except InputError as err:
        assert "multi-sample" in str(err) or "two or more" in str(err)
        return
    assert q.num_groups % multiple == 0
    check_packing(q, n, load, caps)
    # only splits: the same rows in the same order, every old boundary kept, isolated flags kept
    assert np.array_equal(q.order, p.order)
    kept = np.isin(q.group_offsets, p.group_offsets)
    assert set(p.group_offsets.tolist()) <= set(q.group_offsets.tolist())
    assert q.num_groups - p.num_groups == int((~kept).sum()) == (-p.num_groups) % multiple
    assert np.array_equal(q.isolated[kept[:-1]], p.isolated) and not q.isolated[~kept[:-1]].any()


@SETTINGS
@given(values=st.lists(st.integers(-2**40, 2**40), max_size=60),
       dtype=st.sampled_from(["int8", "int32", "int64", "uint16"]), small=st.booleans())
def test_dense_ids_are_numpy_uniques_inverse(values, dtype, small):
    """The lookup-table path (small ranges) and the sort path give ``np.unique``'s inverse."""
    from balancer_cli.pack.types import dense_ids

    info = np.iinfo(dtype)
    span = 50 if small else info.max
    arr = np.array([min(max(v % (span + 1) if small else v, info.min), info.max) for v in values], dtype=dtype)
    assert np.array_equal(dense_ids(arr), np.unique(arr, return_inverse=True)[1].reshape(-1))


@SETTINGS
@given(pool=st.lists(st.one_of(st.floats(-1e300, 1e300), st.just(0.0), st.just(-0.0), st.just(float("nan")),
                               st.just(5e-324), st.just(-5e-324)), min_size=1, max_size=30),
       n=st.sampled_from([1, 10, 5000, 20000, 60000]), seed=st.integers(0, 3), as_int=st.booleans(), descending=st.booleans(),
       near=st.booleans())
def test_stable_order_is_numpys_stable_argsort(pool, n, seed, as_int, descending, near):
    """Ties (runs of every length), keys equal but for their last bits, NaNs, signed zeros and
    subnormals come out in numpy's stable order, ascending and descending."""
    from balancer_cli._sort import stable_order

    values = np.array(pool)[np.random.default_rng(seed).integers(0, len(pool), n)]
    if near:  # keys that share their top bits: the cut words tie, the full keys do not
        values = np.nextafter(values, np.inf) if seed % 2 else values + np.arange(n) * 1e-300
    if as_int:
        values = np.nan_to_num(values, posinf=0, neginf=0).clip(-1e15, 1e15).astype(np.int64)
    got = stable_order(values, descending=descending)
    assert got.dtype == np.int64
    assert np.array_equal(got, np.argsort(-values if descending else values, kind="stable"))


@SETTINGS
@given(n=st.sampled_from([0, 1, 2, 50, 5000, 70000]), span=st.sampled_from([1, 3, 300, 70000, 2**40]),
       low=st.sampled_from([0, 5, -3]), dtype=st.sampled_from([np.int8, np.int32, np.int64, np.uint16, np.uint64]),
       seed=st.integers(0, 3))
def test_int_order_is_numpys_stable_argsort(n, span, low, dtype, seed):
    """Keys of 16 bits (radix), of a range up to 4N (counting) and any other (numpy's): ties in index order."""
    from balancer_cli._sort import int_order

    keys = np.random.default_rng(seed).integers(0, span, n) + low
    info = np.iinfo(dtype)
    keys = np.clip(keys, info.min, info.max).astype(dtype)
    got = int_order(keys)
    assert got.dtype == np.int64 and np.array_equal(got, np.argsort(keys, kind="stable"))


@SETTINGS
@given(G=st.integers(1, 200), multiple=st.integers(1, 40), seed=st.integers(0, 2**31 - 1), ties=st.booleans())
def test_split_to_multiple_splits_the_heaviest_groups_first(G, multiple, seed, ties):
    """The groups split are the first ``need`` of two or more samples in argsort(-weight, stable) order."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 4, G)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    weight = rng.integers(0, 3, offsets[-1]).astype(float) if ties else rng.random(offsets[-1])
    p = Packing(np.arange(offsets[-1]), offsets, np.zeros(G, bool), np.array([], np.int64), ())
    need = (-G) % multiple
    order = np.argsort(-group_sums(p, weight), kind="stable")
    expected = order[sizes[order] >= 2][:need]
    if len(expected) < need:
        with pytest.raises(InputError):
            split_to_multiple(p, weight, multiple)
        return
    split = split_to_multiple(p, weight, multiple)
    assert split.num_groups % multiple == 0
    halves = {tuple(g.tolist()) for g in split.groups()}
    for g in range(G):
        members = tuple(range(offsets[g], offsets[g + 1]))
        assert (members not in halves) == (g in set(expected.tolist()))


@SETTINGS
@given(pool=st.lists(st.one_of(st.floats(0, 1e300), st.floats(0, 4), st.just(0.0), st.just(-0.0), st.just(5e-324)),
                     min_size=1, max_size=30),
       n=st.sampled_from([0, 1, 2, 10, 5000, 60000]), seed=st.integers(0, 3), descending=st.booleans(),
       spread=st.booleans(), other=st.sampled_from([None, "negative", "nan", "inf", "int"]))
def test_size_order_orders_to_its_precision_and_ties_by_index(pool, n, seed, descending, spread, other):
    """A permutation in which a value comes before another only if it is larger (descending) or smaller
    by less than 2^-SIZE_BITS, or the two share a bucket and its index is lower; values 2^16 buckets
    below the largest tie at the bottom; anything but non-negative finite floats: :func:`stable_order`."""
    from balancer_cli._sort import SIZE_BITS, size_order, stable_order

    rng = np.random.default_rng(seed)
    values = np.array(pool)[rng.integers(0, len(pool), n)]
    if spread:  # many distinct sizes, some within the precision of each other
        values = values * (1 + rng.integers(0, 4, n) * 2.0**-(SIZE_BITS + 2))
    if other and n:
        values = np.minimum(values, 1e15).astype(np.int64) if other == "int" else values.copy()
        if other != "int":
            values[rng.integers(0, n)] = {"negative": -1.0, "nan": np.nan, "inf": np.inf}[other]
        assert np.array_equal(size_order(values, descending=descending), stable_order(values, descending=descending))
        return
    got = size_order(values, descending=descending)
    assert got.dtype == np.int64 and np.array_equal(np.sort(got), np.arange(n))
    if n < 2:
        return
    ordered = values[got]
    bucket = (ordered + 0.0).view(np.uint64) >> np.uint64(52 - SIZE_BITS)  # -0.0 is 0.0
    low = max(int(bucket.max()) - 0xFFFF, 0)
    bucket = np.maximum(bucket, np.uint64(low))
    step = np.diff(bucket.astype(np.int64))
    assert (step <= 0).all() if descending else (step >= 0).all()  # buckets in order
    same = step == 0
    assert (np.diff(got)[same] > 0).all()  # ties (one bucket) keep index order
    assert np.all(ordered[1:][~same] != ordered[:-1][~same])  # equal values always share a bucket
    near = np.abs(np.diff(ordered)) <= np.maximum(ordered[1:], ordered[:-1]) * 2.0**-SIZE_BITS
    wrong = (np.diff(ordered) > 0) if descending else (np.diff(ordered) < 0)
    assert not (wrong & ~near & (bucket[1:] > low) & (bucket[:-1] > low)).any()  # out of order only within it


@SETTINGS
@given(pool=st.lists(st.one_of(st.floats(allow_nan=False), st.just(0.0), st.just(-0.0), st.just(5e-324)),
                     min_size=1, max_size=30),
       n=st.sampled_from([0, 1, 2, 10, 5000, 60000]), seed=st.integers(0, 3), near=st.booleans())
def test_stable_argsort_is_numpys_stable_argsort(pool, n, seed, near):
    """The compiled sort the dealing kernel calls: ties, near-equal keys, signed zeros, infinities;
    compiled and as Python."""
    from balancer_cli._sort import stable_argsort

    values = np.array(pool)[np.random.default_rng(seed).integers(0, len(pool), n)]
    if near:
        values = np.nextafter(values, np.inf)
    expected = np.argsort(values, kind="stable")
    assert np.array_equal(stable_argsort(values), expected)
    if n <= 5000:
        assert np.array_equal(getattr(stable_argsort, "py_func", stable_argsort)(values), expected)


@SETTINGS
@given(pool=st.lists(st.one_of(st.floats(), st.just(-0.0)), min_size=1, max_size=20),
       n=st.sampled_from([0, 1, 7, 3000, 60000]), majors=st.sampled_from([1, 3, 300, 70000]), seed=st.integers(0, 3))
def test_lexsort_order_is_numpys_lexsort(pool, n, majors, seed):
    """By major key (16-bit or wider), ties by value (NaNs, signed zeros, repeats), then by index."""
    from balancer_cli._sort import lexsort_order

    rng = np.random.default_rng(seed)
    values = np.array(pool)[rng.integers(0, len(pool), n)]
    major = rng.integers(0, majors, n)
    got = lexsort_order(values, major)
    assert got.dtype == np.int64 and np.array_equal(got, np.lexsort((values, major)))


@SETTINGS
@given(words=st.lists(st.integers(0, 2**64 - 1), unique=True, max_size=300), shift=st.integers(0, 56))
def test_radix_sort_is_numpys_sort(words, shift):
    """Words of any bits (digits constant across all of them included), compiled and as Python."""
    from balancer_cli._sort import radix_sort

    word = np.array(sorted({w >> shift for w in words}), dtype=np.uint64)
    word = word[np.random.default_rng(len(words)).permutation(len(word))]
    assert np.array_equal(radix_sort(word), np.sort(word))
    assert np.array_equal(getattr(radix_sort, "py_func", radix_sort)(word), np.sort(word))


@SETTINGS
@given(values=st.lists(st.integers(-2**40, 2**40), max_size=60), needles=st.lists(st.integers(-2**40, 2**40), max_size=8),
       dtype=st.sampled_from(["int8", "uint8", "int16", "int32", "uint32", "int64"]), side=st.sampled_from(["left", "right"]),
       scalar=st.booleans())
def test_search_sorted_is_numpys_searchsorted_in_the_arrays_type(values, needles, dtype, side, scalar):
    """Needles inside and outside the sorted array's type (Python ints, int64 arrays, scalars) give
    numpy's own positions."""
    from balancer_cli._index import search_sorted

    info = np.iinfo(dtype)
    a = np.sort(np.clip(values, info.min, info.max)).astype(dtype)
    v = (needles[0] if needles else 0) if scalar else np.array(needles, np.int64)
    expected = np.searchsorted(a.astype(np.int64), v, side=side)
    assert np.array_equal(search_sorted(a, v, side), expected)
    assert np.array_equal(search_sorted(a, v.tolist() if not scalar else v, side), expected)


@SETTINGS
@given(n=st.integers(0, 300), k=st.integers(1, 5), m=st.integers(0, 400), rows=st.integers(1, 50),
       dtype=st.sampled_from(["float64", "float32", "int64", "int32", "int8"]), seed=st.integers(0, 10**6))
def test_index_helpers_are_numpys_indexing_and_add_at(n, k, m, rows, dtype, seed):
    """take_rows / take_column give ``a[i]`` / ``a[i, c]`` (negative indices, 2-D index arrays, empty
    tables) and sum_rows gives ``np.add.at`` on zeros, bit for bit; out-of-range indices raise."""
    from balancer_cli._index import sum_rows, take_column, take_rows

    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((n, k)) * 1e3 * rng.random((n, k)) ** 8).astype(dtype)
    index = rng.integers(-n, n, m) if n else np.zeros(0, np.int64)
    assert np.array_equal(take_rows(a, index), a[index]) and take_rows(a, index).dtype == a.dtype
    if n:
        assert np.array_equal(take_rows(a, index.reshape(-1, 1)), a[index.reshape(-1, 1)])
        column = int(rng.integers(0, k))
        assert np.array_equal(take_column(a, index, column), a[index, column])
        with pytest.raises(IndexError):
            take_rows(a, np.array([n]))
    target = rng.integers(0, rows, m)
    values = (rng.standard_normal((m, k)) * 10.0 ** rng.integers(-8, 8, (m, 1))).astype(dtype)
    expected = np.zeros((rows, k))
    np.add.at(expected, target, values)
    assert np.array_equal(sum_rows(target, values, rows), expected)  # exactly: the same additions in order
    with pytest.raises(ValueError):
        sum_rows(np.array([rows]), np.ones((1, k)), rows)


@SETTINGS
@given(n=st.integers(0, 300), k=st.integers(1, 20), dtype=st.sampled_from(["float64", "float32", "int64", "int8"]),
       fortran=st.booleans(), seed=st.integers(0, 10**6))
def test_column_helpers_are_numpys_axis_0_reductions(n, k, dtype, fortran, seed):
    """column_sums adds the rows in order, as numpy's axis-0 sum of a C-ordered float64 table, bit
    for bit (a tall table too: numpy may not block it differently); column_max is numpy's max."""
    from balancer_cli._columns import column_max, column_sums

    rng = np.random.default_rng(seed)
    for rows in (n, 70_000 if seed % 10 == 0 else 0):
        a = (rng.standard_normal((rows, k)) * 10.0 ** rng.integers(-6, 6, (rows, 1))).astype(dtype)
        a = np.asfortranarray(a) if fortran else a
        assert np.array_equal(column_sums(a), np.ascontiguousarray(a, dtype=np.float64).sum(axis=0))
        if rows:
            assert np.array_equal(column_max(a), a.max(axis=0)) and column_max(a).dtype == a.dtype
        else:
            with pytest.raises(ValueError):
                column_max(a)
    with pytest.raises(ValueError):
        column_sums(np.zeros(3))


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10**6), share=st.floats(0.05, 1.0), whole=st.booleans())
def test_a_search_over_rows_is_the_search_over_their_copies(seed, share, whole):
    """``rows`` (the samples without a scan error) searches as the rows' copies do, without them."""
    rng = np.random.default_rng(seed)
    n = 3000
    items = rng.integers(0, 6, n)
    load = np.stack([items, 256 * items + rng.integers(20, 900, n)], 1)
    rows = np.flatnonzero(rng.random(n) < share)
    if len(rows) == 0:
        rows = np.array([0])
    source = rng.integers(0, 3, n)
    kw = {"world_size": 2, "micro_batches": 1, "max_caps_K": np.array([30, 9000]), "grid": 2, "seed": seed % 5,
          "sample_size": 3000 if whole else 600, "prune": True}
    try:
        copied = search_thresholds(load[rows], load[rows].astype(float), source_N=source[rows], **kw)
    except UsageError:  # too few samples for a step: the same refusal either way
        with pytest.raises(UsageError):
            search_thresholds(load, load.astype(float), source_N=source, rows=rows, **kw)
        return
    viewed = search_thresholds(load, load.astype(float), source_N=source, rows=rows, **kw)
    assert repr(viewed.candidates) == repr(copied.candidates) and viewed.sample_size == copied.sample_size


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10**6), R=st.sampled_from([2, 4, 8]), M=st.integers(1, 2), sources=st.integers(1, 4),
       text_share=st.floats(0.0, 0.6), whole=st.booleans())
# Whole: a tier-0 (within the bounds) best above a pruned candidate's bound, which cannot be within.
@example(seed=262143, R=8, M=1, sources=1, text_share=0.40625, whole=True)
def test_pruned_search_picks_what_the_full_search_picks(seed, R, M, sources, text_share, whole):
    """Pruning skips candidates whose packing alone scores past the best: the same best, objective
    included, and every pruned candidate's lower bound ranks it after the best. Evaluated whole,
    candidates within the contract's bounds rank first, and the polish is skipped only where the
    terms it cannot change (packing, step mix) already rank a candidate past the best three: those
    three, which the pipeline falls back to, are the full search's."""
    rng = np.random.default_rng(seed)
    n = 3000
    items = np.where(rng.random(n) < text_share, 0, rng.integers(1, 8, n))
    load = np.stack([items, 256 * items + rng.integers(20, 900, n)], 1)
    source = rng.integers(0, sources, n)
    kw = dict(world_size=R, micro_batches=M, max_caps_K=np.array([40, 12000]), grid=3,
              sample_size=3000 if whole else 1500, source_N=source, seed=seed % 7)
    full = search_thresholds(load, load.astype(float), **kw)
    pruned = search_thresholds(load, load.astype(float), prune=True, **kw)
    assert pruned.candidates[0] == full.candidates[0]
    if whole:
        assert pruned.candidates[:3] == full.candidates[:3]
    # The candidates evaluated refine the groups dealt for pruning; with no room to keep them
    # each is dealt again: the same candidates.
    with mock.patch.object(search_module, "_DEALS_KEPT_BYTES", 0):
        again = search_thresholds(load, load.astype(float), prune=True, **kw)
    assert repr(again.candidates) == repr(pruned.candidates)  # repr: pruned ones hold NaN
    within = [c for c in full.candidates if c.within_bounds]
    assert whole or not within  # judged only on the whole input
    if within:
        assert full.candidates[0].within_bounds
    for c in within:
        assert c.steps_over_lower_bound <= 1.03 and c.mix_vs_random <= 1.0
        assert all(d <= 0.005 or u >= 0.9 for d, u in zip(c.dist_ratio_K, c.utilization_K))
    assert len(pruned.candidates) == len(full.candidates)
    by_caps = {c.caps_K: c for c in full.candidates}
    top = 3 if whole else 1
    for c in pruned.candidates:
        if c.pruned:
            # A lower bound of its objective that ranks it after the best (three, whole: a candidate
            # that cannot be within the bounds ranks after one that is, whatever their objectives).
            assert by_caps[c.caps_K].objective >= c.objective - 1e-9
            assert full.candidates.index(by_caps[c.caps_K]) >= top
            assert whole or c.objective > full.candidates[0].objective
        else:
            assert c == by_caps[c.caps_K]
    # The search report stays valid JSON (no NaN for what pruning did not measure) and renders.
    import json

    from balancer_cli.report.search import search_data, search_table

    data = search_data(pruned, ("vision", "llm"))
    json.dumps(data, allow_nan=False)
    header, rows = search_table(data, top=len(data["candidates"]))
    assert len(rows) == len(pruned.candidates) and all(len(row) == len(header) for row in rows)
    assert [bool(c.get("pruned")) for c in data["candidates"]] == [c.pruned for c in pruned.candidates]
    assert [bool(c.get("within_bounds")) for c in data["candidates"]] == [c.within_bounds for c in pruned.candidates]
    # The step mix is shown wherever it was measured (a candidate pruned after its assignment included).
    assert [c["mix_vs_random"] for c in data["candidates"]] == [
        None if np.isnan(c.mix_vs_random) else round(c.mix_vs_random, 6) for c in pruned.candidates]


def test_search_on_the_whole_input_prefers_caps_within_the_bounds():
    # Two text-only sources, 64 ranks (a random input once over the Dist bound): the lowest
    # objective was caps 1 / 2,257, where 4 samples are oversize and share a step with full
    # groups (LLM Dist 0.0105); caps within every bound rank first now.
    from balancer_cli.lengths import make_lengths_table
    from balancer_cli.pack.config import PackConfig
    from balancer_cli.pack.inputs import prepare_inputs
    from balancer_cli.pack.pipeline import run_search

    rng = np.random.default_rng(1012)  # bench/bench_pack_random.py --family harsh, case 12
    n = int(np.exp(rng.uniform(np.log(3000), np.log(400_000))))
    source = rng.choice(2, n, p=rng.dirichlet(np.ones(int(rng.integers(2, 9)))))  # draws as the bench does
    text = np.empty(n, np.int64)
    for s in range(2):
        idx = np.flatnonzero(source == s)
        mu, sigma = rng.uniform(3.5, 7), rng.uniform(0.2, 1.0)
        rng.random()  # the bench's text-only draw (both sources are)
        text[idx] = np.clip(rng.lognormal(mu, sigma, len(idx)), 8, 6000).astype(np.int64)
    zeros = np.zeros(n, np.int64)
    inputs = prepare_inputs(make_lengths_table(text, {"vision": (zeros, zeros)}, source=source.astype(str)))
    res = run_search(inputs, PackConfig(world_size=64, micro_batches=1), prune=True)
    best = res.candidates[0]
    assert res.sample_size == len(text) and best.within_bounds, best
    assert max(best.dist_ratio_K) <= 0.005
    measured = [c for c in res.candidates if not c.pruned]
    assert min(c.objective for c in measured) < best.objective  # the bounds outrank the objective


def test_search_packs_a_subsample_to_its_share_of_a_step():
    """A subsample is packed to a multiple of its share of a step's groups (R x M x n / N), so it
    holds as many steps as the full data; its efficiency is groups over the fewest (a rounded share
    of a step would overstate whole steps); an input up to 1.5x the sample size is evaluated whole."""
    from balancer_cli.pack.bounds import groups_lower_bound
    from balancer_cli.pack.packers.balanced import BalancedOptions

    rng = np.random.default_rng(1)
    n = 9000
    items = rng.choice([1, 3, 4, 5], n)
    load = np.stack([items, 256 * items + rng.integers(40, 300, n)], 1)
    res = search_thresholds(load, load.astype(float), world_size=32, micro_batches=2, max_caps_K=np.array([24, 6144]),
                            grid=2, sample_size=4000, seed=3)
    assert res.sample_size == 4000
    pick = np.sort(np.random.default_rng(3).choice(n, 4000, replace=False))
    multiple = round(64 * 4000 / n)
    for c in res.candidates:
        caps = np.array(c.caps_K)
        p = pack_balanced(load[pick], caps, cost_NK=load[pick].astype(float), seed=3, group_multiple=multiple,
                          options=BalancedOptions(passes=3, class_mix=False))
        assert p.num_groups % multiple == 0
        # A subsample's share of a step is rounded, so its efficiency counts groups, not steps.
        assert c.steps_over_lower_bound == pytest.approx(p.num_groups / groups_lower_bound(load[pick], caps))
    whole = search_thresholds(load, load.astype(float), world_size=32, micro_batches=2,
                              max_caps_K=np.array([24, 6144]), grid=2, sample_size=6000)
    assert whole.sample_size == n


def test_the_subsample_holds_steps_of_many_ranks():
    """Many groups a step raise the sample size to ``SUBSAMPLE_STEPS`` steps of the target group
    size: 19k samples at 1000 x 2 are searched whole (a 12k subsample filled about one step, and
    no candidate could split to whole steps: "no candidate caps" though 9 steps fit), and 60k at
    1000 x 1 on a 36k subsample."""
    from balancer_cli.pack.search import DEFAULT_GROUP_SIZE, SUBSAMPLE_STEPS

    rng = np.random.default_rng(4)

    def load(n):
        items = rng.choice([0, 1, 2], n)
        return np.stack([items, 256 * items + rng.integers(5, 200, n)], 1)

    whole = load(19_060)
    res = search_thresholds(whole, whole.astype(float), world_size=1000, micro_batches=2, grid=2,
                            max_caps_K=np.array([24, 8192]))
    assert res.sample_size == len(whole) and res.candidates
    sub = load(60_000)
    res = search_thresholds(sub, sub.astype(float), world_size=1000, micro_batches=1, grid=2,
                            max_caps_K=np.array([24, 8192]))
    assert res.sample_size == SUBSAMPLE_STEPS * 1000 * DEFAULT_GROUP_SIZE == 36_000
    assert all(c.steps_over_lower_bound < 1.5 for c in res.candidates if not c.pruned)


def _harsh_303():
    """``bench/bench_pack_random.py --family harsh`` case 303: 75,922 samples of 7 sources, 3 of
    them text-only, tiles coupled to LLM tokens (256 a tile), 128 ranks x 1 micro-batch."""
    from bench.bench_pack_random import FAMILIES

    return FAMILIES["harsh"](303, None)[1]


def test_search_avoids_caps_whose_full_run_keeps_one_class_a_step_unmixed():
    # At LLM caps a hair over the tiles' tokens (14 tiles / 3,637 tokens) the full run rounds its
    # groups to 128 a step, dealing then needs 1.04x the bound and first fit's groups are kept:
    # their tile classes (one a step) hold the sources in very different shares, steps 5.9x less
    # mixed than random batching. The subsample, packed unrounded, kept dealing's groups and its
    # ~20 steps mixed the classes (1.15x), so the search picked those caps. Now the subsample is
    # rounded as the full data is and the classes' bias counts: caps within every bound.
    from balancer_cli.pack.config import PackConfig
    from balancer_cli.pack.evaluate import evaluate_rows
    from balancer_cli.pack.inputs import prepare_inputs
    from balancer_cli.pack.pipeline import place_packer, resolve_thresholds

    inputs = prepare_inputs(_harsh_303())
    assert inputs.num_samples == 75_922
    config = PackConfig(world_size=128, micro_batches=1)
    caps, bounds, search = resolve_thresholds(inputs, config)
    assert search.sample_size < inputs.num_samples  # a subsample decided
    placed = place_packer("balanced", inputs, config, caps, bounds)
    m = evaluate_rows(inputs, placed.rows, placed.dropped_sample, placed.dropped_reason, caps_K=caps, world_size=128,
                      micro_batches=1, epoch_num_steps=placed.epoch_num_steps).metrics
    assert m["step_mix"]["vs_random"] <= 1.0, (caps, m["step_mix"])
    assert m["steps"]["vs_lower_bound"] <= 1.03
    assert max(m["modules"][k]["dist_ratio"] for k in inputs.modules) <= 0.005


def test_search_ranks_candidates_and_respects_limits():
    rng = np.random.default_rng(0)
    n = 5000
    items = rng.choice([1, 3, 4, 5], n)
    tokens = 256 * items + rng.integers(40, 300, n)
    load = np.stack([items, tokens], 1)
    cost = load.astype(float)
    max_caps = np.array([24, 6144])
    res = search_thresholds(load, cost, world_size=8, micro_batches=1, max_caps_K=max_caps, grid=3, sample_size=3000)
    objectives = [c.objective for c in res.candidates]
    assert objectives == sorted(objectives)
    assert (res.best_caps_K <= max_caps).all()
    assert res.grid_objective.shape == tuple(len(ax) for ax in res.grid_axes)
    assert np.isclose(np.nanmin(res.grid_objective), objectives[0])
    again = search_thresholds(load, cost, world_size=8, micro_batches=1, max_caps_K=max_caps, grid=3, sample_size=3000)
    assert again.candidates == res.candidates
    isf = search_thresholds(load, cost, world_size=8, micro_batches=1, max_caps_K=max_caps, grid=2,
                            sample_size=2000, algorithm="isf")
    assert (isf.best_bounds_K <= isf.best_caps_K).all() and len(isf.candidates) == 4 * 3


def test_search_errors_and_default_caps():
    with pytest.raises(InputError):
        search_thresholds(np.zeros((0, 2), np.int64), np.zeros((0, 2)), world_size=1, micro_batches=1,
                          max_caps_K=np.array([9, 4096]))
    with pytest.raises(UsageError):
        search_thresholds(np.ones((5, 2), np.int64), np.ones((5, 2)), world_size=1, micro_batches=1,
                          max_caps_K=np.array([9]))
    with pytest.raises(UsageError, match="no candidate caps pack the 5 samples into whole steps of 64 groups") as error:
        search_thresholds(np.ones((5, 2), np.int64), np.ones((5, 2)), world_size=64, micro_batches=1,
                          max_caps_K=np.array([9, 4096]))
    assert "sample_size" not in str(error.value)  # the whole input was searched: no bigger subsample helps
    caps = default_caps(np.array([[4, 1100], [3, 1200], [5, 1000]]), 4)
    assert caps.tolist() == [16, 4736]


def test_a_candidate_that_cannot_split_to_whole_steps_is_skipped_not_fatal():
    """A candidate whose groups cannot be split to a multiple of R x M (too few hold two samples)
    drops out of the search; the others are still ranked. None left: one usage error (exit 2)."""
    rng = np.random.default_rng(3)
    items = rng.integers(0, 4, 400)
    load = np.stack([items, 200 * items + rng.integers(20, 900, 400)], 1)
    real_split, calls = search_eval.split_to_multiple, []

    def first_fails(packing, weight, multiple):
        calls.append(multiple)
        if len(calls) == 1:
            raise InputError("cannot reach a multiple", fix="-")
        return real_split(packing, weight, multiple)

    kwargs = {"world_size": 4, "micro_batches": 1, "max_caps_K": np.array([12, 4096]), "grid": 2}
    full = search_thresholds(load, load.astype(float), **kwargs)
    with mock.patch.object(search_eval, "split_to_multiple", first_fails):
        res = search_thresholds(load, load.astype(float), **kwargs)
    assert len(res.candidates) == len(full.candidates) - 1 and len(calls) > 1
    with (mock.patch.object(search_eval, "split_to_multiple", mock.Mock(side_effect=InputError("x", fix="-"))),
          pytest.raises(UsageError, match="no candidate caps pack the 400 samples into whole steps of 4 groups")):
        search_thresholds(load, load.astype(float), **kwargs)


def test_source_pairing_mixes_steps_better_than_random_batching():
    """Equal-cost one-sample groups: with their source counts, steps hold the global mix more
    closely than the same steps filled by a shuffle; without them, about as closely."""
    from balancer_cli.pack.evaluate import step_mix_ratio

    rng = np.random.default_rng(1)
    G, R = 512, 16
    source_G = rng.choice(3, G, p=[0.5, 0.3, 0.2])
    mix = np.eye(3, dtype=np.int64)[source_G]
    cost = np.full((G, 2), 100.0) + rng.random((G, 2))
    a = assign_groups(cost, world_size=R, micro_batches=1, seed=0, mix_GO=mix)
    check_assignment(a, G, R, 1)
    assert step_mix_ratio(a.step, source_G, a.num_steps) < 0.6
    blind = assign_groups(cost, world_size=R, micro_batches=1, seed=0)
    assert step_mix_ratio(blind.step, source_G, blind.num_steps) > 0.7
