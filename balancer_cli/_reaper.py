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
import select
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["STOPPED", "VARIABLE", "add_descendants", "end_marked", "end_processes", "marked", "proc_stat",
           "processes"]

#: The environment variable that carries a run's marker into its cluster's processes.
VARIABLE = "BALANCER_RAY_RUN"
#: What a command writes to the reaper once it has stopped its cluster itself.
STOPPED = b"stopped\n"
#: Seconds between the reaper's lists of the run's processes while the command runs.
WATCH_S = 0.25


def marked(marker: str) -> list[int]:
    """The live processes (not this one) whose environment holds ``VARIABLE=marker``."""
    return sorted(pid for pid, (_, _, is_marked) in processes(marker).items() if is_marked)


def proc_stat(pid: int) -> tuple[str, int, str] | None:
    """``(state, parent, start time)`` of a process (``/proc/PID/stat``; the start time tells a reused
    PID from the process once seen), None when it is gone or there is no ``/proc``."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1]), fields[19]
    except (OSError, IndexError, ValueError):
        return None


def processes(marker: str | None = None) -> dict[int, tuple[int, str, bool]]:
    """``{pid: (parent, start time, marked)}`` of the processes but this one (``marked``: its
    environment holds ``VARIABLE=marker``; always False without a marker)."""
    needle = None if marker is None else f"{VARIABLE}={marker}".encode()
    table = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            pid = int(entry.name)
            stat = proc_stat(pid)
            if pid != os.getpid() and stat is not None:
                table[pid] = (stat[1], stat[2], needle is not None and needle in (entry / "environ").read_bytes())
        except (OSError, ValueError):  # gone meanwhile, or not ours to read
            continue
    return table


def end_processes(alive: Callable[[], list[int]], grace_s: float = 2.0, settle_s: float = 0.5,
                  most_s: float = 10.0) -> None:
    """SIGTERM the processes ``alive()`` lists, then SIGKILL those it lists after ``grace_s``, again and
    again until it has listed none for ``settle_s`` (a raylet that is still dying starts its agents
    again), for ``most_s`` at most. ``alive`` leaves zombies out: gone but for their parent's wait."""
    pids = alive()
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = alive()
    quiet_since, deadline = time.monotonic(), time.monotonic() + most_s
    while time.monotonic() < deadline and time.monotonic() - quiet_since < settle_s:
        pids = alive()
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if pids:
            quiet_since = time.monotonic()
        time.sleep(0.05)


def add_descendants(table: dict[int, tuple[int, str, bool]], known: dict[int, str]) -> None:
    """Add to ``known`` (pid -> start time) every process of ``table`` (:func:`processes`) that
    descends from one in it; a parent whose start time is not the one known is a reused PID."""
    grown = True
    while grown:
        grown = False
        for pid, (parent, start, _) in table.items():
            if pid not in known and parent in known and table.get(parent, (0, known[parent]))[1] == known[parent]:
                known[pid], grown = start, True


def _cluster(marker: str, known: dict[int, str]) -> list[int]:
    """The live processes of the run, zombies aside: the marked ones and every descendant of a
    process of the run (Ray's agents rename themselves over their environment: the marker reads
    gone, their parent raylet's does not); ``known`` (pid -> start time) keeps every one seen, so a
    process whose parent died meanwhile is still known, and a reused PID is not."""
    table = processes(marker)
    for pid, (_, start, is_marked) in table.items():
        if is_marked:
            known.setdefault(pid, start)
    add_descendants(table, known)
    return [pid for pid, start in known.items()
            if pid in table and table[pid][1] == start and (proc_stat(pid) or ("Z",))[0] != "Z"]


def end_marked(marker: str, grace_s: float = 2.0, known: dict[int, str] | None = None) -> None:
    """End the run's processes (:func:`_cluster`, from ``known`` on) with :func:`end_processes`."""
    known = {} if known is None else known
    end_processes(lambda: _cluster(marker, known), grace_s)


def main(argv: list[str]) -> int:
    """Wait for standard input to close, then end the processes of marker ``argv[0]``, unless the
    command said :data:`STOPPED` first (it stopped its cluster itself: anything marked that lives on,
    a subprocess it started meanwhile, is its own). Meanwhile the run's processes are listed every
    :data:`WATCH_S`: a raylet whose command was killed may die on its own before it is seen, and
    its agents, reparented to init and renamed over their environment, are known only from then."""
    if len(argv) != 1 or not argv[0]:
        return 2
    said, known, fd = b"", {}, sys.stdin.fileno()
    with contextlib.suppress(OSError):
        while True:  # until the command that started us exits (its end of the pipe closes)
            if select.select([fd], [], [], WATCH_S)[0]:
                chunk = os.read(fd, 64)
                if not chunk:
                    break
                said += chunk
            else:
                _cluster(argv[0], known)
    if said != STOPPED:
        end_marked(argv[0], known=known)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
