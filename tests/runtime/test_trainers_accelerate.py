"""accelerate and the Hugging Face Trainer on two gloo processes: the docs' snippets keep the manifest's plan.

One spawn runs every check (processes are slow to start): the `accelerate` snippet over two epochs
of a manifest packed with ``--epochs 2`` and a resume into its second epoch, ``accelerator.prepare``
of the raw loader and ``dispatch_batches=True`` refused on every process (never halving, never
hanging), and the `hf` snippet. Each process's batches are compared with the manifest's rows.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

from dist_util import free_tcp_init_method, spawn  # noqa: E402
from runtime_util import (  # noqa: E402
    MICRO,
    SAMPLES,
    WORLD,
    Recorder,
    Tokens,
    collate,
    collate_with_index,
    manifest_batches,
    manifest_epochs,
    snippet,
    two_epoch_manifest,
)

from balancer_cli.errors import UsageError  # noqa: E402
from balancer_cli.runtime.sampler import ManifestBatchSampler  # noqa: E402

pytestmark = pytest.mark.dist

packed = two_epoch_manifest("acc", seed=4)


class SyncRecorder(Recorder):
    """Its 'loss' is the token count; it records each batch's samples and whether gradients sync after it."""

    def __init__(self):
        super().__init__()
        self.syncs = []

    def forward(self, batch):
        from accelerate.state import GradientState

        self.syncs.append(GradientState().sync_gradients)
        return super().forward(batch)


def _refusals(loader) -> list[str]:
    """The UsageError texts of ``len(loader)`` and of its first batch."""
    texts = []
    for probe in (len, lambda x: next(iter(x))):
        try:
            probe(loader)
        except UsageError as error:
            texts.append(str(error))
    return texts


def _worker(rank: int, world: int, port: int, manifest: str, lengths: str, out: str) -> None:
    # As `accelerate launch --cpu` sets them; accelerate joins the gloo group itself.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), ACCELERATE_USE_CPU="true")
    torch.set_num_threads(1)
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    result = {}
    # The docs' accelerate snippet, two epochs, then resumed at step 2 of epoch 1.
    model = SyncRecorder()
    scope = {"manifest_dir": manifest, "lengths_path": lengths, "dataset": Tokens(SAMPLES),
             "collate": collate_with_index, "model": model, "num_epochs": 2, "checkpoint": None}
    exec(snippet("accelerate"), scope)
    accelerator, sampler = scope["accelerator"], scope["sampler"]
    result["distributed"] = [accelerator.num_processes, accelerator.process_index, sampler.rank, sampler.world_size]
    result["seen"], result["syncs"] = model.seen, model.syncs
    result["passthrough"] = accelerator.prepare(scope["loader"]) is scope["loader"]
    state_sampler = ManifestBatchSampler(manifest)
    state_sampler.set_epoch(1)
    resumed = SyncRecorder()
    exec(snippet("accelerate"), {**scope, "model": resumed, "checkpoint": {"sampler": state_sampler.state_dict(step=2)}})
    result["resumed"] = resumed.seen

    # The raw loader through prepare(), and through dispatch_batches=True: refused on every process.
    raw = DataLoader(Tokens(SAMPLES), batch_sampler=ManifestBatchSampler(manifest), collate_fn=collate)
    result["prepare"] = _refusals(scope["accelerator"].prepare(raw))
    raw = DataLoader(Tokens(SAMPLES), batch_sampler=ManifestBatchSampler(manifest), collate_fn=collate)
    result["dispatch"] = _refusals(prepare_data_loader(raw, accelerator.device, dispatch_batches=True,
                                                       put_on_device=True))

    # The docs' Hugging Face Trainer snippet (its Trainer makes its own Accelerator: last).
    import transformers

    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    args = transformers.TrainingArguments(output_dir=str(Path(out) / "hf"), max_steps=2,
                                          gradient_accumulation_steps=sampler.batches_per_step, report_to=[],
                                          use_cpu=True, save_strategy="no", remove_unused_columns=False,
                                          dataloader_num_workers=0, disable_tqdm=True)
    dataset = Tokens(SAMPLES)
    hf = {"manifest_dir": manifest, "model": transformers.GPT2LMHeadModel(config), "training_args": args,
          "dataset": dataset, "collate": collate}
    exec(snippet("hf"), hf)
    result["hf_steps"], result["hf_read"] = hf["trainer"].state.global_step, dataset.read
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()


def test_accelerate_and_hf_trainer_replay_the_manifest_on_two_processes(packed, tmp_path):
    pytest.importorskip("transformers")
    manifest, lengths = packed
    port = int(free_tcp_init_method().rsplit(":", 1)[1])
    spawn(_worker, (WORLD, port, str(manifest), str(lengths), str(tmp_path)), WORLD)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    expected, placed = manifest_epochs(manifest)
    for rank, result in enumerate(results):
        assert result["distributed"] == [WORLD, rank, rank, WORLD]
        # Exactly this rank's manifest batches, in order, epoch 1 the manifest's epoch 1.
        assert result["seen"] == expected[rank][0] + expected[rank][1]
        # Gradients sync once per manifest step: after every MICRO-th batch.
        assert result["syncs"] == [(i + 1) % MICRO == 0 for i in range(len(result["seen"]))]
        assert result["resumed"] == expected[rank][1][2 * MICRO:]
        assert result["passthrough"]  # prepare() again returns the prepared loader as it is
        assert len(result["prepare"]) == 2 and all("BatchSamplerShard over 2 processes" in t for t in result["prepare"])
        assert all("prepare_manifest_loader" in t for t in result["prepare"])
        assert len(result["dispatch"]) == 2 and all("dispatch_batches=True" in t for t in result["dispatch"])
        assert result["hf_steps"] == 2
        first = [i for batch in expected[rank][0][:2 * MICRO] for i in batch]
        assert result["hf_read"][:len(first)] == first
    for epoch in range(2):
        got = np.sort(np.concatenate([np.concatenate(r["seen"][:len(expected[0][0])] if epoch == 0
                                                     else r["seen"][len(expected[0][0]):]) for r in results]))
        assert np.array_equal(got, placed)  # every placed sample exactly once per epoch


def test_a_batch_sampler_shard_over_two_processes_is_refused(packed):
    """accelerate's BatchSamplerShard (what prepare() builds) over our sampler: len() and iter() raise;
    over one process (what prepare_manifest_loader builds under Megatron-LM's accelerate) it passes through."""
    from accelerate.data_loader import BatchSamplerShard

    manifest, _ = packed
    sampler = ManifestBatchSampler(manifest, rank=0, world_size=WORLD)
    shard = BatchSamplerShard(sampler, num_processes=2, process_index=0)
    with pytest.raises(UsageError, match="keep 1 of every 2 of its own batches"):
        len(shard)
    with pytest.raises(UsageError, match="prepare_manifest_loader"):
        next(iter(shard))
    single = BatchSamplerShard(sampler, num_processes=1, process_index=0)
    assert len(single) == len(sampler) and list(single) == manifest_batches(manifest, 0, 0)


def test_prepare_manifest_loader_needs_a_manifest_sampler():
    from balancer_cli.runtime.trainers import prepare_manifest_loader

    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    with pytest.raises(UsageError, match="batch_sampler is a ManifestBatchSampler, not BatchSampler"):
        prepare_manifest_loader(object(), loader)
