"""Options shared by ``pack``, ``search`` and ``report``: step shape, caps, baselines, progress.

Decorators add the options; the ``*_from_options`` functions turn parsed values into the
library's parameters (raising :class:`~balancer_cli.errors.UsageError` on malformed values).

Example:
    >>> caps_from_options(4096, {"vision": 12, "audio": None}, ("mel=3",))
    (('llm', 4096), ('mel', 3), ('vision', 12))
    >>> parse_baselines("random, isf"), parse_baselines("none")
    (('random', 'isf'), ())
"""

from __future__ import annotations

from collections.abc import Mapping

import click

from balancer_cli.cli._render import NAMED_ENCODERS
from balancer_cli.errors import UsageError
from balancer_cli.lengths import LLM
from balancer_cli.pack.packers import registry

__all__ = ["step_shape_options", "cap_options", "baselines_option", "quiet_option", "parse_pairs",
           "parse_baselines", "caps_from_options", "cost_presets"]


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
