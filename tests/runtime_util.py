"""Helpers for the runtime tests (torch): the snippets of docs/runtime.md, a manifest of the real packer
over two epochs and each rank's groups read back from its rows, and the stand-in datasets, collate
functions and model the snippets are run with."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from replay_util import random_lengths

from balancer_cli.lengths import write_lengths
from balancer_cli.manifest import open_manifest, read_dropped
from balancer_cli.pack.config import PackConfig
from balancer_cli.run import pack_to_dir

DOC = Path(__file__).resolve().parents[1] / "docs" / "runtime.md"
#: The trainer tests' manifest: 2 ranks x 2 micro-batches over 120 samples.
WORLD, MICRO, SAMPLES = 2, 2, 120


def snippet(name: str) -> str:
    """The code of the snippet marked ``<!-- snippet: name -->`` in docs/runtime.md."""
    match = re.search(rf"<!-- snippet: {name} -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert match, f"docs/runtime.md has no snippet {name!r}"
    return match.group(1)


def manifest_batches(manifest, rank: int, epoch: int) -> list[list[int]]:
    """Rank ``rank``'s groups of epoch ``epoch``, read from the manifest's rows (step, then micro)."""
    m = open_manifest(manifest)
    rows, first = m.read_all(), sum(m.epoch_num_steps[:epoch])
    keep = (rows.step >= first) & (rows.step < first + m.epoch_num_steps[epoch]) & (rows.rank == rank)
    groups: dict[tuple[int, int], list[int]] = {}
    for step, micro, sample in zip(rows.step[keep], rows.micro[keep], rows.sample[keep]):
        groups.setdefault((int(step), int(micro)), []).append(int(sample))
    return [groups[key] for key in sorted(groups)]


def two_epoch_manifest(name: str, seed: int):
    """A module fixture: ``balancer pack --dp 2 --micro-batches 2 --epochs 2`` (the real packer) over
    ``SAMPLES`` random samples of seed ``seed``, in a temporary folder named ``name``; it gives the
    manifest directory and its lengths table."""

    @pytest.fixture(scope="module")
    def packed(tmp_path_factory) -> tuple[Path, Path]:
        tmp = tmp_path_factory.mktemp(name)
        write_lengths(random_lengths(SAMPLES, seed=seed), tmp / "lengths.parquet")
        pack_to_dir([tmp / "lengths.parquet"], tmp / "out",
                    PackConfig(world_size=WORLD, micro_batches=MICRO, epochs=2), baselines=())
        return tmp / "out", tmp / "lengths.parquet"

    return packed


def manifest_epochs(manifest) -> tuple[list[list[list[list[int]]]], np.ndarray]:
    """``expected[rank][epoch]``, every rank's groups of both epochs (checked to differ between the
    epochs), and the samples the manifest places (all but the dropped ones), sorted."""
    expected = [[manifest_batches(manifest, r, e) for e in range(2)] for r in range(WORLD)]
    assert expected[0][0] != expected[0][1]  # the packed epochs differ: replaying epoch 0 twice would show
    dropped, _ = read_dropped(manifest)
    return expected, np.setdiff1d(np.arange(SAMPLES), dropped)


class Indexed(torch.utils.data.Dataset):
    """Sample i is i (``SAMPLES`` of them)."""

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return i


def index_batch(indices, offset: float = 0.0) -> dict:
    """A batch of ``Indexed`` samples: their indices and ``x``, the indices plus ``offset`` as a column."""
    return {"index": list(indices), "x": torch.tensor(indices, dtype=torch.float32)[:, None] + offset}


class Tokens(torch.utils.data.Dataset):
    """Sample i: a row of token ids of length 2 + i % 7; records what was read."""

    def __init__(self, n: int):
        self.n, self.read = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.read.append(i)
        return {"input_ids": torch.arange(2 + i % 7) % 50 + 1, "index": i}


def collate(items):
    """``Tokens`` samples padded into ``input_ids``, ``attention_mask`` and ``labels`` (-100 on padding)."""
    width = max(len(x["input_ids"]) for x in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    mask = torch.zeros(len(items), width, dtype=torch.long)
    for row, x in enumerate(items):
        ids[row, :len(x["input_ids"])] = x["input_ids"]
        mask[row, :len(x["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def collate_with_index(items):
    """:func:`collate`, plus the batch's sample indices as ``index``."""
    return {**collate(items), "index": [x["index"] for x in items]}


class Recorder(torch.nn.Module):
    """A stand-in model with one weight ``w``: its summed 'loss' is ``w * batch[key].sum()`` (the token
    count by default); ``seen`` records each batch's samples."""

    def __init__(self, key: str = "attention_mask"):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.key, self.seen = key, []

    def forward(self, batch):
        self.seen.append(batch["index"])
        return (self.w * batch[self.key].sum()).sum()

    @property
    def samples(self) -> list[int]:
        """The samples of every batch, in the order they were fed."""
        return [i for batch in self.seen for i in batch]
