"""The pack pipeline: lengths table + config -> manifest rows, dropped samples and metadata.

:func:`pack_manifest` is pure (no I/O): it drops samples with a scan error (their error text is
the reason), builds the per-sample load matrix (encoder *items* per module, LLM *tokens* last; the
quantities the caps bound) and cost matrix (:func:`balancer_cli.cost.samples.sample_costs`), runs the
threshold search when caps are not given for every module, packs each epoch with the packer of
:data:`~balancer_cli.pack.packers.registry.PACKERS` the config names (its own random streams per
epoch, :func:`~balancer_cli.pack.config.stream_seed`), assigns groups to (step, rank, micro) and
returns the rows sorted the way :func:`balancer_cli.manifest.write_manifest` wants them. Steps
are numbered globally across epochs. The baselines go through the same :func:`place_packer`, so
every metric compares like with like.

Example:
    >>> import numpy as np
    >>> from balancer_cli.lengths import make_lengths_table
    >>> lt = make_lengths_table(np.full(8, 100), {"vision": (np.full(8, 256), np.ones(8, int))})
    >>> cfg = PackConfig(world_size=2, caps=(("vision", 2), ("llm", 200)), algorithm="llm-ffd")
    >>> result = pack_manifest(lt, cfg)
    >>> result.epoch_num_steps, len(result.rows), sorted(result.rows.sample.tolist())
    ([2], 8, [0, 1, 2, 3, 4, 5, 6, 7])
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from balancer_cli._memory import release_freed_memory
from balancer_cli.errors import InputError, UsageError
from balancer_cli.lengths import LengthsTable
from balancer_cli.manifest import ManifestRows
from balancer_cli.pack.cap_fit import (
    check_caps_fit,
    check_given_caps_fill_a_step,
    name_given_caps,
)
from balancer_cli.pack.config import MAX_CAP, PackConfig
from balancer_cli.pack.inputs import PackInputs, prepare_inputs
from balancer_cli.pack.packers import registry
from balancer_cli.pack.pick_check import (
    Bar,
    Trial,
    Unplaced,
    checked_pick,
    first_window,
    window_trial,
)
from balancer_cli.pack.placement import Placement, merge_windows
from balancer_cli.pack.search import search_thresholds, tail_raised
from balancer_cli.pack.window_place import planned, sample_view, window_view
from balancer_cli.pack.windows import (
    WindowMembers,
    WindowResult,
    WindowTask,
    window_count,
)

__all__ = [
    "PackResult",
    "resolve_thresholds",
    "run_search",
    "sample_view",
    "place_packer",
    "with_phase_ranks",
    "pack_manifest",
    "pack_inputs",
]

#: ISF acceptance bound as a share of the cap when neither the user nor the search gives one.
DEFAULT_BOUND_SHARE = 0.9
#: Up to this many samples, a searched pick whose full run breaks a bound of the contract
#: (:mod:`~balancer_cli.pack.contract`) is checked against the next candidates' full runs: a
#: subsample's few steps can hide a bias or an extra step (a text-only 20k at ``--dp 64`` x 2:
#: 0.58x mix on the subsample, 2.87x in full). Past it, against their first windows
#: (:mod:`~balancer_cli.pack.pick_check`).
CHECK_MAX_SAMPLES = 2_000_000


@dataclass(frozen=True)
class PackResult:
    """What :func:`pack_manifest` returns; hand it to :func:`balancer_cli.manifest.write_manifest`.

    Attributes:
        rows: placements sorted by (step, rank, micro, order within group).
        dropped_sample, dropped_reason: samples never placed, with why.
        epoch_num_steps: steps of each epoch.
        meta: the manifest metadata (parameters, fingerprint, summary metrics).
        search: the threshold search result when the search ran, else None.
        evaluation: the rows' :class:`~balancer_cli.pack.evaluate.Evaluation` (its metrics are
            ``meta["summary"]``); the report of these rows reuses it instead of evaluating again.
        plan: the windows every epoch packed (:func:`plan_windows`); the report's baselines pack
            the same ones and reuse it instead of planning again.
    """

    rows: ManifestRows
    dropped_sample: np.ndarray
    dropped_reason: tuple[str, ...]
    epoch_num_steps: list[int]
    meta: Mapping[str, Any]
    search: Any = field(default=None, compare=False)
    evaluation: Any = field(default=None, compare=False)
    plan: WindowMembers | None = field(default=None, compare=False)


def _by_module(pairs: Sequence[tuple[str, int]], modules: Sequence[str], what: str) -> dict[str, int]:
    """``{module: value}`` of config pairs (validated positive by PackConfig), modules checked."""
    given = dict(pairs)
    for module in given:
        if module not in modules:
            raise UsageError(f"{{{what}[{module}]}} names an unknown module '{module}' (modules here: "
                             f"{', '.join(modules)})", fix=f"use one of: {', '.join(modules)}")
    return given


def _require_measured(inputs: PackInputs) -> None:
    """Fail when every sample has a scan error: there is nothing to search caps for or pack."""
    if not inputs.ok_N.any():
        first = inputs.error_texts[0]
        raise InputError(f"all {inputs.num_samples} samples have a scan error (first: {first})",
                         fix="fix the dataset and re-run `balancer scan`")


def _largest(inputs: PackInputs) -> np.ndarray:
    """(K,) the largest load of a sample without error, per module (loads are >= 0)."""
    load = inputs.load_NK
    # ``where`` skips the failed rows without copying the others.
    skip = {} if inputs.all_ok else {"initial": 0, "where": inputs.ok_N}
    return np.array([load[:, k].max(**skip) for k in range(load.shape[1])], dtype=np.int64)  # per column: ~10x faster


def _default_max_caps(inputs: PackInputs, largest_K: np.ndarray) -> np.ndarray:
    """Upper limits for the search when the user gives none: the largest sample (``largest_K``,
    :func:`_largest`), at least a few typical ones, at most :data:`~balancer_cli.pack.config.MAX_CAP`
    (a cap a manifest can hold: samples of a billion tokens had the search pick one of 6e9, and the
    written manifest failed its own check; over it they are oversize)."""
    typical = np.percentile(inputs.ok_rows(inputs.load_NK), 90, axis=0) * 8
    return np.minimum(np.maximum(np.maximum(largest_K, typical), 1), MAX_CAP).astype(np.int64)


def run_search(inputs: PackInputs, config: PackConfig, **search_options: Any) -> Any:
    """Run the threshold search over the samples without error.

    Caps given in ``config.caps`` are the search's upper limits (memory limits); other modules are
    limited by :func:`_default_max_caps`. ``search_options`` go to
    :func:`balancer_cli.pack.search.search_thresholds` (``grid``, ``sample_size``, ...).
    """
    caps = _by_module(config.caps, inputs.modules, "caps")
    _require_measured(inputs)  # the limits below are percentiles of the measured samples
    largest_K = _largest(inputs)
    max_caps_K = _default_max_caps(inputs, largest_K)
    for k, module in enumerate(inputs.modules):
        max_caps_K[k] = caps.get(module, max_caps_K[k])
    # "error" asks that no sample be over a cap: the searched caps fit the largest one, under a cap
    # the user gave as well (a given 21 items, the largest 19: not 17). Only a given cap under the
    # largest sample can then be too small, and the error names it.
    min_caps_K = np.minimum(largest_K, max_caps_K) if config.oversize == "error" else None
    algorithm = config.algorithm if config.algorithm in ("balanced", "isf") else "balanced"
    check_given_caps_fill_a_step(inputs, config)  # the search stays under them
    try:
        return search_thresholds(
            inputs.load_NK, inputs.cost_NK, world_size=config.world_size,
            micro_batches=config.micro_batches, max_caps_K=max_caps_K, min_caps_K=min_caps_K,
            target_group_size=config.target_group_size,
            seed=config.epoch_seed(0, "search"), algorithm=algorithm,
            source_N=inputs.source_codes_N, rows=None if inputs.all_ok else inputs.ok_ids(),
            **search_options)
    except UsageError as error:  # no caps fill a step: name a given cap most samples are over
        raise name_given_caps(inputs, config, error) from None


def resolve_thresholds(inputs: PackInputs, config: PackConfig) -> tuple[np.ndarray, np.ndarray, Any]:
    """Caps and ISF bounds per module (K,), running the search when a cap is missing.

    Returns:
        ``(caps_K, bounds_K, search_result_or_None)``.
    """
    caps = _by_module(config.caps, inputs.modules, "caps")
    bounds = _by_module(config.bounds, inputs.modules, "bounds")
    search = None
    if all(m in caps for m in inputs.modules):
        check_given_caps_fill_a_step(inputs, config)  # (run_search checks them too, before it searches)
        caps_K = np.array([caps[m] for m in inputs.modules], dtype=np.int64)
    else:
        search = run_search(inputs, config, prune=True)  # the same best caps, fewer candidates measured
        caps_K = np.asarray(search.best_caps_K, dtype=np.int64)
        if config.algorithm == "isf":  # our packer's search reports bounds = caps: keep ISF's defaults then
            for k, module in enumerate(inputs.modules):
                bounds.setdefault(module, int(search.best_bounds_K[k]))
    check_caps_fit(inputs, caps_K)
    return caps_K, _bounds_for(inputs, caps_K, bounds), search


def _bounds_for(inputs: PackInputs, caps_K: np.ndarray, bounds: Mapping[str, int]) -> np.ndarray:
    """(K,) ISF acceptance bounds: the given ones, else :data:`DEFAULT_BOUND_SHARE` of the caps."""
    bounds_K = np.array([bounds.get(m, max(1, math.floor(DEFAULT_BOUND_SHARE * c)))
                         for m, c in zip(inputs.modules, caps_K)], dtype=np.int64)
    bad = np.flatnonzero(bounds_K > caps_K)
    if len(bad):
        m = inputs.modules[int(bad[0])]
        raise UsageError(f"{{bounds[{m}]}} {int(bounds_K[bad[0]])} exceeds its cap {int(caps_K[bad[0]])}",
                         fix="an ISF acceptance bound Q' must be <= the cap Q")
    return bounds_K


def place_packer(name: str, inputs: PackInputs, config: PackConfig, caps_K: np.ndarray,
                 bounds_K: np.ndarray, *, engine: Any = "local", engine_options: Any = None,
                 on_window: Callable[[int, int], None] | None = None, plan: WindowMembers | None = None,
                 first: WindowResult | None = None) -> Placement:
    """Pack every epoch with the registered packer ``name``, window by window, and place its groups.

    The manifest's own packer and every baseline go through here, with the same step shape, seed
    streams, epochs and windows (:mod:`balancer_cli.pack.windows`), so their metrics compare like
    with like. ``engine`` (a name of :data:`~balancer_cli.pack.engines.ENGINES`, or a
    ``run_windows`` function of the same contract) runs the windows; every engine gives the same
    placement. ``on_window(done, total)`` is called as each window (of every epoch) is done.
    ``plan`` is :func:`plan_windows` of the same inputs, config and caps, when the caller holds it,
    and ``first`` its first window (epoch 0) already placed (:func:`~balancer_cli.pack.pick_check.window_trial`).
    """
    from balancer_cli.pack.engines import get_engine

    spec = registry.get(name)
    whole, ids_n, plan = planned(inputs, config, caps_K, plan)
    tasks, members = [], []
    for epoch, by_window in enumerate(plan.members):
        for window, positions in enumerate(by_window):
            tasks.append(WindowTask(packer=spec.name, config=config, caps_K=caps_K, bounds_K=bounds_K,
                                    epoch=epoch, window=window))
            members.append(positions)

    run_windows = get_engine(engine) if isinstance(engine, str) else engine
    progress = None
    if on_window is not None:
        done = itertools.count(1)

        def progress() -> None:
            on_window(next(done), len(tasks))
    if first is not None and progress is not None:
        progress()  # the first window, placed already
    todo = range(1 if first is not None else 0, len(tasks))
    results = run_windows([tasks[i] for i in todo], lambda j: window_view(inputs, whole, ids_n, members[todo[j]]),
                          engine_options, progress=progress)
    results[:0] = [first] if first is not None else []
    members.clear()  # the window slices are no longer needed
    release_freed_memory()  # the windows' working arrays, before the merge builds the rows
    by_epoch = [[r for t, r in zip(tasks, results) if t.epoch == epoch] for epoch in range(config.epochs)]
    del results  # merge_windows frees each window as it merges it
    return merge_windows(inputs, by_epoch, epochs=config.epochs)


def with_phase_ranks(rows: ManifestRows, inputs: PackInputs, world_size: int) -> ManifestRows:
    """Add ``<m>_rank`` columns: the rank that runs encoder m's phase for each row (post-balancing)."""
    from balancer_cli.replay.post_balance import (
        manifest_phase_ranks,  # compiled kernels: import when used
    )

    costs = {m: inputs.cost_NK[:, k] for k, m in enumerate(inputs.modules)}  # encoders first, llm last
    phase_ranks = manifest_phase_ranks(rows, costs, world_size)
    extra = dict(rows.extra)
    for module, rank in phase_ranks.items():
        extra[f"{module}_rank"] = np.asarray(rank, dtype=np.int32)
    return ManifestRows(rows.step, rows.rank, rows.micro, rows.sample, extra)


