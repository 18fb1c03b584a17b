"""`balancer scan` over the real data in ../shared/data (converted to records where needed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from balancer_cli.scan.pipeline import scan
from balancer_cli.scan.measure import ScanConfig
from balancer_cli.scan.rules.registry import get_rule


def _write_jsonl(path: Path, records) -> Path:
    with open(path, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    return path


@pytest.fixture(scope="module")
def coco_jsonl(shared_data: Path, tmp_path_factory) -> Path:
    """COCO val2017 as records shaped like the annotation: file_name, width, height, caption."""
    coco = json.loads((shared_data / "coco-val2017" / "captions_val2017.json").read_text())
    caption = {}
    for annotation in coco["annotations"]:
        caption.setdefault(annotation["image_id"], annotation["caption"])
    records = ({"file_name": im["file_name"], "width": im["width"], "height": im["height"],
                "caption": caption[im["id"]]} for im in coco["images"])
    return _write_jsonl(tmp_path_factory.mktemp("coco") / "coco.jsonl", records)


COCO_FIELDS = (("image", "file_name"), ("text", "caption"))


def test_coco_sizes_under_qwen2_vl_and_internvl(coco_jsonl):
    qwen = scan([str(coco_jsonl)], ScanConfig(model="qwen2-vl", fields=COCO_FIELDS), jobs=1).lengths
    assert qwen.num_samples == 5000 and qwen.ok_mask().all()
    # Qwen2-VL merges 2x2 patches: LLM image tokens = encoder patches / 4; the README's p50 is 345.
    assert np.median(qwen.tokens("vision") // 4) == 345
    internvl = scan([str(coco_jsonl)], ScanConfig(model="internvl", fields=COCO_FIELDS), jobs=1).lengths
    tiles = internvl.items("vision")
    assert (tiles == 7).sum() == 2197 and (tiles == 13).sum() == 2303  # the README's bimodal split
    # Captions are short: the LLM length is the template + caption + the image placeholders.
    text = internvl.llm_tokens() - 256 * tiles
    assert 30 < np.median(text) < 120


def test_mathvista_extreme_sizes(shared_data, tmp_path):
    mathvista = json.loads((shared_data / "mathvista-testmini" / "testmini.json").read_text())
    records = [{"image": v["image"], "width": v["metadata"]["img_width"], "height": v["metadata"]["img_height"],
                "question": v["query"] if "query" in v else v["question"], "answer": str(v.get("answer", ""))}
               for v in mathvista.values()]
    lengths = scan([str(_write_jsonl(tmp_path / "mv.jsonl", records))], ScanConfig(model="qwen2-vl"), jobs=1).lengths
    assert lengths.num_samples == 1000 and lengths.ok_mask().all()
    per_image = lengths.tokens("vision") // 4
    assert (per_image.min(), per_image.max()) == (6, 16224)  # the README's range


def test_llava_scienceqa_as_shipped(shared_data):
    """The LLaVA file as-is: text-only samples measure, image samples say which image is missing."""
    path = shared_data / "llava-scienceqa" / "scienceqa_llava_test_CQM-A.json"
    records = json.loads(path.read_text())
    lengths = scan([str(path)], ScanConfig(model="qwen2-vl"), jobs=1, block_size=1000).lengths
    has_image = np.array(["image" in r for r in records])
    assert lengths.num_samples == len(records) == 4241
    assert (lengths.ok_mask() == ~has_image).all()
    first = int(np.flatnonzero(has_image)[0])
    assert lengths.errors()[first].startswith(f"missing_file: {path}:")
    assert f"image not found: {records[first]['image']}" in lengths.errors()[first]
    assert (lengths.llm_tokens()[~has_image] > 20).all()


def test_llava_scienceqa_with_sizes_from_a_side_table(shared_data, tmp_path):
    """With per-record sizes added (as a size pre-pass would), every sample measures."""
    path = shared_data / "llava-scienceqa" / "scienceqa_llava_test_CQM-A.json"
    records = json.loads(path.read_text())
    for i, record in enumerate(records):
        if "image" in record:
            record.update(width=200 + 7 * (i % 50), height=150 + 11 * (i % 30))
    lengths = scan([str(_write_jsonl(tmp_path / "sqa.jsonl", records))], ScanConfig(model="llava-1.5"), jobs=1).lengths
    assert lengths.ok_mask().all()
    with_image = np.array(["image" in r for r in records])
    assert (lengths.items("vision") == with_image).all()
    assert (lengths.tokens("vision")[with_image] == get_rule("llava-1.5").count_image(640, 480).encoder_tokens).all()


def test_activitynet_durations(shared_data, tmp_path):
    videos = json.loads((shared_data / "activitynet-captions" / "train_modified.json").read_text())
    records = [{"video": f"{key}.mp4", "duration": v["duration"],
                "conversations": [{"from": "human", "value": "<video>\nDescribe the video."},
                                  {"from": "gpt", "value": " ".join(s.strip() for s in v["sentences"])}]}
               for key, v in videos.items()]
    data = _write_jsonl(tmp_path / "anet.jsonl", records)
    lengths = scan([str(data)], ScanConfig(model="qwen2-vl", video_size=(640, 360)), jobs=1, block_size=4096).lengths
    assert lengths.num_samples == 10009 and lengths.ok_mask().all()
    assert lengths.modules == ("vision", "video")  # vision is always kept, audio dropped (none)
    rule = get_rule("qwen2-vl")
    durations = np.array([r["duration"] for r in records])
    for i in (int(durations.argmin()), int(durations.argmax()), 0):
        expected = rule.count_video(0, 640, 360, duration_s=float(durations[i]))
        assert lengths.tokens("video")[i] == expected.encoder_tokens
        assert lengths.items("video")[i] == expected.items
    assert lengths.tokens("vision").sum() == 0
