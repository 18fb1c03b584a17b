"""plan-partition / plan-recompute through the CLI: JSON contract, inputs, errors and exit codes."""

from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner

from balancer_cli.cli import main
from balancer_cli.lengths import make_lengths_table, write_lengths
from balancer_cli.manifest import ManifestRows, write_manifest

VIT = ["--vision", "internvit-6b", "--llm", "internlm2-20b"]


def run(args):
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.output


def test_plan_partition_json_contract_without_data():
    code, out = run(["plan-partition", *VIT, "--stages", "4", "--group-llm-tokens", "4096",
                     "--group-vision-items", "10", "--json"])
    assert code == 0, out
    s = json.loads(out)
    assert len(s["layers"]) == 97 and {"name", "module", "cost"} <= set(s["layers"][0])
    assert [st["layers"][0] for st in s["stages"]][0] == 0 and s["stages"][-1]["layers"][1] == 96
    assert all({"layers", "cost", "cut_bytes"} <= set(st) for st in s["stages"])
    assert s["largest_stage"] == max(st["cost"] for st in s["stages"])
    assert s["largest_stage"] <= 1.02 * s["optimum"]["max_cost"]
    assert s["largest_stage"] < s["equal_split"]["max_cost"]
    assert s["megatron_args"][0] == "--pipeline-model-parallel-size 4"
    assert s["workload_source"]["source"] == "explicit"


def test_plan_partition_text_and_lengths_input(tmp_path, internvl_lengths):
    code, out = run(["plan-partition", *VIT, "--stages", "8", "--lengths", str(internvl_lengths[0])])
    assert code == 0, out
    assert "exact optimum" in out and "equal layers/stage" in out and "Megatron-LM:" in out and "PARTS = [0," in out


def test_plan_partition_from_manifest_uses_its_groups(tmp_path):
    lt = make_lengths_table(np.array([1000, 3000, 500, 2500]),
                            {"vision": (np.array([256, 1024, 0, 512]), np.array([1, 4, 0, 2]))})
    write_lengths(lt, tmp_path / "l.parquet")
    rows = ManifestRows(step=np.array([0, 0, 0, 0]), rank=np.array([0, 0, 1, 1]), micro=np.zeros(4, int),
                        sample=np.array([0, 1, 2, 3]))
    write_manifest(tmp_path / "m", rows, dropped_sample=np.array([], np.int64), dropped_reason=[],
                   meta={"world_size": 2, "micro_batches": 1, "num_samples": 4, "seed": 0,
                         "lengths_fingerprint": lt.fingerprint})
    code, out = run(["plan-partition", *VIT, "--stages", "2", "--manifest", str(tmp_path / "m"),
                     "--lengths", str(tmp_path / "l.parquet"), "--json"])
    assert code == 0, out
    s = json.loads(out)
    assert s["workload_source"]["num_groups"] == 2
    assert s["typical_group"]["llm.tokens"] == 3500.0 and s["typical_group"]["vision.tokens"] == 3.5 * 1025
    # memory checks the heavier group (5 tiles), the typical one is the mean
    code, out = run(["plan-recompute", *VIT, "--stages", "2", "--manifest", str(tmp_path / "m"),
                     "--lengths", str(tmp_path / "l.parquet"), "--gpu-memory-gb", "80", "--zero-stage", "1",
                     "--dp", "8", "--tp", "2", "--json"])
    assert code == 0, out
    # a manifest from other lengths is refused
    other = make_lengths_table(np.array([1, 2, 3, 4]))
    write_lengths(other, tmp_path / "o.parquet")
    code, out = run(["plan-partition", *VIT, "--stages", "2", "--manifest", str(tmp_path / "m"),
                     "--lengths", str(tmp_path / "o.parquet")])
    assert code == 1 and "fingerprint" in out
    code, out = run(["plan-partition", *VIT, "--stages", "2", "--manifest", str(tmp_path / "m")])
    assert code == 2 and "--lengths" in out


def test_profile_overrides_costs(tmp_path):
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"llm.embedding": 0.0, "llm.layer": 0.01, "llm.head": 0.045}))
    code, out = run(["plan-partition", "--llm", "llama3-8b", "--stages", "2", "--profile", str(profile), "--json"])
    assert code == 0, out
    s = json.loads(out)
    assert s["cost_unit"] == "seconds" and s["layers"][1]["cost"] == 0.01
    assert [st["layers"] for st in s["stages"]] == [[0, 18], [19, 33]]  # 18 layers | 14 layers + head (4.5 layers)
    profile.write_text(json.dumps({"llm.layr": 1}))
    code, out = run(["plan-partition", "--llm", "llama3-8b", "--stages", "2", "--profile", str(profile)])
    assert code == 1 and "unknown layer 'llm.layr'" in out
    profile.write_text("[1, 2]")
    code, out = run(["plan-partition", "--llm", "llama3-8b", "--stages", "2", "--profile", str(profile)])
    assert code == 1 and "2 times for 34 layers" in out


