"""``--model hf:DIR``: media token counts from transformers' own processor classes of a local folder.

:func:`hf_rule` reads a local checkpoint or processor folder (``preprocessor_config.json``,
``video_preprocessor_config.json``, ``processor_config.json`` with or without nested
``image_processor`` / ``video_processor`` sections, ``tokenizer.json``, the chat template) and
returns an :class:`HFRule`, a :class:`~balancer_cli.scan.rules.base.VisionRule` whose counts come
from the folder's transformers classes through their size-only APIs: the image processor's
``get_number_of_image_patches`` (or the family's resize helper), the video processor's
``sample_frames`` and ``get_num_of_video_patches``, and the processor's ``replace_*_token``
strings (timestamps, wrappers, row breaks), counted with the folder's tokenizer. A small adapter
per family (:mod:`~balancer_cli.scan.rules.hf_backends`) turns them into encoder tokens, items
and per-item sequence lengths, whose meaning differs between families. Nothing is downloaded
(``local_files_only``); transformers is imported only when a rule counts.

Families with an adapter: Qwen2-VL / Qwen2.5-VL, Qwen3-VL, GLM-4.1V, Gemma 3, Pixtral / Mistral 3,
Qwen2.5-Omni and Qwen3-Omni. Folders of the other families the scan knows (LLaVA, LLaVA-NeXT,
LLaVA-OneVision, Idefics3, SmolVLM, InternVL) are counted with their preset's rule read from the
folder's configs (``HFRule.fast_preset``, ``counted_by="preset"``). Where a video processor
cannot be imported here (transformers' ``Qwen2VLVideoProcessor`` needs torchvision), videos are
counted with the preset's rule and ``HFRule.notes`` says so.

Example:
    >>> hf_rule("/nonexistent")
    Traceback (most recent call last):
    ...
    balancer_cli.errors.UsageError: --model hf:/nonexistent: not a folder; fix: pass a local model or processor folder (hf:DIR); the scan never downloads
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from balancer_cli.errors import InputError, UsageError
from balancer_cli.scan.rules.base import MediaCount, MediaRejected, VisionRule

__all__ = ["FAMILIES", "HF_PREFIX", "HFRule", "folder_configs", "hf_rule", "is_hf_model"]

HF_PREFIX = "hf:"

#: processor class -> (family adapter, preset with the same rule). Adapter "" = counted by the preset.
FAMILIES: dict[str, tuple[str, str]] = {
    "Qwen2VLProcessor": ("qwen2-vl", "qwen2-vl"),
    "Qwen2_5_VLProcessor": ("qwen2-vl", "qwen2.5-vl"),
    "Qwen3VLProcessor": ("qwen3-vl", "qwen3-vl"),
    "Glm4vProcessor": ("glm4v", "glm-4.1v"),
    "Glm46VProcessor": ("glm4v", "glm-4.1v"),
    "Gemma3Processor": ("gemma3", "gemma3"),
    "PixtralProcessor": ("pixtral", "pixtral"),
    "Qwen2_5OmniProcessor": ("qwen2.5-omni", "qwen2.5-omni"),
    "Qwen3OmniMoeProcessor": ("qwen3-omni", "qwen3-omni"),
    "LlavaProcessor": ("", "llava-1.5"),
    "LlavaNextProcessor": ("", "llava-next"),
    "LlavaOnevisionProcessor": ("", "llava-onevision"),
    "Idefics3Processor": ("", "idefics3"),
    "SmolVLMProcessor": ("", "smolvlm"),
    "InternVLProcessor": ("", "internvl"),
}


def is_hf_model(model: str) -> bool:
    """True for ``hf:DIR`` model specs.

    Example:
        >>> is_hf_model("hf:/models/qwen3-vl"), is_hf_model("qwen2-vl")
        (True, False)
    """
    return model.startswith(HF_PREFIX)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: cannot read ({exc})", fix="repair or re-download the model folder") from None
    return data if isinstance(data, dict) else {}


_CONFIG_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json",
                 "config.json", "tokenizer_config.json")


def folder_configs(path: str) -> dict[str, dict[str, Any]]:
    """The folder's configs: ``image``, ``video``, ``processor``, ``model``, ``tokenizer`` (``{}`` when absent).

    A transformers 5 ``processor_config.json`` nests the sub-processors' configs; they are used
    when the separate files are missing. Cached per process while the files stay unchanged.
    """
    stamp = []
    for name in _CONFIG_FILES:
        try:
            info = (Path(path) / name).stat()
            stamp.append((name, info.st_mtime_ns, info.st_size))
        except OSError:
            stamp.append((name, 0, -1))
    return _folder_configs(path, tuple(stamp))


@functools.lru_cache(maxsize=16)
def _folder_configs(path: str, stamp: tuple) -> dict[str, dict[str, Any]]:
    base = Path(path)
    processor = _read_json(base / "processor_config.json")
    image = _read_json(base / "preprocessor_config.json") or dict(processor.get("image_processor") or {})
    video = _read_json(base / "video_preprocessor_config.json") or dict(processor.get("video_processor") or {})
    if not image.get("feature_extractor_type") and isinstance(processor.get("feature_extractor"), dict):
        image = {**processor["feature_extractor"], **image}
    return {"image": image, "video": video, "processor": processor, "model": _read_json(base / "config.json"),
            "tokenizer": _read_json(base / "tokenizer_config.json")}


def _processor_class(configs: dict[str, dict[str, Any]]) -> str:
    for section in ("processor", "image", "video", "tokenizer"):
        name = configs[section].get("processor_class")
        if isinstance(name, str) and name:
            return name
    return ""


@dataclass(frozen=True)
class HFRule(VisionRule):
    """The counting rule of a local transformers folder (see the module docstring).

    Attributes:
        path: the folder (absolute).
        processor_class: the folder's processor class (``Qwen3VLProcessor``, ...).
        family: the adapter counting it (``""``: ``fast_preset``'s rule does).
        fast_preset: the preset whose hand-written rule counts the same family.
        counted_by: ``transformers`` or ``preset``.
        overrides: processor keyword overrides, sorted ``(name, value)`` pairs (``--param``).
        notes: what could not be counted through transformers here, and why.
        fast: :attr:`fast_preset`'s rule with the folder's config values (attached by
            :func:`~balancer_cli.scan.rules.registry.get_rule`).
        text_tokenizer: tokenizer spec counting the text of processor strings (``""``: the folder's).
        specials: tokens those strings are split at (``()``: the folder tokenizer's added tokens).
    """

    name: str = "hf:"
    path: str = ""
    processor_class: str = ""
    family: str = ""
    fast_preset: str = ""
    counted_by: str = "transformers"
    overrides: tuple[tuple[str, Any], ...] = ()
    notes: tuple[str, ...] = ()
    fast: Any = None
    text_tokenizer: str = ""
    specials: tuple[str, ...] = ()
    image_token: str = "<image>"
    video_token: str = "<video>"
    audio_token: str = "<audio>"

    @property
    def counts_audio(self) -> bool:
        """True for audio-capable folders (Qwen2.5-Omni, Qwen3-Omni): :meth:`count_audio` counts clips."""
        return self.family in ("qwen2.5-omni", "qwen3-omni")

    def fast_rule(self) -> VisionRule:
        """The preset rule with this folder's config values (the fast path ``--verify`` compares)."""
        if self.fast is None:
            raise UsageError(f"{self.name}: no preset rule was attached to this folder's rule",
                             fix="build it with get_rule('hf:DIR')")
        return self.fast

    def _backend(self) -> Any:
        return _backend(self)

    def count_image(self, width: int, height: int) -> MediaCount:
        """Tokens of one image, from the folder's image processor (see the module docstring)."""
        if self.counted_by == "preset":
            return self.fast_rule().count_image(width, height)
        return _cached_image(self, width, height)

    def count_video(self, num_frames: int, width: int, height: int, fps: float | None = None,
                    duration_s: float | None = None) -> MediaCount:
        """Tokens of one video, from the folder's video processor and processor."""
        backend = None if self.counted_by == "preset" else self._backend()
        if backend is None or backend.video_processor is None:
            return self.fast_rule().count_video(num_frames, width, height, fps=fps, duration_s=duration_s)
        return backend.video(num_frames, width, height, fps, duration_s)

    def count_audio(self, duration_s: float) -> MediaCount:
        """Tokens of one audio clip (Omni folders), from the processor's ``num_audio_tokens``."""
        backend = None if self.counted_by == "preset" else self._backend()
        if backend is None or not hasattr(backend, "audio"):
            raise MediaRejected(f"{self.name} ({self.processor_class or 'no processor class'}) counts no audio",
                                fix="use an audio-capable folder (Qwen2.5-Omni, Qwen3-Omni)")
        return backend.audio(duration_s)

    def for_images(self, num_images: int) -> VisionRule:
        """Preset-counted families may process multi-image samples differently (LLaVA-OneVision)."""
        return self.fast_rule().for_images(num_images) if self.counted_by == "preset" else self


@functools.lru_cache(maxsize=65536)
def _cached_image(rule: HFRule, width: int, height: int) -> MediaCount:
    return rule._backend().image(width, height)


@functools.lru_cache(maxsize=16)
def _backend(rule: HFRule) -> Any:
    from balancer_cli.scan.rules.hf_backends import make_backend

    return make_backend(rule, folder_configs(rule.path))


def hf_rule(path: str, **overrides: Any) -> HFRule:
    """The :class:`HFRule` of a local folder; ``overrides`` go to the processors as keyword arguments.

    Raises:
        UsageError: not a folder, no processor config, or a processor class the scan has no adapter
            or preset for.
    """
    base = Path(path).expanduser()
    if not base.is_dir():
        raise UsageError(f"--model hf:{path}: not a folder",
                         fix="pass a local model or processor folder (hf:DIR); the scan never downloads")
    configs = folder_configs(str(base.resolve()))
    if not configs["image"] and not configs["processor"] and not configs["video"]:
        raise UsageError(f"--model hf:{path}: no preprocessor_config.json, processor_config.json or "
                         "video_preprocessor_config.json", fix="pass the folder of a downloaded model or processor")
    processor_class = _processor_class(configs)
    if processor_class not in FAMILIES:
        raise UsageError(f"--model hf:{path}: processor class {processor_class or '(none)'!r} has no counting "
                         "adapter here", fix=f"use one of the processor classes {', '.join(FAMILIES)}, or a preset")
    family, preset = FAMILIES[processor_class]
    from balancer_cli.scan.rules.hf_backends import probe_notes, token_names

    rule = HFRule(name=f"{HF_PREFIX}{base.resolve()}", path=str(base.resolve()), processor_class=processor_class,
                  family=family, fast_preset=preset, counted_by="transformers" if family else "preset",
                  overrides=tuple(sorted(overrides.items())), **token_names(family, configs))
    return dataclasses.replace(rule, notes=probe_notes(rule, configs)) if family else rule
