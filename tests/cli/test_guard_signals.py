"""SIGTERM and Ctrl-C end a command with its own exit code and line, wherever they land.

Inside LLVM's bindings they are deferred until the main thread is out of them: LLVM calls back
into Python through ctypes (a kernel loading from numba's cache), and ctypes swallows an
exception raised there: a SIGTERM that landed as a kernel loaded killed ``balancer pack`` with a
segfault (-11) instead of exit 143 and one line. Inside an import they are deferred until the
module is imported: an extension module turns the exception into an ImportError, and a library
that takes it for an optional dependency missing carries on with the signal lost (pyarrow's
import of pandas). Around a Ray session the command's handlers are put back after ``ray.init``
and ``ray.shutdown``, which replace them.
"""

from __future__ import annotations

import importlib
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest

from balancer_cli.cli import _common
from balancer_cli.cli._common import Terminated, _sigterm_raises

pytestmark = pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="deferral needs SIGALRM")


def _call(fn):
    return fn()


def _in_llvm(fn):
    """Call ``fn`` from a frame whose module is named like LLVM's bindings' (``llvmlite...``)."""
    stand_in = types.FunctionType(_call.__code__, {"__name__": "llvmlite.binding.stand_in"})
    return stand_in(fn)


def _signal_main_thread(signum):
    """Send ``signum`` to the main thread itself (``os.kill`` may land on another thread of the test
    process, whose handler then waits for the scheduler): the handler runs right after this call."""
    signal.pthread_kill(threading.main_thread().ident, signum)


def _assert_terminated(script, unreached):
    """Run ``script`` (a command body sent SIGTERM): exit 143 and the command's line, no traceback,
    and the line it prints past the signal (``unreached``) never printed; returns its stdout."""
    done = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 143, (done.returncode, done.stderr[-2000:])
    assert done.stderr.strip().splitlines()[-1] == "Error: terminated; no output was written", done.stderr
    assert "Traceback" not in done.stderr and unreached not in done.stdout
    assert "SIGTERM received" not in done.stderr, done.stderr  # a native handler's stack dump (absl's)
    return done.stdout


def _busy(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    return "finished"


@pytest.fixture
def interactive_sigint():
    """SIGINT as an interactive command starts with it (Python's default handler), whatever the
    test run's own (a background job starts with SIGINT ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("interactive_sigint")
@pytest.mark.parametrize(("signum", "error"), [(signal.SIGTERM, Terminated), (signal.SIGINT, KeyboardInterrupt)])
def test_a_signal_inside_llvm_raises_once_the_main_thread_is_out_of_it(signum, error):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM)}

    reached = []

    def inside():
        _signal_main_thread(signum)  # handled right after this call returns: inside the stand-in frame
        reached.append(_busy(0.2))  # several retries land here, still inside: each one waits again

    with pytest.raises(error), _sigterm_raises():
        _in_llvm(inside)
        reached.append("out")
        assert _common._pending == [error]
        time.sleep(5)  # out of it: the next retry raises (within _RETRY_S), not after 5 s
    assert reached == ["finished", "out"]  # nothing was raised inside
    assert not _common._pending and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert {s: signal.getsignal(s) for s in before} == before  # the command's handlers are uninstalled


class _SignalsWhenCollected:
    """Sends ``signum`` to the main thread from ``__del__``: the handler's exception is raised in
    ``__del__``, where Python prints and drops it ("Exception ignored in ...")."""

    def __init__(self, signum):
        self.signum = signum

    def __del__(self):
        _signal_main_thread(self.signum)
        _busy(0.001)  # the handler runs here, inside __del__


@pytest.mark.usefixtures("interactive_sigint")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the one dropped
@pytest.mark.parametrize(("signum", "error"), [(signal.SIGTERM, Terminated), (signal.SIGINT, KeyboardInterrupt)])
def test_a_signal_whose_exception_is_dropped_raises_again(signum, error):
    with pytest.raises(error), _sigterm_raises():
        _SignalsWhenCollected(signum)  # collected at once: its __del__ drops the first exception
        started = time.perf_counter()
        _busy(5)  # the next check raises it again (within _RETRY_S), not after 5 s
    assert time.perf_counter() - started < 1.0
    assert not _common._pending and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_cleanup_on_the_way_out_is_not_interrupted():
    cleaned = []
    with pytest.raises(Terminated), _sigterm_raises():
        try:
            _signal_main_thread(signal.SIGTERM)
            _busy(5)
        finally:
            cleaned.append(_busy(0.2))  # the next check lands here, finds Terminated on its way out
            cleaned.append(signal.getitimer(signal.ITIMER_REAL))  # and ends the checks
    assert cleaned == ["finished", (0.0, 0.0)]


def test_an_ignored_sigint_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a background job or nohup starts
    try:
        with _sigterm_raises():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            _signal_main_thread(signal.SIGINT)
            assert _busy(0.05) == "finished" and not _common._pending
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_command_that_ends_while_a_signal_is_deferred_has_finished():
    def inside():
        _signal_main_thread(signal.SIGTERM)
        return "finished"

    with _sigterm_raises():
        assert _in_llvm(inside) == "finished"
    time.sleep(3 * _common._RETRY_S)  # no retry is left armed to raise later
    assert not _common._pending and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_signal_once_the_output_is_in_place_lets_the_command_finish(tmp_path):
    """After ``committed_folder`` put the output in place, "terminated; no output was written" would
    be false: a SIGTERM then (or held over the renames) is held and the command finishes (exit 0);
    the next command starts without the mark."""
    out = tmp_path / "out"
    with _sigterm_raises():
        from balancer_cli.commit import committed_folder

        with committed_folder(out) as folder:
            (folder / "manifest.parquet").write_bytes(b"rows")
        _signal_main_thread(signal.SIGTERM)
        time.sleep(3 * _common._RETRY_S)
        finished = True
    assert finished and (out / "manifest.parquet").read_bytes() == b"rows"
    with pytest.raises(Terminated), _sigterm_raises():
        _signal_main_thread(signal.SIGTERM)
        _busy(1)


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 0), (signal.SIGINT, 0), (signal.SIGTERM, 2)])
def test_a_signal_as_the_process_ends_keeps_the_commands_exit_code(tmp_path, signum, code):
    """``balancer`` (``cli.run``) ends the process once the command is over: a signal that lands
    then (here while its output is flushed) ends it with the command's own code, where the
    interpreter's teardown (0.2-0.5 s after a pack) was killed with status 143 and no line, the
    output whole, or printed a KeyboardInterrupt traceback."""
    script = tmp_path / "late.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys, time
        import balancer_cli.cli as cli

        class Stdout:
            def write(self, text):
                return sys.__stdout__.write(text)
            def flush(self):  # the process is ending: a signal arrives now
                sys.__stdout__.flush()
                os.kill(os.getpid(), {int(signum)})
                time.sleep(5)
                print("not ended by the signal", file=sys.__stderr__)

        def command():
            print("the command's output")
            sys.exit({code})

        cli.main = command
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.stdout = Stdout()
        cli.run()
        """))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (code, "the command's output\n", "")
    assert time.perf_counter() - started < 4.5


