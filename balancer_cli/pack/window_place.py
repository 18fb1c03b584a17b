"""One window of a run: its samples as the packers see them, packed and placed on steps.

:func:`place_window` is the unit of work of every engine (:mod:`balancer_cli.pack.engines`): it
packs a window's samples (:func:`pack_window`: the packer's groups, split to a multiple of the
groups a step holds) and places them (:func:`place_packed`: assigned to slots, then evened out by
the step stages). The two halves apart let the pick check read a packing's step count and drops
before paying for its placement (:mod:`~balancer_cli.pack.pick_check`). The windows themselves
(which samples, how many) are :mod:`balancer_cli.pack.windows`' plan.

Example:
    >>> from balancer_cli.lengths import make_lengths_table
    >>> from balancer_cli.pack.config import PackConfig
    >>> from balancer_cli.pack.inputs import prepare_inputs
    >>> inputs = prepare_inputs(make_lengths_table(np.arange(40, 120, 2)))
    >>> config = PackConfig(world_size=2, caps=(("llm", 400),), algorithm="llm-ffd")
    >>> whole, ids_n, plan = planned(inputs, config, np.array([400]))
    >>> task = WindowTask(packer="llm-ffd", config=config, caps_K=np.array([400]), bounds_K=np.array([400]),
    ...                   epoch=0, window=0)
    >>> view = window_view(inputs, whole, ids_n, plan.members[0][0])
    >>> result, packing = place_window(task, view), pack_window(task, view)
    >>> sorted(result.order_P.tolist()) == list(range(40)), result.num_steps, packing.num_groups
    (True, 4, 8)
    >>> place_packed(task, view, packing).order_P.tolist() == result.order_P.tolist()  # the same, in halves
    True
"""

from __future__ import annotations

import numpy as np

from balancer_cli._index import take_rows
from balancer_cli.errors import InputError, UsageError
from balancer_cli.pack.assign import (
    assign_groups,
    group_source_counts,
    split_to_multiple,
)
from balancer_cli.pack.config import PackConfig
from balancer_cli.pack.inputs import PackInputs
from balancer_cli.pack.packers import registry
from balancer_cli.pack.types import Assignment, Packing, group_sums
from balancer_cli.pack.windows import (
    WindowMembers,
    WindowResult,
    WindowTask,
    plan_windows,
)

__all__ = ["pack_window", "place_packed", "place_window", "planned", "sample_view", "window_view"]


def sample_view(inputs: PackInputs) -> registry.SampleView:
    """The samples without a scan error, as the packers see them (no copy when every sample is fine)."""
    return registry.SampleView(ids_n=inputs.ok_ids(), load_nK=inputs.ok_rows(inputs.load_NK),
                               cost_nK=inputs.ok_rows(inputs.cost_NK),
                               source_n=inputs.ok_rows(inputs.source_codes_N), modules=inputs.modules)


def planned(inputs: PackInputs, config: PackConfig, caps_K: np.ndarray,
            plan: WindowMembers | None = None) -> tuple[registry.SampleView | None, np.ndarray, WindowMembers]:
    """``(whole, ids_n, plan)``: every sample as one view where none failed (the inputs' arrays
    themselves, no copy; else None), the ids of the samples without a scan error, and the windows."""
    whole = sample_view(inputs) if inputs.all_ok else None
    ids_n = inputs.ok_ids() if whole is None else whole.ids_n
    if plan is None:
        # With failed samples the plan reads copies of the other rows, freed once it is made: the
        # windows take their rows from the inputs' arrays (10M with 1% failed: 0.16 GB less held).
        plan = plan_windows(whole if whole is not None else sample_view(inputs), config, caps_K)
    return whole, ids_n, plan


def window_view(inputs: PackInputs, whole: registry.SampleView | None, ids_n: np.ndarray,
                positions: np.ndarray) -> registry.SampleView:
    """A window's samples (``positions`` into ``ids_n``, the samples without a scan error) as the packers see them."""
    if whole is not None and len(positions) == len(ids_n):  # one window of every sample: no copy
        return whole
    rows = ids_n[positions]  # the window's samples: their rows of the inputs' arrays
    return registry.SampleView(ids_n=rows, load_nK=take_rows(inputs.load_NK, rows),
                               cost_nK=take_rows(inputs.cost_NK, rows), source_n=inputs.source_codes_N[rows],
                               modules=inputs.modules)


def place_window(task: WindowTask, view: registry.SampleView) -> WindowResult:
    """Pack ``view`` (one window's samples) with ``task.packer`` and assign its groups to slots:
    :func:`place_packed` of :func:`pack_window`.

    A packer registered with ``polish`` has its groups placed by
    :func:`~balancer_cli.pack.step_stages.place_steps`: assigned, then its steps' source mix, ranks'
    tiles, slots' groups, spread across steps and heaviest ranks evened out by the step stages, on
    coarser assignment cells as well where the steps mix worse than random batching.

    Raises:
        UsageError: fewer groups than one step needs, or no way to reach a multiple of R x M.
    """
    return place_packed(task, view, pack_window(task, view))


