"""Rendering of a report's data: the ours-vs-baselines table (terminal and Markdown) and ``report.md``.

Pure functions of the JSON-ready report data (:class:`~balancer_cli.report.build.Report`'s
``data``), so ``report.md`` and the CLI summary always agree with ``report.json``.

Example:
    >>> print(format_text_table(["packing", "llm dist"], [["ours", "0.001"], ["random", "0.192"]]))
    packing  llm dist
    -------  --------
    ours     0.001
    random   0.192
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from balancer_cli.lengths import LLM

__all__ = ["summary_table", "format_text_table", "markdown_table", "render_markdown", "contract_lines",
           "sparse_floors", "floor_group_size", "tail_lines", "cap_option", "NAMED_ENCODERS"]

#: Encoders with a dedicated ``--max-<m>-items`` option; any other module uses ``--cap m=V``.
NAMED_ENCODERS = ("vision", "audio", "video")


def cap_option(module: str, cap: int) -> str:
    """The ``balancer pack`` option that caps ``module`` at ``cap``.

    Example:
        >>> cap_option("llm", 4096), cap_option("vision", 12), cap_option("mel", 3)
        ('--max-llm-tokens 4096', '--max-vision-items 12', '--cap mel=3')
    """
    if module == LLM:
        return f"--max-llm-tokens {cap}"
    return f"--max-{module}-items {cap}" if module in NAMED_ENCODERS else f"--cap {module}={cap}"


def tail_lines(params: Mapping[str, Any]) -> list[str]:
    """A line when the longest samples raised searched caps far past what typical samples need
    (``params.search.tail_raised``: :func:`balancer_cli.pack.search.tail_raised`), and the
    options that cap them; else none.

    Example:
        >>> tail_lines({"caps": {"llm": 10_000_000}, "search": {"tail_raised": {"llm": 512}}})[0].split("; ")[1]
        'cap them with --max-llm-tokens 512: longer samples then get groups of their own (--oversize)'
    """
    raised = (params.get("search") or {}).get("tail_raised") or {}
    if not raised:
        return []
    caps = ", ".join(f"{m} {params['caps'][m]:,} where typical samples need ~{t:,}" for m, t in raised.items())
    flags = " ".join(cap_option(m, t) for m, t in raised.items())
    return [f"caps follow the longest 0.1% of the samples ({caps}), and every group holds that much more; cap "
            + f"them with {flags}: longer samples then get groups of their own (--oversize)"]


def _mix_vs_random(step_mix: Mapping[str, Any]) -> str:
    """``0.61x``: mean step-mix distance over that of the same steps filled by a shuffle."""
    ratio = step_mix.get("vs_random")
    if ratio is None:  # reports written before the ratio was stored
        shuffled = step_mix["shuffled_mean_distance"]
        ratio = step_mix["mean_distance"] / shuffled if shuffled > 0 else 1.0
    return f"{ratio:.2f}x"


def summary_table(data: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the ours-vs-baselines table (one row per manifest/baseline)."""
    modules = list(data["manifest"]["modules"])
    header = ["packing"] + [f"{m} {x}" for m in modules for x in ("dist", "pad", "util")]
    header += ["step util", "steps (vs bound)", "over-cap groups", "dropped", "mix vs random"]
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
                _mix_vs_random(m["step_mix"])]
        rows.append(row)
    return header, rows


def format_text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Aligned plain-text table (for the terminal)."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line("-" * w for w in widths)] + [line(r) for r in rows])


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured Markdown table (``|`` in cells becomes ``/``)."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c).replace("|", "/") for c in r) + " |" for r in rows]
    return "\n".join(out)


#: How a broken bound of the contract reads (``dist:vision``: kind ``dist``, module ``vision``),
#: from the report data, the module and the contract's bounds.
_MISSED = {
    "dist": lambda data, m, limit: f"{m} Dist {data['modules'][m]['dist_ratio']:.4f} > {limit['max_dist_ratio']}",
    "util": lambda data, m, limit: (
        f"{m} utilization {data['modules'][m]['utilization']:.3f} < {limit['min_sparse_utilization']} "
        f"(held by {_share(data['modules'][m]['group_share'])} of the groups)"),
    "steps": lambda data, m, limit: (
        f"steps {data['steps']['vs_lower_bound']:.3f}x the lower bound > {limit['max_steps_vs_lower_bound']}x"),
    "mix": lambda data, m, limit: (
        f"step mix {data['step_mix']['vs_random']:.2f}x random batching > {limit['max_step_mix_vs_random']}x"),
}


