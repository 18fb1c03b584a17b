"""``balancer report``: recompute report.json/.md/.png of a manifest from its written files."""

from __future__ import annotations

from pathlib import Path

import click

from balancer_cli.cli._common import emit, handle_errors, json_option
from balancer_cli.cli.cmd_pack import parse_baselines, render_summary
from balancer_cli.errors import InputError, ManifestError
from balancer_cli.pack.packers.baselines import BASELINES

__all__ = ["command"]


@click.command("report")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--lengths", "lengths_files", multiple=True, type=click.Path(dir_okay=False),
              help="Lengths file(s) the manifest was packed from (default: the paths it recorded).")
@click.option("--baselines", help="Comma list of baselines to compare with, or 'none' "
              f"(default: those `pack` used; of {','.join(BASELINES)}).")
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
    from balancer_cli.lengths import read_lengths
    from balancer_cli.manifest import open_manifest
    from balancer_cli.report.build import build_report, write_report

    manifest = open_manifest(out)
    if baselines is None:
        baseline_names = tuple(manifest.meta.get("report_baselines", BASELINES))
    else:
        baseline_names = parse_baselines(baselines)
    paths = list(lengths_files) or list(manifest.meta.get("lengths_files", []))
    if not paths:
        raise ManifestError(f"{out}: the manifest records no lengths files", fix="pass them with --lengths FILE")
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        raise ManifestError(f"lengths file {missing[0]} (recorded in {out}) no longer exists",
                            fix="pass the lengths files with --lengths FILE")
    table = read_lengths(paths)
    report = build_report(manifest, table, baselines=baseline_names)
    try:
        written = write_report(out, report)
    except OSError as error:
        raise InputError(f"cannot write the report into {out}: {error.strerror or error}",
                         fix="make the manifest directory writable") from None
    summary = {"out": str(Path(out)), "files": {k: str(v) for k, v in written.items()}, **report.data}
    emit(summary, as_json, render_summary)
