"""Benchmark: per-phase post-balancing vs one-assignment-for-all-phases balancers.

Steps are drawn from the real InternVL token lengths (``../shared/data/internvl-lengths``): each
step is R ranks x n samples in random arrival order. Three phases per sample:

- vision: InternViT-like, each 448 px tile is its own 1025-token sequence, cost per tile
  ``1025 + 1025**2 / (6 * 1024)`` (linear + attention term, hidden 1024);
- audio (synthetic): half the samples carry a clip of lognormal duration (median 8 s, cut at
  30 s chunks), 50 tokens/s, cost ``T + T**2 / (6 * 1280)`` per chunk;
- llm: ``len + len**2 / (6 * 4096)``.

Compared, on the same steps: the arrival order (before); verl's equal-size Karmarkar-Karp on LLM
lengths (R bins of equal count); VeOmni-style LPT on sum of squared LLM lengths; plain LPT per
phase with a keep-in-place (Hungarian) matching; and ``plan_post_balance`` (flat, and with 8 ranks
per node). Balancers that produce one assignment move whole samples (raw pixels + mel + text);
per-phase plans move encoder inputs to the phase rank and encoder outputs back.

Then the planning time per step at ``--timing-ranks`` (default 1024) x 16 samples x 3 modules:
CPU ms on one core (median of ``--timing-steps``, default 5), for each post-balance variant, and
the ratio of a plain baseline timed in the same process (LPT per encoder phase with heapq, alone
and with the Hungarian keep-in-place matching) to the flat plan's time.

Usage: ``python bench/bench_post_balance.py [--ranks 64] [--per-rank 16] [--steps 20]
[--timing-ranks 1024] [--timing-steps 5] [--json OUT]``
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from pathlib import Path

import numpy as np
from scipy.optimize import linear_sum_assignment

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from balancer_cli.lengths import read_lengths  # noqa: E402
from balancer_cli.replay.post_balance import phase_loads, plan_post_balance  # noqa: E402

MODULES = ("vision", "audio", "llm")
TILE_TOKENS = 1025
# bytes per unit moved (bf16): pixels per tile, ViT output per tile (256 tokens x 4096),
# mel per audio token (128 bins x 2 frames), audio output per token (4096), text id per token
BYTES = {"vision_in": 3 * 448 * 448 * 2, "vision_out": 256 * 4096 * 2,
         "audio_in": 128 * 2 * 2, "audio_out": 4096 * 2, "text": 4}


def synth_audio_tokens(num: int, rng: np.random.Generator) -> np.ndarray:
    has = rng.random(num) < 0.5
    seconds = np.minimum(rng.lognormal(np.log(8.0), 0.9, num), 120.0)
    return np.where(has, np.round(seconds * 50), 0).astype(np.int64)


def costs_of(tiles, audio_tokens, llm_tokens):
    vision = tiles * (TILE_TOKENS + TILE_TOKENS ** 2 / (6 * 1024))
    full, rest = np.divmod(audio_tokens, 1500)
    audio = full * (1500 + 1500 ** 2 / (6 * 1280)) + rest + rest ** 2 / (6 * 1280)
    llm = llm_tokens + llm_tokens ** 2 / (6 * 4096)
    return np.column_stack([vision, audio, llm]).astype(np.float64)


def sample_bytes(tiles, audio_tokens, llm_tokens):
    """Per sample: (enc_in, enc_out) bytes per encoder, and whole-sample raw bytes."""
    v_in, v_out = tiles * BYTES["vision_in"], tiles * BYTES["vision_out"]
    a_in, a_out = audio_tokens * BYTES["audio_in"], audio_tokens * BYTES["audio_out"]
    raw = v_in + a_in + llm_tokens * BYTES["text"]
    return np.stack([v_in, a_in]), np.stack([v_out, a_out]), llm_tokens * BYTES["text"], raw


# ---- baselines --------------------------------------------------------------------------------

def lpt(cost_n, num_bins):
    heap = [(0.0, b) for b in range(num_bins)]
    bins = np.empty(len(cost_n), np.int64)
    for i in np.argsort(-cost_n, kind="stable"):
        load, b = heapq.heappop(heap)
        bins[i] = b
        heapq.heappush(heap, (load + float(cost_n[i]), b))
    return bins


def karmarkar_karp_equal_size(cost_n, k):
    """verl's equal-size KK: states of k singleton sets, merged largest spread first."""
    order = np.argsort(cost_n, kind="stable")
    heap, counter = [], 0
    for offset in range(0, len(order), k):
        chunk = order[offset: offset + k]
        sets = [[int(i)] for i in chunk] + [[] for _ in range(k - len(chunk))]
        sums = np.array([cost_n[s].sum() if s else 0.0 for s in sets])
        heapq.heappush(heap, (-(sums.max() - sums.min()), counter, sums, sets))
        counter += 1
    while len(heap) > 1:
        _, _, s0, sets0 = heapq.heappop(heap)
        _, _, s1, sets1 = heapq.heappop(heap)
        o0, o1 = np.argsort(-s0, kind="stable"), np.argsort(s1, kind="stable")  # largest with smallest
        sums = s0[o0] + s1[o1]
        sets = [sets0[a] + sets1[b] for a, b in zip(o0, o1)]
        heapq.heappush(heap, (-(sums.max() - sums.min()), counter, sums, sets))
        counter += 1
    bins = np.empty(len(cost_n), np.int64)
    for b, members in enumerate(heap[0][3]):
        bins[members] = b
    return bins


