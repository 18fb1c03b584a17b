"""Timing groups: warm-up, rounds of repeats, the median; CUDA events and peak memory on a GPU.

Example:
    >>> [m] = measure(lambda lengths: None, [(4, 4)], device="cpu", warmup=1, repeats=3)
    >>> m.seconds >= 0, m.peak_bytes
    (True, None)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from balancer_cli.runtime.calibrate.families import Runner

__all__ = ["Measurement", "device_name", "measure"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """One shape's median time over the rounds, and (on a GPU) its peak allocated memory."""

    seconds: float
    peak_bytes: int | None = None


def measure(run: Runner, shapes: Sequence[Sequence[int]], *, device: str | torch.device, warmup: int = 1,
            repeats: int = 3, on_run: Callable[[], Any] | None = None) -> list[Measurement]:
    """Time ``run(shape)`` for every shape: ``warmup`` untimed runs each, then ``repeats`` rounds over
    all shapes; each shape's time is the median of its rounds.

    Rounds go over all shapes in turn (not one shape ``repeats`` times in a row), so a slow spell of
    the machine (another process, a frequency drop) lands on many shapes once instead of on one
    shape every time, and the median drops it. On CUDA each run is timed with CUDA events and its
    peak allocated memory is recorded; on CPU with ``perf_counter``. ``on_run`` is called after
    every run (a progress bar).
    """
    done = on_run or (lambda: None)
    cuda = torch.device(device).type == "cuda"
    for shape in shapes:
        for _ in range(warmup):
            run(shape)
            done()
    times: list[list[float]] = [[] for _ in shapes]
    peaks: list[int | None] = [None] * len(shapes)
    for _ in range(max(repeats, 1)):
        for i, shape in enumerate(shapes):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run(shape)
                stop.record()
                torch.cuda.synchronize()
                seconds = start.elapsed_time(stop) / 1000.0
                peaks[i] = max(peaks[i] or 0, int(torch.cuda.max_memory_allocated()))
            else:
                begin = time.perf_counter()
                run(shape)
                seconds = time.perf_counter() - begin
            times[i].append(seconds)
            done()
    return [Measurement(seconds=float(statistics.median(t)), peak_bytes=p) for t, p in zip(times, peaks)]


def device_name(device: str | torch.device) -> str:
    """A readable device name: the GPU's model, or ``cpu (<threads> threads)``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu ({torch.get_num_threads()} threads)"
