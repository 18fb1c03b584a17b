"""Pack engines by name: where the windows of a pack run are packed and assigned.

An engine is a module whose ``run_windows(tasks, view_of, options, progress=None)`` returns one
:class:`~balancer_cli.pack.windows.WindowResult` per :class:`~balancer_cli.pack.windows.WindowTask`,
in task order, each the result of :func:`~balancer_cli.pack.window_place.place_window` on
``view_of(i)``, and calls ``progress()`` once per window as it is done (a resumed one included).
Everything else (search, windows, merging, metrics) is shared, so every engine writes a
byte-identical manifest for the same ``window_samples``.

Example:
    >>> sorted(ENGINES)
    ['local', 'ray']
    >>> get_engine("warp")
    Traceback (most recent call last):
    ...
    balancer_cli.errors.UsageError: unknown --engine 'warp'; fix: use --engine local or --engine ray
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from balancer_cli.errors import UsageError

__all__ = ["ENGINES", "RunWindows", "get_engine"]

#: ``run_windows(tasks, view_of, options, progress=None)``: one placed window per task, in task order.
RunWindows = Callable[..., list]

#: engine name (``--engine``) -> the module that defines its ``run_windows`` (imported on use:
#: the Ray engine's dependencies are an extra).
ENGINES: dict[str, str] = {
    "local": "balancer_cli.pack.engines.local",
    "ray": "balancer_cli.pack.engines.ray",
}


def get_engine(name: str) -> RunWindows:
    """The ``run_windows`` of engine ``name``, importing its module now.

    Example:
        >>> get_engine("local").__module__
        'balancer_cli.pack.engines.local'
    """
    if name not in ENGINES:
        raise UsageError(f"unknown --engine {name!r}", fix="use --engine local or --engine ray")
    return importlib.import_module(ENGINES[name]).run_windows
