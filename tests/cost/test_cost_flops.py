"""FLOPs/memory formulas against hand-computed values, presets, the flops cost model and model files."""

from __future__ import annotations

import numpy as np
import pytest

from balancer_cli.cost import flops
from balancer_cli.cost.samples import CostModel, module_features, sample_costs
from balancer_cli.errors import InputError, UsageError
from balancer_cli.lengths import make_lengths_table
from balancer_cli.cost.presets import PRESETS, ModelConfig, get_model, load_model_file

# A GPT-style layer as in Korthikanti et al. 2022 / Narayanan et al. 2021: MHA, f = 4h, GELU.
GPT = ModelConfig(name="gpt", kind="llm", num_layers=2, hidden_size=1024, ffn_hidden_size=4096, num_heads=16,
                  num_kv_heads=16, gated_mlp=False, causal=False, vocab_size=50000)


def test_gpt_layer_flops_match_narayanan_24h2_plus_4sh():
    h = 1024
    per_token, per_sumsq = flops.layer_flops(GPT)
    assert per_token == 24 * h * h
    assert per_sumsq == 4 * h
    # one sequence of s tokens: 24 s h^2 + 4 s^2 h
    s = 2048
    assert per_token * s + per_sumsq * s * s == 24 * s * h * h + 4 * s * s * h


def test_causal_attention_counts_half_and_tp_divides():
    causal = ModelConfig(name="c", kind="llm", num_layers=1, hidden_size=1024, ffn_hidden_size=4096, num_heads=16,
                         num_kv_heads=16, gated_mlp=False, causal=True, vocab_size=10)
    assert flops.layer_flops(causal)[1] == 2 * 1024
    assert flops.layer_flops(GPT, tp=4) == (24 * 1024 ** 2 / 4, 4 * 1024 / 4)


def test_gpt_activations_match_korthikanti_34h_plus_5as():
    h, a = 1024, 16
    none = flops.layer_activation_bytes(GPT, "none", attention="eager", dropout=True)
    assert (none.per_token, none.per_sumsq) == (34 * h, 5 * a)
    sel = flops.layer_activation_bytes(GPT, "selective", attention="eager", dropout=True)
    assert (sel.per_token, sel.per_sumsq) == (34 * h, 0)
    full = flops.layer_activation_bytes(GPT, "full", attention="eager", dropout=True)
    assert (full.per_token, full.per_sumsq) == (2 * h, 0)
    # tensor + sequence parallel divides everything by t (Korthikanti eq. 5)
    tp = flops.layer_activation_bytes(GPT, "none", attention="eager", dropout=True, tp=8)
    assert (tp.per_token, tp.per_sumsq) == (34 * h / 8, 5 * a / 8)
    # one sequence of s tokens, one micro-batch: sbh(34 + 5as/h)
    s = 2048
    assert none.of(s, s * s) == s * h * (34 + 5 * a * s / h)


def test_internlm2_20b_layer_by_hand():
    m = get_model("internlm2-20b")
    h, kv, f, a = 6144, 8 * 128, 16384, 48
    assert flops.layer_flops(m) == (2 * h * (h + 2 * kv) + 2 * h * h + 6 * h * f, 2 * h)
    assert flops.layer_params(m) == h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h
    # no dropout, SwiGLU: 2h+2h (norms) + 2h (qkv in) + 2h+2kv (q,k) + 2kv (v) + 2h (proj in) + 2h (mlp in) + 8f
    act = flops.layer_activation_bytes(m, "none", attention="flash")
    assert act.per_token == 2 * (2 * h + h + (h + kv) + kv + h + h + 4 * f) + 4 * a
    assert act.per_sumsq == 0
    eager = flops.layer_activation_bytes(m, "none", attention="eager")
    assert eager.per_sumsq == 2 * a
    assert flops.recompute_flops(m, "full") == flops.layer_flops(m)
    assert flops.recompute_flops(m, "selective", attention="eager") == (0.0, 2 * h)
    assert flops.recompute_flops(m, "selective", attention="flash") == (0.0, 0.0)


