"""Vision-token rules against the real transformers image processors (built offline, no torch).

Thousands of sizes go through the processors' pure size helpers (``smart_resize``, tile-grid
functions, ``get_number_of_image_patches``, the processors' ``_get_num_multimodal_tokens``); a few
dozen tiny synthetic images per family go through the full ``processor(images=...)``.
"""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest

from balancer_cli.errors import InputError, SampleError, UsageError
from balancer_cli.scan.rules.base import MediaCount, MediaRejected, count_images
from balancer_cli.scan.rules.qwen import qwen_sampled_frames
from balancer_cli.scan.rules.registry import PRESETS, get_rule, rule_from_processor_config

warnings.filterwarnings("ignore", category=FutureWarning)


def _sizes(seed: int, n: int, max_side: int = 20000) -> list[tuple[int, int]]:
    """``(width, height)`` pairs: log-uniform sides, extreme aspect ratios, tiny and square ones."""
    rng = np.random.default_rng(seed)
    w = np.exp(rng.uniform(0, math.log(max_side), n)).astype(int) + 1
    h = np.exp(rng.uniform(0, math.log(max_side), n)).astype(int) + 1
    fixed = [(1, 1), (1, 2), (2, 1), (27, 28), (28, 28), (56, 56), (13, 2600), (2600, 13), (1, 200),
             (200, 1), (1, 201), (448, 448), (336, 336), (1920, 1080), (1080, 1920), (640, 480),
             (640, 427), (4000, 3000), (20000, 100), (100, 20000), (50, 10000), (364, 364), (512, 512)]
    return fixed + list(zip(w.tolist(), h.tolist()))


def _check_invariants(c: MediaCount) -> None:
    assert c.items == len(c.seqlens) >= 1
    assert c.encoder_tokens == sum(c.seqlens) > 0
    assert c.llm_tokens > 0


@pytest.fixture(scope="module")
def coco_sizes(shared_data) -> list[tuple[int, int]]:
    data = json.loads((shared_data / "coco-val2017" / "captions_val2017.json").read_text())
    return [(im["width"], im["height"]) for im in data["images"]]


@pytest.fixture(scope="module")
def mathvista_sizes(shared_data) -> list[tuple[int, int]]:
    data = json.loads((shared_data / "mathvista-testmini" / "testmini.json").read_text())
    return [(r["metadata"]["img_width"], r["metadata"]["img_height"]) for r in data.values()]


# --------------------------------------------------------------------------- Qwen2-VL / Qwen2.5-VL
@pytest.fixture(scope="module")
def qwen_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056)


