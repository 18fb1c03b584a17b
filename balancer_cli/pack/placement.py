"""Placement: packings of every epoch -> manifest rows sorted by (step, rank, micro, order in group).

:func:`place_epochs` is the one path every manifest and every baseline goes through: pack the
epoch (its ``pack`` stream), split groups until their count is a multiple of R x M, assign
them to (step, rank, micro) with the packer's assigner (or in order, as a plain data loader
does), number steps globally across epochs and collect dropped samples with their reasons.

Example:
    >>> import numpy as np
    >>> from balancer_cli.lengths import make_lengths_table
    >>> from balancer_cli.pack.config import PackConfig
    >>> from balancer_cli.pack.packers.baselines import pack_random
    >>> from balancer_cli.pack.inputs import prepare_inputs
    >>> inputs = prepare_inputs(make_lengths_table(np.arange(1, 9)))
    >>> rows, dropped, reasons, steps = place_epochs(inputs, lambda e: pack_random(8, 2, seed=e),
    ...                                              PackConfig(world_size=2, epochs=2))
    >>> steps, len(rows), dropped.tolist()
    ([2, 2], 16, [])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from balancer_cli.errors import InputError, UsageError
from balancer_cli.manifest import ManifestRows
from balancer_cli.pack.assign import assign_groups, group_source_counts, split_to_multiple
from balancer_cli.pack.inputs import PackInputs
from balancer_cli.pack.types import Assignment, Packing, group_sums

if TYPE_CHECKING:
    from balancer_cli.pack.config import PackConfig

__all__ = ["Packer", "Placement", "place_epochs"]

#: ``epoch -> Packing`` over the samples without error (ids are dataset sample ids).
Packer = Callable[[int], Packing]


class Placement(NamedTuple):
    """Every epoch of one packer placed: rows sorted by slot, dropped samples with reasons, steps per epoch."""

    rows: ManifestRows
    dropped_sample: np.ndarray
    dropped_reason: tuple[str, ...]
    epoch_num_steps: list[int]


def place_epochs(inputs: PackInputs, pack_epoch: Packer, config: PackConfig, *, sequential: bool = False) -> Placement:
    """Pack and assign every epoch of ``config``; return sorted rows, dropped samples/reasons, steps per epoch.

    Args:
        inputs: the load/cost matrices.
        pack_epoch: ``epoch -> Packing`` over the samples without error (ids are dataset ids).
        config: the step shape, epochs and seed streams.
        sequential: place groups in packing order (group g at step g // (R x M)), as a plain
            distributed data loader does, instead of the balancing assigner.

    Raises:
        UsageError: fewer groups than one step needs (``world_size * micro_batches``).
    """
    shape, epochs = config.shape, config.epochs
    world_size, micro_batches, per_step = shape.world_size, shape.micro_batches, shape.groups_per_step
    parts, orders, epoch_num_steps = [], [], []
    base = 0  # first row of the epoch's packing order in the concatenated orders
    # sample -> reason -> epochs it applied to; a reason that held in every epoch is written plain.
    dropped: dict[int, dict[str, list[int]]] = {}
    for sample in np.flatnonzero(~inputs.ok_N):
        dropped[int(sample)] = {str(inputs.error_N[sample]): list(range(epochs))}
    offset = 0
    for epoch in range(epochs):
        packing = pack_epoch(epoch)
        if packing.num_groups < per_step:
            raise UsageError(
                f"{{world_size}} {world_size} x {{micro_batches}} {micro_batches} needs {per_step} groups per step, "
                f"but the samples form only {packing.num_groups} groups",
                fix="lower {world_size} or {micro_batches}, or lower the caps so that more groups form")
        # The assigner wants G to be a multiple of R x M: split the heaviest groups (caps still hold).
        try:
            packing = split_to_multiple(packing, inputs.cost_NK[:, -1], per_step)
        except InputError as error:
            raise UsageError(
                f"{{world_size}} {world_size} x {{micro_batches}} {micro_batches} needs a multiple of {per_step} "
                f"groups (groups per step), and the {packing.num_groups} groups cannot be split to one "
                f"({error.message})",
                fix="lower {world_size} or {micro_batches}, or lower the caps so that more groups form") from None
        cost_GK = group_sums(packing, inputs.cost_NK)
        if sequential:
            step_G, rank_G, micro_G = shape.slots(np.arange(packing.num_groups))
            assignment = Assignment(step=step_G, rank=rank_G, micro=micro_G, num_steps=packing.num_groups // per_step)
        else:
            assignment = assign_groups(cost_GK, world_size=world_size, micro_batches=micro_batches,
                                       seed=config.epoch_seed(epoch, "assign"),
                                       mix_GO=group_source_counts(packing, inputs.source_codes_N))
        step_G = np.asarray(assignment.step, dtype=np.int64)
        keep_G = step_G >= 0
        order_P = np.asarray(packing.order, dtype=np.int64)
        offsets_G = np.asarray(packing.group_offsets, dtype=np.int64)
        for g in np.flatnonzero(~keep_G):
            # The assigner left the group out (an incomplete last step).
            for sample in order_P[offsets_G[g]:offsets_G[g + 1]]:
                dropped.setdefault(int(sample), {}).setdefault("not in a full step", []).append(epoch)
        for sample, reason in zip(packing.dropped, packing.dropped_reason):
            dropped.setdefault(int(sample), {}).setdefault(str(reason), []).append(epoch)
        # Group-level parts only: rows are expanded once, after sorting the G groups, which needs
        # a few bytes per sample instead of lexsorting five (P,) int64 columns.
        parts.append((step_G[keep_G] + offset, np.asarray(assignment.rank, np.int64)[keep_G],
                      np.asarray(assignment.micro, np.int64)[keep_G], offsets_G[:-1][keep_G] + base,
                      np.diff(offsets_G)[keep_G]))
        orders.append(order_P)
        base += len(order_P)
        epoch_num_steps.append(int(assignment.num_steps))
        offset += int(assignment.num_steps)
    rows = _expand_groups(parts, orders)
    dropped_sample = np.array(sorted(dropped), dtype=np.int64)
    reasons = tuple(_drop_reason(dropped[int(s)], epochs) for s in dropped_sample)
    return Placement(rows, dropped_sample, reasons, epoch_num_steps)


def _expand_groups(parts, orders) -> ManifestRows:
    """Rows sorted by (step, rank, micro, position in group) from per-group step/rank/micro/start/size.

    Each (step, rank, micro) slot holds one group (:class:`Assignment`), so sorting groups by slot
    and expanding each group's members in packing order gives exactly the row-level lexsort.
    """
    step_G, rank_G, micro_G, start_G, size_G = (np.concatenate(x) for x in zip(*parts))
    order_P = orders[0] if len(orders) == 1 else np.concatenate(orders)
    by_slot = np.lexsort((micro_G, rank_G, step_G))
    step_G, rank_G, micro_G, start_G, size_G = (x[by_slot] for x in (step_G, rank_G, micro_G, start_G, size_G))
    slot_G = np.stack([step_G, rank_G, micro_G], axis=1)
    if len(slot_G) > 1 and not (np.diff(slot_G, axis=0) != 0).any(axis=1).all():
        # Two groups in one slot (not produced by our assigners): interleave by position as a row sort would.
        return _expand_rows(step_G, rank_G, micro_G, start_G, size_G, order_P)
    num_rows = int(size_G.sum())
    # row i of the output reads order_P[start of its group + (i - first row of its group)]
    first_row_G = np.cumsum(size_G) - size_G
    index_P = np.repeat(start_G - first_row_G, size_G)
    index_P += np.arange(num_rows, dtype=np.int64)
    sample = order_P[index_P]
    del index_P
    return ManifestRows(np.repeat(step_G.astype(np.int32), size_G), np.repeat(rank_G.astype(np.int32), size_G),
                        np.repeat(micro_G.astype(np.int32), size_G), sample)


def _expand_rows(step_G, rank_G, micro_G, start_G, size_G, order_P) -> ManifestRows:
    """The general row-level sort by (step, rank, micro, position in group)."""
    first_row_G = np.cumsum(size_G) - size_G
    position = np.arange(int(size_G.sum()), dtype=np.int64) - np.repeat(first_row_G, size_G)
    index = np.repeat(start_G, size_G) + position
    step, rank, micro = (np.repeat(x, size_G) for x in (step_G, rank_G, micro_G))
    order = np.lexsort((position, micro, rank, step))
    return ManifestRows(step[order].astype(np.int32), rank[order].astype(np.int32),
                        micro[order].astype(np.int32), order_P[index[order]].astype(np.int64))


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
