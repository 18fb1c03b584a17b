"""Shared options and input reading of ``plan-partition`` and ``plan-recompute``.

The workload the planners evaluate comes from, in order of preference:

1. ``--manifest DIR`` (+ ``--lengths FILE``): the packed groups of the manifest's first epoch;
   the typical group is their mean, the heaviest is checked group by group;
2. ``--lengths FILE`` alone: consecutive samples grouped up to ``--group-llm-tokens``;
3. neither: one group of ``--group-llm-tokens`` LLM tokens (one sequence) and
   ``--group-vision-items`` items (of ``--group-vision-tokens`` tokens each for native-resolution
   encoders).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import numpy as np

from balancer_cli.cost.samples import CostModel
from balancer_cli.errors import InputError, ManifestError, UsageError
from balancer_cli.lengths import read_lengths
from balancer_cli.planners.chain import Layer, build_chain, explicit_features, features_at, group_features, sequential_groups

__all__ = ["model_options", "workload_options", "build_model", "load_workload", "load_profile"]

DEFAULT_GROUP_LLM_TOKENS = 4096


def model_options(fn):
    """--vision/--audio/--llm/--stages/--attention/--tp."""
    options = [
        click.option("--vision", "--vision-model", "vision", metavar="PRESET|FILE", help="Vision encoder preset or YAML/JSON model file."),
        click.option("--audio", "--audio-model", "audio", metavar="PRESET|FILE", help="Audio encoder preset or model file."),
        click.option("--llm", "--llm-model", "llm", metavar="PRESET|FILE", required=True, help="LLM preset or YAML/JSON model file."),
        click.option("--stages", "stages", type=click.IntRange(min=1), required=True, help="Pipeline stages P."),
        click.option("--attention", type=click.Choice(["flash", "eager"]), default="flash", show_default=True,
                     help="Attention kernel (eager stores the s x s scores; flash does not)."),
        click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Tensor-parallel size (with sequence parallelism): per-GPU FLOPs and memory."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def workload_options(fn):
    """--lengths/--manifest/--group-*."""
    options = [
        click.option("--lengths", "lengths", multiple=True, type=click.Path(dir_okay=False),
                     help="Lengths table(s) (Parquet or OmniBal JSON); repeat for several."),
        click.option("--manifest", "manifest", type=click.Path(file_okay=False),
                     help="Manifest directory from `balancer pack`: plan for its groups (needs --lengths)."),
        click.option("--group-llm-tokens", type=click.IntRange(min=1), default=None,
                     help=f"LLM tokens per group without a manifest (default {DEFAULT_GROUP_LLM_TOKENS})."),
        click.option("--group-vision-items", type=click.IntRange(min=0), default=None,
                     help="Vision items (tiles/images) per group, without data."),
        click.option("--group-vision-tokens", type=click.IntRange(min=1), default=None,
                     help="Encoder tokens per vision item, for native-resolution encoders without data."),
        click.option("--group-audio-items", type=click.IntRange(min=0), default=None,
                     help="Audio clips per group, without data."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def build_model(vision: str | None, audio: str | None, llm: str, attention: str, tp: int) -> CostModel:
    return CostModel.build(llm, {"vision": vision, "audio": audio}, attention=attention, tp=tp)


def build_model_chain(vision: str | None, audio: str | None, llm: str, attention: str, tp: int,
                      stages: int) -> tuple[CostModel, list[Layer]]:
    """The cost model and its layer chain, checking that ``stages`` fits the chain's length."""
    model = build_model(vision, audio, llm, attention, tp)
    chain = build_chain(model)
    if stages > len(chain):
        raise UsageError(f"--stages {stages} exceeds the {len(chain)} layers of the chain", fix="use fewer stages")
    return model, chain


