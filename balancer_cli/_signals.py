"""The command's own signal handlers, kept through a library call that replaces them.

``ray.init`` installs a SIGTERM handler that calls ``sys.exit(15)`` (and, in its core worker, a
native one that prints a C++ stack), and ``ray.shutdown`` leaves SIGTERM's native disposition at
the default: a SIGTERM during ``balancer pack --engine ray`` ended with exit 15 and a stack
dump, or after the cluster stopped killed the process (-15) before any ``finally`` ran, not the
command's exit 143 and one line (:func:`balancer_cli.cli._common.handle_errors`). Setting a
handler again from Python installs it natively again too.

Example:
    >>> import signal
    >>> before = signal.getsignal(signal.SIGTERM)
    >>> with kept_signal_handlers():
    ...     _ = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # a library's own
    >>> signal.getsignal(signal.SIGTERM) is before
    True
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["kept_signal_handlers"]


@contextlib.contextmanager
def kept_signal_handlers() -> Iterator[None]:
    """Put SIGTERM's and SIGINT's handlers back as they were on entry once the block ends (in the
    main thread, where Python's handlers run; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            if handler is not None:  # None: a native handler, not set from Python, left as it is
                signal.signal(signum, handler)
