"""``balancer plan-partition``: balanced pipeline stages (BMP) for an MLLM and its balanced data."""

from __future__ import annotations

import click

from balancer_cli.cli._common import emit, handle_errors, json_option
from balancer_cli.cli._plan_common import build_model_chain, load_profile, load_workload, model_options, workload_options
from balancer_cli.planners.summary import partition_summary, render_partition


@click.command("plan-partition")
@model_options
@workload_options
@click.option("--profile", type=click.Path(dir_okay=False), help="Measured per-layer times (JSON) instead of FLOPs.")
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
    model, chain = build_model_chain(vision, audio, llm, attention, tp, stages)
    typical, _, info = load_workload(model, lengths, manifest, group_llm_tokens, group_vision_items,
                                     group_vision_tokens, group_audio_items)
    costs = load_profile(profile, chain) if profile else None
    summary = partition_summary(chain, typical, stages, costs=costs, radius=radius, top_k=top_k, method=method)
    names = " + ".join([cfg.name for _, cfg in model.encoders] + [model.llm.name])
    summary.update({
        "models": {**{m: cfg.name for m, cfg in model.encoders}, "llm": model.llm.name},
        "workload": _describe(info, typical),
        "workload_source": info,
        "typical_group": typical,
        "cost_unit": "seconds" if profile else "FLOPs",
        "title": f"plan-partition: {names}, {stages} stages, {len(chain)} layers, tp {tp}, {attention} attention",
    })
    emit(summary, as_json, render_partition)


def _describe(info, typical) -> str:
    parts = [f"{k.split('.')[0]} {v:,.0f} tokens" for k, v in typical.items() if k.endswith(".tokens")]
    where = {"manifest": f"mean of {info.get('num_groups')} groups of {info.get('manifest')}",
             "lengths": f"mean of {info.get('num_groups')} groups of consecutive samples up to "
                        f"{info.get('group_llm_tokens')} LLM tokens",
             "explicit": "one group given by options"}[info["source"]]
    return f"typical group ({where}): " + ", ".join(parts)
