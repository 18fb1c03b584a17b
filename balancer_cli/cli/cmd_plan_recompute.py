"""``balancer plan-recompute``: per stage, the least recomputation that fits GPU memory."""

from __future__ import annotations

import click

from balancer_cli.cli._common import emit, handle_errors, json_option
from balancer_cli.cli._plan_common import build_model_chain, load_workload, model_options, workload_options
from balancer_cli.cli.cmd_plan_partition import _describe
from balancer_cli.errors import UsageError
from balancer_cli.planners.partition import bounds_from_cuts
from balancer_cli.planners.recompute import plan_recompute
from balancer_cli.planners.summary import partition_summary, recompute_summary, render_recompute


@click.command("plan-recompute")
@model_options
@workload_options
@click.option("--gpu-memory-gb", type=click.FloatRange(min=0, min_open=True), required=True, help="Memory per GPU, GB.")
@click.option("--margin", type=click.FloatRange(0, 1, max_open=True), default=0.1, show_default=True,
              help="Share of GPU memory kept free (CUDA context, NCCL, fragmentation).")
@click.option("--zero-stage", type=click.IntRange(0, 3), default=0, show_default=True,
              help="ZeRO stage (1 = Megatron's distributed optimizer).")
@click.option("--dp", type=click.IntRange(min=1), default=1, show_default=True, help="Data-parallel size (ZeRO sharding).")
@click.option("--micro-batches", type=click.IntRange(min=1), default=None,
              help="Micro-batches per step and pipeline (default: --stages, so stage i holds P - i in flight).")
@click.option("--cuts", default=None, metavar="C1,C2,..",
              help="Stage boundaries (first layer of stages 1..P-1) instead of planning them with BMP.")
@json_option
@handle_errors
def command(vision, audio, llm, stages, attention, tp, lengths, manifest, group_llm_tokens, group_vision_items,
            group_vision_tokens, group_audio_items, gpu_memory_gb, margin, zero_stage, dp, micro_batches, cuts, as_json):
    """Choose, per pipeline stage, which layers to recompute (none / selective / full) so the
    heaviest group fits --gpu-memory-gb under 1F1B, adding as little compute as possible.

    The stages are BMP's partition (as `plan-partition` prints) unless --cuts gives them. Exits 1
    with the memory needed when nothing fits.

    \b
    Example:
      balancer plan-recompute --vision internvit-6b --llm internlm2-20b --stages 8 \\
          --gpu-memory-gb 80 --zero-stage 1 --dp 8 --manifest out/ --lengths lengths.parquet
    """
    model, chain = build_model_chain(vision, audio, llm, attention, tp, stages)
    typical, per_group, info = load_workload(model, lengths, manifest, group_llm_tokens, group_vision_items,
                                             group_vision_tokens, group_audio_items)
    if cuts:
        try:
            cut_list = [int(c) for c in cuts.split(",")]
        except ValueError:
            raise UsageError(f"--cuts {cuts!r} is not a comma-separated list of layer indices", fix="e.g. --cuts 23,45,72") from None
        if len(cut_list) != stages - 1 or cut_list != sorted(set(cut_list)) or cut_list[0] <= 0 or cut_list[-1] >= len(chain):
            raise UsageError(f"--cuts {cuts!r} must be {stages - 1} increasing indices in 1..{len(chain) - 1}",
                             fix="take them from `balancer plan-partition --json` (stages[i].layers[0])")
        bounds = bounds_from_cuts(cut_list, len(chain))
    else:
        bounds = tuple(tuple(s["layers"]) for s in partition_summary(chain, typical, stages)["stages"])
    plan = plan_recompute(chain, bounds, typical, per_group, gpu_memory_gb=gpu_memory_gb, margin=margin,
                          zero_stage=zero_stage, dp=dp, micro_batches=micro_batches or stages)
    summary = recompute_summary(plan, chain)
    names = " + ".join([cfg.name for _, cfg in model.encoders] + [model.llm.name])
    summary.update({
        "models": {**{m: cfg.name for m, cfg in model.encoders}, "llm": model.llm.name},
        "workload": _describe(info, typical) + f"; memory for the heaviest of {info['num_groups']} groups",
        "workload_source": info,
        "settings": {"gpu_memory_gb": gpu_memory_gb, "margin": margin, "zero_stage": zero_stage, "dp": dp,
                     "micro_batches": micro_batches or stages, "tp": tp, "attention": attention},
        "title": (f"plan-recompute: {names}, {stages} stages, {gpu_memory_gb:g} GB/GPU, ZeRO-{zero_stage} dp {dp}, "
                  f"tp {tp}, {micro_batches or stages} micro-batches, {attention} attention"),
    })
    emit(summary, as_json, render_recompute)
