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
    >>> from balancer_cli.pack.pipeline import PackConfig, pack_manifest
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

from balancer_cli.errors import BalancerError, ManifestError
from balancer_cli._fsutil import atomic_path
from balancer_cli.lengths import LengthsTable
from balancer_cli.manifest import REPORT_JSON, REPORT_MD, REPORT_PNG, ManifestFile, read_dropped
from balancer_cli.pack.packers.baselines import BASELINES, run_baseline
from balancer_cli.report.evaluate import Evaluation, evaluate_rows
from balancer_cli.pack.pipeline import PackConfig, prepare_inputs

__all__ = ["Report", "build_report", "write_report", "render_markdown", "summary_table", "check_fingerprint"]

#: Baseline drawn next to the manifest in report.png, first available wins.
PLOT_BASELINE_PREFERENCE = ("dataloader", "isf", "llm-ffd", "random")


@dataclass(frozen=True)
class Report:
    """A report: JSON-ready ``data`` plus per-module (S, R) loads for the plots.

    Attributes:
        data: what ``report.json`` holds.
        loads: ``{"ours": {module: (S, R)}, "<baseline>": {...}}``.
    """

    data: dict
    loads: dict


def check_fingerprint(manifest: ManifestFile, lengths: LengthsTable, origin: str = "the lengths table") -> None:
    """Raise :class:`ManifestError` when ``lengths`` is not the table the manifest was packed from."""
    expected = manifest.meta.get("lengths_fingerprint")
    if expected != lengths.fingerprint:
        raise ManifestError(
            f"{origin} (fingerprint {lengths.fingerprint[:12]}) is not the one {manifest.path} was packed from "
            f"(fingerprint {str(expected)[:12]})",
            fix="pass the same lengths files, in the same order, with --lengths")


def config_from_meta(meta: Mapping[str, Any], batch_size: int | None = None) -> PackConfig:
    """The :class:`PackConfig` a manifest was packed with (from its metadata)."""
    params = meta.get("params", {})
    return PackConfig(
        world_size=int(meta["world_size"]), micro_batches=int(meta["micro_batches"]),
        algorithm=str(meta.get("algorithm", "balanced")),
        caps=tuple((m, int(c)) for m, c in params.get("caps", {}).items()),
        bounds=tuple((m, int(b)) for m, b in params.get("bounds", {}).items()),
        iterations=int(params.get("iterations", 50)), oversize=str(params.get("oversize", "isolate")),
        epochs=len(meta.get("epoch_num_steps", [1])), seed=int(meta.get("seed", 0)),
        cost_model=str(params.get("cost_model", "tokens")),
        cost_presets=tuple(sorted(dict(params.get("cost_presets", {})).items())),
        target_group_size=params.get("target_group_size"),
        batch_size=batch_size, lengths_files=tuple(meta.get("lengths_files", ())))