def pack_window(task: WindowTask, view: registry.SampleView) -> Packing:
    """The window's groups, a multiple of R x M of them (the heaviest split where needed), on local
    positions ``0 .. n-1`` of ``view``: what :func:`place_packed` places. Its step count and the
    samples it drops are final here (the pick check reads them before placing:
    :mod:`~balancer_cli.pack.pick_check`).

    Raises:
        UsageError: as :func:`place_window`.
    """
    config = task.window_config
    shape = task.config.shape
    R, M, per_step = shape.world_size, shape.micro_batches, shape.groups_per_step
    spec = registry.get(task.packer)
    # Pack local positions 0..n-1 (ids are mapped back at the end): the arrays are the window's own.
    local = registry.SampleView(ids_n=np.arange(len(view.ids_n)), load_nK=view.load_nK, cost_nK=view.cost_nK,
                                source_n=view.source_n, modules=view.modules)
    packing = spec.build(local, config, task.caps_K, task.bounds_K)(task.epoch)
    if packing.num_groups < per_step:
        raise UsageError(
            f"{{world_size}} {R} x {{micro_batches}} {M} needs {per_step} groups per step, "
            f"but the samples form only {packing.num_groups} groups",
            fix="lower {world_size} or {micro_batches}, or lower the caps so that more groups form"
                + (", or raise {window_samples}" if task.window or task.config.window_samples else ""))
    try:
        # The assigner wants G to be a multiple of R x M: split the heaviest groups (caps still hold).
        packing = split_to_multiple(packing, view.cost_nK[:, -1], per_step)
    except InputError as error:
        isolated = int(np.count_nonzero(packing.isolated))
        detail = f"; {isolated} of them single samples over a cap, isolated" if isolated else ""
        # Lower caps only isolate more samples where most are over them: groups of several split.
        cap_fix = ("raise the caps those samples exceed, or drop them with {oversize} drop"
                   if 2 * isolated > packing.num_groups else "lower the caps so that more groups form")
        window_fix = ", or change {window_samples}" if task.window or task.config.window_samples else ""
        raise UsageError(
            f"{{world_size}} {R} x {{micro_batches}} {M} needs a multiple of {per_step} groups (groups per "
            f"step), and the {packing.num_groups} groups cannot be split to one ({error.message}{detail})",
            fix="lower {world_size} or {micro_batches}, or " + cap_fix + window_fix) from None
    return packing


def place_packed(task: WindowTask, view: registry.SampleView, packing: Packing) -> WindowResult:
    """:func:`pack_window`'s ``packing`` of ``view`` assigned to slots (and evened out by the step
    stages where the packer polishes), with the window's sample ids."""
    config = task.window_config
    shape, spec = task.config.shape, registry.get(task.packer)
    if spec.sequential:
        step_G, rank_G, micro_G = shape.slots(np.arange(packing.num_groups))
        assignment = Assignment(step=step_G, rank=rank_G, micro=micro_G,
                                num_steps=packing.num_groups // shape.groups_per_step)
    elif spec.polish:
        # Compiled kernels: imported late.
        from balancer_cli.pack.polish import polish_passes
        from balancer_cli.pack.step_stages import place_steps

        packing, assignment = place_steps(
            packing, view.cost_nK, view.load_nK, task.caps_K, view.source_n, shape,
            seeds=tuple(config.epoch_seed(task.epoch, s) for s in ("assign", "polish", "trade")),
            polish_passes=polish_passes(len(view.ids_n)), modules=view.modules)
    else:
        assignment = assign_groups(group_sums(packing, view.cost_nK), world_size=shape.world_size,
                                   micro_batches=shape.micro_batches,
                                   seed=config.epoch_seed(task.epoch, "assign"),
                                   mix_GO=group_source_counts(packing, view.source_n))
    ids = np.asarray(view.ids_n)
    # Held for every window until the merge: sample ids in the ids' own type, slots in int32.
    return WindowResult(
        order_P=ids[np.asarray(packing.order, dtype=np.int64)],
        offsets_G=np.asarray(packing.group_offsets, dtype=np.int64),
        step_G=np.asarray(assignment.step, dtype=np.int32),
        rank_G=np.asarray(assignment.rank, dtype=np.int32),
        micro_G=np.asarray(assignment.micro, dtype=np.int32),
        num_steps=int(assignment.num_steps),
        dropped=ids[np.asarray(packing.dropped, dtype=np.int64)],
        dropped_reason=tuple(str(r) for r in packing.dropped_reason))

