"""The reaper of a local Ray cluster: it ends the cluster's processes when the command that started
it dies, however it dies.

A command that stops normally, or on SIGTERM or Ctrl-C, stops its cluster itself
(:func:`balancer_cli._ray.ray_session`). A command killed by SIGKILL (the OOM killer, a scheduler's
hard stop) runs no code, and Ray's GCS, raylet, agents and workers stayed ~60-100 s, reparented to
init. So before ``ray.init`` starts a local cluster, the command starts this reaper in a session of
its own (a signal to the command's process group does not reach it) and sets a marker in its own
environment, which every process of the cluster inherits. The reaper waits for its standard input
to close, which happens when the command exits by any path, then ends every process whose
environment carries the marker, and their descendants: SIGTERM, then SIGKILL after a grace period.
A command that stopped its cluster itself says so first, and the reaper just exits.

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

__all__ = ["STOPPED", "VARIABLE", "end_marked", "marked"]

#: The environment variable that carries a run's marker into its cluster's processes.
VARIABLE = "BALANCER_RAY_RUN"
#: What a command writes to the reaper once it has stopped its cluster itself.
STOPPED = b"stopped\n"


def marked(marker: str) -> list[int]:
    """The live processes (not this one) whose environment holds ``VARIABLE=marker``."""
    return sorted(pid for pid, (_, _, is_marked) in _processes(marker).items() if is_marked)


def _processes(marker: str) -> dict[int, tuple[int, str, bool]]:
    """``{pid: (parent, start time, marked)}`` of the processes but this one."""
    needle = f"{VARIABLE}={marker}".encode()
    table = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            pid = int(entry.name)
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if pid != os.getpid():
                table[pid] = (int(fields[1]), fields[19], needle in (entry / "environ").read_bytes())
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
    return table


def _cluster(marker: str, known: dict[int, str]) -> list[int]:
    """The live processes of the run: the marked ones and every descendant of a process of the run
    (Ray's agents rename themselves over their environment: the marker reads gone, their parent
    raylet's does not); ``known`` (pid -> start time) keeps every one seen, so a process whose parent
    died meanwhile is still known, and a reused PID is not."""
    table = _processes(marker)
    for pid, (_, start, is_marked) in table.items():
        if is_marked:
            known.setdefault(pid, start)
    grown = True
    while grown:
        grown = False
        for pid, (parent, start, _) in table.items():
            if pid not in known and parent in known and table.get(parent, (0, known[parent]))[1] == known[parent]:
                known[pid], grown = start, True
    return [pid for pid, start in known.items() if pid in table and table[pid][1] == start]


def end_marked(marker: str, grace_s: float = 2.0, settle_s: float = 0.5, most_s: float = 10.0) -> None:
    """SIGTERM the run's processes (:func:`_cluster`), then SIGKILL those left after ``grace_s``, again
    and again until none has been seen for ``settle_s`` (a raylet that is still dying starts its
    agents again), for ``most_s`` at most. A zombie is gone but for its parent's wait: not waited for."""
    known: dict[int, str] = {}
    pids = _cluster(marker, known)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = [pid for pid in _cluster(marker, known) if not _zombie(pid)]
    quiet_since, deadline = time.monotonic(), time.monotonic() + most_s
    while time.monotonic() < deadline and time.monotonic() - quiet_since < settle_s:
        pids = [pid for pid in _cluster(marker, known) if not _zombie(pid)]
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if pids:
            quiet_since = time.monotonic()
        time.sleep(0.05)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True  # gone


def main(argv: list[str]) -> int:
    """Wait for standard input to close, then end the processes of marker ``argv[0]``, unless the
    command said :data:`STOPPED` first (it stopped its cluster itself: anything marked that lives on,
    a subprocess it started meanwhile, is its own)."""
    if len(argv) != 1 or not argv[0]:
        return 2
    said = b""
    with contextlib.suppress(OSError):
        said = sys.stdin.buffer.read()  # blocks until the command that started us exits
    if said != STOPPED:
        end_marked(argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