def _share(share: float) -> str:
    """A share as a percentage, with two digits where it is under 1% (a module in 0.11% of the groups)."""
    return f"{share:.0%}" if share >= 0.01 or share == 0 else f"{share * 100:.2g}%"


def contract_lines(summary: Mapping[str, Any]) -> list[str]:
    """A line naming the contract's bounds ours misses (none when it meets them all), and why the
    step mix cannot reach random batching where a sparse module's groups are too few to reach
    every step (:func:`_sparse_hint`), or what one micro-batch leaves uneven or unmixed
    (:func:`_one_slot_hint`).

    Example:
        >>> data = {"contract": {"bounds": {"max_dist_ratio": 0.005}, "broken": ["dist:llm"]},
        ...         "modules": {"llm": {"dist_ratio": 0.0071, "sparse": False}}, "manifest": {"micro_batches": 1}}
        >>> contract_lines(data)[0]
        'bounds missed: llm Dist 0.0071 > 0.005 (docs/packing.md: what still misses, and why)'
        >>> contract_lines({**data, "manifest": {"micro_batches": 2}})[1:]  # the hint is for one micro-batch
        []
    """
    broken = (summary.get("contract") or {}).get("broken") or []
    if not broken:
        return []
    limits = summary["contract"]["bounds"]
    missed = [_MISSED[kind](summary, module, limits) for kind, _, module in (b.partition(":") for b in broken)]
    lines = ["bounds missed: " + "; ".join(missed) + " (docs/packing.md: what still misses, and why)"]
    floors = _sparse_hint(summary) if "mix" in broken else []  # a sparse module's floor explains the mix
    over_cap = _over_cap_hint(summary, broken)
    # Where the samples over a cap explain every bound missed, pairing groups would not help.
    explained = len(over_cap) == len(broken)
    return lines + _ceiling_hint(summary, broken) + over_cap + (
        floors or ([] if explained else _one_slot_hint(summary, broken)))


def _ceiling_hint(summary: Mapping[str, Any], broken: Sequence[str]) -> list[str]:
    """Where a sparse module's utilization bound is out of any placement's reach on this input
    (``modules.<m>.utilization_ceiling`` under it: its whole load is less than R times its largest
    sample, and the step holding that sample waits for it on every rank), a line saying so.

    Example:
        >>> data = {"modules": {"audio": {"utilization": 0.313, "utilization_ceiling": 0.3134}},
        ...         "contract": {"bounds": {"min_sparse_utilization": 0.9}}, "manifest": {"world_size": 8}}
        >>> _ceiling_hint(data, ["util:audio"])[0].split(": ")[1]
        'no placement keeps more than 0.313 of its rank-time busy on this input (0.313 here)'
    """
    lines = []
    for kind, _, module in (bound.partition(":") for bound in broken):
        entry = summary["modules"].get(module, {}) if kind == "util" else {}
        ceiling = entry.get("utilization_ceiling")
        if ceiling is not None and ceiling < summary["contract"]["bounds"]["min_sparse_utilization"]:
            lines.append(f"  {module}'s load is {ceiling:.3f} of {summary['manifest']['world_size']} ranks x its "
                         f"largest sample's, whose step waits for it on every rank: no placement keeps more than "
                         f"{ceiling:.3f} of its rank-time busy on this input ({entry['utilization']:.3f} here)")
    return lines


