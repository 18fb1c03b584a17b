"""Pixtral / Mistral 3 vision-token rule: native resolution up to a longest edge, row-break tokens.

``PixtralImageProcessor`` shrinks an image whose longest side exceeds ``longest_edge`` (floor of
the scaled sides), then rounds both sides up to multiples of ``patch_size * spatial_merge_size``
(``PixtralProcessor`` passes that product as the processor's patch size). The vision tower sees
``(H / patch_size) x (W / patch_size)`` patches; after the ``spatial_merge_size`` x
``spatial_merge_size`` patch merger the LLM sees one ``[IMG]`` per merged patch plus one
``[IMG_BREAK]`` per row, the last one replaced by ``[IMG_END]``: ``rows * (cols + 1)`` tokens.

Presets (released ``preprocessor_config.json`` / ``processor_config.json`` values):

- ``pixtral``: ``mistral-community/pixtral-12b``: ``patch_size 16``, ``size.longest_edge 1024``,
  ``spatial_merge_size 1``.
- ``mistral3``: ``mistralai/Mistral-Small-3.1-24B-Instruct-2503`` (and 3.2): ``patch_size 14``,
  ``size.longest_edge 1540``, ``spatial_merge_size 2``.

Example:
    >>> PixtralRule().count_image(1920, 1080)
    MediaCount(encoder_tokens=2304, items=1, llm_tokens=2340, seqlens=(2304,))
    >>> PixtralRule(name="mistral3", patch_size=14, longest_edge=1540, spatial_merge_size=2).count_image(1920, 1080)
    MediaCount(encoder_tokens=6820, items=1, llm_tokens=1736, seqlens=(6820,))
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
)

__all__ = ["PixtralRule", "pixtral_processor_params", "pixtral_resized_size"]


def pixtral_resized_size(width: int, height: int, longest_edge: int, patch: int) -> tuple[int, int]:
    """``(width, height)`` after ``PixtralImageProcessor``'s resize with processor patch ``patch``.

    Raises :class:`MediaRejected` when a side shrinks to zero pixels (the processor cannot resize it).

    Example:
        >>> pixtral_resized_size(1920, 1080, 1024, 16)
        (1024, 576)
    """
    ratio = max(height / longest_edge, width / longest_edge)
    if ratio > 1:
        height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
    if height < 1 or width < 1:
        raise MediaRejected(f"a {width}x{height} image shrinks to nothing under longest_edge={longest_edge} "
                            "(aspect ratio too extreme)", fix="crop or pad the image, or drop the sample")
    return ((width - 1) // patch + 1) * patch, ((height - 1) // patch + 1) * patch


@dataclass(frozen=True)
class PixtralRule(VisionRule):
    """Pixtral-12B (``pixtral``) and Mistral-Small-3.x / Mistral 3 (``mistral3``); no video input."""

    name: str = "pixtral"
    patch_size: int = 16
    longest_edge: int = 1024
    spatial_merge_size: int = 1
    image_token: str = "[IMG]"
    video_token: str = "<video>"

    def count_image(self, width: int, height: int) -> MediaCount:
        """Patches through the vision tower; merged patches + one break/end token per row to the LLM."""
        check_size(self.name, width, height)
        unit = self.patch_size * self.spatial_merge_size
        w, h = pixtral_resized_size(width, height, self.longest_edge, unit)
        rows, cols = h // unit, w // unit
        patches = (h // self.patch_size) * (w // self.patch_size)
        return MediaCount(patches, 1, rows * (cols + 1), (patches,))

    def count_video(self, num_frames: int, width: int, height: int, fps: float | None = None,
                    duration_s: float | None = None) -> MediaCount:
        """Pixtral / Mistral 3 have no video input."""
        raise MediaRejected(f"{self.name} does not accept videos",
                            fix="use a video-capable preset (qwen3-vl, qwen2-vl, glm-4.1v, internvl, ...)")


def pixtral_processor_params(config: dict[str, Any], video: dict[str, Any]) -> dict[str, Any]:
    """:class:`PixtralRule` parameters of a Pixtral / Mistral 3 folder's merged configs.

    ``patch_size`` is the processor's (``processor_config.json``: an int) or the image
    processor's (``{"height": 14, "width": 14}``); ``spatial_merge_size`` is the processor's or
    ``config.json``'s.

    Example:
        >>> pixtral_processor_params({"patch_size": {"height": 14}, "size": {"longest_edge": 1540},
        ...                           "spatial_merge_size": 2}, {})
        {'patch_size': 14, 'longest_edge': 1540, 'spatial_merge_size': 2}
    """
    out: dict[str, Any] = {}
    patch = config.get("patch_size")
    if isinstance(patch, dict):
        patch = patch.get("height")
    if patch is None:
        patch = config_section(config, "vision_config").get("patch_size")
    if patch:
        out["patch_size"] = int(patch)
    longest = config_section(config, "size").get("longest_edge")
    if longest:
        out["longest_edge"] = int(longest)
    if config.get("spatial_merge_size"):
        out["spatial_merge_size"] = int(config["spatial_merge_size"])
    return out