def test_internvit_6b_stem_and_projector_by_hand():
    v, llm = get_model("internvit-6b"), get_model("internlm2-20b")
    assert flops.stem_flops_per_token(v) == 2 * 3 * 14 * 14 * 3200
    assert flops.projector_dims(v, llm) == (4 * 3200, 6144, 6144)
    assert flops.projector_flops_per_token(v, llm) == 2 * (12800 * 6144 + 6144 * 6144)
    assert flops.head_flops_per_token(llm) == 2 * 6144 * 92544
    assert flops.head_activation_bytes_per_token(llm) == 4 * 6144 + 4 * 92544


def test_state_bytes_follow_zero_paper():
    assert flops.state_bytes_per_param(0) == 16
    assert flops.state_bytes_per_param(1, 4) == 2 + 2 + 3
    assert flops.state_bytes_per_param(2, 4) == 2 + (2 + 12) / 4
    assert flops.state_bytes_per_param(3, 4) == 4
    with pytest.raises(ValueError):
        flops.state_bytes_per_param(4)


@pytest.mark.parametrize("name, published", [("llama3-8b", 8.03e9), ("qwen2-7b", 7.62e9), ("internlm2-20b", 19.86e9),
                                             ("llama3-70b", 70.6e9), ("qwen2-72b", 72.7e9), ("yi-34b", 34.4e9)])
def test_llm_presets_add_up_to_published_sizes(name, published):
    m = get_model(name)
    total = m.num_layers * flops.layer_params(m) + flops.embedding_params(m) + flops.head_params(m)
    assert abs(total / published - 1) < 0.01  # biases are ignored


def test_vision_presets_tokens_per_item():
    assert get_model("internvit-6b").tokens_per_item == 1025 and get_model("internvit-6b").llm_tokens_per_item == 256
    assert get_model("siglip-so400m").tokens_per_item == 729
    assert get_model("clip-vit-l-336").llm_tokens_per_item == 576
    assert get_model("whisper-large-v3-encoder").tokens_per_item == 1500
    m = get_model("internvit-6b")
    assert abs(m.num_layers * flops.layer_params(m) / 5.54e9 - 1) < 0.01  # 45 of InternViT-6B's 48 layers (5.9B)
    assert set(PRESETS) >= {"internvit-300m", "qwen2-vl-vit", "qwen2-72b", "yi-34b", "llama3-70b"}


def test_sample_costs_flops_one_sample_by_hand():
    lt = make_lengths_table(np.array([300]), {"vision": (np.array([256 * 2]), np.array([2]))})
    costs = sample_costs(lt, "flops", vision="internvit-300m", llm="qwen2-7b")
    q = get_model("qwen2-7b")
    h = 1024
    vision_fwd = 24 * (24 * h * h * 2050 + 4 * h * 2 * 1025 ** 2) + 2 * 588 * h * 2050 \
        + 2 * (4096 * 3584 + 3584 * 3584) * 512
    assert costs["vision"][0] == pytest.approx(3 * vision_fwd, rel=1e-12)
    lin, att = flops.layer_flops(q)
    assert costs["llm"][0] == pytest.approx(3 * (28 * (lin * 300 + att * 300 ** 2) + 2 * 3584 * 152064 * 300), rel=1e-12)
    assert list(costs) == ["vision", "llm"]
    assert sample_costs(lt)["vision"].tolist() == [512.0]  # the tokens model is unchanged


