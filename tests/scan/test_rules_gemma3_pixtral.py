"""Gemma 3 and Pixtral / Mistral 3 against transformers 5.x.

Gemma 3: ``Gemma3ImageProcessor.pan_and_scan`` on zero-stride arrays of thousands of sizes (no pixels
allocated), the full image processor on real pan-and-scan images, and ``Gemma3Processor``'s
placeholder string tokenized. Pixtral / Mistral 3: the Pillow image processor's resize helper on
thousands of sizes, its full call on tiny images, and the processor's ``[IMG]``/``[IMG_BREAK]``
layout."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from rules_util import qwen_tokenizer_dir, sizes  # noqa: F401  (fixture)

from balancer_cli.scan.rules.base import MediaRejected
from balancer_cli.scan.rules.registry import get_rule, rule_from_processor_config

warnings.filterwarnings("ignore", category=FutureWarning)

#: Gemma3Processor's pan-and-scan defaults; google/gemma-3-*-it: size 896, image_seq_length 256.
PAN = {"pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4, "pan_and_scan_min_ratio_to_activate": 1.2}


@pytest.fixture(scope="module")
def gemma_image_processor():
    from transformers.models.gemma3.image_processing_pil_gemma3 import (
        Gemma3ImageProcessorPil,
    )

    return Gemma3ImageProcessorPil(size={"height": 896, "width": 896})


def _crops(processor, w: int, h: int, **pan) -> int:
    return len(processor.pan_and_scan(image=np.broadcast_to(np.uint8(0), (3, h, w)), **{**PAN, **pan}))


@pytest.mark.parametrize("pan", [{}, {"pan_and_scan_max_num_crops": 8, "pan_and_scan_min_crop_size": 128,
                                      "pan_and_scan_min_ratio_to_activate": 1.5}])
def test_gemma3_crops_match_pan_and_scan(gemma_image_processor, pan):
    rule = get_rule("gemma3", do_pan_and_scan=True, **pan)
    off = get_rule("gemma3")
    counted = {}
    for w, h in sizes(41, 4000):
        crops = _crops(gemma_image_processor, w, h, **pan)
        c = rule.count_image(w, h)
        assert (c.items, c.encoder_tokens) == (1 + crops, 4096 * (1 + crops)), (w, h)
        assert off.count_image(w, h).items == 1
        counted[crops] = counted.get(crops, 0) + 1
    assert len(counted) >= 3  # 0, 2 and more crops all occur


def test_gemma3_full_processor_and_placeholder_string(gemma_image_processor, qwen_tokenizer_dir):  # noqa: F811
    from transformers import PreTrainedTokenizerFast
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(qwen_tokenizer_dir / "tokenizer.json"))
    proc = object.__new__(Gemma3Processor)  # the constructor wants Gemma's tokenizer attributes
    proc.full_image_sequence = "\n\n<start_of_image>" + "<image_soft_token>" * 256 + "<end_of_image>\n\n"
    rule = get_rule("gemma3", do_pan_and_scan=True, text_tokenizer=str(qwen_tokenizer_dir / "tokenizer.json"))
    for w, h in [(600, 200), (200, 600), (1100, 200), (300, 290), (520, 256), (2000, 256), (64, 48)]:
        out = gemma_image_processor(images=[np.zeros((h, w, 3), np.uint8)], do_pan_and_scan=True, do_resize=False,
                                    return_tensors=None, input_data_format="channels_last", **PAN)
        crops = int(out["num_crops"][0])
        c = rule.count_image(w, h)
        assert c.items == 1 + crops == len(out["pixel_values"]), (w, h)
        text = proc.replace_image_token({"num_crops": [crops]}, 0)
        assert c.llm_tokens == len(tokenizer(text, add_special_tokens=False)["input_ids"]), (w, h)
    assert get_rule("gemma3").count_image(640, 480).llm_tokens == 260
    with pytest.raises(MediaRejected, match="video"):
        rule.count_video(8, 64, 64)


def test_gemma3_preset_reads_the_released_configs(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 896, "width": 896},
         "do_pan_and_scan": None, "image_seq_length": 256}))
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_length": 256,
                                                                 "processor_class": "Gemma3Processor"}))
    rule = rule_from_processor_config("gemma3", tmp_path)
    assert (rule.image_size, rule.image_seq_length, rule.do_pan_and_scan) == (896, 256, False)


@pytest.mark.parametrize("preset,patch,longest,merge", [("pixtral", 16, 1024, 1), ("mistral3", 14, 1540, 2)])
def test_pixtral_matches_the_resize_helper_and_layout(preset, patch, longest, merge):
    from transformers.models.pixtral.image_processing_pil_pixtral import (
        get_resize_output_image_size,
    )

    rule = get_rule(preset)
    unit = patch * merge
    rejected = 0
    for w, h in sizes(42 + merge, 4000):
        ratio = max(h / longest, w / longest)
        if ratio > 1 and min(int(h / ratio), int(w / ratio)) < 1:
            with pytest.raises(MediaRejected):
                rule.count_image(w, h)
            rejected += 1
            continue
        rh, rw = get_resize_output_image_size(np.broadcast_to(np.uint8(0), (h, w, 3)), size=(longest, longest),
                                              patch_size=(unit, unit), input_data_format="channels_last")
        rows, cols = rh // unit, rw // unit
        layout = ((["[IMG]"] * cols + ["[IMG_BREAK]"]) * rows)[:-1] + ["[IMG_END]"]  # replace_image_token
        c = rule.count_image(w, h)
        assert (c.encoder_tokens, c.llm_tokens) == ((rh // patch) * (rw // patch), len(layout)), (w, h)
    assert rejected < 400


def test_pixtral_full_image_processor_on_tiny_images():
    from transformers.models.pixtral.image_processing_pil_pixtral import (
        PixtralImageProcessorPil,
    )

    for preset, patch, longest, merge in [("pixtral", 16, 1024, 1), ("mistral3", 14, 1540, 2)]:
        processor = PixtralImageProcessorPil(size={"longest_edge": longest}, patch_size={"height": patch, "width": patch})
        rule = get_rule(preset)
        for w, h in [(1, 1), (5, 90), (90, 5), (33, 47), (64, 64), (100, 29)]:
            out = processor(images=[np.zeros((h, w, 3), np.uint8)], patch_size={"height": patch * merge,
                            "width": patch * merge}, return_tensors=None, input_data_format="channels_last")
            rh, rw = (int(x) for x in out["image_sizes"][0])
            assert rule.count_image(w, h).encoder_tokens == (rh // patch) * (rw // patch), (preset, w, h)


def test_pixtral_preset_reads_mistral3_configs(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "PixtralImageProcessor", "patch_size": {"height": 14, "width": 14},
         "size": {"longest_edge": 1540}}))
    (tmp_path / "processor_config.json").write_text(json.dumps(
        {"processor_class": "PixtralProcessor", "patch_size": 14, "spatial_merge_size": 2}))
    rule = rule_from_processor_config("pixtral", tmp_path)
    assert (rule.patch_size, rule.longest_edge, rule.spatial_merge_size) == (14, 1540, 2)
    assert rule.count_image(1920, 1080) == get_rule("mistral3").count_image(1920, 1080)
