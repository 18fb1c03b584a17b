"""Signal handlers put back as they were once a block ends, whoever replaced them in it.

A command installs its own SIGTERM and Ctrl-C handlers for its run
(:func:`balancer_cli.cli._common.handle_errors`), and a library may install others under it
(``ray.init`` and ``ray.shutdown``: :func:`balancer_cli._ray.ray_session`); both restore what
they found through :func:`kept_signal_handlers`. Setting a handler from Python installs it
natively too, so a library's native handler is replaced as well.

Once a command's output is in place (:func:`balancer_cli.commit.committed_folder` calls
:func:`mark_output_committed`), the command has done its work: its handlers hold a SIGTERM or
Ctrl-C from then on, and the command ends as it would have (its summary printed, exit 0), where
"terminated; no output was written" would no longer be true.

Example:
    >>> import signal
    >>> before = signal.getsignal(signal.SIGTERM)
    >>> with kept_signal_handlers(signal.SIGTERM):
    ...     _ = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # a library's own
    >>> signal.getsignal(signal.SIGTERM) is before
    True
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["clear_output_committed", "kept_signal_handlers", "mark_output_committed", "output_committed"]

_committed = threading.Event()


@contextlib.contextmanager
def kept_signal_handlers(*signums: int) -> Iterator[None]:
    """Put the handlers of ``signums`` back as they were on entry once the block ends (in the main
    thread, where Python's handlers run; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {signum: signal.getsignal(signum) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            if handler is not None:  # None: a native handler, not set from Python, left as it is
                signal.signal(signum, handler)


def mark_output_committed() -> None:
    """Record that the running command's output is in place (read by its signal handlers)."""
    _committed.set()


def output_committed() -> bool:
    """Whether :func:`mark_output_committed` was called since the last :func:`clear_output_committed`."""
    return _committed.is_set()


def clear_output_committed() -> None:
    """Forget the mark (a command clears it as it starts and ends)."""
    _committed.clear()