def test_native_resolution_encoder_reads_seqlens():
    lt = make_lengths_table(np.array([100, 100]), {"vision": (np.array([400, 400]), np.array([2, 2]))},
                            seqlens={"vision": [[100, 300], [200, 200]]})
    tokens, sumsq, side = module_features(lt, "vision", get_model("qwen2-vl-vit"))
    assert tokens.tolist() == [400, 400] and sumsq.tolist() == [100 ** 2 + 300 ** 2, 2 * 200 ** 2]
    assert side.tolist() == [100, 100]
    even = make_lengths_table(np.array([100]), {"vision": (np.array([400]), np.array([2]))})
    assert module_features(even, "vision", get_model("qwen2-vl-vit"))[1].tolist() == [2 * 200 ** 2]


def test_errored_samples_cost_nothing():
    lt = make_lengths_table(np.array([100, 100]), {"vision": (np.array([256, 256]), np.array([1, 1]))},
                            error=[None, "missing image"])
    costs = sample_costs(lt, "flops", vision="internvit-300m", llm="qwen2-7b")
    assert costs["vision"][1] == 0 and costs["llm"][1] == 0 and costs["llm"][0] > 0


def test_flops_errors():
    lt = make_lengths_table(np.array([10]), {"vision": (np.array([256]), np.array([1]))})
    with pytest.raises(UsageError, match="internvit-6b"):
        sample_costs(lt, "flops", vision="no-such-vit", llm="qwen2-7b")
    with pytest.raises(UsageError, match="needs an LLM"):
        sample_costs(lt, "flops", vision="internvit-6b")
    with pytest.raises(UsageError, match="no model was given"):
        sample_costs(lt, "flops", llm="qwen2-7b")
    with pytest.raises(UsageError, match="expected llm"):
        CostModel.build("internvit-6b")
    with pytest.raises(UsageError, match="unknown cost model"):
        sample_costs(lt, "bytes")


def test_model_file_roundtrip_and_errors(tmp_path):
    good = tmp_path / "my-llm.yaml"
    good.write_text("kind: llm\nnum_layers: 4\nhidden_size: 512\nffn_hidden_size: 1024\nnum_heads: 8\n"
                    "num_kv_heads: 2\nvocab_size: 1000\n")
    m = get_model(str(good), kind="llm")
    assert (m.name, m.kv_size, m.gated_mlp, m.causal) == ("my-llm", 128, True, True)
    js = tmp_path / "vit.json"
    js.write_text('{"kind": "vision", "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 256, "num_heads": 4,'
                  ' "patch_size": 16, "image_size": 224, "tokens_per_item": 196}')
    assert load_model_file(js).tokens_per_item == 196
    cases = {
        "kind: llm\nnum_layers: 4\nhidden_size: 512\nffn_hidden_size: 1024\nvocab_size: 10\n": "'num_heads' is missing",
        "kind: llm\nnum_layers: four\nhidden_size: 512\nffn_hidden_size: 1024\nnum_heads: 8\nvocab_size: 1\n": "'num_layers'",
        "kind: llm\nnum_layers: 4\nhidden: 512\n": "unknown field 'hidden'",
        "kind: [llm\n": "not valid YAML",
        "- 1\n- 2\n": "expected a mapping",
        "kind: robot\nnum_layers: 4\nhidden_size: 512\nffn_hidden_size: 1024\nnum_heads: 8\n": "'kind'",
        "kind: vision\nnum_layers: 4\nhidden_size: 500\nffn_hidden_size: 1024\nnum_heads: 8\n": "must divide",
    }
    for i, (text, message) in enumerate(cases.items()):
        bad = tmp_path / f"bad{i}.yaml"
        bad.write_text(text)
        with pytest.raises(InputError, match=message) as info:
            load_model_file(bad)
        assert str(bad) in str(info.value)
    with pytest.raises(InputError, match="cannot read"):
        get_model(str(tmp_path / "missing.yaml"))


def test_docstring_examples_run():
    import doctest

    import balancer_cli.cost.flops
    import balancer_cli.cost.presets
    import balancer_cli.cost.samples

    for module in (balancer_cli.cost.samples, balancer_cli.cost.flops, balancer_cli.cost.presets):
        failed, _ = doctest.testmod(module)
        assert failed == 0, module.__name__