def build_report(manifest: ManifestFile, lengths: LengthsTable, *, baselines: Sequence[str] = BASELINES) -> Report:
    """Compute the report of a written manifest and of the requested baselines.

    Args:
        manifest: the opened manifest.
        lengths: the lengths table it was packed from (checked by fingerprint).
        baselines: names from :data:`~balancer_cli.pack.packers.baselines.BASELINES`; the manifest's own
            algorithm is skipped. A baseline that cannot run (e.g. too few groups for the step
            shape) is reported with its error instead of failing the report.
    """
    check_fingerprint(manifest, lengths)
    meta = manifest.meta
    config = config_from_meta(meta)
    inputs = prepare_inputs(lengths, config.cost_model, config.cost_presets)
    caps_K = np.array([meta["params"]["caps"][m] for m in inputs.modules], dtype=np.int64)
    bounds_K = np.array([meta["params"]["bounds"][m] for m in inputs.modules], dtype=np.int64)
    rows = manifest.read_all()
    dropped_sample, dropped_reason = read_dropped(manifest.path)
    shape = dict(caps_K=caps_K, world_size=config.world_size, micro_batches=config.micro_batches)
    ours = evaluate_rows(inputs, rows, dropped_sample, tuple(dropped_reason),
                         epoch_num_steps=manifest.epoch_num_steps, **shape)
    data = {
        "manifest": {
            "algorithm": config.algorithm, "params": meta.get("params", {}),
            "seed": config.seed, "world_size": config.world_size, "micro_batches": config.micro_batches,
            "epochs": config.epochs, "num_samples": inputs.num_samples, "modules": list(inputs.modules),
            "lengths_fingerprint": lengths.fingerprint,
        },
        **ours.metrics,
        "baselines": {},
    }
    loads = {"ours": ours.loads}
    # The random baseline batches as many samples per group as the manifest does on average.
    placed_per_epoch = len(rows) / max(config.epochs, 1)
    del rows  # the baselines below pack from the lengths alone
    groups_per_epoch = max(manifest.num_steps * config.world_size * config.micro_batches / max(config.epochs, 1), 1)
    base_config = config_from_meta(meta, batch_size=max(1, round(placed_per_epoch / groups_per_epoch)))
    for name in baselines:
        if name == config.algorithm:
            continue
        try:
            b_rows, b_dropped, b_reasons, b_epochs = run_baseline(name, inputs, base_config, caps_K, bounds_K)
        except (BalancerError, ImportError) as error:
            data["baselines"][name] = {"error": str(error)}
            continue
        evaluation: Evaluation = evaluate_rows(inputs, b_rows, b_dropped, b_reasons, epoch_num_steps=b_epochs, **shape)
        data["baselines"][name] = evaluation.metrics
        if name in ("random", "dataloader"):
            data["baselines"][name]["batch_size"] = base_config.batch_size
        loads[name] = evaluation.loads
        # One baseline's rows at a time: free them before the next baseline packs.
        del b_rows, b_dropped, b_reasons, evaluation
    return Report(data, loads)


