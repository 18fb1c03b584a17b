"""``balancer pack``: lengths -> balanced manifest (+ dropped list and report vs baselines)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from balancer_cli.cli._common import emit, handle_errors, json_option
from balancer_cli.cli._options import cost_model_options
from balancer_cli.errors import InputError, UsageError
from balancer_cli.lengths import LLM
from balancer_cli.pack.packers.baselines import BASELINES
from balancer_cli.pack.pipeline import OVERSIZE_POLICIES

__all__ = ["command", "parse_pairs", "parse_baselines", "caps_from_options", "cost_presets", "render_summary",
           "progress"]

#: Encoders with a dedicated ``--max-<m>-items`` option; any other module uses ``--cap m=V``.
NAMED_ENCODERS = ("vision", "audio", "video")


def parse_pairs(values: tuple[str, ...], option: str) -> dict[str, int]:
    """``("vision=12", "llm=8192")`` -> ``{"vision": 12, "llm": 8192}`` (raises UsageError)."""
    pairs = {}
    for value in values:
        module, sep, number = value.partition("=")
        if not sep or not module or not number.strip().lstrip("-").isdigit():
            raise UsageError(f"{option} {value!r} is not MODULE=INTEGER", fix=f"write e.g. {option} vision=12")
        pairs[module.strip()] = int(number)
    return pairs


def parse_baselines(value: str) -> tuple[str, ...]:
    """``"random,llm-ffd"`` -> ``("random", "llm-ffd")``; ``"none"`` or ``""`` -> ``()``."""
    names = tuple(x.strip() for x in value.split(",") if x.strip() and x.strip() != "none")
    unknown = [n for n in names if n not in BASELINES]
    if unknown:
        raise UsageError(f"unknown baseline {unknown[0]!r}",
                         fix=f"use a comma list of: {', '.join(BASELINES)}, or none")
    return names


def caps_from_options(max_llm_tokens: int | None, max_items: Mapping[str, int | None], cap: tuple[str, ...]
                      ) -> tuple[tuple[str, int], ...]:
    """Merge ``--max-llm-tokens``, ``--max-<m>-items`` and ``--cap m=V`` into ``((module, cap), ...)``."""
    caps = parse_pairs(cap, "--cap")
    if max_llm_tokens is not None:
        caps[LLM] = max_llm_tokens
    caps.update({m: v for m, v in max_items.items() if v is not None})
    return tuple(sorted(caps.items()))


def cost_presets(cost_model: str, **presets: str | None) -> tuple[tuple[str, str], ...]:
    """``((module, preset), ...)`` of the ``--<m>-model`` options given (none under ``tokens``)."""
    if cost_model == "tokens":
        return ()
    return tuple(sorted((m, p) for m, p in presets.items() if p))


def progress(total: int, quiet: bool, desc: str):
    """A tqdm bar on stderr, silent when not a terminal or with ``--quiet``."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, disable=quiet or not sys.stderr.isatty(), leave=False)


def render_summary(summary: Mapping[str, Any]) -> str:
    """The text summary: what was written, the parameters, and ours vs baselines."""
    from balancer_cli.report.build import format_text_table, summary_table

    params = summary["manifest"]["params"]
    caps = ", ".join(f"{m}={c}" for m, c in params["caps"].items())
    steps = summary["steps"]
    lines = [
        f"packed {summary['manifest']['num_samples']} samples into {steps['total']} steps "
        f"({summary['manifest']['world_size']} ranks x {summary['manifest']['micro_batches']} micro-batches, "
        f"{summary['manifest']['epochs']} epoch(s)) -> {summary['out']}",
        f"caps {caps}" + (" (searched)" if params.get("searched") else "")
        + f"; dropped {summary['dropped']['count']} ({100 * summary['dropped']['share']:.2f}%)",
        "",
        format_text_table(*summary_table(summary)),
    ]
    if "post_balance" in summary:
        post = summary["post_balance"]
        phases = ", ".join(f"{m} {summary['modules'][m]['utilization']:.3f} -> {v['utilization']:.3f}"
                           for m, v in post["modules"].items())
        lines.append(f"post-balancing: utilization {phases}; step {summary['step']['utilization']:.3f} -> "
                     f"{post['step']['utilization']:.3f}")
    return "\n".join(lines)