def pack_manifest(lengths: LengthsTable, config: PackConfig) -> PackResult:
    """Pack a lengths table into manifest rows (pure; write with :func:`write_manifest`).

    Raises:
        InputError: no sample can be packed (every one has a scan error) or unknown columns.
        UsageError: bad options, caps below every sample, more ranks x micro-batches than groups.
    """
    inputs = prepare_inputs(lengths, config.cost_model, config.cost_presets, costs=config.costs)
    return pack_inputs(inputs, config, lengths_fingerprint=lengths.fingerprint)


def pack_inputs(inputs: PackInputs, config: PackConfig, *, lengths_fingerprint: str, engine: str = "local",
                engine_options: Any = None, on_window: Callable[[int, int], None] | None = None) -> PackResult:
    """:func:`pack_manifest` from already prepared inputs (:func:`prepare_inputs` of the lengths table).

    ``engine`` and ``engine_options`` choose where the windows are packed, and ``on_window``
    follows them (:func:`place_packer`; a run that checks more caps packs its windows again).

    Lets a caller drop the Arrow lengths table while packing (the inputs hold all packing needs),
    which lowers the peak memory of large runs. Same result as :func:`pack_manifest`.
    """
    from balancer_cli.pack.evaluate import evaluate_rows

    _require_measured(inputs)

    def run(caps_K: np.ndarray, bounds_K: np.ndarray, plan: WindowMembers | None = None,
            first: WindowResult | None = None) -> Trial:
        # Planned here to be kept: the report's baselines pack the same windows (10M: ~1.2 s saved).
        plan = plan if plan is not None else planned(inputs, config, caps_K)[2]
        rows, dropped_sample, dropped_reason, epoch_num_steps = place_packer(
            config.algorithm, inputs, config, caps_K, bounds_K, engine=engine, engine_options=engine_options,
            on_window=on_window, plan=plan, first=first)
        if config.post_balance:
            rows = with_phase_ranks(rows, inputs, config.world_size)
        evaluation = evaluate_rows(inputs, rows, dropped_sample, dropped_reason, caps_K=caps_K,
                                   world_size=config.world_size, micro_batches=config.micro_batches,
                                   epoch_num_steps=epoch_num_steps)
        return Trial(caps_K, bounds_K, Placement(rows, dropped_sample, dropped_reason, epoch_num_steps), evaluation,
                     plan)

    def candidate(caps_K: np.ndarray, bar: Bar) -> Trial | Unplaced:
        # A run of one window (one epoch): its packing gives the run's steps and drops, so a
        # candidate that cannot beat the bar is not placed (pick_check). Several: all are needed.
        bounds_K = _bounds_for(inputs, caps_K, bounds)
        held = planned(inputs, config, caps_K)
        if sum(map(len, held[2].members)) > 1:
            return run(caps_K, bounds_K, held[2])
        plan, first = first_window(inputs, config, caps_K, bounds_K, bar, held, whole_run=True)
        return first if isinstance(first, Unplaced) else run(caps_K, bounds_K, plan, first)

    def windows(caps_K: np.ndarray) -> dict[str, int]:
        # What the windows are (the summary's first line): as many as place_packer packs. Before
        # packing, while little memory is held (with scan errors the loads are copied).
        if not config.window_samples:
            return {}
        count, least = window_count(inputs.ok_rows(inputs.load_NK), config, caps_K)
        return {"windows": count, "min_window_samples": least}

    caps_K, bounds_K, search = resolve_thresholds(inputs, config)
    checked, probe = None, None
    check = search is not None and config.algorithm == "balanced"
    bounds = _by_module(config.bounds, inputs.modules, "bounds")
    if check and inputs.num_samples > CHECK_MAX_SAMPLES:
        # The pick and the next candidates on their first windows; the kept one's is reused.
        probe, checked = checked_pick(inputs.modules, inputs.num_samples, search,
                                      window_trial(inputs, config, caps_K, bounds_K),
                                      lambda c, bar: window_trial(inputs, config, c, _bounds_for(inputs, c, bounds),
                                                                  bar),
                                      sifted=True)
        caps_K, bounds_K = probe.caps_K, probe.bounds_K
        checked["on"] = "first window"
    window_info = windows(caps_K)
    trial = run(caps_K, bounds_K, *((probe.plan, probe.first) if probe is not None else ()))
    if check and probe is None:
        trial, checked = checked_pick(inputs.modules, inputs.num_samples, search, trial, candidate)
        window_info = window_info if np.array_equal(trial.caps_K, caps_K) else windows(trial.caps_K)
    caps_K, bounds_K, evaluation = trial.caps_K, trial.bounds_K, trial.evaluation
    rows, dropped_sample, dropped_reason, epoch_num_steps = trial.placement
    summary = evaluation.metrics
    meta = config.to_meta()
    given_caps = dict(config.caps)
    given = [m for m in inputs.modules if m in given_caps]  # the search's limits, from the user
    meta["params"].update({
        "caps": {m: int(c) for m, c in zip(inputs.modules, caps_K)},
        "bounds": {m: int(b) for m, b in zip(inputs.modules, bounds_K)},
        "cap_units": {m: inputs.load_unit(m) for m in inputs.modules},
        **window_info,
        "searched": search is not None,
        "search": None if search is None else {
            "algorithm": search.algorithm, "sample_size": int(search.sample_size),
            "candidates": len(search.candidates), "best_objective": round(float(search.candidates[0].objective), 6),
            "grid_axes": {m: [int(v) for v in axis] for m, axis in zip(inputs.modules, search.grid_axes)},
            **({} if checked is None else {"checked": checked}),
            **tail_raised(caps_K, search.params["typical_caps"], inputs.modules, given=given),
            **({"given": given} if given else {}),  # the report's hints then leave the group size alone
        },
    })
    meta.update(num_samples=inputs.num_samples, modules=list(inputs.modules), lengths_fingerprint=lengths_fingerprint,
                summary=summary)
    return PackResult(rows, dropped_sample, dropped_reason, epoch_num_steps, meta, search, evaluation, trial.plan)
