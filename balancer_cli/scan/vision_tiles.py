"""Tiling vision-token rules: InternVL's dynamic 448 px tiles (+ thumbnail).

InternVL (1.5, 2, 2.5, 3) splits an image into a ``cols x rows`` grid of 448 px tiles whose aspect
ratio is closest to the image's (``dynamic_preprocess`` / transformers' ``GotOcr2ImageProcessor``
with ``crop_to_patches=True``), adds a 448 px thumbnail when there is more than one tile, runs
every tile through InternViT (1024 patches of 14 px) and pixel-shuffles each to 256 LLM tokens.

Example:
    >>> c = InternVLRule().count_image(640, 480)    # 4 x 3 tiles + thumbnail
    >>> c.items, c.encoder_tokens, c.llm_tokens
    (13, 13312, 3330)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from balancer_cli.scan.vision_base import MediaCount, MediaRejected, check_size

__all__ = ["InternVLRule", "tile_grids", "closest_tile_grid"]


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
class InternVLRule:
    """InternVL 1.5 / 2 / 2.5 / 3 (released ``max_dynamic_patch=12``, 448 px, 256 tokens per tile).

    ``llm_tokens`` = ``256 * tiles + 2`` (the processor's ``<img>`` and ``</img>``). Videos: every
    sampled frame is one 448 px tile (``max_num=1``); ``video_frames`` frames are sampled
    (``num_segments``; InternVL's own video examples use 8, its ``load_video`` default is 32) and
    each frame is ``<img>`` + 256 + ``</img>``; the ``FrameN: `` labels and ``\\n`` separators the
    processor also writes are text (a few tokens per frame) and not counted here.
    """

    name: str = "internvl"
    image_size: int = 448
    patch_size: int = 14
    downsample_ratio: float = 0.5
    min_tiles: int = 1
    max_tiles: int = 12
    use_thumbnail: bool = True
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
