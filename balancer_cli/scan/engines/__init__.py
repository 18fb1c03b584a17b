"""Scan engines by name: where the blocks of a scan are measured.

An engine is a module whose ``run_blocks(blocks, config, jobs)`` (plus ``options=`` when
:func:`~balancer_cli.scan.pipeline.scan` gets ``engine_options``) yields ``(block, table)`` in the
order of ``blocks``, each table a :func:`~balancer_cli.scan.measure.measure_job` result passed
through :func:`~balancer_cli.scan.measure.unwrap_job`. Everything else (block splitting, ordering
checks, metadata, assembly) is shared, so every engine writes a byte-identical table.

:data:`ENGINES` names each engine's module, imported on first use: the Ray engine's dependencies
are an extra, and a scan on the local engine never imports them.

Example:
    >>> sorted(ENGINES)
    ['local', 'ray']
    >>> get_engine("warp")
    Traceback (most recent call last):
    ...
    balancer_cli.errors.UsageError: unknown --engine 'warp'; fix: use --engine local
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

from balancer_cli.errors import UsageError

__all__ = ["ENGINES", "RunBlocks", "get_engine"]

#: ``run_blocks(blocks, config, jobs, **options)`` of an engine: ``(block, table)`` in block order.
RunBlocks = Callable[..., Iterator[tuple[Any, Any]]]

#: engine name (``--engine``) -> the module that defines its ``run_blocks``.
ENGINES: dict[str, str] = {
    "local": "balancer_cli.scan.engines.local",
    "ray": "balancer_cli.scan.engines.ray",
}


def get_engine(name: str) -> RunBlocks:
    """The ``run_blocks`` of engine ``name``, importing its module now.

    Raises:
        UsageError: an unknown name, or an engine whose dependencies are not installed.

    Example:
        >>> get_engine("local").__module__
        'balancer_cli.scan.engines.local'
    """
    if name not in ENGINES:
        raise UsageError(f"unknown --engine {name!r}", fix="use --engine local")
    try:
        module = importlib.import_module(ENGINES[name])
    except ModuleNotFoundError as exc:
        raise UsageError(f"--engine {name} needs {exc.name!r}, which is not installed",
                         fix=f"pip install 'balancer_cli[{name}]'") from None
    return module.run_blocks