def test_plan_recompute_fits_shrinks_and_fails():
    base = ["plan-recompute", *VIT, "--stages", "4", "--tp", "4", "--group-llm-tokens", "8192",
            "--group-vision-items", "24", "--zero-stage", "1", "--dp", "8", "--json"]
    counts = []
    for gb in ("400", "80", "40"):
        code, out = run([*base, "--gpu-memory-gb", gb])
        assert code == 0, out
        s = json.loads(out)
        assert all(st["memory_gb"] <= s["budget_gb"] + 1e-9 for st in s["stages"])
        assert all({"recompute_layers", "memory_gb", "overhead"} <= set(st) for st in s["stages"])
        counts.append(s["recomputed_layers"])
    assert counts[0] == 0 and counts[0] <= counts[1] < counts[2]
    code, out = run([*base[:-1], "--gpu-memory-gb", "8"])
    assert code == 1 and out.startswith("Error: no recompute plan fits 8 GB") and "GB with every layer recomputed" in out
    code, out = run([*base[:-1], "--gpu-memory-gb", "80"])
    assert "--recompute-granularity" in out or "(no recomputation)" in out


def test_plan_recompute_cuts_option():
    base = ["plan-recompute", "--llm", "llama3-8b", "--stages", "2", "--gpu-memory-gb", "80", "--zero-stage", "1",
            "--dp", "8"]
    code, out = run([*base, "--cuts", "10", "--json"])
    assert code == 0 and json.loads(out)["stages"][1]["layers"] == [10, 33]
    code, out = run([*base, "--cuts", "10,20"])
    assert code == 2 and "--cuts" in out
    code, out = run([*base, "--cuts", "x"])
    assert code == 2


def test_bad_models_and_inputs(tmp_path):
    code, out = run(["plan-partition", "--vision", "internvit-7b", "--llm", "qwen2-7b", "--stages", "2"])
    assert code == 2 and "unknown model preset 'internvit-7b'" in out and "internvit-6b" in out and "siglip-so400m" in out
    code, out = run(["plan-partition", "--llm", "internvit-6b", "--stages", "2"])
    assert code == 2 and "expected llm" in out
    bad = tmp_path / "llm.yaml"
    bad.write_text("kind: llm\nnum_layers: 4\nhidden_size: 512\nffn_hidden_size: 1024\nvocab_size: 100\n")
    code, out = run(["plan-recompute", "--llm", str(bad), "--stages", "2", "--gpu-memory-gb", "80"])
    assert code == 1 and str(bad) in out and "'num_heads' is missing" in out
    code, out = run(["plan-partition", "--vision", "qwen2-vl-vit", "--llm", "qwen2-7b", "--stages", "2",
                     "--group-vision-items", "3"])
    assert code == 2 and "--group-vision-tokens" in out
    code, out = run(["plan-partition", *VIT, "--stages", "2"])
    assert code == 2 and "--group-vision-items" in out
    code, out = run(["plan-partition", "--llm", "llama3-8b", "--stages", "99"])
    assert code == 2 and "exceeds" in out
    code, out = run(["plan-partition", "--llm", "llama3-8b", "--stages", "2", "--lengths", str(tmp_path / "nope.parquet")])
    assert code == 1 and "no such file" in out


def test_cost_model_options_for_other_commands():
    import click

    from balancer_cli.cli._common import handle_errors
    from balancer_cli.cli._options import cost_model_options, costs_from_options

    lt = make_lengths_table(np.array([100, 200]), {"vision": (np.array([256, 512]), np.array([1, 2]))})

    @click.command()
    @cost_model_options
    @handle_errors
    def cmd(cost_model, vision_model, audio_model, llm_model, costs):
        costs = costs_from_options(lt, cost_model, vision_model, audio_model, llm_model, costs)
        click.echo(json.dumps({m: c.tolist() for m, c in costs.items()}))

    runner = CliRunner()
    assert json.loads(runner.invoke(cmd, []).output) == {"vision": [256.0, 512.0], "llm": [100.0, 200.0]}
    out = json.loads(runner.invoke(cmd, ["--cost-model", "flops", "--vision-model", "internvit-300m",
                                         "--llm-model", "qwen2-7b"]).output)
    assert out["vision"][1] == 2 * out["vision"][0] and out["llm"][1] > 2 * out["llm"][0]
    bad = runner.invoke(cmd, ["--cost-model", "flops", "--llm-model", "qwen2-7b"])
    assert bad.exit_code == 2 and "--vision-model" in bad.output
    code, out = run(["plan-partition", "--vision-model", "internvit-300m", "--llm-model", "qwen2-7b", "--stages", "2",
                     "--group-vision-items", "4", "--json"])
    assert code == 0 and json.loads(out)["models"] == {"vision": "internvit-300m", "llm": "qwen2-7b"}
