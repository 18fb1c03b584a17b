"""Per-family adapters of :class:`~balancer_cli.scan.rules.hf.HFRule`: transformers' size-only APIs
turned into encoder tokens, items, per-item sequence lengths and LLM placeholder tokens.

Each backend holds the folder's transformers objects: the image processor (Pillow backend, from
``AutoImageProcessor``), the video processor (imported from its module; ``None`` where its import
needs torchvision), the feature extractor (audio), and an attribute-only instance of the
processor class (``object.__new__``: its constructor type-checks a video processor, which fails
without torchvision, while the ``replace_*_token`` methods only read attributes). Processor
placeholder strings are built with one pad per merged patch group and counted with the folder's
tokenizer split at its added tokens, then the remaining pads are added: pads are single added
tokens, so the count is exact and independent of the clip's size.

Example:
    >>> sorted(BACKENDS)
    ['gemma3', 'glm4v', 'pixtral', 'qwen2-vl', 'qwen2.5-omni', 'qwen3-omni', 'qwen3-vl']
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import numpy as np

from balancer_cli.errors import UsageError
from balancer_cli.scan.rules.base import (
    MediaCount,
    MediaRejected,
    check_size,
    frames_from_metadata,
)

__all__ = ["BACKENDS", "FAMILY_SPECIALS", "make_backend", "probe_notes", "token_names"]

#: The frame rate assumed when a record gives neither ``fps`` nor a frame count (transformers' own).
SOURCE_FPS = 24.0

#: family -> (processor module, processor class, default video processor class, image/video/audio tokens)
_FAMILY = {
    "qwen2-vl": ("qwen2_vl", "Qwen2VLProcessor", "Qwen2VLVideoProcessor", ("<|image_pad|>", "<|video_pad|>", "")),
    "qwen3-vl": ("qwen3_vl", "Qwen3VLProcessor", "Qwen3VLVideoProcessor", ("<|image_pad|>", "<|video_pad|>", "")),
    "glm4v": ("glm4v", "Glm4vProcessor", "Glm4vVideoProcessor", ("<|image|>", "<|video|>", "")),
    "gemma3": ("gemma3", "Gemma3Processor", "", ("<start_of_image>", "<video>", "")),
    "pixtral": ("pixtral", "PixtralProcessor", "", ("[IMG]", "<video>", "")),
    "qwen2.5-omni": ("qwen2_5_omni", "Qwen2_5OmniProcessor", "Qwen2VLVideoProcessor",
                     ("<|IMAGE|>", "<|VIDEO|>", "<|AUDIO|>")),
    "qwen3-omni": ("qwen3_omni_moe", "Qwen3OmniMoeProcessor", "Qwen2VLVideoProcessor",
                   ("<|IMAGE|>", "<|VIDEO|>", "<|AUDIO|>")),
}
#: The added tokens each family's placeholder strings hold (for folders without a tokenizer.json).
FAMILY_SPECIALS = {
    "qwen2-vl": ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
    "qwen3-vl": ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
    "glm4v": ("<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|video|>"),
    "gemma3": ("<start_of_image>", "<end_of_image>", "<image_soft_token>"),
    "pixtral": ("[IMG]", "[IMG_BREAK]", "[IMG_END]"),
    "qwen2.5-omni": ("<|IMAGE|>", "<|VIDEO|>", "<|AUDIO|>"),
    "qwen3-omni": ("<|IMAGE|>", "<|VIDEO|>", "<|AUDIO|>"),
}
_VIDEO_MODULES = {"Qwen2VLVideoProcessor": "qwen2_vl", "Qwen3VLVideoProcessor": "qwen3_vl",
                  "Glm4vVideoProcessor": "glm4v", "Glm46VVideoProcessor": "glm46v"}
_NOT_KWARGS = {"video_processor_type", "image_processor_type", "processor_class", "feature_extractor_type", "auto_map"}


def token_names(family: str, configs: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The placeholder tokens of a family (the tokenizer config's ``image_token`` etc. win)."""
    image, video, audio = _FAMILY[family][3] if family else ("<image>", "<video>", "<audio>")
    tok = configs["tokenizer"]
    out = {"image_token": tok.get("image_token") or image, "video_token": tok.get("video_token") or video}
    if family == "gemma3":
        out["image_token"] = tok.get("boi_token") or image
    if audio:
        out["audio_token"] = tok.get("audio_token") or audio
    return out


