"""``--model hf:DIR``: local folders written by transformers' own classes (``save_pretrained``, no
download) counted through their size-only APIs, equal to the hand-written presets over thousands of
sizes, videos and clips; ``scan --verify``; the folder's chat template as countable pieces."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import jinja2
import numpy as np
import pytest
from click.testing import CliRunner
from rules_util import (  # noqa: F401
    copy_tokenizer,
    qwen2_video_processor_class,
    qwen_tokenizer_dir,
    sizes,
    videos,
    write_json,
)

from balancer_cli.errors import UsageError
from balancer_cli.scan.measure import ScanConfig
from balancer_cli.scan.pipeline import scan
from balancer_cli.scan.rules.base import MediaRejected
from balancer_cli.scan.rules.hf import HFRule
from balancer_cli.scan.rules.hf_template import render_hf_template
from balancer_cli.scan.rules.registry import get_rule

warnings.filterwarnings("ignore", category=FutureWarning)

TEMPLATE = ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
            "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
            "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
            "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'video' %}"
            "<|vision_start|><|video_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
            "<|im_end|>\n{% endfor %}")


def _qwen_image(patch: int, low: int, high: int):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(patch_size=patch, size={"shortest_edge": low, "longest_edge": high})


def _folder(root: Path, name: str, tokenizer: Path, processor: dict, *parts) -> Path:
    folder = root / name
    folder.mkdir()
    for part in parts:
        part.save_pretrained(folder)
    write_json(folder / "processor_config.json", processor)
    copy_tokenizer(tokenizer, folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory, qwen_tokenizer_dir):  # noqa: F811
    from transformers import WhisperFeatureExtractor
    from transformers.models.gemma3.image_processing_pil_gemma3 import (
        Gemma3ImageProcessorPil,
    )
    from transformers.models.glm4v.image_processing_pil_glm4v import (
        Glm4vImageProcessorPil,
    )
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
    from transformers.models.pixtral.image_processing_pil_pixtral import (
        PixtralImageProcessorPil,
    )
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
        Qwen3VLVideoProcessor,
    )

    root, tok = tmp_path_factory.mktemp("hf"), qwen_tokenizer_dir
    qwen2_video = qwen2_video_processor_class()
    out = {
        "qwen2-vl": _folder(root, "qwen2-vl", tok, {"processor_class": "Qwen2VLProcessor"},
                            _qwen_image(14, 3136, 12845056), qwen2_video(do_sample_frames=True, fps=2.0)),
        "qwen3-vl": _folder(root, "qwen3-vl", tok, {"processor_class": "Qwen3VLProcessor"},
                            _qwen_image(16, 65536, 16777216),
                            Qwen3VLVideoProcessor(size={"shortest_edge": 4096, "longest_edge": 25165824})),
        "glm-4.1v": _folder(root, "glm", tok, {"processor_class": "Glm4vProcessor"},
                            Glm4vImageProcessorPil(size={"shortest_edge": 12544, "longest_edge": 9633792}),
                            Glm4vVideoProcessor()),
        "gemma3": _folder(root, "gemma3", tok, {"processor_class": "Gemma3Processor", "image_seq_length": 256},
                          Gemma3ImageProcessorPil(size={"height": 896, "width": 896}, do_pan_and_scan=True,
                                                  pan_and_scan_min_crop_size=256, pan_and_scan_max_num_crops=4,
                                                  pan_and_scan_min_ratio_to_activate=1.2)),
        "mistral3": _folder(root, "mistral3", tok, {"processor_class": "PixtralProcessor", "patch_size": 14,
                                                    "spatial_merge_size": 2},
                            PixtralImageProcessorPil(size={"longest_edge": 1540}, patch_size={"height": 14, "width": 14})),
    }
    for name, patch, cls in [("qwen2.5-omni", 14, "Qwen2_5OmniProcessor"), ("qwen3-omni", 16, "Qwen3OmniMoeProcessor")]:
        folder = _folder(root, name, tok, {"processor_class": cls},
                         qwen2_video(patch_size=patch, do_sample_frames=True, fps=2.0))
        image = _qwen_image(patch, 3136, 12845056).to_dict()
        audio = WhisperFeatureExtractor(feature_size=128, chunk_length=300).to_dict()
        write_json(folder / "preprocessor_config.json", {**audio, **image})  # one merged file, as released
        write_json(folder / "config.json", {"thinker_config": {"audio_config": {"n_window": 100 if patch == 14 else 50}}})
        out[name] = folder
    return out


def _count(rule, what, *args, **kwargs):
    try:
        return getattr(rule, f"count_{what}")(*args, **kwargs)
    except MediaRejected:
        return "rejected"


@pytest.mark.parametrize("name", ["qwen2-vl", "qwen3-vl", "glm-4.1v", "gemma3", "mistral3", "qwen2.5-omni",
                                  "qwen3-omni"])
def test_hf_folder_equals_the_preset(name, folders):
    rule = get_rule(f"hf:{folders[name]}")
    assert isinstance(rule, HFRule) and rule.counted_by == "transformers" and rule.notes == ()
    tokenizer = str(folders[name] / "tokenizer.json")
    extra = {"gemma3": {"do_pan_and_scan": True, "text_tokenizer": tokenizer},
             "glm-4.1v": {"timestamp_tokenizer": tokenizer}, "qwen3-vl": {"timestamp_tokenizer": tokenizer}}
    preset = get_rule(name, **extra.get(name, {}))
    for w, h in sizes(71, 1500):
        assert _count(rule, "image", w, h) == _count(preset, "image", w, h), (name, w, h)
    if name not in ("gemma3", "mistral3"):
        for total, fps, w, h in videos(72, 150):
            assert _count(rule, "video", total, w, h, fps=fps) == _count(preset, "video", total, w, h, fps=fps), (
                name, total, fps, w, h)
        assert _count(rule, "video", 0, 640, 360, duration_s=33.3) == _count(preset, "video", 0, 640, 360,
                                                                              duration_s=33.3)
    if "omni" in name:
        for d in np.exp(np.random.default_rng(73).uniform(np.log(0.01), np.log(2000), 400)).tolist():
            assert _count(rule, "audio", d) == _count(preset, "audio", d), (name, d)


def test_hf_folder_follows_do_sample_frames(tmp_path, folders):
    """Released Qwen2.5-Omni / Qwen2-VL video configs say ``do_sample_frames: false``: the processor
    takes every frame it is handed (their loaders sample 2 fps first); ``--param`` restores that."""
    config = json.loads((folders["qwen2.5-omni"] / "video_preprocessor_config.json").read_text())
    folder = tmp_path / "omni"
    folder.mkdir()
    for file in folders["qwen2.5-omni"].iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    write_json(folder / "video_preprocessor_config.json", {**config, "do_sample_frames": False})
    every = get_rule(f"hf:{folder}").count_video(300, 640, 360, fps=30.0)
    assert every.items == 150 and every == get_rule("qwen2.5-omni").count_video(300, 640, 360)
    sampled = get_rule(f"hf:{folder}", do_sample_frames=True, fps=2.0).count_video(300, 640, 360, fps=30.0)
    assert sampled == get_rule("qwen2.5-omni").count_video(300, 640, 360, fps=30.0) and sampled.items == 10


def test_hf_rule_errors_and_preset_families(tmp_path, folders):
    with pytest.raises(UsageError, match="not a folder"):
        get_rule(f"hf:{tmp_path / 'missing'}")
    with pytest.raises(UsageError, match="no preprocessor_config"):
        get_rule(f"hf:{tmp_path}")
    write_json(tmp_path / "processor_config.json", {"processor_class": "WhateverProcessor"})
    with pytest.raises(UsageError, match="WhateverProcessor"):
        get_rule(f"hf:{tmp_path}")
    write_json(tmp_path / "processor_config.json", {"processor_class": "LlavaOnevisionProcessor"})
    write_json(tmp_path / "preprocessor_config.json", {"vision_aspect_ratio": "anyres_max_4"})
    llava = get_rule(f"hf:{tmp_path}")
    assert llava.counted_by == "preset" and llava.fast.max_crops == 4
    assert llava.count_image(640, 480) == get_rule("llava-onevision", max_crops=4).count_image(640, 480)
    assert [c.llm_tokens for c in (llava.for_images(2).count_image(640, 480),)] == [730]
    with pytest.raises(MediaRejected, match="video"):
        get_rule(f"hf:{folders['mistral3']}").count_video(8, 64, 64)
    with pytest.raises(MediaRejected, match="audio"):
        get_rule(f"hf:{folders['qwen3-vl']}").count_audio(3.0)


def test_hf_template_pieces_count_like_the_tokenizer(folders):
    from transformers import PreTrainedTokenizerFast

    folder = folders["qwen3-vl"]
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    from balancer_cli.scan.rules.hf_template import Part
    from balancer_cli.scan.text import load_tokenizer

    turns = [("user", ["Compare ", Part("image"), " and ", Part("video"), "\nPlease — 说明差异 (naïve café)."]),
             ("assistant", ["They differ.\n\n  Indented  "]), ("user", ["Why?"]), ("assistant", ["12345 != 678."])]
    pieces, specials, media = render_hf_template(str(folder), turns,
                                                 {"<|image_pad|>": "image", "<|video_pad|>": "video"})
    messages = [{"role": r, "content": [{"type": "text", "text": p} if isinstance(p, str) else {"type": p.kind}
                                        for p in parts]} for r, parts in turns]
    text = jinja2.Environment().from_string(TEMPLATE).render(messages=messages)
    assert media == ["image", "video"]
    expected = len(tokenizer(text, add_special_tokens=False)["input_ids"]) - 2  # the two placeholders
    assert sum(load_tokenizer(str(folder)).count_batch(pieces)) + specials == expected


def _images_jsonl(path: Path, n: int, max_ratio: float = 1e9) -> Path:
    rng = np.random.default_rng(74)
    with path.open("w") as f:
        for i in range(n):
            w, h = (int(x) for x in np.exp(rng.uniform(0, np.log(6000), 2)).astype(int) + 1)
            h = int(min(max(h, w / max_ratio), w * max_ratio))
            f.write(json.dumps({"image": f"i{i}.png", "width": w, "height": h, "conversations": [
                {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A thing."}]}) + "\n")
    return path


@pytest.mark.parametrize("model", ["qwen3-vl", "gemma3", "mistral3", "glm-4.1v", "hf"])
def test_scan_verify_reports_agreement(model, tmp_path, folders):
    data = _images_jsonl(tmp_path / "d.jsonl", 120)
    spec = f"hf:{folders['qwen3-vl']}" if model == "hf" else model
    result = scan([str(data)], ScanConfig(model=spec, tokenizer="qwen2"), jobs=1, verify=40)
    report = result.summary["verify"]
    assert report["samples"] == report["media"] == 40 and report["disagreements"] == 0, report
    assert result.summary["rule"]["counted_by"].startswith("transformers" if model == "hf" else "preset")


def test_scan_verify_reports_disagreements_and_strict_exits_1(tmp_path, monkeypatch):
    from balancer_cli.cli import main
    from balancer_cli.scan import verify

    data = _images_jsonl(tmp_path / "d.jsonl", 60, max_ratio=20)
    wrong = get_rule("qwen2-vl", max_pixels=1003520)  # a twin that differs on big images
    monkeypatch.setattr(verify, "reference_rule", lambda rule, tokenizer_json=None: (wrong, "a wrong twin"))
    report = scan([str(data)], ScanConfig(model="qwen2-vl"), jobs=1, verify=30).summary["verify"]
    assert 0 < report["disagreements"] <= report["media"] == 30
    first = report["examples"][0]
    assert first["scan"]["llm_tokens"] > first["transformers"]["llm_tokens"] and first["line"] >= 1
    args = ["scan", str(data), "-o", str(tmp_path / "o.parquet"), "--model", "qwen2-vl", "-q", "--verify", "30"]
    ok = CliRunner().invoke(main, args)
    assert ok.exit_code == 0 and "disagreement(s)" in ok.output and "a wrong twin" in ok.output
    strict = CliRunner().invoke(main, args + ["--strict"])
    assert strict.exit_code == 1 and "disagree with transformers" in strict.output
    assert (tmp_path / "o.parquet").is_file()


def test_cli_hf_model_uses_the_folder_tokenizer(tmp_path, folders):
    from balancer_cli.cli import main

    data = _images_jsonl(tmp_path / "d.jsonl", 5)
    result = CliRunner().invoke(main, ["scan", str(data), "-o", str(tmp_path / "o.parquet"), "--model",
                                       f"hf:{folders['qwen3-vl']}", "-q", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["tokenizer"].endswith("tokenizer.json") and summary["rule"]["rule"] == "HFRule"
    bad = CliRunner().invoke(main, ["scan", str(data), "-o", str(tmp_path / "o.parquet"), "--model",
                                    f"hf:{folders['qwen3-vl']}", "--processor-config", str(folders["qwen3-vl"])])
    assert bad.exit_code == 2 and "processor-config" in bad.output
