"""Helpers of the resume tests: a manifest with the packer's caps, and every rank of a replay run
in one process up to a cut (no torch)."""

from __future__ import annotations

import json

import numpy as np

from balancer_cli.manifest import ManifestRows, open_manifest, write_manifest
from balancer_cli.replay.cursor import ManifestReplay

__all__ = ["with_caps", "epoch_samples", "run", "flat"]


def with_caps(src, out, lengths, caps, rows_per_row_group=16):
    """``src`` rewritten with the packer's ``caps`` and ``lengths``' fingerprint in its metadata."""
    m = open_manifest(src)
    rows = m.read_all()
    placed = np.zeros(int(m.meta["num_samples"]), bool)
    placed[rows.sample] = True
    meta = {k: m.meta[k] for k in ("world_size", "micro_batches", "num_samples", "seed")}
    write_manifest(out, ManifestRows(rows.step, rows.rank, rows.micro, rows.sample),
                   dropped_sample=np.flatnonzero(~placed), dropped_reason=["test"] * int((~placed).sum()),
                   meta={**meta, "algorithm": "test", "lengths_fingerprint": lengths.fingerprint,
                         "params": {"caps": caps}},
                   epoch_num_steps=m.epoch_num_steps, rows_per_row_group=rows_per_row_group)
    return out


def epoch_samples(manifest, epoch):
    m = open_manifest(manifest)
    starts = np.concatenate([[0], np.cumsum(m.epoch_num_steps)])
    base = epoch % len(m.epoch_num_steps)
    return np.sort(m.read_steps(int(starts[base]), int(starts[base + 1])).sample)


def run(manifest, world, state=None, cut=None, epoch=0, **kwargs):
    """Every rank's batches (``cut`` each, else the rest of the epoch) and the state after them."""
    replays = [ManifestReplay(manifest, rank=r, world_size=world, epoch=epoch, **kwargs) for r in range(world)]
    if state is not None:
        for replay in replays:
            replay.load_state_dict(json.loads(json.dumps(state)))
            replay.set_epoch(epoch)  # the usual epoch loop keeps the loaded resume point
    lengths = [len(replay) for replay in replays]
    its = [iter(replay) for replay in replays]
    taken = [[next(it) for _ in range(cut)] if cut is not None else list(it) for it in its]
    if cut is None:
        assert [len(t) for t in taken] == lengths, "len() is the number of batches iter() yields"
    states = [replay.state_dict() for replay in replays]
    assert all(s == states[0] for s in states), "the state is the same on every rank"
    assert len({len(t) for t in taken}) == 1, "every rank runs the same number of batches"
    return taken, states[0]


def flat(taken):
    return [s for batches in taken for b in batches for s in b]
