"""The vision-rule presets: one released model configuration per name, with overridable parameters.

``get_rule("qwen2-vl")`` returns a frozen rule (:class:`~balancer_cli.scan.rules.base.VisionRule`)
whose ``count_image(width, height)`` / ``count_video(...)`` give the
:class:`~balancer_cli.scan.rules.base.MediaCount` the released processor produces for that size
(encoder patches, items, LLM placeholder tokens, per-item sequence lengths), computed from the
size alone. Parameters can be overridden by keyword (``get_rule("internvl", max_tiles=6)``) or read
from a local ``preprocessor_config.json`` (:func:`rule_from_processor_config`). The families'
rules and their processor-config readers live in :mod:`~balancer_cli.scan.rules.qwen`,
:mod:`~balancer_cli.scan.rules.llava` and :mod:`~balancer_cli.scan.rules.tiles`.

Example:
    >>> get_rule("qwen2-vl").count_image(1920, 1080).llm_tokens
    2691
    >>> get_rule("internvl", max_num=6).count_image(1920, 1080).items   # 2 x 1 tiles + thumbnail
    3
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from balancer_cli.errors import InputError, UsageError
from balancer_cli.scan.rules.base import VisionRule
from balancer_cli.scan.rules.gemma3 import Gemma3Rule, gemma3_processor_params
from balancer_cli.scan.rules.glm4v import Glm4vRule, glm4v_processor_params
from balancer_cli.scan.rules.hf import HF_PREFIX, hf_rule
from balancer_cli.scan.rules.llava import (
    LlavaNextRule,
    LlavaOnevisionRule,
    LlavaRule,
    llava_processor_params,
    parse_pinpoints,
)
from balancer_cli.scan.rules.omni import OmniRule, omni_processor_params
from balancer_cli.scan.rules.pixtral import PixtralRule, pixtral_processor_params
from balancer_cli.scan.rules.qwen import SAMPLERS, QwenVLRule, qwen_processor_params
from balancer_cli.scan.rules.qwen3 import Qwen3VLRule, qwen3_processor_params
from balancer_cli.scan.rules.tiles import (
    Idefics3Rule,
    InternVLRule,
    idefics3_processor_params,
    internvl_processor_params,
)

__all__ = ["PRESETS", "get_rule", "rule_from_processor_config"]

#: preset name -> factory of the released configuration.
PRESETS: dict[str, Callable[..., VisionRule]] = {
    "qwen2-vl": lambda **kw: QwenVLRule(name="qwen2-vl", **kw),
    "qwen2.5-vl": lambda **kw: QwenVLRule(name="qwen2.5-vl", **kw),
    "internvl": lambda **kw: InternVLRule(name="internvl", **kw),
    "llava-1.5": lambda **kw: LlavaRule(name="llava-1.5", **kw),
    "llava-next": lambda **kw: LlavaNextRule(name="llava-next", **kw),
    "llava-onevision": lambda **kw: LlavaOnevisionRule(name="llava-onevision", **kw),
    "idefics3": lambda **kw: Idefics3Rule(name="idefics3", **kw),
    "smolvlm": lambda **kw: Idefics3Rule(**{
        "name": "smolvlm", "image_size": 512, "longest_edge": 2048, "patch_size": 16,
        "scale_factor": 4, "video": True, **kw}),
    "qwen3-vl": lambda **kw: Qwen3VLRule(name="qwen3-vl", **kw),
    "gemma3": lambda **kw: Gemma3Rule(name="gemma3", **kw),
    "glm-4.1v": lambda **kw: Glm4vRule(name="glm-4.1v", **kw),
    "pixtral": lambda **kw: PixtralRule(name="pixtral", **kw),
    "mistral3": lambda **kw: PixtralRule(**{"name": "mistral3", "patch_size": 14, "longest_edge": 1540,
                                           "spatial_merge_size": 2, **kw}),
    "qwen2.5-omni": lambda **kw: OmniRule(name="qwen2.5-omni", **kw),
    "qwen3-omni": lambda **kw: OmniRule(**{
        "name": "qwen3-omni", "patch_size": 16, "video_min_pixels": 128 * 32 * 32,
        "video_max_pixels": 768 * 32 * 32, "audio_rule": "qwen3-omni", "n_window": 50, **kw}),
}

#: Other spellings of preset names.
_PRESET_ALIASES = {"glm4v": "glm-4.1v", "glm-4.5v": "glm-4.1v", "mistral-3": "mistral3", "gemma-3": "gemma3",
                   "qwen2_5-omni": "qwen2.5-omni"}

# Parameter names used by the various processors / training configs -> our field names.
_ALIASES = {
    "max_num": "max_tiles", "max_dynamic_patch": "max_tiles", "max_patches": "max_tiles",
    "min_num": "min_tiles", "min_dynamic_patch": "min_tiles", "min_patches": "min_tiles",
    "force_image_size": "image_size", "num_segments": "video_frames", "num_frames": "video_frames",
    "temporal_patch": "temporal_patch_size", "image_grid_pinpoints": "pinpoints",
    "max_image_size": "image_size", "tile_size": "image_size", "image_seq_len": "tokens_per_tile",
}

#: Fields whose override is converted first (a JSON list of pairs -> the rule's tuple of pairs).
_CONVERTERS: dict[str, Callable[[Any], Any]] = {"pinpoints": parse_pinpoints,
                                                 "crop_text_tokens": lambda v: tuple(int(x) for x in v)}


def _fields(rule: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(rule) if f.name != "name"]


def _preset_key(name: str) -> str:
    """The :data:`PRESETS` key of ``name`` (case-insensitive); raises UsageError for an unknown preset."""
    key = name.strip().lower()
    key = _PRESET_ALIASES.get(key, key)
    if key not in PRESETS:
        raise UsageError(f"unknown vision preset {name!r}", fix=f"use one of: {', '.join(PRESETS)}")
    return key


def get_rule(name: str, **overrides: Any) -> VisionRule:
    """The rule of preset ``name`` with some parameters overridden.

    Args:
        name: one of :data:`PRESETS` (case-insensitive).
        **overrides: rule fields (``min_pixels``, ``max_pixels``, ``max_tiles``, ``image_size``,
            ``patch_size``, ``merge_size``, ``fps``, ...) or their processor aliases
            (``max_num``, ``max_dynamic_patch``, ``max_patches``, ``num_segments``, ...).

    ``name`` may also be ``hf:DIR``, a local transformers folder counted by its own processor
    classes (:func:`~balancer_cli.scan.rules.hf.hf_rule`; ``overrides`` go to the processors).

    Raises:
        UsageError: unknown preset or parameter, or a value of the wrong type.

    Example:
        >>> get_rule("qwen2.5-vl", max_pixels=1003520).count_image(1920, 1080).llm_tokens
        1222
    """
    if name.startswith(HF_PREFIX):
        rule = hf_rule(name[len(HF_PREFIX):], **overrides)
        fast = rule_from_processor_config(rule.fast_preset, rule.path)
        if rule.counted_by == "preset" and overrides:  # the preset counts: the overrides are its parameters
            fast = get_rule(rule.fast_preset, **{**{f: getattr(fast, f) for f in _fields(fast)}, **overrides})
        tokenizer = Path(rule.path) / "tokenizer.json"
        text_fields = {f: str(tokenizer) for f in ("timestamp_tokenizer", "text_tokenizer") if f in _fields(fast)}
        if text_fields and tokenizer.is_file():  # the preset counts processor text with the folder's tokenizer
            fast = dataclasses.replace(fast, **text_fields)
        return dataclasses.replace(rule, fast=fast)
    key = _preset_key(name)
    default = PRESETS[key]()
    known = _fields(default)
    kwargs: dict[str, Any] = {}
    for raw, value in overrides.items():
        field = _ALIASES.get(raw, raw)
        if field not in known:
            raise UsageError(f"vision preset {key!r} has no parameter {raw!r}",
                             fix=f"use one of: {', '.join(known)}")
        expected = type(getattr(default, field))
        if field in _CONVERTERS:
            value = _CONVERTERS[field](value)
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise UsageError(f"vision preset {key!r}: {raw}={value!r} must be of type {expected.__name__}",
                             fix=f"give {'an' if expected is int else 'a'} {expected.__name__}, e.g. "
                                 f"--param {raw}={getattr(default, field)}")
        kwargs[field] = value
    rule = dataclasses.replace(default, **kwargs)
    _check_values(key, rule)
    return rule


_MAY_BE_ZERO = {"split_newline_extra", "max_crops", "max_video_tokens", "tokens_per_tile", "newline_tokens",
                "nb_max_frames"}
_ORDERED = (("min_pixels", "max_pixels"), ("video_min_pixels", "video_max_pixels"),
            ("min_tiles", "max_tiles"), ("min_frames", "max_frames"))


def _check_values(key: str, rule: Any) -> None:
    """Reject values that would make a rule divide by zero or produce nonsense counts."""
    for f in dataclasses.fields(rule):
        value = getattr(rule, f.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        lowest = 0 if f.name in _MAY_BE_ZERO else (1 if isinstance(value, int) else 1e-9)
        if value < lowest:
            raise UsageError(f"vision preset {key!r}: {f.name}={value} must be >= {lowest:g}",
                             fix=f"give {f.name} a value of at least {lowest:g}, or leave it to the preset")
    sampler = getattr(rule, "frame_sampler", None)
    if sampler is not None and sampler not in SAMPLERS:
        raise UsageError(f"vision preset {key!r}: frame_sampler={sampler!r} is not one of {', '.join(SAMPLERS)}",
                         fix=f"use one of: {', '.join(SAMPLERS)}")
    for low, high in _ORDERED:
        if hasattr(rule, low) and getattr(rule, low) > getattr(rule, high):
            raise UsageError(f"vision preset {key!r}: {low}={getattr(rule, low)} exceeds "
                             f"{high}={getattr(rule, high)}", fix=f"give {low} <= {high}")


def _only(keys: tuple[str, ...], reader: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    def read(cfg: dict[str, Any], video: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in reader(cfg, video).items() if k in keys}
    return read


#: preset name -> the rule parameters of a processor config (each keeps only the fields its rule has).
_CONFIG_READERS: dict[str, Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]] = {
    "qwen2-vl": qwen_processor_params, "qwen2.5-vl": qwen_processor_params, "internvl": internvl_processor_params,
    "llava-1.5": _only(("image_size", "patch_size"), llava_processor_params),
    "llava-next": _only(("image_size", "patch_size", "pinpoints", "max_crops"), llava_processor_params),
    "llava-onevision": llava_processor_params,
    "idefics3": _only(("image_size", "longest_edge", "do_image_splitting", "patch_size", "scale_factor",
                       "tokens_per_tile"), idefics3_processor_params),
    "smolvlm": idefics3_processor_params,
    "qwen3-vl": qwen3_processor_params, "gemma3": gemma3_processor_params, "glm-4.1v": glm4v_processor_params,
    "pixtral": pixtral_processor_params, "mistral3": pixtral_processor_params,
    "qwen2.5-omni": omni_processor_params, "qwen3-omni": omni_processor_params,
}


_CONFIG_FIX = "pass the model's preprocessor_config.json (or its folder)"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: cannot read processor config ({exc})", fix=_CONFIG_FIX) from exc
    if not isinstance(data, dict):
        raise InputError(f"{path}: processor config is not a JSON object (it holds a {type(data).__name__})",
                         fix=_CONFIG_FIX)
    return data


def rule_from_processor_config(name: str, path: str | Path) -> VisionRule:
    """The preset ``name`` with the parameters of a local processor config.

    ``path`` is a ``preprocessor_config.json`` (or InternVL's ``config.json``) or a model folder; in
    a folder ``preprocessor_config.json``, ``processor_config.json`` and ``config.json`` are merged
    (first wins; a transformers 5 ``processor_config.json``'s nested ``image_processor`` /
    ``video_processor`` sections count as those files) and ``video_preprocessor_config.json``
    supplies the video parameters. Keys a rule
    does not use (``image_mean``, ...) are ignored. Nothing is downloaded.

    Example:
        >>> import json, tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "preprocessor_config.json"
        >>> _ = p.write_text(json.dumps({"min_pixels": 3136, "max_pixels": 1003520}))
        >>> rule_from_processor_config("qwen2-vl", p).max_pixels
        1003520
    """
    key = _preset_key(name)
    path = Path(path)
    cfg: dict[str, Any] = {}
    video: dict[str, Any] = {}
    if path.is_dir():
        names = ("preprocessor_config.json", "processor_config.json", "config.json")
        found = [path / n for n in names if (path / n).is_file()]
        if not found:
            raise InputError(f"{path}: no preprocessor_config.json, processor_config.json or config.json",
                             fix="pass the folder of a downloaded model or the config file itself")
        for file in reversed(found):
            data = _read_json(file)
            # transformers 5 nests the sub-processors' configs in processor_config.json
            nested = data.get("image_processor") if file.name == "processor_config.json" else None
            cfg.update({**data, **nested} if isinstance(nested, dict) else data)
            if file.name == "processor_config.json" and isinstance(data.get("video_processor"), dict):
                video = data["video_processor"]
        if (path / "video_preprocessor_config.json").is_file():
            video = _read_json(path / "video_preprocessor_config.json")
    elif path.is_file():
        cfg = _read_json(path)
    else:
        raise InputError(f"{path}: processor config not found", fix="check the path: a model folder or its "
                         "preprocessor_config.json")
    return get_rule(key, **_CONFIG_READERS[key](cfg, video))
