"""Pool workers started with die_with_parent do not outlive a parent killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")

PARENT = textwrap.dedent("""
    import multiprocessing, os, sys, time
    from concurrent.futures import ProcessPoolExecutor
    from balancer_cli._procs import die_with_parent

    pool = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork"),
                               initializer=die_with_parent, initargs=(os.getpid(),))
    pids = {pool.submit(os.getpid).result() for _ in range(8)}
    pool.submit(time.sleep, 60)
    print(" ".join(map(str, sorted(pids))), flush=True)
    time.sleep(60)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie (exited, not yet reaped) counts as gone
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_workers_die_when_the_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert pids and all(_alive(p) for p in pids)
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)


def test_terminate_workers_ends_a_busy_pool_at_once():
    from concurrent.futures import ProcessPoolExecutor

    from balancer_cli._procs import terminate_workers

    pool = ProcessPoolExecutor(1)
    pool.submit(os.getpid).result(timeout=120)  # the worker runs (a loaded machine starts it late)
    pool.submit(time.sleep, 60)
    workers = list(pool._processes.values())
    started = time.monotonic()
    terminate_workers(pool)
    while any(w.is_alive() for w in workers) and time.monotonic() - started < 30:
        time.sleep(0.05)  # a loaded machine reaps the killed worker a moment later
    # well before the 60 s task ends, whatever the machine's load
    assert workers and all(not w.is_alive() for w in workers) and time.monotonic() - started < 30
