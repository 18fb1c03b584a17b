"""``balancer report``: recompute report.json/.md/.png of a manifest from its written files."""

from __future__ import annotations

import click

from balancer_cli.cli._common import emit, handle_errors, json_option
from balancer_cli.cli._options import baselines_option, parse_baselines
from balancer_cli.cli._render import render_pack
from balancer_cli.pack.packers import registry

__all__ = ["command"]


@click.command("report")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--lengths", "lengths_files", multiple=True, type=click.Path(dir_okay=False),
              help="Lengths file(s) the manifest was packed from (default: the paths it recorded).")
@baselines_option("Comma list of baselines to compare with, or 'none' "
                  f"(default: those `pack` used; of {','.join(registry.names(baseline=True))}).", None)
@json_option
@handle_errors
def command(out, lengths_files, baselines, as_json):
    """Recompute OUT/report.json, report.md and report.png from OUT/manifest.parquet and the lengths.

    The lengths table must be the one the manifest was packed from: its fingerprint is checked.

    \b
    Example:
      balancer report out/
      balancer report out/ --lengths lengths.parquet --json
    """
    from balancer_cli.run import report_dir

    summary = report_dir(out, lengths_files=lengths_files,
                         baselines=None if baselines is None else parse_baselines(baselines))
    emit(summary, as_json, render_pack)