def _video_processor(family: str, configs: dict[str, dict[str, Any]]) -> tuple[Any, str]:
    """``(video processor or None, why not)`` built from the folder's video (else image) config."""
    config = configs["video"] or configs["image"]
    name = config.get("video_processor_type") or _FAMILY[family][2]
    if not name:
        return None, ""
    module = _VIDEO_MODULES.get(name)
    if module is None:
        return None, f"no adapter for video processor {name}"
    try:
        cls = getattr(importlib.import_module(f"transformers.models.{module}.video_processing_{module}"), name)
    except ImportError as exc:  # Qwen2VLVideoProcessor imports torchvision at module level
        return None, f"{name} cannot be imported here ({exc})"
    return cls.from_dict({k: v for k, v in config.items() if k not in _NOT_KWARGS}), ""


def probe_notes(rule: Any, configs: dict[str, dict[str, Any]]) -> tuple[str, ...]:
    """What of ``rule``'s folder is not counted through transformers here (e.g. videos without torchvision)."""
    _, why = _video_processor(rule.family, configs)
    return (f"videos counted by the {rule.fast_preset} preset rule: {why}",) if why else ()


def _shell(family: str, **attributes: Any) -> Any:
    module, name = _FAMILY[family][0], _FAMILY[family][1]
    cls = getattr(importlib.import_module(f"transformers.models.{module}.processing_{module}"), name)
    shell = object.__new__(cls)
    for key, value in attributes.items():
        setattr(shell, key, value)
    return shell


def _rejected(what: str, exc: Exception) -> MediaRejected:
    return MediaRejected(f"{what}: {exc}", fix="crop or pad the media, or drop the sample")


