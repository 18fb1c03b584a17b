"""``balancer calibrate`` on CPU with a tiny Qwen2-VL config: real modules, a fit, costs.json, consumers."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from click.testing import CliRunner

from balancer_cli.cli import main
from balancer_cli.cost.calibration import sequence_lengths
from balancer_cli.cost.fit import group_features
from balancer_cli.cost.measured import read_costs
from balancer_cli.lengths import make_lengths_table, read_lengths, write_lengths
from balancer_cli.manifest import open_manifest
from balancer_cli.runtime.calibrate import calibrate, replay_times
from balancer_cli.runtime.calibrate.families import FAMILIES, family_for
from balancer_cli.runtime.calibrate.measure import Measurement

TINY = dict(vision_config=dict(depth=2, embed_dim=32, num_heads=2, hidden_size=48, mlp_ratio=2, patch_size=14,
                               spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
            text_config=dict(num_hidden_layers=2, hidden_size=48, intermediate_size=96, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256, bos_token_id=1, eos_token_id=2,
                             max_position_embeddings=8192, rope_scaling={"type": "mrope", "mrope_section": [2, 2, 2]}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen2-vl")
    transformers.Qwen2VLConfig(**TINY).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def lengths_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    n = 240
    items = rng.integers(0, 4, size=n)
    per_item = 4 * rng.integers(8, 300, size=n)
    llm = rng.integers(20, 600, size=n) + items * per_item // 4
    lt = make_lengths_table(llm, {"vision": (items * per_item, items)})
    path = tmp_path_factory.mktemp("lengths") / "lengths.parquet"
    write_lengths(lt, path)
    return path


TRUE = {"vision": np.array([2e-9, 3e-6, 4e-4, 1e-3]), "llm": np.array([1e-9, 2e-5, 8e-4, 2e-3])}


def _fake_measure(module_of):
    """A deterministic timer: the true cost of the shape, scaled by the runner's share of layers."""
    def measure(run, shapes, on_run):
        out = []
        for shape in shapes:
            on_run()
            t = float(group_features(shape) @ TRUE[module_of(run)])
            out.append(Measurement(seconds=t * (0.25 + 0.75 * run.layers / 2)))
        return out
    return measure


def test_packed_llm_attention_stays_within_each_sample(model_dir):
    """The LLM's packed group attends per sample (varlen): sample 2 of a pack = sample 2 run alone."""
    from balancer_cli.runtime.calibrate import families as F

    config = transformers.AutoConfig.from_pretrained(str(model_dir))
    for attention in ("sdpa", "eager"):
        body = F._build_model(transformers.models.qwen2_vl.modeling_qwen2_vl.Qwen2VLTextModel, config.text_config,
                              attention="sdpa", dtype=torch.float32, device=torch.device("cpu"))
        ids = torch.randint(256, (1, 30))
        kw = F._packed_kwargs([10, 20], torch.device("cpu"))
        kw["position_ids"] = kw["position_ids"][None].expand(4, 1, -1)
        F._set_attention(body.config, F._attention_name(attention))
        packed = body(input_ids=ids, attention_mask={"full_attention": None}, use_cache=False, **kw).last_hidden_state
        F._set_attention(body.config, "sdpa")
        alone = body(input_ids=ids[:, 10:], use_cache=False).last_hidden_state
        torch.testing.assert_close(packed[0, 10:], alone[0], rtol=1e-4, atol=1e-5)


