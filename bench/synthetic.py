"""Synthetic multimodal lengths with a fixed seed, for packing benchmarks.

200k samples by default from four sources: 30% text-only, the others with 1 to 13 InternVL
tiles (256 vision tokens each, counted in the LLM sequence too); optionally a sparse ``audio``
module present in a share of the samples (1 to 3 clips of 50 to 1500 tokens each).

Example:
    >>> d = make_synthetic(1000, seed=0, audio_share=0.1)
    >>> d["modules"], d["load_NK"].shape, round(float((d["load_NK"][:, 0] == 0).mean()), 1)
    (('vision', 'audio', 'llm'), (1000, 3), 0.3)
"""

from __future__ import annotations

import numpy as np

__all__ = ["make_synthetic", "SOURCES"]

#: name -> (share of samples, text tokens log-mean, log-std, tiles low, tiles high)
SOURCES = {
    "chat_text": (0.30, 6.2, 0.9, 0, 0),
    "caption": (0.30, 4.3, 0.5, 1, 5),
    "docvqa": (0.25, 4.8, 0.7, 5, 13),
    "chart": (0.15, 5.5, 0.8, 3, 9),
}
TOKENS_PER_TILE = 256


def make_synthetic(num_samples: int = 200_000, *, seed: int = 0, audio_share: float | None = None,
                   audio_source: bool = False) -> dict:
    """Generate per-sample loads (items / tokens) and costs (tokens).

    With ``audio_source`` the audio clips belong to a ``speech`` source of their own (text plus
    clips, no tiles; ``audio_share`` of the samples) instead of a random share of every source.

    Returns:
        ``{"modules", "load_NK" int64, "cost_NK" float64, "source" (N,) str}``; encoders first,
        ``llm`` last. Encoder loads are items, the LLM load is tokens; costs are tokens.
    """
    rng = np.random.default_rng(seed)
    names = list(SOURCES)
    shares = np.array([SOURCES[s][0] for s in names])
    src = rng.choice(len(names), size=num_samples, p=shares / shares.sum())
    text = np.empty(num_samples, np.int64)
    tiles = np.zeros(num_samples, np.int64)
    for i, name in enumerate(names):
        _, mu, sigma, lo, hi = SOURCES[name]
        idx = np.flatnonzero(src == i)
        text[idx] = np.clip(rng.lognormal(mu, sigma, len(idx)), 8, 6000).astype(np.int64)
        if hi > 0:
            tiles[idx] = rng.integers(lo, hi + 1, len(idx))
    vision_tokens = TOKENS_PER_TILE * tiles
    modules = ["vision"]
    load = [tiles]
    cost = [vision_tokens.astype(np.float64)]
    llm = text + vision_tokens
    if audio_share and audio_source:
        has = rng.random(num_samples) < audio_share
        names.append("speech")
        src = np.where(has, len(names) - 1, src)
        tiles[has] = 0
        vision_tokens = TOKENS_PER_TILE * tiles
        cost[0] = vision_tokens.astype(np.float64)
        text[has] = np.clip(rng.lognormal(4.5, 0.6, int(has.sum())), 8, 6000).astype(np.int64)
        llm = text + vision_tokens
    if audio_share:
        has = (src == len(names) - 1) if audio_source else rng.random(num_samples) < audio_share
        clips = np.where(has, rng.integers(1, 4, num_samples), 0)
        audio_tokens = np.zeros(num_samples, np.int64)
        for c in range(1, 4):
            audio_tokens += np.where(clips >= c, rng.integers(50, 1501, num_samples), 0)
        modules.append("audio")
        load.append(clips)
        cost.append(audio_tokens.astype(np.float64))
        llm = llm + audio_tokens
    modules.append("llm")
    load.append(llm)
    cost.append(llm.astype(np.float64))
    return {
        "modules": tuple(modules),
        "load_NK": np.stack(load, axis=1).astype(np.int64),
        "cost_NK": np.stack(cost, axis=1),
        "source": np.asarray(names, dtype=object)[src],
    }