def _over_cap_hint(summary: Mapping[str, Any], broken: Sequence[str]) -> list[str]:
    """Where a dense module's Dist is over the bound only in the steps holding samples over a cap
    (``modules.<m>.over_cap``: :func:`~balancer_cli.pack.evaluate.over_cap_dist`), a line saying
    so and naming the fix measured: such a sample is alone in a group larger than the caps let any
    other be; with ``--oversize drop`` the other steps' Dist is what remains (two fresh inputs at
    one micro-batch: every bound met, where two micro-batches or twice the group size did not
    help, so :func:`contract_lines` then leaves out the one-micro-batch hint).

    Example:
        >>> data = {"modules": {"llm": {"dist_ratio": 0.0057, "over_cap": {
        ...     "dist": 0.0055, "steps": 12, "groups": 365, "largest": {"module": "llm", "load": 10177, "cap": 1152}}}},
        ...     "manifest": {"num_samples": 86600, "epochs": 1, "params": {"cap_units": {"llm": "tokens"}}}}
        >>> print(_over_cap_hint(data, ["dist:llm"])[0])
          llm Dist: 0.0055 of it is in the 12 steps holding the 365 samples over a cap, each alone in a group larger than the caps let any other be (the largest of 10177 llm tokens, cap 1152): --oversize drop drops them (0.42% of the samples), the other steps' share 0.0002
    """
    lines = []
    for kind, _, module in (bound.partition(":") for bound in broken):
        entry = summary["modules"].get(module, {}).get("over_cap") if kind == "dist" else None
        if entry is None:
            continue
        largest, man = entry["largest"], summary["manifest"]
        unit = ((man.get("params") or {}).get("cap_units") or {}).get(largest["module"], "")
        what = f"{largest['module']} {unit}".strip()  # "llm tokens", "vision items"
        samples = man["num_samples"] * man.get("epochs", 1)
        rest = summary["modules"][module]["dist_ratio"] - entry["dist"]
        steps, groups = (f"{n} {noun}{'s' if n != 1 else ''}" for n, noun in ((entry["steps"], "step"),
                                                                                (entry["groups"], "sample")))
        lines.append(f"  {module} Dist: {entry['dist']:.4f} of it is in the {steps} holding the {groups} over a "
                     f"cap, each alone in a group larger than the caps let any other be (the largest of "
                     f"{largest['load']} {what}, cap {largest['cap']}): --oversize drop drops them "
                     f"({_share(entry['groups'] / max(samples, 1))} of the samples), the other steps' share "
                     f"{max(rest, 0.0):.4f}")
    return lines


def _one_slot_hint(summary: Mapping[str, Any], broken: Sequence[str]) -> list[str]:
    """Why one micro-batch can leave steps uneven or less mixed than random batching where no
    sparse module binds: a rank's load is then one group, so a step's R groups must be equal on
    every module (within the Dist bound), and the groups packing could not make equal (tight caps,
    few coarse items) share steps with their like, sources and all, or leave the steps uneven;
    with two micro-batches a rank pairs two unequal groups (random three-module inputs: mix 1.42x
    -> 0.53x and 1.14x -> 0.92x, audio Dist 0.0081 -> 0.0008; docs/packing.md). Also where the
    searched pick broke a Dist or the mix and the caps kept traded that for another bound (a 245k
    at ``--dp 64``: steps 1.037x; at two micro-batches the pick meets every bound). Not for a Dist
    where a sparse module idles its ranks too (few or sparse steps: pairing did not help). Where the
    search picks every cap, groups of twice the samples are named too: they even out like the pair
    (8 of 9 fresh misses within every bound at two micro-batches, 7 of 9 at twice the group size).

    Example:
        >>> _one_slot_hint({"manifest": {"micro_batches": 1}}, ["mix"])[0].split(": ")[-1]
        '--micro-batches 2 lets each rank pair two unequal groups'
        >>> _one_slot_hint({"manifest": {"micro_batches": 1, "params": {"searched": True}},
        ...                 "groups": {"mean_size": 4.6}}, ["mix"])[0].split(", or ")[-1]
        '--target-group-size 10 gives each group twice the samples (4.6 now)'
        >>> _one_slot_hint({"manifest": {"micro_batches": 1}}, ["dist:audio"])[0].split(", ")[1].split(":")[0]
        'so groups packing cannot make equal leave its steps uneven'
        >>> _one_slot_hint({"manifest": {"micro_batches": 2}}, ["mix"])
        []
    """
    if summary["manifest"]["micro_batches"] != 1 or any(bound.startswith("util:") for bound in broken):
        # (A sparse module idle too says the steps are too few or too sparse for any pairing to even
        # out: sample_data's 19 steps at --dp 4 lost the LLM's Dist at two micro-batches, 0.059 -> 0.083.)
        return []
    checked = ((summary["manifest"].get("params") or {}).get("search") or {}).get("checked") or {}
    picked = [bound for bound in checked.get("pick_broken", []) if bound == "mix" or bound.startswith("dist:")]
    if "mix" in broken:
        why = "so groups of like costs share steps, and their sources with them"
    elif any(bound.startswith("dist:") for bound in broken):
        why = "so groups packing cannot make equal leave its steps uneven"
    elif picked and checked.get("kept", "pick") != "pick":
        why = f"so the searched caps' groups left the steps uneven or unmixed ({', '.join(picked)})"
    else:
        return []
    size = _free_group_size(summary)
    target = None if size is None else math.ceil(2 * size)
    larger = "" if target is None or not _target_ok(target) else (
        f", or --target-group-size {target} gives each group twice the samples ({size:.1f} now)")
    return [f"  at one micro-batch a step's groups must be equal on every module, {why}: --micro-batches 2 lets "
            f"each rank pair two unequal groups{larger}"]


