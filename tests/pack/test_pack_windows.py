"""Pack windows: stratified slices, every sample placed once per epoch, one window = no windows."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer_cli._shuffle import shuffle
from balancer_cli.errors import UsageError
from balancer_cli.lengths import make_lengths_table
from balancer_cli.pack.config import PackConfig, stream_seed
from balancer_cli.pack.inputs import EMPTY_ERROR_REASON, prepare_inputs
from balancer_cli.pack.pipeline import pack_manifest, place_packer, resolve_thresholds
from balancer_cli.pack.windows import (
    BASE_BYTES,
    BYTES_PER_SAMPLE,
    EPOCH_BYTES_PER_SAMPLE,
    HELD_BYTES_PER_SAMPLE,
    MAX_WINDOW_SAMPLES,
    SOURCE_BYTES_PER_SAMPLE,
    num_windows,
    resolve_window_samples,
    window_members,
    window_samples_for,
)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 400), windows=st.integers(1, 9), sources=st.integers(1, 5), seed=st.integers(0, 3),
       epoch=st.integers(0, 2))
def test_windows_partition_the_samples_and_are_stratified(n, windows, sources, seed, epoch):
    source = np.random.default_rng(seed).integers(0, sources, n)
    members = window_members(source, windows, seed=seed, epoch=epoch)
    assert len(members) == max(1, windows) or windows <= 1
    flat = np.concatenate(members)
    assert np.array_equal(np.sort(flat), np.arange(n))  # each sample in exactly one window
    assert all(np.all(np.diff(m) > 0) for m in members)  # sorted positions
    sizes = [len(m) for m in members]
    assert max(sizes) - min(sizes) <= 1
    for o in range(sources):  # every window holds each source's share to within one sample
        counts = [int((source[m] == o).sum()) for m in members]
        assert max(counts) - min(counts) <= 1
    again = window_members(source, windows, seed=seed, epoch=epoch)
    assert all(np.array_equal(a, b) for a, b in zip(members, again))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 300), windows=st.integers(2, 9), sources=st.integers(1, 6),
       spread=st.sampled_from([1, 10**6]), seed=st.integers(0, 5), names=st.booleans())
def test_window_members_are_the_shuffled_labels_they_stand_for(n, windows, sources, spread, seed, names):
    """The compiled deal equals its definition: the sources laid out one after another in code
    order, position k labelled ``k % windows``, each source's labels shuffled by the epoch's
    ``window`` stream (in code order), the i-th sample of a source taking its i-th label, then
    each window's positions in order (any source codes, or names)."""
    codes = np.random.default_rng(seed).integers(0, sources, n) * spread - 3
    source = np.array([f"s{c}" for c in codes]) if names else codes
    rng = np.random.default_rng(stream_seed(seed, 1, "window"))
    inverse = np.unique(source, return_inverse=True)[1].ravel()
    window_of = np.empty(n, np.int64)
    start = 0
    for code in range(inverse.max() + 1):
        where = np.flatnonzero(inverse == code)
        labels = (start + np.arange(len(where))) % windows
        if len(where) > 1:
            labels = labels.astype(np.min_scalar_type(-windows))
            shuffle(rng, labels)
        window_of[where] = labels
        start += len(where)
    expected = [np.flatnonzero(window_of == w) for w in range(windows)]
    members = window_members(source, windows, seed=seed, epoch=1)
    assert [m.tolist() for m in members] == [e.tolist() for e in expected]


def test_window_members_of_unsigned_or_no_samples():
    codes = np.array([5, 1, 5, 9, 1, 1])
    expected = [m.tolist() for m in window_members(codes, 2, seed=3, epoch=0)]
    for dtype in (np.uint8, np.uint64):
        assert [m.tolist() for m in window_members(codes.astype(dtype), 2, seed=3, epoch=0)] == expected
    assert [len(m) for m in window_members(np.zeros(0, np.int64), 3, seed=0, epoch=0)] == [0, 0, 0]


