"""The pack pipeline: conservation per epoch, ordering, metadata, errors, baselines' packers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from balancer_cli.errors import InputError, UsageError
from balancer_cli.lengths import make_lengths_table
from balancer_cli.pack.bounds import groups_lower_bound
from balancer_cli.pack.config import PackConfig
from balancer_cli.pack.inputs import prepare_inputs
from balancer_cli.pack.packers.baselines import (
    default_batch_size,
    pack_llm_ffd,
    pack_random,
)
from balancer_cli.pack.packers.registry import PACKERS
from balancer_cli.pack.pipeline import pack_manifest
from balancer_cli.pack.types import check_packing


def _table(n: int, seed: int = 0, *, errors: int = 0, audio: bool = False):
    rng = np.random.default_rng(seed)
    items = rng.integers(0, 7, n)
    modules = {"vision": (items * 256, items)}
    llm = items * 256 + rng.integers(20, 600, n)
    if audio:  # sparse third module: a few samples carry audio clips
        clips = np.where(rng.random(n) < 0.15, rng.integers(1, 4, n), 0)
        modules["audio"] = (clips * 750, clips)
        llm = llm + clips * 750
    error = [None] * n
    for i in rng.choice(n, errors, replace=False):
        error[i] = f"missing image img{i}.jpg"
    return make_lengths_table(llm, modules, error=error, source=rng.choice(["a", "b", "c"], n))


def _epoch_samples(result, epoch):
    first = sum(result.epoch_num_steps[:epoch])
    last = first + result.epoch_num_steps[epoch]
    in_epoch = (result.rows.step >= first) & (result.rows.step < last)
    return result.rows.sample[in_epoch]


def _dropped_in(reason: str, epoch: int) -> bool:
    """Whether a dropped.parquet reason applies to ``epoch`` ("... (epochs 0, 2)" or every epoch)."""
    if "(epoch" not in reason:
        return True
    listed = reason[reason.rindex("(epoch"):].split(" ", 1)[1].rstrip(")")
    return str(epoch) in [x.strip() for x in listed.split(",")]


def _check_conservation(lt, result, config):
    rows = result.rows
    key = (rows.step.astype(np.int64) << 40) | (rows.rank.astype(np.int64) << 20) | rows.micro
    assert (np.diff(key) >= 0).all(), "rows not sorted by (step, rank, micro)"
    assert sum(result.epoch_num_steps) == (int(rows.step.max()) + 1 if len(rows) else 0)
    dropped_everywhere = {int(s) for s, r in zip(result.dropped_sample, result.dropped_reason)
                          if "(epoch" not in r}
    for epoch in range(config.epochs):
        placed = _epoch_samples(result, epoch)
        counts = np.bincount(placed, minlength=lt.num_samples)
        assert counts.max(initial=0) <= 1, f"epoch {epoch}: a sample placed twice"
        epoch_dropped = {int(s) for s, r in zip(result.dropped_sample, result.dropped_reason)
                         if _dropped_in(r, epoch)}
        for sample in range(lt.num_samples):
            assert (counts[sample] == 1) != (sample in epoch_dropped), (epoch, sample)
        # Every non-dropped sample appears exactly once per epoch.
        assert all(counts[s] == 1 for s in range(lt.num_samples) if s not in dropped_everywhere
                   and s not in epoch_dropped)
    # every rank holds micro_batches groups at every step
    groups = np.unique(np.stack([rows.step, rows.rank, rows.micro]), axis=1)
    assert groups.shape[1] == sum(result.epoch_num_steps) * config.world_size * config.micro_batches
    errors = {int(i) for i in np.flatnonzero(~lt.ok_mask())}
    reasons = dict(zip(result.dropped_sample.tolist(), result.dropped_reason))
    assert all(reasons[i].startswith("missing image") for i in errors)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(40, 300), seed=st.integers(0, 10_000), world=st.integers(1, 4), micro=st.integers(1, 3),
       epochs=st.integers(1, 3), errors=st.integers(0, 5), algorithm=st.sampled_from(tuple(PACKERS)),
       oversize=st.sampled_from(["isolate", "drop"]))
def test_conservation_every_epoch(n, seed, world, micro, epochs, errors, algorithm, oversize):
    lt = _table(n, seed, errors=errors)
    config = PackConfig(world_size=world, micro_batches=micro, epochs=epochs, seed=seed, algorithm=algorithm,
                        caps=(("llm", 1600), ("vision", 5)), oversize=oversize)
    try:
        result = pack_manifest(lt, config)
    except UsageError as error:  # too few groups for the step shape is a legitimate refusal
        assert "groups per step" in str(error)
        return
    _check_conservation(lt, result, config)


def test_epochs_differ_and_steps_are_global():
    lt = _table(400, 1)
    config = PackConfig(world_size=2, micro_batches=2, epochs=3, caps=(("llm", 1600), ("vision", 5)),
                        algorithm="llm-ffd")
    result = pack_manifest(lt, config)
    assert len(result.epoch_num_steps) == 3
    firsts = [_epoch_samples(result, e)[:20].tolist() for e in range(3)]
    assert firsts[0] != firsts[1] != firsts[2]
    assert result.meta["epochs"] == 3


def test_metadata_records_every_parameter():
    lt = _table(200, 2, errors=2)
    config = PackConfig(world_size=2, caps=(("llm", 1600), ("vision", 5)), bounds=(("vision", 4),),
                        iterations=7, seed=5, algorithm="isf", lengths_files=("x.parquet",))
    meta = pack_manifest(lt, config).meta
    assert meta["algorithm"] == "isf" and meta["seed"] == 5 and meta["world_size"] == 2
    assert meta["params"]["caps"] == {"vision": 5, "llm": 1600}
    assert meta["params"]["bounds"] == {"vision": 4, "llm": 1440}  # default bound = 0.9 x cap
    assert meta["params"]["iterations"] == 7 and meta["params"]["cost_model"] == "tokens"
    assert meta["num_samples"] == 200 and meta["lengths_fingerprint"] == lt.fingerprint
    assert meta["lengths_files"] == ["x.parquet"]
    by_reason = meta["summary"]["dropped"]["by_reason"]
    assert sum(v["count"] for r, v in by_reason.items() if r.startswith("missing image")) == 2
    assert set(meta["summary"]["modules"]) == {"vision", "llm"}


def test_sparse_audio_module_is_packed_and_capped():
    lt = _table(500, 3, audio=True)
    assert lt.modules == ("vision", "audio")
    config = PackConfig(world_size=4, caps=(("llm", 4000), ("vision", 8), ("audio", 2)), algorithm="llm-ffd")
    result = pack_manifest(lt, config)
    _check_conservation(lt, result, config)
    assert result.meta["modules"] == ["vision", "audio", "llm"]
    assert "audio" in result.meta["summary"]["modules"]


def test_search_runs_when_a_cap_is_missing():
    lt = _table(600, 4)
    result = pack_manifest(lt, PackConfig(world_size=2, caps=(("llm", 4096),)))
    assert result.meta["params"]["searched"] and result.search is not None
    assert result.meta["params"]["caps"]["llm"] <= 4096
    assert result.meta["params"]["search"]["candidates"] == len(result.search.candidates)


@pytest.mark.parametrize("config, match", [
    (dict(caps=(("llm", 10), ("vision", 5))), r"caps\[llm\] 10 is smaller than every sample"),
    (dict(caps=(("llm", 5000), ("audio", 5))), "unknown module 'audio'"),
    (dict(world_size=500, caps=(("llm", 5000), ("vision", 12)), algorithm="llm-ffd"),
     "world_size 500 x micro_batches 1 needs 500 groups per step"),
    (dict(caps=(("llm", 5000), ("vision", 12)), bounds=(("vision", 13),)), r"bounds\[vision\] 13 exceeds its cap"),
])
def test_bad_configs_raise_usage_errors_naming_parameters(config, match):
    with pytest.raises(UsageError, match=match):
        pack_manifest(_table(100, 5), PackConfig(**config))


def _mostly_long(n: int = 200, short: int = 3):
    """``n`` samples of which ``short`` hold under 100 LLM tokens, the rest 4,000-6,000."""
    rng = np.random.default_rng(0)
    llm = np.concatenate([rng.integers(20, 100, short), rng.integers(4000, 6000, n - short)])
    items = rng.integers(0, 4, n)
    return make_lengths_table(llm + items * 256, {"vision": (items * 256, items)}, source=rng.choice(["a", "b"], n))


@pytest.mark.parametrize("config, match", [
    # drop: 3 samples under the cap cannot fill a step of 8 groups, searched vision cap or given
    ({"world_size": 8, "caps": (("llm", 500),), "oversize": "drop"},
     (r"caps\[llm\] 500 leaves 3 of 200 samples under the caps, fewer than the 8 groups one step of world_size 8 x "
      r"micro_batches 1 needs \(197 over a cap, which oversize drop drops\); fix: raise caps\[llm\] \(the median "
      r"sample holds \d+ tokens\), or lower world_size or micro_batches$")),
    ({"world_size": 4, "micro_batches": 2, "caps": (("llm", 500), ("vision", 9)), "oversize": "drop"},
     r"leaves 3 of 200 samples under the caps, fewer than the 8 groups"),
    # isolate: 197 single-sample groups and 1-3 more: 198-200 groups, no multiple of 64 among them
    ({"world_size": 64, "caps": (("llm", 500),), "oversize": "isolate"},
     (r"caps\[llm\] 500 leaves 3 of 200 samples under the caps, and the 197 over a cap are isolated in groups of "
      r"their own \(oversize isolate\): 198 to 200 groups, none a multiple of the 64 of one step of world_size 64 x "
      r"micro_batches 1; fix: raise caps\[llm\] .*, or drop them with oversize drop$")),
])
def test_given_caps_that_leave_too_few_samples_to_fill_a_step_name_the_cap_to_raise(config, match):
    """Caps far below the data fail before any search or packing with the cap to raise, not with
    a shortage of groups that seems to ask for smaller caps."""
    with pytest.raises(UsageError, match=match):
        pack_manifest(_mostly_long(), PackConfig(**config))


@pytest.mark.parametrize("config", [
    {"world_size": 2, "caps": (("llm", 500),), "oversize": "drop"},  # 3 samples fill a step of 2 groups
    {"world_size": 2, "caps": (("llm", 500),), "oversize": "isolate"},  # 198-200 groups: a multiple of 2 within reach
    {"world_size": 8, "caps": (("llm", 500),), "oversize": "error"},  # the oversize error names the first sample
])
def test_given_caps_that_can_fill_steps_pack_or_fail_as_before(config):
    """Where whole steps are within reach (or ``error`` asks to stop at an oversize sample), the
    check lets the pack run as it did: every sample placed once or listed with its reason."""
    if config["oversize"] == "error":
        with pytest.raises(InputError, match="exceed a cap"):
            pack_manifest(_mostly_long(), PackConfig(**config))
        return
    table, config = _mostly_long(), PackConfig(**config)
    result = pack_manifest(table, config)
    assert sum(result.epoch_num_steps) >= 1
    _check_conservation(table, result, config)


@pytest.mark.parametrize("via", ["pack", "search"])
def test_a_search_that_finds_no_caps_names_the_given_cap_most_samples_are_over(via):
    """Three samples fit under the LLM cap, each over half of it (no two share a group): the
    groups are the 200 samples one a group, none splits, and no multiple of 3 lies within reach.
    The pre-check cannot see that (it allows the three to share); the search's own failure then
    names the cap the user gave that 197 samples are over, for ``balancer pack`` and ``balancer
    search`` alike (both through ``run_search``)."""
    from balancer_cli.pack.pipeline import run_search

    rng = np.random.default_rng(0)
    llm = np.concatenate([[60, 70, 80], rng.integers(4000, 6000, 197)])
    items = rng.integers(0, 4, 200)
    table = make_lengths_table(llm, {"vision": (items * 256, items)}, source=rng.choice(["a", "b"], 200))
    config = PackConfig(world_size=3, caps=(("llm", 100),))
    with pytest.raises(UsageError, match=r"^no candidate caps pack the 200 samples into whole steps of 3 groups .*: "
                                         r"197 of the 200 samples are over caps\[llm\] 100 or another cap given; "
                                         r"fix: raise caps\[llm\] \(the median sample holds \d+ tokens\), or lower"):
        if via == "pack":
            pack_manifest(table, config)
        else:
            run_search(prepare_inputs(table), config)
    # Fewer samples than a step's groups: no cap fills a step, and the error does not ask to raise one.
    with pytest.raises(UsageError, match=r"into whole steps of 6 groups .*; fix: lower world_size or micro_batches$"):
        pack_manifest(make_lengths_table(np.array([4000, 5000]), {"vision": (np.array([256, 0]), np.array([1, 0]))}),
                      PackConfig(world_size=2, micro_batches=3, caps=(("llm", 1951),)))


def test_a_window_of_isolated_samples_that_cannot_split_says_to_raise_the_caps():
    """The whole input can fill steps (198-200 groups at 2 a step), but a window of 67 samples all
    over the LLM cap is 67 single-sample groups: the packer names them and the fixes that help."""
    config = PackConfig(world_size=2, caps=(("llm", 500), ("vision", 9)), oversize="isolate", window_samples=67)
    with pytest.raises(UsageError, match=r"the 67 groups cannot be split to one \(.*; 67 of them single samples over "
                                         r"a cap, isolated\); fix: lower world_size or micro_batches, or raise the "
                                         r"caps those samples exceed, or drop them with oversize drop, or change "
                                         r"window_samples$"):
        pack_manifest(_mostly_long(), config)


@pytest.mark.parametrize("config, match", [
    (dict(caps=(("llm", 5000), ("vision", 0))), r"caps\[vision\] 0 must be a positive integer"),
    (dict(world_size=0), "world_size must be an integer >= 1"),
    (dict(micro_batches=True), "micro_batches must be an integer >= 1"),
    (dict(epochs=2.5), "epochs must be an integer >= 1"),
    (dict(seed=-1), "seed must be an integer >= 0"),
    (dict(algorithm="greedy"), "unknown algorithm 'greedy'; fix: use one of: balanced, dataloader"),
    (dict(oversize="squeeze"), "unknown oversize 'squeeze'"),
    (dict(cost_model="time"), "unknown cost_model 'time'"),
    (dict(target_group_size=0.5), "target_group_size must be a number >= 1"),
])
def test_pack_config_is_validated_once_when_built(config, match):
    with pytest.raises(UsageError, match=match):
        PackConfig(**config)


def test_pack_config_round_trips_through_manifest_metadata():
    config = PackConfig(world_size=4, micro_batches=2, algorithm="isf", caps={"llm": 4096, "vision": 9},
                        bounds={"vision": 8}, iterations=7, oversize="drop", epochs=3, seed=11,
                        target_group_size=4, batch_size=5, lengths_files=("a.parquet",), post_balance=True)
    assert config.shape.groups_per_step == 8 and config.caps == (("llm", 4096), ("vision", 9))
    assert PackConfig.from_meta(config.to_meta()) == config
    assert PackConfig.from_meta(config.to_meta(), seed=2).seed == 2


def test_oversize_error_searches_caps_that_fit_every_sample():
    """``oversize="error"`` asks that no sample be over a cap: the searched caps fit the largest
    sample (isolating allows caps below a long tail), so only a cap given too small fails."""
    lt = _table(3000, 5)
    tail = lt.table.column("llm_tokens").to_numpy().copy()
    tail[[0, 1500]] = 12_000  # two samples (under the 99.9th percentile) of ~1.5 groups' tokens
    lt = make_lengths_table(tail, {"vision": (lt.table.column("vision_tokens").to_numpy(),
                                              lt.table.column("vision_items").to_numpy())},
                            source=lt.table.column("source").to_numpy(zero_copy_only=False))
    isolated = pack_manifest(lt, PackConfig(world_size=4))
    assert isolated.meta["params"]["caps"]["llm"] < 12_000  # the tail is isolated under the searched cap
    strict = pack_manifest(lt, PackConfig(world_size=4, oversize="error"))
    caps = strict.meta["params"]["caps"]
    assert caps["llm"] >= 12_000 and caps["vision"] >= 6 and len(strict.dropped_sample) == 0
    assert len(strict.rows.sample) == lt.num_samples
    with pytest.raises(InputError, match=r"sample 0 has llm load 12000 > cap 4096 \(2 sample"):
        pack_manifest(lt, PackConfig(world_size=4, oversize="error", caps=(("llm", 4096),)))
    # A cap given over the largest sample bounds the search from above only: the searched cap
    # stays between the largest sample and it (it had gone under the largest, and the pack
    # stopped on a cap nobody chose).
    given = pack_manifest(lt, PackConfig(world_size=4, oversize="error", caps=(("llm", 30_000),)))
    assert 12_000 <= given.meta["params"]["caps"]["llm"] <= 30_000 and len(given.rows.sample) == lt.num_samples
    largest_items = int(lt.table.column("vision_items").to_numpy().max())
    given = pack_manifest(lt, PackConfig(world_size=4, oversize="error", caps=(("vision", largest_items + 2),)))
    assert largest_items <= given.meta["params"]["caps"]["vision"] <= largest_items + 2


def test_error_rows_only_is_an_input_error():
    lt = make_lengths_table(np.array([5, 6]), error=["bad record", "bad record"])
    with pytest.raises(InputError, match="all 2 samples have a scan error"):
        pack_manifest(lt, PackConfig(caps=(("llm", 100),)))


def test_unknown_column_is_named():
    lt = _table(20)
    lt = type(lt)(lt.table.append_column("audio_tokens", lt.table.column("llm_tokens")), {}, lt.fingerprint)
    with pytest.raises(InputError, match="unknown column 'audio_tokens'.*audio_items"):
        prepare_inputs(lt)



def test_loads_are_exact_int32_and_errors_count_zero():
    """Loads in int32 up to the largest value a lengths table holds; errors' null lengths count 0."""
    top = 2**31 - 1
    lt = make_lengths_table(np.array([top, 5, 0]), {"vision": (np.array([256, 0, 0]), np.array([1, 0, 0]))},
                            error=[None, None, "unreadable"])
    inputs = prepare_inputs(lt)
    assert inputs.load_NK.dtype == np.int32
    assert inputs.load_NK.tolist() == [[1, top], [0, 5], [0, 0]]
    assert inputs.cost_NK.tolist() == [[256.0, float(np.float32(top))], [0.0, 5.0], [0.0, 0.0]]

