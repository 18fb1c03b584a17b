"""Placement: placed windows of every epoch -> manifest rows sorted by (step, rank, micro, order in group).

:func:`merge_windows` is the one path every manifest and every baseline goes through: the windows
of each epoch (:func:`~balancer_cli.pack.window_place.place_window`: packed, split to a multiple of
R x M and assigned to (step, rank, micro)) follow one another, steps are numbered globally across
windows and epochs, and dropped samples are collected with their reasons.

Example:
    >>> import numpy as np
    >>> from balancer_cli.lengths import make_lengths_table
    >>> from balancer_cli.pack.config import PackConfig
    >>> from balancer_cli.pack.inputs import prepare_inputs
    >>> from balancer_cli.pack.window_place import place_window
    >>> from balancer_cli.pack.windows import WindowTask
    >>> from balancer_cli.pack.packers.registry import SampleView
    >>> inputs = prepare_inputs(make_lengths_table(np.arange(1, 9)))
    >>> view = SampleView(ids_n=np.arange(8), load_nK=inputs.load_NK, cost_nK=inputs.cost_NK,
    ...                   source_n=inputs.source_codes_N, modules=inputs.modules)
    >>> config = PackConfig(world_size=2, epochs=2, batch_size=2)
    >>> results = [[place_window(WindowTask(packer="random", config=config, caps_K=np.array([20]),
    ...                                     bounds_K=np.array([20]), epoch=e, window=0), view)] for e in range(2)]
    >>> rows, dropped, reasons, steps = merge_windows(inputs, results, epochs=2)
    >>> steps, len(rows), dropped.tolist()
    ([2, 2], 16, [])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from balancer_cli._jit import njit
from balancer_cli._memory import release_freed_memory
from balancer_cli._sort import int_order
from balancer_cli.manifest import ManifestRows, StepShape
from balancer_cli.pack.inputs import PackInputs
from balancer_cli.pack.windows import WindowResult

__all__ = ["Placement", "merge_windows"]


class Placement(NamedTuple):
    """Every epoch of one packer placed: rows sorted by slot, dropped samples with reasons, steps per epoch."""

    rows: ManifestRows
    dropped_sample: np.ndarray
    dropped_reason: tuple[str, ...]
    epoch_num_steps: list[int]


def merge_windows(inputs: PackInputs, results_by_epoch: Sequence[Sequence[WindowResult]], *,
                  epochs: int) -> Placement:
    """Concatenate the placed windows of every epoch into sorted rows, dropped samples and steps.

    Args:
        inputs: the load/cost matrices (for the samples with a scan error).
        results_by_epoch: per epoch, its windows in order. Lists are emptied: each window's
            arrays are freed once its rows are written (where the caller holds no other reference).
        epochs: number of epochs (a reason that held in every epoch is written plain).
    """
    windows, epoch_num_steps = [], []  # (result, its first step's global number)
    # sample -> reason -> epochs it applied to; a reason that held in every epoch is written plain.
    # Samples with a scan error are not here: no packer sees them (their text is their reason).
    dropped: dict[int, dict[str, list[int]]] = {}
    offset = 0
    for epoch, results in enumerate(results_by_epoch):
        epoch_steps = 0
        for result in results:
            offsets_G = result.offsets_G
            for g in np.flatnonzero(result.step_G < 0):
                # The assigner left the group out (an incomplete last step).
                for sample in result.order_P[offsets_G[g]:offsets_G[g + 1]]:
                    dropped.setdefault(int(sample), {}).setdefault("not in a full step", []).append(epoch)
            for sample, reason in zip(result.dropped, result.dropped_reason):
                dropped.setdefault(int(sample), {}).setdefault(str(reason), []).append(epoch)
            windows.append((result, offset))
            offset += result.num_steps
            epoch_steps += result.num_steps
        epoch_num_steps.append(int(epoch_steps))
        if isinstance(results, list):  # ``windows`` holds them now, and lets each go once merged
            results.clear()
    rows = _expand_groups(windows)
    left_out = np.array(sorted(dropped), dtype=np.int64)
    reasons = np.empty(len(left_out), dtype=object)
    reasons[:] = [_drop_reason(dropped[int(s)], epochs) for s in left_out]
    # The failed samples as arrays (a dataset may fail by the million): the same texts in every epoch.
    dropped_sample = np.concatenate([inputs.error_rows, left_out])
    by_sample = np.argsort(dropped_sample, kind="stable")
    reasons = np.concatenate([inputs.error_texts, reasons])[by_sample]
    return Placement(rows, dropped_sample[by_sample], tuple(reasons), epoch_num_steps)


def _kept_groups(result: WindowResult, offset: int):
    """(step, rank, micro, start, size) of a window's groups in a slot, steps numbered from ``offset``."""
    keep_G = result.step_G >= 0
    return (result.step_G[keep_G] + offset, result.rank_G[keep_G], result.micro_G[keep_G],
            result.offsets_G[:-1][keep_G], np.diff(result.offsets_G)[keep_G])


