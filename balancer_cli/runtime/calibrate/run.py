"""``balancer calibrate``: time each module of a model on group shapes from the lengths, fit its cost.

For each module (``vision``, ``llm``, ...): draw fit and held-out shapes from the lengths table
(:mod:`balancer_cli.cost.calibration`), build the module with random weights and ``layers``
layers, time forward + backward of every shape, fit ``a*sum(l^2) + b*sum(l) + c*count + d`` by
non-negative least squares on the fit shapes (:mod:`balancer_cli.cost.fit`) and judge it, and the
FLOPs and token proxies scaled to their best constant, on the held-out shapes only.

With ``layers`` below the model's ``L`` (a 72B model on one GPU), a second copy with 0 layers
times what is not a layer (embeddings, LM head, patch embedding, merger), and every time is
``t0 + (L / layers) * (t_layers - t0)``. The same two copies give ``per_layer_seconds`` (at the
held-out group of median size) for ``plan-partition --profile``.

Example (CPU, a tiny config; see tests/runtime/test_calibrate.py):
    >>> from balancer_cli.runtime.calibrate import calibrate  # doctest: +SKIP
    >>> costs = calibrate("tiny-qwen2-vl/", read_lengths("lengths.parquet"))  # doctest: +SKIP
    >>> costs.module("llm").extra("r2_heldout") > 0.95  # doctest: +SKIP
    True
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers  # a hard requirement of calibration: missing, the command says so before any work

from balancer_cli import __version__
from balancer_cli._fsutil import file_fingerprint
from balancer_cli.cost.calibration import (
    GridSpec,
    Shape,
    default_limits,
    group_proxies,
    memory_cap,
    plan_shapes,
    sequence_lengths,
)
from balancer_cli.cost.fit import (
    FEATURES,
    fit_quality,
    group_features,
    nnls_fit,
    scale_fit,
)
from balancer_cli.cost.measured import MeasuredCosts, ModuleFit
from balancer_cli.cost.samples import CostModel
from balancer_cli.errors import BalancerError, InputError, UsageError
from balancer_cli.lengths import LLM, LengthsTable
from balancer_cli.runtime.calibrate.families import (
    ATTENTIONS,
    Family,
    Runner,
    family_for,
)
from balancer_cli.runtime.calibrate.measure import Measurement, device_name, measure

__all__ = ["DTYPES", "Measure", "calibrate", "calibrate_to_file", "flops_model_files", "load_config"]

#: ``--dtype`` name -> torch dtype.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: ``(runner, shapes, on_run) -> [Measurement]``: how shapes are timed (replaceable, e.g. in tests);
#: ``on_run()`` after each run moves the progress bar.
Measure = Callable[[Runner, Sequence[Shape], Callable[[], Any]], list[Measurement]]


def load_config(config_dir: str | os.PathLike):
    """The transformers config of a local folder (``config.json``), never from the network.

    Raises:
        InputError: no folder, no config.json, or one transformers cannot read.
    """
    from transformers import AutoConfig

    path = Path(config_dir)
    if not (path / "config.json").is_file():
        raise InputError(f"{path}: no config.json there",
                         fix="pass a folder holding a transformers config.json (a checkpoint folder without weights works)")
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{path / 'config.json'}: transformers cannot read it ({str(exc).splitlines()[0]})",
                         fix="check model_type and the fields of config.json") from None


def _fit_module(family: Family, config, module: str, shapes: tuple[tuple[Shape, ...], tuple[Shape, ...]], *,
                layers: int | None, device: str, dtype: torch.dtype, attention: str, measure_fn: Measure,
                tick: Callable[[], Any], budget_bytes: float | None = None) -> ModuleFit:
    fit_shapes, held_shapes = shapes
    full = family.num_layers(config, module)
    n = full if layers is None else max(1, min(layers, full))
    try:
        runner = family.build(config, module, n, torch.device(device), dtype, attention)
        runner0 = family.build(config, module, 0, torch.device(device), dtype, attention)
    except (ImportError, ValueError, TypeError, KeyError, AttributeError, RuntimeError) as exc:
        where = Path(getattr(config, "_name_or_path", "") or ".") / "config.json"
        raise InputError(f"{where}: transformers cannot build the {module} module of {config.model_type!r} "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
                         fix="check the config's fields, or --attention (flash_attention_2 needs the flash-attn package)"
                         ) from None

    # Fit and held-out shapes are timed in the same rounds: a change in the machine's load during
    # the calibration then shifts both alike instead of biasing the judgement of the fit.
    shapes_all = fit_shapes + held_shapes
    try:
        ms = measure_fn(runner, shapes_all, tick)
    except torch.cuda.OutOfMemoryError:
        raise BalancerError(f"the {module} module ran out of GPU memory on the largest calibration groups "
                            f"({max(sum(s) for s in shapes_all):,} tokens)",
                            fix="lower --max-llm-tokens / --max-vision-items, --layers, or use bfloat16") from None
    t_all = np.array([m.seconds for m in ms])
    t0_all = np.array([m.seconds for m in measure_fn(runner0, shapes_all, tick)]) if n < full else np.zeros(len(shapes_all))
    if n < full:
        t_all = t0_all + (full / n) * (t_all - t0_all)
    peaks = [m.peak_bytes for m in ms]
    split = len(fit_shapes)
    t_fit, t_held, t0_held = t_all[:split], t_all[split:], t0_all[split:]
    peaks_fit, peaks_held = peaks[:split], peaks[split:]
    f_fit = np.stack([group_features(s) for s in fit_shapes])
    f_held = np.stack([group_features(s) for s in held_shapes])
    coeffs = nnls_fit(f_fit, t_fit)
    r2, worst = fit_quality(f_held @ coeffs, t_held)
    extras: dict[str, Any] = {"r2_heldout": r2, "max_rel_err_heldout": worst}
    proxy_model = _proxy_model(family, config, module)
    fit_proxies, held_proxies = group_proxies(proxy_model, module, fit_shapes), group_proxies(proxy_model, module, held_shapes)
    for proxy in ("flops", "tokens"):
        k = scale_fit(fit_proxies[proxy], t_fit)
        extras[f"{proxy}_r2_heldout"], extras[f"{proxy}_max_rel_err_heldout"] = fit_quality(k * held_proxies[proxy], t_held)
    # Per-layer seconds at the held-out group of median size: (t_layers - t_0) / layers each.
    typical = int(np.argsort([sum(s) for s in held_shapes])[len(held_shapes) // 2])
    base = t0_held[typical] if n < full else measure_fn(runner0, [held_shapes[typical]], tick)[0].seconds
    layer = max(float(t_held[typical] - base) / full, 0.0)
    extras.update(per_layer_seconds=[layer] * full, other_seconds=float(base), num_layers=full,
                  shapes={"fit": len(fit_shapes), "heldout": len(held_shapes), "layers_timed": n,
                          "typical_group": list(held_shapes[typical])})
    if all(p is not None for p in peaks_fit + peaks_held):
        extras["memory"] = _memory_fit(f_fit, np.array(peaks_fit, float), f_held, np.array(peaks_held, float))
        if budget_bytes is not None:
            lengths_seen = [l for shape in fit_shapes + held_shapes for l in shape]
            coeffs_mem = np.array([extras["memory"]["coeffs"][f] for f in FEATURES])
            extras["memory"]["cap"] = memory_cap(coeffs_mem, budget_bytes, module, shortest=min(lengths_seen),
                                                 longest=max(lengths_seen))
            extras["memory"]["cap_unit"] = "tokens" if module == LLM else "items"
    fit = ModuleFit(**{name: float(c) for name, c in zip(FEATURES, coeffs)},
                    extras=tuple((k, extras[k]) for k in sorted(extras)))
    return fit


def _memory_fit(f_fit: np.ndarray, b_fit: np.ndarray, f_held: np.ndarray, b_held: np.ndarray) -> dict[str, Any]:
    """Peak bytes per shape, fitted like the time (weights, gradients and workspace fall in ``constant``)."""
    coeffs = nnls_fit(f_fit, b_fit)
    r2, worst = fit_quality(f_held @ coeffs, b_held)
    return {"coeffs": {name: float(c) for name, c in zip(FEATURES, coeffs)}, "unit": "bytes",
            "r2_heldout": r2, "max_rel_err_heldout": worst}


def _proxy_model(family: Family, config, module: str) -> CostModel:
    llm = family.model_config(config, LLM) if LLM in family.modules else None
    if module == LLM:
        return CostModel(llm=llm)
    return CostModel(llm=llm, encoders=((module, family.model_config(config, module)),))


def calibrate(config_dir: str | os.PathLike, lengths: LengthsTable, *, modules: Sequence[str] | None = None,
              layers: int | None = None, device: str = "cpu", dtype: str = "float32", attention: str = "sdpa",
              seed: int = 0, limits: Mapping[str, Mapping[str, int]] | None = None, num_lengths: int = 6,
              num_heldout: int = 16, warmup: int = 1, repeats: int = 3, measure_fn: Measure | None = None,
              gpu_memory_gb: float | None = None, margin: float = 0.1, progress: bool = False) -> MeasuredCosts:
    """Calibrate the modules of the model in ``config_dir`` on shapes drawn from ``lengths``.

    Args:
        config_dir: a folder with a transformers ``config.json`` (no weights needed).
        lengths: the lengths table the calibration's shapes are drawn from.
        modules: modules to calibrate (default: every module the model and the table share).
        layers: layers built per module (default: all); fewer extrapolate to the full depth.
        device, dtype, attention: ``cpu``/``cuda[:i]``, a name of :data:`DTYPES`, one of
            :data:`~balancer_cli.runtime.calibrate.families.ATTENTIONS`.
        seed: seeds the held-out draw and the weights.
        limits: per module ``{"max_total": tokens}`` (LLM) or ``{"max_count": items}`` (encoders):
            the largest group timed (default: 8 median samples, at least the 99th percentile).
        num_lengths, num_heldout: shape grid sizes; warmup, repeats: untimed runs per shape, then
            timed rounds over all shapes (each shape keeps its median).
        measure_fn: how a shape is timed (default: :func:`~balancer_cli.runtime.calibrate.measure.measure`).
        gpu_memory_gb, margin: with peak memory measured (GPU), each module's ``memory.cap``: the
            largest cap (LLM tokens, encoder items) whose groups fit ``(1 - margin) x gpu_memory_gb``
            GB (1e9 bytes) under the fitted memory.
        progress: show a progress bar (stderr).

    Raises:
        InputError: an unreadable config folder. UsageError: a bad option, a module the model or
        the table does not have.
    """
    if attention not in ATTENTIONS:
        raise UsageError(f"unknown {{attention}} {attention!r}", fix=f"use one of: {', '.join(ATTENTIONS)}")
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}", fix=f"use one of: {', '.join(DTYPES)}")
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise UsageError(f"unknown device {device!r}", fix="use --device cpu, cuda or cuda:<index>") from None
    if attention == "flash_attention_2" and kind != "cuda" and measure_fn is None:
        raise UsageError("{attention} flash_attention_2 runs on CUDA devices only", fix="add --device cuda, or use sdpa")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {device!r} is not available (torch {torch.__version__} sees no GPU)", fix="use --device cpu")
    if gpu_memory_gb is not None and not (gpu_memory_gb > 0 and 0 <= margin < 1):
        raise UsageError(f"gpu_memory_gb must be > 0 and margin in [0, 1), got {gpu_memory_gb!r} and {margin!r}")
    if gpu_memory_gb is not None and measure_fn is None and kind != "cuda":
        raise UsageError("{gpu_memory_gb} needs a GPU: peak memory is measured on CUDA devices only",
                         fix="add --device cuda, or leave --gpu-memory-gb out")
    budget = None if gpu_memory_gb is None else (1.0 - margin) * gpu_memory_gb * 1e9
    config = load_config(config_dir)
    family = family_for(config)
    available = [m for m in family.modules if m == LLM or m in lengths.modules]
    chosen = list(modules) if modules else available
    for m in chosen:
        if m not in family.modules:
            raise UsageError(f"the {family.name} model has no module {m!r}", fix=f"choose from: {', '.join(family.modules)}")
        if m != LLM and m not in lengths.modules:
            raise UsageError(f"the lengths table has no module {m!r}", fix=f"choose from: {', '.join(available)}")
    torch.manual_seed(seed)
    timer = measure_fn or (lambda run, shapes, on_run: measure(run, shapes, device=device, warmup=warmup,
                                                               repeats=repeats, on_run=on_run))
    specs, shapes = {}, {}
    for m in chosen:
        seq = sequence_lengths(lengths, m)
        items = None if m == LLM else np.asarray(lengths.items(m))[lengths.ok_mask()]
        limit = dict(limits.get(m, {})) if limits else {}
        specs[m] = GridSpec(**(limit or default_limits(seq, m, items)), num_lengths=num_lengths,
                            num_heldout=num_heldout, quantum=family.quantum(m), seed=seed)
        shapes[m] = plan_shapes(seq, specs[m])
    total = 0
    for m, (fit, held) in shapes.items():
        # below full depth a 0-layer copy runs every shape too; at full depth it runs the typical group only
        scaled = layers is not None and layers < family.num_layers(config, m)
        total += ((len(fit) + len(held)) * 2 if scaled else len(fit) + len(held) + 1) * (warmup + max(repeats, 1))
    from tqdm.auto import tqdm

    fits = []
    with tqdm(total=total, desc="calibrate", unit="run", disable=not progress) as bar:
        for m in sorted(chosen, key=lambda name: name == LLM):
            fit = _fit_module(family, config, m, shapes[m], layers=layers, device=device, dtype=DTYPES[dtype],
                              attention=attention, measure_fn=timer, tick=lambda: bar.update(), budget_bytes=budget)
            fits.append((m, fit))
    return MeasuredCosts(
        modules=tuple(fits), device=device_name(device), dtype=dtype, attention=attention,
        versions=(("balancer_cli", __version__), ("torch", torch.__version__), ("transformers", transformers.__version__)),
        config_fingerprint=file_fingerprint(Path(config_dir) / "config.json"),
        settings=(("model_type", config.model_type), ("seed", seed), ("layers", layers),
                  ("limits", {m: {k: v for k, v in (("max_total", s.max_total), ("max_count", s.max_count)) if v}
                              for m, s in specs.items()})))


def flops_model_files(config_dir: str | os.PathLike, folder: str | os.PathLike) -> dict[str, str]:
    """Write the shapes of each module of the model in ``config_dir`` as model files (JSON) for
    ``--cost-model flops`` into ``folder``: ``{module: path}``. This is how the FLOPs proxy of the
    same model is packed with, to compare it with a calibration.
    """
    import dataclasses
    import json

    config = load_config(config_dir)
    family = family_for(config)
    files = {}
    for module in family.modules:
        fields = dataclasses.asdict(family.model_config(config, module))
        fields.pop("name"), fields.pop("source")
        path = Path(folder) / f"{module}_model.json"
        path.write_text(json.dumps(fields, sort_keys=True))
        files[module] = str(path)
    return files


def calibrate_to_file(config_dir: str | os.PathLike, lengths_files: Sequence[str | os.PathLike],
                      out: str | os.PathLike, **options: Any) -> dict[str, Any]:
    """Read the lengths, :func:`calibrate`, write ``out`` (costs.json) atomically; the summary.

    Raises:
        UsageError: ``out`` is one of the inputs. Everything :func:`calibrate` raises.
    """
    import json

    from balancer_cli._fsutil import atomic_path
    from balancer_cli.lengths import read_lengths

    target = Path(out).resolve()
    inputs = [Path(p).resolve() for p in lengths_files] + [(Path(config_dir) / "config.json").resolve()]
    if target in inputs:
        raise UsageError(f"{{out}} {out} is one of the inputs", fix="write the costs to a new file, e.g. -o costs.json")
    if target.exists() and not target.is_file():
        raise UsageError(f"{{out}} {out} exists and is not a regular file", fix="pass a file path for -o")
    costs = calibrate(config_dir, read_lengths([str(p) for p in lengths_files]), **options)
    doc = costs.to_json()
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return {"out": str(out), **doc}
