"""The library calls behind ``balancer plan-partition`` and ``balancer plan-recompute``.

Each takes the models (presets or model files), the stages and a :class:`WorkloadSpec`, and
returns the JSON summary the command prints (``--json``) or renders
(:func:`~balancer_cli.planners.summary.render_partition`,
:func:`~balancer_cli.planners.summary.render_recompute`).

Example:
    >>> s = plan_partition_summary(llm="llama3-8b", stages=2, workload=WorkloadSpec(group_llm_tokens=4096))
    >>> s["title"]
    'plan-partition: llama3-8b, 2 stages, 34 layers, tp 1, flash attention'
    >>> [st["layers"] for st in s["stages"]]
    [[0, 17], [18, 33]]
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from balancer_cli.cost.presets import ModelConfig
from balancer_cli.cost.samples import CostModel
from balancer_cli.errors import UsageError
from balancer_cli.planners.chain import layer_costs, layer_out_bytes
from balancer_cli.planners.partition import Bounds, bounds_from_cuts, plan_partition
from balancer_cli.planners.recompute import plan_recompute
from balancer_cli.planners.summary import partition_summary, recompute_summary
from balancer_cli.planners.workload import (
    WorkloadSpec,
    build_model_chain,
    load_profile,
    load_workload,
)

__all__ = ["plan_partition_summary", "plan_recompute_summary"]


def plan_partition_summary(*, llm: str | ModelConfig, vision: str | ModelConfig | None = None, audio: str | ModelConfig | None = None, stages: int,
                           attention: str = "flash", tp: int = 1, workload: WorkloadSpec = WorkloadSpec(),
                           profile: str | os.PathLike | None = None, method: str = "bmp", radius: int = 2,
                           top_k: int = 5) -> dict[str, Any]:
    """Balanced pipeline stages for the typical group of ``workload``, with the baselines and flags.

    Args:
        llm, vision, audio: presets or model files (encoders are left out when ``None``).
        stages: P, pipeline stages.
        attention: ``flash`` or ``eager``.
        tp: tensor-parallel size (with sequence parallelism).
        workload: where the groups come from.
        profile: measured per-layer times (JSON, see
            :func:`~balancer_cli.planners.workload.load_profile`) instead of FLOPs.
        method, radius, top_k: as :func:`~balancer_cli.planners.partition.plan_partition`.

    Returns:
        :func:`~balancer_cli.planners.summary.partition_summary` plus ``models``, ``workload``
        (one line), ``workload_source``, ``typical_group``, ``cost_unit`` and ``title``.

    Raises:
        UsageError, InputError, ManifestError: bad models, stages, workload or profile.

    Example:
        >>> s = plan_partition_summary(llm="qwen2-7b", vision="internvit-300m", stages=2,
        ...                            workload=WorkloadSpec(group_vision_items=4))
        >>> s["models"]
        {'vision': 'internvit-300m', 'llm': 'qwen2-7b'}
        >>> s["workload"]
        'typical group (one group given by options): llm 4,096 tokens, vision 4,100 tokens'
    """
    model, chain = build_model_chain(llm=llm, vision=vision, audio=audio, attention=attention, tp=tp, stages=stages)
    loaded = load_workload(model, workload)
    costs = load_profile(profile, chain) if profile else None
    summary = partition_summary(chain, loaded.typical, stages, costs=costs, radius=radius, top_k=top_k, method=method)
    summary.update({
        "models": _model_names(model),
        "workload": loaded.describe(),
        "workload_source": loaded.source,
        "typical_group": loaded.typical,
        "cost_unit": "seconds" if profile else "FLOPs",
        "title": f"plan-partition: {_title_names(model)}, {stages} stages, {len(chain)} layers, tp {tp}, "
                 f"{attention} attention",
    })
    return summary


def plan_recompute_summary(*, llm: str | ModelConfig, vision: str | ModelConfig | None = None, audio: str | ModelConfig | None = None, stages: int,
                           attention: str = "flash", tp: int = 1, workload: WorkloadSpec = WorkloadSpec(),
                           gpu_memory_gb: float, margin: float = 0.1, zero_stage: int = 0, dp: int = 1,
                           micro_batches: int | None = None, cuts: str | Sequence[int] | None = None,
                           profile: str | os.PathLike | None = None) -> dict[str, Any]:
    """Per stage, the least recomputation with which the heaviest group of ``workload`` fits GPU memory.

    Args:
        llm, vision, audio, stages, attention, tp, workload: as :func:`plan_partition_summary`.
        gpu_memory_gb, margin, zero_stage, dp: as :func:`~balancer_cli.planners.recompute.plan_recompute`.
        micro_batches: micro-batches per step and pipeline (default ``stages``).
        cuts: the first layer of stages 1..P-1 (a sequence, or its comma-separated text);
            default: BMP's partition for the typical group.
        profile: measured per-layer times (as :func:`plan_partition_summary`): the default stages
            are BMP's partition of those times instead of FLOPs (the recomputation's own cost stays
            in FLOPs).

    Returns:
        :func:`~balancer_cli.planners.summary.recompute_summary` plus ``models``, ``workload``,
        ``workload_source``, ``settings`` and ``title``.

    Raises:
        UsageError, InputError, ManifestError: bad models, stages, workload or cuts.
        PlanError: some stage does not fit even with every layer recomputed.

    Example:
        >>> s = plan_recompute_summary(llm="llama3-8b", stages=2, gpu_memory_gb=80, zero_stage=1, dp=8, cuts=[10])
        >>> [st["layers"] for st in s["stages"]], s["settings"]["micro_batches"]
        ([[0, 9], [10, 33]], 2)
    """
    model, chain = build_model_chain(llm=llm, vision=vision, audio=audio, attention=attention, tp=tp, stages=stages)
    loaded = load_workload(model, workload)
    # Text is checked even when empty (`--cuts ''` is refused); an empty sequence means none given.
    by_hand = cuts is not None and (isinstance(cuts, str) or len(cuts) > 0)
    if by_hand:
        bounds = _cut_bounds(cuts, stages, len(chain))
    else:
        costs = load_profile(profile, chain) if profile else layer_costs(chain, loaded.typical)
        bounds = plan_partition(costs, layer_out_bytes(chain, loaded.typical), stages).chosen.bounds
    micro = micro_batches or stages
    plan = plan_recompute(chain, bounds, loaded.typical, loaded.per_group, gpu_memory_gb=gpu_memory_gb, margin=margin,
                          zero_stage=zero_stage, dp=dp, micro_batches=micro)
    summary = recompute_summary(plan, chain)
    summary.update({
        "models": _model_names(model),
        "workload": loaded.describe() + f"; memory for the heaviest of {loaded.source['num_groups']} groups",
        "workload_source": loaded.source,
        "settings": {"gpu_memory_gb": gpu_memory_gb, "margin": margin, "zero_stage": zero_stage, "dp": dp,
                     "micro_batches": micro, "tp": tp, "attention": attention,
                     "stages_from": "cuts" if by_hand else ("profile" if profile else "FLOPs")},
        "title": (f"plan-recompute: {_title_names(model)}, {stages} stages, {gpu_memory_gb:g} GB/GPU, "
                  f"ZeRO-{zero_stage} dp {dp}, tp {tp}, {micro} micro-batches, {attention} attention"),
    })
    return summary


def _cut_bounds(cuts: str | Sequence[int], stages: int, num_layers: int) -> Bounds:
    """Stage bounds from cuts given by hand, checked against the stages and the chain's length."""
    if isinstance(cuts, str) and not cuts.strip():
        # An empty --cuts is a mistake (a shell variable that expanded to nothing), not a request
        # for BMP's stages: those come from leaving it out.
        wanted = "" if stages == 1 else f"give {stages - 1} layer {'index' if stages == 2 else 'indices'}, or "
        raise UsageError(f"{{cuts}} {cuts!r} gives no stage boundary",
                         fix=f"{wanted}leave {{cuts}} out to plan the stages")
    try:
        cut_list = [int(c) for c in (cuts.split(",") if isinstance(cuts, str) else cuts)]
    except (TypeError, ValueError):
        raise UsageError(f"{{cuts}} {cuts!r} is not a comma-separated list of layer indices",
                         fix="e.g. {cuts} 23,45,72") from None
    if (len(cut_list) != stages - 1 or cut_list != sorted(set(cut_list))
            or (cut_list and (cut_list[0] <= 0 or cut_list[-1] >= num_layers))):
        raise UsageError(f"{{cuts}} {cuts!r} must be {stages - 1} increasing indices in 1..{num_layers - 1}",
                         fix="take them from `balancer plan-partition --json` (stages[i].layers[0])")
    return bounds_from_cuts(cut_list, num_layers)


def _model_names(model: CostModel) -> dict[str, str]:
    """``{module: model name}``, encoders first, ``llm`` last."""
    return {**{m: cfg.name for m, cfg in model.encoders}, "llm": model.llm.name}


def _title_names(model: CostModel) -> str:
    """The models as a title names them: ``internvit-6b + internlm2-20b``."""
    return " + ".join([cfg.name for _, cfg in model.encoders] + [model.llm.name])