def _expand_groups(windows: Sequence[tuple[WindowResult, int]]) -> ManifestRows:
    """Rows sorted by (step, rank, micro, position in group) from each window's groups (``start``
    into the window's own packing order), windows given with their first step's number.

    Each (step, rank, micro) slot holds one group (:class:`Assignment`), so sorting groups by slot
    and expanding each group's members in packing order gives exactly the row-level lexsort.
    Windows number their steps after the previous ones, so the groups sort window by window: each
    window's sorted groups are written straight into the preallocated rows and dropped before the
    next (10M: no concatenated group columns or packing order beside the rows, 0.12 GB off the
    pack's peak). Each entry of ``windows`` is then set to None: a window's arrays go as its rows
    come (10M in two epochs: 0.17 GB of them held beside the whole rows before).
    """
    shape = _covering(windows)
    if not _slots_apart(windows, shape):
        # Two groups in one slot or windows out of step order (not produced by our assigners):
        # interleave by position as a row sort would.
        return _expand_rows(windows)
    num_rows = sum(int(np.diff(r.offsets_G)[r.step_G >= 0].sum()) for r, _ in windows)
    sample_dtype = np.result_type(*(r.order_P.dtype for r, _ in windows)) if windows else np.dtype(np.int64)
    step, rank, micro = (np.empty(num_rows, np.int32) for _ in range(3))
    sample = np.empty(num_rows, sample_dtype)
    row = 0
    for w, (result, offset) in enumerate(windows):
        _, *slot_G, start_G, size_G = _sorted_by_slot(shape, *_kept_groups(result, offset))
        row = _gather_groups(result.order_P, *slot_G, start_G, size_G, step, rank, micro, sample, row)
        windows[w] = result = None
        release_freed_memory()  # the window's arrays lie in the heap: its pages back to the OS (~1 ms)
    return ManifestRows(step, rank, micro, sample)


def _covering(windows: Sequence[tuple[WindowResult, int]]) -> StepShape:
    """The smallest shape holding every window's kept groups (their slot numbers sort them)."""
    ranks, micros = [], []
    for result, _ in windows:
        keep_G = result.step_G >= 0
        if keep_G.any():
            ranks.append(int(result.rank_G[keep_G].max()))
            micros.append(int(result.micro_G[keep_G].max()))
    return StepShape.covering(np.array(ranks, np.int64), np.array(micros, np.int64))


def _slots_apart(windows: Sequence[tuple[WindowResult, int]], shape: StepShape) -> bool:
    """Whether every kept group has a slot of its own and each window's slots follow the last one's."""
    last = -1
    for result, offset in windows:
        key_G = shape.slot_number(*_kept_groups(result, offset)[:3])
        if len(key_G):
            # Sorted, not np.unique: numpy's hashing unique of 280k distinct int64 keys takes 60-90 ms, a sort 3.
            key_G = np.sort(key_G)
            if key_G[0] <= last or (key_G[1:] == key_G[:-1]).any():
                return False
            last = key_G[-1]
    return True


def _sorted_by_slot(shape: StepShape, step_G, rank_G, micro_G, start_G, size_G):
    """(key, step, rank, micro, start, size) of one window's groups, sorted by slot number (stable)."""
    key_G = shape.slot_number(step_G, rank_G, micro_G)
    by_slot = int_order(key_G - key_G.min()) if len(key_G) else np.zeros(0, np.int64)
    return tuple(x[by_slot] for x in (key_G, step_G, rank_G, micro_G, start_G, size_G))


@njit
def _gather_groups(order_P, step_G, rank_G, micro_G, start_G, size_G, step, rank, micro, sample,
                   row):  # pragma: no cover - compiled
    """Write each group's members (``order_P[start : start + size]``) and its slot, group after
    group, into the rows from ``row`` on; returns the row after the last written."""
    for g in range(len(start_G)):
        for p in range(start_G[g], start_G[g] + size_G[g]):
            step[row], rank[row], micro[row], sample[row] = step_G[g], rank_G[g], micro_G[g], order_P[p]
            row += 1
    return row


def _expand_rows(windows: Sequence[tuple[WindowResult, int]]) -> ManifestRows:
    """The general row-level sort by (step, rank, micro, position in group)."""
    parts = [_kept_groups(result, offset) for result, offset in windows]
    base_W = np.cumsum([0] + [len(result.order_P) for result, _ in windows[:-1]])
    step_G, rank_G, micro_G, start_G, size_G = (np.concatenate(x) for x in zip(*parts))
    start_G = start_G + np.repeat(base_W, [len(part[0]) for part in parts])
    order_P = np.concatenate([result.order_P for result, _ in windows])
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
