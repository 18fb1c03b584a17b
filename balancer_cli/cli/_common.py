"""Shared plumbing of the CLI commands: error handling, ``--json`` summaries, exit codes.

Commands stay thin: parse options, call one library function, write outputs, then
:func:`emit` a summary. :func:`handle_errors` turns :class:`~balancer_cli.errors.BalancerError`
into a one-line ``Error: ...`` on stderr with exit code 1 (or 2 for usage errors).

Example:
    >>> import click
    >>> @click.command()
    ... @json_option
    ... @handle_errors
    ... def hello(as_json):
    ...     emit({"greeting": "hi"}, as_json, lambda s: s["greeting"])
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import click

from balancer_cli._signals import (
    clear_output_committed,
    kept_signal_handlers,
    output_committed,
)
from balancer_cli.errors import BalancerError

__all__ = ["handle_errors", "json_option", "emit", "fail", "command_flags", "progress", "check_output_option",
           "Terminated"]

F = TypeVar("F", bound=Callable[..., Any])

json_option = click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object on stdout.")


_CAP_OPTION = re.compile(r"max_([a-z][a-z0-9]*)_(?:items|tokens)")


def command_flags(command: click.Command | None) -> dict[str, str]:
    """``{parameter: flag}`` of a click command: how its options spell the library's parameters.

    Example:
        >>> @click.command()
        ... @click.option("--dp", "world_size", type=int)
        ... def pack(world_size):
        ...     pass
        >>> command_flags(pack)
        {'world_size': '--dp'}
    """
    if command is None:
        return {}
    flags = {}
    for param in command.params:
        if isinstance(param, click.Option) and param.name:
            flag = max(param.opts, key=len)  # the long spelling: --out, not -o
            flags[param.name] = flag
            # --max-<m>-items / --max-llm-tokens set one entry of the library's `caps`.
            cap = _CAP_OPTION.fullmatch(param.name)
            if cap:
                flags[f"caps[{cap.group(1)}]"] = flag
    return flags


def fail(error: BalancerError) -> None:
    """Print ``Error: ...`` (parameters spelled as this command's flags) and exit with its code."""
    ctx = click.get_current_context(silent=True)
    click.echo(f"Error: {error.for_flags(command_flags(ctx.command if ctx else None))}", err=True)
    sys.exit(error.exit_code)


class Terminated(KeyboardInterrupt):
    """Raised in the main thread on SIGTERM, so every ``finally`` (temporary files) runs."""


_terminated = threading.Event()

#: Top-level packages in whose frames (or their callees') a signal's exception is not raised but
#: deferred, since it would not unwind cleanly from there:
#:
#: - ``llvmlite``: LLVM's bindings call back into Python through ctypes (a kernel loading from
#:   numba's cache, ``ExecutionEngine._raw_object_cache_getbuffer``), and ctypes swallows an
#:   exception raised there and returns to LLVM with nothing: ``balancer pack`` died of a
#:   segfault (-11) instead of exiting 143 when SIGTERM landed as a kernel loaded.
#: - ``importlib``: every import runs under its frames. An extension module's init turns the
#:   exception into an ImportError (numpy's: ``PyCapsule_Import could not import module
#:   "datetime"``) and is left half-initialized; a library that catches ImportError for an
#:   optional dependency then carries on with the signal lost and a half-built module.
#:
#: numba's own Python code (a compile) unwinds as any, so a long compile loop is still interrupted.
_DEFERRED_IN = frozenset({"llvmlite", "importlib"})
#: Seconds between the checks whether a deferred signal may raise yet; SIGALRM (POSIX) checks.
_RETRY_S = 0.02
_CAN_DEFER = hasattr(signal, "setitimer")
#: The exception a signal raises once the main thread is out of those frames, and again until it
#: is seen on its way out (:func:`_raise_when_safe`).
_pending: list[type[BaseException]] = []
#: The frame that runs the command (its ``with`` block): only frames below it are looked at, so a
#: command run from code that is itself being imported (a script's module-level call) is not held.
_outer: list[Any] = []


def _in_deferred(frame: Any) -> bool:
    """Whether ``frame`` or a caller of it, up to the command's own frame, runs code of
    :data:`_DEFERRED_IN`."""
    outer = _outer[0] if _outer else None
    while frame is not None and frame is not outer:
        if str(frame.f_globals.get("__name__", "")).partition(".")[0] in _DEFERRED_IN:
            return True
        frame = frame.f_back
    return False


def _unwinding(error: type[BaseException]) -> bool:
    """Whether an ``error`` is on its way out: handled by an ``except``, ``finally`` or ``__exit__``
    (itself or as the context of the exception handled there)."""
    handled = sys.exc_info()[1]
    while handled is not None:
        if isinstance(handled, error):
            return True
        handled = handled.__context__
    return False


def _raise_when_safe(error: type[BaseException], frame: Any) -> None:
    """Raise ``error`` now, or where the main thread is inside LLVM's bindings or an import, once
    it is out; then again at each check (every :data:`_RETRY_S`, by SIGALRM) until a check finds
    it on its way out, since an exception raised in a weakref callback, ``__del__`` or a garbage
    collector's callback is printed and dropped ("Exception ignored in ...": a SIGTERM as
    matplotlib's transforms were collected, and the pack ran on to exit 0). That check raises
    nothing and ends the checks, so cleanup (``finally``) runs undisturbed, its system calls not
    interrupted again; the command's end ends them too. Once the command's output is in place it
    raises nothing: the command finishes (:func:`balancer_cli._signals.mark_output_committed`)."""
    if output_committed():
        _pending.clear()
        return
    if not _CAN_DEFER:
        raise error()
    if _unwinding(error):
        _pending.clear()
        return
    _pending[:] = [error]
    signal.signal(signal.SIGALRM, _on_retry)
    signal.setitimer(signal.ITIMER_REAL, _RETRY_S)
    if not _in_deferred(frame):
        raise error()


def _on_retry(signum: int, frame: Any) -> None:
    if _pending:
        _raise_when_safe(_pending[0], frame)


def _on_sigterm(signum: int, frame: Any) -> None:
    _terminated.set()
    _raise_when_safe(Terminated, frame)


def _on_sigint(signum: int, frame: Any) -> None:
    _raise_when_safe(KeyboardInterrupt, frame)


def _quiet_unraisable(previous: Callable[[Any], None]) -> Callable[[Any], None]:
    """An ``sys.unraisablehook`` that drops, unprinted, the signal's own exception where Python
    drops it (raised in a weakref callback or ``__del__``: numba's ``_on_type_disposal`` as a
    SIGTERM landed mid-compile printed "Exception ignored in ... Traceback" before the command's
    line); the next check raises it again (:func:`_raise_when_safe`). Others go to ``previous``."""

    def hook(unraisable: Any) -> None:
        kind = unraisable.exc_type
        if _pending and kind is not None and issubclass(kind, _pending[0]):
            return
        previous(unraisable)

    return hook


@contextlib.contextmanager
def _sigterm_raises():
    """While a command runs, SIGTERM raises :class:`Terminated` and Ctrl-C KeyboardInterrupt, both
    deferred out of LLVM's frames and imports (then the previous handlers are back; a command that
    ends while one is deferred has finished, and ends as it would have)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = (signal.SIGTERM, signal.SIGINT) + ((signal.SIGALRM,) if _CAN_DEFER else ())
    outer = _outer[:]
    with kept_signal_handlers(*held):
        interactive = signal.getsignal(signal.SIGINT) is signal.default_int_handler  # not where the host ignores it
        _outer[:] = [sys._getframe(2)]  # this generator's, contextmanager's __enter__, then the `with`'s
        clear_output_committed()
        unraisable = sys.unraisablehook
        sys.unraisablehook = _quiet_unraisable(unraisable)
        signal.signal(signal.SIGTERM, _on_sigterm)
        if interactive:
            signal.signal(signal.SIGINT, _on_sigint)
        try:
            yield
        finally:
            if _CAN_DEFER:
                signal.setitimer(signal.ITIMER_REAL, 0)  # before SIGALRM's own handler is back
            _pending.clear()
            _outer[:] = outer
            sys.unraisablehook = unraisable
            clear_output_committed()


def handle_errors(fn: F) -> F:
    """Decorator: run a command body, converting BalancerError into a one-line message + exit code.

    SIGTERM and Ctrl-C end the command through the normal unwinding (temporary outputs removed)
    with one line and exit code 143 / 130.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _terminated.clear()
        try:
            with _sigterm_raises():
                return fn(*args, **kwargs)
        except BaseException as error:
            if _terminated.is_set():
                _exit_terminated()
            if isinstance(error, BalancerError):
                fail(error)
            if isinstance(error, KeyboardInterrupt):
                click.echo("Error: interrupted; no output was written", err=True)
                sys.exit(130)
            raise

    return wrapper  # type: ignore[return-value]


def _exit_terminated() -> None:
    """End the process after SIGTERM once every ``finally`` has run (temporary outputs removed).

    The process exits at once, without the interpreter's shutdown: a library interrupted part way
    (a thread pool, a native extension) need not be in a state its finalizers can tear down.
    """
    click.echo("Error: terminated; no output was written", err=True)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(143)


def check_output_option(output: Any, inputs: Any, *, folder: bool = False) -> None:
    """Refuse ``-o OUTPUT`` when it is, holds or lies inside one of ``inputs``, or is not a regular
    file/folder (:func:`balancer_cli._fsutil.check_output`); ``None`` (not given) passes."""
    from balancer_cli._fsutil import check_output

    if output is not None:
        check_output(output, [p for p in inputs if p is not None], folder=folder)


def emit(summary: Mapping[str, Any], as_json: bool, render: Callable[[Mapping[str, Any]], str]) -> None:
    """Print a command's summary: one JSON object with ``--json``, else ``render(summary)``."""
    if as_json:
        click.echo(json.dumps(summary, sort_keys=True, default=_jsonable))
    else:
        click.echo(render(summary))


def _jsonable(value: Any) -> Any:
    # numpy scalars/arrays and paths appear in summaries; make them plain JSON.
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def progress(total: int, quiet: bool, desc: str):
    """A tqdm bar on stderr, silent when not a terminal or with ``--quiet``."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, disable=quiet or not sys.stderr.isatty(), leave=False)
