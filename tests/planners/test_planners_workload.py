"""Workload loading and the two plan entry points in Python: errors name parameters."""

from __future__ import annotations

import numpy as np
import pytest

from balancer_cli.errors import ManifestError, UsageError
from balancer_cli.lengths import make_lengths_table, write_lengths
from balancer_cli.manifest import ManifestRows, write_manifest
from balancer_cli.planners import summary
from balancer_cli.planners.entry import plan_partition_summary, plan_recompute_summary
from balancer_cli.planners.flags import EXTERNAL_FLAGS
from balancer_cli.planners.workload import WorkloadSpec, build_model, build_model_chain, load_workload


def test_workload_spec_normalizes_paths_and_checks_counts():
    assert WorkloadSpec(lengths=["a.parquet", "b.json"]).lengths == ("a.parquet", "b.json")
    with pytest.raises(UsageError) as info:
        WorkloadSpec(group_vision_items=-1)
    assert info.value.for_flags({"group_vision_items": "--group-vision-items"}).startswith("--group-vision-items must")
    with pytest.raises(UsageError):
        WorkloadSpec(group_llm_tokens=True)


def test_errors_name_parameters_that_the_cli_spells_as_flags():
    with pytest.raises(UsageError) as info:
        build_model_chain(llm="llama3-8b", stages=40)
    assert str(info.value).startswith("stages 40 exceeds") and "{" not in str(info.value)
    assert info.value.for_flags({"stages": "--stages"}).startswith("--stages 40 exceeds")
    model = build_model(llm="qwen2-7b", vision="internvit-300m")
    with pytest.raises(UsageError, match="manifest needs the lengths table"):
        load_workload(model, WorkloadSpec(manifest="out"))
    with pytest.raises(UsageError, match="pass group_vision_tokens N"):
        load_workload(build_model(llm="qwen2-7b", vision="qwen2-vl-vit"), WorkloadSpec(group_vision_items=3))


def test_manifest_groups_follow_slot_order_and_check_the_lengths(tmp_path):
    lt = make_lengths_table(np.array([1000, 3000, 500, 2500]))
    write_lengths(lt, tmp_path / "l.parquet")
    # two steps of one rank, two micro-batches: four slots, one sample each
    rows = ManifestRows(step=np.array([0, 0, 1, 1]), rank=np.zeros(4, int), micro=np.array([0, 1, 0, 1]),
                        sample=np.array([3, 1, 0, 2]))
    write_manifest(tmp_path / "m", rows, dropped_sample=np.array([], np.int64), dropped_reason=[],
                   meta={"world_size": 1, "micro_batches": 2, "lengths_fingerprint": lt.fingerprint})
    spec = WorkloadSpec(lengths=[tmp_path / "l.parquet"], manifest=tmp_path / "m")
    loaded = load_workload(build_model(llm="llama3-8b"), spec)
    assert loaded.per_group["llm.tokens"].tolist() == [2500, 3000, 1000, 500]
    assert loaded.source == {"source": "manifest", "manifest": str(tmp_path / "m"), "steps": 2, "num_groups": 4}
    other = make_lengths_table(np.array([1, 2, 3, 4]))
    write_lengths(other, tmp_path / "o.parquet")
    with pytest.raises(ManifestError, match="fingerprint"):
        load_workload(build_model(llm="llama3-8b"), WorkloadSpec(lengths=[tmp_path / "o.parquet"], manifest=tmp_path / "m"))


def test_entry_points_take_cuts_as_text_or_indices():
    args = dict(llm="llama3-8b", stages=2, gpu_memory_gb=80, zero_stage=1, dp=8)
    assert plan_recompute_summary(**args, cuts="10") == plan_recompute_summary(**args, cuts=[10])
    with pytest.raises(UsageError) as info:
        plan_recompute_summary(**args, cuts="10,20")
    assert info.value.for_flags({"cuts": "--cuts"}).startswith("--cuts '10,20' must be 1 increasing indices")
    planned = plan_recompute_summary(**args)
    partitioned = plan_partition_summary(llm="llama3-8b", stages=2)
    assert [s["layers"] for s in planned["stages"]] == [s["layers"] for s in partitioned["stages"]]


def test_printed_framework_flags_are_external_flags():
    import re

    s = plan_partition_summary(llm="internlm2-20b", vision="internvit-6b", stages=4,
                               workload=WorkloadSpec(group_vision_items=10))
    text = summary.render_partition(s) + summary.render_recompute(
        plan_recompute_summary(llm="internlm2-20b", vision="internvit-6b", stages=4, tp=4, gpu_memory_gb=40,
                               zero_stage=1, dp=8, workload=WorkloadSpec(group_llm_tokens=8192, group_vision_items=24)))
    printed = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
    assert printed and printed <= EXTERNAL_FLAGS