def _free_group_size(summary: Mapping[str, Any]) -> float | None:
    """The groups' mean size where the search picked every cap, so a ``--target-group-size`` moves
    it; None where a cap was given (it fixes the group size, or bounds the search's:
    ``params.search.given``) or the size is not known."""
    params = summary["manifest"].get("params") or {}
    if not params.get("searched") or (params.get("search") or {}).get("given"):
        return None
    return (summary.get("groups") or {}).get("mean_size") or None


def _target_ok(target: int) -> bool:
    """Whether ``--target-group-size`` takes ``target`` (a module in one group of millions would
    ask for more than the option allows). Imported here: only where a hint names one."""
    from balancer_cli.pack.config import MAX_TARGET_GROUP_SIZE

    return target <= MAX_TARGET_GROUP_SIZE


def _sparse_hint(summary: Mapping[str, Any]) -> list[str]:
    """Why the steps cannot mix: a step holds a sparse module on every rank or on none (else its
    ranks idle), so with the module in a share ``h`` of the groups and M micro-batches at most
    ``h x M`` of the steps can hold it, and the sources that carry it gather in those; at
    ``ceil(1 / h)`` micro-batches every step can (a step's groups on a rank hold it once), and at
    M micro-batches so can groups of :func:`floor_group_size` samples (where the search picks every
    cap: ``--target-group-size``), as many of them holding it in fewer groups.

    Example:
        >>> hint = _sparse_hint({"manifest": {"micro_batches": 2, "params": {"searched": True}},
        ...                      "modules": {"audio": {"sparse": True, "group_share": 0.24}},
        ...                      "groups": {"mean_size": 4.6}})
        >>> hint[0].split(": ")[1]
        'at 2 micro-batches at most 48% of the steps hold it, and the sources that carry it gather in those'
        >>> hint[0].split(": ")[2]
        '--micro-batches 5 or more lets every step hold it, or --target-group-size 10 at 2 micro-batches (groups of ~10 samples where they hold 4.6)'
    """
    M = summary["manifest"]["micro_batches"]
    size = _free_group_size(summary)
    lines = []
    for module, share, lift in sparse_floors(summary["modules"], M):
        line = (f"  {module} is in {share:.0%} of the groups and a step holds it on every rank or on none "
                f"(else they idle): at {M} micro-batch{'es' if M > 1 else ''} at most {share * M:.0%} of "
                f"the steps hold it, and the sources that carry it gather in those: --micro-batches {lift} or more "
                "lets every step hold it")
        target = None if size is None else floor_group_size(size, share, M)
        if target is not None and _target_ok(target):
            line += (f", or --target-group-size {target} at {M} micro-batch{'es' if M > 1 else ''} (groups of "
                     f"~{target} samples where they hold {size:.1f})")
        lines.append(line)
    return lines


def sparse_floors(modules: Mapping[str, Any], micro_batches: int) -> list[tuple[str, float, int]]:
    """``(module, group share, micro-batches)`` of each sparse module in too few groups to reach
    every step at ``micro_batches`` (``share x M < 1``), with the fewest micro-batches that let
    every step hold it (``ceil(1 / share)``); ``modules`` as the report's ``modules`` entry.

    Example:
        >>> sparse_floors({"audio": {"sparse": True, "group_share": 0.24}, "llm": {"sparse": False}}, 2)
        [('audio', 0.24, 5)]
    """
    return [(module, v["group_share"], math.ceil(1 / v["group_share"])) for module, v in modules.items()
            if v.get("sparse") and 0 < v.get("group_share", 0.0) * micro_batches < 1]


