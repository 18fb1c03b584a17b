"""Qwen3-VL vision-token rule: 16 px patches merged 2x2 (multiples of 32), videos with timestamp text.

Images follow ``Qwen2VLImageProcessor`` (Qwen3-VL ships it with ``patch_size=16``): ``smart_resize``
to multiples of 32 within ``[min_pixels, max_pixels]``. Videos follow ``Qwen3VLVideoProcessor``
(transformers 5.x): ``int(total_frames / video_fps * fps)`` frames clamped to
``[min_frames, max_frames]`` and to the file's frames, picked with
``np.linspace(0, total - 1, n).round()``; one 3-D ``smart_resize`` for the whole clip whose pixel
budget (``video_max_pixels``) counts every frame; ``ceil(n / 2)`` temporal patches. The processor
writes ``<{t:.1f} seconds><|vision_start|>`` + pads + ``<|vision_end|>`` per temporal patch, ``t``
the mean timestamp of its two frames: ``llm_tokens`` includes that text, counted with
``timestamp_tokenizer`` (the ``qwen2`` vocabulary, which Qwen3's tokenizer shares).

Defaults: ``Qwen/Qwen3-VL-*-Instruct`` ``preprocessor_config.json`` (``size = {shortest_edge:
65536, longest_edge: 16777216}``, ``patch_size 16``, ``merge_size 2``, ``temporal_patch_size 2``)
and ``video_preprocessor_config.json`` (``size = {shortest_edge: 4096, longest_edge: 25165824}``,
``fps 2``, ``min_frames 4``, ``max_frames 768``, ``do_sample_frames true``).

Example:
    >>> rule = Qwen3VLRule()
    >>> rule.count_image(1920, 1080).llm_tokens
    2040
    >>> c = rule.count_video(300, 640, 360, fps=30.0)     # 10 s -> 20 frames -> 10 temporal patches
    >>> c.items, c.seqlens[0], c.llm_tokens
    (10, 880, 2280)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from balancer_cli.scan.rules.base import (
    MediaCount,
    MediaRejected,
    check_size,
    frames_from_metadata,
)
from balancer_cli.scan.rules.qwen import MAX_ASPECT_RATIO, QwenVLRule

__all__ = ["Qwen3VLRule", "qwen3_frame_indices", "qwen3_processor_params", "qwen3_timestamps", "smart_resize_video"]


def smart_resize_video(num_frames: int, height: int, width: int, temporal_factor: int = 2, factor: int = 32,
                       min_pixels: int = 4096, max_pixels: int = 25165824) -> tuple[int, int]:
    """Qwen3-VL / GLM-4.1V's video ``smart_resize``: the budget counts ``num_frames`` frames.

    Sides below ``factor`` are scaled up first (aspect kept, ``int`` truncation), then as
    Qwen2-VL's ``smart_resize`` with ``t_bar * h_bar * w_bar`` against the pixel bounds.

    Example:
        >>> smart_resize_video(20, 360, 640)
        (352, 640)
    """
    if num_frames < temporal_factor:
        raise MediaRejected(f"video of {num_frames} sampled frame(s) is shorter than the temporal patch "
                            f"({temporal_factor} frames)", fix="drop the sample or give the video more frames")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaRejected(
            f"aspect ratio {max(height, width) / min(height, width):.1f} of a {width}x{height} video exceeds "
            f"the processor's limit of {MAX_ASPECT_RATIO}", fix="crop or pad the video, or drop the sample")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def qwen3_frame_indices(total_frames: int, video_fps: float, fps: float = 2.0, min_frames: int = 4,
                        max_frames: int = 768) -> np.ndarray:
    """Frame indices ``Qwen3VLVideoProcessor.sample_frames`` keeps.

    Example:
        >>> qwen3_frame_indices(300, 30.0).tolist()[:4]
        [0, 16, 31, 47]
    """
    n = int(total_frames / video_fps * fps)
    n = min(max(n, min_frames), max_frames, total_frames)
    return np.linspace(0, total_frames - 1, n).round().astype(int)


def qwen3_timestamps(indices: np.ndarray, video_fps: float, temporal_patch_size: int = 2) -> list[float]:
    """Seconds written before each temporal patch (``Qwen3VLProcessor._calculate_timestamps``).

    Example:
        >>> qwen3_timestamps(np.array([0, 16, 31]), 30.0)
        [0.26666666666666666, 1.0333333333333334]
    """
    idx = indices.tolist()
    if len(idx) % temporal_patch_size:
        idx.extend(idx[-1] for _ in range(temporal_patch_size - len(idx) % temporal_patch_size))
    ts = [i / video_fps for i in idx]
    return [(ts[i] + ts[i + temporal_patch_size - 1]) / 2 for i in range(0, len(ts), temporal_patch_size)]


@dataclass(frozen=True)
class Qwen3VLRule(QwenVLRule):
    """Qwen3-VL (2B..235B Instruct/Thinking): Qwen2-VL's image rule at 16 px, Qwen3's video processor.

    ``video_min_pixels`` / ``video_max_pixels`` bound the pixels of the whole sampled clip (the
    3-D ``smart_resize``); ``cap_pixels_per_frame=True`` adds the processor's optional per-frame
    cap (``max_video_tokens`` patches per frame, 768); off by default as in transformers 5.x.
    ``source_fps`` is the frame rate assumed when a record gives neither ``fps`` nor a frame
    count (24, transformers' own fallback). ``timestamp_tokenizer`` counts the timestamp text
    (``""``: not counted).
    """

    name: str = "qwen3-vl"
    min_pixels: int = 65536
    max_pixels: int = 16777216
    patch_size: int = 16
    video_min_pixels: int = 4096
    video_max_pixels: int = 25165824
    max_video_tokens: int = 768
    source_fps: float = 24.0
    timestamp_tokenizer: str = "qwen2"

    def sample_indices(self, num_frames: int, fps: float | None = None,
                       duration_s: float | None = None) -> tuple[np.ndarray, float]:
        """``(frame indices kept, the video's frame rate)`` for a video's metadata."""
        total, duration = frames_from_metadata(num_frames, fps, duration_s)
        if duration is None:  # frames handed over already sampled: all of them, fps unknown
            return np.arange(total, dtype=int), self.source_fps
        if fps is None:
            fps = total / duration if total and duration else self.source_fps
        if total <= 0:
            total = max(1, int(round(duration * fps)))
        return qwen3_frame_indices(total, fps, self.fps, self.min_frames, self.max_frames), fps

    def timestamp_tokens(self, seconds: list[float]) -> list[int]:
        """Tokens of each ``<{t:.1f} seconds>`` text (0 each without a ``timestamp_tokenizer``)."""
        if not self.timestamp_tokenizer:
            return [0] * len(seconds)
        from balancer_cli.scan.text import load_tokenizer

        return load_tokenizer(self.timestamp_tokenizer).count_batch([f"<{t:.1f} seconds>" for t in seconds])

    def count_video(self, num_frames: int, width: int, height: int, fps: float | None = None,
                    duration_s: float | None = None) -> MediaCount:
        """Tokens of one video: per temporal patch, pads + ``<|vision_start|>``/``<|vision_end|>`` + timestamp.

        Example:
            >>> Qwen3VLRule().count_video(0, 1280, 720, duration_s=1.0).items   # 4 frames at least
            2
        """
        check_size(self.name, width, height)
        indices, video_fps = self.sample_indices(num_frames, fps, duration_s)
        frames = len(indices)
        factor = self.factor
        max_pixels = self.video_max_pixels
        if self.cap_pixels_per_frame and frames:
            per_frame = max(min(self.max_video_tokens * factor * factor, max_pixels // frames),
                            int(self.video_min_pixels * 1.05))
            max_pixels = per_frame * frames
        h, w = smart_resize_video(frames, height, width, self.temporal_patch_size, factor,
                                  self.video_min_pixels, max_pixels)
        grid_t = -(-frames // self.temporal_patch_size)
        per_t = (h // self.patch_size) * (w // self.patch_size)
        text = sum(self.timestamp_tokens(qwen3_timestamps(indices, video_fps, self.temporal_patch_size)))
        llm = grid_t * (per_t // self.merge_size**2 + 2) + text
        return MediaCount(grid_t * per_t, grid_t, llm, (per_t,) * grid_t)


def qwen3_processor_params(config: dict[str, Any], video: dict[str, Any]) -> dict[str, Any]:
    """:class:`Qwen3VLRule` parameters of Qwen3-VL's processor configs (as Qwen2-VL's).

    Example:
        >>> qwen3_processor_params({"size": {"shortest_edge": 65536, "longest_edge": 16777216}},
        ...                        {"size": {"shortest_edge": 4096, "longest_edge": 25165824}, "fps": 2})
        {'min_pixels': 65536, 'max_pixels': 16777216, 'video_min_pixels': 4096, 'video_max_pixels': 25165824, 'fps': 2.0}
    """
    from balancer_cli.scan.rules.qwen import qwen_processor_params

    return qwen_processor_params(config, video)
