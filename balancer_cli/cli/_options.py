"""The ``--cost-model``/``--vision-model``/``--audio-model``/``--llm-model`` options of
``pack``, ``search`` and ``report``, and the one call they make.

Example:
    >>> import click
    >>> @click.command()
    ... @cost_model_options
    ... def cmd(cost_model, vision_model, audio_model, llm_model):
    ...     pass
"""

from __future__ import annotations

import click
import numpy as np

from balancer_cli.cost.samples import COST_MODELS, sample_costs
from balancer_cli.lengths import LengthsTable

__all__ = ["cost_model_options", "costs_from_options"]


def cost_model_options(fn):
    """Add ``--cost-model tokens|flops`` and the model presets/files the flops model needs."""
    options = [
        click.option("--cost-model", type=click.Choice(COST_MODELS), default="tokens", show_default=True,
                     help="Module cost: token counts, or training FLOPs of the models below."),
        click.option("--vision-model", metavar="PRESET|FILE", help="Vision encoder for --cost-model flops."),
        click.option("--audio-model", metavar="PRESET|FILE", help="Audio encoder for --cost-model flops."),
        click.option("--llm-model", metavar="PRESET|FILE", help="LLM for --cost-model flops (required there)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def costs_from_options(lengths: LengthsTable, cost_model: str, vision_model: str | None, audio_model: str | None,
                       llm_model: str | None) -> dict[str, np.ndarray]:
    """``sample_costs`` for the options above (raises UsageError/InputError with clear messages)."""
    if cost_model == "tokens":
        return sample_costs(lengths, "tokens")
    return sample_costs(lengths, "flops", vision=vision_model, audio=audio_model, llm=llm_model)