def test_window_counts_and_budget():
    assert num_windows(100, None) == 1 and num_windows(100, 30) == 4 and num_windows(100, 30, min_samples=40) == 2
    assert num_windows(10, 30) == 1
    assert resolve_window_samples(10**6, None, None) is None  # fits the default budget: one window
    assert resolve_window_samples(10**7, None, 1.0) == window_samples_for(1.0, 10**7) < MAX_WINDOW_SAMPLES
    # a budget that would allow bigger windows still gets windows of at most MAX_WINDOW_SAMPLES
    assert resolve_window_samples(10**7, None, None) == MAX_WINDOW_SAMPLES < window_samples_for(8.0, 10**7)
    assert resolve_window_samples(10**7, 4_000_000, None) == 4_000_000  # unless W is given
    # the held samples count: a budget that cannot hold them is refused with the size it needs
    assert window_samples_for(8.0, 10**8) < window_samples_for(8.0, 10**7) < window_samples_for(8.0)
    with pytest.raises(UsageError, match="cannot hold 100,000,000 samples"):
        window_samples_for(4.0, 10**8)
    # a third module widens the windows (and the held bytes): smaller windows for the same budget
    assert window_samples_for(1.0, 3 * 10**6, 3) < window_samples_for(1.0, 3 * 10**6, 2)
    assert resolve_window_samples(3 * 10**6, None, 0.6, num_modules=3) == window_samples_for(0.6, 3 * 10**6, 3)
    # the libraries alone take ~0.3 GiB (numba's kernels, matplotlib), and the packed run must fit too
    with pytest.raises(UsageError, match=r"~0\.3\d GiB at the least.*raise .*memory.gb to 0\.4"):
        window_samples_for(0.25, 2000)
    with pytest.raises(UsageError, match="cannot hold 1,200,000 samples"):
        window_samples_for(0.34, 1_200_000)
    free = 0.6 * 2**30 - BASE_BYTES - HELD_BYTES_PER_SAMPLE * 10**6
    assert window_samples_for(0.6, 10**6) == int(free // BYTES_PER_SAMPLE)
    # every epoch past the first holds its plan, windows and rows too
    held = EPOCH_BYTES_PER_SAMPLE[0]
    free = 0.7 * 2**30 - BASE_BYTES - (HELD_BYTES_PER_SAMPLE + 2 * held) * 3 * 10**6
    assert resolve_window_samples(3 * 10**6, None, 0.7, epochs=3) == window_samples_for(0.7, 3 * 10**6, epochs=3) == int(
        free // BYTES_PER_SAMPLE) < window_samples_for(0.7, 3 * 10**6)
    with pytest.raises(UsageError, match=r"cannot hold 10,000,000 samples of 2 modules in 3 epochs .*raise .*to 1\.4"):
        window_samples_for(1.0, 10**7, epochs=3)
    assert window_samples_for(1.0, 10**7) == 1_390_987  # one epoch: as before
    # every source past four (up to the 16 the groups count) widens a window sample
    assert window_samples_for(1.0, 10**7, num_sources=4) == window_samples_for(1.0, 10**7, num_sources=1)
    narrower = (BYTES_PER_SAMPLE + 12 * SOURCE_BYTES_PER_SAMPLE)
    assert window_samples_for(1.0, 10**7, num_sources=500) == window_samples_for(1.0, 10**7, num_sources=16) == int(
        (2**30 - BASE_BYTES - HELD_BYTES_PER_SAMPLE * 10**7) // narrower)
    assert resolve_window_samples(10**7, None, 1.0, num_sources=9) == window_samples_for(1.0, 10**7, num_sources=9) < (
        window_samples_for(1.0, 10**7))
    with pytest.raises(UsageError, match="both set the window size"):
        resolve_window_samples(10, 5, 1.0)
    with pytest.raises(UsageError):
        window_samples_for(0)


def test_window_zero_keeps_the_run_seeds():
    assert stream_seed(3, 1, "pack", window=0) == stream_seed(3, 1, "pack")
    assert stream_seed(3, 1, "pack", window=1) != stream_seed(3, 1, "pack")


def _inputs(n=6000, seed=0):
    rng = np.random.default_rng(seed)
    source = rng.choice(["a", "b", "c"], n, p=[0.5, 0.3, 0.2])
    items = np.where(source == "a", rng.integers(1, 4, n), rng.integers(2, 7, n))
    tokens = 256 * items + rng.integers(20, 600, n)
    error = [None] * n
    error[7] = "corrupt_image: x"
    return make_lengths_table(tokens, {"vision": (256 * items, items)}, source=source, error=error)


@pytest.mark.parametrize("packer", ["balanced", "isf", "random", "dataloader", "llm-ffd"])
def test_every_sample_is_placed_once_per_epoch_in_windows(packer):
    lengths = _inputs()
    inputs = prepare_inputs(lengths)
    config = PackConfig(world_size=4, micro_batches=2, epochs=2, window_samples=1500,
                        caps=(("vision", 24), ("llm", 7000)))
    caps_K, bounds_K, _ = resolve_thresholds(inputs, config)
    rows, dropped, _reasons, epoch_steps = place_packer(packer, inputs, config, caps_K, bounds_K)
    first = 0
    for steps in epoch_steps:  # per epoch: placed + dropped (this epoch) == every sample, once
        lo, hi = np.searchsorted(rows.step, [first, first + steps])
        placed = np.asarray(rows.sample[lo:hi])
        assert len(np.unique(placed)) == len(placed)
        assert set(placed.tolist()) | set(dropped.tolist()) == set(range(lengths.num_samples))
        first += steps
    assert 7 in dropped.tolist()
    slot = (np.asarray(rows.step, np.int64) * 4 + rows.rank) * 2 + rows.micro
    assert np.all(np.diff(slot) >= 0)  # sorted by slot, every slot of every step used
    assert len(np.unique(slot)) == sum(epoch_steps) * 8


def test_on_window_follows_every_window_of_every_epoch():
    inputs = prepare_inputs(_inputs())
    config = PackConfig(world_size=4, micro_batches=2, epochs=2, window_samples=1500,
                        caps=(("vision", 24), ("llm", 7000)))
    caps_K, bounds_K, _ = resolve_thresholds(inputs, config)
    calls = []
    place_packer("balanced", inputs, config, caps_K, bounds_K, on_window=lambda *call: calls.append(call))
    total = 2 * num_windows(inputs.num_samples - 1, 1500)  # one sample has a scan error
    assert total > 2 and calls == [(i, total) for i in range(1, total + 1)]


def test_one_window_packs_exactly_as_no_windows_and_windows_are_deterministic():
    lengths = _inputs()
    plain = pack_manifest(lengths, PackConfig(world_size=4, seed=2))
    one = pack_manifest(lengths, PackConfig(world_size=4, seed=2, window_samples=10**6))
    for a, b in zip((plain.rows.step, plain.rows.rank, plain.rows.sample), (one.rows.step, one.rows.rank, one.rows.sample)):
        assert np.array_equal(a, b)
    w1 = pack_manifest(lengths, PackConfig(world_size=4, seed=2, window_samples=2000))
    w2 = pack_manifest(lengths, PackConfig(world_size=4, seed=2, window_samples=2000))
    assert np.array_equal(w1.rows.sample, w2.rows.sample) and w1.meta == w2.meta
    assert not np.array_equal(w1.rows.sample, plain.rows.sample)
    assert w1.meta["params"]["window_samples"] == 2000
    assert w1.meta["summary"]["step_mix"]["vs_random"] < 1.0  # windows are stratified slices


def test_tiny_windows_merge_into_ones_that_hold_whole_steps():
    lengths = _inputs(n=2000)
    result = pack_manifest(lengths, PackConfig(world_size=8, window_samples=10))
    assert len(np.unique(result.rows.sample)) == int(lengths.ok_mask().sum())


@settings(max_examples=25, deadline=None)
@given(n=st.integers(200, 1500), R=st.integers(1, 6), M=st.integers(1, 3), windows=st.integers(1, 4),
       sources=st.integers(1, 4), seed=st.integers(0, 50),
       packer=st.sampled_from(["balanced", "isf", "random", "dataloader", "llm-ffd"]))
def test_conservation_for_any_mixture_and_window_count(n, R, M, windows, sources, seed, packer):
    """Every sample is placed exactly once per epoch or listed with a reason, for any mixture."""
    rng = np.random.default_rng(seed)
    source = rng.integers(0, sources, n).astype(str)
    items = rng.integers(0, 6, n) * (rng.random(n) < 0.8)
    tokens = 256 * items + rng.integers(5, 700, n)
    error = [None if rng.random() > 0.02 else "malformed_record: x" for _ in range(n)]
    lengths = make_lengths_table(tokens, {"vision": (256 * items, items)}, source=source, error=error)
    config = PackConfig(world_size=R, micro_batches=M, epochs=2, seed=seed, window_samples=max(1, n // windows),
                        caps=(("vision", 30), ("llm", 9000)))
    inputs = prepare_inputs(lengths)
    caps_K, bounds_K, _ = resolve_thresholds(inputs, config)
    try:
        rows, dropped, reasons, epoch_steps = place_packer(packer, inputs, config, caps_K, bounds_K)
    except UsageError as error:  # too few groups for one step: a clear usage error, never a crash
        assert "groups" in error.message
        return
    assert len(reasons) == len(dropped)
    first = 0
    for steps in epoch_steps:
        lo, hi = np.searchsorted(rows.step, [first, first + steps])
        placed = np.asarray(rows.sample[lo:hi])
        assert len(np.unique(placed)) == len(placed)
        assert not set(placed.tolist()) & {int(s) for s, r in zip(dropped, reasons) if "epoch" not in r}
        assert set(placed.tolist()) | set(dropped.tolist()) == set(range(n))
        first += steps


@settings(max_examples=20, deadline=None)
@given(n=st.integers(300, 1200), windows=st.integers(1, 3), failed=st.floats(0.0, 0.5), seed=st.integers(0, 50),
       packer=st.sampled_from(["balanced", "isf", "llm-ffd"]))
def test_failed_samples_change_nothing_but_the_ids(n, windows, failed, seed, packer):
    """A table with failed samples packs as the table of the others alone (the same windows, groups
    and slots; only the sample ids are the table's own), and lists each failed sample once, with
    its text: one string object per distinct text, an empty text given a reason of its own."""
    rng = np.random.default_rng(seed)
    items = rng.integers(0, 6, n)
    tokens, source = 256 * items + rng.integers(5, 700, n), rng.choice(["a", "b", "c"], n)
    bad = rng.random(n) < failed
    bad[:3], source[:3] = False, ["a", "b", "c"]  # the sources' codes (first seen first) the same in both tables
    texts = np.array(["missing_file: x.jpg", "", "decode: truncated"])
    error = [str(texts[i % 3]) if b else None for i, b in enumerate(bad)]
    config = PackConfig(world_size=2, seed=seed, window_samples=max(1, (n - int(bad.sum())) // windows),
                        caps=(("vision", 30), ("llm", 9000)), algorithm=packer)
    whole = pack_manifest(make_lengths_table(tokens, {"vision": (256 * items, items)}, source=source, error=error),
                          config)
    good = np.flatnonzero(~bad)
    alone = pack_manifest(make_lengths_table(tokens[good], {"vision": (256 * items[good], items[good])},
                                             source=source[good]), config)
    assert np.array_equal(whole.rows.step, alone.rows.step) and np.array_equal(whole.rows.rank, alone.rows.rank)
    assert np.array_equal(whole.rows.sample, good[alone.rows.sample])
    failed_here = {int(s): r for s, r in zip(whole.dropped_sample, whole.dropped_reason) if bad[s]}
    assert sorted(failed_here) == np.flatnonzero(bad).tolist()
    assert all(r == (texts[s % 3] or EMPTY_ERROR_REASON) for s, r in failed_here.items())
    inputs = prepare_inputs(make_lengths_table(tokens, {"vision": (256 * items, items)}, error=error))
    assert np.array_equal(inputs.error_rows, np.flatnonzero(bad))
    assert len({id(t) for t in inputs.error_texts}) == len(set(inputs.error_texts.tolist()))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.booleans(), st.integers(0, 2**31 - 1),
       st.sampled_from([0, 2**21 - 2, 2**31 - 40]))
def test_merged_rows_are_the_row_level_sort(windows, R, M, shared, seed, skipped):
    """Windows' groups expand straight into rows sorted by (step, rank, micro, position in group),
    also when groups share a slot (not produced by our assigners: the general row sort), and past
    2^21 steps (10M samples at ``--dp 1``), where a bit field per column overflowed the sort key."""
    from balancer_cli.manifest import is_slot_sorted
    from balancer_cli.pack.placement import merge_windows
    from balancer_cli.pack.windows import WindowResult

    rng = np.random.default_rng(seed)
    inputs = prepare_inputs(make_lengths_table(np.ones(1, np.int64)))
    empty = np.zeros(0, np.int64)  # a window of ``skipped`` steps whose groups were all left out
    results = [WindowResult(empty, np.zeros(1, np.int64), empty, empty, empty, skipped, empty, ())]
    ref, offset, first = [], skipped, 0
    for _ in range(windows):
        S = int(rng.integers(1, 4))
        sizes = rng.integers(1, 4, S * R * M)
        order = first + rng.permutation(int(sizes.sum()))
        first += len(order)
        slot = rng.integers(0, S * R * M, S * R * M) if shared else rng.permutation(S * R * M)
        step, rank, micro = slot // (R * M), slot // M % R, slot % M
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        results.append(WindowResult(order, offsets, step, rank, micro, S, np.zeros(0, np.int64), ()))
        ref += [(offset + s, r, m, p, order[offsets[g] + p]) for g, (s, r, m) in enumerate(zip(step, rank, micro))
                for p in range(sizes[g])]
        offset += S
    rows = merge_windows(inputs, [results], epochs=1).rows
    ref.sort(key=lambda t: t[:4])  # stable: groups of one slot interleave by position, in window order
    assert [(int(a), int(b), int(c), int(d)) for a, b, c, d in zip(rows.step, rows.rank, rows.micro, rows.sample)] == \
        [(s, r, m, x) for s, r, m, _, x in ref]
    assert is_slot_sorted(rows)


@pytest.mark.parametrize("window", [1, 700, 1500, 10**6])
def test_the_manifest_records_the_windows_it_packed(window):
    """``params.windows`` is the count place_packer packs (every epoch), and ``min_window_samples`` its floor."""
    lengths = _inputs()
    config = PackConfig(world_size=4, micro_batches=2, epochs=2, window_samples=window,
                        caps=(("vision", 24), ("llm", 7000)))
    inputs = prepare_inputs(lengths)
    caps_K, bounds_K, _ = resolve_thresholds(inputs, config)
    calls = []
    place_packer("balanced", inputs, config, caps_K, bounds_K, on_window=lambda *call: calls.append(call))
    params = pack_manifest(lengths, config).meta["params"]
    assert calls[-1][1] == 2 * params["windows"]
    n = inputs.num_samples - 1  # one scan error
    assert params["windows"] == num_windows(n, window, params["min_window_samples"]) >= 1
    assert "windows" not in pack_manifest(lengths, PackConfig(world_size=4, caps=config.caps)).meta["params"]
