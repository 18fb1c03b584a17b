"""Ray for the ``--engine ray`` commands: imported on demand, and one session of it per run that
keeps the command's own signal handlers.

``ray.init`` installs a SIGTERM handler that calls ``sys.exit(15)``, and its core worker a native
one (absl's failure handler) that prints a C++ stack and kills the process; ``ray.shutdown``
sets the native disposition to the default. A SIGTERM during ``balancer pack --engine ray``
ended with exit 15 and no line, a stack dump and -11, or -15 before any ``finally`` ran, not the
command's exit 143 and one line (:func:`balancer_cli.cli._common.handle_errors`). So
:func:`import_ray` imports Ray with its native failure handler off (``RAY_DISABLE_FAILURE_SIGNAL_HANDLER``,
read at import; workers keep theirs), :func:`ray_session` runs ``ray.init`` and ``ray.shutdown``
inside :func:`~balancer_cli._signals.kept_signal_handlers` (setting a handler again from Python
installs it natively again too), and a SIGTERM that Ray's handler turned into ``SystemExit(15)``
inside ``ray.init`` is handed to the handler it replaced once what ``ray.init`` started is stopped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from balancer_cli._reaper import STOPPED as REAPER_STOPPED
from balancer_cli._reaper import VARIABLE as REAPER_VARIABLE
from balancer_cli._reaper import add_descendants, end_processes, proc_stat, processes
from balancer_cli._signals import kept_signal_handlers
from balancer_cli.errors import InputError, UsageError

__all__ = ["import_ray", "ray_session"]

_INSTALL_FIX = "install the extra: pip install 'balancer_cli[ray]'"
#: The signals whose handlers Ray replaces and a command sets (a command's exit 143 and 130).
_HELD = (signal.SIGTERM, signal.SIGINT)
#: Ray's notice that a new local cluster uses token authentication (its default), printed on every
#: run: our cluster lives for one command, so the notice is kept off the command's output. Ray's
#: setting stays as it is (``RAY_AUTH_MODE``, which Ray sets for the process, is restored afterwards).
_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
_AUTH_MODE = "RAY_AUTH_MODE"
#: Off while Ray is imported (module docstring); the variable is put back as it was afterwards.
_NO_NATIVE_HANDLER = "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"
#: Seconds a cluster's address has to accept a TCP connection (:func:`_check_reachable`).
_PROBE_S = 10.0
_CONNECT_FIX = ("start it with `ray start --head` or pass its address to --ray-address; a cluster with token "
                "authentication also needs RAY_AUTH_MODE=token and its token (~/.ray/auth_token or RAY_AUTH_TOKEN)")


def import_ray():
    """Import ``ray`` and ``ray.data`` or raise a :class:`UsageError` that says how to install them."""
    saved = os.environ.get(_NO_NATIVE_HANDLER)
    os.environ.setdefault(_NO_NATIVE_HANDLER, "1")  # a user's own setting stays theirs
    try:
        import ray
        import ray.data  # (the Data library is a separate extra of ray)
    except ImportError as exc:
        raise UsageError(f"--engine ray needs Ray Data, which is not installed ({exc})", fix=_INSTALL_FIX) from None
    finally:
        if saved is None:
            os.environ.pop(_NO_NATIVE_HANDLER, None)
        else:
            os.environ[_NO_NATIVE_HANDLER] = saved
    return ray


@contextlib.contextmanager
def ray_session(options: Any) -> Iterator[Any]:
    """Connect to ``options.address`` or start a local cluster (stopped on exit); reuse a live one.

    ``options`` needs ``address``, ``num_cpus`` and ``object_store_bytes``
    (:class:`~balancer_cli.scan.engines.ray.RayOptions`; ``balancer pack --engine ray`` passes its
    own options).
    """
    ray = import_ray()
    started, reaper = False, None
    auth_mode = os.environ.get(_AUTH_MODE)
    if not ray.is_initialized():
        reaper = None if options.address else _start_reaper()  # a cluster of our own: ended if we are killed
        try:
            with kept_signal_handlers(*_HELD):  # ray.init and shutdown replace SIGTERM's: exit 143 stays ours
                _init(ray, options)
        except BaseException as exc:
            try:
                _stop(ray, auth_mode)  # what ray.init started before it was stopped (processes, connection)
            finally:
                _close_reaper(reaper)
            if isinstance(exc, SystemExit) and exc.code == signal.SIGTERM:
                signal.raise_signal(signal.SIGTERM)  # Ray's handler took it: now the handler it replaced
            raise
        started = True
    try:
        with _quiet_logger("ray.data"):  # per-run INFO lines would drown the progress bar
            yield ray
    finally:
        if started:
            try:
                _stop(ray, auth_mode)
            finally:
                _close_reaper(reaper)


def _start_reaper() -> tuple[subprocess.Popen, str | None] | None:
    """Start :mod:`balancer_cli._reaper` for the local cluster about to start, and mark this process's
    environment (which the cluster's processes inherit): ``(reaper, the variable's previous value)``,
    or None where no process can be started (the cluster then ends on Ray's own time if we are killed)."""
    marker = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != REAPER_VARIABLE}  # the reaper is not its own prey
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                      env.get("PYTHONPATH")]))
    try:
        reaper = subprocess.Popen([sys.executable, "-m", "balancer_cli._reaper", marker], stdin=subprocess.PIPE,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                  start_new_session=True)  # Ctrl-C to the command's group leaves it to its work
    except OSError:
        return None
    previous = os.environ.get(REAPER_VARIABLE)
    os.environ[REAPER_VARIABLE] = marker
    return reaper, previous


