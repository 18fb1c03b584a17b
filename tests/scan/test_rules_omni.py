"""Qwen2.5-Omni and Qwen3-Omni against transformers 5.x: audio token counts from each processor's
``_get_num_audio_tokens`` over thousands of durations and from ``WhisperFeatureExtractor`` on real
waveforms, attention windows from the audio encoders' own chunking helpers, images from
``Qwen2VLImageProcessor`` at 14 / 16 px, and videos from ``Qwen2VLVideoProcessor`` with the
processors' frame bounds (its size-only methods; the module is imported against a torchvision stand-in)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from rules_util import qwen2_video_processor_class, sizes, videos

from balancer_cli.scan.rules.base import MediaRejected
from balancer_cli.scan.rules.registry import get_rule

warnings.filterwarnings("ignore", category=FutureWarning)

#: Qwen/Qwen2.5-Omni-7B and Qwen/Qwen3-Omni-30B-A3B-Instruct preprocessor_config.json (audio part).
WHISPER = {"feature_size": 128, "sampling_rate": 16000, "hop_length": 160, "chunk_length": 300,
           "n_fft": 400, "nb_max_frames": 30000, "return_attention_mask": True}


@pytest.fixture(scope="module")
def feature_extractor():
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(**{k: v for k, v in WHISPER.items() if k != "nb_max_frames"})
    assert fe.nb_max_frames == 30000 and fe.n_samples == 4800000
    return fe


def _processor(name: str, feature_extractor):
    if name == "qwen2.5-omni":
        from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import (
            Qwen2_5OmniProcessor as cls,
        )
    else:
        from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import (
            Qwen3OmniMoeProcessor as cls,
        )
    proc = object.__new__(cls)  # the constructor type-checks a torchvision video processor
    proc.feature_extractor = feature_extractor
    return proc


def _durations(seed: int, n: int) -> list[float]:
    rng = np.random.default_rng(seed)
    fixed = [0.02, 0.03, 0.05, 0.1, 1.0, 1.99, 2.0, 2.01, 8.0, 30.0, 299.99, 300.0, 300.01, 301.0, 1800.0]
    return fixed + np.round(np.exp(rng.uniform(np.log(0.02), np.log(3600), n)), 4).tolist()


@pytest.mark.parametrize("name", ["qwen2.5-omni", "qwen3-omni"])
def test_audio_tokens_match_the_processor(name, feature_extractor):
    proc, rule = _processor(name, feature_extractor), get_rule(name)
    n_window = 100 if name == "qwen2.5-omni" else 50
    for d in _durations(51, 4000):
        samples = int(round(d * 16000))
        ref = int(proc._get_num_audio_tokens(samples, n_window=n_window))
        if ref < 1:
            with pytest.raises(MediaRejected):
                rule.count_audio(d)
            continue
        c = rule.count_audio(d)
        assert c.llm_tokens == ref, (name, d)
        assert c.items == len(c.seqlens) and sum(c.seqlens) == c.encoder_tokens


@pytest.mark.parametrize("name", ["qwen2.5-omni", "qwen3-omni"])
def test_attention_windows_match_the_audio_encoder(name):
    import torch

    if name == "qwen2.5-omni":
        from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as m
    else:
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m
    rule = get_rule(name)
    for d in _durations(52, 300):
        try:
            c = rule.count_audio(d)
        except MediaRejected:
            continue
        mel = rule.mel_frames(d)
        lens = torch.tensor([mel])
        _, chunks = m.chunk_and_pad_features(torch.zeros(1, 1, mel), lens, rule.n_window)
        if name == "qwen2.5-omni":
            cu = m.get_audio_cu_seqlens(chunks)
        else:
            cu = m.get_audio_cu_seqlens(chunks, lens, rule.n_window_infer, rule.n_window)
        assert c.seqlens == tuple(torch.diff(cu).tolist()), (name, d)


def test_mel_frames_of_real_waveforms(feature_extractor):
    rng = np.random.default_rng(53)
    for d in [0.05, 0.33, 1.0, 2.5, 7.31, 29.99]:
        wave = rng.standard_normal(int(round(d * 16000))).astype(np.float32)
        # Qwen2.5-Omni pads to 300 s ("max_length"); Qwen3-Omni pads to the clip ("longest", no truncation)
        padded = feature_extractor(wave, sampling_rate=16000, padding="max_length", return_attention_mask=True)
        longest = feature_extractor(wave, sampling_rate=16000, padding=True, truncation=False,
                                    return_attention_mask=True)
        assert int(padded["attention_mask"].sum()) == get_rule("qwen2.5-omni").mel_frames(d), d
        assert int(longest["attention_mask"].sum()) == get_rule("qwen3-omni").mel_frames(d), d


@pytest.mark.parametrize("name,patch", [("qwen2.5-omni", 14), ("qwen3-omni", 16)])
def test_images_match_the_image_processor(name, patch):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    processor = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056, patch_size=patch)
    rule = get_rule(name)
    for w, h in sizes(54, 2000):
        try:
            patches = processor.get_number_of_image_patches(h, w, {})
        except ValueError:
            continue
        assert rule.count_image(w, h).encoder_tokens == patches, (name, w, h)


@pytest.mark.parametrize("name,patch", [("qwen2.5-omni", 14), ("qwen3-omni", 16)])
def test_videos_match_the_video_processor(name, patch):
    from transformers.video_utils import VideoMetadata

    side = patch * 2
    kwargs = {"size": {"shortest_edge": 128 * side * side, "longest_edge": 768 * side * side}}  # processor's
    vp = qwen2_video_processor_class()(patch_size=patch, do_sample_frames=True, fps=2.0)
    rule = get_rule(name)
    for total, fps, w, h in videos(55, 800):
        n = len(vp.sample_frames(VideoMetadata(total_num_frames=total, fps=fps)))
        try:
            patches = vp.get_num_of_video_patches(n, h, w, kwargs)
        except ValueError:
            continue
        if n < 2:
            continue
        c = rule.count_video(total, w, h, fps=fps)
        grid_t = -(-n // 2)  # sample_frames' float step sometimes keeps one frame more: padded to a pair
        assert (c.items, c.encoder_tokens, c.llm_tokens) == (grid_t, patches, patches // 4), (name, total, fps, w, h)