@settings(max_examples=40, deadline=None)
@given(tokens=st.lists(st.integers(0, 300), min_size=1, max_size=200), cap=st.integers(50, 400),
       oversize=st.sampled_from(["isolate", "drop"]), seed=st.integers(0, 99))
def test_llm_ffd_conserves_and_respects_the_llm_cap(tokens, cap, oversize, seed):
    load = np.stack([np.zeros(len(tokens), int), np.array(tokens)], axis=1)
    packing = pack_llm_ffd(load, np.array([1, cap]), seed=seed, oversize=oversize)
    check_packing(packing, len(tokens), load[:, 1:], np.array([cap]))
    # First fit never leaves two groups at most half full: the later one's items would have fit earlier.
    sums = np.array([load[g, 1].sum() for g, iso in zip(packing.groups(), packing.isolated) if not iso])
    assert (sums <= cap / 2).sum() <= 1


def test_llm_ffd_oversize_error_names_the_sample():
    with pytest.raises(InputError, match="sample 1 has 900 LLM tokens"):
        pack_llm_ffd(np.array([[0, 10], [0, 900]]), np.array([1, 100]), oversize="error")


def test_random_batching_has_fixed_batch_size():
    ids = np.arange(10, 33)
    packing = pack_random(len(ids), 5, seed=3, sample_ids=ids)
    check_packing(type(packing)(packing.order - 10, packing.group_offsets, packing.isolated,
                                packing.dropped, ()), len(ids))
    assert packing.group_sizes().tolist() == [5, 5, 5, 5, 3]
    assert default_batch_size(np.array([[1, 100]] * 10), np.array([10, 250])) == 2


