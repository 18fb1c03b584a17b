"""Pack windows: per-window time, the driver's own cost, Ray vs local, and a cluster extrapolation.

Times each phase of a windowed pack in one process (read + prepare, search, every window on the
local engine, merge, metrics), then the same windows on a local Ray cluster (wall time, output
compared with the local engine's), and extrapolates to ``--extrapolate`` samples on ``--cpus``
Ray CPUs: windows in parallel waves, the driver's phases scaled linearly with the samples.

Usage (from the repository root):
    python bench/make_synthetic_lengths.py --num-samples 10000000 --out /tmp/lengths_10m.parquet
    python -m bench.bench_pack_windows /tmp/lengths_10m.parquet --dp 64 --window-samples 1000000
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from balancer_cli.lengths import read_lengths
from balancer_cli.pack.config import PackConfig
from balancer_cli.pack.engines import get_engine
from balancer_cli.pack.evaluate import evaluate_rows
from balancer_cli.pack.inputs import prepare_inputs
from balancer_cli.pack.pipeline import place_packer, resolve_thresholds


def _timed(fn, *args, **kwargs):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - wall, time.process_time() - cpu


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("lengths")
    ap.add_argument("--dp", type=int, default=64)
    ap.add_argument("--window-samples", type=int, default=1_000_000)
    ap.add_argument("--ray-cpus", type=int, default=2)
    ap.add_argument("--extrapolate", type=float, default=100e6)
    ap.add_argument("--cpus", type=int, default=64)
    args = ap.parse_args(argv)

    table, t_read, _ = _timed(read_lengths, [args.lengths])
    inputs, t_prep, _ = _timed(prepare_inputs, table)
    n = inputs.num_samples
    del table
    config = PackConfig(world_size=args.dp, window_samples=args.window_samples)
    (caps_K, bounds_K, _), t_search, _ = _timed(resolve_thresholds, inputs, config)

    # The local engine, timed window by window (the engine is a plain loop: wrap it).
    local = get_engine("local")
    per_window = []

    def timed_local(tasks, view_of, options):
        results = []
        for i, task in enumerate(tasks):
            out, _wall, cpu = _timed(local, [task], lambda _, i=i: view_of(i), options)
            per_window.append(cpu)
            results.extend(out)
        return results

    placement, t_local, _ = _timed(place_packer, "balanced", inputs, config, caps_K, bounds_K, engine=timed_local)
    t_merge = t_local - sum(per_window)
    metrics, t_eval, _ = _timed(evaluate_rows, inputs, placement.rows, placement.dropped_sample,
                                placement.dropped_reason, caps_K=caps_K, world_size=args.dp, micro_batches=1,
                                epoch_num_steps=placement.epoch_num_steps)

    import ray

    ray.init(address="local", num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        _, t_warm, _ = _timed(place_packer, "balanced", inputs, config, caps_K, bounds_K, engine="ray")  # warm-up
        on_ray, t_ray, cpu_ray = _timed(place_packer, "balanced", inputs, config, caps_K, bounds_K, engine="ray")
    finally:
        ray.shutdown()
    same = all(np.array_equal(a, b) for a, b in zip(
        (placement.rows.step, placement.rows.rank, placement.rows.micro, placement.rows.sample),
        (on_ray.rows.step, on_ray.rows.rank, on_ray.rows.micro, on_ray.rows.sample)))

    windows = len(per_window)
    m = metrics.metrics
    print(f"## {n:,} samples, --dp {args.dp}, {windows} windows of ~{n // windows:,} (W={args.window_samples:,}), "
          f"caps {dict(zip(inputs.modules, caps_K.tolist()))}")
    dists = " / ".join(f"{m['modules'][k]['dist_ratio']:.4f}" for k in inputs.modules)
    print(f"Dist {dists}, steps "
          f"{m['steps']['total']} ({m['steps']['vs_lower_bound']:.3f}x), mix {m['step_mix']['vs_random']:.2f}x random")
    print("| phase | seconds | per million samples |")
    print("|---|---|---|")
    for label, t in (("read lengths (driver)", t_read), ("prepare inputs (driver)", t_prep),
                     ("search (driver)", t_search),
                     (f"windows, local engine (sum of {windows}; CPU)", sum(per_window)),
                     ("merge windows (driver)", t_merge), ("metrics (driver)", t_eval)):
        print(f"| {label} | {t:.2f} | {t / n * 1e6:.2f} |")
    print(f"| one window (median CPU) | {np.median(per_window):.2f} | {np.median(per_window) / (n / windows) * 1e6:.2f} |")
    print(f"| windows on Ray, {args.ray_cpus} CPUs (wall; driver CPU {cpu_ray:.2f} s; cold {t_warm:.2f}) | "
          f"{t_ray:.2f} | {t_ray / n * 1e6:.2f} |")
    print(f"Ray placement identical to the local engine's: {same}; Ray vs local: "
          f"{sum(per_window) / t_ray:.2f}x")
    scale = args.extrapolate / n
    waves = math.ceil(windows * scale / args.cpus)
    driver = (t_read + t_prep + t_merge + t_eval) * scale + t_search
    cluster = waves * float(np.median(per_window)) * 1.2  # 20% for scheduling and object transfer
    print(f"Extrapolated to {args.extrapolate:,.0f} samples on {args.cpus} CPUs: {windows * scale:.0f} windows in "
          f"{waves} waves x {np.median(per_window):.1f} s x 1.2 = {cluster:.0f} s, plus the driver "
          f"{driver:.0f} s (linear in samples; search fixed) = {cluster + driver:.0f} s")


if __name__ == "__main__":
    main()
