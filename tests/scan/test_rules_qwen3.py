"""Qwen3-VL against transformers 5.x: ``Qwen2VLImageProcessor`` at 16 px (thousands of sizes, and the
full processor on tiny images) and ``Qwen3VLVideoProcessor`` + ``Qwen3VLProcessor`` (frame sampling,
the 3-D resize, the timestamp text tokenized with the real Qwen vocabulary) on thousands of videos."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from rules_util import check_image_patches, qwen_tokenizer_dir, sizes, videos  # noqa: F401  (fixture)

from balancer_cli.scan.rules.base import MediaRejected
from balancer_cli.scan.rules.registry import get_rule, rule_from_processor_config

warnings.filterwarnings("ignore", category=FutureWarning)

#: Qwen/Qwen3-VL-*-Instruct preprocessor_config.json / video_preprocessor_config.json (released values).
IMAGE_SIZE = {"shortest_edge": 65536, "longest_edge": 16777216}
VIDEO_SIZE = {"shortest_edge": 4096, "longest_edge": 25165824}


@pytest.fixture(scope="module")
def image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, size=IMAGE_SIZE)


@pytest.fixture(scope="module")
def video_processor():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
        Qwen3VLVideoProcessor,
    )

    return Qwen3VLVideoProcessor(size=VIDEO_SIZE, fps=2, min_frames=4, max_frames=768, do_sample_frames=True)


@pytest.fixture(scope="module")
def processor(image_processor, video_processor):
    """``Qwen3VLProcessor`` without its constructor (which type-checks a torchvision video processor)."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    proc = object.__new__(Qwen3VLProcessor)
    proc.image_processor, proc.video_processor = image_processor, video_processor
    proc.video_token, proc.vision_start_token, proc.vision_end_token = (
        "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    return proc


@pytest.fixture(scope="module")
def hf_tokenizer(qwen_tokenizer_dir):  # noqa: F811
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(qwen_tokenizer_dir / "tokenizer.json"))


def test_images_match_the_image_processor(image_processor):
    # the others exceed the aspect-ratio limit, rejected on both sides
    assert check_image_patches(get_rule("qwen3-vl"), image_processor, 21, seqlens=True) > 3000


def test_full_image_processor_on_tiny_images(image_processor):
    rule = get_rule("qwen3-vl")
    rng = np.random.default_rng(22)
    for w, h in [(1, 1), (3, 300), (300, 3), (31, 33), (64, 48)] + [
            tuple(int(x) for x in rng.integers(1, 100, 2)) for _ in range(15)]:
        out = image_processor(images=[np.zeros((h, w, 3), np.uint8)], return_tensors=None,
                              input_data_format="channels_last")
        t, gh, gw = (int(x) for x in out["image_grid_thw"][0])
        assert rule.count_image(w, h).encoder_tokens == t * gh * gw == len(out["pixel_values"]), (w, h)


def _reference_video(processor, hf_tokenizer, total, fps, w, h, cap=None):
    """transformers' own count: sampled indices, patches, and the expanded placeholder tokenized."""
    from transformers.video_utils import VideoMetadata

    vp = processor.video_processor
    meta = VideoMetadata(total_num_frames=total, fps=fps, duration=total / fps)
    indices = vp.sample_frames(meta)
    meta.frames_indices = indices
    kwargs = {} if cap is None else {"cap_pixels_per_frame": cap}
    patches = vp.get_num_of_video_patches(len(indices), h, w, kwargs)
    grid_t = -(-len(indices) // 2)
    grid = np.array([[grid_t, patches // grid_t, 1]])
    text = processor.replace_video_token({"video_grid_thw": grid, "video_metadata": [meta]}, 0)
    return grid_t, patches, len(hf_tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("cap", [None, True])
def test_videos_match_the_video_processor_and_processor(processor, hf_tokenizer, cap):
    rule = get_rule("qwen3-vl", cap_pixels_per_frame=bool(cap))
    checked = 0
    for total, fps, w, h in videos(23 + bool(cap), 1200 if cap is None else 400):
        try:
            grid_t, patches, llm = _reference_video(processor, hf_tokenizer, total, fps, w, h, cap)
        except ValueError:
            with pytest.raises(MediaRejected):
                rule.count_video(total, w, h, fps=fps)
            continue
        c = rule.count_video(total, w, h, fps=fps)
        assert (c.items, c.encoder_tokens, c.llm_tokens) == (grid_t, patches, llm), (total, fps, w, h)
        assert c.seqlens == (patches // grid_t,) * grid_t
        checked += 1
    assert checked > (1150 if cap is None else 380)


def test_timestamps_are_the_processors(processor):
    from balancer_cli.scan.rules.qwen3 import qwen3_frame_indices, qwen3_timestamps

    for total, fps in [(300, 30.0), (7, 2.0), (90001, 29.97), (5, 24.0)]:
        from transformers.video_utils import VideoMetadata

        ref = processor.video_processor.sample_frames(VideoMetadata(total_num_frames=total, fps=fps))
        ours = qwen3_frame_indices(total, fps)
        assert ours.tolist() == ref.tolist()
        assert qwen3_timestamps(ours, fps) == processor._calculate_timestamps(ref, fps, 2)


def test_default_is_uncapped_like_transformers(video_processor):
    assert video_processor.cap_pixels_per_frame is None  # transformers' default: no per-frame cap
    rule = get_rule("qwen3-vl")
    assert rule.cap_pixels_per_frame is False
    short = rule.count_video(0, 1920, 1080, duration_s=4.0)     # 8 frames keep most of their pixels
    capped = get_rule("qwen3-vl", cap_pixels_per_frame=True).count_video(0, 1920, 1080, duration_s=4.0)
    assert short.encoder_tokens > 2.5 * capped.encoder_tokens


def test_duration_only_and_presampled_frames():
    rule = get_rule("qwen3-vl")
    assert rule.count_video(0, 640, 360, duration_s=10.0).items == 10        # 24 fps assumed, 20 frames
    assert rule.count_video(6, 640, 360).items == 3                           # 6 frames as given
    with pytest.raises(MediaRejected):
        rule.count_video(1, 640, 360)                                         # one frame: no temporal pair


def test_preset_reads_the_released_config_files(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"size": IMAGE_SIZE, "patch_size": 16, "merge_size": 2, "temporal_patch_size": 2,
         "image_processor_type": "Qwen2VLImageProcessorFast"}))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 4096, "longest_edge": 16777216}, "fps": 1, "max_frames": 64}))
    rule = rule_from_processor_config("qwen3-vl", tmp_path)
    assert (rule.min_pixels, rule.max_pixels, rule.video_max_pixels, rule.fps, rule.max_frames) == (
        65536, 16777216, 16777216, 1.0, 64)
