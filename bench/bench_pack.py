"""Packing benchmark: our packer vs OmniBal's ISF (and random batching) in the same process.

Prints, per scenario: Dist Ratio and utilization per module, steps vs their lower bound, step
mix vs random (mean total-variation distance between each step's source histogram and the
global one, over the same for the same steps holding a shuffle of the placed samples:
:func:`balancer_cli.pack.evaluate.step_mix_ratio`, the report's measure), dropped samples, and
wall times with their ratio to ISF.

Usage (from the repository root):
    python -m bench.bench_pack                       # all scenarios
    python -m bench.bench_pack --scenario internvl   # one of: internvl, synthetic, audio, speed
    python -m bench.bench_pack --scenario memory     # 10M samples (minutes)
    python -m bench.bench_pack --scenario scale      # real 70k, 1.2M, a three-module 300k (+ at its hint: micro-batches, group size)
    python -m bench.bench_pack --scenario scale --scale-sizes 1200000,10000000
    python -m bench.bench_pack --scenario cli        # the CLI end to end at 1.2M and 10M against the issue's targets
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import time
from pathlib import Path

import numpy as np

from balancer_cli.metrics import dist_ratio, step_loads, utilization
from balancer_cli.pack.assign import (
    assign_groups,
    group_source_counts,
    split_to_multiple,
)
from balancer_cli.pack.bounds import groups_lower_bound
from balancer_cli.pack.evaluate import step_mix_ratio
from balancer_cli.pack.packers.balanced import pack_balanced
from balancer_cli.pack.packers.isf import pack_isf
from balancer_cli.pack.search import default_caps, search_thresholds
from balancer_cli.pack.types import check_packing, group_sums
from bench.synthetic import make_synthetic

ROOT = Path(__file__).resolve().parents[1]


def source_codes(source_N: np.ndarray) -> np.ndarray:
    """(N,) int code of each sample's source label."""
    return np.unique(source_N, return_inverse=True)[1].reshape(-1)


def assign(packing, cost_NK, source_N, R, M):
    """Our assigner as the pack pipeline runs it (group costs and per-group source counts)."""
    return assign_groups(group_sums(packing, cost_NK), world_size=R, micro_batches=M,
                         mix_GO=group_source_counts(packing, source_codes(source_N)))


def evaluate(packing, assignment, cost_NK, source_N, R):
    """Per-module Dist Ratio / utilization and the step mix of a packed, assigned epoch."""
    gid = packing.group_ids()
    samples = packing.order
    step_P = assignment.step[gid].astype(np.int64)
    rank_P = assignment.rank[gid].astype(np.int64)
    out = {"steps": assignment.num_steps, "groups": packing.num_groups, "dropped": len(packing.dropped)}
    for k in range(cost_NK.shape[1]):
        load_SR = step_loads(step_P, rank_P, cost_NK[samples, k], num_steps=assignment.num_steps, world_size=R)
        out[f"dist{k}"] = dist_ratio(load_SR)
        out[f"util{k}"] = utilization(load_SR)
    out["mix"] = step_mix_ratio(step_P, source_codes(source_N)[samples], assignment.num_steps)
    return out