def test_the_program_ends_with_the_commands_code_and_its_whole_output(tmp_path):
    """``python -m balancer_cli`` flushes what it printed into a pipe before ``os._exit``, and keeps
    each exit code: 0, 2 (usage) and 1 (runtime, a lengths file that is not one)."""
    version = subprocess.run([sys.executable, "-m", "balancer_cli", "--version"], capture_output=True, text=True,
                             timeout=60, check=False)
    assert version.returncode == 0 and version.stdout.startswith("balancer") and version.stderr == ""
    usage = subprocess.run([sys.executable, "-m", "balancer_cli", "pack"], capture_output=True, text=True,
                           timeout=60, check=False)
    assert usage.returncode == 2 and "Usage:" in usage.stderr
    (tmp_path / "bad.parquet").write_text("not parquet")
    bad = subprocess.run([sys.executable, "-m", "balancer_cli", "pack", str(tmp_path / "bad.parquet"), "-o",
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1 and "bad.parquet" in bad.stderr


def test_a_signal_outside_llvm_raises_at_once():
    with pytest.raises(Terminated), _sigterm_raises():
        _signal_main_thread(signal.SIGTERM)
        _busy(5)  # not reached: the handler raises in this frame
    assert not _common._pending


def _slow_module(folder, name, signum):
    """A module whose import signals the main thread, then runs on (0.2 s) and ends with
    ``WHOLE = True``."""
    (folder / f"{name}.py").write_text(textwrap.dedent(f"""
        import signal, threading, time
        signal.pthread_kill(threading.main_thread().ident, {int(signum)})
        end = time.perf_counter() + 0.2
        while time.perf_counter() < end:  # several retries land here, still inside the import
            pass
        print("module imported whole", flush=True)
        WHOLE = True
    """))


@pytest.mark.usefixtures("interactive_sigint")
@pytest.mark.parametrize(("signum", "error"), [(signal.SIGTERM, Terminated), (signal.SIGINT, KeyboardInterrupt)])
def test_a_signal_inside_an_import_raises_once_the_module_is_imported(tmp_path, monkeypatch, signum, error):
    name = f"balancer_test_slow_import_{int(signum)}"
    _slow_module(tmp_path, name, signum)
    monkeypatch.syspath_prepend(str(tmp_path))
    reached = []
    try:
        with pytest.raises(error), _sigterm_raises():
            reached.append(importlib.import_module(name).WHOLE)
            time.sleep(5)  # out of it: the next retry raises (within _RETRY_S), not after 5 s
    finally:
        sys.modules.pop(name, None)
    assert reached == [True]
    assert not _common._pending and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_command_run_by_a_module_being_imported_is_not_held(tmp_path, monkeypatch):
    """Only the command's own imports hold a signal: one that runs as a script's module is
    imported (all of it under the import's frames) ends at once."""
    name = "balancer_test_command_at_import"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        import signal, threading, time
        from balancer_cli.cli._common import Terminated, _sigterm_raises

        ENDED_AT = None
        try:
            with _sigterm_raises():
                started = time.perf_counter()
                signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
                while time.perf_counter() < started + 5:
                    pass
        except Terminated:
            ENDED_AT = time.perf_counter() - started
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        ended_at = importlib.import_module(name).ENDED_AT
    finally:
        sys.modules.pop(name, None)
    assert ended_at is not None and ended_at < 1.0


def test_sigterm_inside_an_import_ends_the_command_with_143_and_one_line(tmp_path):
    """A command body whose import (an optional dependency, ImportError caught) is sent SIGTERM:
    the import completes, then the command ends with 143; the signal is never lost."""
    _slow_module(tmp_path, "optional_dependency", signal.SIGTERM)
    script = tmp_path / "body.py"
    script.write_text(textwrap.dedent("""
        import time
        from balancer_cli.cli._common import handle_errors

        @handle_errors
        def body():
            try:
                import optional_dependency
            except ImportError:
                pass
            time.sleep(60)
            print("not terminated")

        body()
    """))
    assert "module imported whole" in _assert_terminated(script, "not terminated")


def test_sigterm_while_kernels_compile_ends_the_command_with_143_and_one_line(tmp_path):
    """A command body that compiles kernels without the cache (seconds in numba and LLVM), sent
    SIGTERM part way: exit 143 and the command's line, never a crash."""
    script = tmp_path / "compile.py"
    script.write_text(textwrap.dedent("""
        import os, signal, threading
        import numba
        from balancer_cli.cli._common import handle_errors

        @handle_errors
        def body():
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
            for i in range(400):
                numba.njit(cache=False)(lambda x, i=i: (x * i + 1.5) ** 2 - x)(float(i))
            print("compiled every kernel")

        body()
    """))
    _assert_terminated(script, "compiled every kernel")


def test_sigterm_in_a_finalizer_ends_the_command_with_143_and_no_traceback(tmp_path):
    """SIGTERM handled inside ``__del__`` (as in numba's ``_on_type_disposal`` while kernels
    compile): Python drops the exception there and printed it ("Exception ignored in ...
    Traceback") before the command's line; now it is dropped unprinted and raised again."""
    script = tmp_path / "finalizer.py"
    script.write_text(textwrap.dedent("""
        import os, signal, time
        from balancer_cli.cli._common import handle_errors

        def busy(seconds):
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass

        class SignalsWhenCollected:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGTERM)
                busy(0.05)  # the handler runs here, inside __del__

        @handle_errors
        def body():
            SignalsWhenCollected()  # collected at once
            busy(5)
            print("ran past the signal")

        body()
    """))
    done = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=60)
    assert "Exception ignored" not in done.stderr, done.stderr
    _assert_terminated(script, "ran past the signal")


@pytest.mark.parametrize("when", ["under ray.init's handler", "as ray.init connects", "in the session", "after it"])
def test_sigterm_around_a_ray_session_ends_the_command_with_143(tmp_path, when):
    """``ray.init`` replaces SIGTERM's handler (Python's with ``sys.exit(15)``, the native one with
    absl's, which prints a C++ stack and kills the process) and ``ray.shutdown`` leaves the native
    one at the default (the process killed before any ``finally``): the session imports Ray with its
    native handler off, hands a SIGTERM that Ray's handler took to the command's, and puts the
    command's back after both. The first two cases signal from a thread once ``ray.init`` has put
    its handler in, or once its core worker exists (before it returns)."""
    pytest.importorskip("ray")
    script = tmp_path / "session.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, threading, time
        from types import SimpleNamespace
        from balancer_cli.cli._common import handle_errors
        from balancer_cli._ray import import_ray, ray_session

        when = {when!r}
        worker = import_ray()._private.worker

        def ray_took_sigterm():
            handler = signal.getsignal(signal.SIGTERM)
            return getattr(handler, "__module__", "").startswith("ray.")

        def connecting():
            return hasattr(worker.global_worker, "core_worker")

        def signal_when(ready):
            while not ready():
                time.sleep(0.0005)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

        @handle_errors
        def body():
            if when in ("under ray.init's handler", "as ray.init connects"):
                ready = ray_took_sigterm if when == "under ray.init's handler" else connecting
                threading.Thread(target=signal_when, args=(ready,), daemon=True).start()
            with ray_session(SimpleNamespace(address=None, num_cpus=1, object_store_bytes=80 * 2**20)):
                if when == "in the session":
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(60)
            if when == "after it":
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(60)
            print("not terminated")

        body()
    """))
    _assert_terminated(script, "not terminated")