def summary_table(data: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the ours-vs-baselines table (one row per manifest/baseline)."""
    modules = list(data["manifest"]["modules"])
    header = ["packing"] + [f"{m} {x}" for m in modules for x in ("dist", "pad", "util")]
    header += ["step util", "steps (vs bound)", "over-cap groups", "dropped", "mix dist"]
    entries = [(f"ours ({data['manifest']['algorithm']})", data)]
    entries += [(name, metrics) for name, metrics in data.get("baselines", {}).items()]
    rows = []
    for name, m in entries:
        if "error" in m:
            rows.append([name, f"not run: {m['error']}"] + [""] * (len(header) - 2))
            continue
        row = [name]
        for module in modules:
            mm = m["modules"][module]
            row += [f"{mm['dist_ratio']:.3f}", f"{mm['pad_ratio']:.3f}", f"{mm['utilization']:.3f}"]
        steps = m["steps"]
        row += [f"{m['step']['utilization']:.3f}", f"{steps['total']} ({steps['vs_lower_bound']:.2f}x)",
                str(m["groups"]["over_cap"]), f"{m['dropped']['count']} ({100 * m['dropped']['share']:.2f}%)",
                f"{m['step_mix']['mean_distance']:.3f}"]
        rows.append(row)
    return header, rows


def format_text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Aligned plain-text table (for the terminal)."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line("-" * w for w in widths)] + [line(r) for r in rows])


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c).replace("|", "/") for c in r) + " |" for r in rows]
    return "\n".join(out)


def render_markdown(data: Mapping[str, Any]) -> str:
    """``report.md``: parameters, the ours-vs-baselines table, dropped samples and post-balancing."""
    man = data["manifest"]
    params = man["params"]
    caps = ", ".join(f"{m} {c} {params.get('cap_units', {}).get(m, '')}".rstrip() for m, c in params["caps"].items())
    lines = [
        "# Pack report", "",
        f"Algorithm **{man['algorithm']}**, {man['world_size']} ranks x "
        f"{man['micro_batches']} micro-batches, {man['epochs']} epoch(s), seed {man['seed']}, "
        f"{man['num_samples']} samples, lengths fingerprint `{man['lengths_fingerprint'][:12]}`.", "",
        f"- caps (Q): {caps}" + (" (found by the threshold search)" if params.get("searched") else ""),
        f"- ISF bounds (Q'): {', '.join(f'{m} {b}' for m, b in params['bounds'].items())}; "
        f"iterations {params.get('iterations')}; oversize {params.get('oversize')}; "
        f"cost model {params.get('cost_model')}"
        + (f" ({', '.join(f'{m}: {p}' for m, p in params['cost_presets'].items())})"
           if params.get("cost_presets") else ""),
        "", "## Balance (lower is better for dist/pad/mix; higher for util)", "",
        _markdown_table(*summary_table(data)), "",
        "dist = Dist Ratio (mean over steps of sum_r (max T - T_r) / (max T x R)); pad = Pad Ratio if each group "
        "were a padded micro-batch (packed groups with variable-length attention pad nothing); util = "
        "sum T / (R x sum_s max_r T); step util counts modules one after another; steps vs the lower bound "
        "(the fewest groups the caps allow) / (R x M); mix dist = mean total-variation distance of each "
        "step's source mix from the overall mix "
        f"({data['step_mix']['shuffled_mean_distance']:.3f} for the same step sizes filled by a plain shuffle).",
        "", "Baselines: dataloader = random batches placed in order (no balancing); random = the same batches "
        "through our assigner; llm-ffd = first-fit decreasing on LLM tokens; isf = OmniBal's ISF.", "",
        "## Dropped samples", "",
    ]
    dropped = data["dropped"]
    lines.append(f"{dropped['count']} of {man['num_samples']} samples ({100 * dropped['share']:.2f}%) not placed.")
    if dropped["by_reason"]:
        lines += ["", _markdown_table(["reason", "count", "share", "example"],
                                      [[r, str(v["count"]), f"{100 * v['share']:.2f}%", v["example"]]
                                       for r, v in list(dropped["by_reason"].items())[:20]]),
                  "", "Every dropped sample and its full reason is in `dropped.parquet`."]
    if "post_balance" in data:
        pb = data["post_balance"]
        lines += ["", "## Post-balancing (per-phase ranks)", "",
                  _markdown_table(["phase", "dist (packed)", "dist (post)", "util (packed)", "util (post)"],
                                  [[m, f"{data['modules'][m]['dist_ratio']:.3f}", f"{v['dist_ratio']:.3f}",
                                    f"{data['modules'][m]['utilization']:.3f}", f"{v['utilization']:.3f}"]
                                   for m, v in pb["modules"].items()]),
                  "", f"Step utilization: {data['step']['utilization']:.3f} packed, "
                      f"{pb['step']['utilization']:.3f} with post-balancing."]
    lines += ["", "![per-step load per rank](report.png)", ""]
    return "\n".join(lines)


def write_report(out_dir: str | os.PathLike, report: Report) -> dict[str, Path]:
    """Write report.json, report.md and report.png into ``out_dir`` (each atomically)."""
    from balancer_cli.report.plot import plot_report

    out = Path(out_dir)
    paths = {"json": out / REPORT_JSON, "md": out / REPORT_MD, "png": out / REPORT_PNG}
    with atomic_path(paths["json"]) as tmp:
        tmp.write_text(json.dumps(report.data, indent=2, sort_keys=True) + "\n")
    with atomic_path(paths["md"]) as tmp:
        tmp.write_text(render_markdown(report.data))
    baseline = next((b for b in PLOT_BASELINE_PREFERENCE if b in report.loads), None)
    with atomic_path(paths["png"]) as tmp:
        plot_report(tmp, report.loads["ours"], report.loads.get(baseline) if baseline else None,
                    ours_label=f"ours ({report.data['manifest']['algorithm']})", baseline_label=baseline)
    return paths