class QwenBackend:
    """Qwen2-VL / Qwen2.5-VL: ``get_number_of_image_patches``, ``sample_frames``, ``get_num_of_video_patches``."""

    def __init__(self, rule: Any, configs: dict[str, dict[str, Any]]) -> None:
        from transformers import AutoImageProcessor

        self.rule, self.configs = rule, configs
        self._splitter: Any = None
        self.kwargs = dict(rule.overrides)
        self.image_processor = AutoImageProcessor.from_pretrained(rule.path, local_files_only=True)
        self.video_processor, _ = _video_processor(rule.family, configs)
        self.shell = self.make_shell()
        self.images_kwargs = {k: v for k, v in self.kwargs.items() if not k.startswith("video_")}
        self.videos_kwargs = {**self.default_videos_kwargs(),
                              **{k.removeprefix("video_"): v for k, v in self.kwargs.items() if k.startswith("video_")}}

    def make_shell(self) -> Any:
        """An attribute-only instance of the folder's processor class."""
        return _shell(self.rule.family, image_processor=self.image_processor, video_processor=self.video_processor,
                      image_token=self.rule.image_token, video_token=self.rule.video_token,
                      vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>")

    def default_videos_kwargs(self) -> dict[str, Any]:
        """Video keyword arguments the processor passes by default (Omni: its frame-size bounds)."""
        return {}

    def text_tokens(self, text: str) -> int:
        """Tokens of a processor placeholder string with the folder's tokenizer."""
        from balancer_cli.scan.rules.hf_template import (
            SpecialSplitter,
            special_splitter,
        )
        from balancer_cli.scan.text import load_tokenizer

        if self._splitter is None:
            self._splitter = (SpecialSplitter(self.rule.specials) if self.rule.specials
                              else special_splitter(self.rule.path))
        return self._splitter.count(text, load_tokenizer(self.rule.text_tokenizer or self.rule.path))

    def image(self, width: int, height: int) -> MediaCount:
        """One image: the image processor's patches, ``merge_size**2`` of them per LLM token."""
        check_size(self.rule.name, width, height)
        try:
            patches = int(self.image_processor.get_number_of_image_patches(height, width, dict(self.images_kwargs)))
        except ValueError as exc:
            raise _rejected(f"{width}x{height} image", exc) from None
        merge = self.images_kwargs.get("merge_size") or self.image_processor.merge_size
        return MediaCount(patches, 1, patches // merge**2, (patches,))

    def frames(self, num_frames: int, fps: float | None, duration_s: float | None) -> tuple[np.ndarray, Any]:
        """``(frame indices the video processor keeps, their VideoMetadata)``."""
        from transformers.video_utils import VideoMetadata

        total, duration = frames_from_metadata(num_frames, fps, duration_s)
        if duration is None:  # frames handed over already sampled
            return np.arange(total), VideoMetadata(total_num_frames=total, fps=fps, frames_indices=list(range(total)))
        fps = fps if fps is not None else (total / duration if total and duration else SOURCE_FPS)
        total = total if total > 0 else max(1, int(round(duration * fps)))
        meta = VideoMetadata(total_num_frames=total, fps=fps, duration=duration)
        sample = self.kwargs.get("do_sample_frames", getattr(self.video_processor, "do_sample_frames", False))
        options = {k: self.kwargs[k] for k in ("fps", "num_frames") if k in self.kwargs}
        try:
            indices = np.asarray(self.video_processor.sample_frames(meta, **options)) if sample else np.arange(total)
        except ValueError as exc:
            raise _rejected(f"video of {total} frames", exc) from None
        meta.frames_indices = indices.tolist()
        return indices, meta

    def video(self, num_frames: int, width: int, height: int, fps: float | None,
              duration_s: float | None) -> MediaCount:
        """One video: temporal patches (items) of ``get_num_of_video_patches / grid_t`` patches each."""
        check_size(self.rule.name, width, height)
        indices, meta = self.frames(num_frames, fps, duration_s)
        n, vp = len(indices), self.video_processor
        if n < 1:
            raise MediaRejected(f"{self.rule.name}: video of {num_frames} frames samples no frame")
        try:
            patches = int(vp.get_num_of_video_patches(n, height, width, dict(self.videos_kwargs)))
        except ValueError as exc:
            raise _rejected(f"video of {n} sampled frames", exc) from None
        grid_t = -(-n // (self.videos_kwargs.get("temporal_patch_size") or vp.temporal_patch_size))
        per_t = patches // grid_t
        merge = self.videos_kwargs.get("merge_size") or vp.merge_size
        return MediaCount(patches, grid_t, self.video_llm(grid_t, per_t // merge**2, merge, meta), (per_t,) * grid_t)

    def video_llm(self, grid_t: int, per_group: int, merge: int, meta: Any) -> int:
        """LLM tokens replacing the video placeholder (Qwen2-VL: the pads only)."""
        return grid_t * per_group


class Qwen3Backend(QwenBackend):
    """Qwen3-VL: ``replace_video_token`` adds ``<t seconds>`` text and wrappers per temporal patch."""

    def video_llm(self, grid_t: int, per_group: int, merge: int, meta: Any) -> int:
        """Pads + the processor's timestamp text and ``<|vision_start|>``/``<|vision_end|>`` per group."""
        grid = np.array([[grid_t, merge * merge, 1]])  # one pad per group; the others are added below
        text = self.shell.replace_video_token({"video_grid_thw": grid, "video_metadata": [meta]}, 0)
        return self.text_tokens(text) + grid_t * (per_group - 1)


class GlmBackend(Qwen3Backend):
    """GLM-4.1V: its image processor budgets an image as two frames; videos carry integer timestamps."""

    def __init__(self, rule: Any, configs: dict[str, dict[str, Any]]) -> None:
        super().__init__(rule, configs)
        self.shell.image_token = rule.image_token


class OmniBackend(QwenBackend):
    """Qwen2.5-Omni / Qwen3-Omni: Qwen2-VL vision with the processor's video bounds, and audio."""

    def __init__(self, rule: Any, configs: dict[str, dict[str, Any]]) -> None:
        from transformers import AutoFeatureExtractor

        super().__init__(rule, configs)
        self.feature_extractor = AutoFeatureExtractor.from_pretrained(rule.path, local_files_only=True)
        audio = (configs["model"].get("thinker_config") or {}).get("audio_config") or {}
        self.shell.feature_extractor = self.feature_extractor
        self.n_window = int(self.kwargs.get("n_window", audio.get("n_window", getattr(self.shell, "n_window", 100))))
        self.n_window_infer = int(audio.get("n_window_infer", 800))

    def default_videos_kwargs(self) -> dict[str, Any]:
        """The processor class's ``videos_kwargs`` (frame-size bounds that override the video config)."""
        return dict(getattr(self.shell, "videos_kwargs", {}) or {})

    def audio(self, duration_s: float) -> MediaCount:
        """One clip: ``_get_num_audio_tokens`` of its samples; windows as the audio encoder attends."""
        from balancer_cli.scan.rules.omni import qwen3_omni_audio, qwen25_omni_audio

        samples = int(round(duration_s * self.feature_extractor.sampling_rate))
        llm = int(self.shell._get_num_audio_tokens(samples, n_window=self.n_window))
        hop, cap = self.feature_extractor.hop_length, self.feature_extractor.nb_max_frames
        if self.rule.family == "qwen3-omni":
            count = qwen3_omni_audio(samples // hop, self.n_window, self.n_window_infer)
        else:
            count = qwen25_omni_audio(min(math.ceil(samples / hop), cap), self.n_window)
        if llm < 1:
            raise MediaRejected(f"{self.rule.name}: audio clip of {duration_s} s holds no audio token")
        return MediaCount(count.encoder_tokens, count.items, llm, count.seqlens)


class Gemma3Backend(QwenBackend):
    """Gemma 3: ``pan_and_scan`` on a zero-stride array of the image's size, ``replace_image_token``."""

    def __init__(self, rule: Any, configs: dict[str, dict[str, Any]]) -> None:
        super().__init__(rule, configs)
        tok, processor = configs["tokenizer"], configs["processor"]
        self.seq = int(processor.get("image_seq_length") or configs["image"].get("image_seq_length") or 256)
        view = "".join([tok.get("image_token") or "<image_soft_token>"] * self.seq)
        self.shell.full_image_sequence = (f"\n\n{rule.image_token}{view}"
                                          f"{tok.get('eoi_token') or '<end_of_image>'}\n\n")
        defaults = dict(getattr(self.shell, "images_kwargs", {}) or {})
        ip = self.image_processor
        self.pan = {k: self.kwargs.get(k, getattr(ip, k, None) if getattr(ip, k, None) is not None else defaults.get(k))
                    for k in ("do_pan_and_scan", "pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
                              "pan_and_scan_min_ratio_to_activate")}
        patch = (configs["model"].get("vision_config") or {}).get("patch_size", 14)
        self.patches = (ip.size["height"] // patch) * (ip.size["width"] // patch)

    def image(self, width: int, height: int) -> MediaCount:
        """``1 + crops`` views of the encoder's patches; the processor's replacement string to the LLM."""
        check_size(self.rule.name, width, height)
        crops = 0
        if self.pan["do_pan_and_scan"]:
            fake = np.broadcast_to(np.uint8(0), (3, height, width))  # no pixels allocated
            crops = len(self.image_processor.pan_and_scan(
                image=fake, pan_and_scan_min_crop_size=self.pan["pan_and_scan_min_crop_size"],
                pan_and_scan_max_num_crops=self.pan["pan_and_scan_max_num_crops"],
                pan_and_scan_min_ratio_to_activate=self.pan["pan_and_scan_min_ratio_to_activate"]))
        text = self.shell.replace_image_token({"num_crops": [crops]}, 0)
        views = 1 + crops
        return MediaCount(views * self.patches, views, self.text_tokens(text), (self.patches,) * views)


class PixtralBackend(QwenBackend):
    """Pixtral / Mistral 3: the Pillow image processor's resize helper; the processor's row layout.

    ``PixtralProcessor``'s module imports the torchvision image processor, so its
    ``replace_image_token`` layout (``[IMG]`` per merged patch, ``[IMG_BREAK]`` per row, the last
    one ``[IMG_END]``) is written out here: ``rows * (cols + 1)`` added tokens.
    """

    def __init__(self, rule: Any, configs: dict[str, dict[str, Any]]) -> None:
        super().__init__(rule, configs)
        processor, model = configs["processor"], configs["model"]
        self.patch = int(processor.get("patch_size") or (model.get("vision_config") or {}).get("patch_size") or 16)
        self.merge = int(processor.get("spatial_merge_size") or model.get("spatial_merge_size") or 1)

    def make_shell(self) -> Any:
        """None: the processor module needs torchvision (see the class docstring)."""
        return None

    def image(self, width: int, height: int) -> MediaCount:
        """Patches of the resized image; ``[IMG]`` per merged patch + a break/end token per row."""
        module = importlib.import_module("transformers.models.pixtral.image_processing_pil_pixtral")
        check_size(self.rule.name, width, height)
        longest = self.images_kwargs.get("longest_edge") or self.image_processor.size["longest_edge"]
        unit = self.patch * self.merge
        ratio = max(height / longest, width / longest)
        if ratio > 1 and min(math.floor(height / ratio), math.floor(width / ratio)) < 1:
            raise MediaRejected(f"a {width}x{height} image shrinks to nothing under longest_edge={longest}",
                                fix="crop or pad the image, or drop the sample")
        h, w = module.get_resize_output_image_size(np.broadcast_to(np.uint8(0), (height, width, 3)),
                                                   size=(longest, longest), patch_size=(unit, unit),
                                                   input_data_format="channels_last")
        patches = (h // self.patch) * (w // self.patch)
        return MediaCount(patches, 1, (h // unit) * (w // unit + 1), (patches,))


BACKENDS = {"qwen2-vl": QwenBackend, "qwen3-vl": Qwen3Backend, "glm4v": GlmBackend, "gemma3": Gemma3Backend,
            "pixtral": PixtralBackend, "qwen2.5-omni": OmniBackend, "qwen3-omni": OmniBackend}


def make_backend(rule: Any, configs: dict[str, dict[str, Any]]) -> Any:
    """The backend of ``rule.family`` over the folder's transformers classes (imported here)."""
    try:
        return BACKENDS[rule.family](rule, configs)
    except ImportError as exc:
        raise UsageError(f"--model {rule.name} needs transformers ({exc})", fix="pip install transformers") from None
