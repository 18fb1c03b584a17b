"""Cost models: what a sample costs each module (tokens, or training FLOPs of real models).

- :mod:`balancer_cli.cost.samples`: per-sample costs and the :data:`~balancer_cli.cost.samples.COST_MODELS`
  registry (``tokens``, ``flops``);
- :mod:`balancer_cli.cost.presets`: model shapes (presets from public configs, YAML/JSON files);
- :mod:`balancer_cli.cost.flops`: the FLOPs, parameter and activation-memory formulas.
"""

__all__: list[str] = []
