"""GLM-4.1V vision-token rule: 14 px patches merged 2x2, images budgeted as 2-frame clips, timed videos.

Mirrors transformers' ``Glm4vImageProcessor`` (the 3-D ``smart_resize`` with ``num_frames = 2``:
an image is budgeted like a two-frame clip) and ``Glm4vVideoProcessor`` (5.x): frames sampled at
2 fps for clips up to ``max_duration`` (300 s), else 600 frames spread over the clip, duplicates
dropped, an even count kept; one ``smart_resize`` for the whole clip. ``Glm4vProcessor`` writes
``<|begin_of_image|>`` + pads + ``<|end_of_image|>`` + ``int(t)`` per temporal patch, ``t`` the
timestamp of its first frame: ``llm_tokens`` includes those wrappers and the digits (one token
per group of up to 3 digits, as GLM-4's tokenizer pre-splits numbers; ``timestamp_tokenizer``
counts them with a real tokenizer instead).

Defaults: ``zai-org/GLM-4.1V-9B-Thinking`` ``preprocessor_config.json`` (``size = {shortest_edge:
12544, longest_edge: 9633792}``, ``patch_size 14``, ``temporal_patch_size 2``, ``merge_size 2``)
and transformers' ``Glm4vVideoProcessor`` (``size = {shortest_edge: 12544, longest_edge:
47040000}``, ``fps 2``, ``max_duration 300``).

Example:
    >>> rule = Glm4vRule()
    >>> rule.count_image(1920, 1080).llm_tokens
    2691
    >>> c = rule.count_video(300, 640, 360, fps=30.0)    # 10 s -> 20 frames -> 10 temporal patches
    >>> c.items, c.llm_tokens
    (10, 3020)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from balancer_cli.scan.rules.base import (
    MediaCount,
    VisionRule,
    check_size,
    config_section,
    frames_from_metadata,
)
from balancer_cli.scan.rules.qwen3 import smart_resize_video

__all__ = ["Glm4vRule", "glm4v_frame_indices", "glm4v_processor_params"]


def glm4v_frame_indices(total_frames: int, video_fps: float, duration_s: float | None = None, fps: float = 2.0,
                        max_duration: float = 300) -> np.ndarray:
    """Frame indices ``Glm4vVideoProcessor.sample_frames`` keeps (deduplicated, even count).

    Example:
        >>> glm4v_frame_indices(95, 30.0).tolist()
        [0, 15, 30, 45, 60, 75, 90, 94]
    """
    max_idx = total_frames - 1
    duration = duration_s or round(max_idx / video_fps) + 1
    if duration <= max_duration:
        n = max(int(math.floor(duration * fps)), 1)
        indices = [min(max_idx, int(math.ceil(i * video_fps / fps))) for i in range(n)]
    else:
        samples = int(max_duration * fps)
        if samples >= total_frames:
            indices = list(range(total_frames))
        else:
            targets = np.linspace(0, duration, samples, endpoint=True)
            indices = [min(max_idx, int(math.ceil(t * video_fps))) for t in targets]
    unique = list(dict.fromkeys(indices))
    if len(unique) & 1:
        unique.append(unique[-1])
    return np.array(unique, dtype=int)


def _digit_tokens(number: int) -> int:
    return -(-len(str(number)) // 3)


@dataclass(frozen=True)
class Glm4vRule(VisionRule):
    """GLM-4.1V-9B (Base/Thinking) and GLM-4.5V (same processor).

    ``source_fps`` is assumed when a record gives neither ``fps`` nor a frame count.
    """

    name: str = "glm-4.1v"
    min_pixels: int = 12544
    max_pixels: int = 9633792
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    fps: float = 2.0
    max_duration: float = 300.0
    video_min_pixels: int = 12544
    video_max_pixels: int = 47040000
    source_fps: float = 24.0
    timestamp_tokenizer: str = ""
    image_token: str = "<|image|>"
    video_token: str = "<|video|>"

    @property
    def factor(self) -> int:
        """Side multiple of the resized media: ``patch_size * merge_size``."""
        return self.patch_size * self.merge_size

    def count_image(self, width: int, height: int) -> MediaCount:
        """Patches of the image resized as a ``temporal_patch_size``-frame clip; a quarter reach the LLM.

        Example:
            >>> Glm4vRule().count_image(640, 480)
            MediaCount(encoder_tokens=1564, items=1, llm_tokens=391, seqlens=(1564,))
        """
        check_size(self.name, width, height)
        h, w = smart_resize_video(self.temporal_patch_size, height, width, self.temporal_patch_size, self.factor,
                                  self.min_pixels, self.max_pixels)
        patches = (h // self.patch_size) * (w // self.patch_size)
        return MediaCount(patches, 1, patches // self.merge_size**2, (patches,))

    def sample_indices(self, num_frames: int, fps: float | None = None,
                       duration_s: float | None = None) -> tuple[np.ndarray, float]:
        """``(frame indices kept, the video's frame rate)`` for a video's metadata."""
        total, duration = frames_from_metadata(num_frames, fps, duration_s)
        if duration is None:
            return np.arange(total, dtype=int), self.source_fps
        if fps is None:
            fps = total / duration if total and duration else self.source_fps
        if total <= 0:
            total = max(1, int(round(duration * fps)))
        return glm4v_frame_indices(total, fps, duration, self.fps, self.max_duration), fps

    def timestamp_tokens(self, seconds: list[int]) -> int:
        """Tokens of the integer timestamps written after each temporal patch."""
        if self.timestamp_tokenizer:
            from balancer_cli.scan.text import load_tokenizer

            return sum(load_tokenizer(self.timestamp_tokenizer).count_batch([str(s) for s in seconds]))
        return sum(_digit_tokens(s) for s in seconds)

    def count_video(self, num_frames: int, width: int, height: int, fps: float | None = None,
                    duration_s: float | None = None) -> MediaCount:
        """Tokens of one video; ``items`` are temporal patches."""
        check_size(self.name, width, height)
        indices, video_fps = self.sample_indices(num_frames, fps, duration_s)
        frames = len(indices)
        h, w = smart_resize_video(frames, height, width, self.temporal_patch_size, self.factor,
                                  self.video_min_pixels, self.video_max_pixels)
        grid_t = -(-frames // self.temporal_patch_size)
        per_t = (h // self.patch_size) * (w // self.patch_size)
        stamps = [idx / video_fps for idx in indices.tolist()][:: self.temporal_patch_size][:grid_t]
        stamps += [stamps[-1] if stamps else 0] * (grid_t - len(stamps))
        llm = grid_t * (per_t // self.merge_size**2 + 2) + self.timestamp_tokens([int(t) for t in stamps])
        return MediaCount(grid_t * per_t, grid_t, llm, (per_t,) * grid_t)


def glm4v_processor_params(config: dict[str, Any], video: dict[str, Any]) -> dict[str, Any]:
    """:class:`Glm4vRule` parameters of GLM-4.1V's ``preprocessor_config.json`` and video config.

    Example:
        >>> glm4v_processor_params({"size": {"shortest_edge": 12544, "longest_edge": 9633792}},
        ...                        {"size": {"longest_edge": 47040000}, "fps": 2})
        {'min_pixels': 12544, 'max_pixels': 9633792, 'video_max_pixels': 47040000, 'fps': 2.0}
    """
    out: dict[str, Any] = {}
    size = config_section(config, "size")
    if size.get("shortest_edge"):
        out["min_pixels"] = int(size["shortest_edge"])
    if size.get("longest_edge"):
        out["max_pixels"] = int(size["longest_edge"])
    for key in ("patch_size", "merge_size", "temporal_patch_size"):
        if config.get(key) is not None:
            out[key] = int(config[key])
    video_size = config_section(video, "size")
    if video_size.get("shortest_edge"):
        out["video_min_pixels"] = int(video_size["shortest_edge"])
    if video_size.get("longest_edge"):
        out["video_max_pixels"] = int(video_size["longest_edge"])
    for key in ("fps", "max_duration"):
        if video.get(key) is not None:
            out[key] = float(video[key])
    return out
