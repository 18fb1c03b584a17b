"""Planners: balanced pipeline partition (BMP) and adaptive activation recomputation.

- :mod:`~balancer_cli.planners.chain`: the MLLM's layer chain and group workload features;
- :mod:`~balancer_cli.planners.workload`: models, groups (manifest, lengths or given by hand) and
  measured layer times;
- :mod:`~balancer_cli.planners.partition`, :mod:`~balancer_cli.planners.recompute`: the two planners;
- :mod:`~balancer_cli.planners.flags`: Megatron-LM / DeepSpeed arguments, and every other tool's
  flag the package quotes (:data:`~balancer_cli.planners.flags.EXTERNAL_FLAGS`);
- :mod:`~balancer_cli.planners.summary`: JSON summaries and their text;
- :mod:`~balancer_cli.planners.entry`: the one call behind each of ``plan-partition`` and
  ``plan-recompute``.
"""

__all__: list[str] = []
