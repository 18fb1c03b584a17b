"""Inputs shared by the pack tests: three modules the packer cannot make equal (the step tests),
and a text-only mix whose searched pick breaks a bound in full (the pick check's tests)."""

from __future__ import annotations

import numpy as np

from balancer_cli.lengths import make_lengths_table


def three_modules(seed, n, sources, *, tiles=(5, 8), tiled_every_other=False):
    """(load_NK, cost_NK, source_N): tiles (drawn from ``tiles`` a sample) in source 0 (or every
    even source), 1-3 audio clips of 50-1,500 tokens in source 1 whose tokens are part of the LLM
    sequence (as are 256 a tile), text in all."""
    rng = np.random.default_rng(seed)
    source = rng.integers(0, sources, n)
    tiled = source % 2 == 0 if tiled_every_other else source == 0
    tiles = np.where(tiled, rng.choice(tiles, n), 0)
    clips = np.where(source == 1, rng.integers(1, 4, n), 0)
    audio = sum(np.where(clips > c, rng.integers(50, 1501, n), 0) for c in range(3))
    text = rng.integers(10, 800, n)
    load = np.stack([tiles, clips, text + 256 * tiles + audio], 1)
    cost = np.stack([256.0 * tiles, audio.astype(float), load[:, 2].astype(float)], 1)
    return load, cost, source


def text_only_20k():
    """Sources of disjoint lengths: at ``--dp 64`` x 2 the subsample's pick (LLM cap 4,167) takes
    a step more in full (and was 2.87x less mixed than random batching there before the coarser
    cells: 0.03x now; 0.58x on the subsample)."""
    rng = np.random.default_rng(0)
    n = 20000
    src = rng.choice(3, n, p=[0.6, 0.3, 0.1])
    llm = np.where(src == 0, rng.integers(50, 200, n),
                   np.where(src == 1, rng.integers(1000, 3000, n), rng.integers(200, 400, n)))
    return make_lengths_table(llm, {}, source=np.array(["a", "b", "c"])[src])
