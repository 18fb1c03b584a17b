"""Exact vision-token rules per model family, by preset name.

``get_rule("qwen2-vl")`` returns a frozen rule whose ``count_image(width, height)`` /
``count_video(...)`` give the :class:`MediaCount` the released processor produces for that size
(encoder patches, items, LLM placeholder tokens, per-item sequence lengths), computed from the
size alone. Parameters can be overridden by keyword (``get_rule("internvl", max_tiles=6)``) or read
from a local ``preprocessor_config.json`` (:func:`rule_from_processor_config`).

Example:
    >>> get_rule("qwen2-vl").count_image(1920, 1080).llm_tokens
    2691
    >>> get_rule("internvl", max_num=6).count_image(1920, 1080).items   # 2 x 1 tiles + thumbnail
    3
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

from balancer_cli.errors import InputError, UsageError
from balancer_cli.scan.rules.base import MediaCount, MediaRejected, VisionRule
from balancer_cli.scan.rules.qwen import QwenVLRule, qwen_sampled_frames
from balancer_cli.scan.rules.llava import LlavaNextRule, LlavaOnevisionRule, LlavaRule
from balancer_cli.scan.rules.tiles import Idefics3Rule, InternVLRule

__all__ = [
    "MediaCount",
    "MediaRejected",
    "VisionRule",
    "PRESETS",
    "get_rule",
    "rule_from_processor_config",
    "video_frames",
    "count_images",
]

#: preset name -> factory of the released configuration.
PRESETS: dict[str, Callable[..., Any]] = {
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
}

# Parameter names used by the various processors / training configs -> our field names.
_ALIASES = {
    "max_num": "max_tiles", "max_dynamic_patch": "max_tiles", "max_patches": "max_tiles",
    "min_num": "min_tiles", "min_dynamic_patch": "min_tiles", "min_patches": "min_tiles",
    "force_image_size": "image_size", "num_segments": "video_frames", "num_frames": "video_frames",
    "temporal_patch": "temporal_patch_size", "image_grid_pinpoints": "pinpoints",
    "max_image_size": "image_size", "tile_size": "image_size", "image_seq_len": "tokens_per_tile",
}


def _fields(rule: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(rule) if f.name != "name"]


def get_rule(name: str, **overrides: Any) -> VisionRule:
    """The rule of preset ``name`` with some parameters overridden.

    Args:
        name: one of :data:`PRESETS` (case-insensitive).
        **overrides: rule fields (``min_pixels``, ``max_pixels``, ``max_tiles``, ``image_size``,
            ``patch_size``, ``merge_size``, ``fps``, ...) or their processor aliases
            (``max_num``, ``max_dynamic_patch``, ``max_patches``, ``num_segments``, ...).

    Raises:
        UsageError: unknown preset or parameter, or a value of the wrong type.

    Example:
        >>> get_rule("qwen2.5-vl", max_pixels=1003520).count_image(1920, 1080).llm_tokens
        1222
    """
    key = name.strip().lower()
    if key not in PRESETS:
        raise UsageError(f"unknown vision preset {name!r}",
                         fix=f"use one of: {', '.join(PRESETS)}")
    default = PRESETS[key]()
    known = _fields(default)
    kwargs: dict[str, Any] = {}
    for raw, value in overrides.items():
        field = _ALIASES.get(raw, raw)
        if field not in known:
            raise UsageError(f"vision preset {key!r} has no parameter {raw!r}",
                             fix=f"use one of: {', '.join(known)}")
        expected = type(getattr(default, field))
        if field == "pinpoints":
            value = _pinpoints(value)
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise UsageError(f"vision preset {key!r}: {raw}={value!r} must be of type {expected.__name__}")
        kwargs[field] = value
    rule = dataclasses.replace(default, **kwargs)
    _check_values(key, rule)
    return rule


_MAY_BE_ZERO = {"split_newline_extra", "max_crops", "max_video_tokens", "tokens_per_tile"}
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
            raise UsageError(f"vision preset {key!r}: {f.name}={value} must be >= {lowest:g}")
    for low, high in _ORDERED:
        if hasattr(rule, low) and getattr(rule, low) > getattr(rule, high):
            raise UsageError(f"vision preset {key!r}: {low}={getattr(rule, low)} exceeds "
                             f"{high}={getattr(rule, high)}")


def _pinpoints(value: Any) -> tuple[tuple[int, int], ...]:
    try:
        pairs = tuple((int(h), int(w)) for h, w in value)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"image_grid_pinpoints={value!r} must be a list of [height, width] pairs") from exc
    if not pairs or min(min(p) for p in pairs) < 1:
        raise UsageError(f"image_grid_pinpoints={value!r} must hold positive [height, width] pairs")
    return pairs


def count_images(rule: VisionRule, sizes: list[tuple[int, int]]) -> list[MediaCount]:
    """Counts of all ``(width, height)`` images of ONE sample, in order.

    Use this rather than calling ``count_image`` per image: LLaVA-OneVision processes a sample
    with several images differently (each image one 384 px crop, no anyres), and InternVL with
    ``multi_image_budget=True`` splits its tile budget among the images.

    Example:
        >>> rule = get_rule("llava-onevision")
        >>> [c.llm_tokens for c in count_images(rule, [(640, 480)])]
        [2929]
        >>> [c.llm_tokens for c in count_images(rule, [(640, 480), (640, 480)])]
        [730, 730]
        >>> budget = get_rule("internvl", multi_image_budget=True)   # InternVL's fine-tuning code
        >>> [c.items for c in count_images(budget, [(1920, 1080)] * 3)]   # max_num 12 // 3 = 4
        [3, 3, 3]
    """
    if len(sizes) > 1 and isinstance(rule, LlavaOnevisionRule) and not rule.multi_image:
        rule = dataclasses.replace(rule, multi_image=True)
    if len(sizes) > 1 and isinstance(rule, InternVLRule) and rule.multi_image_budget:
        rule = dataclasses.replace(rule, max_tiles=max(1, rule.max_tiles // len(sizes)))
    return [rule.count_image(w, h) for w, h in sizes]


def video_frames(duration_s: float, fps: float = 2.0, *, total_frames: int = 0, min_frames: int = 4,
                 max_frames: int = 768, frame_factor: int = 2) -> int:
    """Frames sampled at ``fps`` from a ``duration_s`` video (Qwen2-VL / qwen-vl-utils policy).

    At least ``min_frames``, at most ``max_frames`` and the file's ``total_frames`` (0: unknown),
    rounded down to a multiple of ``frame_factor`` (the temporal patch). Families with a fixed frame
    count (InternVL ``num_segments``, LLaVA-OneVision ``num_frames``) ignore the duration.

    Example:
        >>> video_frames(120.0)        # 2 fps
        240
        >>> video_frames(755.0)        # capped
        768
    """
    return qwen_sampled_frames(total_frames, duration_s, fps, min_frames, max_frames, frame_factor)


def _size_edges(size: Any) -> dict[str, Any]:
    return size if isinstance(size, dict) else {}


def _qwen_config(cfg: dict[str, Any], video: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    size = _size_edges(cfg.get("size"))
    for ours, keys in (("min_pixels", ("min_pixels",)), ("max_pixels", ("max_pixels",))):
        if cfg.get(keys[0]) is not None:
            out[ours] = int(cfg[keys[0]])
    if "min_pixels" not in out and size.get("shortest_edge"):
        out["min_pixels"] = int(size["shortest_edge"])
    if "max_pixels" not in out and size.get("longest_edge"):
        out["max_pixels"] = int(size["longest_edge"])
    for key in ("patch_size", "merge_size", "temporal_patch_size"):
        if cfg.get(key) is not None:
            out[key] = int(cfg[key])
    vsize = _size_edges(video.get("size"))
    vmin = video.get("min_pixels") or vsize.get("shortest_edge")
    vmax = video.get("max_pixels") or vsize.get("longest_edge")
    if vmin:
        out["video_min_pixels"] = int(vmin)
    if vmax:
        out["video_max_pixels"] = int(vmax)
    for key, typ in (("fps", float), ("min_frames", int), ("max_frames", int), ("max_video_tokens", int)):
        if video.get(key) is not None:
            out[key] = typ(video[key])
    return out


def _internvl_config(cfg: dict[str, Any], video: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for raw in ("max_dynamic_patch", "max_patches", "max_num", "min_dynamic_patch", "min_patches",
                "min_num", "force_image_size", "use_thumbnail", "downsample_ratio", "patch_size"):
        if cfg.get(raw) is not None:
            field = _ALIASES.get(raw, raw)
            out[field] = cfg[raw] if field == "use_thumbnail" else (
                float(cfg[raw]) if field == "downsample_ratio" else int(cfg[raw]))
    if cfg.get("crop_to_patches") is False:
        out["max_tiles"] = 1
    size = _size_edges(cfg.get("size"))
    if size.get("height"):
        out["image_size"] = int(size["height"])
    vision = _size_edges(cfg.get("vision_config"))
    if vision.get("image_size") and "image_size" not in out:
        out["image_size"] = int(vision["image_size"])
    if vision.get("patch_size") and "patch_size" not in out:
        out["patch_size"] = int(vision["patch_size"])
    if video.get("num_frames"):
        out["video_frames"] = int(video["num_frames"])
    return out


def _llava_config(cfg: dict[str, Any], video: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    crop = _size_edges(cfg.get("crop_size"))
    size = _size_edges(cfg.get("size"))
    side = crop.get("height") or size.get("height") or size.get("shortest_edge")
    if side:
        out["image_size"] = int(side)
    if cfg.get("patch_size") is not None:
        out["patch_size"] = int(cfg["patch_size"])
    if cfg.get("image_grid_pinpoints"):
        out["pinpoints"] = cfg["image_grid_pinpoints"]
    aspect = cfg.get("vision_aspect_ratio")
    if isinstance(aspect, str) and aspect.startswith("anyres_max_"):
        out["max_crops"] = int(aspect[len("anyres_max_"):])
    if video.get("num_frames"):
        out["video_frames"] = int(video["num_frames"])
    return out


def _idefics3_config(cfg: dict[str, Any], video: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tile = _size_edges(cfg.get("max_image_size")).get("longest_edge")
    if tile:
        out["image_size"] = int(tile)
    longest = _size_edges(cfg.get("size")).get("longest_edge")
    if longest:
        out["longest_edge"] = int(longest)
    if cfg.get("do_image_splitting") is not None:
        out["do_image_splitting"] = bool(cfg["do_image_splitting"])
    vision = _size_edges(cfg.get("vision_config"))
    if vision.get("patch_size"):
        out["patch_size"] = int(vision["patch_size"])
    if cfg.get("scale_factor"):
        out["scale_factor"] = int(cfg["scale_factor"])
    if cfg.get("image_seq_len"):
        out["tokens_per_tile"] = int(cfg["image_seq_len"])
    sampling = _size_edges(cfg.get("video_sampling")) or video
    if sampling.get("fps"):
        out["fps"] = float(sampling["fps"])
    if sampling.get("max_frames"):
        out["max_frames"] = int(sampling["max_frames"])
    return out


def _only(keys: tuple[str, ...], reader: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    def read(cfg: dict[str, Any], video: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in reader(cfg, video).items() if k in keys}
    return read


_CONFIG_READERS: dict[str, Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]] = {
    "qwen2-vl": _qwen_config, "qwen2.5-vl": _qwen_config, "internvl": _internvl_config,
    "llava-1.5": _only(("image_size", "patch_size"), _llava_config),
    "llava-next": _only(("image_size", "patch_size", "pinpoints", "max_crops"), _llava_config),
    "llava-onevision": _llava_config,
    "idefics3": _only(("image_size", "longest_edge", "do_image_splitting", "patch_size", "scale_factor",
                       "tokens_per_tile"), _idefics3_config),
    "smolvlm": _idefics3_config,
}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: cannot read processor config ({exc})",
                         fix="pass the model's preprocessor_config.json (or its folder)") from exc
    if not isinstance(data, dict):
        raise InputError(f"{path}: processor config is not a JSON object")
    return data


def rule_from_processor_config(name: str, path: str | Path) -> VisionRule:
    """The preset ``name`` with the parameters of a local processor config.

    ``path`` is a ``preprocessor_config.json`` (or InternVL's ``config.json``) or a model folder; in
    a folder ``preprocessor_config.json``, ``processor_config.json`` and ``config.json`` are merged
    (first wins) and ``video_preprocessor_config.json`` supplies the video parameters. Keys a rule
    does not use (``image_mean``, ...) are ignored. Nothing is downloaded.

    Example:
        >>> import json, tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "preprocessor_config.json"
        >>> _ = p.write_text(json.dumps({"min_pixels": 3136, "max_pixels": 1003520}))
        >>> rule_from_processor_config("qwen2-vl", p).max_pixels
        1003520
    """
    key = name.strip().lower()
    if key not in PRESETS:
        raise UsageError(f"unknown vision preset {name!r}", fix=f"use one of: {', '.join(PRESETS)}")
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
            cfg.update(_read_json(file))
        if (path / "video_preprocessor_config.json").is_file():
            video = _read_json(path / "video_preprocessor_config.json")
    elif path.is_file():
        cfg = _read_json(path)
    else:
        raise InputError(f"{path}: processor config not found")
    return get_rule(key, **_CONFIG_READERS[key](cfg, video))
