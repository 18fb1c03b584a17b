"""The integration snippets of docs/runtime.md, executed as written (and a check that every snippet of
the page is run by some test), plus the example script and the sampler's ``plan_cache=``."""

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
from runtime_util import DOC, Recorder, Tokens, collate, collate_with_index, snippet  # noqa: E402

from balancer_cli.replay.cursor import ManifestReplay  # noqa: E402
from balancer_cli.runtime import ManifestBatchSampler  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    lengths = random_lengths(120, seed=4)
    out = pack_random(tmp_path_factory.mktemp("integ"), num_samples=120, world_size=2, micro_batches=2,
                      lengths=lengths)
    return out, out / "lengths.parquet"


@pytest.fixture(scope="module")
def packed4(tmp_path_factory):
    """A manifest for 4 ranks x 2 micro-batches (4 steps), what the resume snippets are written for."""
    lengths = random_lengths(120, seed=5)
    out = pack_random(tmp_path_factory.mktemp("integ4"), num_samples=120, world_size=4, micro_batches=2,
                      lengths=lengths, seed=5)
    return out, out / "lengths.parquet"


def test_plain_dataloader_snippet_trains_and_resumes(packed, monkeypatch):
    manifest, lengths = packed
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    dataset = Tokens(120)
    model = Recorder()
    scope = {"manifest_dir": manifest, "lengths_path": lengths, "dataset": dataset, "collate": collate_with_index,
             "model": model, "num_epochs": 1, "checkpoint": None}
    exec(snippet("plain"), scope)
    sampler = scope["sampler"]
    assert scope["step"] == sampler.steps_per_epoch and scope["micro"] == 0
    expected = [i for batch in ManifestBatchSampler(manifest, rank=1, world_size=2) for i in batch]
    assert model.samples == expected
    # Resume from a checkpoint taken mid-epoch: the snippet continues at that step.
    state = ManifestBatchSampler(manifest, rank=1, world_size=2).state_dict(step=3)
    resumed = Recorder()
    exec(snippet("plain"), {**scope, "checkpoint": {"sampler": state}, "model": resumed})
    k = sampler.batches_per_step
    tail = [i for batch in list(ManifestBatchSampler(manifest, rank=1, world_size=2))[3 * k:] for i in batch]
    assert resumed.samples == tail


def _resumes_after_five_batches(packed, code: str) -> dict:
    """Run a torchdata snippet (it stops after 5 batches and resumes from the loader's state); check it
    yields every batch once, in order; its scope."""
    pytest.importorskip("torchdata")
    manifest, _ = packed
    scope = {"manifest_dir": manifest, "dataset": list(range(120)), "collate": lambda b: b}
    exec(code, scope)
    everything = list(ManifestBatchSampler(manifest))  # rank 0 of 1 here: elastic replay of a 2-rank manifest
    assert scope["seen"] == everything[:5]
    assert scope["rest"] == everything[5:]
    return scope


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_torchdata_snippet_resumes_exactly(packed):
    _resumes_after_five_batches(packed, snippet("torchdata"))


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


def _tiny_qwen2():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config)


def test_packed_collator_snippet_trains(packed):
    manifest, _ = packed
    model = _tiny_qwen2()
    scope = {"manifest_dir": manifest, "dataset": Tokens(120), "model": model}
    exec(snippet("packed"), scope)
    assert scope["indices"] == list(ManifestBatchSampler(manifest))[-1]
    assert all(p.grad is not None for p in model.parameters())


def test_iterable_snippet_trains_and_resumes(packed):
    manifest, lengths = packed
    model = _tiny_qwen2()
    scope = {"manifest_dir": manifest, "lengths_path": lengths, "dataset": Tokens(120), "model": model,
             "optimizer": torch.optim.SGD(model.parameters(), lr=1e-3), "num_epochs": 2, "checkpoint": None,
             "seen": []}
    exec(snippet("iterable"), scope)
    epochs = [list(ManifestBatchSampler(manifest, lengths=lengths, epoch=e)) for e in (0, 1)]
    assert scope["seen"] == epochs[0] + epochs[1]
    state = ManifestBatchSampler(manifest, lengths=lengths).state_dict(step=3)
    k = ManifestBatchSampler(manifest, lengths=lengths).batches_per_step
    resumed = {**scope, "checkpoint": {"data": {"sampler": state, "phase": 0}}, "seen": [], "num_epochs": 1}
    exec(snippet("iterable"), resumed)
    assert resumed["seen"] == epochs[0][3 * k:]


