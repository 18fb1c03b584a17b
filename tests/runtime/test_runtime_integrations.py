"""The integration snippets of docs/runtime.md, executed as written, plus the example script."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from replay_util import pack_random, random_lengths  # noqa: E402

from balancer_cli.runtime import ManifestBatchSampler  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "runtime.md"


def snippet(name: str) -> str:
    match = re.search(rf"<!-- snippet: {name} -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert match, f"docs/runtime.md has no snippet {name!r}"
    return match.group(1)


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
    width = max(len(x["input_ids"]) for x in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    mask = torch.zeros(len(items), width, dtype=torch.long)
    for row, x in enumerate(items):
        ids[row, :len(x["input_ids"])] = x["input_ids"]
        mask[row, :len(x["input_ids"])] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    lengths = random_lengths(120, seed=4)
    out = pack_random(tmp_path_factory.mktemp("integ"), num_samples=120, world_size=2, micro_batches=2,
                      lengths=lengths)
    return out, out / "lengths.parquet"


def collate_with_index(items):
    return {**collate(items), "index": [x["index"] for x in items]}


class SumLoss(torch.nn.Module):
    """A stand-in model: its 'loss' is the token count; it records the samples it was fed."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.seen = []

    def forward(self, batch):
        self.seen += batch["index"]
        return (self.w * batch["attention_mask"].sum()).sum()


def test_plain_dataloader_snippet_trains_and_resumes(packed, monkeypatch):
    manifest, lengths = packed
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    dataset = Tokens(120)
    model = SumLoss()
    scope = {"manifest_dir": manifest, "lengths_path": lengths, "dataset": dataset, "collate": collate_with_index,
             "model": model, "num_epochs": 1, "checkpoint": None}
    exec(snippet("plain"), scope)
    sampler = scope["sampler"]
    assert scope["step"] == sampler.steps_per_epoch and scope["micro"] == 0
    expected = [i for batch in ManifestBatchSampler(manifest, rank=1, world_size=2) for i in batch]
    assert model.seen == expected
    # Resume from a checkpoint taken mid-epoch: the snippet continues at that step.
    state = ManifestBatchSampler(manifest, rank=1, world_size=2).state_dict(step=3)
    resumed = SumLoss()
    exec(snippet("plain"), {**scope, "checkpoint": {"sampler": state}, "model": resumed})
    k = sampler.batches_per_step
    tail = [i for batch in list(ManifestBatchSampler(manifest, rank=1, world_size=2))[3 * k:] for i in batch]
    assert resumed.seen == tail


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_torchdata_snippet_resumes_exactly(packed):
    pytest.importorskip("torchdata")
    manifest, _ = packed
    scope = {"manifest_dir": manifest, "dataset": list(range(120)), "collate": lambda b: b}
    exec(snippet("torchdata"), scope)
    everything = list(ManifestBatchSampler(manifest))  # rank 0 of 1 here: elastic replay of a 2-rank manifest
    assert scope["seen"] == everything[:5]
    assert scope["rest"] == everything[5:]


def test_hf_trainer_snippet_trains_on_the_manifest_batches(packed, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    manifest, _ = packed
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    k = ManifestBatchSampler(manifest).batches_per_step
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, gradient_accumulation_steps=k,
                                          report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
                                          remove_unused_columns=False, dataloader_num_workers=0)
    dataset = Tokens(120)
    scope = {"manifest_dir": manifest, "model": model, "training_args": args, "dataset": dataset,
             "collate": collate}
    exec(snippet("hf"), scope)
    assert scope["trainer"].state.global_step == 2
    first = [i for batch in list(ManifestBatchSampler(manifest))[:2 * k] for i in batch]
    assert dataset.read[:len(first)] == first


@pytest.mark.slow
@pytest.mark.dist
def test_example_trains_with_torchrun_on_two_processes(packed, tmp_path):
    manifest, lengths = packed
    out = tmp_path / "summary.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples" / "train_tiny_vlm.py"), "--manifest", str(manifest), "--lengths", str(lengths),
           "--steps", "2", "--token-scale", "0.05", "--json", str(out)]
    for baseline in ("balanced", "random"):
        result = subprocess.run(cmd + ["--baseline", baseline], env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        assert re.search(r"rank 1 step    1 compute .* wait", result.stdout)
        summary = json.loads(out.read_text())
        assert summary["batching"] == baseline and summary["steps"] == 2 and 0 <= summary["wait_share"] < 1
        assert np.all(np.array(summary["compute_s_per_rank"]) > 0)


def test_example_random_baseline_replays_on_any_world_size(tmp_path):
    """The README's `--baseline random` on fewer ranks than the manifest was packed for: every sample of
    each manifest step goes to exactly one of this job's ranks (it refused before)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_tiny_vlm", ROOT / "examples" / "train_tiny_vlm.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = pack_random(tmp_path, num_samples=160, world_size=4, micro_batches=1, lengths=random_lengths(160, seed=2))
    from balancer_cli.replay.reader import ManifestReader

    reader = ManifestReader(out)
    for world in (1, 2, 3, 4):
        per_rank = [list(example.RandomGroups(str(out), rank, world)) for rank in range(world)]
        for step in range(reader.num_steps):
            got = sorted(i for r in per_rank for i in r[step])
            assert got == sorted(reader.step_samples(step).tolist())
