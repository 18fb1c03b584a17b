"""Video defaults that match transformers 5.x.

Qwen2-VL / Qwen2.5-VL: the preset's default equals ``Qwen2VLVideoProcessor(do_sample_frames=True,
fps=2)`` with its own ``cap_pixels_per_frame`` default (None: no total-video budget), through its
size-only methods on thousands of videos (the module is imported against a torchvision stand-in);
the qwen-vl-utils budget stays available as ``cap_pixels_per_frame=True``. LLaVA-OneVision: a video
shorter than the 32 sampled frames keeps its real frames, as ``LlavaOnevisionProcessor`` counts."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from rules_util import qwen2_video_processor_class, videos

from balancer_cli.scan.rules.registry import get_rule

warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(scope="module")
def qwen2_video_processor():
    return qwen2_video_processor_class()(do_sample_frames=True, fps=2.0)


@pytest.mark.parametrize("preset", ["qwen2-vl", "qwen2.5-vl"])
def test_qwen_video_default_is_the_video_processors(preset, qwen2_video_processor):
    from transformers.video_utils import VideoMetadata

    vp = qwen2_video_processor
    assert vp.cap_pixels_per_frame is None and vp.size["longest_edge"] == 768 * 28 * 28
    rule = get_rule(preset)
    checked = extra_frame = 0
    for total, fps, w, h in videos(61, 2500):
        n = len(vp.sample_frames(VideoMetadata(total_num_frames=total, fps=fps)))
        if n < 1 or max(w, h) / min(w, h) > 200:
            continue
        patches = vp.get_num_of_video_patches(n, h, w, {})
        grid_t = -(-n // 2)
        c = rule.count_video(total, w, h, fps=fps)
        assert (c.items, c.encoder_tokens, c.llm_tokens) == (grid_t, patches, patches // 4), (total, fps, w, h)
        checked += 1
        extra_frame += n % 2
    assert checked > 2400 and extra_frame > 10  # the float-step frame of sample_frames is reproduced


def test_uncapped_default_vs_the_old_capped_count():
    """A 10-minute 1080p clip: 768 frames. transformers' default keeps 768x28x28 pixels per frame; the
    qwen-vl-utils budget (the old default) shrinks them to fit 128,000 x 0.9 tokens per video: the
    issue's "up to 2.6x more video tokens than the scan predicts"."""
    uncapped = get_rule("qwen2-vl").count_video(0, 1920, 1080, duration_s=600.0)
    capped = get_rule("qwen2-vl", cap_pixels_per_frame=True).count_video(0, 1920, 1080, duration_s=600.0)
    assert (uncapped.llm_tokens, capped.llm_tokens) == (276480, 105984)
    assert round(uncapped.llm_tokens / capped.llm_tokens, 1) == 2.6


def test_qwen_vl_utils_sampler_keeps_exactly_n_frames():
    rule = get_rule("qwen2-vl", frame_sampler="qwen-vl-utils")
    assert rule.count_video(1213, 640, 360, fps=10.0).items == 121
    assert get_rule("qwen2-vl").count_video(1213, 640, 360, fps=10.0).items == 122   # 243 frames, padded


@pytest.fixture(scope="module")
def onevision_processor():
    from transformers.models.llava_onevision.processing_llava_onevision import (
        LlavaOnevisionProcessor,
    )

    proc = object.__new__(LlavaOnevisionProcessor)  # the constructor wants a torchvision video processor
    proc.num_image_tokens, proc.vision_feature_select_strategy = 729, "full"
    proc.vision_aspect_ratio, proc.image_token, proc.video_token = "anyres_max_9", "<image>", "<video>"
    return proc


def test_llava_onevision_short_videos_keep_their_frames(onevision_processor):
    rule = get_rule("llava-onevision")
    for total in [1, 2, 5, 8, 16, 31, 32, 33, 100, 5000]:
        kept = min(32, total)
        fake = {"pixel_values_videos": [np.zeros((kept, 3, 2, 2), np.float32)]}
        ref = onevision_processor.replace_video_token(fake, 0).count("<video>")
        c = rule.count_video(total, 640, 360, fps=30.0)
        assert (c.items, c.llm_tokens, c.encoder_tokens) == (kept, ref, kept * 729), total
    assert rule.count_video(8, 640, 360).llm_tokens == 8 * 196 + 1 < 6273   # was 32 x 196 + 1
    assert rule.count_video(0, 640, 360, duration_s=90.0).items == 32          # frame count unknown