def test_calibrate_recovers_the_cost_from_exact_times_and_scales_layers(model_dir, lengths_file):
    lt = read_lengths(lengths_file)

    def module_of(run):
        return "vision" if run.__qualname__.startswith("_qwen_build") else "llm"

    costs = calibrate(model_dir, lt, measure_fn=_fake_measure(module_of), num_lengths=4, num_heldout=8)
    assert [m for m, _ in costs.modules] == ["vision", "llm"]
    for module, fit in costs.modules:
        np.testing.assert_allclose(fit.coeffs, TRUE[module], rtol=1e-6, atol=1e-12)
        assert fit.extra("r2_heldout") == pytest.approx(1.0) and fit.extra("max_rel_err_heldout") < 1e-6
        assert fit.extra("flops_r2_heldout") <= 1.0 and len(fit.extra("per_layer_seconds")) == 2
    # one layer of two, scaled to the full depth: t0 + 2 * (t1 - t0) is the 2-layer time again
    scaled = calibrate(model_dir, lt, measure_fn=_fake_measure(module_of), num_lengths=4, num_heldout=8, layers=1)
    for (_, a), (_, b) in zip(costs.modules, scaled.modules):
        np.testing.assert_allclose(a.coeffs, b.coeffs, rtol=1e-6, atol=1e-12)
    doc = costs.to_json()
    assert doc["schema_version"] == 1 and doc["model_type"] == "qwen2_vl" and "torch" in doc["versions"]


