"""Option decorators shared by several commands, and the one call each group of options makes.

- :func:`cost_model_options` (``pack``, ``search``, ``report``): ``--cost-model`` and the model
  presets/files of the ``flops`` cost model; :func:`costs_from_options` turns them into costs.
- :func:`model_options` and :func:`workload_options` (``plan-partition``, ``plan-recompute``):
  the MLLM, pipeline stages and parallelism, and where the planned groups come from
  (:class:`~balancer_cli.planners.workload.WorkloadSpec`).

The Python name of each plan option is the library parameter it sets, so a library error that
names ``{stages}`` reads ``--stages`` (see :mod:`balancer_cli.errors`).

Example:
    >>> import click
    >>> @click.command()
    ... @cost_model_options
    ... def cmd(cost_model, vision_model, audio_model, llm_model):
    ...     pass
    >>> [p.name for p in cmd.params]
    ['cost_model', 'vision_model', 'audio_model', 'llm_model']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click
import numpy as np

from balancer_cli.cost.samples import COST_MODELS, sample_costs
from balancer_cli.lengths import LengthsTable
from balancer_cli.planners.workload import DEFAULT_GROUP_LLM_TOKENS

__all__ = ["cost_model_options", "costs_from_options", "model_options", "workload_options"]

Decorated = TypeVar("Decorated", bound=Callable[..., Any])


def _apply(fn: Decorated, options: list[Callable[[Decorated], Decorated]]) -> Decorated:
    """Decorate ``fn`` with ``options`` so that ``--help`` lists them in this order."""
    for option in reversed(options):
        fn = option(fn)
    return fn


def cost_model_options(fn: Decorated) -> Decorated:
    """Add ``--cost-model tokens|flops`` and the model presets/files the flops model needs.

    Example:
        >>> @click.command()
        ... @cost_model_options
        ... def cmd(cost_model, vision_model, audio_model, llm_model):
        ...     pass
        >>> cmd.params[0].default, list(cmd.params[0].type.choices)
        ('tokens', ['tokens', 'flops'])
    """
    return _apply(fn, [
        click.option("--cost-model", type=click.Choice(tuple(COST_MODELS)), default="tokens", show_default=True,
                     help="Module cost: token counts, or training FLOPs of the models below."),
        click.option("--vision-model", metavar="PRESET|FILE", help="Vision encoder for --cost-model flops."),
        click.option("--audio-model", metavar="PRESET|FILE", help="Audio encoder for --cost-model flops."),
        click.option("--llm-model", metavar="PRESET|FILE", help="LLM for --cost-model flops (required there)."),
    ])


def costs_from_options(lengths: LengthsTable, cost_model: str, vision_model: str | None, audio_model: str | None,
                       llm_model: str | None) -> dict[str, np.ndarray]:
    """:func:`~balancer_cli.cost.samples.sample_costs` for the options of :func:`cost_model_options`.

    Raises:
        UsageError, InputError: an unknown preset, a bad model file, or no model for a module.

    Example:
        >>> from balancer_cli.lengths import make_lengths_table
        >>> costs_from_options(make_lengths_table(np.array([7, 9])), "tokens", None, None, None)["llm"].tolist()
        [7.0, 9.0]
    """
    return sample_costs(lengths, cost_model, vision=vision_model, audio=audio_model, llm=llm_model)


def model_options(fn: Decorated) -> Decorated:
    """Add ``--vision``/``--audio``/``--llm``, ``--stages``, ``--attention`` and ``--tp``.

    Example:
        >>> @click.command()
        ... @model_options
        ... def cmd(vision, audio, llm, stages, attention, tp):
        ...     pass
        >>> [p.name for p in cmd.params]
        ['vision', 'audio', 'llm', 'stages', 'attention', 'tp']
    """
    return _apply(fn, [
        click.option("--vision", "--vision-model", "vision", metavar="PRESET|FILE",
                     help="Vision encoder preset or YAML/JSON model file."),
        click.option("--audio", "--audio-model", "audio", metavar="PRESET|FILE", help="Audio encoder preset or model file."),
        click.option("--llm", "--llm-model", "llm", metavar="PRESET|FILE", required=True,
                     help="LLM preset or YAML/JSON model file."),
        click.option("--stages", "stages", type=click.IntRange(min=1), required=True, help="Pipeline stages P."),
        click.option("--attention", type=click.Choice(["flash", "eager"]), default="flash", show_default=True,
                     help="Attention kernel (eager stores the s x s scores; flash does not)."),
        click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Tensor-parallel size (with sequence parallelism): per-GPU FLOPs and memory."),
    ])


def workload_options(fn: Decorated) -> Decorated:
    """Add ``--lengths``, ``--manifest`` and the sizes of a group given without data (``--group-llm-tokens`` ...).

    Example:
        >>> @click.command()
        ... @workload_options
        ... def cmd(lengths, manifest, group_llm_tokens, group_vision_items, group_vision_tokens, group_audio_items):
        ...     pass
        >>> [p.opts[0] for p in cmd.params][:3]
        ['--lengths', '--manifest', '--group-llm-tokens']
    """
    return _apply(fn, [
        click.option("--lengths", "lengths", multiple=True, type=click.Path(dir_okay=False),
                     help="Lengths table(s) (Parquet or OmniBal JSON); repeat for several."),
        click.option("--manifest", "manifest", type=click.Path(file_okay=False),
                     help="Manifest directory from `balancer pack`: plan for its groups (needs --lengths)."),
        click.option("--group-llm-tokens", type=click.IntRange(min=1), default=None,
                     help=f"LLM tokens per group without a manifest (default {DEFAULT_GROUP_LLM_TOKENS})."),
        click.option("--group-vision-items", type=click.IntRange(min=0), default=None,
                     help="Vision items (tiles/images) per group, without data."),
        click.option("--group-vision-tokens", type=click.IntRange(min=1), default=None,
                     help="Encoder tokens per vision item, for native-resolution encoders without data."),
        click.option("--group-audio-items", type=click.IntRange(min=0), default=None,
                     help="Audio clips per group, without data."),
    ])
