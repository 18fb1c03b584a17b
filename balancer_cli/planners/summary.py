"""JSON summaries and text renderings of partition and recompute plans (pure).

The summaries are what ``plan-partition --json`` and ``plan-recompute --json`` print (plus the
models, workload and title that :mod:`balancer_cli.planners.entry` adds); the renderings are
their text form.

Example:
    >>> from balancer_cli.cost.samples import CostModel
    >>> from balancer_cli.planners.chain import build_chain, explicit_features
    >>> model = CostModel.build("llama3-8b")
    >>> chain = build_chain(model)
    >>> s = partition_summary(chain, explicit_features(model, 4096, {}), 2)
    >>> [st["layers"] for st in s["stages"]]
    [[0, 17], [18, 33]]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from balancer_cli.lengths import LLM
from balancer_cli.planners.chain import Layer, layer_costs, layer_out_bytes
from balancer_cli.planners.flags import (
    deepspeed_parts_snippet,
    megatron_partition_args,
    megatron_recompute_args,
    stage_layer_counts,
)
from balancer_cli.planners.partition import (
    Partition,
    first_stage_partition,
    make_partition,
    plan_partition,
)
from balancer_cli.planners.recompute import GB, RecomputePlan

__all__ = ["partition_summary", "render_partition", "recompute_summary", "render_recompute"]


def _stages(part: Partition, chain: Sequence[Layer]) -> list[dict[str, Any]]:
    """The JSON ``stages`` of a partition: layer range, end layers, cost, cut bytes, layer counts."""
    out = []
    for (a, b), cost, cut in zip(part.bounds, part.stage_costs, part.cut_bytes):
        names = [layer.name for layer in chain[a:b + 1]]
        out.append({"layers": [a, b], "first": names[0], "last": names[-1], "cost": cost, "cut_bytes": cut,
                    "layer_counts": stage_layer_counts([names])[0]})
    return out


def _brief(part: Partition, chain: Sequence[Layer]) -> dict[str, Any]:
    """A partition compared with the chosen one: its stages and ranking keys."""
    return {"stages": _stages(part, chain), "max_cost": part.max_cost, "variance": part.variance,
            "comm_bytes": part.comm_bytes}


def partition_summary(chain: Sequence[Layer], typical: Mapping[str, float], stages: int, *,
                      costs: Sequence[float] | None = None, radius: int = 2, top_k: int = 5,
                      method: str = "bmp") -> dict[str, Any]:
    """Plan a partition of ``chain`` for the ``typical`` group (or measured ``costs``) and describe it.

    Keys: ``layers`` (``name``, ``module``, ``cost``, ``out_bytes``, ``params``), ``stages`` (the
    chosen plan: ``layers [first, last]`` inclusive, ``cost``, ``cut_bytes``, ``layer_counts``),
    ``largest_stage``, ``optimum``, ``equal_split``, ``megatron_default``, ``bmp`` (anchor,
    radius, ranked candidates), ``gap_to_optimum``, ``gain_vs_equal``, ``gain_vs_megatron_default``,
    ``megatron_args``, ``deepspeed``.

    Example:
        >>> from balancer_cli.cost.samples import CostModel
        >>> from balancer_cli.planners.chain import build_chain, explicit_features
        >>> model = CostModel.build("llama3-8b")
        >>> s = partition_summary(build_chain(model), explicit_features(model, 4096, {}), 4)
        >>> [st["layers"] for st in s["stages"]], s["megatron_args"][0]
        ([[0, 8], [9, 17], [18, 26], [27, 33]], '--pipeline-model-parallel-size 4')
    """
    cost = np.asarray(costs, dtype=np.float64) if costs is not None else layer_costs(chain, typical)
    out_bytes = layer_out_bytes(chain, typical)
    plan = plan_partition(cost, out_bytes, stages, radius=radius, top_k=top_k, method=method)
    llm_layers = [i for i, layer in enumerate(chain) if layer.module == LLM and layer.kind == "layer"]
    default = None
    if len(llm_layers) >= stages:
        default = make_partition(first_stage_partition(llm_layers[0], len(llm_layers), len(chain), stages), cost,
                                 out_bytes)
    counts = [s["layer_counts"] for s in _stages(plan.chosen, chain)]
    return {
        "method": method,
        "num_stages": stages,
        "layers": [{"index": i, "name": layer.name, "module": layer.module, "cost": float(c), "out_bytes": float(o),
                    "params": float(layer.params)} for i, (layer, c, o) in enumerate(zip(chain, cost, out_bytes))],
        "stages": _stages(plan.chosen, chain),
        "largest_stage": plan.chosen.max_cost,
        "optimum": _brief(plan.optimum, chain),
        "equal_split": _brief(plan.equal, chain),
        "megatron_default": _brief(default, chain) if default else None,
        "bmp": {"radius": plan.radius, "top_k": top_k, "anchor": _brief(plan.anchor, chain),
                "candidates": [{"cuts": [b[0] for b in c.bounds[1:]], "max_cost": c.max_cost, "variance": c.variance,
                                "comm_bytes": c.comm_bytes} for c in plan.candidates]},
        "gap_to_optimum": plan.gap_to_optimum,
        "gain_vs_equal": plan.gain_vs_equal,
        "gain_vs_megatron_default": (default.max_cost / plan.chosen.max_cost - 1.0) if default else None,
        "megatron_args": megatron_partition_args(counts, has_head=True, embedding_stage=_stage_of(plan.chosen, chain, "llm.embedding")),
        "deepspeed": deepspeed_parts_snippet(plan.chosen.bounds),
    }


def _stage_of(part: Partition, chain: Sequence[Layer], name: str) -> int:
    """The stage of ``part`` holding the layer called ``name`` (the first layer's when none is)."""
    index = next((i for i, layer in enumerate(chain) if layer.name == name), 0)
    return next(s for s, (a, b) in enumerate(part.bounds) if a <= index <= b)


def _fmt_cost(value: float, unit: str) -> str:
    """A stage cost in TFLOP, or in ms when the costs are measured seconds."""
    return f"{value / 1e12:,.1f} TFLOP" if unit == "FLOPs" else f"{value * 1e3:,.2f} ms"


def render_partition(s: Mapping[str, Any]) -> str:
    """Human-readable rendering of :func:`partition_summary` (plus ``title``/``workload``/``cost_unit``).

    Example:
        >>> from balancer_cli.cost.samples import CostModel
        >>> from balancer_cli.planners.chain import build_chain, explicit_features
        >>> model = CostModel.build("llama3-8b")
        >>> text = render_partition(partition_summary(build_chain(model), explicit_features(model, 4096, {}), 2))
        >>> print(text.splitlines()[4])
        BMP (chosen)                  99.5 TFLOP       +0.0%
    """
    unit = s.get("cost_unit", "FLOPs")
    lines = [s.get("title", "plan-partition"), s.get("workload", ""), ""]
    best = s["largest_stage"]
    rows = [(f"{'BMP' if s['method'] == 'bmp' else 'exact'} (chosen)", best),
            ("exact optimum", s["optimum"]["max_cost"]), ("equal layers/stage", s["equal_split"]["max_cost"])]
    if s.get("megatron_default"):
        rows.append(("encoder on stage 0", s["megatron_default"]["max_cost"]))
    lines.append(f"{'partition':<22}{'largest stage':>18}{'vs chosen':>12}")
    for label, value in rows:
        lines.append(f"{label:<22}{_fmt_cost(value, unit):>18}{value / best - 1:>+12.1%}")
    lines += ["", f"chosen is {s['gap_to_optimum']:.2%} above the optimum; the equal-layer split's largest stage is "
                  f"{s['gain_vs_equal']:.1%} larger than the chosen one's", ""]
    lines.append(f"{'stage':<6}{'layers':<10}{'first .. last':<44}{'cost':>16}{'share':>8}{'cut MB':>10}")
    total = sum(st["cost"] for st in s["stages"]) or 1.0
    for i, st in enumerate(s["stages"]):
        a, b = st["layers"]
        lines.append(f"{i:<6}{f'{a}-{b}':<10}{st['first'] + ' .. ' + st['last']:<44}{_fmt_cost(st['cost'], unit):>16}"
                     f"{st['cost'] / total:>8.1%}{st['cut_bytes'] / 1e6:>10.1f}")
    lines += ["", "Megatron-LM:"] + [f"  {a}" for a in s["megatron_args"]]
    lines += ["", "DeepSpeed:"] + [f"  {a}" for a in s["deepspeed"]]
    return "\n".join(lines)


def recompute_summary(plan: RecomputePlan, chain: Sequence[Layer]) -> dict[str, Any]:
    """JSON summary: ``stages`` (``layers``, ``recompute_layers`` {full, selective}, ``recompute_counts``,
    ``memory_gb``, its parts, ``inflight``, ``overhead``, ``megatron``), budget and step overhead.

    Example:
        >>> from balancer_cli.cost.samples import CostModel
        >>> from balancer_cli.planners.chain import build_chain, explicit_features
        >>> from balancer_cli.planners.recompute import plan_recompute
        >>> model = CostModel.build("llama3-8b")
        >>> chain, feats = build_chain(model), explicit_features(model, 8192, {})
        >>> plan = plan_recompute(chain, ((0, 16), (17, 33)), feats, feats, gpu_memory_gb=60, micro_batches=8,
        ...                       zero_stage=1, dp=8)
        >>> s = recompute_summary(plan, chain)
        >>> s["recomputed_layers"], s["stages"][0]["megatron"]
        (6, '--recompute-granularity full --recompute-method block --recompute-num-layers 6')
    """
    stages = []
    for st in plan.stages:
        layers_in = {}
        full, selective = {}, {}
        for layer, mode in zip(chain[st.layers[0]:st.layers[1] + 1], st.modes):
            if layer.recomputable:
                layers_in[layer.module] = layers_in.get(layer.module, 0) + 1
                if mode == "full":
                    full[layer.module] = full.get(layer.module, 0) + 1
                elif mode == "selective":
                    selective[layer.module] = selective.get(layer.module, 0) + 1
        stages.append({
            "stage": st.stage, "layers": list(st.layers), "recompute_layers": st.recompute_layers(),
            "recompute_counts": {"full": full, "selective": selective, "layers": layers_in},
            "memory_gb": st.peak_bytes / GB, "state_gb": st.state_bytes / GB, "activation_gb": st.activation_bytes / GB,
            "work_gb": st.work_bytes / GB, "inflight": st.inflight, "overhead": st.overhead,
            "megatron": megatron_recompute_args(full, selective, layers_in),
        })
    uniform = max((s["recompute_counts"]["full"].get(LLM, 0) for s in stages), default=0)
    return {"stages": stages, "budget_gb": plan.budget_bytes / GB, "step_overhead": plan.step_overhead,
            "recomputed_layers": sum(st.num_recomputed for st in plan.stages), "uniform_full_layers": uniform}


def render_recompute(s: Mapping[str, Any]) -> str:
    """Human-readable rendering of :func:`recompute_summary` (plus ``title``/``workload``).

    Example:
        >>> from balancer_cli.cost.samples import CostModel
        >>> from balancer_cli.planners.chain import build_chain, explicit_features
        >>> from balancer_cli.planners.recompute import plan_recompute
        >>> model = CostModel.build("llama3-8b")
        >>> chain, feats = build_chain(model), explicit_features(model, 8192, {})
        >>> plan = plan_recompute(chain, ((0, 16), (17, 33)), feats, feats, gpu_memory_gb=80, micro_batches=8,
        ...                       zero_stage=1, dp=8)
        >>> print(render_recompute(recompute_summary(plan, chain)).splitlines()[-1])
          stage 1: (no recomputation)
    """
    lines = [s.get("title", "plan-recompute"), s.get("workload", ""),
             f"budget {s['budget_gb']:.1f} GB per GPU after the margin; predicted step-time overhead {s['step_overhead']:+.1%}", "",
             f"{'stage':<6}{'layers':<9}{'in-flight':>10}{'states GB':>11}{'acts GB':>9}{'peak GB':>9}{'overhead':>10}  recompute"]
    for st in s["stages"]:
        full = st["recompute_counts"]["full"]
        sel = st["recompute_counts"]["selective"]
        what = ", ".join([f"{n}/{st['recompute_counts']['layers'][m]} {m} full" for m, n in full.items()]
                         + [f"{n}/{st['recompute_counts']['layers'][m]} {m} selective" for m, n in sel.items()]) or "none"
        a, b = st["layers"]
        lines.append(f"{st['stage']:<6}{f'{a}-{b}':<9}{st['inflight']:>10}{st['state_gb']:>11.1f}"
                     f"{st['activation_gb'] + st['work_gb']:>9.1f}{st['memory_gb']:>9.1f}{st['overhead']:>+10.1%}  {what}")
    lines += ["", "Megatron-LM, per pipeline stage (a launcher sets them by pipeline rank):"]
    lines += [f"  stage {st['stage']}: {st['megatron']}" for st in s["stages"]]
    if s["uniform_full_layers"]:
        lines.append(f"  one value for the LLM layers of every stage (stock launch): --recompute-granularity full --recompute-method block "
                     f"--recompute-num-layers {s['uniform_full_layers']}")
    return "\n".join(lines)