def _release_arrow_memory() -> None:
    """Hand memory Arrow freed back to the OS: its allocator keeps freed pages otherwise (reading a
    10M-sample lengths file leaves ~340 MiB of them), which would count towards the run's peak."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()


def max_item_options(help_template: str):
    """Decorator adding ``--max-<m>-items`` for every named encoder; ``help_template`` has ``{module}``."""

    def decorate(fn):
        for module in reversed(NAMED_ENCODERS):
            fn = click.option(f"--max-{module}-items", f"max_{module}_items", type=click.IntRange(min=1),
                              help=help_template.format(module=module))(fn)
        return fn

    return decorate


@click.command("pack")
@click.argument("lengths", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("-o", "--out", required=True, type=click.Path(file_okay=False), help="Output manifest directory.")
@click.option("--dp", "world_size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Data-parallel ranks R.")
@click.option("--micro-batches", type=click.IntRange(min=1), default=1, show_default=True,
              help="Groups per rank per step M.")
@click.option("--algorithm", type=click.Choice(["balanced", "isf"]), default="balanced", show_default=True,
              help="Packer: ours (balanced) or OmniBal's ISF.")
@click.option("--max-llm-tokens", type=click.IntRange(min=1), help="Cap Qt on LLM tokens per group.")
@max_item_options("Cap Q on {module} items (images/tiles/clips) per group.")
@click.option("--cap", multiple=True, metavar="MODULE=V", help="Cap of any module (items; tokens for llm).")
@click.option("--bound", multiple=True, metavar="MODULE=V", help="ISF acceptance bound Q' (default 0.9 x cap).")
@click.option("--iterations", type=click.IntRange(min=1), default=50, show_default=True, help="ISF iterations C.")
@click.option("--oversize", type=click.Choice(OVERSIZE_POLICIES), default="isolate", show_default=True,
              help="A sample over a cap on its own: own group, dropped, or an error.")
@click.option("--epochs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Epochs to pack (epoch e uses seed S+e); steps are numbered across epochs.")
@click.option("--seed", type=int, default=0, show_default=True)
@cost_model_options
@click.option("--target-group-size", type=click.IntRange(min=1), help="Samples per group the search aims at.")
@click.option("--baselines", default=",".join(BASELINES), show_default=True,
              help="Comma list of baselines to compare with in the report, or 'none'.")
@click.option("--post-balance", is_flag=True, help="Add per-phase <m>_rank columns (post-balancing dispatcher).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@json_option
@handle_errors
def command(lengths, out, world_size, micro_batches, algorithm, max_llm_tokens, max_vision_items, max_audio_items,
            max_video_items, cap, bound, iterations, oversize, epochs, seed, cost_model, vision_model,
            audio_model, llm_model, target_group_size, baselines, post_balance, quiet, as_json):
    """Pack LENGTHS (lengths Parquet and/or OmniBal token-length JSON files, concatenated in order)
    into balanced mini-batches; write OUT/manifest.parquet, dropped.parquet and report.json/.md/.png.

    When not every module has a cap, the threshold search picks the caps (given caps act as upper
    limits). Same inputs and seed give byte-identical manifest, dropped list and report.json.

    \b
    Example:
      balancer pack data/*_token_lengths.json --dp 8 -o out/
      balancer pack lengths.parquet --dp 8 --max-llm-tokens 8192 --max-vision-items 24 -o out/
    """
    from balancer_cli.lengths import read_lengths
    from balancer_cli.manifest import open_manifest, write_manifest
    from balancer_cli.pack.pipeline import PackConfig, pack_inputs, prepare_inputs
    from balancer_cli.report.build import build_report, write_report

    baseline_names = parse_baselines(baselines)
    caps = caps_from_options(max_llm_tokens, {"vision": max_vision_items, "audio": max_audio_items,
                                              "video": max_video_items}, cap)
    with progress(4, quiet, "pack") as bar:
        table = read_lengths(list(lengths))
        bar.update()
        config = PackConfig(
            world_size=world_size, micro_batches=micro_batches, algorithm=algorithm, caps=caps,
            bounds=tuple(sorted(parse_pairs(bound, "--bound").items())), iterations=iterations, oversize=oversize,
            epochs=epochs, seed=seed, cost_model=cost_model,
            cost_presets=cost_presets(cost_model, vision=vision_model, audio=audio_model, llm=llm_model),
            target_group_size=target_group_size,
            lengths_files=tuple(os.path.abspath(p) for p in lengths), post_balance=post_balance)
        # Pack from the per-sample matrices alone and drop the Arrow table meanwhile (it is read
        # again for the report): at 10M samples that keeps a few hundred MB off the peak.
        inputs = prepare_inputs(table, config.cost_model, config.cost_presets)
        fingerprint = table.fingerprint
        del table
        _release_arrow_memory()
        result = pack_inputs(inputs, config, lengths_fingerprint=fingerprint)
        del inputs
        bar.update()
        try:
            write_manifest(out, result.rows, dropped_sample=result.dropped_sample,
                           dropped_reason=result.dropped_reason,
                           # `balancer report OUT` compares with the same baselines by default
                           meta={**result.meta, "report_baselines": list(baseline_names)},
                           epoch_num_steps=result.epoch_num_steps)
            del result  # the report re-reads the written rows: do not hold a second copy meanwhile
            bar.update()
            table = read_lengths(list(lengths))
            _release_arrow_memory()
            report = build_report(open_manifest(out), table, baselines=baseline_names)
            paths = write_report(out, report)
        except OSError as error:
            raise InputError(f"cannot write to {out}: {error.strerror or error}",
                             fix="pass a writable directory with -o") from None
        bar.update()
    summary = {"out": str(Path(out)), "files": {k: str(v) for k, v in paths.items()}, **report.data}
    emit(summary, as_json, render_summary)
