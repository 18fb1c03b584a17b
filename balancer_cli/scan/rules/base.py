"""Shared types of the vision-token rules: :class:`MediaCount`, :class:`MediaRejected`, the protocol.

Every model family's rule is a frozen dataclass implementing :class:`VisionRule`, whose
``count_image`` / ``count_video`` are pure functions of the media size (no pixels are read): they
reproduce what the released processors produce, so a scan over millions of samples costs one
header read per image. :func:`count_images` counts the images of one sample (some families treat
a sample with several images differently).

Example:
    >>> c = MediaCount(encoder_tokens=2048, items=2, llm_tokens=514, seqlens=(1024, 1024))
    >>> c.items == len(c.seqlens) and c.encoder_tokens == sum(c.seqlens)
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from balancer_cli.errors import SampleError

__all__ = ["MediaCount", "MediaRejected", "VisionRule", "check_size", "config_section", "count_images",
           "frames_from_metadata"]


@dataclass(frozen=True)
class MediaCount:
    """What one image or video costs each module.

    Attributes:
        encoder_tokens: patches the vision encoder processes (before any merge / pixel shuffle /
            pooling); e.g. Qwen2-VL ``grid_t * grid_h * grid_w``, InternVL 1024 per 448 px tile.
            The class token of CLIP/InternViT-style encoders is not counted.
        items: the units the encoder attends within, i.e. the unit of the Qv cap: 1 per image for
            Qwen2-VL / LLaVA-1.5, tiles (thumbnail included) for InternVL / Idefics3 / SmolVLM,
            base + crops for LLaVA-NeXT / OneVision, frames (Qwen: temporal patches) for videos.
        llm_tokens: the tokens that replace the processor's media placeholder token
            (``rule.image_token`` / ``rule.video_token``) in the tokenized sequence: the tokens of
            the prompt string the processor writes for the media (transformers'
            ``_get_num_multimodal_tokens`` counted the same until 5.24; from 5.25 Idefics3's counts
            only its ``<image>`` placeholders). Wrapper tokens that the *processor* inserts are included (InternVL ``<img>``/``</img>``, Idefics3 row/column
            and ``<fake_token_around_image>`` tokens, LLaVA-NeXT newline features); wrappers that the
            *chat template* writes around the placeholder (Qwen2-VL ``<|vision_start|>`` and
            ``<|vision_end|>``) are text the template tokenizer counts. To get the sample's LLM
            length, tokenize the text with the placeholder as one token and add ``llm_tokens - 1``.
        seqlens: encoder tokens of each item (per-item attention cost); ``len(seqlens) == items``
            and ``sum(seqlens) == encoder_tokens``.
    """

    encoder_tokens: int
    items: int
    llm_tokens: int
    seqlens: tuple[int, ...]


class MediaRejected(SampleError):
    """The model's processor refuses this media (aspect ratio too extreme, no video support, ...)."""

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 fix: str | None = None) -> None:
        super().__init__(message, kind="rejected_by_model", file=file, line=line, fix=fix)


@runtime_checkable
class VisionRule(Protocol):
    """One model family's exact vision-token rule (implemented by frozen dataclasses that subclass it)."""

    name: str
    image_token: str
    video_token: str

    def count_image(self, width: int, height: int) -> MediaCount:
        """Tokens of one ``width`` x ``height`` image (raises :class:`MediaRejected`)."""
        ...

    def count_video(self, num_frames: int, width: int, height: int, fps: float | None = None,
                    duration_s: float | None = None) -> MediaCount:
        """Tokens of one video (raises :class:`MediaRejected`), see :func:`frames_from_metadata`."""
        ...

    def for_images(self, num_images: int) -> VisionRule:
        """The rule as it applies to each image of a sample with ``num_images`` images (default: itself)."""
        return self


def count_images(rule: VisionRule, sizes: Sequence[tuple[int, int]]) -> list[MediaCount]:
    """Counts of all ``(width, height)`` images of ONE sample, in order.

    Use this rather than calling ``count_image`` per image: LLaVA-OneVision processes a sample
    with several images differently (each image one 384 px crop, no anyres), and InternVL with
    ``multi_image_budget=True`` splits its tile budget among the images (``rule.for_images``).

    Example:
        >>> from balancer_cli.scan.rules.llava import LlavaOnevisionRule
        >>> from balancer_cli.scan.rules.tiles import InternVLRule
        >>> rule = LlavaOnevisionRule()
        >>> [c.llm_tokens for c in count_images(rule, [(640, 480)])]
        [2929]
        >>> [c.llm_tokens for c in count_images(rule, [(640, 480), (640, 480)])]
        [730, 730]
        >>> budget = InternVLRule(multi_image_budget=True)   # InternVL's fine-tuning code
        >>> [c.items for c in count_images(budget, [(1920, 1080)] * 3)]   # max_num 12 // 3 = 4
        [3, 3, 3]
    """
    rule = rule.for_images(len(sizes))
    return [rule.count_image(w, h) for w, h in sizes]


def check_size(name: str, width: int, height: int) -> None:
    """Raise :class:`MediaRejected` unless ``width`` and ``height`` are positive integers.

    Example:
        >>> try:
        ...     check_size("qwen2-vl", 0, 10)
        ... except MediaRejected as exc:
        ...     print(exc.kind, exc)
        rejected_by_model qwen2-vl: invalid media size 0x10 (width and height must be >= 1)
    """
    if int(width) != width or int(height) != height or width < 1 or height < 1:
        raise MediaRejected(f"{name}: invalid media size {width}x{height} (width and height must be >= 1)")


def config_section(config: dict[str, Any], key: str) -> dict[str, Any]:
    """``config[key]`` of a processor config when it is an object, else ``{}``.

    Example:
        >>> config_section({"size": {"height": 448}, "crop_size": 336}, "size"), config_section({}, "crop_size")
        ({'height': 448}, {})
    """
    value = config.get(key)
    return value if isinstance(value, dict) else {}


def frames_from_metadata(num_frames: int, fps: float | None, duration_s: float | None
                         ) -> tuple[int, float | None]:
    """Normalize ``count_video``'s arguments to ``(total_frames, duration_s)``.

    ``num_frames`` is the number of frames the video file holds, ``fps`` its frame rate and
    ``duration_s`` its length; any two determine the third. With ``num_frames <= 0`` and a known
    ``duration_s`` the frame count is unknown (``total_frames = 0``): sampling then follows the
    duration only. Without ``fps`` and ``duration_s`` the rules treat ``num_frames`` as the frames
    already sampled (the processor receives exactly those frames).

    Example:
        >>> frames_from_metadata(300, 30.0, None)
        (300, 10.0)
        >>> frames_from_metadata(0, None, 12.5)
        (0, 12.5)
    """
    if num_frames < 0 or (fps is not None and fps <= 0) or (duration_s is not None and duration_s < 0):
        raise MediaRejected(
            f"invalid video metadata: num_frames={num_frames}, fps={fps}, duration_s={duration_s}")
    if duration_s is None and fps is not None and num_frames > 0:
        duration_s = num_frames / fps
    if num_frames <= 0 and duration_s is not None and fps is not None:
        num_frames = int(round(duration_s * fps))
    return int(num_frames), duration_s
