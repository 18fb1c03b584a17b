"""Text renderings of the commands' summaries (what a command prints without ``--json``).

Each function takes the JSON-ready summary a command emits and returns the text; the data is
the same either way, so ``--json`` and the table never disagree.

Example:
    >>> print(render_caps_hint({"llm": 4096, "vision": 12, "mel": 3}, world_size=8))
    pack with: balancer pack ... --dp 8 --max-llm-tokens 4096 --max-vision-items 12 --cap mel=3
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from balancer_cli.report.markdown import NAMED_ENCODERS, cap_option, tail_lines

__all__ = ["NAMED_ENCODERS", "render_scan", "render_pack", "render_search", "render_caps_hint", "render_calibrate"]


# -- scan -------------------------------------------------------------------------------------

def render_scan(summary: Mapping[str, Any]) -> str:
    """``scan``: samples, errors by kind, tokens per module, presets, the first error of each kind."""
    lines = [f"scanned {summary['samples']:,} samples from {len(summary['sources'])} input(s) -> "
             f"{summary['output']} ({summary['seconds']:.1f} s, {summary['samples_per_s']:,.0f} samples/s)"]
    errors = summary["errors"]
    n_errors = sum(errors.values())
    detail = ", ".join(f"{kind} {n}" for kind, n in errors.items())
    lines.append(f"  measured {summary['measured']:,}; errors {n_errors:,}" + (f" ({detail})" if detail else ""))
    parts = [f"llm_tokens {summary['llm_tokens']:,}"]
    for module, stats in summary["modules"].items():
        parts.append(f"{module}_tokens {stats['tokens']:,} in {stats['items']:,} items")
    lines.append("  " + " | ".join(parts))
    lines.append(f"  model {summary['model']} | tokenizer {summary['tokenizer']} | template {summary['template']}")
    for kind, text in summary["first_error_by_kind"].items():
        lines.append(f"  first {kind}: {text[len(kind) + 2:]}")
    return "\n".join(lines)


# -- pack and report ---------------------------------------------------------------------------

def _searched(params: Mapping[str, Any]) -> str:
    """" (searched)", and what the pick broke in full when a later candidate was kept."""
    checked = (params.get("search") or {}).get("checked") or {}
    if checked.get("kept", "pick") == "pick":
        return " (searched)"
    picked = ", ".join(checked["pick_broken"])
    where = "on its first window" if checked.get("on") == "first window" else "in full"
    return f" (searched; the subsample's pick broke {picked} {where}, a later candidate kept)"


def _windows_raised(params: Mapping[str, Any]) -> list[str]:
    """A line when ``--window-samples`` (or ``--memory-gb``) asked for windows under the fewest
    samples a window holds (smaller ones merge), else none."""
    asked, least = params.get("window_samples"), params.get("min_window_samples")
    if not asked or not least or asked >= least:
        return []
    from balancer_cli.pack.windows import MIN_WINDOW_STEPS

    line = (f"windows: a window holds at least {least:,} samples ({MIN_WINDOW_STEPS} steps at these caps), not "
            f"{asked:,}: {params.get('windows', 1):,} windows; windows of a few steps balance worse "
            "(raise --window-samples or --memory-gb)")
    return [line]


def render_pack(summary: Mapping[str, Any]) -> str:
    """``pack`` / ``report``: what was written, the parameters, ours vs baselines, the bounds ours misses."""
    from balancer_cli.report.markdown import (
        contract_lines,
        format_text_table,
        summary_table,
    )

    params = summary["manifest"]["params"]
    caps = ", ".join(f"{m}={c}" for m, c in params["caps"].items())
    steps = summary["steps"]
    windows = params.get("windows", 1)
    lines = [
        f"packed {summary['manifest']['num_samples']} samples into {steps['total']} steps "
        f"({summary['manifest']['world_size']} ranks x {summary['manifest']['micro_batches']} micro-batches, "
        f"{summary['manifest']['epochs']} epoch(s){f', {windows} windows' if windows > 1 else ''}) -> {summary['out']}",
        f"caps {caps}" + (_searched(params) if params.get("searched") else "")
        + f"; dropped {summary['dropped']['count']} ({100 * summary['dropped']['share']:.2f}%)",
        *tail_lines(params),
        *_windows_raised(params),
        "",
        format_text_table(*summary_table(summary)),
        *contract_lines(summary),
    ]
    if "post_balance" in summary:
        post = summary["post_balance"]
        phases = ", ".join(f"{m} {summary['modules'][m]['utilization']:.3f} -> {v['utilization']:.3f}"
                           for m, v in post["modules"].items())
        lines.append(f"post-balancing: utilization {phases}; step {summary['step']['utilization']:.3f} -> "
                     f"{post['step']['utilization']:.3f}")
    return "\n".join(lines)


# -- search ------------------------------------------------------------------------------------

def render_caps_hint(caps: Mapping[str, int], *, world_size: int) -> str:
    """The ``balancer pack`` options that pack with ``caps``."""
    return f"pack with: balancer pack ... --dp {world_size} {' '.join(cap_option(m, c) for m, c in caps.items())}"


def render_search(summary: Mapping[str, Any]) -> str:
    """``search``: the ranked candidates, the files written, and how to pack with the best."""
    from balancer_cli.report.markdown import format_text_table
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
        *([""] + tail_lines({"caps": best["caps"], "search": best}) if "tail_raised" in best else []),
    ]
    if summary.get("files"):
        lines += ["", "wrote " + ", ".join(summary["files"].values())]
    lines += ["", render_caps_hint(best["caps"], world_size=summary["world_size"])]
    return "\n".join(lines)


# -- calibrate --------------------------------------------------------------------------------

def render_calibrate(summary: Mapping[str, Any]) -> str:
    """``calibrate``: per module the fitted coefficients and the held-out quality against the proxies."""
    lines = [f"calibrated {', '.join(summary['modules'])} on {summary['device']} ({summary['dtype']}, "
             f"{summary['attention']}) -> {summary['out']}",
             f"  {'module':<8} {'a (s/l^2)':>10} {'b (s/l)':>10} {'c (s/seq)':>10} {'d (s)':>10} "
             f"{'R2':>7} {'max err':>8} {'FLOPs R2':>9} {'tokens R2':>10}"]
    for module, entry in summary["modules"].items():
        c = entry["coeffs"]
        lines.append(f"  {module:<8} {c['quadratic']:>10.3g} {c['linear']:>10.3g} {c['count']:>10.3g} "
                     f"{c['constant']:>10.3g} {entry.get('r2_heldout', float('nan')):>7.3f} "
                     f"{entry.get('max_rel_err_heldout', float('nan')):>8.1%} "
                     f"{entry.get('flops_r2_heldout', float('nan')):>9.3f} {entry.get('tokens_r2_heldout', float('nan')):>10.3f}")
    caps = {m: e["memory"]["cap"] for m, e in summary["modules"].items() if "cap" in e.get("memory", {})}
    if caps:
        lines.append("  largest caps that fit the GPU memory: " + ", ".join(
            f"{m} {c:,} {summary['modules'][m]['memory']['cap_unit']}" for m, c in caps.items()))
    lines.append("  R2 and max err are on held-out groups of real lengths; FLOPs and tokens are scaled to their "
                 "best constant. Use: balancer pack ... --cost-model measured --costs " + summary["out"])
    return "\n".join(lines)
