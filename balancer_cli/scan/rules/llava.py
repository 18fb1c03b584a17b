"""LLaVA-family vision-token rules: LLaVA-1.5 (fixed 336 px), LLaVA-NeXT and LLaVA-OneVision (anyres).

LLaVA-NeXT / OneVision pick the grid pinpoint that keeps the most of the image's resolution
(``select_best_resolution``), encode a resized base image plus one crop per pinpoint cell, then
drop the padding rows/columns of the crop features ("unpadding") and append one newline feature
per remaining row. OneVision's ``anyres_max_9`` additionally shrinks the unpadded grid to at most
9 crops' worth of features. Counts follow transformers' ``LlavaNextProcessor`` /
``LlavaOnevisionProcessor`` (``_get_number_of_features``), which is what the model's feature
packing produces.

Example:
    >>> LlavaNextRule().count_image(640, 480).llm_tokens
    2340
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from balancer_cli.errors import UsageError
from balancer_cli.scan.rules.base import (
    MediaCount,
    MediaRejected,
    VisionRule,
    check_size,
    config_section,
    frames_from_metadata,
)

__all__ = ["LlavaRule", "LlavaNextRule", "LlavaOnevisionRule", "llava_processor_params", "parse_pinpoints",
           "select_best_resolution", "unpadded_features"]

LLAVA_NEXT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
ONEVISION_PINPOINTS = tuple((h, w) for h in range(384, 2305, 384) for w in range(384, 2305, 384))


def select_best_resolution(height: int, width: int, pinpoints: tuple[tuple[int, int], ...]
                           ) -> tuple[int, int]:
    """The ``(height, width)`` pinpoint keeping the most effective pixels, then wasting the fewest.

    Example:
        >>> select_best_resolution(480, 640, LLAVA_NEXT_PINPOINTS)
        (672, 672)
    """
    best, best_effective, best_wasted = pinpoints[0], 0, float("inf")
    for ph, pw in pinpoints:
        scale = min(pw / width, ph / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = ph * pw - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (ph, pw), effective, wasted
    return best


def unpadded_features(height: int, width: int, patches: int, scale_h: int, scale_w: int,
                      max_crops: int | None = None) -> tuple[int, int]:
    """``(features, newline_features)`` of the crop grid after removing the padding.

    ``max_crops`` is OneVision's ``anyres_max_N`` (None for LLaVA-NeXT).

    Example:
        >>> unpadded_features(480, 640, 24, 2, 2)
        (1728, 36)
    """
    cur_h, cur_w = patches * scale_h, patches * scale_w
    if width / height > cur_w / cur_h:
        new_h = int(round(height * (cur_w / width), 7))
        cur_h -= (cur_h - new_h) // 2 * 2
    else:
        new_w = int(round(width * (cur_h / height), 7))
        cur_w -= (cur_w - new_w) // 2 * 2
    features, newlines = cur_h * cur_w, cur_h
    if max_crops is not None:
        ratio = math.sqrt(cur_h * cur_w / (max_crops * patches**2))
        if ratio > 1.1:
            features = int(cur_h // ratio) * int(cur_w // ratio)
            newlines = int(cur_h // ratio)
    return features, newlines


@dataclass(frozen=True)
class LlavaRule(VisionRule):
    """LLaVA-1.5 (llava-hf/llava-1.5-*-hf): one 336 px CLIP-L/14 crop, 576 tokens, no video."""

    name: str = "llava-1.5"
    image_size: int = 336
    patch_size: int = 14
    image_token: str = "<image>"
    video_token: str = "<video>"

    def count_image(self, width: int, height: int) -> MediaCount:
        """576 tokens whatever the size (the image is resized / center-cropped to 336 px)."""
        check_size(self.name, width, height)
        patches = (self.image_size // self.patch_size) ** 2
        return MediaCount(patches, 1, patches, (patches,))

    def count_video(self, num_frames: int, width: int, height: int, fps: float | None = None,
                    duration_s: float | None = None) -> MediaCount:
        """LLaVA-1.5 has no video input."""
        raise MediaRejected(f"{self.name} does not accept videos",
                            fix="use a video-capable preset (qwen2-vl, internvl, llava-onevision, smolvlm)")


@dataclass(frozen=True)
class LlavaNextRule(VisionRule):
    """LLaVA-NeXT / LLaVA-1.6 (llava-hf/llava-v1.6-*-hf): 336 px base + crops on 5 pinpoints.

    ``llm_tokens`` = unpadded crop features + one newline per feature row + 576 base features
    (``vision_feature_select_strategy="default"`` drops the CLS token the processor adds back).
    """

    name: str = "llava-next"
    image_size: int = 336
    patch_size: int = 14
    pinpoints: tuple[tuple[int, int], ...] = LLAVA_NEXT_PINPOINTS
    max_crops: int = 0  # 0: no anyres_max limit
    image_token: str = "<image>"
    video_token: str = "<video>"

    @property
    def patches_per_crop(self) -> int:
        """Encoder patches of one crop (576 for 336 px / 14)."""
        return (self.image_size // self.patch_size) ** 2

    def crop_grid(self, width: int, height: int) -> tuple[int, int]:
        """``(rows, cols)`` of crops for the best pinpoint."""
        best_h, best_w = select_best_resolution(height, width, self.pinpoints)
        return math.ceil(best_h / self.image_size), math.ceil(best_w / self.image_size)

    def count_image(self, width: int, height: int) -> MediaCount:
        """Base image + crops through the encoder; unpadded features + newlines + base to the LLM."""
        check_size(self.name, width, height)
        best_h, best_w = select_best_resolution(height, width, self.pinpoints)
        rows, cols = math.ceil(best_h / self.image_size), math.ceil(best_w / self.image_size)
        side = self.image_size // self.patch_size
        features, newlines = unpadded_features(
            height, width, side, best_h // self.image_size, best_w // self.image_size,
            self.max_crops or None)
        items = 1 + rows * cols
        per = self.patches_per_crop
        return MediaCount(items * per, items, features + newlines + side * side, (per,) * items)

    def count_video(self, num_frames: int, width: int, height: int, fps: float | None = None,
                    duration_s: float | None = None) -> MediaCount:
        """LLaVA-NeXT (image model) has no video input; LLaVA-NeXT-Video is a separate model."""
        raise MediaRejected(f"{self.name} does not accept videos",
                            fix="use a video-capable preset (qwen2-vl, internvl, llava-onevision, smolvlm)")


@dataclass(frozen=True)
class LlavaOnevisionRule(VisionRule):
    """LLaVA-OneVision (llava-hf/llava-onevision-qwen2-*-ov-hf): SigLIP 384 px, anyres_max_9.

    Single image: base (729) + unpadded, ``anyres_max_9``-limited crop features + newlines.
    ``multi_image=True`` (a sample with several images): every image is one 384 px crop of
    729 + 1 newline tokens, as the processor does for ``batch_num_images > 1``. Video: every frame
    is one 384 px crop, 2x2-pooled to ``ceil(27/2)**2 = 196`` tokens, plus one newline per video;
    ``video_frames`` frames (32, LLaVA-OneVision's training setting) are sampled uniformly, or all
    frames of a shorter video.
    """

    name: str = "llava-onevision"
    image_size: int = 384
    patch_size: int = 14
    pinpoints: tuple[tuple[int, int], ...] = ONEVISION_PINPOINTS
    max_crops: int = 9
    multi_image: bool = False
    video_frames: int = 32
    image_token: str = "<image>"
    video_token: str = "<video>"

    def for_images(self, num_images: int) -> LlavaOnevisionRule:
        """With several images in the sample, every image is one crop (``multi_image=True``)."""
        return dataclasses.replace(self, multi_image=True) if num_images > 1 and not self.multi_image else self

    def count_image(self, width: int, height: int) -> MediaCount:
        """Tokens of one image (see the class docstring for ``multi_image``)."""
        check_size(self.name, width, height)
        side = self.image_size // self.patch_size
        per = side * side
        if self.multi_image:
            return MediaCount(per, 1, per + 1, (per,))
        best_h, best_w = select_best_resolution(height, width, self.pinpoints)
        rows, cols = math.ceil(best_h / self.image_size), math.ceil(best_w / self.image_size)
        features, newlines = unpadded_features(
            height, width, side, best_h // self.image_size, best_w // self.image_size, self.max_crops)
        items = 1 + rows * cols
        return MediaCount(items * per, items, features + newlines + per, (per,) * items)

    def count_video(self, num_frames: int, width: int, height: int, fps: float | None = None,
                    duration_s: float | None = None) -> MediaCount:
        """``video_frames`` frames x 196 pooled tokens + 1 newline (independent of the video's size).

        A video holding fewer frames than ``video_frames`` keeps the frames it has (LLaVA-NeXT's
        ``frames_upbound`` sampling, and what ``LlavaOnevisionProcessor`` counts for the frames it
        is given); with only a duration known, ``video_frames`` are assumed.

        Example:
            >>> LlavaOnevisionRule().count_video(8, 640, 360).llm_tokens      # 8 frames, not 32
            1569
        """
        check_size(self.name, width, height)
        if self.video_frames < 1:
            raise MediaRejected(f"{self.name}: video_frames={self.video_frames} samples no frame")
        total, _ = frames_from_metadata(num_frames, fps, duration_s)
        side = self.image_size // self.patch_size
        pooled = math.ceil(side / 2) ** 2
        n = min(self.video_frames, total) if total > 0 else self.video_frames
        return MediaCount(n * side * side, n, n * pooled + 1, (side * side,) * n)


def parse_pinpoints(value: Any) -> tuple[tuple[int, int], ...]:
    """``image_grid_pinpoints`` (a list of ``[height, width]``) as the rules' tuple of pairs.

    Example:
        >>> parse_pinpoints([[336, 672], [672, 336]])
        ((336, 672), (672, 336))
    """
    try:
        pairs = tuple((int(h), int(w)) for h, w in value)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"image_grid_pinpoints={value!r} must be a list of [height, width] pairs") from exc
    if not pairs or min(min(p) for p in pairs) < 1:
        raise UsageError(f"image_grid_pinpoints={value!r} must hold positive [height, width] pairs")
    return pairs


def llava_processor_params(config: dict[str, Any], video: dict[str, Any]) -> dict[str, Any]:
    """LLaVA-family parameters of a processor config (each preset keeps those its rule has).

    Example:
        >>> llava_processor_params({"crop_size": {"height": 384}, "vision_aspect_ratio": "anyres_max_9"}, {})
        {'image_size': 384, 'max_crops': 9}
    """
    out: dict[str, Any] = {}
    crop = config_section(config, "crop_size")
    size = config_section(config, "size")
    side = crop.get("height") or size.get("height") or size.get("shortest_edge")
    if side:
        out["image_size"] = int(side)
    if config.get("patch_size") is not None:
        out["patch_size"] = int(config["patch_size"])
    if config.get("image_grid_pinpoints"):
        out["pinpoints"] = config["image_grid_pinpoints"]
    aspect = config.get("vision_aspect_ratio")
    if isinstance(aspect, str) and aspect.startswith("anyres_max_"):
        out["max_crops"] = int(aspect[len("anyres_max_"):])
    if video.get("num_frames"):
        out["video_frames"] = int(video["num_frames"])
    return out