def random_assign(num_groups, R, M, seed=0):
    """OmniBal's evaluation: groups in random order, dealt to ranks as a random sampler does."""
    from balancer_cli.pack.types import Assignment

    perm = np.random.default_rng(seed).permutation(num_groups)
    slot = np.empty(num_groups, np.int64)
    slot[perm] = np.arange(num_groups)
    S = num_groups // (R * M)
    return Assignment((slot // (R * M)).astype(np.int32), (slot % R).astype(np.int32),
                      (slot // R % M).astype(np.int32), S)


def run_scenario(name, load_NK, cost_NK, source_N, modules, caps_K, R, M, isf_bounds=None):
    """Pack with ISF and ours under the same caps, assign, and print one table."""
    print(f"\n## {name}: N={len(load_NK):,}, modules={modules}, caps={caps_K.tolist()}, "
          f"world_size={R}, micro_batches={M}")
    rows = []
    isf_bounds = caps_K - np.maximum(1, caps_K // 32) if isf_bounds is None else isf_bounds
    isf_bounds[:-1] = caps_K[:-1]
    t = time.process_time()
    p_isf = pack_isf(load_NK, caps_K, isf_bounds, iterations=50, seed=0)
    t_isf = time.process_time() - t
    p_isf = split_to_multiple(p_isf, cost_NK[:, -1], R * M)
    check_packing(p_isf, len(load_NK), load_NK, caps_K)
    a_random = random_assign(p_isf.num_groups, R, M)
    rows.append(("ISF + random sampler", evaluate(p_isf, a_random, cost_NK, source_N, R), t_isf))
    t = time.process_time()
    a = assign(p_isf, cost_NK, source_N, R, M)
    rows.append(("ISF + our assigner", evaluate(p_isf, a, cost_NK, source_N, R), t_isf + time.process_time() - t))
    caps_ours = caps_K
    t = time.process_time()
    p = pack_balanced(load_NK, caps_ours, cost_NK=cost_NK, group_multiple=R * M, seed=0, source_N=source_N)
    a = assign(p, cost_NK, source_N, R, M)
    t_ours = time.process_time() - t
    check_packing(p, len(load_NK), load_NK, caps_ours)
    rows.append(("ours", evaluate(p, a, cost_NK, source_N, R), t_ours))
    lb_steps = -(-groups_lower_bound(load_NK, caps_ours) // (R * M))
    head = "| method | " + " | ".join(f"dist {m}" for m in modules) + " | " + " | ".join(f"util {m}" for m in modules)
    print(head + " | steps (lb) | mix vs random | dropped | CPU s (x ISF) |")
    print("|" + "---|" * (5 + 2 * len(modules)))
    for label, r, dt in rows:
        dist = " | ".join(f"{r[f'dist{k}']:.4f}" for k in range(len(modules)))
        util = " | ".join(f"{r[f'util{k}']:.4f}" for k in range(len(modules)))
        print(f"| {label} | {dist} | {util} | {r['steps']} ({lb_steps}) | {r['mix']:.2f}x "
              f"| {r['dropped']} | {dt:.2f} ({dt / t_isf:.2f}x) |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="all")
    ap.add_argument("--world-size", type=int, default=None)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--scale-sizes", default="1200000", help="resampled sizes of --scenario scale")
    args = ap.parse_args(argv)
    want = lambda s: args.scenario in ("all", s)  # noqa: E731
    if want("internvl"):
        from balancer_cli.lengths import read_lengths

        files = sorted(glob.glob(str(ROOT.parent / "shared" / "data" / "internvl-lengths" / "*.json")))
        lt = read_lengths(files)
        load = np.stack([lt.items("vision"), lt.llm_tokens()], 1).astype(np.int64)
        cost = np.stack([lt.tokens("vision"), lt.llm_tokens()], 1).astype(np.float64)
        for caps in (default_caps(load), np.array([10, 4096])):
            run_scenario("internvl-lengths (4 files)", load, cost, lt.sources(), ("vision", "llm"),
                         caps, args.world_size or 8, args.micro_batches)
    if want("synthetic"):
        d = make_synthetic(200_000, seed=0)
        run_scenario("synthetic 200k", d["load_NK"], d["cost_NK"], d["source"], d["modules"],
                     default_caps(d["load_NK"]), args.world_size or 16, args.micro_batches)
    if want("audio"):
        d = make_synthetic(200_000, seed=0, audio_share=0.1)
        run_scenario("synthetic 200k + audio (10%)", d["load_NK"], d["cost_NK"], d["source"], d["modules"],
                     default_caps(d["load_NK"]), args.world_size or 32, args.micro_batches)
    if want("speed"):
        speed(1_200_000, args.world_size or 16, args.micro_batches)
    if args.scenario == "scale":  # not part of "all": the pipeline at 1.2M+ takes a while
        scale([int(n) for n in args.scale_sizes.split(",") if n], args.micro_batches)
    if args.scenario == "cli":  # not part of "all": writes 1.2M and 10M lengths files and packs them
        cli()
    if args.scenario == "memory":  # not part of "all": 10M samples take minutes
        speed(10_000_000, args.world_size or 16, args.micro_batches)


def speed(n, R, M):
    """CPU time of search + pack (ours) vs ISF alone on ``n`` synthetic samples, and peak memory."""
    import resource

    d = make_synthetic(n, seed=0)
    load, cost = d["load_NK"], d["cost_NK"]
    caps = default_caps(load)
    print(f"\n## speed: N={n:,} synthetic, caps={caps.tolist()}, world_size={R}")
    t = time.process_time()
    res = search_thresholds(load, cost, world_size=R, micro_batches=M, max_caps_K=2 * caps)
    t_search = time.process_time() - t
    t = time.process_time()
    p = pack_balanced(load, res.best_caps_K, cost_NK=cost, group_multiple=R * M, seed=0, source_N=d["source"])
    t_pack = time.process_time() - t
    t = time.process_time()
    a = assign(p, cost, d["source"], R, M)
    t_assign = time.process_time() - t
    r = evaluate(p, a, cost, d["source"], R)
    t = time.process_time()
    pack_isf(load, caps, caps - np.maximum(1, caps // 32), iterations=50, seed=0)
    t_isf = time.process_time() - t
    dists = " / ".join(f"{r['dist' + str(k)]:.4f}" for k in range(cost.shape[1]))
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    total = t_search + t_pack + t_assign
    print(f"search {t_search:.2f} s + pack {t_pack:.2f} s + assign {t_assign:.2f} s = {total:.2f} s CPU "
          f"(ISF, 50 iterations: {t_isf:.2f} s; ratio {total / t_isf:.2f}x); peak RSS {peak_mb:.0f} MiB; "
          f"best caps {res.best_caps_K.tolist()}, {p.num_groups} groups; Dist Ratio "
          f"{dists}, steps {r['steps']} "
          f"(lower bound {-(-groups_lower_bound(load, res.best_caps_K) // (R * M))}), "
          f"mix {r['mix']:.2f}x")


def scale(sizes, M):
    """The pack pipeline (search, pack, assign; every baseline) on the real 70k and resampled
    sizes: Dist, steps vs bound, step mix vs random batching of the same steps, CPU vs ISF."""
    from balancer_cli.lengths import read_lengths
    from balancer_cli.pack.inputs import prepare_inputs

    real = sorted(glob.glob(str(ROOT.parent / "shared" / "data" / "internvl-lengths" / "*.json")))
    # (label, table, R, checked: the caps `balancer pack` keeps, see _scale_case)
    cases = [("real 70,706", read_lengths(real), 8, False)]
    # (M > 1 is --micro-batches; the cases below run with it as given.)
    for n in sizes:
        lt = read_lengths(real)
        pick = np.random.default_rng(0).integers(0, lt.num_samples, n)
        cases.append((f"resampled {n:,}", lt.table.take(pick), 64, False))
    from balancer_cli.lengths import LengthsTable, make_lengths_table

    d = make_synthetic(300_000, seed=0, audio_share=0.1, audio_source=True)
    modules = {m: (d["cost_NK"][:, k], d["load_NK"][:, k]) for k, m in enumerate(d["modules"][:-1])}
    # As `balancer pack` keeps its caps: at one micro-batch the search's pick (LLM cap 8,494) takes
    # 1.030x the bound in steps, over the 1.03x the pipeline's check holds it to; the check keeps
    # the next candidate (10,854: 1.016x).
    cases.append(("synthetic 300k: vision, text-only and speech (audio) sources",
                  make_lengths_table(d["load_NK"][:, -1], modules, source=d["source"]), 32, True))
    for label, table, R, checked in cases:
        if not hasattr(table, "table"):
            table = LengthsTable(table)
        inputs = prepare_inputs(table)
        ours = _scale_case(label, inputs, R, M, checked=checked)
        lift, size = _lifting(ours, M)
        if lift > M:
            # A sparse module in too few groups to reach every step at M micro-batches: the mix has
            # a floor there, which the report names with what lifts it (its hint): more
            # micro-batches, or larger groups at M.
            _scale_case(f"{label}, at the hint's micro-batches", inputs, R, lift)
            # (Caps as `balancer pack` keeps them: larger groups' pick broke a Dist bound here, a
            # later candidate the pipeline's check packs met every bound.)
            _scale_case(f"{label}, at the hint's group size", inputs, R, M, target_group_size=size, checked=True)


def _lifting(metrics, M):
    """``(micro-batches, group size)``: the fewest micro-batches that let every step hold each
    sparse module, and the group size that does at M (the report's hint); ``(M, None)`` when
    every step can already."""
    from balancer_cli.report.markdown import floor_group_size, sparse_floors

    floors = sparse_floors(metrics["modules"], M)
    if not floors:
        return M, None
    size = metrics["groups"]["mean_size"]
    return max(lift for _, _, lift in floors), max(floor_group_size(size, share, M) for _, share, _ in floors)


def _scale_case(label, inputs, R, M, target_group_size=None, checked=False):
    """One case of :func:`scale` at R x M (and the search's target group size): the table and the
    warm timing; returns ours' metrics. ``checked``: the caps `balancer pack` keeps (the search's
    pick, or a later candidate where the pick breaks a bound: ``pipeline.pack_inputs``), not the
    pick; its CPU time is the pipeline's."""
    from balancer_cli.pack.config import PackConfig
    from balancer_cli.pack.evaluate import evaluate_rows
    from balancer_cli.pack.pipeline import pack_inputs, place_packer, resolve_thresholds
    from balancer_cli.report.markdown import contract_lines

    config = PackConfig(world_size=R, micro_batches=M, target_group_size=target_group_size)
    t = time.process_time()
    if checked:
        params = pack_inputs(inputs, config, lengths_fingerprint="").meta["params"]
        caps_K, bounds_K = (np.array([params[key][m] for m in inputs.modules]) for key in ("caps", "bounds"))
        record = params["search"].get("checked") or {}
        broke = ", ".join(record.get("pick_broken", [])) or "no bound"
        how = (f"caps `balancer pack` keeps (the search's pick broke {broke}; "
               f"{'the pick' if record.get('kept', 'pick') == 'pick' else 'a later candidate'} kept)")
    else:
        caps_K, bounds_K, _ = resolve_thresholds(inputs, config)
        how = "searched caps"
    t_search = time.process_time() - t
    aim = "" if target_group_size is None else f", target group size {target_group_size}"
    print(f"\n## scale: {label}, world_size={R}, micro_batches={M}{aim}, {how} "
          f"{dict(zip(inputs.modules, caps_K.tolist()))} ({t_search:.2f} s CPU)")
    print("| packing | " + " | ".join(f"{m} dist" for m in inputs.modules) + " | "
          + " | ".join(f"{m} util" for m in inputs.modules) + " | steps (vs bound) | mix vs random | CPU s (x ISF) |")
    print("|" + "---|" * (4 + 2 * len(inputs.modules)))
    results = []
    for name in ("balanced", "isf", "random", "dataloader", "llm-ffd"):
        t = time.process_time()
        rows, dropped, reasons, steps = place_packer(name, inputs, config, caps_K, bounds_K)
        dt = time.process_time() - t + (t_search if name == "balanced" else 0.0)
        m = evaluate_rows(inputs, rows, dropped, reasons, caps_K=caps_K, world_size=R, micro_batches=M,
                          epoch_num_steps=steps).metrics
        results.append((name, m, dt))
    t_isf = next(dt for name, _, dt in results if name == "isf")
    for name, m, dt in results:
        dists = " | ".join(f"{m['modules'][mod]['dist_ratio']:.4f}" for mod in inputs.modules)
        dists += " | " + " | ".join(f"{m['modules'][mod]['utilization']:.3f}" for mod in inputs.modules)
        print(f"| {'ours' if name == 'balanced' else name} | {dists} | {m['steps']['total']} "
              f"({m['steps']['vs_lower_bound']:.2f}x) | {m['step_mix']['vs_random']:.2f}x | "
              f"{dt:.2f} ({dt / t_isf:.2f}x) |")
    # The table's CPU includes numba's first calls; the 1.2M target (2 s on one core) is
    # warm. Timed pinned to one core (the refinement then runs its blocks on one thread, as on a
    # one-core machine: the same groups), and with every core this process may use, whose CPU time
    # adds the second thread's overhead (~0.1 s at 1.2M).
    # (Not for caps the check kept: the warm runs time the search's pick.)
    one = _one_core()
    timings = [] if checked else ([("on one core", one)] if one else []) + [("on all usable cores", None)]
    for where, cores in timings:
        with _pinned(cores):
            total, t_search, t_isf = _warm(inputs, config)
        target = ""
        if cores is not None and inputs.num_samples == 1_200_000:
            target = f"; the issue's target, <= 2 s: {'met' if total <= 2.0 else 'NOT met'}"
        print(f"\nwarm, best of 3, {where}: ours search {t_search:.2f} + pack {total - t_search:.2f} = "
              f"{total:.2f} s CPU, ISF {t_isf:.2f} s ({total / t_isf:.2f}x){target}")
    ours = results[0][1]
    missed = contract_lines({**ours, "manifest": {"micro_batches": M, "params": {"searched": True}}})
    print("ours: " + ("\n".join(missed) if missed else "within every bound of the contract (Dist, sparse "
                      f"utilization, steps {ours['steps']['vs_lower_bound']:.4f}x the bound, mix)"))
    return ours


def _warm(inputs, config, rounds=3):
    """``(search + pack, search, ISF)``: the best CPU seconds of ``rounds`` warm runs."""
    from balancer_cli.pack.pipeline import place_packer, resolve_thresholds

    warm, warm_isf = [], []
    for _ in range(rounds):
        t = time.process_time()
        caps_K, bounds_K, _ = resolve_thresholds(inputs, config)
        t_search = time.process_time() - t
        place_packer("balanced", inputs, config, caps_K, bounds_K)
        warm.append((time.process_time() - t, t_search))
        t = time.process_time()
        place_packer("isf", inputs, config, caps_K, bounds_K)
        warm_isf.append(time.process_time() - t)
    return (*min(warm), min(warm_isf))


def _one_core():
    """One core of this process's affinity (None where the OS has no affinity to set)."""
    return {min(os.sched_getaffinity(0))} if hasattr(os, "sched_setaffinity") else None


@contextlib.contextmanager
def _pinned(cores):
    """Run the block on ``cores`` (None: as it is), the process's affinity restored after."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _cli_run(args):
    """``balancer pack ARGS`` in a child process: (CPU s, wall s, peak bytes) of that child alone."""
    import subprocess
    import sys

    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "balancer_cli", "pack", *map(str, args)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"balancer pack {' '.join(map(str, args))} failed ({proc.returncode})")
    return usage.ru_utime + usage.ru_stime, time.perf_counter() - t, usage.ru_maxrss * 1024


def cli():
    """The issue's end-to-end targets through the CLI, each run in a child process of its own:
    1.2M from a Parquet lengths file <= 4 s wall; 10M with ``--memory-gb 1`` <= 20 s CPU and
    <= 1 GB peak; the default baselines costing no more than the packer (10M, the same budget).
    A first run, not timed against a target, compiles the kernels where numba's cache lacks them."""
    import tempfile

    from balancer_cli.lengths import read_lengths, write_lengths

    real = sorted(glob.glob(str(ROOT.parent / "shared" / "data" / "internvl-lengths" / "*.json")))
    lt = read_lengths(real)
    print("\n## cli: `balancer pack L.parquet --dp 64 ...`, resampled real lengths, one child process per run")
    print("| run | CPU s | wall s | peak | target | met |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for n in (1_200_000, 10_000_000):
            files[n] = Path(tmp) / f"l{n}.parquet"
            pick = np.random.default_rng(0).integers(0, lt.num_samples, n)
            write_lengths(type(lt)(lt.table.take(pick).drop_columns(["sample"])), files[n])  # numbered on read
        # The targets are for compiled kernels in numba's on-disk cache (every run after an install's
        # first, docs/scaling.md): a first run compiles them, in windows and with every baseline.
        cpu, wall, _ = _cli_run([files[1_200_000], "--window-samples", 600_000, "--dp", 64, "-o", Path(tmp) / "warm"])
        print(f"| first run (1.2M in 2 windows, every baseline: kernels compiled or loaded) | {cpu:.1f} | {wall:.1f} "
              f"| | not timed against a target | |")
        runs = {
            "1.2M": ([files[1_200_000], "--baselines", "none"], lambda cpu, wall, peak: (wall <= 4, "<= 4 s wall")),
            "10M": ([files[10_000_000], "--memory-gb", 1, "--baselines", "none"],
                    lambda cpu, wall, peak: (cpu <= 20 and peak <= 1e9, "<= 20 s CPU, <= 1 GB")),
            "10M, default baselines": ([files[10_000_000], "--memory-gb", 1], None),
        }
        measured = {}
        for label, (args, target) in runs.items():
            out = Path(tmp) / f"out{len(measured)}"
            measured[label] = cpu, wall, peak = _cli_run([*args, "--dp", 64, "-o", out])
            met, text = target(cpu, wall, peak) if target else (None, "")
            print(f"| {label} | {cpu:.1f} | {wall:.1f} | {peak / 2**30:.2f} GiB ({peak / 1e9:.2f} GB) | {text} | "
                  f"{'' if met is None else ('yes' if met else 'no')} |")
    packer = measured["10M"][0]
    extra = measured["10M, default baselines"][0] - packer
    print(f"\nthe four default baselines cost {extra:.1f} s CPU against the packer's {packer:.1f} s: "
          f"{extra / packer:.2f}x (target <= 1.0x: {'yes' if extra <= packer else 'no'})")


if __name__ == "__main__":
    main()
