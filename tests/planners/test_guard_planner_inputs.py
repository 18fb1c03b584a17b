"""plan-partition / plan-recompute refuse inputs no plan can come from: one line, a fix, no traceback."""

from __future__ import annotations

import json
import time

import pytest
from cli_util import invoke as _invoke
from cli_util import one_error as _one_error

from balancer_cli.cost.presets import load_model_file
from balancer_cli.cost.samples import CostModel
from balancer_cli.errors import InputError, UsageError
from balancer_cli.planners.entry import plan_recompute_summary
from balancer_cli.planners.partition import MAX_CANDIDATES
from balancer_cli.planners.workload import build_model_chain, load_profile

TINY = {"kind": "llm", "num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 512, "num_heads": 4, "vocab_size": 1000}
CLS = {"kind": "vision", "num_layers": 3, "hidden_size": 128, "ffn_hidden_size": 256, "num_heads": 4,
       "patch_size": 14, "image_size": 448, "tokens_per_item": 1, "merge": 4, "class_tokens": 5}


@pytest.fixture()
def models(tmp_path):
    (tmp_path / "tiny.json").write_text(json.dumps(TINY))
    (tmp_path / "cls.json").write_text(json.dumps(CLS))
    return tmp_path / "tiny.json", tmp_path / "cls.json"


# -- 1. a profile of zeros ---------------------------------------------------------------------

@pytest.mark.parametrize("command", [["plan-partition"], ["plan-recompute", "--gpu-memory-gb", "80"]])
def test_a_profile_of_zeros_is_refused_by_both_planners(tmp_path, models, command):
    profile = tmp_path / "prof.json"
    profile.write_text("[0, 0, 0, 0, 0, 0]")
    line = _one_error(_invoke([*command, "--llm", models[0], "--stages", "2", "--profile", profile]), 1)
    assert "prof.json: every layer's time is 0" in line


def test_a_profile_with_one_positive_time_still_plans(tmp_path):
    _, chain = build_model_chain(llm="llama3-8b", stages=2)
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps([0.0] * (len(chain) - 1) + [1e-3]))
    assert load_profile(profile, chain)[-1] == 1e-3
    profile.write_text(json.dumps([0.0] * len(chain)))
    with pytest.raises(InputError, match="no layer has a positive cost"):
        load_profile(profile, chain)


# -- 2. more class tokens than tokens per item -------------------------------------------------

def test_class_tokens_above_tokens_per_item_are_refused_when_the_file_is_read(models):
    with pytest.raises(InputError) as info:
        load_model_file(models[1])
    assert "cls.json: field 'class_tokens' (5) exceeds tokens_per_item (1)" in str(info.value)
    line = _one_error(_invoke(["plan-partition", "--llm", models[0], "--vision", models[1], "--stages", "2",
                               "--group-vision-items", "2"]), 1)
    assert "field 'class_tokens' (5) exceeds tokens_per_item (1)" in line


def test_class_tokens_within_tokens_per_item_still_load(tmp_path):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps({**CLS, "tokens_per_item": 5}))
    assert load_model_file(path).llm_tokens_per_item == 0


# -- 7. tensor parallelism that Megatron-LM would refuse, and empty cuts ----------------------

@pytest.mark.parametrize("command", [["plan-partition"], ["plan-recompute", "--gpu-memory-gb", "80"]])
@pytest.mark.parametrize("tp", ["3", "1000"])
def test_a_tp_that_does_not_divide_the_heads_is_a_usage_error(models, command, tp):
    line = _one_error(_invoke([*command, "--llm", models[0], "--stages", "2", "--tp", tp]), 2)
    assert f"--tp {tp} does not divide the 4 attention heads of LLM 'tiny'" in line
    assert line.endswith("divides them: 1, 2, 4")


def test_tp_must_divide_the_kv_heads_too():
    with pytest.raises(UsageError) as info:
        CostModel.build("qwen2-7b", tp=8)  # 28 heads, 4 KV heads
    assert info.value.for_flags({"tp": "--tp"}).startswith("--tp 8 does not divide the 28 attention heads and 4 KV")
    assert CostModel.build("qwen2-7b", tp=4).tp == 4
    assert CostModel.build("internlm2-20b", {"vision": "internvit-6b"}, tp=4).tp == 4  # the LLM's heads only


@pytest.mark.parametrize("cuts", ["", " "])
def test_empty_cuts_are_a_usage_error(models, cuts):
    line = _one_error(_invoke(["plan-recompute", "--llm", models[0], "--stages", "2", "--gpu-memory-gb", "80",
                               "--cuts", cuts]), 2)
    assert "--cuts" in line and "gives no stage boundary" in line
    with pytest.raises(UsageError, match="gives no stage boundary"):
        plan_recompute_summary(llm="llama3-8b", stages=2, gpu_memory_gb=80, cuts=cuts)


def test_cuts_given_as_a_sequence_behave_as_before():
    fit = {"llm": "llama3-8b", "stages": 2, "gpu_memory_gb": 80, "zero_stage": 1, "dp": 8}
    s = plan_recompute_summary(**fit, cuts=[10])
    assert [st["layers"] for st in s["stages"]] == [[0, 9], [10, 33]] and s["settings"]["stages_from"] == "cuts"
    assert plan_recompute_summary(**fit, cuts=[])["settings"]["stages_from"] == "FLOPs"


# -- 8. the fix of a missing profile layer ----------------------------------------------------

def test_a_missing_layer_is_named_once_or_with_its_two_spellings(tmp_path, models):
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"llm.layer": 1, "llm.head": 1}))
    line = _one_error(_invoke(["plan-partition", "--llm", models[0], "--stages", "2", "--profile", profile]), 1)
    assert line.endswith("no time for layer 'llm.embedding'; fix: add 'llm.embedding'")
    profile.write_text(json.dumps({"llm.embedding": 1, "llm.head": 1}))
    line = _one_error(_invoke(["plan-partition", "--llm", models[0], "--stages", "2", "--profile", profile]), 1)
    assert line.endswith("fix: add 'llm.layer.0' or 'llm.layer'")


# -- a radius past any chain ---------------------------------------------------------------------

def test_the_radius_shrinks_as_one_step_at_a_time_did():
    from balancer_cli.planners.partition import _largest_radius

    def stepwise(radius, stages):
        # One step at a time, from the radius or from a point above every radius that fits (the
        # candidates grow with r): the same answer, without walking down ~10^6 steps per case.
        radius = min(radius, int(MAX_CANDIDATES ** (1 / (stages - 1)) / 2) + 2)
        while radius > 0 and (2 * radius + 1) ** (stages - 1) > MAX_CANDIDATES:
            radius -= 1
        return radius

    for stages in range(2, 40):
        for radius in (0, 1, 2, 3, 7, 15, 49, 50, 499, 500, 499_999, 500_000, 10**6):
            assert min(radius, _largest_radius(stages)) == stepwise(radius, stages), (stages, radius)


def test_a_huge_radius_finishes(models):
    start = time.monotonic()
    result = _invoke(["plan-partition", "--llm", models[0], "--stages", "2", "--radius", "99999999999999999999",
                      "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["bmp"]["radius"] == 499_999 and time.monotonic() - start < 60
