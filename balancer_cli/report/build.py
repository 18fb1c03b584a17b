"""The pack report: balance metrics of a written manifest against baselines, as JSON, Markdown, PNG.

Everything is computed from what was written (``manifest.parquet``, ``dropped.parquet``) plus the
lengths table it was packed from, never from a packer's internal state. The baselines (random
batching, LLM-only FFD, faithful ISF) are re-packed from the same lengths with the manifest's
recorded caps, seed, epochs and step shape, and placed through the same assigner, so ``balancer
report OUT`` regenerates exactly what ``balancer pack`` wrote.

``report.json`` layout: ``manifest`` (parameters), ``modules.<m>.{dist_ratio, pad_ratio,
utilization}``, ``step.utilization``, ``steps``, ``groups``, ``dropped``, ``step_mix``,
optional ``post_balance``, and ``baselines.<name>`` with the same keys.

Example:
    >>> import numpy as np, tempfile
    >>> from balancer_cli.lengths import make_lengths_table
    >>> from balancer_cli.manifest import open_manifest, write_manifest
    >>> from balancer_cli.pack.config import PackConfig
    >>> from balancer_cli.pack.pipeline import pack_manifest
    >>> lt = make_lengths_table(np.arange(50, 90), {"vision": (np.full(40, 256), np.ones(40, int))})
    >>> res = pack_manifest(lt, PackConfig(world_size=2, caps=(("vision", 4), ("llm", 300)), algorithm="llm-ffd"))
    >>> out = tempfile.mkdtemp()
    >>> _ = write_manifest(out, res.rows, dropped_sample=res.dropped_sample, dropped_reason=res.dropped_reason,
    ...                    meta=res.meta, epoch_num_steps=res.epoch_num_steps)
    >>> report = build_report(open_manifest(out), lt, baselines=("random",))
    >>> sorted(report.data["baselines"]), report.data["dropped"]["count"]
    (['random'], 0)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from balancer_cli._fsutil import atomic_path
from balancer_cli.errors import BalancerError, ManifestError
from balancer_cli.lengths import LengthsTable
from balancer_cli.manifest import (
    REPORT_JSON,
    REPORT_MD,
    REPORT_PNG,
    ManifestFile,
    read_dropped,
)
from balancer_cli.pack.config import PackConfig
from balancer_cli.pack.evaluate import Evaluation, evaluate_rows
from balancer_cli.pack.inputs import PackInputs, prepare_inputs
from balancer_cli.pack.packers import registry
from balancer_cli.pack.pipeline import place_packer, sample_view
from balancer_cli.pack.windows import WindowMembers, plan_windows
from balancer_cli.replay.integrity import check_manifest
from balancer_cli.report.markdown import render_markdown

__all__ = ["Report", "build_report", "early_figure", "report_figure", "write_report"]

#: Baseline drawn next to the manifest in report.png, first available wins.
PLOT_BASELINE_PREFERENCE = ("dataloader", "isf", "llm-ffd", "random")


@dataclass(frozen=True)
class Report:
    """A report: JSON-ready ``data`` plus per-module (S, R) loads for the plots.

    Attributes:
        data: what ``report.json`` holds.
        loads: ``{"ours": {module: (S, R)}, "<baseline>": {...}}``: the manifest's and those of
            the baseline report.png draws (:data:`PLOT_BASELINE_PREFERENCE`), if any ran.
    """

    data: dict
    loads: dict


def _recorded(manifest: ManifestFile, name: str, modules: Sequence[str]) -> np.ndarray:
    """(K,) the caps or bounds (``name``) the manifest records for each of ``modules``."""
    values = (manifest.meta.get("params") or {}).get(name) or {}
    missing = [m for m in modules if m not in values]
    if missing:
        raise ManifestError(f"{manifest.path}: the metadata records no {name} for module {missing[0]!r}",
                            fix="re-run `balancer pack` (the metadata was edited after it was written)")
    return np.array([values[m] for m in modules], dtype=np.int64)


def _drawn_baseline(loads: Mapping[str, Any]) -> str | None:
    """The baseline of ``loads`` that report.png draws: the first of :data:`PLOT_BASELINE_PREFERENCE`."""
    return next((b for b in PLOT_BASELINE_PREFERENCE if b in loads), None)


def build_report(manifest: ManifestFile, lengths: LengthsTable | tuple[PackInputs, str], *,
                 baselines: Sequence[str] = registry.names(baseline=True),
                 cost: Mapping[str, Any] | None = None, ours: Evaluation | None = None,
                 plan: WindowMembers | None = None) -> Report:
    """Compute the report of a written manifest and of the requested baselines.

    Args:
        manifest: the opened manifest.
        lengths: the lengths table it was packed from (checked by fingerprint), or its prepared
            inputs and fingerprint (what ``pack`` already holds: no second read of the lengths).
        baselines: packer names of :data:`~balancer_cli.pack.packers.registry.PACKERS`; the manifest's own
            algorithm is skipped. A baseline that cannot run (e.g. too few groups for the step
            shape) is reported with its error instead of failing the report.
        cost: evaluate under another cost model than the one packed with: ``{"cost_model": ...,
            "cost_presets": ..., "costs": ...}`` (PackConfig fields), e.g. a token-packed manifest
            under measured seconds. Baselines are evaluated under it too.
        ours: the manifest's rows already evaluated by whoever wrote them (``balancer pack``
            evaluates the rows it writes: :attr:`~balancer_cli.pack.pipeline.PackResult.evaluation`);
            used instead of evaluating the read rows again unless ``cost`` asks for another model.
            The written manifest is checked either way.
        plan: the windows the manifest packed, from whoever packed it
            (:attr:`~balancer_cli.pack.pipeline.PackResult.plan`): the baselines pack the same ones
            (the run's seed, epochs, window size and caps), so they reuse it instead of planning again.

    Raises:
        ManifestError: the manifest disagrees with its metadata or loses/duplicates a sample
            (:func:`~balancer_cli.replay.integrity.check_manifest`).
    """
    rows = check_manifest(manifest)  # metadata, step shape and conservation, before any metric
    meta = manifest.meta
    cost = dict(cost or {})
    config = PackConfig.from_meta(meta, str(manifest.path), **cost)
    if isinstance(lengths, tuple):
        inputs, fingerprint = lengths
    else:
        inputs, fingerprint = prepare_inputs(lengths, config.cost_model, config.cost_presets, costs=config.costs), lengths.fingerprint
    manifest.check_lengths(fingerprint)
    caps_K, bounds_K = (_recorded(manifest, name, inputs.modules) for name in ("caps", "bounds"))
    dropped_sample, dropped_reason = read_dropped(manifest.path)
    shape = dict(caps_K=caps_K, world_size=config.world_size, micro_batches=config.micro_batches)
    if ours is None or cost:
        ours = evaluate_rows(inputs, rows, dropped_sample, tuple(dropped_reason),
                             epoch_num_steps=manifest.epoch_num_steps, **shape)
    data = {
        "manifest": {
            "algorithm": config.algorithm, "params": meta.get("params", {}),
            "seed": config.seed, "world_size": config.world_size, "micro_batches": config.micro_batches,
            "epochs": config.epochs, "num_samples": inputs.num_samples, "modules": list(inputs.modules),
            "lengths_fingerprint": fingerprint,
            # what the metrics below measure with (the packing's own, unless the report was asked for another)
            "cost_model": config.cost_model,
        },
        **ours.metrics,
        "baselines": {},
    }
    loads = {"ours": ours.loads}
    # The random baseline batches as many samples per group as the manifest does on average.
    placed_per_epoch = len(rows) / max(config.epochs, 1)
    del rows  # the baselines below pack from the lengths alone
    groups_per_epoch = max(manifest.num_steps * config.shape.groups_per_step / max(config.epochs, 1), 1)
    base_config = PackConfig.from_meta(meta, str(manifest.path), batch_size=max(1, round(placed_per_epoch / groups_per_epoch)), **cost)
    for name in baselines:
        if name == config.algorithm:
            continue
        try:
            # Every baseline packs the same windows: pack's own plan, or planned once (10M: ~1.2 s a plan).
            plan = plan if plan is not None else plan_windows(sample_view(inputs), base_config, caps_K)
            b_rows, b_dropped, b_reasons, b_epochs = place_packer(name, inputs, base_config, caps_K, bounds_K,
                                                                  plan=plan)
        except (BalancerError, ImportError) as error:
            data["baselines"][name] = {"error": str(error)}
            continue
        evaluation: Evaluation = evaluate_rows(inputs, b_rows, b_dropped, b_reasons, epoch_num_steps=b_epochs, **shape)
        data["baselines"][name] = evaluation.metrics
        if name in ("random", "dataloader"):
            data["baselines"][name]["batch_size"] = base_config.batch_size
        # Only the figure's baseline keeps its (S, R) loads (28 MB per 10M-sample baseline): with
        # every baseline's kept, the last one packed 0.1 GB over the first.
        loads[name] = evaluation.loads
        drawn = _drawn_baseline(loads)
        for other in [b for b in loads if b not in ("ours", drawn)]:
            del loads[other]
        # One baseline's rows at a time: free them before the next baseline packs.
        del b_rows, b_dropped, b_reasons, evaluation
    return Report(data, loads)


def write_report(out_dir: str | os.PathLike, report: Report, *, plotter: Any = None) -> dict[str, Path]:
    """Write report.json, report.md and report.png into ``out_dir`` (each atomically).

    The caller rewrites the folder's commit record afterwards (``balancer report``) or commits
    the whole folder (``balancer pack``). ``plotter``: a
    :class:`~balancer_cli.report.plot_worker.PlotWorker` that draws the PNG (the same bytes;
    default: :func:`~balancer_cli.report.plot.plot_report` in this process).
    """
    from balancer_cli.report.plot import plot_report

    out = Path(out_dir)
    paths = {"json": out / REPORT_JSON, "md": out / REPORT_MD, "png": out / REPORT_PNG}
    with atomic_path(paths["json"]) as tmp:
        tmp.write_text(json.dumps(report.data, indent=2, sort_keys=True) + "\n")
    with atomic_path(paths["md"]) as tmp:
        tmp.write_text(render_markdown(report.data))
    with atomic_path(paths["png"]) as tmp:
        plot = plot_report if plotter is None else plotter.plot
        ours, baseline, labels = report_figure(report.loads, report.data["manifest"]["algorithm"])
        plot(tmp, ours, baseline, **labels)
    return paths


def report_figure(loads: Mapping[str, Any], algorithm: str) -> tuple[Any, Any, dict[str, Any]]:
    """What report.png draws from a report's ``loads``: ``(ours, baseline or None, labels)`` for
    :func:`~balancer_cli.report.plot.plot_report`.

    Example:
        >>> report_figure({"ours": {}, "isf": {}, "random": {}}, "balanced")[2]
        {'ours_label': 'ours (balanced)', 'baseline_label': 'isf'}
    """
    baseline = _drawn_baseline(loads)
    return (loads["ours"], loads[baseline] if baseline else None,
            {"ours_label": f"ours ({algorithm})", "baseline_label": baseline})


def early_figure(ours: Any, algorithm: str, baselines: Sequence[str]) -> tuple[Any, Any, dict[str, Any]] | None:
    """report.png's figure before the report exists, when none of ``baselines`` can join it
    (``--baselines none``): :func:`report_figure` of the manifest's loads alone; else None.

    Example:
        >>> early_figure({}, "balanced", ["isf"]) is None, early_figure({}, "isf", ["isf"])[1]
        (True, None)
    """
    if any(b in PLOT_BASELINE_PREFERENCE and b != algorithm for b in baselines):
        return None
    return report_figure({"ours": ours}, algorithm)