def test_resume_any_world_snippet_yields_every_sample_once(packed4):
    manifest, lengths = packed4
    scope = {"manifest_dir": manifest, "lengths_path": lengths}
    exec(snippet("resume-any-world"), scope)  # it asserts every sample once itself
    state, before, after = scope["state"], scope["before"], scope["after"]
    assert state["world_size"] == 4 and state["batch_in_step"] > 0  # saved inside a step
    assert before and after and len(set(before + after)) == len(before + after)
    placed = [s for r in range(4) for batch in ManifestReplay(manifest, r, 4) for s in batch]
    assert sorted(before + after) == sorted(placed) and len(placed) == len(set(placed))


def test_empty_batch_snippet_keeps_every_rank_in_the_step(packed4):
    """Resumed inside the epoch's last step on more ranks than samples left: the ranks past the last
    sample get one empty batch, which the snippet's collate and loss turn into a zero-gradient step."""
    manifest, _ = packed4
    scope = {"collate": collate_with_index}
    exec(snippet("empty-batch"), scope)
    replays = [ManifestReplay(manifest, r, 4) for r in range(4)]
    batches = [list(replay) for replay in replays]
    last_step = replays[0].steps_per_epoch - 1
    taken = sum(replays[0].batches_in_step(s) for s in range(last_step)) + 1  # one batch into the last step
    left = sorted(i for rank in batches for batch in rank[taken:] for i in batch)
    state = ManifestReplay(manifest, 0, 4)
    it = iter(state)
    for _ in range(taken):
        next(it)
    saved = state.state_dict()
    world = len(left) + 3
    seen, empty = [], 0
    for rank in range(world):
        sampler = ManifestBatchSampler(manifest, rank=rank, world_size=world)
        sampler.load_state_dict(saved)
        loader = torch.utils.data.DataLoader(Tokens(120), batch_sampler=sampler, collate_fn=scope["collate_or_none"])
        model = Recorder()
        got = list(loader)
        assert len(got) == 1  # every rank runs the step's one batch
        scope["loss_of"](model, got[0]).backward()
        if got[0] is None:
            empty += 1
            assert model.w.grad is not None and float(model.w.grad) == 0.0
        else:
            seen += model.samples
            assert float(model.w.grad) > 0
    assert empty == 3 and sorted(seen) == left


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_torchdata_workers_snippet_resumes_with_another_number_of_workers(packed):
    scope = _resumes_after_five_batches(packed, snippet("torchdata-workers"))
    assert "_snapshot" in scope["state"]  # saved with workers, resumed without


def test_every_snippet_of_the_doc_is_executed_by_a_test():
    names = re.findall(r"<!-- snippet: ([a-z0-9-]+) -->", DOC.read_text())
    assert len(names) == len(set(names)), "a snippet name appears twice in docs/runtime.md"
    executed = set()
    for path in Path(__file__).parent.glob("test_*.py"):
        executed |= set(re.findall(r"""snippet\(["']([a-z0-9-]+)["']\)""", path.read_text()))
    assert set(names) - executed == set(), "snippets of docs/runtime.md no test runs"
    assert executed - set(names) == set(), "tests read snippets docs/runtime.md does not have"


def test_the_sampler_keeps_elastic_plans_where_plan_cache_says(tmp_path):
    """``plan_cache=`` reaches the replay: beside the manifest by default, another folder, or none."""
    out = pack_random(tmp_path / "m", num_samples=120, world_size=4, micro_batches=1,
                      lengths=random_lengths(120, seed=3))
    expected = list(ManifestReplay(out, 0, 3, plan_cache=False))
    assert list(ManifestBatchSampler(out, rank=0, world_size=3, plan_cache=False)) == expected
    assert not (out / "elastic-plans").exists()
    elsewhere = tmp_path / "plans"
    assert list(ManifestBatchSampler(out, rank=0, world_size=3, plan_cache=elsewhere)) == expected
    assert [p.name[:3] for p in elsewhere.glob("*.npy")] == ["R3-"] and not (out / "elastic-plans").exists()
    assert list(ManifestBatchSampler(out, rank=0, world_size=3)) == expected
    assert [p.name[:3] for p in (out / "elastic-plans").glob("*.npy")] == ["R3-"]
