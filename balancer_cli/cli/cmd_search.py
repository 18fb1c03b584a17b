"""``balancer search``: rank packing thresholds (caps, ISF bounds) for a dataset and a step shape."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from balancer_cli.cli._common import emit, handle_errors, json_option
from balancer_cli.cli._options import cost_model_options
from balancer_cli.cli.cmd_pack import NAMED_ENCODERS, caps_from_options, cost_presets, max_item_options, progress

__all__ = ["command"]


def _render(summary: Mapping[str, Any]) -> str:
    from balancer_cli.report.build import format_text_table
    from balancer_cli.report.search import search_table

    best = summary["best"]
    caps = ", ".join(f"{m}={c}" for m, c in best["caps"].items())
    lines = [
        f"searched {len(summary['candidates'])} candidates ({summary['algorithm']}) on {summary['sample_size']} of "
        f"{summary['num_samples']} samples for {summary['world_size']} ranks x "
        f"{summary['micro_batches']} micro-batches",
        f"best caps: {caps}" + (f"; bounds: {', '.join(f'{m}={b}' for m, b in best['bounds'].items())}"
                                if summary["algorithm"] == "isf" else ""),
        "",
        format_text_table(*search_table(summary, top=summary["top"])),
    ]
    if summary.get("files"):
        lines += ["", "wrote " + ", ".join(summary["files"].values())]
    cli_caps = " ".join(
        f"--max-llm-tokens {c}" if m == "llm" else (f"--max-{m}-items {c}" if m in NAMED_ENCODERS else f"--cap {m}={c}")
        for m, c in best["caps"].items())
    lines += ["", f"pack with: balancer pack ... --dp {summary['world_size']} {cli_caps}"]
    return "\n".join(lines)


@click.command("search")
@click.argument("lengths", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--dp", "world_size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Data-parallel ranks R.")
@click.option("--micro-batches", type=click.IntRange(min=1), default=1, show_default=True,
              help="Groups per rank per step M.")
@click.option("--algorithm", type=click.Choice(["balanced", "isf"]), default="balanced", show_default=True)
@click.option("--max-llm-tokens", type=click.IntRange(min=1), help="Memory limit on LLM tokens per group.")
@max_item_options("Memory limit on {module} items per group (the largest cap tried).")
@click.option("--cap", multiple=True, metavar="MODULE=V", help="Memory limit of any module.")
@click.option("--target-group-size", type=click.FloatRange(min=1), help="Mean samples per group to aim at.")
@click.option("--grid", type=click.IntRange(min=2), default=5, show_default=True, help="Cap values tried per module.")
@click.option("--sample-size", type=click.IntRange(min=100), default=12_000, show_default=True,
              help="Samples each candidate is evaluated on (a seeded subsample).")
@click.option("--seed", type=int, default=0, show_default=True)
@cost_model_options
@click.option("-o", "--out", type=click.Path(dir_okay=False), help="Write the search as JSON here.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write the objective heat map (PNG) here.")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True, help="Candidates to print.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@json_option
@handle_errors
def command(lengths, world_size, micro_batches, algorithm, max_llm_tokens, max_vision_items, max_audio_items,
            max_video_items, cap, target_group_size, grid, sample_size, seed, cost_model, vision_model,
            audio_model, llm_model, out, plot, top, quiet, as_json):
    """Search packing caps for LENGTHS (lengths Parquet and/or OmniBal JSON files): print the ranked
    candidates, optionally write them as JSON (-o) and a heat map of the objective (--plot).

    Caps given here are memory limits: the search tries caps up to them.

    \b
    Example:
      balancer search data/*_token_lengths.json --dp 8 --max-llm-tokens 16384 -o search.json --plot search.png
    """
    import json

    from balancer_cli._fsutil import atomic_path
    from balancer_cli.lengths import read_lengths
    from balancer_cli.pack.pipeline import PackConfig, prepare_inputs, run_search
    from balancer_cli.report.search import plot_search, search_data

    caps = caps_from_options(max_llm_tokens, {"vision": max_vision_items, "audio": max_audio_items,
                                              "video": max_video_items}, cap)
    with progress(3, quiet, "search") as bar:
        table = read_lengths(list(lengths))
        presets = cost_presets(cost_model, vision=vision_model, audio=audio_model, llm=llm_model)
        inputs = prepare_inputs(table, cost_model, presets)
        bar.update()
        config = PackConfig(world_size=world_size, micro_batches=micro_batches, algorithm=algorithm, caps=caps,
                            seed=seed, cost_model=cost_model, cost_presets=presets,
                            target_group_size=target_group_size)
        result = run_search(inputs, config, grid=grid, sample_size=sample_size)
        bar.update()
        data = search_data(result, inputs.modules, extra={
            "world_size": world_size, "micro_batches": micro_batches, "num_samples": inputs.num_samples,
            "lengths_fingerprint": table.fingerprint, "max_caps": dict(caps)})
        files = {}
        if out:
            with atomic_path(out) as tmp:
                tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
            files["json"] = str(Path(out))
        if plot:
            with atomic_path(plot) as tmp:
                plot_search(tmp, data)
            files["plot"] = str(Path(plot))
        bar.update()
    emit({**data, "files": files, "top": top}, as_json, _render)
