"""``balancer pack``: lengths -> balanced manifest (+ dropped list and report vs baselines)."""

from __future__ import annotations

import click

from balancer_cli.cli._common import emit, handle_errors, json_option, progress
from balancer_cli.cli._options import (
    FiniteFloatRange,
    baselines_option,
    cap_options,
    caps_from_options,
    cost_fields,
    cost_model_options,
    parse_baselines,
    parse_pairs,
    quiet_option,
    step_shape_options,
)
from balancer_cli.cli._render import render_pack
from balancer_cli.pack.packers import registry
from balancer_cli.pack.types import OVERSIZE_POLICIES

__all__ = ["command"]


@click.command("pack")
@click.argument("lengths", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("-o", "--out", required=True, type=click.Path(file_okay=False), help="Output manifest directory.")
@step_shape_options
@click.option("--algorithm", type=click.Choice(registry.names(selectable=True)), default="balanced",
              show_default=True, help="Packer: ours (balanced) or OmniBal's ISF.")
@cap_options("Cap Qt on LLM tokens per group.", "Cap Q on {module} items (images/tiles/clips) per group.",
             "Cap of any module (items; tokens for llm).")
@click.option("--bound", "bounds", multiple=True, metavar="MODULE=V",
              help="ISF acceptance bound Q' (default 0.9 x cap).")
@click.option("--iterations", type=click.IntRange(min=1), default=50, show_default=True, help="ISF iterations C.")
@click.option("--oversize", type=click.Choice(OVERSIZE_POLICIES), default="isolate", show_default=True,
              help="A sample over a cap on its own: own group, dropped, or an error.")
@click.option("--epochs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Epochs to pack (each with its own seeded streams); steps are numbered across epochs.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@cost_model_options
@click.option("--target-group-size", type=click.IntRange(min=1), help="Samples per group the search aims at.")
@baselines_option("Comma list of baselines to compare with in the report, or 'none'.",
                  ",".join(registry.names(baseline=True)))
@click.option("--post-balance", is_flag=True, help="Add per-phase <m>_rank columns (post-balancing dispatcher).")
@click.option("--window-samples", type=click.IntRange(min=1), default=None, metavar="W",
              help="Pack in windows of about W samples (stratified by source), each a run of whole steps; "
                   "default: from --memory-gb, at most 1.5M (larger windows run slower).")
@click.option("--memory-gb", type=FiniteFloatRange(min=0, min_open=True), default=None, metavar="G",
              help="Peak memory of the whole run, in GiB (default 8): sets the window size; a budget too small "
                   "for the samples is refused with the size needed.")
@click.option("--engine", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="Where windows are packed: this process, or Ray tasks (needs the [ray] extra); same output.")
@click.option("--ray-address", default=None, metavar="ADDR",
              help="--engine ray: an existing cluster (auto, HOST:6379, ray://HOST:10001); default: start a local "
                   "one. Finished windows go to OUT.parts/ (rerunning resumes from them).")
@click.option("--keep-parts", is_flag=True, help="--engine ray: keep OUT.parts/ (the finished windows) afterwards.")
@quiet_option
@json_option
@handle_errors
def command(lengths, out, world_size, micro_batches, algorithm, max_llm_tokens, max_vision_items, max_audio_items,
            max_video_items, caps, bounds, iterations, oversize, epochs, seed, cost_model, vision_model,
            audio_model, llm_model, costs, target_group_size, baselines, post_balance, window_samples, memory_gb, engine,
            ray_address, keep_parts, quiet, as_json):
    """Pack LENGTHS (lengths Parquet and/or OmniBal token-length JSON files, concatenated in order)
    into balanced mini-batches; write OUT/manifest.parquet, dropped.parquet and report.json/.md/.png.

    When not every module has a cap, the threshold search picks the caps (given caps act as upper
    limits). Same inputs and seed give byte-identical manifest, dropped list and report.json.

    \b
    Example:
      balancer pack data/*_token_lengths.json --dp 8 -o out/
      balancer pack lengths.parquet --dp 8 --max-llm-tokens 8192 --max-vision-items 24 -o out/
      balancer pack lengths_100m.parquet --dp 512 --window-samples 4000000 --engine ray -o out/
    """
    from balancer_cli.pack.config import PackConfig
    from balancer_cli.run import PACK_PHASES, pack_to_dir

    config = PackConfig(
        world_size=world_size, micro_batches=micro_batches, algorithm=algorithm,
        caps=caps_from_options(max_llm_tokens, {"vision": max_vision_items, "audio": max_audio_items,
                                                "video": max_video_items}, caps),
        bounds=tuple(sorted(parse_pairs(bounds, "--bound").items())), iterations=iterations, oversize=oversize,
        epochs=epochs, seed=seed, **cost_fields(cost_model, costs, vision=vision_model, audio=audio_model, llm=llm_model),
        target_group_size=target_group_size, post_balance=post_balance, window_samples=window_samples)
    with progress(len(PACK_PHASES), quiet, "pack") as bar:

        def on_window(done: int, total: int) -> None:
            if total > 1:  # a windowed run: long enough to follow window by window
                bar.set_postfix_str(f"window {done}/{total}")

        summary = pack_to_dir(lengths, out, config, baselines=parse_baselines(baselines),
                              on_phase=lambda phase: bar.update(), memory_gb=memory_gb, engine=engine,
                              ray_address=ray_address, keep_parts=keep_parts,
                              notify=None if quiet else lambda line: click.echo(line, err=True), on_window=on_window)
    emit(summary, as_json, render_pack)
