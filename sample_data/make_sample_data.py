"""Generate ``sample_data/``: a small multimodal dataset for the README, docs and tests.

Deterministic (fixed seed, no timestamps): running it twice writes byte-identical files.

- ``images/``: solid-color PNG and JPEG files of many sizes and aspect ratios (32x32 to 4000x1000,
  a few KB each), plus one corrupt file.
- ``llava.jsonl``: LLaVA-style records: single image (path only, or path plus width/height),
  multi-image, text-only, video (duration, sometimes size), audio (duration), and a few bad records
  (missing image, a path escaping the image root, a corrupt image, a line that is not JSON, more
  ``<image>`` placeholders than images).
- ``messages.json``: OpenAI/Qwen ``messages`` records (a JSON list) with image parts.
- ``internvl_meta.json``: an InternVL meta file over ``llava.jsonl``.

Usage:
    python sample_data/make_sample_data.py            # writes next to this script
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image

OUT = Path(__file__).resolve().parent
SEED = 20240611
WORDS = ["the", "a", "chart", "shows", "value", "of", "red", "blue", "cat", "dog", "table", "figure", "plot", "number", "left", "right", "top", "bottom", "what", "is", "how", "many", "which", "color", "between", "largest", "smallest", "average", "total", "describe", "image", "scene", "person", "people", "sign", "text", "line", "bar", "year", "percent", "increase", "decrease", "answer", "question", "because"]
# (width, height): squares, landscape, portrait, panoramas, tiny and large.
SIZES = [(32, 32), (48, 640), (64, 64), (100, 30), (120, 900), (160, 120), (224, 224), (240, 320), (300, 2000),
         (320, 240), (336, 336), (400, 300), (448, 448), (480, 640), (500, 375), (512, 512), (600, 400),
         (640, 360), (640, 427), (640, 480), (720, 1280), (768, 1024), (800, 600), (896, 896), (1000, 150),
         (1024, 768), (1080, 1920), (1200, 800), (1280, 720), (1344, 336), (1500, 1500), (1600, 900),
         (1920, 1080), (2048, 1536), (2400, 600), (2560, 1440), (3000, 2000), (3200, 400), (4000, 1000),
         (4000, 3000)]


def _sentence(rng: random.Random, low: int, high: int) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(low, high))]
    return " ".join(words).capitalize() + rng.choice(["?", ".", "."])


def write_images(rng: random.Random) -> list[tuple[str, int, int]]:
    folder = OUT / "images"
    folder.mkdir(exist_ok=True)
    images = []
    for index, (width, height) in enumerate(SIZES):
        color = tuple(rng.randrange(256) for _ in range(3))
        image = Image.new("RGB", (width, height), color)
        if index % 3 == 2 and width * height <= 2_000_000:
            name = f"img_{index:02d}_{width}x{height}.jpg"
            image.save(folder / name, "JPEG", quality=30, optimize=True)
        else:
            name = f"img_{index:02d}_{width}x{height}.png"
            image.save(folder / name, "PNG", optimize=True)
        images.append((f"images/{name}", width, height))
    (folder / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png" * 4)
    return images


def _turns(rng: random.Random, prefix: str, rounds: int) -> list[dict[str, str]]:
    turns = []
    for r in range(rounds):
        question = _sentence(rng, 4, 30)
        turns.append({"from": "human", "value": (prefix + question) if r == 0 else question})
        turns.append({"from": "gpt", "value": " ".join(_sentence(rng, 3, 25) for _ in range(rng.randint(1, 4)))})
    return turns


def llava_records(rng: random.Random, images: list[tuple[str, int, int]]) -> list[str]:
    lines = []
    for i in range(300):
        kind = i % 10
        record: dict = {"id": f"s{i:04d}"}
        if kind in (0, 1, 2, 3):  # one image, path only: the scan reads its header
            path, _, _ = rng.choice(images)
            record["image"] = path
            record["conversations"] = _turns(rng, "<image>\n", rng.randint(1, 3))
        elif kind in (4, 5):  # one image with size fields: no file is opened
            path, width, height = rng.choice(images)
            record.update(image=path, width=width, height=height)
            record["conversations"] = _turns(rng, "<image>\n", rng.randint(1, 2))
        elif kind == 6:  # multi-image
            picks = rng.sample(images, rng.randint(2, 4))
            record["image"] = [p for p, _, _ in picks]
            record["conversations"] = _turns(rng, "<image>\n" * len(picks), 1)
        elif kind in (7, 8):  # text only
            record["conversations"] = _turns(rng, "", rng.randint(1, 4))
        elif i % 30 == 9:  # video with duration (and sometimes a size)
            record["video"] = f"videos/v{i:04d}.mp4"
            record["duration"] = round(rng.uniform(2.0, 180.0), 2)
            if rng.random() < 0.5:
                record.update(width=rng.choice([640, 1280, 1920]), height=rng.choice([360, 720, 1080]))
            record["conversations"] = _turns(rng, "<video>\n", 1)
        elif i % 30 == 19:  # audio clip with a duration
            record["audio"] = {"path": f"audio/a{i:04d}.wav", "duration": round(rng.uniform(1.0, 30.0), 2)}
            record["conversations"] = _turns(rng, "<audio>\n", 1)
        else:  # image without placeholder: LLaVA puts it first
            path, _, _ = rng.choice(images)
            record["image"] = path
            record["conversations"] = _turns(rng, "", 1)
        lines.append(json.dumps(record, ensure_ascii=False))
    # Deliberately bad records, spread through the file.
    bad = [
        {"id": "bad_missing", "image": "images/does_not_exist.png",
         "conversations": [{"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "Nothing."}]},
        {"id": "bad_escape", "image": "../../etc/passwd",
         "conversations": [{"from": "human", "value": "<image>\nRead it."}, {"from": "gpt", "value": "No."}]},
        {"id": "bad_corrupt", "image": "images/corrupt.png",
         "conversations": [{"from": "human", "value": "<image>\nAnd this?"}, {"from": "gpt", "value": "Broken."}]},
        {"id": "bad_placeholders", "image": "images/img_00_32x32.png",
         "conversations": [{"from": "human", "value": "<image><image>\nTwo?"}, {"from": "gpt", "value": "One."}]},
    ]
    for position, record in zip((37, 111, 188, 250), bad):
        lines.insert(position, json.dumps(record))
    lines.insert(150, '{"id": "bad_json", "conversations": [')
    return lines


def messages_records(rng: random.Random, images: list[tuple[str, int, int]]) -> list[dict]:
    records = []
    for i in range(24):
        content: list[dict] = []
        for _ in range(i % 3):
            path, width, height = rng.choice(images)
            part = {"type": "image", "image": path}
            if i % 2:
                part.update(width=width, height=height)
            content.append(part)
        content.append({"type": "text", "text": _sentence(rng, 5, 30)})
        messages = [{"role": "user", "content": content},
                    {"role": "assistant", "content": [{"type": "text", "text": _sentence(rng, 5, 40)}]}]
        if i % 4 == 0:
            messages.insert(0, {"role": "system", "content": "You are a careful visual assistant."})
        records.append({"id": f"m{i:03d}", "messages": messages})
    return records


def main() -> None:
    rng = random.Random(SEED)
    images = write_images(rng)
    (OUT / "llava.jsonl").write_text("\n".join(llava_records(rng, images)) + "\n", encoding="utf-8")
    (OUT / "messages.json").write_text(json.dumps(messages_records(rng, images), indent=1) + "\n", encoding="utf-8")
    meta = {"sample_llava": {"root": "sample_data", "annotation": "sample_data/llava.jsonl", "repeat_time": 1}}
    (OUT / "internvl_meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