def test_config_literal_types_name_exactly_the_registered_choices():
    from typing import get_args

    from balancer_cli.cost.samples import COST_MODELS
    from balancer_cli.pack.config import CostModelName
    from balancer_cli.pack.packers.registry import Algorithm

    assert set(get_args(Algorithm)) == set(PACKERS) and set(get_args(CostModelName)) == set(COST_MODELS)


@pytest.mark.parametrize("values, message", [
    ([5, 3_000_000_000, 7], "sample 1 has 'llm_tokens' = 3000000000, past int32"),
    ([5, -3, 7], "sample 1 has negative 'llm_tokens' = -3"),
])
def test_arrays_out_of_range_are_named_not_wrapped(values, message):
    """An array past int32 is refused with its value (it was wrapped to a negative one before)."""
    with pytest.raises(InputError, match=message):
        make_lengths_table(np.array(values))


def test_lower_bound_of_read_only_loads_is_remembered_and_never_stale():
    """Every row of a read-only array: computed once per (array, caps); writable arrays are never remembered."""
    rng = np.random.default_rng(0)
    load = np.stack([rng.integers(0, 12, 500), rng.integers(10, 3000, 500)], axis=1)
    caps = np.array([18, 6400])
    expect = groups_lower_bound(load, caps)
    frozen = load.copy()
    frozen.setflags(write=False)
    assert groups_lower_bound(frozen, caps) == expect == groups_lower_bound(frozen, caps)
    assert groups_lower_bound(frozen, caps * 2) == groups_lower_bound(load, caps * 2) < expect
    assert groups_lower_bound(frozen, caps) == expect
    load[:, 1] = 6000  # a writable array changed in place: its bound follows
    assert groups_lower_bound(load, caps) == 500 != expect
    other = load.copy()
    other.setflags(write=False)
    assert groups_lower_bound(other, caps) == 500 and groups_lower_bound(frozen, caps) == expect
    assert prepare_inputs(make_lengths_table(np.arange(1, 5))).load_NK.flags.writeable is False


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 300), chunks=st.integers(1, 4), seed=st.integers(0, 2**31 - 1), wide=st.booleans())
def test_inputs_read_the_columns_as_sample_costs_and_the_int64_accessors_do(n, chunks, seed, wide):
    """The matrices come from the table's own columns (no int64/float64 copies): the same values as
    ``sample_costs`` (tokens) and the int64 accessors, for chunked tables and errors with null lengths."""
    import pyarrow as pa

    from balancer_cli.cost.samples import sample_costs
    from balancer_cli.lengths import LengthsTable

    rng = np.random.default_rng(seed)
    items = rng.integers(0, 9, n)
    top = 2**31 - 1 if wide else 2**24  # past float32's exact integers, or within them
    table = make_lengths_table(rng.integers(1, top, n), {"vision": (rng.integers(0, top, n), items)},
                               error=[None if rng.random() > 0.2 else "bad" for _ in range(n)]).table
    nulls = pa.array(np.asarray(table.column("llm_tokens")), mask=~np.asarray(table.column("error").is_null()))
    table = table.set_column(table.column_names.index("llm_tokens"), "llm_tokens", nulls)
    lengths = LengthsTable(pa.Table.from_batches(table.to_batches(max_chunksize=max(1, n // chunks))))
    inputs = prepare_inputs(lengths)
    costs = sample_costs(lengths)
    for k, module in enumerate(inputs.modules):
        assert np.array_equal(inputs.cost_NK[:, k], costs[module].astype(np.float32))
    assert np.array_equal(inputs.load_NK[:, 0], lengths.items("vision"))
    assert np.array_equal(inputs.load_NK[:, 1], lengths.llm_tokens())
    assert lengths.llm_tokens().dtype == np.int64 and lengths.llm_tokens(stored=True).dtype == np.int32
