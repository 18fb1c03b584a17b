"""``balancer scan --verify N``: cross-check N random samples' media counts against transformers.

The scan counts media with a hand-written rule (:mod:`balancer_cli.scan.rules`). After a scan,
:func:`verify_scan` draws ``N`` measured samples (seeded, so a rerun draws the same ones),
re-reads their records and counts every image, video and audio clip twice: with the scan's rule
and with its transformers twin (:func:`reference_rule`), then reports each disagreement in
encoder tokens, items, per-item sequence lengths or LLM placeholder tokens.

The twin of a preset is an :class:`~balancer_cli.scan.rules.hf.HFRule` over a temporary folder
holding the preset's values as the released config files (:func:`write_reference_folder`), so
transformers' own processor classes count (Qwen2-VL / Qwen2.5-VL images, Qwen3-VL, GLM-4.1V,
Gemma 3, Pixtral / Mistral 3, Qwen2.5-Omni / Qwen3-Omni); the twin of ``hf:DIR`` is the preset
rule with the folder's values. Presets without a twin (LLaVA, Idefics3, SmolVLM, InternVL, whose
equality is asserted by the test suite instead) are reported as not checked. Media transformers
cannot count here (a video processor needing torchvision) are counted by the preset on both sides
and listed in ``notes``.

Example:
    >>> from balancer_cli.scan.rules.registry import get_rule
    >>> twin, why = reference_rule(get_rule("llava-1.5"))
    >>> twin is None, why
    (True, 'no transformers twin for preset llava-1.5 (its equality with transformers is asserted by the test suite)')
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from balancer_cli.errors import SampleError
from balancer_cli.scan.blocks import RecordBlock
from balancer_cli.scan.readers import read_block
from balancer_cli.scan.records import RecordError, parse_record
from balancer_cli.scan.rules.base import MediaRejected, count_images
from balancer_cli.scan.rules.hf import HFRule, hf_rule

__all__ = ["MAX_EXAMPLES", "draw_samples", "reference_rule", "verify_scan", "write_reference_folder"]

#: Disagreements shown in the summary.
MAX_EXAMPLES = 5

_WHISPER = {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128, "n_fft": 400,
            "chunk_length": 300, "n_samples": 4800000, "padding_value": 0.0, "return_attention_mask": True}


def _reference_configs(rule: Any) -> dict[str, dict[str, Any]] | None:
    """The released config files a preset stands for: ``{file name: JSON}`` (None: no twin)."""
    cls = type(rule).__name__
    qwen_video = {"size": {"shortest_edge": getattr(rule, "video_min_pixels", 0),
                           "longest_edge": getattr(rule, "video_max_pixels", 0)},
                  "patch_size": getattr(rule, "patch_size", 14), "merge_size": getattr(rule, "merge_size", 2),
                  "temporal_patch_size": getattr(rule, "temporal_patch_size", 2), "do_sample_frames": True,
                  "fps": getattr(rule, "fps", 2.0), "min_frames": getattr(rule, "min_frames", 4),
                  "max_frames": getattr(rule, "max_frames", 768)}
    qwen_image = {"size": {"shortest_edge": getattr(rule, "min_pixels", 0),
                           "longest_edge": getattr(rule, "max_pixels", 0)},
                  "patch_size": getattr(rule, "patch_size", 14), "merge_size": getattr(rule, "merge_size", 2),
                  "temporal_patch_size": getattr(rule, "temporal_patch_size", 2)}
    if cls == "QwenVLRule":
        return {"preprocessor_config.json": {**qwen_image, "image_processor_type": "Qwen2VLImageProcessor"},
                "video_preprocessor_config.json": {**qwen_video, "video_processor_type": "Qwen2VLVideoProcessor",
                                                   "cap_pixels_per_frame": rule.cap_pixels_per_frame,
                                                   "max_video_tokens": rule.max_video_tokens},
                "processor_config.json": {"processor_class": "Qwen2VLProcessor"}}
    if cls == "Qwen3VLRule":
        return {"preprocessor_config.json": {**qwen_image, "image_processor_type": "Qwen2VLImageProcessor"},
                "video_preprocessor_config.json": {**qwen_video, "video_processor_type": "Qwen3VLVideoProcessor",
                                                   "cap_pixels_per_frame": rule.cap_pixels_per_frame,
                                                   "max_video_tokens": rule.max_video_tokens},
                "processor_config.json": {"processor_class": "Qwen3VLProcessor"}}
    if cls == "Glm4vRule":
        video = {**qwen_video, "video_processor_type": "Glm4vVideoProcessor", "max_duration": rule.max_duration}
        for key in ("min_frames", "max_frames"):
            video.pop(key)
        return {"preprocessor_config.json": {**qwen_image, "image_processor_type": "Glm4vImageProcessor"},
                "video_preprocessor_config.json": video,
                "processor_config.json": {"processor_class": "Glm4vProcessor"}}
    if cls == "Gemma3Rule":
        return {"preprocessor_config.json": {
                    "image_processor_type": "Gemma3ImageProcessor", "do_pan_and_scan": rule.do_pan_and_scan,
                    "size": {"height": rule.image_size, "width": rule.image_size},
                    "pan_and_scan_min_crop_size": rule.pan_and_scan_min_crop_size,
                    "pan_and_scan_max_num_crops": rule.pan_and_scan_max_num_crops,
                    "pan_and_scan_min_ratio_to_activate": rule.pan_and_scan_min_ratio_to_activate},
                "processor_config.json": {"processor_class": "Gemma3Processor",
                                          "image_seq_length": rule.image_seq_length},
                "config.json": {"vision_config": {"patch_size": rule.patch_size}}}
    if cls == "PixtralRule":
        return {"preprocessor_config.json": {"image_processor_type": "PixtralImageProcessor",
                                             "size": {"longest_edge": rule.longest_edge},
                                             "patch_size": {"height": rule.patch_size, "width": rule.patch_size}},
                "processor_config.json": {"processor_class": "PixtralProcessor", "patch_size": rule.patch_size,
                                          "spatial_merge_size": rule.spatial_merge_size}}
    if cls == "OmniRule":
        qwen3 = rule.audio_rule == "qwen3-omni"
        audio = {**_WHISPER, "sampling_rate": rule.sampling_rate, "hop_length": rule.hop_length,
                 "nb_max_frames": rule.nb_max_frames}
        return {"preprocessor_config.json": {**qwen_image, **audio, "image_processor_type": "Qwen2VLImageProcessor"},
                "video_preprocessor_config.json": {**qwen_video, "video_processor_type": "Qwen2VLVideoProcessor"},
                "processor_config.json": {"processor_class": "Qwen3OmniMoeProcessor" if qwen3 else
                                          "Qwen2_5OmniProcessor"},
                "config.json": {"thinker_config": {"audio_config": {"n_window": rule.n_window,
                                                                    "n_window_infer": rule.n_window_infer}}}}
    return None


def write_reference_folder(rule: Any, folder: str | Path, tokenizer_json: str | Path | None = None) -> bool:
    """Write ``rule``'s values as a transformers folder (``False``: the preset has no twin).

    ``tokenizer_json`` is copied in as the folder's tokenizer (timestamps, wrappers and row
    breaks are counted with it).
    """
    files = _reference_configs(rule)
    if files is None:
        return False
    base = Path(folder)
    base.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (base / name).write_text(json.dumps(data, indent=1), encoding="utf-8")
    if tokenizer_json is not None:
        (base / "tokenizer.json").write_bytes(Path(tokenizer_json).read_bytes())
    return True


def reference_rule(rule: Any, tokenizer_json: str | Path | None = None) -> tuple[Any, str]:
    """``(the transformers twin of rule or None, description)`` (see the module docstring)."""
    if isinstance(rule, HFRule):
        if rule.counted_by != "transformers":
            return None, f"{rule.name} is counted by the {rule.fast_preset} preset (no transformers adapter)"
        return rule.fast_rule(), f"the {rule.fast_preset} preset rule with the folder's values"
    folder = Path(tempfile.mkdtemp(prefix="balancer-verify-"))
    if not write_reference_folder(rule, folder, tokenizer_json):
        return None, (f"no transformers twin for preset {rule.name} (its equality with transformers is "
                      "asserted by the test suite)")
    from balancer_cli.scan.rules.hf_backends import FAMILY_SPECIALS

    twin = dataclasses.replace(hf_rule(str(folder)), fast=rule)
    if tokenizer_json is None:  # the preset's own text tokenizer counts the processor strings' text
        text = (getattr(rule, "timestamp_tokenizer", "") or getattr(rule, "text_tokenizer", "")
                or ("cl100k" if twin.family == "glm4v" else "qwen2"))
        twin = dataclasses.replace(twin, text_tokenizer=text, specials=FAMILY_SPECIALS[twin.family])
    return twin, f"transformers processors built from the {rule.name} preset's values"


def _as_dict(count: Any) -> dict[str, Any]:
    return {"encoder_tokens": count.encoder_tokens, "items": count.items, "llm_tokens": count.llm_tokens,
            "seqlens": list(count.seqlens)}


def _counts(rule: Any, media: Sequence[Any], sizes: list[tuple[int, int]], video_size: tuple[int, int]) -> list:
    """Per media item: a ``MediaCount``, the rejection text, or None (not countable here)."""
    out: list[Any] = []
    images = iter(count_images(rule, sizes) if sizes else ())
    for m in media:
        try:
            if m.kind == "image":
                out.append(next(images))
            elif m.kind == "video":
                if m.duration is None and not m.num_frames:
                    out.append(None)
                    continue
                out.append(rule.count_video(m.num_frames or 0, m.width or video_size[0], m.height or video_size[1],
                                            fps=m.fps, duration_s=m.duration))
            else:
                out.append(rule.count_audio(m.duration) if m.duration is not None and hasattr(rule, "count_audio")
                           else None)
        except MediaRejected as exc:
            out.append(f"rejected: {exc.message}")
    return out


def verify_scan(blocks: Sequence[RecordBlock], sample_ids: Sequence[int], rule: Any, config: Any,
                tokenizer_json: str | Path | None = None) -> dict[str, Any]:
    """Cross-check ``sample_ids`` (found in ``blocks``) between ``rule`` and its transformers twin.

    Returns the summary's ``verify`` entry: ``samples``, ``media`` compared, ``disagreements``,
    ``examples`` (the first :data:`MAX_EXAMPLES`), ``reference`` and ``notes``.
    """
    # The scan's own media reading (size fields, image headers, video/audio headers where the
    # scan reads them), so that only the rule differs between the two counts.
    from balancer_cli.scan import measure

    image_size = measure._image_size
    fill_from_header = getattr(measure, "_fill_from_header", None)

    twin, reference = reference_rule(rule, tokenizer_json)
    report: dict[str, Any] = {"requested": len(sample_ids), "samples": 0, "media": 0, "disagreements": 0,
                              "examples": [], "reference": reference,
                              "notes": list(getattr(twin, "notes", ()) or getattr(rule, "notes", ()))}
    if twin is None:
        return report
    wanted = set(int(s) for s in sample_ids)
    fields = dict(config.fields)
    for block in blocks:
        todo = {s - block.first_sample for s in wanted if block.first_sample <= s < block.first_sample + block.num_records}
        if not todo:
            continue
        for offset, (line, record) in enumerate(read_block(block, fields)):
            if offset not in todo:
                continue
            try:
                sample = parse_record(record, fields)
                sizes = [image_size(m, block.image_root) for m in sample.media if m.kind == "image"]
                for m in sample.media:
                    if m.kind != "image" and fill_from_header is not None:
                        fill_from_header(m, block.image_root)
            except (RecordError, SampleError, TypeError, ImportError):
                continue
            report["samples"] += 1
            ours = _counts(rule, sample.media, sizes, config.video_size)
            theirs = _counts(twin, sample.media, sizes, config.video_size)
            for index, (media, a, b) in enumerate(zip(sample.media, ours, theirs)):
                if a is None or b is None:
                    continue
                report["media"] += 1
                if a != b:
                    report["disagreements"] += 1
                    if len(report["examples"]) < MAX_EXAMPLES:
                        report["examples"].append({
                            "sample": block.first_sample + offset, "file": block.path, "line": line,
                            "media": index, "kind": media.kind,
                            "meta": {k: v for k, v in dataclasses.asdict(media).items()
                                     if k != "ref" and v is not None},
                            "scan": a if isinstance(a, str) else _as_dict(a),
                            "transformers": b if isinstance(b, str) else _as_dict(b)})
    return report


def draw_samples(ok_mask: np.ndarray, count: int, seed: int = 0) -> list[int]:
    """``count`` measured samples (``ok_mask``) drawn without replacement, sorted (seeded).

    Example:
        >>> draw_samples(np.array([True, False, True, True]), 2)
        [2, 3]
    """
    ids = np.flatnonzero(ok_mask)
    if count >= len(ids):
        return ids.tolist()
    return sorted(np.random.default_rng(seed).choice(ids, size=count, replace=False).tolist())
