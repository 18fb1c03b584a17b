"""``balancer calibrate``: fit each module's measured cost on this machine (torch + transformers)."""

from __future__ import annotations

import os

import click

from balancer_cli.cli._common import (
    check_output_option,
    emit,
    handle_errors,
    json_option,
)
from balancer_cli.cli._options import FiniteFloatRange, quiet_option
from balancer_cli.cli._render import render_calibrate

__all__ = ["command"]


@click.command("calibrate")
@click.argument("config_dir", type=click.Path(file_okay=False))
@click.option("--lengths", "lengths_files", multiple=True, required=True, type=click.Path(dir_okay=False),
              help="Lengths file(s) (Parquet or OmniBal JSON) the timed group shapes are drawn from.")
@click.option("--modules", default=None, metavar="M1,M2", help="Modules to calibrate (default: all the model and table share).")
@click.option("--layers", type=click.IntRange(min=1), default=None, metavar="N",
              help="Build N layers per module and scale to the full depth (default: all layers).")
@click.option("--device", default="cpu", show_default=True, metavar="cpu|cuda[:i]")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--attention", type=click.Choice(["sdpa", "eager", "flash_attention_2"]), default="sdpa", show_default=True,
              help="Attention kernel; the LLM's samples attend within themselves (variable-length) in every case.")
@click.option("--max-llm-tokens", type=click.IntRange(min=1), default=None,
              help="Largest LLM group timed, in tokens (default: 8 median samples; at most 1048576); "
                   "use the cap you pack with.")
@click.option("--max-vision-items", type=click.IntRange(min=1), default=None,
              help="Largest vision group timed, in items (default: 8 median samples' items; at most 4096).")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True, help="Timed rounds over all shapes (each shape keeps its median).")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True, help="Untimed runs per shape first.")
@click.option("--gpu-memory-gb", type=FiniteFloatRange(min=0, min_open=True), default=None,
              help="GPU memory, GB: also report per module the largest cap whose groups fit (peak memory, GPU only).")
@click.option("--margin", type=FiniteFloatRange(0, 1, max_open=True), default=0.1, show_default=True,
              help="Share of --gpu-memory-gb kept free.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("-o", "--out", required=True, type=click.Path(dir_okay=False), metavar="COSTS.json")
@quiet_option
@json_option
@handle_errors
def command(config_dir, lengths_files, modules, layers, device, dtype, attention, max_llm_tokens, max_vision_items,
            repeats, warmup, gpu_memory_gb, margin, seed, out, quiet, as_json):
    """Time forward + backward of packed groups of each module of the model in CONFIG_DIR (a
    transformers config.json; random weights, no checkpoint), on shapes drawn from the lengths, and
    fit cost = a*sum(l^2) + b*sum(l) + c*count + d per module into COSTS.json.

    \b
    Example:
      balancer calibrate qwen2-vl-7b/ --lengths lengths.parquet --layers 2 --device cuda \\
          --dtype bfloat16 --attention flash_attention_2 -o costs.json
      balancer pack lengths.parquet --dp 8 --cost-model measured --costs costs.json -o out/
    """
    from balancer_cli.cost.calibration import MAX_GROUP_ITEMS, MAX_GROUP_TOKENS
    from balancer_cli.errors import BalancerError, UsageError

    # Checked before torch loads: every fit shape up to a limit is built and timed, so an
    # unbounded one ran out of memory instead of failing.
    for flag, value, most in (("--max-llm-tokens", max_llm_tokens, MAX_GROUP_TOKENS),
                              ("--max-vision-items", max_vision_items, MAX_GROUP_ITEMS)):
        if value is not None and value > most:
            raise UsageError(f"{flag} must be an integer in 1..{most}, not {value}",
                             fix=f"give the largest group you pack (its {flag} of `balancer pack`), at most {most}")
    names = None if modules is None else [m.strip() for m in modules.split(",") if m.strip()]
    if names is not None and not names:  # an empty list is a mistake, not "every module"
        raise UsageError(f"--modules {modules!r} names no module",
                         fix="give a comma list such as llm,vision, or leave --modules out to calibrate every module")
    # The model folder's own files are the inputs: costs.json may sit beside config.json.
    check_output_option(out, [os.path.join(config_dir, "config.json"), *lengths_files])
    try:  # torch and transformers are imported here only, by the runtime package
        from balancer_cli.runtime.calibrate import calibrate_to_file
    except ImportError as exc:
        raise BalancerError(f"balancer calibrate needs torch and transformers ({exc})",
                            fix="pip install 'balancer_cli[torch]' transformers") from None

    limits = {m: {key: value} for m, key, value in (("llm", "max_total", max_llm_tokens),
                                                    ("vision", "max_count", max_vision_items)) if value}
    summary = calibrate_to_file(config_dir, lengths_files, out,
                                modules=names,
                                layers=layers, device=device, dtype=dtype, attention=attention, seed=seed,
                                limits=limits or None, repeats=repeats, warmup=warmup, gpu_memory_gb=gpu_memory_gb,
                                margin=margin, progress=not quiet)
    emit(summary, as_json, render_calibrate)
