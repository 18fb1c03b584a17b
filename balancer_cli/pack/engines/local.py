"""The local pack engine: windows packed one after another in this process.

Example:
    >>> import numpy as np
    >>> from balancer_cli.pack.config import PackConfig
    >>> from balancer_cli.pack.packers.registry import SampleView
    >>> from balancer_cli.pack.windows import WindowTask
    >>> view = SampleView(ids_n=np.arange(8), load_nK=np.arange(1, 9)[:, None], cost_nK=np.arange(1., 9.)[:, None],
    ...                   source_n=np.zeros(8, np.int64), modules=("llm",))
    >>> task = WindowTask(packer="random", config=PackConfig(world_size=2, batch_size=2), caps_K=np.array([20]),
    ...                   bounds_K=np.array([20]), epoch=0, window=0)
    >>> [r.num_steps for r in run_windows([task], lambda i: view)]
    [2]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from balancer_cli.pack.packers.registry import SampleView
from balancer_cli.pack.window_place import place_window
from balancer_cli.pack.windows import WindowResult, WindowTask

__all__ = ["run_windows"]


def run_windows(tasks: Sequence[WindowTask], view_of: Callable[[int], SampleView], options: Any = None,
                progress: Callable[[], None] | None = None) -> list[WindowResult]:
    """Place every window in order (``options`` is unused: the local engine has none), calling
    ``progress()`` after each."""
    results = []
    for i, task in enumerate(tasks):
        results.append(place_window(task, view_of(i)))
        if progress is not None:
            progress()
    return results
