"""Cost models: a module's predicted work per sample.

The default cost of a sample in a module is its token count (``<m>_tokens``, ``llm_tokens``).
FLOPs presets for real encoders and LLMs extend this module (``--cost-model flops``).

Example:
    >>> import numpy as np
    >>> from balancer_cli.lengths import make_lengths_table
    >>> lt = make_lengths_table(np.array([300, 40]), {"vision": (np.array([1024, 0]), np.array([1, 0]))})
    >>> {m: c.tolist() for m, c in sample_costs(lt).items()}
    {'vision': [1024.0, 0.0], 'llm': [300.0, 40.0]}
"""

from __future__ import annotations

from balancer_cli.errors import UsageError
from balancer_cli.lengths import LLM, LengthsTable

__all__ = ["COST_MODELS", "sample_costs"]

COST_MODELS = ("tokens",)


def sample_costs(lengths: LengthsTable, cost_model: str = "tokens") -> dict:
    """Per-sample cost of every module: ``{module: (N,) float64}``, encoders first, ``llm`` last.

    Args:
        lengths: the lengths table.
        cost_model: ``tokens`` (cost = tokens the module processes).

    Raises:
        UsageError: unknown cost model.
    """
    if cost_model != "tokens":
        raise UsageError(f"unknown cost model {cost_model!r}", fix=f"use one of: {', '.join(COST_MODELS)}")
    costs = {m: lengths.tokens(m).astype("float64") for m in lengths.modules}
    costs[LLM] = lengths.llm_tokens().astype("float64")
    return costs