def keep_in_place(bins, home, num_ranks):
    """Hungarian maximum-overlap matching of bins to ranks."""
    weight = np.zeros((num_ranks, num_ranks))
    np.add.at(weight, (bins, home), 1.0)
    rows, cols = linear_sum_assignment(weight, maximize=True)
    rank_of_bin = np.empty(num_ranks, np.int64)
    rank_of_bin[rows] = cols
    return rank_of_bin[bins]


# ---- one step ---------------------------------------------------------------------------------

def evaluate(dest_KN, cost_NK, home, sizes, num_ranks, per_phase):
    """max/mean and max/LB per phase; samples and bytes moved."""
    out = {}
    total_max = 0.0
    for m, name in enumerate(MODULES):
        load = phase_loads(cost_NK[:, m], dest_KN[m], num_ranks)
        lb = max(cost_NK[:, m].sum() / num_ranks, cost_NK[:, m].max())
        out[name] = {"max_over_mean": load.max() / load.mean(), "max_over_lb": load.max() / lb}
        total_max += load.max()
    out["step_time"] = total_max
    in_bytes, out_bytes, text_bytes, raw_bytes = sizes
    if per_phase:
        # encoder inputs: data rank -> phase rank; outputs: phase rank -> LLM-phase rank
        moved = (dest_KN != home[None, :]).any(axis=0)
        out["moved"] = int(moved.sum())
        out["bytes"] = float(((dest_KN[:2] != home[None, :]) * in_bytes).sum()
                             + ((dest_KN[:2] != dest_KN[2][None, :]) * out_bytes).sum()
                             + ((dest_KN[2] != home) * text_bytes).sum())
    else:
        moved = dest_KN[2] != home
        out["moved"] = int(moved.sum())
        out["bytes"] = float((moved * raw_bytes).sum())
    return out


