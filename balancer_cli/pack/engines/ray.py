"""The Ray pack engine: windows packed as Ray tasks, merged by the driver in order, resumably.

Each window is one Ray task running the same :func:`~balancer_cli.pack.window_place.place_window` as
the local engine on the same slice of samples, so the merged manifest is byte-identical to
``--engine local`` with the same ``window_samples`` (the metadata records no engine).

- **Retries.** A task that raises an infrastructure error (``OSError``, ``MemoryError``, a lost
  worker) is retried ``retries`` times by Ray; an error of the data or the options (a
  :class:`~balancer_cli.errors.BalancerError`, e.g. too few groups for one step) is raised as
  the local engine raises it. Windows that still fail are reported together, by epoch and window,
  after every other window finished.
- **Resume.** With ``parts_dir`` (``balancer pack`` uses ``OUT.parts/`` beside ``OUT``), every
  finished window is written there (temp file + rename) tagged with the run key (lengths
  fingerprint, config, caps, bounds, window count, tool version). A rerun of the same command
  reuses every window whose tag matches and packs only the rest; the directory is removed once the
  manifest is written, unless ``keep_parts``. The directory carries balancer's marker file
  (:data:`~balancer_cli._fsutil.PARTS_MARKER`): one without it is neither reused nor deleted.

Example:
    >>> RayPackOptions(run_key="k").retries
    3
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from balancer_cli._fsutil import claim_parts_dir
from balancer_cli.errors import BalancerError, InputError
from balancer_cli.pack.packers.registry import SampleView
from balancer_cli.pack.window_place import place_window
from balancer_cli.pack.windows import WindowResult, WindowTask

__all__ = ["RayPackOptions", "read_shard", "run_windows", "shard_path", "window_key"]

_FIELDS = ("order_P", "offsets_G", "step_G", "rank_G", "micro_G", "dropped")


@dataclass(frozen=True, kw_only=True)
class RayPackOptions:
    """Cluster, retries and resume directory of a Ray pack run.

    Attributes:
        run_key: fingerprint of the run's data (the lengths); each window's tag adds the config,
            caps, bounds and its place (:func:`window_key`), and shards with another tag are packed again.
        address: an existing cluster (``auto``, ``host:6379``, ``ray://host:10001``); None starts a
            local one for this run.
        num_cpus: CPUs of the local cluster (None: all cores).
        object_store_bytes: object store of the local cluster (None: Ray's default).
        parts_dir: where finished windows are kept for resume (None: no resume).
        retries: retries of a window that raised an infrastructure error.
        notify: called with one line when a run resumes.
    """

    run_key: str
    address: str | None = None
    num_cpus: int | None = None
    object_store_bytes: int | None = None
    parts_dir: str | None = None
    retries: int = 3
    notify: Callable[[str], None] | None = None


def shard_path(parts_dir: str | os.PathLike, task: WindowTask) -> Path:
    """``<parts_dir>/<packer>-e<epoch>-w<window>.npz``: where a finished window is kept."""
    return Path(parts_dir) / f"{task.packer}-e{task.epoch:04d}-w{task.window:06d}.npz"


def _write_shard(path: Path, result: WindowResult, key: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **{name: getattr(result, name) for name in _FIELDS},
                 num_steps=np.int64(result.num_steps), reasons=np.array(result.dropped_reason, dtype=str),
                 key=np.array(key))
    os.replace(tmp, path)


def read_shard(path: Path, key: str) -> WindowResult | None:
    """The window kept at ``path`` if it was written by run ``key``, else None."""
    try:
        with np.load(path, allow_pickle=False) as z:
            if str(z["key"]) != key:
                return None
            arrays = {name: np.asarray(z[name], dtype=np.int64) for name in _FIELDS}
            return WindowResult(num_steps=int(z["num_steps"]), dropped_reason=tuple(str(r) for r in z["reasons"]),
                                **arrays)
    except (OSError, KeyError, ValueError):
        return None


def _place_and_keep(task: WindowTask, view: SampleView, parts_dir: str | None, key: str) -> WindowResult:
    """The Ray task: place the window and keep it for resume."""
    result = place_window(task, view)
    if parts_dir:
        _write_shard(shard_path(parts_dir, task), result, key)
    return result


def run_windows(tasks: Sequence[WindowTask], view_of: Callable[[int], SampleView],
                options: RayPackOptions | None = None,
                progress: Callable[[], None] | None = None) -> list[WindowResult]:
    """Place every window as a Ray task; results in task order (see the module docstring).
    ``progress()`` is called once per window: at once for those reused from ``parts_dir``, then
    as each finishes.

    Raises:
        BalancerError: a window's data or options are bad (as in the local engine).
        InputError: some windows failed after their retries (rerunning resumes).
    """
    from balancer_cli._ray import ray_session

    options = options or RayPackOptions(run_key="")
    results: list[WindowResult | None] = [None] * len(tasks)
    keys = [window_key(options.run_key, task, len(tasks)) for task in tasks]
    if options.parts_dir:
        claim_parts_dir(options.parts_dir)  # refuses a folder balancer did not create
        for i, task in enumerate(tasks):
            results[i] = read_shard(shard_path(options.parts_dir, task), keys[i])
        reused = sum(r is not None for r in results)
        for _ in range(reused if progress is not None else 0):
            progress()
        if reused and options.notify:
            options.notify(f"resuming from {options.parts_dir}: {reused} of {len(tasks)} windows already packed")
    todo = [i for i, r in enumerate(results) if r is None]
    if not todo:
        return results  # type: ignore[return-value]
    with ray_session(options) as ray:
        remote = ray.remote(max_retries=options.retries,
                            retry_exceptions=[OSError, MemoryError, ConnectionError])(_place_and_keep)
        refs = {i: remote.remote(tasks[i], ray.put(view_of(i)), options.parts_dir, keys[i]) for i in todo}
        failures = []
        for i, ref in refs.items():  # in task order: the driver merges as windows finish
            try:
                results[i] = ray.get(ref)
                if progress is not None:
                    progress()
            except ray.exceptions.RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                if isinstance(cause, BalancerError):
                    # The other windows are not cancelled: a ``ray.cancel`` that races with a
                    # task's completion aborts the driver (a failed check in Ray's task manager,
                    # ray-project/ray#54846; seen in our own test runs). They finish, or end with a
                    # session this run started.
                    raise cause from None
                failures.append((i, cause or exc))
            except ray.exceptions.RayError as exc:  # a lost worker or node, after Ray's own retries
                failures.append((i, exc))
    if failures:
        listed = "; ".join(f"epoch {tasks[i].epoch} window {tasks[i].window}: {_one_line(error)}"
                           for i, error in failures[:5])
        raise InputError(
            f"{len(failures)} of {len(tasks)} pack windows failed after {options.retries} retries ({listed})",
            fix="rerun the same command: finished windows are kept and reused"
                + (f" (in {options.parts_dir})" if options.parts_dir else ""))
    return results  # type: ignore[return-value]


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return (text[-1] if text else type(error).__name__)[:200]


def window_key(run_key: str, task: WindowTask, num_tasks: int) -> str:
    """Fingerprint of everything that decides one window's result: the run (lengths), the config,
    caps, bounds, the window's place and the number of windows, and the tool version."""
    from balancer_cli import __version__
    from balancer_cli._fsutil import bytes_fingerprint

    payload = {"run": run_key, "config": task.config.to_meta(), "caps": np.asarray(task.caps_K).tolist(),
               "bounds": np.asarray(task.bounds_K).tolist(), "packer": task.packer, "epoch": task.epoch,
               "window": task.window, "tasks": num_tasks, "tool_version": __version__}
    return bytes_fingerprint(json.dumps(payload, sort_keys=True, default=repr).encode())
