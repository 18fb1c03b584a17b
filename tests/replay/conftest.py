"""Fixtures shared by the replay tests."""

from __future__ import annotations

import pytest
from replay_util import pack_random, random_lengths
from resume_util import with_caps


@pytest.fixture
def capped(tmp_path):
    """A 300-sample manifest of 4 ranks x 2 micro-batches, 2 epochs, in row groups of 32 rows, with
    caps recorded (vision 14, llm 3000), and its lengths table."""
    lengths = random_lengths(300, seed=8)
    src = pack_random(tmp_path / "src", num_samples=300, world_size=4, micro_batches=2, epochs=2, seed=8,
                      rows_per_row_group=32)
    return with_caps(src, tmp_path / "m", lengths, {"vision": 14, "llm": 3000}), lengths