def test_cli_calibrates_for_real_and_pack_search_report_consume_it(model_dir, lengths_file, tmp_path):
    runner = CliRunner()
    costs = tmp_path / "costs.json"
    result = runner.invoke(main, ["calibrate", str(model_dir), "--lengths", str(lengths_file), "--max-llm-tokens", "2048",
                                  "--max-vision-items", "8", "--repeats", "1", "--warmup", "1", "-o", str(costs),
                                  "--quiet", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    doc = json.loads(costs.read_text())
    assert summary["modules"] == doc["modules"] and set(doc["modules"]) == {"vision", "llm"}
    for entry in doc["modules"].values():
        assert all(v >= 0 and np.isfinite(v) for v in entry["coeffs"].values())
        # real timings on a shared CI machine: the figure is reported, its size is not a test
        assert np.isfinite(entry["r2_heldout"]) and entry["r2_heldout"] <= 1.0 and entry["unit"] == "seconds"
    assert doc["limits"] == {"llm": {"max_total": 2048}, "vision": {"max_count": 8}}
    assert read_costs(costs).module("llm").extra("shapes")["fit"] >= 4

    out = tmp_path / "out"
    args = ["pack", str(lengths_file), "--dp", "2", "--max-llm-tokens", "2048", "--max-vision-items", "8",
            "--cost-model", "measured", "--costs", str(costs), "--baselines", "none", "-o", str(out), "--json"]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    manifest = open_manifest(out)
    assert manifest.meta["params"]["cost_model"] == "measured"
    assert manifest.meta["params"]["costs"]["modules"] == doc["modules"]
    rows = manifest.read_all()
    assert sorted(rows.sample.tolist()) == list(range(240))  # every sample once
    again = tmp_path / "again"
    assert runner.invoke(main, args[:-3] + ["-o", str(again), "--json"]).exit_code == 0
    assert (again / "manifest.parquet").read_bytes() == (out / "manifest.parquet").read_bytes()

    # a token-packed manifest, reported in measured seconds
    tokens = tmp_path / "tokens"
    assert runner.invoke(main, args[:8] + ["--baselines", "none", "-o", str(tokens)]).exit_code == 0
    result = runner.invoke(main, ["report", str(tokens), "--cost-model", "measured", "--costs", str(costs), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["manifest"]["cost_model"] == "measured"
    assert "measured with cost model measured" in (tokens / "report.md").read_text()
    bad = runner.invoke(main, ["report", str(tokens), "--costs", str(costs)])
    assert bad.exit_code == 2 and "--cost-model" in bad.output
    bad = runner.invoke(main, ["pack", str(lengths_file), "--dp", "2", "--cost-model", "measured", "-o", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "--costs" in bad.output
    bad = runner.invoke(main, ["pack", str(lengths_file), "--dp", "2", "--costs", str(costs), "-o", str(tmp_path / "y")])
    assert bad.exit_code == 2 and "--cost-model measured" in bad.output
    result = runner.invoke(main, ["search", str(lengths_file), "--dp", "2", "--max-llm-tokens", "2048", "--cost-model",
                                  "measured", "--costs", str(costs), "--sample-size", "100", "--quiet", "--json"])
    assert result.exit_code == 0, result.output

    # plan-partition takes the calibration's per-layer times as its profile
    model = tmp_path / "llm.json"
    model.write_text(json.dumps({"kind": "llm", "num_layers": 2, "hidden_size": 48, "ffn_hidden_size": 96,
                                 "num_heads": 4, "num_kv_heads": 2, "vocab_size": 256}))
    result = runner.invoke(main, ["plan-partition", "--llm-model", str(model), "--stages", "2", "--profile", str(costs),
                                  "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["cost_unit"] == "seconds"
    result = runner.invoke(main, ["plan-recompute", "--llm-model", str(model), "--stages", "2", "--profile", str(costs),
                                  "--gpu-memory-gb", "80", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["settings"]["stages_from"] == "profile"

    # the replay of the manifest's first steps times every group of every rank
    [times] = replay_times(model_dir, [out], read_lengths(lengths_file), steps=2, repeats=1, warmup=0)
    assert times["steps"] == 2 and np.array(times["seconds"]["llm"]).shape == (2, 2)
    assert (np.array(times["seconds"]["llm"]) > 0).all() and 0 <= times["step_dist_ratio"] < 1


def test_cli_errors_are_one_line(model_dir, lengths_file, tmp_path):
    runner = CliRunner()
    base = ["calibrate", str(model_dir), "--lengths", str(lengths_file)]
    result = runner.invoke(main, ["calibrate", str(tmp_path), "--lengths", str(lengths_file), "-o", str(tmp_path / "c.json")])
    assert result.exit_code == 1 and "no config.json" in result.output and "Traceback" not in result.output
    result = runner.invoke(main, base + ["--modules", "audio", "-o", str(tmp_path / "c.json")])
    assert result.exit_code == 2 and "no module 'audio'" in result.output
    result = runner.invoke(main, base + ["-o", str(lengths_file)])
    assert result.exit_code == 1 and "is also an input" in result.output  # refused before any work
    result = runner.invoke(main, base + ["--device", "gpu", "-o", str(tmp_path / "c.json")])
    assert result.exit_code == 2 and "unknown device 'gpu'" in result.output
    result = runner.invoke(main, base + ["--attention", "flash_attention_2", "--quiet", "-o", str(tmp_path / "c.json")])
    assert result.exit_code == 2 and "CUDA devices only" in result.output
    result = runner.invoke(main, base + ["--device", "cuda:7", "-o", str(tmp_path / "c.json")])
    if not torch.cuda.is_available():
        assert result.exit_code == 2 and "--device cpu" in result.output
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"model_type": "no-such-model"}')
    result = runner.invoke(main, ["calibrate", str(tmp_path / "bad"), "--lengths", str(lengths_file), "-o",
                                  str(tmp_path / "c.json")])
    assert result.exit_code == 1 and "config.json" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "c.json").exists()


def test_family_registry_covers_causal_lms():
    config = transformers.Qwen2Config(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=128)
    family = family_for(config)
    assert family is FAMILIES["causal-lm"] and family.modules == ("llm",)
    run = family.build(config, "llm", 1, torch.device("cpu"), torch.float32, "sdpa")
    run([5, 9])
    assert run.layers == 1


def test_measured_costs_give_the_lowest_measured_time_imbalance(model_dir, tmp_path):
    """End to end with a known truth: the timer's times are a fixed function of the shape (a large
    per-sample overhead tokens and FLOPs do not see); the packing with the calibration fitted on it
    has the lowest Dist Ratio of that time, below tokens and FLOPs, when the manifests are replayed."""
    from balancer_cli.pack.config import PackConfig
    from balancer_cli.run import pack_to_dir
    from balancer_cli.runtime.calibrate.run import flops_model_files

    truth = {"vision": np.array([1e-9, 2e-6, 3e-3, 1e-3]), "llm": np.array([3e-9, 1e-6, 4e-3, 1e-3])}

    def measure(run, shapes, on_run):
        module = "vision" if run.__qualname__.startswith("_qwen_build") else "llm"
        return [Measurement(seconds=float(group_features(s) @ truth[module])) for s in shapes]

    rng = np.random.default_rng(3)
    n = 3000
    short = rng.random(n) < 0.5
    llm = np.where(short, rng.integers(20, 120, size=n), rng.integers(400, 2400, size=n))
    items = rng.integers(0, 3, size=n)
    lt = make_lengths_table(llm, {"vision": (items * 4 * rng.integers(16, 200, size=n), items)})
    path = tmp_path / "lengths.parquet"
    write_lengths(lt, path)
    costs = calibrate(model_dir, lt, measure_fn=measure, num_lengths=5, num_heldout=8)
    models = flops_model_files(model_dir, tmp_path)
    common = dict(world_size=4, caps=(("llm", 4096), ("vision", 6)), seed=1)
    packed = {
        "tokens": pack_to_dir([path], tmp_path / "tokens", PackConfig(**common), baselines=()),
        "flops": pack_to_dir([path], tmp_path / "flops", PackConfig(**common, cost_model="flops", cost_presets=tuple(
            sorted(models.items()))), baselines=()),
        "measured": pack_to_dir([path], tmp_path / "measured", PackConfig(**common, cost_model="measured", costs=costs),
                                baselines=()),
    }
    times = replay_times(model_dir, [s["out"] for s in packed.values()], lt, steps=10_000, measure_fn=measure)
    dist = {name: t["dist_ratio"]["llm"] for name, t in zip(packed, times)}
    assert dist["measured"] < 0.5 * min(dist["tokens"], dist["flops"]), dist
    step = {name: t["step_dist_ratio"] for name, t in zip(packed, times)}
    assert step["measured"] < min(step["tokens"], step["flops"]), step


def test_peak_memory_is_fitted_and_gives_the_largest_cap_that_fits(model_dir, lengths_file):
    mem = {"vision": np.array([0.0, 4e3, 1e5, 2e8]), "llm": np.array([50.0, 2e4, 1e5, 5e8])}

    def measure(run, shapes, on_run):
        module = "vision" if run.__qualname__.startswith("_qwen_build") else "llm"
        return [Measurement(seconds=float(group_features(s) @ TRUE[module]),
                            peak_bytes=int(group_features(s) @ mem[module])) for s in shapes]

    costs = calibrate(model_dir, read_lengths(lengths_file), measure_fn=measure, num_lengths=4, num_heldout=8,
                      gpu_memory_gb=1.0, margin=0.1)
    for module, fit in costs.modules:
        memory = fit.extra("memory")
        got = np.array([memory["coeffs"][k] for k in ("quadratic", "linear", "count", "constant")])
        np.testing.assert_allclose(got, mem[module], rtol=1e-3, atol=1e-3)
        cap = memory["cap"]
        assert cap > 0 and memory["cap_unit"] == ("tokens" if module == "llm" else "items")
        budget = 0.9e9
        if module == "llm":  # a group at the cap fits, as one sequence and as many short ones
            assert group_features([cap]) @ mem["llm"] <= budget
            assert group_features([20] * (cap // 20)) @ mem["llm"] <= budget
        else:  # cap items of the longest kind fit, one more does not
            longest = max(l for l in sequence_lengths(read_lengths(lengths_file), "vision"))
            longest = -(-longest // 4) * 4
            assert group_features([longest] * cap) @ mem["vision"] <= budget < group_features([longest] * (cap + 1)) @ mem["vision"]
    with pytest.raises(Exception, match="needs a GPU"):
        calibrate(model_dir, read_lengths(lengths_file), gpu_memory_gb=1.0)


def test_missing_transformers_is_one_clear_line(monkeypatch, model_dir, lengths_file, tmp_path):
    import sys

    for name in [m for m in sys.modules if m.startswith("balancer_cli.runtime.calibrate")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    result = CliRunner().invoke(main, ["calibrate", str(model_dir), "--lengths", str(lengths_file), "-o",
                                       str(tmp_path / "c.json")])
    assert result.exit_code == 1 and "needs torch and transformers" in result.output and "pip install" in result.output
    assert "Traceback" not in result.output