def run_step(rng, lengths, num_ranks, per_rank):
    n = num_ranks * per_rank
    pick = rng.choice(len(lengths["tiles"]), n, replace=False)
    tiles, llm = lengths["tiles"][pick], lengths["llm"][pick]
    audio = synth_audio_tokens(n, rng)
    llm_total = llm + audio // 2  # audio placeholders in the LLM sequence (2x pooled)
    cost_NK = costs_of(tiles, audio, llm_total)
    sizes = sample_bytes(tiles, audio, llm_total)
    home = np.repeat(np.arange(num_ranks), per_rank)
    results, times = {}, {}

    def single(bins):  # one assignment for every phase
        return np.tile(keep_in_place(bins, home, num_ranks), (3, 1))

    results["before"] = evaluate(np.tile(home, (3, 1)), cost_NK, home, sizes, num_ranks, False)
    results["verl KK (equal size, LLM len)"] = evaluate(
        single(karmarkar_karp_equal_size(llm_total.astype(float), num_ranks)), cost_NK, home, sizes, num_ranks, False)
    results["VeOmni LPT (sum len^2)"] = evaluate(
        single(lpt(llm_total.astype(float) ** 2, num_ranks)), cost_NK, home, sizes, num_ranks, False)
    t, cpu = time.perf_counter(), time.process_time()
    lpt_bins = [lpt(cost_NK[:, m], num_ranks) for m in range(2)]  # the two encoder phases
    times["lpt"] = time.perf_counter() - t
    times["lpt cpu"] = time.process_time() - cpu
    t, cpu = time.perf_counter(), time.process_time()
    lpt_dest = np.stack([keep_in_place(bins, home, num_ranks) for bins in lpt_bins] + [home])
    times["lpt + hungarian"] = times["lpt"] + time.perf_counter() - t
    times["lpt + hungarian cpu"] = times["lpt cpu"] + time.process_time() - cpu
    results["LPT per phase + keep-in-place"] = evaluate(lpt_dest, cost_NK, home, sizes, num_ranks, True)
    costs_by_rank = list(cost_NK.reshape(num_ranks, per_rank, 3))
    for label, rpn, llm, tol in (("post-balance (flat)", None, False, 0.0), ("post-balance (8/node)", 8, False, 0.0),
                                 ("post-balance (8/node, 5% tolerance)", 8, False, 0.05),
                                 ("post-balance (8/node, +LLM)", 8, True, 0.0)):
        t, cpu = time.perf_counter(), time.process_time()
        plan = plan_post_balance(costs_by_rank, rpn, modules=MODULES, balance_llm=llm, move_tolerance=tol)
        times[label] = time.perf_counter() - t
        times[label + " cpu"] = time.process_time() - cpu
        results[label] = evaluate(plan.dest_KN, cost_NK, home, sizes, num_ranks, True)
        if rpn:
            results[label]["moved_cross_node"] = int((plan.dest_KN // rpn != home // rpn).any(axis=0).sum())
    return results, times


def summarize(all_results):
    methods = list(all_results[0])
    table = {}
    for method in methods:
        rows = [r[method] for r in all_results]
        entry = {}
        for name in MODULES:
            for key in ("max_over_mean", "max_over_lb"):
                entry[f"{name}_{key}"] = float(np.mean([r[name][key] for r in rows]))
        entry["moved"] = float(np.mean([r["moved"] for r in rows]))
        entry["bytes_mb"] = float(np.mean([r["bytes"] for r in rows])) / 2 ** 20
        entry["step_time"] = float(np.mean([r["step_time"] for r in rows]))
        if "moved_cross_node" in rows[0]:
            entry["moved_cross_node"] = float(np.mean([r["moved_cross_node"] for r in rows]))
        table[method] = entry
    base = table["before"]["step_time"]
    for entry in table.values():
        entry["step_speedup"] = base / entry["step_time"]
    return table


def render(table, num_ranks, per_rank, steps):
    lines = [f"R={num_ranks} ranks x {per_rank} samples, {steps} steps (means over steps); per phase max/mean "
             "(max/lower bound)",
             "", "| method | vision | audio | llm | step speedup | samples moved | MB moved |",
             "|---|---|---|---|---|---|---|"]
    for method, e in table.items():
        moved = f"{e['moved']:.0f}" + (f" ({e['moved_cross_node']:.0f} cross-node)" if "moved_cross_node" in e else "")
        phases = " | ".join(f"{e[f'{m}_max_over_mean']:.3f} ({e[f'{m}_max_over_lb']:.3f})" for m in MODULES)
        lines.append(f"| {method} | {phases} | {e['step_speedup']:.3f}x | {moved} | {e['bytes_mb']:.0f} |")
    return "\n".join(lines)


def render_timing(med, num_ranks, steps):
    """Planning time per step (CPU ms, one core) and each baseline's ratio to the flat plan."""
    ours = med["post-balance (flat) cpu"]
    lines = [(f"planning time per step, {num_ranks} ranks x 16 samples x 3 modules (median of {steps} steps, "
              "CPU ms on one core, same process):")]
    for label in ("flat", "8/node", "8/node, 5% tolerance", "8/node, +LLM"):
        name = f"post-balance ({label})"
        wall = f"  ({med[name]:.2f} ms wall)" if name in med else ""
        lines.append(f"  {name:54s} {med[name + ' cpu']:7.2f} ms{wall}")
    for key, label in (("lpt cpu", "plain LPT per encoder phase (heapq)"),
                       ("lpt + hungarian cpu", "plain LPT + Hungarian keep-in-place (scipy)")):
        lines.append(f"  baseline: {label:44s} {med[key]:7.2f} ms = {med[key] / ours:.2f}x the flat plan's time")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--per-rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timing-ranks", type=int, default=1024)
    parser.add_argument("--timing-steps", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    files = sorted((ROOT.parent / "shared" / "data" / "internvl-lengths").glob("*.json"))
    table_lt = read_lengths(files)
    lengths = {"tiles": table_lt.items("vision"), "llm": table_lt.llm_tokens()}
    rng = np.random.default_rng(args.seed)
    plan_post_balance([np.ones((2, 3))] * 2)  # compile / load the cached kernels outside timings
    all_results = [run_step(rng, lengths, args.ranks, args.per_rank)[0] for _ in range(args.steps)]
    table = summarize(all_results)
    print(render(table, args.ranks, args.per_rank, args.steps))
    checks = {
        "within_10pct_of_lb": all(r["post-balance (flat)"][m]["max_over_lb"] <= 1.10
                                  for r in all_results for m in ("vision", "audio")),
        "never_worse_than_lpt": all(r["post-balance (flat)"][m]["max_over_lb"]
                                    <= r["LPT per phase + keep-in-place"][m]["max_over_lb"] + 1e-12
                                    for r in all_results for m in ("vision", "audio")),
        "moves_le_lpt_keep_in_place": all(r["post-balance (flat)"]["moved"] <= r["LPT per phase + keep-in-place"]["moved"]
                                          for r in all_results),
    }
    # planning time at scale: R ranks x 16 samples x 3 modules, vs plain LPT per phase in the same process
    timing = {key: [] for key in ("lpt cpu", "lpt + hungarian cpu", "post-balance (flat)", "post-balance (flat) cpu",
                                  "post-balance (8/node) cpu", "post-balance (8/node, 5% tolerance) cpu",
                                  "post-balance (8/node, +LLM) cpu")}
    big = []
    for _ in range(args.timing_steps):
        results, times = run_step(rng, lengths, args.timing_ranks, 16)
        big.append(results)
        for key in timing:
            timing[key].append(times[key])
    med = {key: float(np.median(v)) * 1e3 for key, v in timing.items()}
    print()
    print(render_timing(med, args.timing_ranks, args.timing_steps))
    big_table = summarize(big)
    print()
    print(render(big_table, args.timing_ranks, 16, 5))
    checks["planning_under_10ms"] = med["post-balance (flat) cpu"] <= 10.0
    checks["within_10pct_of_lb_1024"] = all(r["post-balance (flat)"][m]["max_over_lb"] <= 1.10
                                            for r in big for m in ("vision", "audio"))
    print("\nchecks:", json.dumps(checks))
    if args.json:
        args.json.write_text(json.dumps({"table": table, "table_large": big_table, "planning_ms": med, "checks": checks}, indent=2))


if __name__ == "__main__":
    main()
