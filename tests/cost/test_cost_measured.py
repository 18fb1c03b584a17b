"""The measured cost model's pure core: the fit, the costs.json schema, per-sample costs, the shape grid."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer_cli.cost.calibration import (
    GridSpec,
    default_limits,
    group_shapes,
    plan_shapes,
    sequence_lengths,
)
from balancer_cli.cost.fit import fit_quality, group_features, nnls_fit, scale_fit
from balancer_cli.cost.measured import (
    MeasuredCosts,
    ModuleFit,
    measured_sample_costs,
    read_costs,
    sequence_features,
)
from balancer_cli.cost.samples import sample_costs
from balancer_cli.errors import InputError, UsageError
from balancer_cli.lengths import make_lengths_table

DOC = {"schema_version": 1, "device": "cpu", "dtype": "float32", "attention": "sdpa", "versions": {"torch": "x"},
       "config_fingerprint": "abc", "modules": {
           "vision": {"coeffs": {"quadratic": 1e-9, "linear": 2e-6, "count": 1e-3, "constant": 0.01}, "unit": "seconds",
                      "r2_heldout": 0.99, "per_layer_seconds": [0.1, 0.1], "other_seconds": 0.02},
           "llm": {"coeffs": {"quadratic": 2e-9, "linear": 1e-5, "count": 5e-4, "constant": 0.002}, "unit": "seconds",
                   "r2_heldout": 0.98, "per_layer_seconds": [0.2, 0.2, 0.2], "other_seconds": 0.05}}}


def _table():
    return make_lengths_table(np.array([300, 40, 1000, 7]),
                              {"vision": (np.array([512, 0, 2048, 100]), np.array([2, 0, 1, 1]))},
                              error=[None, None, None, "corrupt image"])


@given(st.lists(st.floats(0, 10), min_size=4, max_size=4), st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_nnls_recovers_non_negative_coefficients(coeffs, seed):
    rng = np.random.default_rng(seed)
    shapes = [tuple(rng.integers(1, 500, size=rng.integers(1, 9))) for _ in range(30)]
    f = np.stack([group_features(s) for s in shapes])
    truth = np.array(coeffs) * np.array([1e-6, 1e-3, 1.0, 1.0])
    t = f @ truth + 1e-9
    got = nnls_fit(f, t)
    assert (got >= 0).all()
    np.testing.assert_allclose(f @ got, t, rtol=1e-6)


def test_nnls_clamps_what_would_be_negative_and_quality_is_judged():
    f = np.stack([group_features([l] * n) for l in (10, 100, 1000) for n in (1, 2, 4)])
    t = f @ np.array([0.0, 1.0, -5.0, 0.0]) + 50.0  # a negative per-sample time is not a cost
    got = nnls_fit(f, np.maximum(t, 1.0))
    assert (got >= 0).all()
    r2, worst = fit_quality(f @ got, np.maximum(t, 1.0))
    assert 0.9 < r2 <= 1.0 and worst >= 0
    assert fit_quality(np.array([2.0]), np.array([2.0])) == (1.0, 0.0)
    assert scale_fit(np.array([1.0, 2.0, 4.0]), np.array([2.0, 4.0, 8.0])) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        nnls_fit(f, t[:-1])


def test_costs_json_round_trip_and_errors_name_the_field(tmp_path):
    costs = MeasuredCosts.from_json(DOC)
    assert [m for m, _ in costs.modules] == ["vision", "llm"]
    again = MeasuredCosts.from_json(json.loads(json.dumps(costs.to_json())))
    assert again == costs and again.to_json() == costs.to_json()
    assert costs.module("llm").extra("r2_heldout") == 0.98
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(DOC))
    assert read_costs(path) == costs
    for bad, needle in ((dict(DOC, schema_version=2), "schema_version 2"),
                        (dict(DOC, modules={}), "'modules'"),
                        (dict(DOC, modules={"llm": {"coeffs": {"quadratic": -1, "linear": 0, "count": 0}}}),
                         "modules.llm.coeffs.quadratic is -1"),
                        (dict(DOC, modules={"llm": {"coeffs": {"quadratic": 0, "linear": "x", "count": 0}}}),
                         "coeffs.linear is 'x'")):
        path.write_text(json.dumps(bad))
        with pytest.raises(InputError, match=needle) as err:
            read_costs(path)
        assert str(path) in str(err.value)
    path.write_text("{not json")
    with pytest.raises(InputError, match="cannot read costs JSON"):
        read_costs(path)
    with pytest.raises(UsageError, match="no module 'audio'.*calibrated: vision, llm"):
        costs.module("audio")


def test_measured_sample_costs_are_the_formula_and_errors_cost_nothing():
    lt = _table()
    costs = MeasuredCosts.from_json(DOC)
    got = measured_sample_costs(lt, costs)
    v, l_ = costs.module("vision"), costs.module("llm")
    # vision: sample 0 has 2 items of 256 patches, sample 2 one of 2048; sample 3 has an error
    assert got["vision"][0] == pytest.approx(v.quadratic * 2 * 256 ** 2 + v.linear * 512 + v.count * 2)
    assert got["vision"][2] == pytest.approx(v.quadratic * 2048 ** 2 + v.linear * 2048 + v.count)
    assert got["vision"][1] == 0 and got["vision"][3] == 0 and got["llm"][3] == 0
    assert got["llm"][1] == pytest.approx(l_.quadratic * 1600 + l_.linear * 40 + l_.count)
    assert sample_costs(lt, "measured", costs=costs)["llm"].tolist() == got["llm"].tolist()
    with pytest.raises(UsageError, match="needs a calibration"):
        sample_costs(lt, "measured")
    only_llm = MeasuredCosts.from_json(dict(DOC, modules={"llm": DOC["modules"]["llm"]}))
    with pytest.raises(UsageError, match="no module 'vision'"):
        measured_sample_costs(lt, only_llm)


@given(st.lists(st.lists(st.integers(1, 900), min_size=0, max_size=4), min_size=1, max_size=30),
       st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_group_shapes_carry_exactly_the_features_of_their_samples(items, seed):
    """Conservation: a group's shape has the summed per-sample features of its samples (with seqlens)."""
    seqlens = [tuple(x) for x in items]
    tokens = np.array([sum(s) for s in seqlens])
    lt = make_lengths_table(np.arange(1, len(items) + 1) * 10, {"vision": (tokens, np.array([len(s) for s in seqlens]))},
                            seqlens={"vision": seqlens})
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(items))
    groups = np.array_split(order, max(1, len(items) // 3))
    feats = sequence_features(lt, "vision")
    for group, shape in zip(groups, group_shapes(lt, "vision", groups)):
        np.testing.assert_allclose(group_features(shape)[:3] if shape else np.zeros(3), feats[group].sum(axis=0))
    for group, shape in zip(groups, group_shapes(lt, "llm", groups)):
        assert sorted(shape) == sorted(int(x) for x in lt.llm_tokens()[group])


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=200), st.integers(1, 20000), st.integers(1, 4),
       st.integers(0, 9))
