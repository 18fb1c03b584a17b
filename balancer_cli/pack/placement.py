"""Placement: packings of every epoch -> manifest rows sorted by (step, rank, micro, order in group).

:func:`place_epochs` is the one path every manifest and every baseline goes through: pack the
epoch (seed ``seed + epoch``), split groups until their count is a multiple of R x M, assign
them to (step, rank, micro) with the packer's assigner (or in order, as a plain data loader
does), number steps globally across epochs and collect dropped samples with their reasons.

Example:
    >>> import numpy as np
    >>> from balancer_cli.lengths import make_lengths_table
    >>> from balancer_cli.pack.baselines import pack_random
    >>> from balancer_cli.pack.inputs import prepare_inputs
    >>> inputs = prepare_inputs(make_lengths_table(np.arange(1, 9)))
    >>> rows, dropped, reasons, steps = place_epochs(inputs, lambda e: pack_random(8, 2, seed=e), world_size=2,
    ...                                              micro_batches=1, epochs=2, seed=0)
    >>> steps, len(rows), dropped.tolist()
    ([2, 2], 16, [])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from balancer_cli.errors import InputError, UsageError
from balancer_cli.manifest import ManifestRows
from balancer_cli.pack.inputs import PackInputs
from balancer_cli.pack.types import Assignment, Packing, group_sums

__all__ = ["Packer", "place_epochs"]

#: ``epoch -> Packing`` over the samples without error (ids are dataset sample ids).
Packer = Callable[[int], Packing]


def place_epochs(
    inputs: PackInputs,
    pack_epoch: Packer,
    *,
    world_size: int,
    micro_batches: int,
    epochs: int,
    seed: int,
    sequential: bool = False,
) -> tuple[ManifestRows, np.ndarray, tuple[str, ...], list[int]]:
    """Pack and assign every epoch; return sorted rows, dropped samples/reasons and steps per epoch.

    Args:
        inputs: the load/cost matrices.
        pack_epoch: ``epoch -> Packing`` over the samples without error (ids are dataset ids).
        world_size, micro_batches: the step shape.
        epochs: number of epochs; epoch e assigns with seed ``seed + e``.
        seed: base seed.
        sequential: place groups in packing order (group g at step g // (R x M)), as a plain
            distributed data loader does, instead of the balancing assigner.

    Raises:
        UsageError: fewer groups than one step needs (``world_size * micro_batches``).
    """
    from balancer_cli.pack.assign import assign_groups, split_to_multiple

    parts, epoch_num_steps = [], []
    # sample -> reason -> epochs it applied to; a reason that held in every epoch is written plain.
    dropped: dict[int, dict[str, list[int]]] = {}
    for sample in np.flatnonzero(~inputs.ok_N):
        dropped[int(sample)] = {str(inputs.error_N[sample]): list(range(epochs))}
    offset = 0
    per_step = world_size * micro_batches
    for epoch in range(epochs):
        packing = pack_epoch(epoch)
        if packing.num_groups < per_step:
            raise UsageError(
                f"--dp {world_size} x --micro-batches {micro_batches} needs {per_step} groups per step, "
                f"but the samples form only {packing.num_groups} groups",
                fix="lower --dp or --micro-batches, or lower the caps so that more groups form")
        # The assigner wants G to be a multiple of R x M: split the heaviest groups (caps still hold).
        try:
            packing = split_to_multiple(packing, inputs.cost_NK[:, -1], per_step)
        except InputError as error:
            raise UsageError(
                f"--dp {world_size} x --micro-batches {micro_batches} needs a multiple of {per_step} groups "
                f"(groups per step), and the {packing.num_groups} groups cannot be split to one ({error.message})",
                fix="lower --dp or --micro-batches, or lower the caps so that more groups form") from None
        cost_GK = group_sums(packing, inputs.cost_NK)
        if sequential:
            slot = np.arange(packing.num_groups)
            assignment = Assignment(step=(slot // per_step).astype(np.int32),
                                    rank=((slot % per_step) // micro_batches).astype(np.int32),
                                    micro=(slot % micro_batches).astype(np.int32), num_steps=len(slot) // per_step)
        else:
            assignment = assign_groups(cost_GK, world_size=world_size, micro_batches=micro_batches, seed=seed + epoch)
        group_P = packing.group_ids()
        position_P = np.arange(len(packing.order)) - packing.group_offsets[group_P]
        step_P = np.asarray(assignment.step, dtype=np.int64)[group_P]
        keep = step_P >= 0
        for sample in np.asarray(packing.order)[~keep]:
            # The assigner left the group out (an incomplete last step).
            dropped.setdefault(int(sample), {}).setdefault("not in a full step", []).append(epoch)
        for sample, reason in zip(packing.dropped, packing.dropped_reason):
            dropped.setdefault(int(sample), {}).setdefault(str(reason), []).append(epoch)
        parts.append((step_P[keep] + offset, np.asarray(assignment.rank)[group_P][keep],
                      np.asarray(assignment.micro)[group_P][keep], position_P[keep],
                      np.asarray(packing.order, dtype=np.int64)[keep]))
        epoch_num_steps.append(int(assignment.num_steps))
        offset += int(assignment.num_steps)
    step, rank, micro, position, sample = (np.concatenate(x) for x in zip(*parts))
    order = np.lexsort((position, micro, rank, step))
    rows = ManifestRows(step[order].astype(np.int32), rank[order].astype(np.int32),
                        micro[order].astype(np.int32), sample[order].astype(np.int64))
    dropped_sample = np.array(sorted(dropped), dtype=np.int64)
    reasons = tuple(_drop_reason(dropped[int(s)], epochs) for s in dropped_sample)
    return rows, dropped_sample, reasons, epoch_num_steps


def _drop_reason(epochs_by_reason: Mapping[str, list[int]], epochs: int) -> str:
    """One reason text; ``reason (epochs 0, 2)`` when it did not hold in every epoch."""
    parts = []
    for reason, which in epochs_by_reason.items():
        which = sorted(set(which))
        if len(which) == epochs:
            parts.append(reason)
        else:
            label = "epoch" if len(which) == 1 else "epochs"
            parts.append(f"{reason} ({label} {', '.join(map(str, which))})")
    return "; ".join(parts)
