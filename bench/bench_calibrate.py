"""Measured-time balance of token, FLOPs and measured (calibrated) costs, on the real model.

Calibrates a model (default: a tiny Qwen2-VL-style config written here, random weights), packs the
same lengths three times with the same caps (``--cost-model tokens``, ``flops`` with the model's own
shapes, ``measured`` with the calibration), then replays the first ``--steps`` steps of each
manifest on the model, timing every rank's groups, and prints each packing's Dist Ratio of
*measured time* per module and for the whole step (modules one after another). Lower is better;
the packing that balances what the hardware really spends wins.

Usage (from the repository root):
    python -m bench.bench_calibrate                      # InternVL lengths, tiny model, CPU
    python -m bench.bench_calibrate --config qwen2-vl-7b/ --layers 2 --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from balancer_cli.metrics import dist_ratio_per_step

LENGTHS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "internvl-lengths"

#: The tiny Qwen2-VL-style config of the CPU run (2 ViT layers of width 64, 2 LLM layers of width 96).
TINY = dict(vision_config=dict(depth=2, embed_dim=64, num_heads=4, hidden_size=96, mlp_ratio=4, patch_size=14,
                               spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
            text_config=dict(num_hidden_layers=2, hidden_size=96, intermediate_size=256, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512, bos_token_id=1, eos_token_id=2,
                             max_position_embeddings=32768,
                             rope_scaling={"type": "mrope", "mrope_section": [4, 4, 4]}))


def write_tiny_config(folder: Path) -> Path:
    """Write the tiny Qwen2-VL config.json into ``folder``."""
    from transformers import Qwen2VLConfig

    Qwen2VLConfig(**TINY).save_pretrained(str(folder))
    return folder


def _stderr(values: np.ndarray) -> float:
    """Standard error of the mean (0 for a single value)."""
    return float(values.std(ddof=1) / np.sqrt(len(values))) if len(values) > 1 else 0.0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("lengths", nargs="*", help="lengths files (default: the four InternVL sources)")
    ap.add_argument("--config", default=None, help="model config folder (default: the tiny Qwen2-VL config)")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32, help="steps of each manifest replayed on the model")
    ap.add_argument("--replay-modules", default="llm",
                    help="modules timed in the replay (default llm: on the InternVL lengths every item is 256 patches, "
                         "so tokens, FLOPs and measured vision costs are proportional and balance vision alike)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--attention", default="sdpa")
    ap.add_argument("--repeats", type=int, default=8, help="timed rounds (each group keeps its median)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from balancer_cli.lengths import read_lengths
    from balancer_cli.pack.config import PackConfig
    from balancer_cli.run import pack_to_dir, report_dir
    from balancer_cli.runtime.calibrate import (
        calibrate_to_file,
        flops_model_files,
        replay_times,
    )

    work = Path(tempfile.mkdtemp(prefix="bench_calibrate_"))
    config_dir = Path(args.config) if args.config else write_tiny_config(work / "model")
    files = args.lengths or sorted(str(p) for p in LENGTHS.glob("*_token_lengths.json"))
    lengths = read_lengths(files)
    common = dict(world_size=args.dp, seed=args.seed)
    begin = time.perf_counter()
    tokens = pack_to_dir(files, work / "tokens", PackConfig(**common), baselines=())
    caps = tuple(sorted(tokens["manifest"]["params"]["caps"].items()))
    print(f"{lengths.num_samples:,} samples, dp {args.dp}, caps {dict(caps)} (searched with token costs)")
    costs = work / "costs.json"
    options = dict(layers=args.layers, device=args.device, dtype=args.dtype, attention=args.attention,
                   seed=args.seed, repeats=args.repeats,
                   limits={m: {"max_total" if m == "llm" else "max_count": int(c)} for m, c in caps})
    calibration = calibrate_to_file(config_dir, files, costs, **options)
    print(f"calibrated in {time.perf_counter() - begin:.0f} s on {calibration['device']}:")
    for module, entry in calibration["modules"].items():
        print(f"  {module:<7} held-out R^2 measured {entry['r2_heldout']:.3f} (max err {entry['max_rel_err_heldout']:.1%}), "
              f"FLOPs {entry['flops_r2_heldout']:.3f}, tokens {entry['tokens_r2_heldout']:.3f}")
    models = flops_model_files(config_dir, work)
    flops = pack_to_dir(files, work / "flops", PackConfig(**common, caps=caps, cost_model="flops",
                                                          cost_presets=tuple(sorted(models.items()))), baselines=())
    measured = pack_to_dir(files, work / "measured", PackConfig(**common, caps=caps, cost_model="measured", costs=costs),
                           baselines=())
    modules = [m.strip() for m in args.replay_modules.split(",") if m.strip()]
    print(f"\nmeasured-time Dist Ratio of the first {args.steps} steps ({args.dp} ranks, {', '.join(modules)}; "
          f"lower is better), mean over steps +- standard error:")
    packings = {"tokens": tokens, "flops": flops, "measured": measured}
    begin = time.perf_counter()
    # All three manifests are timed in the same rounds: a slow spell of the machine hits them alike.
    replays = replay_times(config_dir, [s["out"] for s in packings.values()], lengths, steps=args.steps,
                           modules=modules, layers=args.layers, device=args.device, dtype=args.dtype,
                           attention=args.attention, repeats=args.repeats)
    per_step = {name: dist_ratio_per_step(sum(np.array(t["seconds"][m]) for m in modules))
                for name, t in zip(packings, replays)}
    print(f"  {'packed with':<12} {'measured time':>16} {'vs measured (paired)':>22} {'predicted (fitted s)':>21}")
    for name, summary in packings.items():
        d = per_step[name]
        diff = d - per_step["measured"]
        predicted = report_dir(summary["out"], baselines=(), cost={"cost_model": "measured", "costs": costs})
        fitted = np.mean([predicted["modules"][m]["dist_ratio"] for m in modules])
        paired = "" if name == "measured" else f"{diff.mean():+.4f} +- {_stderr(diff):.4f}"
        print(f"  {name:<12} {d.mean():>8.4f} +- {_stderr(d):.4f} {paired:>22} {fitted:>21.4f}")
    print(f"(replayed in {time.perf_counter() - begin:.0f} s; the fitted column is the same Dist Ratio in the "
          f"calibration's seconds, free of timing noise)")
    print(f"\n(work folder {work})")


if __name__ == "__main__":
    main()
