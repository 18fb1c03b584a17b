"""Lightning on two gloo processes: the docs' snippet replays the manifest's epochs, each its own.

Lightning (``use_distributed_sampler=False``) sets the epoch on ``loader.batch_sampler.sampler``,
never on the batch sampler; ``ManifestBatchSampler.sampler`` forwards it, so epoch 1 of a
manifest packed with ``--epochs 2`` is the manifest's epoch 1, not epoch 0 again. One spawn runs
the snippet for two epochs and then Lightning's default (``use_distributed_sampler=True``), which
must refuse the sampler loudly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")

from dist_util import free_tcp_init_method, spawn  # noqa: E402
from runtime_util import (  # noqa: E402
    MICRO,
    WORLD,
    Indexed,
    index_batch,
    manifest_batches,
    manifest_epochs,
    snippet,
    two_epoch_manifest,
)

from balancer_cli.runtime.sampler import ManifestBatchSampler  # noqa: E402

pytestmark = pytest.mark.dist

packed = two_epoch_manifest("pl", seed=5)


class Recorder(L.LightningModule):
    """Records (epoch, samples) of every batch it trains on."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append([self.current_epoch, batch["index"]])
        return (self.w * batch["x"]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _worker(rank: int, world: int, port: int, manifest: str, lengths: str, out: str) -> None:
    # What Lightning's own launcher gives each process: WORLD_SIZE and LOCAL_RANK, no RANK.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0", LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    os.environ.pop("RANK", None)
    torch.set_num_threads(1)
    options = {"accelerator": "cpu", "devices": world, "strategy": "ddp", "logger": False,
               "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
               "num_sanity_val_steps": 0, "default_root_dir": out}
    model = Recorder()
    scope = {"manifest_dir": manifest, "lengths_path": lengths, "dataset": Indexed(), "collate": index_batch,
             "model": model, "num_epochs": 2, "micro_batches": MICRO, "trainer_options": options}
    exec(snippet("lightning"), scope)
    trainer = scope["trainer"]
    sampler = trainer.train_dataloader.batch_sampler
    result = {"seen": model.seen, "global_step": trainer.global_step, "rank": [sampler.rank, sampler.world_size]}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))

    # Lightning's default would put a DistributedSampler into the batch sampler: it refuses, loudly.
    loader = torch.utils.data.DataLoader(Indexed(), batch_sampler=ManifestBatchSampler(manifest),
                                         collate_fn=index_batch)
    default = L.Trainer(max_epochs=1, **options)
    try:
        default.fit(Recorder(), train_dataloaders=loader)
        refusal = None
    except TypeError as error:
        refusal = str(error)
    Path(out, f"default{rank}.json").write_text(json.dumps(refusal))


def test_lightning_replays_each_packed_epoch_on_two_processes(packed, tmp_path):
    manifest, lengths = packed
    port = int(free_tcp_init_method().rsplit(":", 1)[1])
    spawn(_worker, (WORLD, port, str(manifest), str(lengths), str(tmp_path)), WORLD)
    expected, placed = manifest_epochs(manifest)
    per_epoch: list[list[int]] = [[], []]
    for rank in range(WORLD):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["rank"] == [rank, WORLD]  # from the process group Lightning joined
        assert result["seen"] == [[e, b] for e in range(2) for b in expected[rank][e]]
        # accumulate_grad_batches=MICRO: one optimizer step per manifest step.
        assert result["global_step"] == sum(len(expected[rank][e]) for e in range(2)) // MICRO
        for epoch, batch in result["seen"]:
            per_epoch[epoch] += batch
        refusal = json.loads((tmp_path / f"default{rank}.json").read_text())
        assert refusal and "use_distributed_sampler=False" in refusal
    for epoch in range(2):
        assert np.array_equal(np.sort(per_epoch[epoch]), placed)  # every placed sample exactly once per epoch


def test_lightning_sets_the_epoch_through_the_batch_samplers_sampler(packed):
    """What Lightning's loops and Fabric call at every epoch reaches the sampler (one process)."""
    from lightning.fabric.utilities.data import _set_sampler_epoch

    manifest, _ = packed
    sampler = ManifestBatchSampler(manifest, rank=1, world_size=WORLD)
    loader = torch.utils.data.DataLoader(Indexed(), batch_sampler=sampler)
    assert loader.batch_sampler.sampler is sampler.sampler
    _set_sampler_epoch(loader, 1)
    assert sampler.epoch == sampler.sampler.epoch == 1
    assert [batch.tolist() for batch in loader] == manifest_batches(manifest, 1, 1)
