"""libsndfile, called quietly and read plainly, for :mod:`balancer_cli.scan.media_header`.

libsndfile reads MP3 through libmpg123, which prints its warnings straight to file descriptor 2
(``warning: ID3v2: unrealistic small tag length 0``, ``Note: Trying to resync...``): C output that
no Python setting reaches, into a user's terminal, ``-q`` or not. :func:`muted_stderr` points
descriptor 2 at ``/dev/null`` for the call. And where libsndfile cannot tell a file's format, it
says the file "does not exist or is not a regular file", of a file the scan has just opened:
:func:`sndfile_reason` says what it means.

Example:
    >>> import os
    >>> with muted_stderr():
    ...     os.write(2, b"not shown")
    9
    >>> sndfile_reason(RuntimeError("Error opening 'x.mp3': File does not exist or is not a regular file (possibly a pipe?)."))
    'format not recognised'
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

__all__ = ["muted_stderr", "sndfile_reason"]

#: Threads of one process take turns: each restores the descriptor it found.
_LOCK = threading.Lock()
#: libsndfile's words for a file it opened but could not place, and what they mean here.
_MISLEADING = {"File does not exist or is not a regular file (possibly a pipe?).": "format not recognised"}


@contextlib.contextmanager
def muted_stderr() -> Iterator[None]:
    """File descriptor 2 on ``/dev/null`` inside the block (Python's own ``sys.stderr`` writes
    to it too, for as long as the block lasts: one header read)."""
    with _LOCK:
        try:
            saved = os.dup(2)
        except OSError:  # no descriptor 2 to mute
            yield
            return
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, 2)
            finally:
                os.close(null)
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def sndfile_reason(exc: BaseException) -> str:
    """The reason in a libsndfile error (after its ``Error opening '...':`` prefix), in plain words."""
    reason = str(exc).split(": ", 1)[-1].strip() or type(exc).__name__
    return _MISLEADING.get(reason, reason)
