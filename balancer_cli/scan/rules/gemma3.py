"""Gemma 3 vision-token rule: a fixed 896 px SigLIP view (256 tokens), optional pan-and-scan crops.

Every image (and every pan-and-scan crop) is resized to 896 x 896, encoded by SigLIP-So400m/14
(64 x 64 = 4,096 patches) and average-pooled to ``image_seq_length = 256`` LLM tokens.
``Gemma3Processor`` replaces each ``<start_of_image>`` with
``"\\n\\n<start_of_image>" + 256 x <image_soft_token> + "<end_of_image>\\n\\n"``; with pan-and-scan
(``do_pan_and_scan=True``) and ``n`` crops it writes ``"Here is the original image " + view +
" and here are some crops to help you see better " + " ".join([view] * n)``. The crop count follows
``Gemma3ImageProcessor.pan_and_scan`` (only images whose aspect ratio reaches
``pan_and_scan_min_ratio_to_activate``; 2..``pan_and_scan_max_num_crops`` crops of at least
``pan_and_scan_min_crop_size`` px). Note that transformers' size-only
``Gemma3Processor._get_num_multimodal_tokens`` ignores pan-and-scan (always 256); this rule
follows what the processor call does.

``llm_tokens`` counts each view as 256 + 2 (``<start_of_image>``, ``<end_of_image>``) + the two
``\\n\\n`` (one token each in Gemma 3's vocabulary). With pan-and-scan, the wording and the
newlines around the views form the text pieces between added tokens; they are counted with
``text_tokenizer`` when one is given (e.g. the model folder's ``tokenizer.json``), else with the
fixed counts ``crop_text_tokens`` (6 + 11 tokens of wording, 1 per joining space, the newlines
apart; an estimate, since Gemma's tokenizer is not bundled). Gemma 3 has no video input.

Defaults: ``google/gemma-3-*-it`` ``preprocessor_config.json`` (``size 896x896``,
``do_pan_and_scan null``) and ``processor_config.json`` (``image_seq_length 256``); the
pan-and-scan limits are ``Gemma3Processor``'s defaults (``min_crop_size 256``,
``max_num_crops 4``, ``min_ratio_to_activate 1.2``).

Example:
    >>> Gemma3Rule().count_image(1920, 1080)
    MediaCount(encoder_tokens=4096, items=1, llm_tokens=260, seqlens=(4096,))
    >>> Gemma3Rule(do_pan_and_scan=True).count_image(1920, 1080).items    # original + 2 crops
    3
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

__all__ = ["Gemma3Rule", "gemma3_processor_params", "pan_and_scan_crops"]

_ORIGINAL = "Here is the original image "
_CROPS = " and here are some crops to help you see better "


def pan_and_scan_crops(width: int, height: int, min_crop_size: int = 256, max_num_crops: int = 4,
                       min_ratio_to_activate: float = 1.2) -> int:
    """Crops ``Gemma3ImageProcessor.pan_and_scan`` cuts from an image (0: none).

    Example:
        >>> pan_and_scan_crops(1920, 1080), pan_and_scan_crops(1000, 900), pan_and_scan_crops(300, 2000)
        (2, 0, 4)
    """
    if width >= height:
        if width / height < min_ratio_to_activate:
            return 0
        crops_w = min(int(math.floor(width / min_crop_size)), int(math.floor(width / height + 0.5)))
        crops_w, crops_h = min(max_num_crops, max(2, crops_w)), 1
    else:
        if height / width < min_ratio_to_activate:
            return 0
        crops_h = min(int(math.floor(height / min_crop_size)), int(math.floor(height / width + 0.5)))
        crops_w, crops_h = 1, min(max_num_crops, max(2, crops_h))
    if min(int(math.ceil(width / crops_w)), int(math.ceil(height / crops_h))) < min_crop_size:
        return 0
    return crops_w * crops_h


@dataclass(frozen=True)
class Gemma3Rule(VisionRule):
    """Gemma 3 (4B, 12B, 27B; also MedGemma / ShieldGemma 2 vision checkpoints)."""

    name: str = "gemma3"
    image_size: int = 896
    patch_size: int = 14
    image_seq_length: int = 256
    do_pan_and_scan: bool = False
    pan_and_scan_min_crop_size: int = 256
    pan_and_scan_max_num_crops: int = 4
    pan_and_scan_min_ratio_to_activate: float = 1.2
    newline_tokens: int = 1
    crop_text_tokens: tuple[int, int, int] = (6, 11, 1)
    text_tokenizer: str = ""
    image_token: str = "<start_of_image>"
    video_token: str = "<video>"

    def crops(self, width: int, height: int) -> int:
        """Pan-and-scan crops of an image (0 when pan-and-scan is off or does not apply)."""
        if not self.do_pan_and_scan:
            return 0
        return pan_and_scan_crops(width, height, self.pan_and_scan_min_crop_size, self.pan_and_scan_max_num_crops,
                                  self.pan_and_scan_min_ratio_to_activate)

    def _text_tokens(self, crops: int) -> int:
        """Tokens of the text between the views' added tokens (newlines merge with the wording)."""
        if not self.text_tokenizer:
            original, more, join = self.crop_text_tokens
            return 2 * (1 + crops) * self.newline_tokens + (original + more + join * (crops - 1) if crops else 0)
        from balancer_cli.scan.text import load_tokenizer

        pieces = (["\n\n", "\n\n"] if not crops else
                  [_ORIGINAL + "\n\n", "\n\n" + _CROPS + "\n\n"] + ["\n\n \n\n"] * (crops - 1) + ["\n\n"])
        return sum(load_tokenizer(self.text_tokenizer).count_batch(pieces))

    def count_image(self, width: int, height: int) -> MediaCount:
        """``1 + crops`` views of ``(image_size / patch_size)**2`` patches and 256 + 4 LLM tokens each."""
        check_size(self.name, width, height)
        crops = self.crops(width, height)
        views = 1 + crops
        patches = (self.image_size // self.patch_size) ** 2
        llm = views * (self.image_seq_length + 2) + self._text_tokens(crops)
        return MediaCount(views * patches, views, llm, (patches,) * views)

    def count_video(self, num_frames: int, width: int, height: int, fps: float | None = None,
                    duration_s: float | None = None) -> MediaCount:
        """Gemma 3 has no video input."""
        raise MediaRejected(f"{self.name} does not accept videos",
                            fix="use a video-capable preset (qwen3-vl, qwen2-vl, glm-4.1v, internvl, ...)")


def gemma3_processor_params(config: dict[str, Any], video: dict[str, Any]) -> dict[str, Any]:
    """:class:`Gemma3Rule` parameters of a Gemma 3 model folder's merged configs.

    Example:
        >>> gemma3_processor_params({"size": {"height": 896}, "do_pan_and_scan": None, "image_seq_length": 256}, {})
        {'image_size': 896, 'image_seq_length': 256}
    """
    out: dict[str, Any] = {}
    side = config_section(config, "size").get("height")
    if side:
        out["image_size"] = int(side)
    if config.get("image_seq_length") or config.get("mm_tokens_per_image"):
        out["image_seq_length"] = int(config.get("image_seq_length") or config["mm_tokens_per_image"])
    if config.get("do_pan_and_scan") is not None:
        out["do_pan_and_scan"] = bool(config["do_pan_and_scan"])
    for key, kind in (("pan_and_scan_min_crop_size", int), ("pan_and_scan_max_num_crops", int),
                      ("pan_and_scan_min_ratio_to_activate", float)):
        if config.get(key) is not None:
            out[key] = kind(config[key])
    patch = config_section(config, "vision_config").get("patch_size")
    if patch:
        out["patch_size"] = int(patch)
    return out