@settings(max_examples=60, deadline=None)
def test_plan_shapes_stay_within_the_limits(lengths, limit, quantum, seed):
    spec = GridSpec(max_total=max(limit, quantum * -(-min(lengths) // quantum)), num_lengths=4, num_heldout=5,
                    quantum=quantum, seed=seed)
    fit, held = plan_shapes(np.array(lengths), spec)
    assert fit and len(held) == 5
    for shape in fit + held:
        assert shape and spec.fits(shape) and all(l % quantum == 0 for l in shape)
    assert plan_shapes(np.array(lengths), spec) == (fit, held)  # same seed, same shapes
    # fit shapes are uniform groups from 1 up to the most that fit
    assert any(len(s) == 1 for s in fit)


def test_grid_limits_and_errors():
    lt = _table()
    assert sequence_lengths(lt, "vision").tolist() == [256, 256, 2048]
    assert default_limits(np.array([100, 200, 300]), "llm") == {"max_total": 1600}
    assert default_limits(np.array([256]), "vision", np.array([2, 0, 1]))["max_count"] >= 8
    with pytest.raises(UsageError, match="no sample has vision"):
        default_limits(np.array([], dtype=np.int64), "vision")
    with pytest.raises(UsageError, match="no sequence fits"):
        plan_shapes(np.array([500]), GridSpec(max_total=100))
    with pytest.raises(UsageError, match="group limit"):
        GridSpec()


def test_post_balance_coefficients_match_precomputed_costs():
    from balancer_cli.replay.post_balance import plan_post_balance

    costs = MeasuredCosts.from_json(DOC)
    rng = np.random.default_rng(0)
    lengths_by_rank = [rng.integers(1, 4000, size=(6, 1)).astype(float) for _ in range(4)]
    fit = costs.module("llm")
    precomputed = [np.array([[fit.group_seconds([l]) - fit.constant] for l in r[:, 0]]) for r in lengths_by_rank]
    a = plan_post_balance(lengths_by_rank, modules=("llm",), cost_coeffs=costs.cost_coeffs(["llm"]), balance_llm=True)
    b = plan_post_balance(precomputed, modules=("llm",), balance_llm=True)
    np.testing.assert_allclose(a.load_after, b.load_after)
    assert a.dest_KN.tolist() == b.dest_KN.tolist()
    with pytest.raises(UsageError, match="cost_coeffs entry"):
        plan_post_balance(lengths_by_rank, modules=("llm",), cost_coeffs=[(1.0,)])


def test_module_fit_checks_its_coefficients():
    with pytest.raises(ValueError, match="'count'"):
        ModuleFit(quadratic=0.0, linear=1.0, count=-1.0)
    assert ModuleFit(quadratic=0.0, linear=2.0, count=1.0, constant=0.5).group_seconds([3, 4]) == 16.5
