"""Qwen2.5-Omni and Qwen3-Omni: Qwen2-VL-style image and video rules plus their audio encoders.

Images and videos go through ``Qwen2VLImageProcessor`` / ``Qwen2VLVideoProcessor`` (patch 14 for
Qwen2.5-Omni, 16 for Qwen3-Omni, merge 2) with the processor's own ``videos_kwargs`` frame bounds
(``[128, 768] x (patch * 2)**2`` pixels per frame), so :class:`~balancer_cli.scan.rules.qwen.QwenVLRule`
counts them. Audio (:meth:`OmniRule.count_audio`) follows each processor's ``num_audio_tokens``:
16 kHz audio, 160-sample hops (100 mel frames per second), then

- Qwen2.5-Omni: ``mel = min(ceil(samples / 160), nb_max_frames)`` (30,000: 300 s), encoder frames
  after the stride-2 conv ``(mel - 1) // 2 + 1``, attended in chunks of ``n_window * 2 = 200``
  mel frames (100 encoder frames each), average-pooled by 2:
  ``llm = ((mel - 1) // 2 + 1 - 2) // 2 + 1``.
- Qwen3-Omni: ``mel = samples // 160`` (no truncation), three stride-2 convs per 100-frame chunk
  (13 tokens per full chunk), ``llm = encoder = f(mel % 100) + 13 * (mel // 100)``; attention
  windows of ``13 * n_window_infer / 100 = 104`` encoder frames.

Defaults: ``Qwen/Qwen2.5-Omni-7B`` ``preprocessor_config.json`` (``patch_size 14``,
``min_pixels 3136``, ``max_pixels 12845056``, ``hop_length 160``, ``chunk_length 300``,
``nb_max_frames 30000``), ``Qwen/Qwen3-Omni-30B-A3B-Instruct`` ``preprocessor_config.json``
(``patch_size 16``, same pixel bounds, ``n_samples 4800000``) and the processors' ``videos_kwargs``.

Example:
    >>> q25, q3 = OmniRule(), OmniRule(name="qwen3-omni", patch_size=16, video_min_pixels=128 * 32 * 32,
    ...                               video_max_pixels=768 * 32 * 32, audio_rule="qwen3-omni", n_window=50)
    >>> q25.count_audio(10.0).llm_tokens, q3.count_audio(10.0).llm_tokens
    (250, 130)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from balancer_cli.scan.rules.base import MediaCount, MediaRejected, config_section
from balancer_cli.scan.rules.qwen import QwenVLRule, qwen_processor_params

__all__ = ["AUDIO_RULES", "OmniRule", "omni_processor_params", "qwen3_omni_audio", "qwen25_omni_audio"]


def _after_conv(frames: int) -> int:
    return (frames - 1) // 2 + 1


def qwen25_omni_audio(mel_frames: int, n_window: int = 100) -> MediaCount:
    """Qwen2.5-Omni's audio encoder on ``mel_frames`` mel frames.

    Example:
        >>> qwen25_omni_audio(1000)
        MediaCount(encoder_tokens=500, items=5, llm_tokens=250, seqlens=(100, 100, 100, 100, 100))
    """
    chunk = n_window * 2
    chunks = [chunk] * (mel_frames // chunk) + ([mel_frames % chunk] if mel_frames % chunk else [])
    seqlens = tuple(_after_conv(c) for c in chunks)
    llm = (_after_conv(mel_frames) - 2) // 2 + 1
    return MediaCount(sum(seqlens), len(seqlens), llm, seqlens)


def _qwen3_omni_len(mel_frames: int, n_window: int) -> int:
    chunk = n_window * 2
    rest = _after_conv(mel_frames % chunk)
    return (_after_conv(rest) - 1) // 2 + 1 + (mel_frames // chunk) * 13


def qwen3_omni_audio(mel_frames: int, n_window: int = 50, n_window_infer: int = 800) -> MediaCount:
    """Qwen3-Omni's audio encoder (``_get_feat_extract_output_lengths`` and its attention windows).

    Example:
        >>> qwen3_omni_audio(1000)
        MediaCount(encoder_tokens=130, items=2, llm_tokens=130, seqlens=(104, 26))
    """
    chunk = n_window * 2
    tokens = _qwen3_omni_len(mel_frames, n_window)
    longest = _qwen3_omni_len(min(mel_frames, chunk), n_window)
    window = longest * (n_window_infer // chunk)
    seqlens = (window,) * (tokens // window) + ((tokens % window,) if tokens % window else ())
    return MediaCount(tokens, len(seqlens), tokens, seqlens)


#: The audio encoders :class:`OmniRule` knows (``audio_rule``).
AUDIO_RULES = ("qwen2.5-omni", "qwen3-omni")


@dataclass(frozen=True)
class OmniRule(QwenVLRule):
    """Qwen2.5-Omni (3B, 7B) and Qwen3-Omni (30B-A3B Instruct/Thinking/Captioner).

    ``audio_rule`` picks the audio encoder (:data:`AUDIO_RULES`); ``sampling_rate``,
    ``hop_length`` and ``nb_max_frames`` are the Whisper feature extractor's (``nb_max_frames``
    only truncates under Qwen2.5-Omni; 0 means no limit).
    """

    name: str = "qwen2.5-omni"
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28
    audio_rule: str = "qwen2.5-omni"
    sampling_rate: int = 16000
    hop_length: int = 160
    nb_max_frames: int = 30000
    n_window: int = 100
    n_window_infer: int = 800
    image_token: str = "<|IMAGE|>"
    video_token: str = "<|VIDEO|>"
    audio_token: str = "<|AUDIO|>"

    @property
    def counts_audio(self) -> bool:
        """True: this rule counts audio clips (:meth:`count_audio`), not the scan's Whisper default."""
        return True

    def mel_frames(self, duration_s: float) -> int:
        """Mel frames the feature extractor keeps for ``duration_s`` seconds of audio."""
        samples = int(round(duration_s * self.sampling_rate))
        if self.audio_rule == "qwen3-omni":
            return samples // self.hop_length
        frames = math.ceil(samples / self.hop_length)
        return min(frames, self.nb_max_frames) if self.nb_max_frames else frames

    def count_audio(self, duration_s: float) -> MediaCount:
        """Encoder frames, attention windows (items) and LLM placeholder tokens of one clip."""
        if self.audio_rule not in AUDIO_RULES:
            raise MediaRejected(f"{self.name}: unknown audio_rule {self.audio_rule!r}",
                                fix=f"use one of: {', '.join(AUDIO_RULES)}")
        mel = self.mel_frames(duration_s)
        if mel < 1:
            raise MediaRejected(f"{self.name}: audio clip of {duration_s} s holds no mel frame")
        if self.audio_rule == "qwen3-omni":
            count = qwen3_omni_audio(mel, self.n_window, self.n_window_infer)
        else:
            count = qwen25_omni_audio(mel, self.n_window)
        if count.llm_tokens < 1:
            raise MediaRejected(f"{self.name}: audio clip of {duration_s} s holds no audio token")
        return count


def omni_processor_params(config: dict[str, Any], video: dict[str, Any]) -> dict[str, Any]:
    """:class:`OmniRule` parameters of an Omni folder's configs (image keys as Qwen2-VL's).

    The video frame bounds stay the processor's ``videos_kwargs`` (they override the video
    processor's own ``size`` at call time), so a lone ``preprocessor_config.json`` does not set them.

    Example:
        >>> omni_processor_params({"patch_size": 16, "hop_length": 160, "nb_max_frames": 30000}, {})
        {'patch_size': 16, 'hop_length': 160, 'nb_max_frames': 30000}
    """
    out = {k: v for k, v in qwen_processor_params(config, {}).items() if not k.startswith("video_")}
    for key in ("sampling_rate", "hop_length", "nb_max_frames", "n_window", "n_window_infer"):
        if config.get(key) is not None:
            out[key] = int(config[key])
    audio = config_section(config_section(config, "thinker_config"), "audio_config")
    for key in ("n_window", "n_window_infer"):
        if audio.get(key) is not None:
            out[key] = int(audio[key])
    for key, kind in (("fps", float), ("min_frames", int), ("max_frames", int)):
        if video.get(key) is not None:
            out[key] = kind(video[key])
    return out