@pytest.mark.parametrize("preset", ["qwen2-vl", "qwen2.5-vl"])
def test_qwen_matches_processor_patch_counts(preset, qwen_processor, coco_sizes, mathvista_sizes):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    rule = get_rule(preset)
    checked = 0
    for w, h in _sizes(1, 3000) + coco_sizes[::5] + mathvista_sizes:
        try:
            ref_h, ref_w = smart_resize(h, w, 28, 3136, 12845056)
        except ValueError:
            with pytest.raises(MediaRejected, match="aspect ratio"):
                rule.count_image(w, h)
            continue
        c = rule.count_image(w, h)
        patches = qwen_processor.get_number_of_image_patches(h, w, {})
        assert rule.resized_size(w, h) == (ref_w, ref_h)
        assert (c.encoder_tokens, c.llm_tokens, c.items) == (patches, patches // 4, 1), (w, h)
        _check_invariants(c)
        checked += 1
    assert checked > 3000


def test_qwen_transformers_default_vs_released_max_pixels(qwen_processor):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    library_default = Qwen2VLImageProcessorPil()  # max_pixels 28*28*1280 = 1,003,520
    assert library_default.size["longest_edge"] == 1003520
    assert get_rule("qwen2-vl").count_image(1080, 1920).llm_tokens == 2691
    assert qwen_processor.get_number_of_image_patches(1920, 1080, {}) // 4 == 2691
    assert get_rule("qwen2-vl", max_pixels=1003520).count_image(1080, 1920).llm_tokens == 1222
    assert library_default.get_number_of_image_patches(1920, 1080, {}) // 4 == 1222


def test_qwen_full_processor_on_tiny_images(qwen_processor):
    rule = get_rule("qwen2-vl")
    rng = np.random.default_rng(2)
    shapes = [(1, 1), (3, 500), (500, 3), (27, 29), (60, 90), (200, 1)] + [
        tuple(int(x) for x in rng.integers(1, 120, 2)) for _ in range(24)]
    for w, h in shapes:
        out = qwen_processor(images=[np.zeros((h, w, 3), np.uint8)], return_tensors=None, input_data_format="channels_last")
        t, gh, gw = (int(x) for x in out["image_grid_thw"][0])
        c = rule.count_image(w, h)
        assert (c.encoder_tokens, c.llm_tokens) == (t * gh * gw, t * gh * gw // 4), (w, h)
        assert len(out["pixel_values"]) == c.encoder_tokens


def test_qwen_rejects_extreme_aspect_ratio():
    with pytest.raises(MediaRejected) as info:
        get_rule("qwen2-vl").count_image(201, 1)
    assert isinstance(info.value, SampleError) and info.value.kind == "rejected_by_model"
    assert "201" in str(info.value)
    get_rule("qwen2-vl").count_image(200, 1)  # exactly 200 is accepted


def test_qwen_video_matches_video_processor():
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchvision", reason="transformers' video processors need torchvision")
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    proc = Qwen2VLVideoProcessor()
    rule = get_rule("qwen2-vl", cap_pixels_per_frame=True)
    for total, src_fps, w, h in [(60, 30.0, 64, 48), (9, 3.0, 40, 90), (300, 25.0, 30, 30), (41, 1.0, 100, 60)]:
        meta = VideoMetadata(total_num_frames=total, fps=src_fps, width=w, height=h)
        video = torch.zeros((total, 3, h, w), dtype=torch.uint8)
        out = proc(videos=[video], video_metadata=[meta], do_sample_frames=True, fps=2.0,
                   cap_pixels_per_frame=True, return_tensors="pt")
        t, gh, gw = (int(x) for x in out["video_grid_thw"][0])
        c = rule.count_video(total, w, h, fps=src_fps)
        assert (c.encoder_tokens, c.items, c.llm_tokens) == (t * gh * gw, t, t * gh * gw // 4), (total, w, h)
        _check_invariants(c)


def _qwen_vl_utils_video(total_frames: int, video_fps: float, width: int, height: int) -> tuple[int, int, int]:
    """qwen-vl-utils' ``smart_nframes`` + ``fetch_video`` resize (the reference implementation,
    float budget division), transcribed; returns ``(grid_t, grid_h, grid_w)``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    min_frames = math.ceil(4 / 2) * 2
    max_frames = math.floor(min(768, total_frames) / 2) * 2
    nframes = total_frames / video_fps * 2.0
    nframes = min(min(max(nframes, min_frames), max_frames), total_frames)
    nframes = math.floor(nframes / 2) * 2
    min_pixels, total_pixels = 128 * 28 * 28, int(128000 * 28 * 28 * 0.9)
    max_pixels = max(min(768 * 28 * 28, total_pixels / nframes * 2), int(min_pixels * 1.05))
    h, w = smart_resize(height, width, 28, min_pixels, max_pixels)
    return nframes // 2, h // 14, w // 14


def test_qwen_video_matches_reference_sampling_and_budget():
    rule = get_rule("qwen2-vl", cap_pixels_per_frame=True, frame_sampler="qwen-vl-utils")
    rng = np.random.default_rng(12)
    for _ in range(1500):
        src_fps = float(rng.choice([1.0, 10.0, 23.976, 25.0, 30.0, 60.0]))
        total = int(rng.integers(2, 60 * 60 * 30))
        w, h = (int(x) for x in rng.integers(16, 4000, 2))
        if max(w, h) / min(w, h) > 200:
            continue
        t, gh, gw = _qwen_vl_utils_video(total, src_fps, w, h)
        c = rule.count_video(total, w, h, fps=src_fps)
        assert (c.items, c.encoder_tokens, c.llm_tokens) == (t, t * gh * gw, t * gh * gw // 4), (total, src_fps, w, h)
        assert c.llm_tokens <= 128000


def test_qwen_video_budget_and_sampling():
    rule = get_rule("qwen2-vl", cap_pixels_per_frame=True)
    assert (qwen_sampled_frames(0, 755.0) == 768 and qwen_sampled_frames(0, 1.0) == 4
            and qwen_sampled_frames(0, 10.3) == 20)
    assert rule.sampled_frames(0, None, 12.5) == 24
    long_hd = rule.count_video(0, 1920, 1080, duration_s=600.0)   # 768 frames -> per-frame cap
    short_hd = rule.count_video(0, 1920, 1080, duration_s=10.0)   # 20 frames -> 768*28*28 cap
    assert long_hd.items == 384 and short_hd.items == 10
    assert long_hd.llm_tokens <= 128000 < 768 // 2 * short_hd.seqlens[0] // 4
    assert short_hd.seqlens[0] // 4 <= 768
    with pytest.raises(MediaRejected):
        rule.count_video(1, 64, 64, fps=30.0)  # one frame: no temporal pair to sample


# --------------------------------------------------------------------------- InternVL
def _internvl_reference_tiles(width: int, height: int, image_size=448, min_num=1, max_num=12) -> int:
    """InternVL's own ``dynamic_preprocess`` tile count (OpenGVLab's code, set-ordered ratios)."""
    aspect_ratio = width / height
    target_ratios = set((i, j) for n in range(min_num, max_num + 1) for i in range(1, n + 1)
                        for j in range(1, n + 1) if min_num <= i * j <= max_num)
    target_ratios = sorted(target_ratios, key=lambda x: x[0] * x[1])
    best_ratio_diff, best_ratio = float("inf"), (1, 1)
    area = width * height
    for ratio in target_ratios:
        diff = abs(aspect_ratio - ratio[0] / ratio[1])
        if diff < best_ratio_diff:
            best_ratio_diff, best_ratio = diff, ratio
        elif diff == best_ratio_diff and area > 0.5 * image_size * image_size * ratio[0] * ratio[1]:
            best_ratio = ratio
    blocks = best_ratio[0] * best_ratio[1]
    return blocks + 1 if blocks != 1 else 1


@pytest.fixture(scope="module")
def got_processor():
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    return GotOcr2ImageProcessorPil(crop_to_patches=True, min_patches=1, max_patches=12,
                                    size={"height": 448, "width": 448})


def test_internvl_matches_processor_and_reference(got_processor, coco_sizes, mathvista_sizes):
    rule = get_rule("internvl")
    for w, h in _sizes(3, 3000) + coco_sizes[::5] + mathvista_sizes:
        c = rule.count_image(w, h)
        tiles = got_processor.get_number_of_image_patches(h, w, {})
        assert c.items == tiles == _internvl_reference_tiles(w, h), (w, h)
        assert c.llm_tokens == 2 + 256 * tiles and c.encoder_tokens == 1024 * tiles
        _check_invariants(c)


@pytest.mark.parametrize("max_num", [1, 4, 6])
def test_internvl_max_tiles_override(got_processor, max_num):
    rule = get_rule("internvl", max_num=max_num)
    for w, h in _sizes(4, 400):
        ref = got_processor.get_number_of_image_patches(h, w, {"max_patches": max_num})
        assert rule.count_image(w, h).items == ref == _internvl_reference_tiles(w, h, max_num=max_num)


def test_internvl_full_processor_on_tiny_images(got_processor):
    rule = get_rule("internvl")
    rng = np.random.default_rng(5)
    shapes = [(1, 1), (2, 30), (30, 2), (64, 48), (48, 64)] + [
        tuple(int(x) for x in rng.integers(1, 64, 2)) for _ in range(5)]
    for w, h in shapes:
        out = got_processor(images=[np.zeros((h, w, 3), np.uint8)], return_tensors=None, input_data_format="channels_last")
        assert out["num_patches"][0] == len(out["pixel_values"]) == rule.count_image(w, h).items


def test_coco_facts_of_the_data_readme(coco_sizes):
    tiles = np.array([get_rule("internvl").count_image(w, h).items for w, h in coco_sizes])
    assert (tiles == 7).sum() == 2197 and (tiles == 13).sum() == 2303
    qwen = np.array([get_rule("qwen2-vl").count_image(w, h).llm_tokens for w, h in coco_sizes])
    assert int(np.median(qwen)) == 345


def test_mathvista_range_under_qwen(mathvista_sizes):
    qwen = [get_rule("qwen2-vl").count_image(w, h).llm_tokens for w, h in mathvista_sizes]
    assert (min(qwen), max(qwen)) == (6, 16224)


def test_internvl_multi_image_budget_of_the_finetuning_code():
    sizes = [(640, 480), (1920, 1080), (300, 3000)]
    plain = get_rule("internvl")
    assert [c.items for c in count_images(plain, sizes)] == [plain.count_image(w, h).items for w, h in sizes]
    budget = get_rule("internvl", multi_image_budget=True)
    got = [c.items for c in count_images(budget, sizes)]
    assert got == [_internvl_reference_tiles(w, h, max_num=12 // 3) for w, h in sizes]
    assert [c.items for c in count_images(budget, [(640, 480)] * 13)] == [1] * 13  # max(1, 12 // 13)
    assert count_images(budget, [(640, 480)])[0].items == 13


def test_internvl_video_is_one_tile_per_frame():
    c = get_rule("internvl", num_segments=16).count_video(0, 1920, 1080, duration_s=90.0)
    assert c == MediaCount(16 * 1024, 16, 16 * 258, (1024,) * 16)


# --------------------------------------------------------------------------- registry
def test_get_rule_errors():
    with pytest.raises(UsageError, match="qwen2-vl"):
        get_rule("gpt-5-vision")
    with pytest.raises(UsageError, match="max_tiles"):
        get_rule("internvl", max_frames=3)
    with pytest.raises(UsageError, match="int"):
        get_rule("qwen2-vl", max_pixels="big")
    with pytest.raises(UsageError, match="patch_size=0"):
        get_rule("llava-next", patch_size=0)
    with pytest.raises(UsageError, match="exceeds"):
        get_rule("qwen2-vl", min_pixels=10**8)
    with pytest.raises(UsageError, match="min_tiles"):
        get_rule("internvl", min_num=13)
    with pytest.raises(UsageError, match="pinpoints"):
        get_rule("llava-next", image_grid_pinpoints=[[336]])
    assert get_rule("llava-next", image_grid_pinpoints=[[336, 336]]).count_image(640, 480).items == 2
    assert set(PRESETS) == {"qwen2-vl", "qwen2.5-vl", "internvl", "llava-1.5", "llava-next",
                            "llava-onevision", "idefics3", "smolvlm", "qwen3-vl", "gemma3", "glm-4.1v",
                            "pixtral", "mistral3", "qwen2.5-omni", "qwen3-omni"}


def test_rule_from_processor_config(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 3136, "longest_edge": 1003520}, "patch_size": 14, "merge_size": 2,
         "image_mean": [0.5, 0.5, 0.5]}))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"fps": 1.0, "max_pixels": 360 * 420}))
    rule = rule_from_processor_config("qwen2-vl", tmp_path)
    assert (rule.max_pixels, rule.fps, rule.video_max_pixels) == (1003520, 1.0, 151200)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"max_dynamic_patch": 6, "force_image_size": 448, "use_thumbnail": True}))
    assert rule_from_processor_config("internvl", cfg).max_tiles == 6
    hf = tmp_path / "hf.json"
    hf.write_text(json.dumps({"crop_to_patches": True, "max_patches": 4, "size": {"height": 448, "width": 448}}))
    assert rule_from_processor_config("internvl", hf).max_tiles == 4


@pytest.mark.parametrize("name, text, message", [
    ("list.json", "[1, 2]", "list.json: processor config is not a JSON object (it holds a list); fix: pass"),
    ("cut.json", "{\"size\": ", "cut.json: cannot read processor config"),
    ("absent.json", None, "absent.json: processor config not found; fix: check the path"),
])
def test_a_bad_processor_config_is_one_error_with_its_fix(tmp_path, name, text, message):
    if text is not None:
        (tmp_path / name).write_text(text)
    with pytest.raises(InputError, match="; fix: ") as raised:
        rule_from_processor_config("qwen2-vl", tmp_path / name)
    assert message in str(raised.value)


# --------------------------------------------------------------------------- LLaVA / Idefics3 / SmolVLM
def _tiny_tokenizer(merge_double_newline: bool = True):
    """A word-level tokenizer where every placeholder / wrapper / newline is one token, like the
    released ones (Idefics3's Llama-3 and SmolVLM's tokenizers merge ``\\n\\n`` into one token)."""
    from tokenizers import AddedToken, Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    special = ["<image>", "<video>", "<fake_token_around_image>", "<global-img>"]
    special += [f"<row_{r}_col_{c}>" for r in range(1, 9) for c in range(1, 9)]
    fast.add_special_tokens({"additional_special_tokens": special})
    newlines = ["\n\n", "\n"] if merge_double_newline else ["\n"]
    fast.add_tokens([AddedToken(t, normalized=False, special=False) for t in newlines])
    return fast


def _image(w: int, h: int) -> np.ndarray:
    return np.zeros((h, w, 3), np.uint8)


def test_llava15_matches_processor():
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.llava.processing_llava import LlavaProcessor

    proc = LlavaProcessor(image_processor=CLIPImageProcessorPil(size={"shortest_edge": 336},
                                                                crop_size={"height": 336, "width": 336}),
                          tokenizer=_tiny_tokenizer(), patch_size=14, vision_feature_select_strategy="default",
                          num_additional_image_tokens=1)
    rule = get_rule("llava-1.5")
    sizes = _sizes(6, 200)
    ref = proc._get_num_multimodal_tokens(image_sizes=[[h, w] for w, h in sizes])["num_image_tokens"]
    assert [rule.count_image(w, h).llm_tokens for w, h in sizes] == ref == [576] * len(sizes)
    for w, h in [(3, 5), (40, 30), (17, 64)]:
        out = proc(text=["<image>"], images=[_image(w, h)], input_data_format="channels_last")
        assert len(out["input_ids"][0]) == rule.count_image(w, h).llm_tokens
    with pytest.raises(MediaRejected, match="video"):
        rule.count_video(8, 64, 64)


@pytest.fixture(scope="module")
def llava_next_processor():
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor

    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": 336},
                                                 crop_size={"height": 336, "width": 336})
    return LlavaNextProcessor(image_processor=image_processor, tokenizer=_tiny_tokenizer(), patch_size=14,
                              vision_feature_select_strategy="default", num_additional_image_tokens=1)


def test_llava_next_matches_processor(llava_next_processor, coco_sizes, mathvista_sizes):
    from transformers.image_processing_utils import select_best_resolution

    rule = get_rule("llava-next")
    pinpoints = llava_next_processor.image_processor.image_grid_pinpoints
    sizes = _sizes(7, 3000) + coco_sizes[::5] + mathvista_sizes
    ref = llava_next_processor._get_num_multimodal_tokens(image_sizes=[[h, w] for w, h in sizes])
    for (w, h), tokens in zip(sizes, ref["num_image_tokens"]):
        c = rule.count_image(w, h)
        best_h, best_w = select_best_resolution([h, w], pinpoints)
        assert c.llm_tokens == tokens, (w, h)
        assert c.items == 1 + (best_h // 336) * (best_w // 336) and c.encoder_tokens == 576 * c.items
        _check_invariants(c)


def test_llava_next_full_processor_on_tiny_images(llava_next_processor):
    rule = get_rule("llava-next")
    for w, h in [(1, 1), (2, 9), (9, 2), (40, 30), (30, 40), (64, 16), (16, 64), (33, 35)]:
        out = llava_next_processor(text=["<image>"], images=[_image(w, h)], input_data_format="channels_last")
        c = rule.count_image(w, h)
        assert len(out["input_ids"][0]) == c.llm_tokens, (w, h)
        assert len(out["pixel_values"][0]) == c.items


@pytest.fixture(scope="module")
def onevision_processor():
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )
    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

    # The full constructor wants a video processor (torchvision); the counting methods need none.
    proc = object.__new__(LlavaOnevisionProcessor)
    proc.image_processor = LlavaOnevisionImageProcessorPil()
    proc.num_image_tokens, proc.vision_feature_select_strategy = 729, "full"
    proc.vision_aspect_ratio, proc.image_token, proc.video_token = "anyres_max_9", "<image>", "<video>"
    return proc


def test_llava_onevision_matches_processor(onevision_processor, coco_sizes, mathvista_sizes):
    from transformers.image_processing_utils import select_best_resolution

    rule = get_rule("llava-onevision")
    pinpoints = onevision_processor.image_processor.image_grid_pinpoints
    for w, h in _sizes(8, 3000) + coco_sizes[::5] + mathvista_sizes:
        c = rule.count_image(w, h)
        assert c.llm_tokens == onevision_processor._get_number_of_features(h, w, 384, 384), (w, h)
        best_h, best_w = select_best_resolution([h, w], pinpoints)
        assert c.items == 1 + (best_h // 384) * (best_w // 384)
        _check_invariants(c)


def test_llava_onevision_replace_tokens_single_multi_and_video(onevision_processor):
    proc, rule = onevision_processor, get_rule("llava-onevision")
    for sizes in ([(40, 30)], [(30, 70)], [(40, 30), (9, 90)], [(5, 5), (6, 6), (7, 70)]):
        inputs = proc.image_processor(images=[[_image(w, h) for w, h in sizes]], return_tensors=None,
                                      input_data_format="channels_last")
        expected = [c.llm_tokens for c in count_images(rule, sizes)]
        got = [proc.replace_image_token(inputs, i).count("<image>") for i in range(len(sizes))]
        assert got == expected, sizes
        if len(sizes) == 1:
            assert len(inputs["pixel_values"][0]) == rule.count_image(*sizes[0]).items
    video = rule.count_video(0, 640, 360, duration_s=60.0)
    fake = {"pixel_values_videos": [np.zeros((32, 3, 384, 384), np.float32)]}
    assert video.llm_tokens == proc.replace_video_token(fake, 0).count("<video>") == 32 * 196 + 1
    assert video.encoder_tokens == 32 * 729 and video.items == 32


def _idefics_like(cls_proc, cls_image, preset: str, merge: bool = True):
    rule = get_rule(preset)
    image_processor = cls_image(size={"longest_edge": rule.longest_edge},
                                max_image_size={"longest_edge": rule.image_size})
    if cls_proc.__name__ == "Idefics3Processor":
        return rule, cls_proc(image_processor=image_processor, tokenizer=_tiny_tokenizer(merge),
                              image_seq_len=rule.image_seq_len)
    proc = object.__new__(cls_proc)  # SmolVLMProcessor's constructor wants a video processor
    proc.image_processor, proc.image_seq_len = image_processor, rule.image_seq_len
    proc.fake_image_token, proc.image_token, proc.global_image_token = (
        "<fake_token_around_image>", "<image>", "<global-img>")
    proc.tokenizer = _tiny_tokenizer(merge)
    return rule, proc


def test_idefics3_matches_processor(coco_sizes, mathvista_sizes):
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    rule, proc = _idefics_like(Idefics3Processor, Idefics3ImageProcessorPil, "idefics3")
    # The reference is the prompt the processor writes for each image, tokenized: from
    # transformers 5.25 ``_get_num_multimodal_tokens`` counts only the ``<image>`` placeholders,
    # not the crop markers and newlines around them, which the LLM reads too.
    prompt_tokens: dict[tuple[int, int], int] = {}  # tokenize each distinct prompt string once
    for w, h in _sizes(9, 3000) + coco_sizes[::5] + mathvista_sizes:
        tiles, rows, cols = proc.image_processor.get_number_of_image_patches(h, w, {})
        c = rule.count_image(w, h)
        if (rows, cols) not in prompt_tokens:
            text = proc.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)
            prompt_tokens[rows, cols] = len(proc.tokenizer(text, add_special_tokens=False)["input_ids"])
        assert (c.llm_tokens, c.items) == (prompt_tokens[rows, cols], max(tiles, 1)), (w, h)
        assert c.encoder_tokens == 676 * c.items
        _check_invariants(c)
    for w, h in [(1, 1), (3, 40), (40, 3), (64, 48), (20, 21), (1, 90)]:
        out = proc(text=["<image>"], images=[[_image(w, h)]], input_data_format="channels_last")
        c = rule.count_image(w, h)
        assert len(out["input_ids"][0]) == c.llm_tokens, (w, h)
        assert np.asarray(out["pixel_values"]).shape[1] == c.items


def test_idefics3_tokenizer_without_double_newline_token():
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    _, proc = _idefics_like(Idefics3Processor, Idefics3ImageProcessorPil, "idefics3", merge=False)
    rule = get_rule("idefics3", split_newline_extra=1)
    out = proc(text=["<image>"], images=[[_image(64, 48)]], input_data_format="channels_last")
    assert len(out["input_ids"][0]) == rule.count_image(64, 48).llm_tokens


def test_smolvlm_matches_processor(coco_sizes, mathvista_sizes):
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
    from transformers.models.smolvlm.processing_smolvlm import SmolVLMProcessor

    rule, proc = _idefics_like(SmolVLMProcessor, SmolVLMImageProcessorPil, "smolvlm")
    assert rule.image_seq_len == 64 and rule.patches_per_tile == 1024
    prompt_tokens: dict[tuple[int, int], int] = {}  # tokenize each distinct prompt string once
    for w, h in _sizes(10, 3000) + coco_sizes[::5] + mathvista_sizes:
        tiles, rows, cols = proc.image_processor.get_number_of_image_patches(h, w, {})
        c = rule.count_image(w, h)
        assert c.items == max(tiles, 1), (w, h)
        if (rows, cols) not in prompt_tokens:
            text = proc.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)
            prompt_tokens[rows, cols] = len(proc.tokenizer(text, add_special_tokens=False)["input_ids"])
        assert c.llm_tokens == prompt_tokens[rows, cols], (w, h)
    for w, h in [(2, 2), (50, 7), (7, 50), (64, 48)]:
        inputs = proc.image_processor(images=[[_image(w, h)]], return_row_col_info=True,
                                      input_data_format="channels_last")
        text = proc.replace_image_token(inputs, 0)
        c = rule.count_image(w, h)
        assert c.llm_tokens == len(proc.tokenizer(text, add_special_tokens=False)["input_ids"])
        assert np.asarray(inputs["pixel_values"]).shape[1] == c.items


def test_smolvlm_video_frames():
    rule = get_rule("smolvlm")
    c = rule.count_video(300, 640, 360, fps=30.0)  # 10 s at 1 fps
    assert c == MediaCount(10 * 1024, 10, 10 * 67, (1024,) * 10)
    assert rule.count_video(0, 640, 360, duration_s=3600.0).items == 64
    assert rule.count_video(5, 640, 360, fps=1.0).items == 5       # 5 s, 5 frames
    with pytest.raises(MediaRejected, match="video"):
        get_rule("idefics3").count_video(8, 64, 64)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_on_random_sizes_keeps_invariants(preset):
    rule = get_rule(preset)
    for w, h in _sizes(11, 300):
        try:
            c = rule.count_image(w, h)
        except MediaRejected:  # the Qwen/GLM aspect-ratio limit; Pixtral shrinking a side to 0 px
            assert (preset.startswith(("qwen", "glm")) and max(w, h) / min(w, h) > 200) or (
                preset in ("pixtral", "mistral3") and max(w, h) / min(w, h) > 1024)
            continue
        _check_invariants(c)
    with pytest.raises(MediaRejected):
        rule.count_image(0, 10)


def test_docstring_examples():
    import doctest

    from balancer_cli.scan import image_header
    from balancer_cli.scan.rules import base, llava, qwen, registry, tiles

    for module in (base, qwen, tiles, llava, registry, image_header):
        failed, attempted = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert attempted > 0 and failed == 0, module.__name__


def test_smolvlm_2b_from_model_folder(tmp_path):
    """SmolVLM-2.2B: 384 px tiles, SigLIP patch 14, shuffle 3 -> 81 tokens per tile."""
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"max_image_size": {"longest_edge": 384}, "size": {"longest_edge": 1536}, "do_image_splitting": True,
         "video_sampling": {"fps": 1, "max_frames": 64, "video_size": {"longest_edge": 384}}}))
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_len": 81}))
    (tmp_path / "config.json").write_text(json.dumps({"scale_factor": 3, "vision_config": {"patch_size": 14}}))
    rule = rule_from_processor_config("smolvlm", tmp_path)
    assert (rule.image_size, rule.longest_edge, rule.patch_size, rule.image_seq_len) == (384, 1536, 14, 81)
    assert rule.patches_per_tile == 729 and rule.max_frames == 64
    c = rule.count_image(640, 480)  # 1536 x 1152 -> 3 rows x 4 cols + global
    assert (c.items, c.llm_tokens) == (13, 3 * (4 * 83 + 1) + 84)
