"""``balancer plan-recompute``: per stage, the least recomputation that fits GPU memory."""

from __future__ import annotations

import click

from balancer_cli.cli._common import emit, handle_errors, json_option
from balancer_cli.cli._options import FiniteFloatRange, model_options, workload_options
from balancer_cli.planners.entry import plan_recompute_summary
from balancer_cli.planners.summary import render_recompute
from balancer_cli.planners.workload import WorkloadSpec

__all__ = ["command"]


@click.command("plan-recompute")
@model_options
@workload_options
@click.option("--gpu-memory-gb", type=FiniteFloatRange(min=0, min_open=True), required=True,
              help="Memory per GPU, GB.")
@click.option("--margin", type=FiniteFloatRange(0, 1, max_open=True), default=0.1, show_default=True,
              help="Share of GPU memory kept free (CUDA context, NCCL, fragmentation).")
@click.option("--zero-stage", type=click.IntRange(0, 3), default=0, show_default=True,
              help="ZeRO stage (1 = Megatron's distributed optimizer).")
@click.option("--dp", type=click.IntRange(min=1), default=1, show_default=True, help="Data-parallel size (ZeRO sharding).")
@click.option("--micro-batches", type=click.IntRange(min=1), default=None,
              help="Micro-batches per step and pipeline (default: --stages, so stage i holds P - i in flight).")
@click.option("--cuts", default=None, metavar="C1,C2,..",
              help="Stage boundaries (first layer of stages 1..P-1) instead of planning them with BMP.")
@click.option("--profile", type=click.Path(dir_okay=False),
              help="Measured per-layer times (JSON, or the costs.json of `balancer calibrate`): the stages are "
                   "BMP's partition of these times instead of FLOPs.")
@json_option
@handle_errors
def command(vision, audio, llm, stages, attention, tp, lengths, manifest, group_llm_tokens, group_vision_items,
            group_vision_tokens, group_audio_items, gpu_memory_gb, margin, zero_stage, dp, micro_batches, cuts, profile,
            as_json):
    """Choose, per pipeline stage, which layers to recompute (none / selective / full) so the
    heaviest group fits --gpu-memory-gb under 1F1B, adding as little compute as possible.

    The stages are BMP's partition (as `plan-partition` prints) unless --cuts gives them. Exits 1
    with the memory needed when nothing fits.

    \b
    Example:
      balancer plan-recompute --vision internvit-6b --llm internlm2-20b --stages 8 \\
          --gpu-memory-gb 80 --zero-stage 1 --dp 8 --manifest out/ --lengths lengths.parquet
    """
    workload = WorkloadSpec(lengths=lengths, manifest=manifest, group_llm_tokens=group_llm_tokens,
                            group_vision_items=group_vision_items, group_vision_tokens=group_vision_tokens,
                            group_audio_items=group_audio_items)
    summary = plan_recompute_summary(llm=llm, vision=vision, audio=audio, stages=stages, attention=attention, tp=tp,
                                     workload=workload, gpu_memory_gb=gpu_memory_gb, margin=margin,
                                     zero_stage=zero_stage, dp=dp, micro_batches=micro_batches, cuts=cuts,
                                     profile=profile)
    emit(summary, as_json, render_recompute)
