"""Measured time of manifests: run their first steps' groups on the real model, rank by rank.

This is how packings are compared on what matters, time: every (step, rank) of the first
``steps`` steps runs its groups module by module (forward + backward, timed like a calibration
shape), and each module's Dist Ratio is computed from the measured seconds. The ranks run one after
another in this process; what differs between ranks is only their groups. Several manifests are
timed in the same rounds (every round runs every group of every manifest once), so a slow spell
of the machine lands on all of them alike and their Dist Ratios stay comparable.

Example (CPU, a tiny config; see bench/bench_calibrate.py):
    >>> times = replay_times("tiny-qwen2-vl/", ["out_tokens/", "out_measured/"], lengths, steps=8)  # doctest: +SKIP
    >>> times[1]["dist_ratio"]["llm"] < times[0]["dist_ratio"]["llm"]  # doctest: +SKIP
    True
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from balancer_cli.cost.calibration import group_shapes
from balancer_cli.lengths import LLM, LengthsTable
from balancer_cli.manifest import open_manifest
from balancer_cli.metrics import dist_ratio
from balancer_cli.runtime.calibrate.families import family_for
from balancer_cli.runtime.calibrate.measure import measure
from balancer_cli.runtime.calibrate.run import DTYPES, Measure, load_config

__all__ = ["manifest_groups", "replay_times"]


def manifest_groups(manifest_dir: str | os.PathLike, steps: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, int, int]:
    """The samples of every group of the first ``steps`` steps, with their step and rank.

    Returns:
        ``(samples_by_group, step_G, rank_G, num_steps, world_size)``.
    """
    manifest = open_manifest(manifest_dir)
    steps = min(steps, manifest.num_steps)
    rows = manifest.read_steps(0, steps)
    key = rows.slot_numbers()
    bounds = np.flatnonzero(np.diff(key)) + 1
    starts = np.concatenate([[0], bounds]).astype(np.int64)
    return (np.split(rows.sample, bounds), rows.step[starts].astype(np.int64), rows.rank[starts].astype(np.int64),
            steps, int(manifest.meta["world_size"]))


def replay_times(config_dir: str | os.PathLike, manifest_dirs: Sequence[str | os.PathLike], lengths: LengthsTable, *,
                 steps: int = 8, modules: Sequence[str] | None = None, layers: int | None = None, device: str = "cpu",
                 dtype: str = "float32", attention: str = "sdpa", warmup: int = 1, repeats: int = 3,
                 measure_fn: Measure | None = None) -> list[dict[str, Any]]:
    """Time the first ``steps`` steps of each manifest on the model of ``config_dir``.

    Returns:
        Per manifest ``{"steps", "world_size", "seconds": {module: (S, R) list}, "dist_ratio":
        {module: float}, "step_dist_ratio": float}``: per module the measured seconds of each rank
        at each step; the step's Dist Ratio counts modules one after another (step time = the sum).
        ``measure_fn`` replaces the timer (as in :func:`~balancer_cli.runtime.calibrate.run.calibrate`).
    """
    timer = measure_fn or (lambda run, shapes, on_run: measure(run, shapes, device=device, warmup=warmup,
                                                               repeats=repeats, on_run=on_run))
    config = load_config(config_dir)
    family = family_for(config)
    chosen = [m for m in (modules or family.modules) if m == LLM or m in lengths.modules]
    plans = [manifest_groups(path, steps) for path in manifest_dirs]
    results = [{"steps": n, "world_size": r, "seconds": {}, "dist_ratio": {}} for _, _, _, n, r in plans]
    totals = [np.zeros((n, r)) for _, _, _, n, r in plans]
    for module in sorted(chosen, key=lambda m: m == LLM):
        layers_m = family.num_layers(config, module) if layers is None else layers
        run = family.build(config, module, layers_m, torch.device(device), DTYPES[dtype], attention)
        jobs = []  # (manifest, step, rank, shape) of every non-empty group of every manifest
        for i, (groups, step_G, rank_G, _, _) in enumerate(plans):
            jobs += [(i, s, r, shape) for shape, s, r in zip(group_shapes(lengths, module, groups), step_G, rank_G) if shape]
        timed = timer(run, [job[3] for job in jobs], lambda: None)
        seconds = [np.zeros_like(t) for t in totals]
        for (i, s, r, _), m in zip(jobs, timed):
            seconds[i][s, r] += m.seconds
        for i, sec in enumerate(seconds):
            results[i]["seconds"][module] = sec.round(9).tolist()
            results[i]["dist_ratio"][module] = round(dist_ratio(sec), 6)
            totals[i] += sec
    for result, total in zip(results, totals):
        result["step_dist_ratio"] = round(dist_ratio(total), 6)
    return results
