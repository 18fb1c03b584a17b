"""What the planners evaluate: the model and its layer chain, the groups of the data, measured layer times.

The workload comes from, in order of preference (:class:`WorkloadSpec`):

1. ``manifest`` (+ ``lengths``): the packed groups of the manifest's first epoch; the typical
   group is their mean, the heaviest is checked group by group;
2. ``lengths`` alone: consecutive samples grouped up to ``group_llm_tokens``;
3. neither: one group of ``group_llm_tokens`` LLM tokens (one sequence) and
   ``group_vision_items`` items (of ``group_vision_tokens`` tokens each for native-resolution
   encoders).

Example:
    >>> model, chain = build_model_chain(llm="llama3-8b", stages=2)
    >>> workload = load_workload(model, WorkloadSpec(group_llm_tokens=2048))
    >>> workload.typical["llm.tokens"], workload.source
    (2048.0, {'source': 'explicit', 'num_groups': 1})
    >>> workload.describe()
    'typical group (one group given by options): llm 2,048 tokens'
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from balancer_cli.cost.presets import ModelConfig
from balancer_cli.cost.samples import CostModel
from balancer_cli.errors import InputError, ManifestError, UsageError, check_int
from balancer_cli.lengths import LLM, LengthsTable, read_lengths
from balancer_cli.manifest import open_manifest
from balancer_cli.planners.chain import (
    Layer,
    build_chain,
    explicit_features,
    group_features,
    mean_features,
    sequential_groups,
)
from balancer_cli.replay.integrity import check_manifest

__all__ = ["DEFAULT_GROUP_LLM_TOKENS", "WorkloadSpec", "Workload", "build_model", "build_model_chain",
           "load_workload", "manifest_groups", "load_profile"]

#: LLM tokens per group when no manifest gives the groups.
DEFAULT_GROUP_LLM_TOKENS = 4096

#: Fields of :class:`WorkloadSpec` that count something, and their least value.
_COUNTS = {"group_llm_tokens": 1, "group_vision_items": 0, "group_vision_tokens": 1, "group_audio_items": 0}


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkloadSpec:
    """Where the planners' groups come from (see the module docstring for the order).

    Attributes:
        lengths: lengths tables (Parquet or OmniBal JSON), in the order ``balancer pack`` read them.
        manifest: a manifest directory packed from ``lengths``: plan for its groups.
        group_llm_tokens: LLM tokens per group without a manifest (default
            :data:`DEFAULT_GROUP_LLM_TOKENS`).
        group_vision_items, group_audio_items: encoder items per group, without data.
        group_vision_tokens: encoder tokens per vision item, for native-resolution encoders
            without data.

    Raises:
        UsageError: a count that is not an integer, or below its least value.

    Example:
        >>> WorkloadSpec(lengths="lengths.parquet").lengths
        ('lengths.parquet',)
        >>> WorkloadSpec(group_llm_tokens=0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        balancer_cli.errors.UsageError: group_llm_tokens must be an integer >= 1, not 0; fix: give ...
    """

    lengths: Sequence[str | os.PathLike] | str | os.PathLike = ()
    manifest: str | os.PathLike | None = None
    group_llm_tokens: int | None = None
    group_vision_items: int | None = None
    group_vision_tokens: int | None = None
    group_audio_items: int | None = None

    def __post_init__(self) -> None:
        paths = [self.lengths] if isinstance(self.lengths, (str, os.PathLike)) else self.lengths
        object.__setattr__(self, "lengths", tuple(str(p) for p in paths))
        for name, least in _COUNTS.items():
            value = getattr(self, name)
            if value is not None:
                check_int(name, value, least=least, fix=f"give {{{name}}} >= {least}, or leave it out")


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """The groups the planners evaluate.

    Attributes:
        typical: features of the typical (mean) group: stage times are planned for it.
        per_group: ``{feature: (G,) float64}`` of every group: memory must fit the heaviest.
        source: how the groups were formed (``source``: ``manifest``, ``lengths`` or
            ``explicit``; ``num_groups``; and the manifest path, step count or group size).
    """

    typical: dict[str, float]
    per_group: dict[str, np.ndarray]
    source: dict[str, Any]

    def describe(self) -> str:
        """One line naming the typical group and where it comes from.

        Example:
            >>> Workload(typical={"llm.tokens": 3507.4, "llm.sumsq": 1e7}, per_group={},
            ...          source={"source": "lengths", "num_groups": 12, "group_llm_tokens": 4096}).describe()
            'typical group (mean of 12 groups of consecutive samples up to 4096 LLM tokens): llm 3,507 tokens'
        """
        parts = [f"{k.split('.')[0]} {v:,.0f} tokens" for k, v in self.typical.items() if k.endswith(".tokens")]
        info = self.source
        where = {"manifest": f"mean of {info.get('num_groups')} groups of {info.get('manifest')}",
                 "lengths": f"mean of {info.get('num_groups')} groups of consecutive samples up to "
                            f"{info.get('group_llm_tokens')} LLM tokens",
                 "explicit": "one group given by options"}[info["source"]]
        return f"typical group ({where}): " + ", ".join(parts)


def build_model(*, llm: str | ModelConfig, vision: str | ModelConfig | None = None,
                audio: str | ModelConfig | None = None, attention: str = "flash", tp: int = 1) -> CostModel:
    """The cost model of an MLLM from its presets or model files (encoders left out when ``None``).

    Raises:
        UsageError: an unknown preset, a model of the wrong kind, bad attention or tp.
        InputError: an unreadable or invalid model file.

    Example:
        >>> [m for m, _ in build_model(llm="qwen2-7b", vision="qwen2-vl-vit").encoders]
        ['vision']
    """
    return CostModel.build(llm, {"vision": vision, "audio": audio}, attention=attention, tp=tp)


def build_model_chain(*, llm: str | ModelConfig, vision: str | ModelConfig | None = None,
                      audio: str | ModelConfig | None = None, attention: str = "flash", tp: int = 1,
                      stages: int) -> tuple[CostModel, list[Layer]]:
    """The cost model and its layer chain, checking that ``stages`` fits the chain's length.

    Raises:
        UsageError: as :func:`build_model`, or more stages than layers.

    Example:
        >>> model, chain = build_model_chain(llm="llama3-8b", stages=4)
        >>> len(chain)
        34
        >>> build_model_chain(llm="llama3-8b", stages=99)
        Traceback (most recent call last):
        ...
        balancer_cli.errors.UsageError: stages 99 exceeds the 34 layers of the chain; fix: use fewer stages
    """
    model = build_model(llm=llm, vision=vision, audio=audio, attention=attention, tp=tp)
    chain = build_chain(model)
    if stages > len(chain):
        raise UsageError(f"{{stages}} {stages} exceeds the {len(chain)} layers of the chain", fix="use fewer stages")
    return model, chain


def load_workload(model: CostModel, spec: WorkloadSpec) -> Workload:
    """The groups of ``spec``, with ``model``'s features.

    Raises:
        UsageError: a manifest without its lengths table, or no data and no group sizes for an encoder.
        InputError: unreadable lengths tables, or no measured sample in them.
        ManifestError: an unreadable manifest, or one packed from other lengths.

    Example:
        >>> model = build_model(llm="qwen2-7b", vision="internvit-300m")
        >>> load_workload(model, WorkloadSpec(group_vision_items=2)).typical["vision.tokens"]
        2050.0
        >>> load_workload(model, WorkloadSpec())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        balancer_cli.errors.UsageError: no data and no group_vision_items for the vision encoder; fix: pass ...
    """
    # Checked here, not in WorkloadSpec: errors in the models come first, as they always have.
    if spec.manifest and not spec.lengths:
        raise UsageError("{manifest} needs the lengths table it was packed from",
                         fix="add {lengths} FILE (the file given to `balancer pack`)")
    if spec.lengths:
        table = read_lengths(list(spec.lengths))
        if spec.manifest:
            groups, info = manifest_groups(spec.manifest, table)
        else:
            cap = spec.group_llm_tokens or DEFAULT_GROUP_LLM_TOKENS
            groups = sequential_groups(table.llm_tokens(), table.ok_mask(), cap)
            info = {"source": "lengths", "group_llm_tokens": cap}
        per_group = group_features(model, table, groups)
        info["num_groups"] = int(len(next(iter(per_group.values()))))
        if info["num_groups"] == 0:
            raise InputError(f"{', '.join(spec.lengths)}: no measured sample to plan for", fix="check the lengths table")
        return Workload(typical=mean_features(per_group), per_group=per_group, source=info)
    encoders = dict(model.encoders)
    items = {"vision": spec.group_vision_items, "audio": spec.group_audio_items}
    for module in encoders:
        if module not in items:  # a model built in Python with another encoder: only data describes it
            raise UsageError(f"no data for the {module} encoder", fix="pass {manifest}/{lengths}")
        if items[module] is None:
            raise UsageError(f"no data and no {{group_{module}_items}} for the {module} encoder",
                             fix=f"pass {{manifest}}/{{lengths}}, or {{group_{module}_items}} N")
    try:
        feats = explicit_features(model, spec.group_llm_tokens or DEFAULT_GROUP_LLM_TOKENS,
                                  {m: int(items[m] or 0) for m in encoders},
                                  {"vision": spec.group_vision_tokens} if spec.group_vision_tokens else None)
    except ValueError as exc:
        raise UsageError(str(exc), fix="pass {group_vision_tokens} N (encoder tokens per item) or a lengths table") from None
    return Workload(typical=feats, per_group={k: np.array([v]) for k, v in feats.items()},
                    source={"source": "explicit", "num_groups": 1})


def manifest_groups(manifest: str | os.PathLike, table: LengthsTable) -> tuple[np.ndarray, dict[str, Any]]:
    """The group of every sample in the first epoch of ``manifest``: one group per (step, rank, micro).

    Returns:
        ``(group_of_sample, source)``: (N,) int64 group indices in slot order (-1 for samples
        not placed in the first epoch), and the ``source`` entry of :class:`Workload`.

    Raises:
        ManifestError: an unreadable manifest, one packed from other lengths, or one that places
            no sample.

    Example:
        >>> import tempfile
        >>> from balancer_cli.lengths import make_lengths_table
        >>> from balancer_cli.manifest import ManifestRows, write_manifest
        >>> lt = make_lengths_table(np.array([10, 20, 30]))
        >>> rows = ManifestRows(np.array([0, 0, 0]), np.array([0, 0, 1]), np.zeros(3, int), np.array([2, 0, 1]))
        >>> out = write_manifest(tempfile.mkdtemp(), rows, dropped_sample=np.array([], np.int64), dropped_reason=[],
        ...                      meta={"world_size": 2, "micro_batches": 1, "lengths_fingerprint": lt.fingerprint})
        >>> groups, source = manifest_groups(out.parent, lt)
        >>> groups.tolist(), source["steps"]
        ([0, 1, 0], 1)
    """
    path = Path(manifest)
    opened = open_manifest(path)
    opened.check_lengths(table.fingerprint, required=False)
    if "num_samples" in opened.meta:  # conservation, as the sampler checks it (a plan for rows it refuses helps none)
        check_manifest(opened)
    first_epoch = opened.epoch_num_steps[0] if opened.epoch_num_steps else opened.num_steps
    rows = opened.read_steps(0, first_epoch)
    if len(rows) == 0:
        raise ManifestError(f"{path}: the manifest places no sample", fix="re-run `balancer pack`")
    if int(np.max(rows.sample)) >= table.num_samples:
        raise ManifestError(f"{path}: sample {int(np.max(rows.sample))} is beyond the {table.num_samples} samples "
                            "of {lengths}", fix="pass the lengths file given to `balancer pack`")
    _, group_of_row = np.unique(rows.slot_numbers(), return_inverse=True)
    groups = np.full(table.num_samples, -1, dtype=np.int64)
    groups[np.asarray(rows.sample, dtype=np.int64)] = group_of_row
    return groups, {"source": "manifest", "manifest": str(path), "steps": int(first_epoch)}


def _calibration_profile(path: str | os.PathLike, doc: dict, modules: set[str]) -> dict[str, float]:
    """The ``{kind: seconds}`` profile of a costs.json for the chain's ``modules`` (see :func:`load_profile`)."""
    from balancer_cli.cost.measured import MeasuredCosts

    costs = MeasuredCosts.from_json(doc, where=str(path))
    profile: dict[str, float] = {}
    for module, fit in costs.modules:
        if module not in modules:
            continue  # calibrated, but not part of this plan's model
        per_layer = fit.extra("per_layer_seconds")
        if not per_layer:
            raise InputError(f"{path}: module {module!r} has no per_layer_seconds",
                             fix="re-run balancer calibrate (this version records them)")
        other = float(fit.extra("other_seconds", 0.0))
        profile[f"{module}.layer"] = float(np.mean(per_layer))
        if module == LLM:
            profile.update({f"{LLM}.embedding": 0.0, f"{LLM}.head": other})
        else:
            profile.update({f"{module}.stem": 0.0, f"{module}.projector": other})
    return profile


def load_profile(path: str | os.PathLike, chain: Sequence[Layer]) -> np.ndarray:
    """Measured per-layer times: a JSON list (chain order), an object mapping layer names
    (``llm.layer.3``) or kinds (``llm.layer``: every LLM layer) to seconds, or the costs.json of
    ``balancer calibrate`` (its ``per_layer_seconds`` per layer; its ``other_seconds``, what is not
    a layer, on the LLM head and each encoder's projector; 0 on embeddings and stems).

    Raises:
        InputError: an unreadable file, unknown or missing layers, times that are not finite
            numbers >= 0, or no time above 0.

    Example:
        >>> import tempfile
        >>> _, chain = build_model_chain(llm="llama3-8b", stages=2)
        >>> profile = Path(tempfile.mkdtemp()) / "times.json"
        >>> _ = profile.write_text('{"llm.embedding": 0, "llm.layer": 0.01, "llm.head": 0.05}')
        >>> load_profile(profile, chain)[[0, 1, -1]].tolist()
        [0.0, 0.01, 0.05]
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: cannot read profile JSON ({exc})", fix="pass a JSON list or {layer: seconds}") from None
    names = [layer.name for layer in chain]
    if isinstance(data, dict) and "schema_version" in data and "modules" in data:
        data = _calibration_profile(path, data, {layer.module for layer in chain})
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
                kind = f"{layer.module}.{layer.kind}"  # a chain's one embedding is named as its kind
                spellings = f"'{layer.name}'" if kind == layer.name else f"'{layer.name}' or '{kind}'"
                raise InputError(f"{path}: no time for layer {layer.name!r}", fix=f"add {spellings}")
            values.append(value)
    else:
        raise InputError(f"{path}: expected a JSON list or object", fix="pass a JSON list or {layer: seconds}")
    try:
        times = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise InputError(f"{path}: times must be numbers", fix="write seconds as numbers") from None
    if (times < 0).any() or not np.isfinite(times).all():
        raise InputError(f"{path}: times must be finite and >= 0", fix="check the profile")
    # Stages are balanced by their share of the time: with none measured there is nothing to
    # balance (and every stage ratio the plans report would divide by zero).
    if not (times > 0).any():
        raise InputError(f"{path}: every layer's time is 0 (no layer has a positive cost)",
                         fix="give each layer its measured seconds (at least one above 0)")
    return times