def load_workload(model: CostModel, lengths: tuple[str, ...], manifest: str | None, group_llm_tokens: int | None,
                  group_vision_items: int | None, group_vision_tokens: int | None,
                  group_audio_items: int | None) -> tuple[dict[str, float], dict[str, np.ndarray], dict[str, Any]]:
    """``(typical features, per-group features, description)`` for the planners."""
    if manifest and not lengths:
        raise UsageError("--manifest needs the lengths table it was packed from",
                         fix="add --lengths FILE (the file given to `balancer pack`)")
    if lengths:
        table = read_lengths(list(lengths))
        if manifest:
            groups, info = _manifest_groups(Path(manifest), table)
        else:
            cap = group_llm_tokens or DEFAULT_GROUP_LLM_TOKENS
            groups = sequential_groups(table.llm_tokens(), table.ok_mask(), cap)
            info = {"source": "lengths", "group_llm_tokens": cap}
        per_group = group_features(model, table, groups)
        info["num_groups"] = int(len(next(iter(per_group.values()))))
        if info["num_groups"] == 0:
            raise InputError(f"{', '.join(lengths)}: no measured sample to plan for", fix="check the lengths table")
        return features_at(per_group, "mean"), per_group, info
    encoders = dict(model.encoders)
    items = {"vision": group_vision_items, "audio": group_audio_items}
    for module in encoders:
        if items.get(module) is None:
            raise UsageError(f"no data and no --group-{module}-items for the {module} encoder",
                             fix=f"pass --manifest/--lengths, or --group-{module}-items N")
    try:
        feats = explicit_features(model, group_llm_tokens or DEFAULT_GROUP_LLM_TOKENS,
                                  {m: int(items[m] or 0) for m in encoders},
                                  {"vision": group_vision_tokens} if group_vision_tokens else None)
    except ValueError as exc:
        raise UsageError(str(exc), fix="pass --group-vision-tokens N (encoder tokens per item) or a lengths table") from None
    info = {"source": "explicit", "num_groups": 1}
    return feats, {k: np.array([v]) for k, v in feats.items()}, info


def _manifest_groups(path: Path, table) -> tuple[np.ndarray, dict[str, Any]]:
    from balancer_cli.manifest import open_manifest

    manifest = open_manifest(path)
    expected = manifest.meta.get("lengths_fingerprint")
    if expected and expected != table.fingerprint:
        raise ManifestError(f"{path}: packed from a lengths table with fingerprint {expected}, "
                            f"but --lengths has {table.fingerprint}", fix="pass the lengths file given to `balancer pack`")
    first_epoch = manifest.epoch_num_steps[0] if manifest.epoch_num_steps else manifest.num_steps
    rows = manifest.read_steps(0, first_epoch)
    if len(rows) == 0:
        raise ManifestError(f"{path}: the manifest places no sample", fix="re-run `balancer pack`")
    if int(np.max(rows.sample)) >= table.num_samples:
        raise ManifestError(f"{path}: sample {int(np.max(rows.sample))} is beyond the {table.num_samples} samples of --lengths",
                            fix="pass the lengths file given to `balancer pack`")
    key = (np.asarray(rows.step, np.int64) << 42) | (np.asarray(rows.rank, np.int64) << 21) | np.asarray(rows.micro, np.int64)
    _, group_of_row = np.unique(key, return_inverse=True)
    groups = np.full(table.num_samples, -1, dtype=np.int64)
    groups[np.asarray(rows.sample, dtype=np.int64)] = group_of_row
    return groups, {"source": "manifest", "manifest": str(path), "steps": int(first_epoch)}


def load_profile(path: str, chain: list[Layer]) -> np.ndarray:
    """Measured per-layer times: a JSON list (chain order) or an object mapping layer names
    (``llm.layer.3``) or kinds (``llm.layer``: every LLM layer) to seconds."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: cannot read profile JSON ({exc})", fix="pass a JSON list or {layer: seconds}") from None
    names = [layer.name for layer in chain]
    if isinstance(data, list):
        if len(data) != len(chain):
            raise InputError(f"{path}: {len(data)} times for {len(chain)} layers",
                             fix=f"give one time per layer, in order: {names[0]} .. {names[-1]}")
        values = data
    elif isinstance(data, dict):
        known = set(names) | {f"{layer.module}.{layer.kind}" for layer in chain}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InputError(f"{path}: unknown layer {unknown[0]!r}", fix=f"use names like {names[1]!r} or kinds like 'llm.layer'")
        values = []
        for layer in chain:
            value = data.get(layer.name, data.get(f"{layer.module}.{layer.kind}"))
            if value is None:
                raise InputError(f"{path}: no time for layer {layer.name!r}",
                                 fix=f"add '{layer.name}' or '{layer.module}.{layer.kind}'")
            values.append(value)
    else:
        raise InputError(f"{path}: expected a JSON list or object", fix="pass a JSON list or {layer: seconds}")
    try:
        times = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise InputError(f"{path}: times must be numbers", fix="write seconds as numbers") from None
    if (times < 0).any() or not np.isfinite(times).all():
        raise InputError(f"{path}: times must be finite and >= 0", fix="check the profile")
    return times
