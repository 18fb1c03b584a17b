"""GLM-4.1V against transformers 5.x: ``Glm4vImageProcessor`` (thousands of sizes, the full processor on
tiny images) and ``Glm4vVideoProcessor`` + ``Glm4vProcessor.replace_video_token`` (frame sampling, the
3-D resize, the integer timestamps) on thousands of videos."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import pytest
from rules_util import check_image_patches, videos

from balancer_cli.scan.rules.base import MediaRejected
from balancer_cli.scan.rules.registry import get_rule, rule_from_processor_config
from balancer_cli.scan.text import load_tokenizer

warnings.filterwarnings("ignore", category=FutureWarning)

#: zai-org/GLM-4.1V-9B-Thinking preprocessor_config.json (released values).
IMAGE_SIZE = {"shortest_edge": 12544, "longest_edge": 9633792}


@pytest.fixture(scope="module")
def image_processor():
    from transformers.models.glm4v.image_processing_pil_glm4v import (
        Glm4vImageProcessorPil,
    )

    return Glm4vImageProcessorPil(size=IMAGE_SIZE, patch_size=14, temporal_patch_size=2, merge_size=2)


@pytest.fixture(scope="module")
def processor():
    from transformers.models.glm4v.processing_glm4v import Glm4vProcessor
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor

    proc = object.__new__(Glm4vProcessor)  # the constructor type-checks a torchvision video processor
    proc.video_processor = Glm4vVideoProcessor()
    proc.image_token = "<|image|>"
    return proc


def test_images_match_the_image_processor(image_processor):
    assert check_image_patches(get_rule("glm-4.1v"), image_processor, 31, seqlens=False) > 3000


def test_full_image_processor_on_tiny_images(image_processor):
    rule = get_rule("glm-4.1v")
    for w, h in [(1, 1), (5, 200), (200, 5), (27, 29), (60, 90), (113, 41)]:
        out = image_processor(images=[np.zeros((h, w, 3), np.uint8)], return_tensors=None,
                              input_data_format="channels_last")
        t, gh, gw = (int(x) for x in out["image_grid_thw"][0])
        assert rule.count_image(w, h).encoder_tokens == t * gh * gw == len(out["pixel_values"]), (w, h)


def _digits(text: str) -> int:
    """Integer timestamps as GLM-4's tokenizer counts them (cl100k-style groups of up to 3 digits)."""
    return sum(load_tokenizer("cl100k").count_batch(re.findall(r"<\|end_of_image\|>(\d+)", text)))


def test_videos_match_the_video_processor_and_processor(processor):
    from transformers.video_utils import VideoMetadata

    rule = get_rule("glm-4.1v")
    vp = processor.video_processor
    checked = 0
    for total, fps, w, h in videos(32, 1500):
        meta = VideoMetadata(total_num_frames=total, fps=fps, duration=total / fps)
        indices = vp.sample_frames(meta)
        meta.frames_indices = indices
        try:
            patches = vp.get_num_of_video_patches(len(indices), h, w, {})
        except ValueError:
            with pytest.raises(MediaRejected):
                rule.count_video(total, w, h, fps=fps)
            continue
        grid_t = len(indices) // 2
        grid = np.array([[grid_t, 4, 1]])  # one pad per frame group: the rest are single added tokens
        text = processor.replace_video_token({"video_grid_thw": grid, "video_metadata": [meta]}, 0)
        llm = text.count("<|begin_of_image|>") * 2 + _digits(text) + grid_t * (patches // grid_t // 4)
        c = rule.count_video(total, w, h, fps=fps)
        assert (c.items, c.encoder_tokens, c.llm_tokens) == (grid_t, patches, llm), (total, fps, w, h)
        checked += 1
    assert checked > 1400


def test_long_videos_spread_600_frames():
    rule = get_rule("glm-4.1v")
    assert rule.count_video(30 * 3600, 640, 360, fps=30.0).items == 300      # one hour: 600 frames
    assert rule.count_video(0, 640, 360, duration_s=10.0).items == 10        # 24 fps assumed


def test_preset_reads_the_released_config_files(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"size": IMAGE_SIZE, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
         "image_processor_type": "Glm4vImageProcessor", "processor_class": "Glm4vProcessor"}))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 12544, "longest_edge": 47040000}, "fps": 2}))
    rule = rule_from_processor_config("glm4v", tmp_path)
    assert (rule.min_pixels, rule.max_pixels, rule.video_max_pixels, rule.fps) == (12544, 9633792, 47040000, 2.0)
