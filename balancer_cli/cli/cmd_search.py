"""``balancer search``: rank packing thresholds (caps, ISF bounds) for a dataset and a step shape."""

from __future__ import annotations

import click

from balancer_cli.cli._common import emit, handle_errors, json_option, progress
from balancer_cli.cli._options import (
    FiniteFloatRange,
    cap_options,
    caps_from_options,
    cost_fields,
    cost_model_options,
    quiet_option,
    step_shape_options,
)
from balancer_cli.cli._render import render_search
from balancer_cli.pack.packers import registry

__all__ = ["command"]


@click.command("search")
@click.argument("lengths", nargs=-1, required=True, type=click.Path(dir_okay=False))
@step_shape_options
@click.option("--algorithm", type=click.Choice(registry.names(selectable=True)), default="balanced",
              show_default=True)
@cap_options("Memory limit on LLM tokens per group.", "Memory limit on {module} items per group (the largest cap tried).",
             "Memory limit of any module.")
@click.option("--target-group-size", type=FiniteFloatRange(min=1), help="Mean samples per group to aim at.")
@click.option("--grid", type=click.IntRange(min=2), default=5, show_default=True, help="Cap values tried per module.")
@click.option("--sample-size", type=click.IntRange(min=100), default=12_000, show_default=True,
              help="Samples each candidate is evaluated on (a seeded subsample).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@cost_model_options
@click.option("-o", "--out", type=click.Path(dir_okay=False), help="Write the search as JSON here.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write the objective heat map (PNG) here.")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True, help="Candidates to print.")
@quiet_option
@json_option
@handle_errors
def command(lengths, world_size, micro_batches, algorithm, max_llm_tokens, max_vision_items, max_audio_items,
            max_video_items, caps, target_group_size, grid, sample_size, seed, cost_model, vision_model,
            audio_model, llm_model, costs, out, plot, top, quiet, as_json):
    """Search packing caps for LENGTHS (lengths Parquet and/or OmniBal JSON files): print the ranked
    candidates, optionally write them as JSON (-o) and a heat map of the objective (--plot).

    Caps given here are memory limits: the search tries caps up to them.

    \b
    Example:
      balancer search data/*_token_lengths.json --dp 8 --max-llm-tokens 16384 -o search.json --plot search.png
    """
    from balancer_cli.errors import UsageError
    from balancer_cli.pack.config import PackConfig
    from balancer_cli.pack.search import MAX_GRID
    from balancer_cli.run import SEARCH_PHASES, search_to_files

    if grid > MAX_GRID:  # click checks the least; the most lives with the search (imported late: heavy)
        raise UsageError(f"--grid must be an integer in 2..{MAX_GRID}, not {grid}",
                         fix="try a few values per module (default 5): the search packs grid^modules candidates")
    config = PackConfig(
        world_size=world_size, micro_batches=micro_batches, algorithm=algorithm, seed=seed,
        caps=caps_from_options(max_llm_tokens, {"vision": max_vision_items, "audio": max_audio_items,
                                                "video": max_video_items}, caps),
        **cost_fields(cost_model, costs, vision=vision_model, audio=audio_model, llm=llm_model),
        target_group_size=target_group_size)
    with progress(len(SEARCH_PHASES), quiet, "search") as bar:
        data = search_to_files(lengths, config, grid=grid, sample_size=sample_size, out=out, plot=plot,
                               on_phase=lambda phase: bar.update())
    emit({**data, "top": top}, as_json, render_search)
