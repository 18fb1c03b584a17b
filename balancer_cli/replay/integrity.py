"""Integrity of a manifest against its own metadata and the conservation contract.

A manifest is consistent when:

- its metadata agrees with itself: ``num_steps`` is the sum of ``epoch_num_steps``, and the
  rows' last step is ``num_steps - 1``;
- every step holds exactly ``world_size x micro_batches`` groups (ranks and micro-batches in
  range, rows sorted by step, rank, micro), and post-balancing's ``<m>_rank`` columns name ranks
  in range;
- **conservation**: in every epoch each of the ``num_samples`` samples is placed exactly once or
  is in ``dropped.parquet`` (never both, never twice), each dropped sample with a reason.

Both ``balancer report`` and the sampler (:class:`~balancer_cli.replay.reader.ManifestReader`)
run :func:`check_manifest` when they open a manifest: a few vectorized passes and one compiled
count per epoch into a byte per sample (10M rows: 0.3 s with the read, 10 MB beside the rows; two int64
``bincount`` columns were 160 MB, the peak of a 10M pack's report).

Example:
    >>> import numpy as np
    >>> ok = dict(world_size=1, micro_batches=1, num_samples=3, epoch_num_steps=[2])
    >>> check_rows("m", np.array([0, 0, 1]), np.zeros(3, int), np.zeros(3, int), np.array([2, 0, 1]),
    ...            dropped_sample=np.array([], int), dropped_reason=[], **ok)
    >>> try:
    ...     check_rows("m", np.array([0, 0, 1]), np.zeros(3, int), np.zeros(3, int), np.array([2, 0, 2]),
    ...                dropped_sample=np.array([], int), dropped_reason=[], **ok)
    ... except ManifestError as error:
    ...     print(error.message.split(" (")[0])
    m: sample 2 is placed 2 times in epoch 0
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from balancer_cli._index import search_sorted, sorted_runs
from balancer_cli._jit import njit
from balancer_cli.errors import ManifestError
from balancer_cli.manifest import ManifestFile, ManifestRows, read_dropped

__all__ = ["check_manifest", "check_rows"]

_FIX = "re-run `balancer pack`; the manifest was edited or written by another tool"


def check_manifest(manifest: ManifestFile) -> ManifestRows:
    """Read ``manifest``'s rows and dropped list and run :func:`check_rows` on them.

    Returns:
        The rows checked (:meth:`ManifestFile.read_all`), for a caller that needs them: a report
        at 10M rows then holds one copy, not two.

    Raises:
        ManifestError: naming the first thing that differs.
    """
    # Opening checked every field read here (manifest_meta.check_meta: integers in range, epoch
    # counts that sum to num_steps) but num_samples, which a manifest may lack; conservation needs it.
    num_samples, world_size, micro_batches = manifest.num_samples, manifest.world_size, manifest.micro_batches
    epochs = manifest.epoch_num_steps
    rows = manifest.read_all()  # (after the metadata checks: it reads num_samples)
    dropped_sample, dropped_reason = read_dropped(manifest.path)
    check_rows(str(manifest.path), rows.step, rows.rank, rows.micro, rows.sample, world_size=world_size,
               micro_batches=micro_batches, num_samples=num_samples, epoch_num_steps=epochs,
               dropped_sample=dropped_sample, dropped_reason=dropped_reason)
    for name, values in rows.extra.items():  # post-balancing's <m>_rank columns
        if name.endswith("_rank") and len(values) and (int(values.min()) < 0 or int(values.max()) >= world_size):
            raise ManifestError(f"{manifest.path}: column {name} names a rank outside 0..{world_size - 1}", fix=_FIX)
    return rows


def check_rows(where: str, step: np.ndarray, rank: np.ndarray, micro: np.ndarray, sample: np.ndarray, *,
               world_size: int, micro_batches: int, num_samples: int, epoch_num_steps: Sequence[int],
               dropped_sample: np.ndarray, dropped_reason: Sequence[str]) -> None:
    """Check the rows (P,) and the dropped list against the step shape and conservation.

    Raises:
        ManifestError: ``where: <what differs>; fix: ...``.
    """
    num_steps = int(sum(epoch_num_steps))
    R, M = world_size, micro_batches
    if num_samples < 0 or R < 1 or M < 1:
        raise ManifestError(f"{where}: metadata gives {num_samples} samples, {R} ranks, {M} micro-batches", fix=_FIX)
    last = int(step[-1]) + 1 if len(step) else 0
    if last != num_steps or (len(step) and int(step[0]) < 0):
        raise ManifestError(f"{where}: rows cover steps 0..{last - 1}, the metadata says {num_steps} steps", fix=_FIX)
    for name, values, bound in (("rank", rank, R), ("micro", micro, M), ("sample", sample, num_samples)):
        if len(values) and (int(values.min()) < 0 or int(values.max()) >= bound):
            bad = int(np.flatnonzero((values < 0) | (values >= bound))[0])
            raise ManifestError(f"{where}: {name} {values[bad]} at step {step[bad]} is outside 0..{bound - 1} "
                                f"(metadata: {R} ranks, {M} micro-batches, {num_samples} samples)", fix=_FIX)
    if len(step):

        def slots(lo: int, hi: int) -> np.ndarray:  # slot numbers: R and M come from the metadata, unbounded
            return (np.asarray(step[lo:hi], np.int64) * R + rank[lo:hi]) * M + micro[lo:hi]

        groups = sorted_runs(slots, len(step))  # a block at a time: no (P,) int64 temporaries
        if groups is None:
            raise ManifestError(f"{where}: rows are not sorted by (step, rank, micro)", fix=_FIX)
        if groups != num_steps * R * M or int(slots(0, 1)[0]) != 0:
            firsts = np.concatenate([[0], np.flatnonzero(np.diff(slots(0, len(step)))) + 1])  # group starts
            groups_S = np.bincount(np.asarray(step)[firsts], minlength=num_steps)
            s = int(np.flatnonzero(groups_S != R * M)[0])
            raise ManifestError(f"{where}: step {s} has {groups_S[s]} groups, expected {R} ranks x {M} micro-batches",
                                fix=_FIX)
    dropped_sample = np.asarray(dropped_sample, dtype=np.int64)
    if len(dropped_sample) and (int(dropped_sample.min()) < 0 or int(dropped_sample.max()) >= num_samples):
        raise ManifestError(f"{where}: dropped.parquet names a sample outside 0..{num_samples - 1}", fix=_FIX)
    if any(not isinstance(r, str) or not r for r in dropped_reason):
        raise ManifestError(f"{where}: dropped.parquet has a sample without a reason", fix=_FIX)
    listed, times = np.unique(dropped_sample, return_counts=True)
    if len(times) and int(times.max()) > 1:
        raise ManifestError(f"{where}: sample {int(listed[np.argmax(times)])} is listed twice in dropped.parquet",
                            fix=_FIX)
    bounds = search_sorted(step, np.cumsum([0, *epoch_num_steps]))
    for epoch, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        count_N = _placements(np.asarray(sample[lo:hi]), listed, num_samples)
        bad = np.flatnonzero(count_N != 1)
        if len(bad):
            over = bad[count_N[bad] > 1]  # a duplicate says more than the sample it displaced
            s = int(over[0] if len(over) else bad[0])
            placed, dropped = int(np.count_nonzero(sample[lo:hi] == s)), bool(np.isin(s, listed))
            state = ("neither placed nor dropped" if placed + dropped == 0 else
                     "placed and also dropped" if dropped else f"placed {placed} times")
            raise ManifestError(f"{where}: sample {s} is {state} in epoch {epoch} ({len(bad)} samples differ; "
                                "each must be placed once per epoch or dropped with a reason)", fix=_FIX)


@njit
def _placements(sample_P, listed_D, num_samples):  # pragma: no cover - compiled
    """(N,) uint8: how often each sample is placed in ``sample_P`` or listed in ``listed_D`` (ids
    checked in range), counted up to 255: only 1 passes."""
    count_N = np.zeros(num_samples, np.uint8)
    for i in range(len(sample_P) + len(listed_D)):
        s = sample_P[i] if i < len(sample_P) else listed_D[i - len(sample_P)]
        if count_N[s] < 255:
            count_N[s] += 1
    return count_N
