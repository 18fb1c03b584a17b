"""Ready-to-paste framework arguments for a partition or a recompute plan (pure: returns text).

Megatron-LM (Megatron-Core) knobs used:
- ``--pipeline-model-parallel-size``; uneven LLM stages with ``--decoder-first-pipeline-num-layers``
  / ``--decoder-last-pipeline-num-layers`` (Megatron-Core >= 0.9, middle stages equal) or
  ``--pipeline-model-parallel-layout`` (Megatron-Core >= 0.13, experimental: ``E`` embedding,
  ``t`` decoder layer, ``L`` loss, ``|`` between stages);
- the vision encoder: LLaVA-style models place it with the first stage, or on its own stages
  with ``--encoder-pipeline-model-parallel-size`` (Megatron-Core 0.9-0.12); stock Megatron cannot
  split an encoder across stages it shares with decoder layers, so such plans list the layers of
  each stage for a custom pipeline instead.
- ``--recompute-granularity {full,selective}``, ``--recompute-method block``,
  ``--recompute-num-layers N`` (block: the first N layers of each stage's chunk).

DeepSpeed: ``PipelineModule`` builds stage i from ``self.parts[i]:self.parts[i + 1]`` of its
``LayerSpec`` list; stock ``partition_method`` values (``uniform``, ``parameters``,
``type:regex``) cannot express explicit boundaries, so the snippet overrides
``_partition_layers`` with the planned ``parts``.

:data:`EXTERNAL_FLAGS` lists every flag of another tool that balancer_cli quotes anywhere (these
outputs, and error fixes elsewhere in the package), so a test can tell them from typos of the
``balancer`` commands' own options.

Example:
    >>> megatron_partition_args([{"llm": 20}, {"llm": 22}, {"llm": 22}, {"llm": 16}], has_head=True)[:3]
    ['--pipeline-model-parallel-size 4', '--decoder-first-pipeline-num-layers 20', '--decoder-last-pipeline-num-layers 16']
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from balancer_cli.lengths import LLM

__all__ = ["EXTERNAL_FLAGS", "stage_layer_counts", "megatron_partition_args", "deepspeed_parts_snippet",
           "megatron_recompute_args"]

#: Every flag of another tool that a module of balancer_cli quotes (in output, messages or docs).
#: A flag quoted in the package is either an option of a ``balancer`` command or one of these.
EXTERNAL_FLAGS: frozenset[str] = frozenset({
    # Megatron-LM (Megatron-Core) pipeline and recompute arguments, printed by the planners
    "--pipeline-model-parallel-size",
    "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers",
    "--pipeline-model-parallel-layout",
    "--encoder-pipeline-model-parallel-size",
    "--recompute-granularity",
    "--recompute-method",
    "--recompute-num-layers",
    # `ray start --head`: the fix when scan's Ray engine finds no cluster (scan/engines/ray.py)
    "--head",
    # `huggingface-cli download --repo-type dataset NAME --local-dir DIR` (scan/hf_datasets.py)
    "--repo-type",
    "--local-dir",
})


def stage_layer_counts(names_per_stage: Sequence[Sequence[str]]) -> list[dict[str, int]]:
    """Transformer layers per module in each stage (``{"vision": 14, "llm": 3}``).

    Example:
        >>> stage_layer_counts([["vision.stem", "vision.layer.0", "llm.layer.0"], ["llm.layer.1", "llm.head"]])
        [{'vision': 1, 'llm': 1}, {'llm': 1}]
    """
    counts = []
    for names in names_per_stage:
        stage: dict[str, int] = {}
        for name in names:
            module, kind = name.split(".")[0], name.split(".")[1]
            if kind == "layer":
                stage[module] = stage.get(module, 0) + 1
        counts.append(stage)
    return counts


def megatron_partition_args(counts: Sequence[Mapping[str, int]], *, has_head: bool = True,
                            embedding_stage: int = 0) -> list[str]:
    """Megatron-LM arguments for per-stage layer counts (``counts[i][module]``).

    Returns argument lines first, then ``# ...`` comment lines explaining the encoder placement.
    ``embedding_stage``: the stage holding the LLM's input embedding (``E`` in the layout).

    Example:
        >>> for line in megatron_partition_args([{"vision": 24}, {"llm": 16}, {"llm": 16}], embedding_stage=1):
        ...     print(line)
        --pipeline-model-parallel-size 2
        --encoder-pipeline-model-parallel-size 1
        --pipeline-model-parallel-layout "E,t*16|t*16,L"  # Megatron-Core >= 0.13 (decoder stages)
        # encoder alone on the first 1 stage(s) (Megatron-Core 0.9-0.12 LLaVA)
    """
    p = len(counts)
    llm = [int(c.get(LLM, 0)) for c in counts]
    encoders = sorted({m for c in counts for m in c if m != LLM})
    enc_stages = [i for i, c in enumerate(counts) if any(c.get(m, 0) for m in encoders)]
    only_encoder = [i for i in enc_stages if llm[i] == 0]
    args: list[str] = []
    notes: list[str] = []
    decoder_p = p
    shared = False
    if encoders and enc_stages and only_encoder == list(range(len(only_encoder))) and len(only_encoder) == len(enc_stages):
        decoder_p = p - len(only_encoder)
        args.append(f"--pipeline-model-parallel-size {decoder_p}")
        args.append(f"--encoder-pipeline-model-parallel-size {len(only_encoder)}")
        notes.append(f"# encoder alone on the first {len(only_encoder)} stage(s) (Megatron-Core 0.9-0.12 LLaVA)")
        llm = llm[len(only_encoder):]
    else:
        args.append(f"--pipeline-model-parallel-size {p}")
        if enc_stages == [0]:
            notes.append("# encoder + projector with the first decoder stage (Megatron's LLaVA default)")
        elif enc_stages:
            shared = True
            per_stage = ", ".join(f"stage {i}: " + " + ".join(f"{c[m]} {m}" for m in [*encoders, LLM] if c.get(m))
                                  for i, c in enumerate(counts))
            notes.append("# the encoder spans stages it shares with decoder layers: stock Megatron cannot split it;"
                         f" per-stage layers for a custom pipeline: {per_stage}")
    if decoder_p > 1 and llm:
        offset = p - decoder_p
        middle = llm[1:-1]
        if not shared and len(set(llm)) > 1 and len(set(middle)) <= 1:
            args.append(f"--decoder-first-pipeline-num-layers {llm[0]}")
            args.append(f"--decoder-last-pipeline-num-layers {llm[-1]}")
        elif not shared and len(set(llm)) > 1:
            notes.append("# decoder stages differ in the middle: use the layout line")
        stages = []
        for i, n in enumerate(llm):
            parts = (["E"] if i + offset == embedding_stage else []) + ([f"t*{n}"] if n else [])
            stages.append(",".join(parts + (["L"] if i == len(llm) - 1 and has_head else [])))
        args.append(f'--pipeline-model-parallel-layout "{"|".join(stages)}"  # Megatron-Core >= 0.13 (decoder stages)')
    return args + notes


def deepspeed_parts_snippet(bounds: Sequence[tuple[int, int]]) -> list[str]:
    """Python lines subclassing ``deepspeed.pipe.PipelineModule`` with the planned ``parts``.

    Example:
        >>> deepspeed_parts_snippet(((0, 9), (10, 33)))[2]
        '    PARTS = [0, 10, 34]'
    """
    parts = [b[0] for b in bounds] + [bounds[-1][1] + 1]
    return [
        "# LayerSpec list in the chain order of the plan (one spec per planned layer)",
        "class PlannedPipeline(deepspeed.pipe.PipelineModule):",
        f"    PARTS = {parts}",
        "    def _partition_layers(self, method='uniform'):",
        "        self.parts = list(self.PARTS)",
        "        stage = self._topo.get_coord(self.global_rank).pipe",
        "        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])",
        f"# PlannedPipeline(layers=specs, num_stages={len(bounds)})",
    ]


def megatron_recompute_args(full: Mapping[str, int], selective: Mapping[str, int], layers: Mapping[str, int]) -> str:
    """Megatron recompute flags for one stage given per-module counts of fully / selectively
    recomputed layers and of all layers in the stage.

    Example:
        >>> megatron_recompute_args({"llm": 4}, {}, {"llm": 16})
        '--recompute-granularity full --recompute-method block --recompute-num-layers 4'
    """
    parts = []
    for module in layers:
        nf, ns = int(full.get(module, 0)), int(selective.get(module, 0))
        label = "" if module == LLM else f"[{module} encoder config] "
        if nf and ns:
            parts.append(f"{label}mixed ({nf} full + {ns} selective): not expressible in one Megatron config;"
                         f" --recompute-granularity full --recompute-method block --recompute-num-layers {nf + ns}"
                         " is the nearest that fits")
        elif nf:
            parts.append(f"{label}--recompute-granularity full --recompute-method block --recompute-num-layers {nf}")
        elif ns:
            parts.append(f"{label}--recompute-granularity selective"
                         + ("" if ns == layers[module] else f"  # plan: {ns} of {layers[module]} layers; selective applies to all"))
    return "; ".join(parts) if parts else "(no recomputation)"
