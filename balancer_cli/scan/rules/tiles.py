"""Tiling vision-token rules: InternVL's dynamic 448 px tiles (+ thumbnail), Idefics3 / SmolVLM splits.

InternVL (1.5, 2, 2.5, 3) splits an image into a ``cols x rows`` grid of 448 px tiles whose aspect
ratio is closest to the image's (``dynamic_preprocess`` / transformers' ``GotOcr2ImageProcessor``
with ``crop_to_patches=True``), adds a 448 px thumbnail when there is more than one tile, runs
every tile through InternViT (1024 patches of 14 px) and pixel-shuffles each to 256 LLM tokens.
Idefics3 / SmolVLM resize the longest edge to 4 tiles, round both sides up to whole tiles, split
into ``rows x cols`` tiles plus a global image, and pixel-shuffle each tile.

Example:
    >>> c = InternVLRule().count_image(640, 480)    # 4 x 3 tiles + thumbnail
    >>> c.items, c.encoder_tokens, c.llm_tokens
    (13, 13312, 3330)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from balancer_cli.scan.rules.base import (
    MediaCount,
    MediaRejected,
    VisionRule,
    check_size,
    config_section,
    frames_from_metadata,
)

__all__ = ["InternVLRule", "Idefics3Rule", "closest_tile_grid", "idefics3_grid", "idefics3_processor_params",
           "internvl_processor_params", "smolvlm_sampled_frames", "tile_grids"]


@lru_cache(maxsize=64)
def tile_grids(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """All ``(cols, rows)`` grids with ``min_tiles <= cols * rows <= max_tiles``, by tile count.

    The order (cols outer, rows inner, stable sort by count) is transformers' and decides ties.

    Example:
        >>> tile_grids(1, 4)
        ((1, 1), (1, 2), (2, 1), (1, 3), (3, 1), (1, 4), (2, 2), (4, 1))
    """
    grids = [(c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1)
             if min_tiles <= c * r <= max_tiles]
    return tuple(sorted(grids, key=lambda g: g[0] * g[1]))


def closest_tile_grid(width: int, height: int, tile_size: int, min_tiles: int, max_tiles: int
                      ) -> tuple[int, int]:
    """The ``(cols, rows)`` grid whose aspect ratio is closest to ``width / height``.

    On equal distance a grid with more tiles wins while the image area exceeds half the grid's
    pixel area (InternVL's ``find_closest_aspect_ratio`` tie rule).

    Example:
        >>> closest_tile_grid(640, 480, 448, 1, 12)
        (4, 3)
        >>> closest_tile_grid(640, 427, 448, 1, 12)
        (3, 2)
    """
    aspect_ratio = width / height
    area = width * height
    best_diff, best = float("inf"), (1, 1)
    for grid in tile_grids(min_tiles, max_tiles):
        diff = abs(aspect_ratio - grid[0] / grid[1])
        if diff < best_diff:
            best_diff, best = diff, grid
        elif diff == best_diff and area > 0.5 * tile_size * tile_size * grid[0] * grid[1]:
            best = grid
    return best


@dataclass(frozen=True)
class InternVLRule(VisionRule):
    """InternVL 1.5 / 2 / 2.5 / 3 (released ``max_dynamic_patch=12``, 448 px, 256 tokens per tile).

    ``llm_tokens`` = ``256 * tiles + 2`` (the processor's ``<img>`` and ``</img>``). Videos: every
    sampled frame is one 448 px tile (``max_num=1``); ``video_frames`` frames are sampled
    (``num_segments``; InternVL's own video examples use 8, its ``load_video`` default is 32) and
    each frame is ``<img>`` + 256 + ``</img>``; the ``FrameN: `` labels and ``\\n`` separators the
    processor also writes are text (a few tokens per frame) and not counted here.

    ``multi_image_budget=True`` reproduces InternVL's own fine-tuning code
    (``internvl_chat_finetune.py``), which splits the tile budget among a sample's images
    (``max_num = max(1, max_dynamic_patch // num_images)``); transformers' processor gives every
    image the full budget (the default). Apply it through
    :func:`~balancer_cli.scan.rules.base.count_images`.
    """

    name: str = "internvl"
    image_size: int = 448
    patch_size: int = 14
    downsample_ratio: float = 0.5
    min_tiles: int = 1
    max_tiles: int = 12
    use_thumbnail: bool = True
    multi_image_budget: bool = False
    video_frames: int = 8
    image_token: str = "<image>"
    video_token: str = "<video>"

    @property
    def patches_per_tile(self) -> int:
        """InternViT patches of one tile: ``(image_size / patch_size) ** 2`` (1024)."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_tile(self) -> int:
        """LLM tokens of one tile after pixel shuffle (256)."""
        return int(self.patches_per_tile * self.downsample_ratio**2)

    def for_images(self, num_images: int) -> InternVLRule:
        """With ``multi_image_budget``, each of ``num_images`` images gets ``max_tiles // num_images`` tiles."""
        if num_images > 1 and self.multi_image_budget:
            return dataclasses.replace(self, max_tiles=max(1, self.max_tiles // num_images))
        return self

    def num_tiles(self, width: int, height: int) -> int:
        """Tiles of an image, the thumbnail included."""
        check_size(self.name, width, height)
        if self.max_tiles <= 1:
            return 1
        cols, rows = closest_tile_grid(width, height, self.image_size, self.min_tiles, self.max_tiles)
        tiles = cols * rows
        return tiles + 1 if self.use_thumbnail and tiles > 1 else tiles

    def _count(self, tiles: int, wrappers: int) -> MediaCount:
        return MediaCount(tiles * self.patches_per_tile, tiles,
                          tiles * self.tokens_per_tile + wrappers, (self.patches_per_tile,) * tiles)

    def count_image(self, width: int, height: int) -> MediaCount:
        """Tokens of one image (``items`` = tiles incl. thumbnail)."""
        return self._count(self.num_tiles(width, height), 2)

    def count_video(self, num_frames: int, width: int, height: int, fps: float | None = None,
                    duration_s: float | None = None) -> MediaCount:
        """Tokens of one video: ``video_frames`` single-tile frames, whatever the video's length.

        InternVL's ``get_index`` picks ``num_segments`` evenly spaced frames (repeating frames
        of very short videos), so the count depends on neither duration nor resolution.
        """
        check_size(self.name, width, height)
        if self.video_frames < 1:
            raise MediaRejected(f"{self.name}: video_frames={self.video_frames} samples no frame")
        return MediaCount(self.video_frames * self.patches_per_tile, self.video_frames,
                          self.video_frames * (self.tokens_per_tile + 2),
                          (self.patches_per_tile,) * self.video_frames)


def _rescale_to_max_len(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect_ratio = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect_ratio)
        height += height % 2
    else:
        height = max_len
        width = int(height * aspect_ratio)
        width += width % 2
    return max(height, 1), max(width, 1)


def _scale_below(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect_ratio = width / height
    if width >= height and width > max_len:
        width = max_len
        height = int(width / aspect_ratio)
    elif height > width and height > max_len:
        height = max_len
        width = int(height * aspect_ratio)
    return max(height, 1), max(width, 1)


def idefics3_grid(width: int, height: int, tile: int, longest_edge: int, max_side: int = 4096
                  ) -> tuple[int, int]:
    """``(rows, cols)`` of Idefics3 / SmolVLM tiles; ``(0, 0)`` when the image is one tile.

    Follows the image processor's pipeline: resize the longest edge to ``longest_edge`` (even
    short side, at most ``max_side``), round both sides up to multiples of ``tile``, split.

    Example:
        >>> idefics3_grid(640, 480, 364, 1456)
        (3, 4)
    """
    h, w = _rescale_to_max_len(height, width, longest_edge)
    h, w = _scale_below(h, w, max_side)
    aspect_ratio = w / h
    if w >= h:
        w = math.ceil(w / tile) * tile
        h = math.ceil(int(w / aspect_ratio) / tile) * tile
    else:
        h = math.ceil(h / tile) * tile
        w = math.ceil(int(h * aspect_ratio) / tile) * tile
    if h > tile or w > tile:
        return (h - tile) // tile + 1, (w - tile) // tile + 1
    return 0, 0


def smolvlm_sampled_frames(total_frames: int, source_fps: float | None, duration_s: float,
                           fps: float = 1.0, max_frames: int = 64, skip_secs: float = 1.0) -> int:
    """Frames ``SmolVLMVideoProcessor.sample_frames`` keeps (uniform, ends skipped, deduplicated).

    Example:
        >>> smolvlm_sampled_frames(300, 30.0, 10.0)
        10
        >>> smolvlm_sampled_frames(0, None, 600.0)
        64
    """
    desired = max(1, min(int(round(fps * duration_s)), max_frames))
    if total_frames <= 0 or not source_fps:
        return desired
    start, end = 0, total_frames - 1
    if skip_secs > 0 and duration_s - 2 * skip_secs > max_frames * fps:
        start, end = int(skip_secs * source_fps), int(total_frames - skip_secs * source_fps)
    start, end = max(0, start), min(end, total_frames - 1)
    if start >= end:
        start, end = 0, total_frames - 1
    return int(np.unique(np.linspace(start, end, desired, dtype=int)).size)


@dataclass(frozen=True)
class Idefics3Rule(VisionRule):
    """Idefics3 (HuggingFaceM4/Idefics3-8B-Llama3) and SmolVLM / SmolVLM2 (``smolvlm`` preset).

    ``idefics3``: 364 px tiles, longest edge 1456, SigLIP patch 14, pixel shuffle 2 -> 169 tokens
    per tile. ``smolvlm``: the 256M/500M SmolVLM(2) configuration, 512 px tiles, longest edge 2048,
    patch 16, shuffle 4 -> 64 tokens per tile (SmolVLM-2.2B: ``image_size=384, longest_edge=1536,
    patch_size=14, scale_factor=3`` -> 81). ``llm_tokens`` is the processor's prompt string: per
    tile ``<fake_token_around_image><row_r_col_c>`` + tokens, a ``\n`` per row, then
    ``\n<fake_token_around_image><global-img>`` + tokens + ``<fake_token_around_image>``
    (``split_newline_extra=1`` for tokenizers that do not merge ``\n\n`` into one token).
    Videos (SmolVLM only): frames sampled at ``fps`` up to ``max_frames``, each one unsplit tile
    (``tokens + 3``); the intro and timestamp text around them is not counted here.
    """

    name: str = "idefics3"
    image_size: int = 364
    longest_edge: int = 1456
    patch_size: int = 14
    scale_factor: int = 2
    do_image_splitting: bool = True
    split_newline_extra: int = 0
    tokens_per_tile: int = 0  # 0: (image_size / patch_size)**2 / scale_factor**2
    video: bool = False
    fps: float = 1.0
    max_frames: int = 64
    image_token: str = "<image>"
    video_token: str = "<video>"

    @property
    def patches_per_tile(self) -> int:
        """Encoder patches of one tile."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def image_seq_len(self) -> int:
        """LLM tokens of one tile after pixel shuffle (169 / 64), or ``tokens_per_tile`` if set."""
        return self.tokens_per_tile or self.patches_per_tile // self.scale_factor**2

    def count_image(self, width: int, height: int) -> MediaCount:
        """Tiles (rows x cols + global image) through the encoder; the prompt string to the LLM."""
        check_size(self.name, width, height)
        rows, cols = (idefics3_grid(width, height, self.image_size, self.longest_edge)
                      if self.do_image_splitting else (0, 0))
        seq = self.image_seq_len
        tiles = rows * cols + 1
        llm = seq + 3
        if rows:
            llm += self.split_newline_extra + rows * (cols * (seq + 2) + 1)
        per = self.patches_per_tile
        return MediaCount(tiles * per, tiles, llm, (per,) * tiles)

    def sampled_frames(self, num_frames: int, fps: float | None = None,
                       duration_s: float | None = None) -> int:
        """Frames the SmolVLM video processor keeps (all given frames without fps/duration)."""
        total, duration = frames_from_metadata(num_frames, fps, duration_s)
        if duration is None:
            return total
        return smolvlm_sampled_frames(total, fps, duration, self.fps, self.max_frames)

    def count_video(self, num_frames: int, width: int, height: int, fps: float | None = None,
                    duration_s: float | None = None) -> MediaCount:
        """SmolVLM: one unsplit tile of ``image_seq_len + 3`` tokens per sampled frame."""
        check_size(self.name, width, height)
        if not self.video:
            raise MediaRejected(f"{self.name} does not accept videos", fix="use the smolvlm preset")
        frames = self.sampled_frames(num_frames, fps, duration_s)
        if frames < 1:
            raise MediaRejected(f"{self.name}: video of {num_frames} frames samples no frame")
        per = self.patches_per_tile
        return MediaCount(frames * per, frames, frames * (self.image_seq_len + 3), (per,) * frames)


#: InternVL config keys -> :class:`InternVLRule` fields, in the order they are read (a later key wins).
_INTERNVL_KEYS = (("max_dynamic_patch", "max_tiles"), ("max_patches", "max_tiles"), ("max_num", "max_tiles"),
                  ("min_dynamic_patch", "min_tiles"), ("min_patches", "min_tiles"), ("min_num", "min_tiles"),
                  ("force_image_size", "image_size"), ("use_thumbnail", "use_thumbnail"),
                  ("downsample_ratio", "downsample_ratio"), ("patch_size", "patch_size"))


def internvl_processor_params(config: dict[str, Any], video: dict[str, Any]) -> dict[str, Any]:
    """:class:`InternVLRule` parameters of InternVL's ``config.json`` or a ``GotOcr2`` processor config.

    Example:
        >>> internvl_processor_params({"max_dynamic_patch": 6, "force_image_size": 448}, {})
        {'max_tiles': 6, 'image_size': 448}
    """
    out: dict[str, Any] = {}
    for key, field in _INTERNVL_KEYS:
        if config.get(key) is not None:
            value = config[key]
            out[field] = value if field == "use_thumbnail" else (
                float(value) if field == "downsample_ratio" else int(value))
    if config.get("crop_to_patches") is False:
        out["max_tiles"] = 1
    size = config_section(config, "size")
    if size.get("height"):
        out["image_size"] = int(size["height"])
    vision = config_section(config, "vision_config")
    if vision.get("image_size") and "image_size" not in out:
        out["image_size"] = int(vision["image_size"])
    if vision.get("patch_size") and "patch_size" not in out:
        out["patch_size"] = int(vision["patch_size"])
    if video.get("num_frames"):
        out["video_frames"] = int(video["num_frames"])
    return out


def idefics3_processor_params(config: dict[str, Any], video: dict[str, Any]) -> dict[str, Any]:
    """:class:`Idefics3Rule` parameters of an Idefics3 / SmolVLM model folder's merged configs.

    Example:
        >>> idefics3_processor_params({"max_image_size": {"longest_edge": 384}, "scale_factor": 3}, {})
        {'image_size': 384, 'scale_factor': 3}
    """
    out: dict[str, Any] = {}
    tile = config_section(config, "max_image_size").get("longest_edge")
    if tile:
        out["image_size"] = int(tile)
    longest = config_section(config, "size").get("longest_edge")
    if longest:
        out["longest_edge"] = int(longest)
    if config.get("do_image_splitting") is not None:
        out["do_image_splitting"] = bool(config["do_image_splitting"])
    vision = config_section(config, "vision_config")
    if vision.get("patch_size"):
        out["patch_size"] = int(vision["patch_size"])
    if config.get("scale_factor"):
        out["scale_factor"] = int(config["scale_factor"])
    if config.get("image_seq_len"):
        out["tokens_per_tile"] = int(config["image_seq_len"])
    sampling = config_section(config, "video_sampling") or video
    if sampling.get("fps"):
        out["fps"] = float(sampling["fps"])
    if sampling.get("max_frames"):
        out["max_frames"] = int(sampling["max_frames"])
    return out
