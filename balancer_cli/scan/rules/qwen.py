"""Qwen2-VL / Qwen2.5-VL vision-token rule: ``smart_resize`` to multiples of 28, 2x2 patch merge.

Mirrors transformers' ``Qwen2VLImageProcessor`` (and the identical ``smart_resize`` of
qwen-vl-utils) for images and ``Qwen2VLVideoProcessor`` for videos: frames sampled at 2 fps
(``do_sample_frames=True``, the sampling qwen-vl-utils and the training repos do before the
processor) and each frame resized within ``[video_min_pixels, video_max_pixels]``. transformers 5.x
applies no total-video pixel budget unless ``cap_pixels_per_frame=True`` is passed (its default
``None`` means off), so neither does this rule by default; ``cap_pixels_per_frame=True`` gives
qwen-vl-utils' budget (``max_video_tokens`` x 0.9 tokens per video).

Example:
    >>> rule = QwenVLRule()
    >>> rule.count_image(1080, 1920).llm_tokens      # released max_pixels = 12845056
    2691
    >>> QwenVLRule(max_pixels=28 * 28 * 1280).count_image(1080, 1920).llm_tokens
    1222
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from balancer_cli.scan.rules.base import (
    MediaCount,
    MediaRejected,
    VisionRule,
    check_size,
    config_section,
    frames_from_metadata,
)

__all__ = ["SAMPLERS", "QwenVLRule", "qwen_processor_params", "qwen_sampled_frames", "smart_resize"]

MAX_ASPECT_RATIO = 200
#: Frame samplers of :func:`qwen_sampled_frames`.
SAMPLERS = ("transformers", "qwen-vl-utils")


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """The resized ``(height, width)``: multiples of ``factor``, pixels within [min, max].

    Same arithmetic as transformers' / qwen-vl-utils' ``smart_resize`` (Python's banker's
    ``round`` included, which matters at exact halves). Raises :class:`MediaRejected` when the
    aspect ratio exceeds 200 (the processor raises ``ValueError`` there).

    Example:
        >>> smart_resize(480, 640, 28, 3136, 12845056)
        (476, 644)
    """
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaRejected(
            f"aspect ratio {max(height, width) / min(height, width):.1f} of a {width}x{height} image "
            f"exceeds the processor's limit of {MAX_ASPECT_RATIO}",
            fix="crop or pad the image, or drop the sample")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def qwen_sampled_frames(total_frames: int, duration_s: float, fps: float = 2.0, min_frames: int = 4,
                        max_frames: int = 768, temporal_patch_size: int = 2, sampler: str = "transformers") -> int:
    """Frames ``Qwen2VLVideoProcessor.sample_frames`` keeps when sampling ``fps`` frames per second.

    ``total_frames = 0`` means the file's frame count is unknown: only ``max_frames`` caps.
    ``sampler="transformers"`` reproduces the processor exactly: its indices are
    ``torch.arange(0, total, total / n)``, whose float step yields ``n + 1`` frames for about 4% of
    ``(total, n)`` pairs (e.g. 243 for 1213 frames and n = 242); ``"qwen-vl-utils"`` keeps exactly
    ``n`` (qwen-vl-utils' ``linspace`` sampling).

    Example:
        >>> qwen_sampled_frames(total_frames=3000, duration_s=100.0)   # 2 fps over 100 s
        200
        >>> qwen_sampled_frames(total_frames=0, duration_s=1.0)        # at least min_frames
        4
        >>> qwen_sampled_frames(1213, 121.3, fps=2.0), qwen_sampled_frames(1213, 121.3, sampler="qwen-vl-utils")
        (243, 242)
    """
    if sampler not in SAMPLERS:
        raise MediaRejected(f"unknown frame sampler {sampler!r}", fix=f"use one of: {', '.join(SAMPLERS)}")
    cap = max_frames if total_frames <= 0 else min(max_frames, total_frames)
    cap = math.floor(cap / temporal_patch_size) * temporal_patch_size
    wanted = duration_s * fps
    upper = cap if total_frames <= 0 else min(cap, total_frames)
    wanted = min(max(wanted, min_frames), upper)
    n = int(math.floor(wanted / temporal_patch_size) * temporal_patch_size)
    if sampler == "transformers" and total_frames > 0 and n > 0:
        n = math.ceil(total_frames / (total_frames / n))  # len(torch.arange(0, total, total / n))
    return n


@dataclass(frozen=True)
class QwenVLRule(VisionRule):
    """Qwen2-VL / Qwen2.5-VL (identical counting; Qwen2.5-VL's window attention does not change it).

    Defaults are the released ``preprocessor_config.json`` of Qwen2-VL-*-Instruct and
    Qwen2.5-VL-*-Instruct (``min_pixels=3136``, ``max_pixels=12845056``); transformers' class
    default is ``max_pixels=28*28*1280`` (1,003,520), which gives far fewer tokens for big images.
    Video defaults are transformers' ``Qwen2VLVideoProcessor`` (per-frame pixels in
    ``[128*28*28, 768*28*28]``, no total-video cap, as its ``cap_pixels_per_frame=None`` default)
    sampling 2 fps, 4..768 frames (``frame_sampler="transformers"``: its exact frame count; set
    ``"qwen-vl-utils"``, with ``cap_pixels_per_frame=True``, for qwen-vl-utils' loader).
    """

    name: str = "qwen2-vl"
    min_pixels: int = 3136
    max_pixels: int = 12845056
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28
    max_video_tokens: int = 128000
    cap_pixels_per_frame: bool = False
    frame_sampler: str = "transformers"
    image_token: str = "<|image_pad|>"
    video_token: str = "<|video_pad|>"

    @property
    def factor(self) -> int:
        """Side multiple of the resized image: ``patch_size * merge_size``."""
        return self.patch_size * self.merge_size

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """The processor's resized ``(width, height)`` of an image."""
        check_size(self.name, width, height)
        h, w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return w, h

    def count_image(self, width: int, height: int) -> MediaCount:
        """Tokens of one image: ``grid_h * grid_w`` patches, a quarter of them reach the LLM.

        Example:
            >>> QwenVLRule().count_image(640, 480)
            MediaCount(encoder_tokens=1564, items=1, llm_tokens=391, seqlens=(1564,))
        """
        w, h = self.resized_size(width, height)
        patches = (h // self.patch_size) * (w // self.patch_size)
        return MediaCount(patches, 1, patches // self.merge_size**2, (patches,))

    def sampled_frames(self, num_frames: int, fps: float | None = None,
                       duration_s: float | None = None) -> int:
        """Frames the processor keeps (see :func:`~balancer_cli.scan.rules.base.frames_from_metadata`)."""
        total, duration = frames_from_metadata(num_frames, fps, duration_s)
        if duration is None:
            return total  # frames handed over as they are (do_sample_frames=False)
        return qwen_sampled_frames(total, duration, self.fps, self.min_frames, self.max_frames,
                                   self.temporal_patch_size, self.frame_sampler)

    def count_video(self, num_frames: int, width: int, height: int, fps: float | None = None,
                    duration_s: float | None = None) -> MediaCount:
        """Tokens of one video; ``items`` are temporal patches (the ViT attends within each).

        Example:
            >>> QwenVLRule().count_video(300, 640, 360, fps=30.0)   # 10 s -> 20 frames
            MediaCount(encoder_tokens=11960, items=10, llm_tokens=2990, seqlens=(1196, 1196, 1196, 1196, 1196, 1196, 1196, 1196, 1196, 1196))
        """
        check_size(self.name, width, height)
        frames = self.sampled_frames(num_frames, fps, duration_s)
        if frames < 1:
            raise MediaRejected(
                f"{self.name}: video of {num_frames} frames (fps={fps}, duration_s={duration_s}) "
                f"yields no frame group of {self.temporal_patch_size} frames")
        max_pixels = self.video_max_pixels
        if self.cap_pixels_per_frame:
            total_pixels = int(self.max_video_tokens * self.factor * self.factor * 0.9)
            max_pixels = max(min(max_pixels, total_pixels * self.temporal_patch_size // frames),
                             int(self.video_min_pixels * 1.05))
        h, w = smart_resize(height, width, self.factor, self.video_min_pixels, max_pixels)
        grid_t = -(-frames // self.temporal_patch_size)  # the processor repeats the last frame
        per_t = (h // self.patch_size) * (w // self.patch_size)
        return MediaCount(grid_t * per_t, grid_t, grid_t * per_t // self.merge_size**2, (per_t,) * grid_t)


def qwen_processor_params(config: dict[str, Any], video: dict[str, Any]) -> dict[str, Any]:
    """:class:`QwenVLRule` parameters of a ``preprocessor_config.json`` (and its video config).

    Example:
        >>> qwen_processor_params({"min_pixels": 3136, "size": {"longest_edge": 1003520}}, {"fps": 1})
        {'min_pixels': 3136, 'max_pixels': 1003520, 'fps': 1.0}
    """
    out: dict[str, Any] = {}
    size = config_section(config, "size")
    for key in ("min_pixels", "max_pixels"):
        if config.get(key) is not None:
            out[key] = int(config[key])
    if "min_pixels" not in out and size.get("shortest_edge"):
        out["min_pixels"] = int(size["shortest_edge"])
    if "max_pixels" not in out and size.get("longest_edge"):
        out["max_pixels"] = int(size["longest_edge"])
    for key in ("patch_size", "merge_size", "temporal_patch_size"):
        if config.get(key) is not None:
            out[key] = int(config[key])
    video_size = config_section(video, "size")
    video_min = video.get("min_pixels") or video_size.get("shortest_edge")
    video_max = video.get("max_pixels") or video_size.get("longest_edge")
    if video_min:
        out["video_min_pixels"] = int(video_min)
    if video_max:
        out["video_max_pixels"] = int(video_max)
    for key, kind in (("fps", float), ("min_frames", int), ("max_frames", int), ("max_video_tokens", int),
                      ("cap_pixels_per_frame", bool)):
        if video.get(key) is not None:
            out[key] = kind(video[key])
    return out
