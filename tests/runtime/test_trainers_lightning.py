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
import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")

from dist_util import free_tcp_init_method, spawn  # noqa: E402
from replay_util import random_lengths  # noqa: E402

from balancer_cli.lengths import write_lengths  # noqa: E402
from balancer_cli.manifest import open_manifest, read_dropped  # noqa: E402
from balancer_cli.pack.config import PackConfig  # noqa: E402
from balancer_cli.run import pack_to_dir  # noqa: E402
from balancer_cli.runtime.sampler import ManifestBatchSampler  # noqa: E402

pytestmark = pytest.mark.dist

DOC = Path(__file__).resolve().parents[2] / "docs" / "runtime.md"
WORLD, MICRO, SAMPLES = 2, 2, 120


def snippet(name: str) -> str:
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


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A manifest of the real packer, ``balancer pack --dp 2 --micro-batches 2 --epochs 2``."""
    tmp = tmp_path_factory.mktemp("pl")
    write_lengths(random_lengths(SAMPLES, seed=5), tmp / "lengths.parquet")
    pack_to_dir([tmp / "lengths.parquet"], tmp / "out",
                PackConfig(world_size=WORLD, micro_batches=MICRO, epochs=2), baselines=())
    return tmp / "out", tmp / "lengths.parquet"


class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return i


def collate(indices):
    return {"index": list(indices), "x": torch.tensor(indices, dtype=torch.float32)[:, None]}


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
    scope = {"manifest_dir": manifest, "lengths_path": lengths, "dataset": Samples(), "collate": collate,
             "model": model, "num_epochs": 2, "micro_batches": MICRO, "trainer_options": options}
    exec(snippet("lightning"), scope)
    trainer = scope["trainer"]
    sampler = trainer.train_dataloader.batch_sampler
    result = {"seen": model.seen, "global_step": trainer.global_step, "rank": [sampler.rank, sampler.world_size]}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))

    # Lightning's default would put a DistributedSampler into the batch sampler: it refuses, loudly.
    loader = torch.utils.data.DataLoader(Samples(), batch_sampler=ManifestBatchSampler(manifest), collate_fn=collate)
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
    expected = [[manifest_batches(manifest, r, e) for e in range(2)] for r in range(WORLD)]
    assert expected[0][0] != expected[0][1]  # the packed epochs differ: replaying epoch 0 twice would show
    dropped, _ = read_dropped(manifest)
    placed = np.setdiff1d(np.arange(SAMPLES), dropped)
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
    loader = torch.utils.data.DataLoader(Samples(), batch_sampler=sampler)
    assert loader.batch_sampler.sampler is sampler.sampler
    _set_sampler_epoch(loader, 1)
    assert sampler.epoch == sampler.sampler.epoch == 1
    assert [batch.tolist() for batch in loader] == manifest_batches(manifest, 1, 1)
