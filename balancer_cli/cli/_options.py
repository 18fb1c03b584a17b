"""Option decorators shared by several commands, and the one call each group of options makes.

- :func:`step_shape_options`, :func:`cap_options`, :func:`baselines_option`, :data:`quiet_option`
  (``pack``, ``search``, ``report``): ``--dp``/``--micro-batches``, ``--max-llm-tokens`` /
  ``--max-<m>-items`` / ``--cap`` (the library's ``caps``), the baselines the report compares
  with; :func:`caps_from_options`, :func:`parse_pairs`, :func:`parse_baselines` and
  :func:`cost_presets` turn their values into library parameters.
- :data:`cost_model_options` (``pack``, ``search``; :data:`report_cost_options` for ``report``):
  ``--cost-model``, the model presets/files of the ``flops`` cost model and the ``--costs`` of the
  ``measured`` one; :func:`cost_fields` turns them into PackConfig fields, :func:`costs_from_options`
  into costs.
- :func:`model_options` and :func:`workload_options` (``plan-partition``, ``plan-recompute``):
  the MLLM, pipeline stages and parallelism, and where the planned groups come from
  (:class:`~balancer_cli.planners.workload.WorkloadSpec`).

The Python name of each plan option is the library parameter it sets, so a library error that
names ``{stages}`` reads ``--stages`` (see :mod:`balancer_cli.errors`).

Example:
    >>> import click
    >>> @click.command()
    ... @cost_model_options
    ... def cmd(cost_model, vision_model, audio_model, llm_model, costs):
    ...     pass
    >>> [p.name for p in cmd.params]
    ['cost_model', 'vision_model', 'audio_model', 'llm_model', 'costs']
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import click
import numpy as np

from balancer_cli.cli._render import NAMED_ENCODERS
from balancer_cli.cost.samples import COST_MODELS, sample_costs
from balancer_cli.errors import UsageError
from balancer_cli.lengths import LLM, LengthsTable
from balancer_cli.pack.packers import registry
from balancer_cli.planners.workload import DEFAULT_GROUP_LLM_TOKENS

__all__ = ["FiniteFloatRange", "cost_model_options", "report_cost_options", "cost_fields", "costs_from_options", "model_options", "workload_options", "step_shape_options",
           "cap_options", "baselines_option", "quiet_option", "parse_pairs", "parse_baselines", "caps_from_options",
           "cost_presets"]


class FiniteFloatRange(click.FloatRange):
    """click's ``FloatRange`` that also refuses NaN and infinities: every comparison with NaN is
    false, so ``nan`` would pass a range check as "in range" (``--gpu-memory-gb nan`` planned no
    recomputation).

    Example:
        >>> FiniteFloatRange(min=0).convert("1.5", None, None)
        1.5
    """

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        converted = super().convert(value, param, ctx)
        if not math.isfinite(converted):
            self.fail(f"{value} is not a finite number", param, ctx)
        return converted

Decorated = TypeVar("Decorated", bound=Callable[..., Any])


def _apply(fn: Decorated, options: list[Callable[[Decorated], Decorated]]) -> Decorated:
    """Decorate ``fn`` with ``options`` so that ``--help`` lists them in this order."""
    for option in reversed(options):
        fn = option(fn)
    return fn


def _cost_options(default: str | None) -> Callable[[Decorated], Decorated]:
    """``--cost-model`` (default ``default``; None: the manifest's own), the flops models, ``--costs``."""
    help_ = ("Module cost: token counts, training FLOPs of the models below, or seconds measured by "
             "`balancer calibrate` (--costs)." if default else
             "Measure the report with this cost model instead of the one the manifest was packed with.")

    def decorate(fn: Decorated) -> Decorated:
        return _apply(fn, [
            click.option("--cost-model", type=click.Choice(tuple(COST_MODELS)), default=default,
                         show_default=default is not None, help=help_),
            click.option("--vision-model", metavar="PRESET|FILE", help="Vision encoder for --cost-model flops."),
            click.option("--audio-model", metavar="PRESET|FILE", help="Audio encoder for --cost-model flops."),
            click.option("--llm-model", metavar="PRESET|FILE", help="LLM for --cost-model flops (required there)."),
            click.option("--costs", type=click.Path(dir_okay=False), metavar="COSTS.json",
                         help="Calibration for --cost-model measured (written by `balancer calibrate`)."),
        ])
    return decorate


#: ``pack``, ``search``: ``--cost-model tokens|flops|measured`` (default tokens), the flops models and
#: ``--costs``.
#:
#: Example:
#:     >>> @click.command()
#:     ... @cost_model_options
#:     ... def cmd(cost_model, vision_model, audio_model, llm_model, costs):
#:     ...     pass
#:     >>> cmd.params[0].default, list(cmd.params[0].type.choices)
#:     ('tokens', ['tokens', 'flops', 'measured'])
cost_model_options = _cost_options("tokens")
#: ``report``: the same options, where no ``--cost-model`` means the manifest's own.
report_cost_options = _cost_options(None)


def cost_fields(cost_model: str, costs: str | None, **presets: str | None) -> dict[str, Any]:
    """The :class:`~balancer_cli.pack.config.PackConfig` cost fields of :data:`cost_model_options`.

    Example:
        >>> cost_fields("flops", None, llm="qwen2-7b", vision=None)
        {'cost_model': 'flops', 'cost_presets': (('llm', 'qwen2-7b'),), 'costs': None}
    """
    return {"cost_model": cost_model, "cost_presets": cost_presets(cost_model, **presets), "costs": costs}


def costs_from_options(lengths: LengthsTable, cost_model: str, vision_model: str | None, audio_model: str | None,
                       llm_model: str | None, costs: str | None = None) -> dict[str, np.ndarray]:
    """:func:`~balancer_cli.cost.samples.sample_costs` for the options of :data:`cost_model_options`.

    Raises:
        UsageError, InputError: an unknown preset, a bad model or costs file, or no model for a module.

    Example:
        >>> from balancer_cli.lengths import make_lengths_table
        >>> costs_from_options(make_lengths_table(np.array([7, 9])), "tokens", None, None, None)["llm"].tolist()
        [7.0, 9.0]
    """
    return sample_costs(lengths, cost_model, vision=vision_model, audio=audio_model, llm=llm_model, costs=costs)


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


# -- pack, search, report ---------------------------------------------------------------------

def step_shape_options(fn):
    """``--dp`` (world_size) and ``--micro-batches``."""
    fn = click.option("--micro-batches", type=click.IntRange(min=1), default=1, show_default=True,
                      help="Groups per rank per step M.")(fn)
    return click.option("--dp", "world_size", type=click.IntRange(min=1), default=1, show_default=True,
                        help="Data-parallel ranks R.")(fn)


def cap_options(llm_help: str, items_help: str, cap_help: str):
    """``--max-llm-tokens``, ``--max-<m>-items`` per named encoder and ``--cap MODULE=V`` (as ``caps``);
    ``items_help`` has ``{module}``."""

    def decorate(fn):
        fn = click.option("--cap", "caps", multiple=True, metavar="MODULE=V", help=cap_help)(fn)
        for module in reversed(NAMED_ENCODERS):
            fn = click.option(f"--max-{module}-items", f"max_{module}_items", type=click.IntRange(min=1),
                              help=items_help.format(module=module))(fn)
        return click.option("--max-llm-tokens", type=click.IntRange(min=1), help=llm_help)(fn)

    return decorate


def baselines_option(help_text: str, default: str | None):
    """``--baselines a,b`` (or ``none``): packers of the registry the report compares with."""
    return click.option("--baselines", default=default, show_default=default is not None, help=help_text)


quiet_option = click.option("--quiet", is_flag=True, help="No progress bar.")


def parse_pairs(values: tuple[str, ...], option: str) -> dict[str, int]:
    """``("vision=12", "llm=8192")`` -> ``{"vision": 12, "llm": 8192}`` (raises UsageError)."""
    pairs = {}
    for value in values:
        module, sep, number = value.partition("=")
        if not sep or not module or not number.strip().lstrip("-").isdigit():
            raise UsageError(f"{option} {value!r} is not MODULE=INTEGER", fix=f"write e.g. {option} vision=12")
        pairs[module.strip()] = int(number)
    return pairs


def parse_baselines(value: str) -> tuple[str, ...]:
    """``"random,llm-ffd"`` -> ``("random", "llm-ffd")``; ``"none"`` or ``""`` -> ``()``."""
    names = tuple(x.strip() for x in value.split(",") if x.strip() and x.strip() != "none")
    choices = registry.names(baseline=True)
    unknown = [n for n in names if n not in choices]
    if unknown:
        raise UsageError(f"unknown baseline {unknown[0]!r}", fix=f"use a comma list of: {', '.join(choices)}, or none")
    return names


def caps_from_options(max_llm_tokens: int | None, max_items: Mapping[str, int | None], caps: tuple[str, ...]
                      ) -> tuple[tuple[str, int], ...]:
    """Merge ``--max-llm-tokens``, ``--max-<m>-items`` and ``--cap m=V`` into ``((module, cap), ...)``."""
    merged = parse_pairs(caps, "--cap")
    if max_llm_tokens is not None:
        merged[LLM] = max_llm_tokens
    merged.update({m: v for m, v in max_items.items() if v is not None})
    return tuple(sorted(merged.items()))


def cost_presets(cost_model: str, **presets: str | None) -> tuple[tuple[str, str], ...]:
    """``((module, preset), ...)`` of the ``--<m>-model`` options given (none under ``tokens``)."""
    if cost_model == "tokens":
        return ()
    return tuple(sorted((m, p) for m, p in presets.items() if p))
