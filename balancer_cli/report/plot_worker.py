"""Draw ``report.png`` in a child process that imports matplotlib while the parent packs.

Importing matplotlib and drawing the report's panels take ~1 s of a 1.2M-sample ``balancer
pack`` (~6 s end to end on 2 cores), all of it after the packing, on the critical path. A
:class:`PlotWorker` started right after the lengths are read imports matplotlib on the other
core while the parent packs, then draws the figure it is sent with the same
:func:`~balancer_cli.report.plot.plot_report` (byte-identical PNG). It is only worth it where
the packing takes long enough to hide the import: :func:`want_worker` decides.

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
    """

    def __init__(self, command: Sequence[str] | None = None) -> None:
        """Start the child: ``command`` (default: this module's :func:`_main` under this interpreter)."""
        command = [sys.executable, "-m", "balancer_cli.report.plot_worker"] if command is None else list(command)
        try:
            self._proc: subprocess.Popen | None = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError:  # no interpreter to start: plot() draws in this process
            self._proc = None

    def __enter__(self) -> PlotWorker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the child if it still runs (it was never sent a figure)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def plot(self, path: str | os.PathLike, ours: Mapping[str, np.ndarray], baseline: Mapping[str, np.ndarray] | None,
             **labels: Any) -> None:
        """Draw :func:`~balancer_cli.report.plot.plot_report`'s figure into ``path``: in the child,
        or here when the child fails (the same PNG either way)."""
        proc = self._proc
        if proc is not None:
            job = {"path": os.fspath(path), "ours": {m: np.asarray(v) for m, v in ours.items()},
                   "baseline": None if baseline is None else {m: np.asarray(v) for m, v in baseline.items()},
                   "labels": labels}
            try:
                proc.communicate(pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL), timeout=TIMEOUT_S)
                if proc.returncode == 0 and os.path.isfile(path):
                    return
            except (OSError, subprocess.TimeoutExpired):
                pass
            finally:  # an interrupt included: no child outlives the call
                self.close()
        from balancer_cli.report.plot import plot_report

        plot_report(path, ours, baseline, **labels)


def _main() -> int:
    """The child: import the plotting code, then draw the one figure read from stdin."""
    from balancer_cli.report.plot import plot_report, preload  # the import is the point: before the job arrives

    preload()
    job = pickle.loads(sys.stdin.buffer.read())
    plot_report(job["path"], job["ours"], job["baseline"], **job["labels"])
    return 0


if __name__ == "__main__":
    sys.exit(_main())
