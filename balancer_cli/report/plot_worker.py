"""Draw ``report.png`` in a child process that imports matplotlib while the parent packs.

Importing matplotlib and drawing the report's panels take ~1 s of a 1.2M-sample ``balancer
pack`` (~6 s end to end on 2 cores), all of it after the packing, on the critical path. A
:class:`PlotWorker` started right after the lengths are read imports matplotlib on the other
core while the parent packs, then draws the figure it is sent with the same
:func:`~balancer_cli.report.plot.plot_report` and writes the PNG bytes back (byte-identical to
drawing here); a figure known before the report is written (no baseline in it) is sent as soon
as it is known (:meth:`PlotWorker.submit`). It is only worth it where the packing takes long
enough to hide the import: :func:`want_worker` decides.

Any failure of the child (no interpreter, killed, an exception, past :data:`TIMEOUT_S`) makes
:meth:`PlotWorker.plot` draw in the parent instead: the worker can make a run faster, never fail it.

Example:
    >>> import numpy as np, tempfile, pathlib
    >>> out = pathlib.Path(tempfile.mkdtemp()) / "r.png"
    >>> with PlotWorker() as worker:
    ...     worker.plot(out, {"llm": np.ones((4, 2))}, None)
    >>> out.stat().st_size > 0
    True
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from balancer_cli._procs import usable_cores

__all__ = ["PlotWorker", "want_worker", "WORKER_MIN_SAMPLES", "TIMEOUT_S"]

#: Samples from which a pack run draws its report in a worker: the packing then takes ~0.5 s or
#: more, enough to hide matplotlib's import (~0.8 s CPU on the other core). Below it the child's
#: import would outlast the packing and the parent would wait for it.
WORKER_MIN_SAMPLES = 200_000
#: Seconds the parent waits for the child's figure before drawing it itself.
TIMEOUT_S = 120.0


def want_worker(num_samples: int) -> bool:
    """Whether a pack run of ``num_samples`` samples should draw its report in a :class:`PlotWorker`.

    Not when matplotlib is already imported (the parent draws at once: a long-lived process,
    such as a test session or a notebook) or with one usable core (the child would only compete).

    Example:
        >>> want_worker(1_000)
        False
    """
    return num_samples >= WORKER_MIN_SAMPLES and "matplotlib" not in sys.modules and usable_cores() > 1


class PlotWorker:
    """A child process that has matplotlib imported and draws one report figure.

    Use as a context manager: leaving it stops a child that was never used (an error in the run).
    :meth:`submit` sends the figure as soon as its data is known, before the folder it goes to
    is written (``balancer pack --baselines none``: the child draws while the manifest is
    written); :meth:`plot` then only collects the PNG bytes.
    """

    def __init__(self, command: Sequence[str] | None = None) -> None:
        """Start the child: ``command`` (default: this module's :func:`_main` under this interpreter)."""
        command = [sys.executable, "-m", "balancer_cli.report.plot_worker"] if command is None else list(command)
        self._job: tuple | None = None  # the figure sent, as plot() is called with it
        self._exchange: threading.Thread | None = None  # sends the job, reads the PNG back
        self._png: bytes | None = None
        try:
            self._proc: subprocess.Popen | None = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        except OSError:  # no interpreter to start: plot() draws in this process
            self._proc = None

    def __enter__(self) -> PlotWorker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the child if it still runs (it was never sent a figure, or its figure is not wanted)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if self._exchange is not None:  # ends with the child
            self._exchange.join()
            self._exchange = None
        if proc is not None:
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None and not pipe.closed:
                    pipe.close()
        self._proc = None

    def submit(self, ours: Mapping[str, np.ndarray], baseline: Mapping[str, np.ndarray] | None,
               **labels: Any) -> None:
        """Send :func:`~balancer_cli.report.plot.plot_report`'s figure to the child now (once, in a
        thread: a child that reads nothing cannot block the caller); :meth:`plot` collects it."""
        if self._proc is None or self._job is not None:
            return
        job = {"ours": {m: np.asarray(v) for m, v in ours.items()},
               "baseline": None if baseline is None else {m: np.asarray(v) for m, v in baseline.items()},
               "labels": labels}
        self._job = (job["ours"], job["baseline"], labels)
        data = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
        self._exchange = threading.Thread(target=self._run, args=(self._proc, data), daemon=True,
                                          name="balancer-plot")
        self._exchange.start()

    def _run(self, proc: subprocess.Popen, data: bytes) -> None:
        try:
            png, _ = proc.communicate(data, timeout=TIMEOUT_S)
        except (OSError, ValueError, subprocess.TimeoutExpired):  # close() stops the child
            return
        if proc.returncode == 0 and png.startswith(_PNG_SIGNATURE):
            self._png = png

    def plot(self, path: str | os.PathLike, ours: Mapping[str, np.ndarray], baseline: Mapping[str, np.ndarray] | None,
             **labels: Any) -> None:
        """Draw :func:`~balancer_cli.report.plot.plot_report`'s figure into ``path``: in the child
        (the one :meth:`submit` sent, if it is this one), or here when the child fails or drew
        another figure (the same PNG either way)."""
        png = None
        try:
            self.submit(ours, baseline, **labels)
            if self._exchange is not None and _same_figure(self._job, (ours, baseline, labels)):
                self._exchange.join()  # communicate's timeout bounds the wait
                png = self._png
        finally:  # an interrupt included: no child outlives the call
            self.close()
        if png is not None:
            with open(path, "wb") as file:
                file.write(png)
            return
        from balancer_cli.report.plot import plot_report

        plot_report(path, ours, baseline, **labels)


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _same_figure(sent: tuple, asked: tuple) -> bool:
    """Whether :meth:`PlotWorker.plot`'s figure is the one already sent: equal labels and loads."""

    def same_loads(a, b) -> bool:
        if a is None or b is None:
            return a is None and b is None
        return list(a) == list(b) and all(np.array_equal(a[m], np.asarray(b[m])) for m in a)

    return sent[2] == asked[2] and same_loads(sent[0], asked[0]) and same_loads(sent[1], asked[1])


def _main() -> int:
    """The child: import the plotting code, then draw the one figure read from stdin and write
    its PNG bytes to stdout."""
    import io

    from balancer_cli.report.plot import plot_report, preload  # the import is the point: before the job arrives

    preload()
    job = pickle.loads(sys.stdin.buffer.read())
    png = io.BytesIO()
    plot_report(png, job["ours"], job["baseline"], **job["labels"])
    sys.stdout.buffer.write(png.getvalue())
    return 0


if __name__ == "__main__":
    code = _main()
    # The parent waits for this process to end, and the interpreter's teardown (matplotlib's
    # and numpy's modules) took 0.1-0.15 s of that wait.
    sys.stdout.flush()
    os._exit(code)
