"""Worker processes that die with their parent.

A pool worker blocks on its task queue; if the parent dies (SIGKILL, OOM killer) nothing tells it,
and it stays behind as an orphan. :func:`die_with_parent` (a pool ``initializer``) asks Linux to
send the worker SIGKILL when its parent dies; :func:`terminate_workers` ends a pool's workers at
once when the parent unwinds (an error, Ctrl-C, SIGTERM) instead of waiting for their tasks.

Example:
    >>> import os
    >>> from concurrent.futures import ProcessPoolExecutor
    >>> with ProcessPoolExecutor(1, initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
    ...     pool.submit(abs, -3).result()
    3
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from typing import Any

__all__ = ["die_with_parent", "terminate_workers", "usable_cores"]

_PR_SET_PDEATHSIG = 1


def usable_cores() -> int:
    """All cores this process may use (its CPU affinity where the OS has one).

    Example:
        >>> usable_cores() >= 1
        True
    """
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def die_with_parent(parent_pid: int) -> None:
    """Pool initializer: SIGKILL this process when ``parent_pid`` dies (Linux; elsewhere a no-op)."""
    if os.getpid() == parent_pid:  # not a worker (a pool run in-process): never end the caller
        return
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def terminate_workers(pool: Any) -> None:
    """End a ``ProcessPoolExecutor``'s workers now and drop its queued tasks (for ``except`` paths)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for process in processes:
        # SIGKILL, not SIGTERM: a forked worker inherits the parent's Python SIGTERM handler, which
        # raises inside the task, and the pool's worker loop would catch it and carry on.
        with contextlib.suppress(Exception):
            process.kill()
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        with contextlib.suppress(Exception):
            process.join(timeout=5)
