"""``balancer report``: recompute report.json/.md/.png of a manifest from its written files."""

from __future__ import annotations

import click

from balancer_cli.cli._common import emit, handle_errors, json_option
from balancer_cli.cli._options import (
    baselines_option,
    cost_fields,
    parse_baselines,
    report_cost_options,
)
from balancer_cli.cli._render import render_pack
from balancer_cli.pack.packers import registry

__all__ = ["command"]


@click.command("report")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--lengths", "lengths_files", multiple=True, type=click.Path(dir_okay=False),
              help="Lengths file(s) the manifest was packed from (default: the paths it recorded).")
@baselines_option("Comma list of baselines to compare with, or 'none' "
                  f"(default: those `pack` used; of {','.join(registry.names(baseline=True))}).", None)
@report_cost_options
@json_option
@handle_errors
def command(out, lengths_files, baselines, cost_model, vision_model, audio_model, llm_model, costs, as_json):
    """Recompute OUT/report.json, report.md and report.png from OUT/manifest.parquet and the lengths.

    The lengths table must be the one the manifest was packed from: its fingerprint is checked.
    --cost-model measures the manifest (and the baselines) with another cost model than the one it
    was packed with, e.g. a token-packed manifest in the seconds of a calibration.

    \b
    Example:
      balancer report out/
      balancer report out/ --lengths lengths.parquet --json
      balancer report out/ --cost-model measured --costs costs.json
    """
    from balancer_cli.errors import UsageError
    from balancer_cli.run import report_dir

    if cost_model is None and (costs or vision_model or audio_model or llm_model):
        raise UsageError("--costs and the --*-model options need --cost-model",
                         fix="add --cost-model measured (with --costs) or --cost-model flops (with the models)")
    cost = None if cost_model is None else cost_fields(cost_model, costs, vision=vision_model, audio=audio_model,
                                                        llm=llm_model)
    summary = report_dir(out, lengths_files=lengths_files, cost=cost,
                         baselines=None if baselines is None else parse_baselines(baselines))
    emit(summary, as_json, render_pack)