def floor_group_size(mean_size: float, share: float, micro_batches: int) -> int:
    """Samples a group holds on average for a sparse module in a share ``share`` of groups of
    ``mean_size`` samples to reach every step at ``micro_batches`` (:func:`sparse_floors`):
    ``ceil(mean_size / (share x M))``. Fewer, larger groups hold its samples: as many groups hold
    it, a share of them that many times larger (bench/bench_pack.py's three-module 300k at 1
    micro-batch: audio in 46% of groups of 4.6 samples, mix 1.71x; at ``--target-group-size
    10`` audio is in every group and the steps mix at 0.93x, within every bound).

    Example:
        >>> floor_group_size(4.6, 0.46, 1), floor_group_size(4.6, 0.24, 2)
        (10, 10)
    """
    return max(1, math.ceil(mean_size / (share * micro_batches)))


def render_markdown(data: Mapping[str, Any]) -> str:
    """``report.md``: parameters, the ours-vs-baselines table and the bounds ours misses, dropped
    samples and post-balancing."""
    man = data["manifest"]
    params = man["params"]
    missed = contract_lines(data)
    caps = ", ".join(f"{m} {c} {params.get('cap_units', {}).get(m, '')}".rstrip() for m, c in params["caps"].items())
    lines = [
        "# Pack report", "",
        f"Algorithm **{man['algorithm']}**, {man['world_size']} ranks x "
        f"{man['micro_batches']} micro-batches, {man['epochs']} epoch(s), seed {man['seed']}, "
        f"{man['num_samples']} samples, lengths fingerprint `{man['lengths_fingerprint'][:12]}`.", "",
        f"- caps (Q): {caps}" + (" (found by the threshold search)" if params.get("searched") else ""),
        *(f"- {line}" for line in tail_lines(params)),
        f"- ISF bounds (Q'): {', '.join(f'{m} {b}' for m, b in params['bounds'].items())}; "
        f"iterations {params.get('iterations')}; oversize {params.get('oversize')}; "
        f"cost model {params.get('cost_model')}"
        + (f" ({', '.join(f'{m}: {p}' for m, p in params['cost_presets'].items())})"
           if params.get("cost_presets") else "")
        + (f"; metrics measured with cost model {man['cost_model']}"
           if man.get("cost_model", params.get("cost_model")) != params.get("cost_model") else ""),
        "", "## Balance (lower is better for dist/pad/mix; higher for util)", "",
        markdown_table(*summary_table(data)), "",
        "dist = Dist Ratio (mean over steps of sum_r (max T - T_r) / (max T x R)); pad = Pad Ratio if each group "
        "were a padded micro-batch (packed groups with variable-length attention pad nothing); util = "
        "sum T / (R x sum_s max_r T); step util counts modules one after another; steps vs the lower bound "
        "(the fewest groups the caps allow) / (R x M); mix vs random = mean total-variation distance of each "
        "step's source mix from the overall mix, over the same for the same steps holding a seeded shuffle of "
        "the placed samples (1.00x = as mixed as random batching, lower = closer to the overall mix; "
        f"ours: {data['step_mix']['mean_distance']:.3f} vs {data['step_mix']['shuffled_mean_distance']:.3f}).",
        *(["", *missed] if missed else []),
        "", "Baselines: dataloader = random batches placed in order (no balancing); random = the same batches "
        "through our assigner; llm-ffd = first-fit decreasing on LLM tokens; isf = OmniBal's ISF.", "",
        "## Dropped samples", "",
    ]
    dropped = data["dropped"]
    lines.append(f"{dropped['count']} of {man['num_samples']} samples ({100 * dropped['share']:.2f}%) not placed.")
    if dropped["by_reason"]:
        lines += ["", markdown_table(["reason", "count", "share", "example"],
                                      [[r, str(v["count"]), f"{100 * v['share']:.2f}%", v["example"]]
                                       for r, v in list(dropped["by_reason"].items())[:20]]),
                  "", "Every dropped sample and its full reason is in `dropped.parquet`."]
    if "post_balance" in data:
        pb = data["post_balance"]
        lines += ["", "## Post-balancing (per-phase ranks)", "",
                  markdown_table(["phase", "dist (packed)", "dist (post)", "util (packed)", "util (post)"],
                                  [[m, f"{data['modules'][m]['dist_ratio']:.3f}", f"{v['dist_ratio']:.3f}",
                                    f"{data['modules'][m]['utilization']:.3f}", f"{v['utilization']:.3f}"]
                                   for m, v in pb["modules"].items()]),
                  "", f"Step utilization: {data['step']['utilization']:.3f} packed, "
                      f"{pb['step']['utilization']:.3f} with post-balancing."]
    lines += ["", "![per-step load per rank](report.png)", ""]
    return "\n".join(lines)