def _close_reaper(started: tuple[subprocess.Popen, str | None] | None) -> None:
    """The environment as it was, and the reaper told the cluster is stopped (it exits)."""
    if started is None:
        return
    reaper, previous = started
    if previous is None:
        os.environ.pop(REAPER_VARIABLE, None)
    else:
        os.environ[REAPER_VARIABLE] = previous
    with contextlib.suppress(OSError):
        reaper.stdin.write(REAPER_STOPPED)
        reaper.stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        reaper.wait(timeout=5)


def _init(ray: Any, options: Any) -> None:
    """``ray.init``: connect to ``options.address``, or start a local cluster of our own."""
    if options.address:
        _check_reachable(options.address)
        try:
            # Ship this very balancer_cli to the workers, so every node measures with the
            # driver's code (its dependencies must be installed on the nodes).
            ray.init(address=options.address, log_to_driver=False, configure_logging=False,
                     runtime_env={"py_modules": [str(Path(__file__).resolve().parent)]})
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise InputError(f"cannot connect to the Ray cluster at {options.address!r} ({exc})",
                             fix=_CONNECT_FIX) from None
    else:
        # address="local": always a fresh cluster of our own, even if `ray start` runs here.
        # Local workers must import this very copy of balancer_cli, installed or not.
        pythonpath = os.pathsep.join(dict.fromkeys([str(Path(__file__).resolve().parents[1]),
                                                    *filter(None, sys.path)]))
        with _quiet_logger(_AUTH_LOGGER):
            ray.init(address="local", num_cpus=options.num_cpus, object_store_memory=options.object_store_bytes,
                     include_dashboard=False, log_to_driver=False, configure_logging=False,
                     runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})


def _check_reachable(address: str, timeout_s: float = _PROBE_S) -> None:
    """Raise :class:`InputError` where nothing accepts a TCP connection at ``address``'s
    ``HOST:PORT`` (``auto`` and addresses without a port are left to Ray): Ray waits ~14 minutes
    for a cluster's GCS before it gives up, so a mistyped address hung the command that long.

    Example:
        >>> _check_reachable("auto")  # Ray finds the cluster (or says there is none) at once
    """
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise InputError(f"cannot connect to the Ray cluster at {address!r} (nothing answers at {host}:{port}: "
                         f"{exc.strerror or exc})", fix=_CONNECT_FIX) from None


def _stop(ray: Any, auth_mode: str | None) -> None:
    """``ray.shutdown`` (a no-op when nothing is connected or started), keeping our handlers, and
    ``RAY_AUTH_MODE`` put back to ``auth_mode`` (a new local cluster sets it for the process).

    The processes of a local cluster that outlive the shutdown are ended: after a SIGTERM, Ray's
    dashboard and runtime-env agents (the raylet's children, listed before it stops) stayed ~60 s
    behind their stopped raylet, in the command's folder."""
    ours = _ray_descendants()
    try:
        with kept_signal_handlers(*_HELD):
            try:
                ray.shutdown()
            except KeyboardInterrupt:
                # SIGTERM's (or Ctrl-C's) exception, raised again inside the shutdown while the
                # command unwinds: finish the shutdown here, where it is seen on its way out.
                ray.shutdown()
                raise
    finally:
        _end_processes(ours)
        if auth_mode is None:
            os.environ.pop(_AUTH_MODE, None)


def _ray_descendants() -> list[tuple[int, str]]:
    """``(pid, start time)`` of this process's descendants whose command line names Ray (Linux
    ``/proc``; none elsewhere). The start time tells a reused PID from the process listed."""
    me = os.getpid()
    known = {me: (proc_stat(me) or ("", 0, ""))[2]}
    add_descendants(processes(), known)
    return [(pid, start) for pid, start in known.items() if pid != me and b"ray" in _cmdline(pid)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _end_processes(listed: list[tuple[int, str]], grace_s: float = 2.0) -> None:
    """End the listed processes still alive (the same start time; :func:`balancer_cli._reaper.end_processes`),
    then reap those that are ours (the cluster's raylet and GCS): no zombie left behind."""

    def alive() -> list[int]:
        return [pid for pid, start in listed if (stat := proc_stat(pid)) is not None and stat[2] == start
                and stat[0] != "Z"]

    end_processes(alive, grace_s, settle_s=0.05)
    for pid, _ in listed:
        with contextlib.suppress(OSError):
            os.waitpid(pid, os.WNOHANG)


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    """Only errors from logger ``name`` meanwhile."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)

