"""The reaper of a local Ray cluster: it ends the cluster's processes when the command that started
it dies, however it dies.

A command that stops normally, or on SIGTERM or Ctrl-C, stops its cluster itself
(:func:`balancer_cli._ray.ray_session`). A command killed by SIGKILL (the OOM killer, a scheduler's
hard stop) runs no code, and Ray's GCS, raylet, agents and workers stayed ~60-100 s, reparented to
init. So before ``ray.init`` starts a local cluster, the command starts this reaper in a session of
its own (a signal to the command's process group does not reach it) and sets a marker in its own
environment, which every process of the cluster inherits. The reaper waits for its standard input
to close, which happens when the command exits by any path, then ends every process whose
environment carries the marker: SIGTERM, then SIGKILL after a grace period. After a normal stop it
finds none and exits at once.

Run as ``python -m balancer_cli._reaper MARKER`` (Linux ``/proc``; elsewhere it finds nothing).

Example:
    >>> marked("no-process-has-this-marker")
    []
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

__all__ = ["VARIABLE", "end_marked", "marked"]

#: The environment variable that carries a run's marker into its cluster's processes.
VARIABLE = "BALANCER_RAY_RUN"


def marked(marker: str) -> list[int]:
    """The live processes (not this one) whose environment holds ``VARIABLE=marker``."""
    needle = f"{VARIABLE}={marker}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if int(entry.name) != os.getpid() and needle in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except (OSError, ValueError):  # gone meanwhile, or not ours to read
            continue
    return found


def end_marked(marker: str, grace_s: float = 2.0, settle_s: float = 0.5, most_s: float = 10.0) -> None:
    """SIGTERM the marked processes, then SIGKILL those left after ``grace_s``, again and again until
    none has been seen for ``settle_s`` (a raylet that is still dying starts its agents again; a
    zombie's environment reads empty: it is gone but for its parent's wait), for ``most_s`` at most."""
    pids = marked(marker)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = marked(marker)
    quiet_since, deadline = time.monotonic(), time.monotonic() + most_s
    while time.monotonic() < deadline and time.monotonic() - quiet_since < settle_s:
        pids = marked(marker)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if pids:
            quiet_since = time.monotonic()
        time.sleep(0.05)


def main(argv: list[str]) -> int:
    """Wait for standard input to close, then end the processes of marker ``argv[0]``."""
    if len(argv) != 1 or not argv[0]:
        return 2
    with contextlib.suppress(OSError):
        sys.stdin.buffer.read()  # blocks until the command that started us exits
    end_marked(argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
