"""The cost-model registry and the checks of model shapes and cost models."""

from __future__ import annotations

import numpy as np
import pytest

from balancer_cli.cost.presets import PRESETS, ModelConfig, get_model
from balancer_cli.cost.samples import COST_MODELS, CostModel, sample_costs
from balancer_cli.errors import UsageError
from balancer_cli.lengths import make_lengths_table


def test_registry_names_every_cost_model_and_rejects_others():
    assert list(COST_MODELS) == ["tokens", "flops", "measured"]
    lt = make_lengths_table(np.array([10, 20]))
    assert sample_costs(lt, "tokens", llm="no-such-llm")["llm"].tolist() == [10.0, 20.0]  # tokens needs no model
    with pytest.raises(UsageError, match="unknown cost model 'time'"):
        sample_costs(lt, "time")


def test_cost_model_and_shapes_are_checked_on_construction():
    llm = get_model("llama3-8b")
    with pytest.raises(UsageError, match="attention 'sdpa'"):
        CostModel(llm=llm, attention="sdpa")
    with pytest.raises(UsageError) as info:
        CostModel(llm=llm, tp=0)
    assert info.value.for_flags({"tp": "--tp"}).endswith("fix: pass --tp 1 or more")
    fields = {f: getattr(PRESETS["llama3-8b"], f) for f in ("name", "kind", "num_layers", "hidden_size",
                                                            "ffn_hidden_size", "num_heads", "num_kv_heads",
                                                            "gated_mlp", "causal", "vocab_size")}
    with pytest.raises(UsageError, match="must divide"):
        ModelConfig(**{**fields, "num_heads": 30})
    with pytest.raises(UsageError, match="'kind'"):
        ModelConfig(**{**fields, "kind": "robot"})


def test_a_module_without_a_model_names_a_parameter_that_exists():
    lt = make_lengths_table(np.array([10]), {"video": (np.array([64]), np.array([1]))})
    with pytest.raises(UsageError) as info:
        sample_costs(lt, "flops", llm="qwen2-7b")
    assert "encoders={'video': <preset>}" in str(info.value) and "--video" not in str(info.value)
    costs = sample_costs(lt, "flops", llm="qwen2-7b", encoders={"video": "internvit-300m"})
    assert list(costs) == ["video", "llm"]


@pytest.mark.parametrize("block", [1, 7, 1000])
def test_model_costs_computed_a_block_of_samples_at_a_time_are_the_whole_tables(monkeypatch, block):
    """``prepare_inputs`` computes the FLOPs of a block of samples at a time (bounded memory): a
    sample's cost is its own, so any block size gives the costs of the whole table, failed
    samples (null lengths) and an item's own sequence lengths included."""
    from balancer_cli.pack import inputs as pack_inputs

    rng = np.random.default_rng(block)
    n = 57
    items = rng.integers(0, 4, n)
    seqlens = [[int(x) for x in rng.integers(64, 1025, k)] for k in items]
    tokens = np.array([sum(s) for s in seqlens])
    lengths = make_lengths_table(rng.integers(10, 3000, n) + tokens, {"vision": (tokens, items)},
                                 seqlens={"vision": seqlens}, error=[None if rng.random() > 0.1 else "bad" for _ in range(n)])
    presets = (("llm", "qwen2-7b"), ("vision", "qwen2-vl-vit"))
    whole = pack_inputs.prepare_inputs(lengths, "flops", presets).cost_NK
    monkeypatch.setattr(pack_inputs, "_COST_BLOCK", block)
    assert np.array_equal(pack_inputs.prepare_inputs(lengths, "flops", presets).cost_NK, whole)
    direct = sample_costs(lengths, "flops", vision="qwen2-vl-vit", llm="qwen2-7b")
    assert np.array_equal(whole, np.column_stack([direct["vision"], direct["llm"]]).astype(np.float32))
