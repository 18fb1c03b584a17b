"""``balancer plan-partition``: balanced pipeline stages (BMP) for an MLLM and its balanced data."""

from __future__ import annotations

import click

from balancer_cli.cli._common import emit, handle_errors, json_option
from balancer_cli.cli._options import model_options, workload_options
from balancer_cli.planners.entry import plan_partition_summary
from balancer_cli.planners.summary import render_partition
from balancer_cli.planners.workload import WorkloadSpec

__all__ = ["command"]


@click.command("plan-partition")
@model_options
@workload_options
@click.option("--profile", type=click.Path(dir_okay=False), help="Measured per-layer times (JSON, or the costs.json of `balancer calibrate`) instead of FLOPs.")
@click.option("--method", type=click.Choice(["bmp", "exact"]), default="bmp", show_default=True,
              help="bmp: OmniBal's search (anchor + radius + top-K); exact: the min-max optimum.")
@click.option("--radius", type=click.IntRange(min=0), default=2, show_default=True, help="BMP search radius r (layers).")
@click.option("--top-k", type=click.IntRange(min=1), default=5, show_default=True, help="BMP candidates kept.")
@json_option
@handle_errors
def command(vision, audio, llm, stages, attention, tp, lengths, manifest, group_llm_tokens, group_vision_items,
            group_vision_tokens, group_audio_items, profile, method, radius, top_k, as_json):
    """Split the layer chain (encoder stem, layers, projector, LLM embedding, layers, head) into
    --stages pipeline stages with equal work for the typical group of your balanced data.

    Prints the chosen partition next to the exact optimum and the equal-layer split, then the
    Megatron-LM arguments and a DeepSpeed PipelineModule `parts` list.

    \b
    Example:
      balancer plan-partition --vision internvit-6b --llm internlm2-20b --stages 8 \\
          --manifest out/ --lengths lengths.parquet
    """
    workload = WorkloadSpec(lengths=lengths, manifest=manifest, group_llm_tokens=group_llm_tokens,
                            group_vision_items=group_vision_items, group_vision_tokens=group_vision_tokens,
                            group_audio_items=group_audio_items)
    summary = plan_partition_summary(llm=llm, vision=vision, audio=audio, stages=stages, attention=attention, tp=tp,
                                     workload=workload, profile=profile, method=method, radius=radius, top_k=top_k)
    emit(summary, as_json, render_partition)
