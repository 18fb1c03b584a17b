"""The pack pipeline: lengths table + config -> manifest rows, dropped samples and metadata.

:func:`pack_manifest` is pure (no I/O): it drops samples with a scan error (their error text is
the reason), builds the per-sample load matrix (encoder *items* per module, LLM *tokens* last; the
quantities the caps bound) and cost matrix (:func:`balancer_cli.cost.samples.sample_costs`), runs the
threshold search when caps are not given for every module, packs each epoch with its own seed
(``seed + epoch``), assigns groups to (step, rank, micro) and returns the rows sorted the way
:func:`balancer_cli.manifest.write_manifest` wants them. Steps are numbered globally across
epochs. The baselines reuse :func:`place_epochs` so every manifest goes through the same
assign/ordering path and the metrics compare like with like.

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

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from balancer_cli.errors import InputError, UsageError
from balancer_cli.lengths import LLM, LengthsTable
from balancer_cli.manifest import ManifestRows
from balancer_cli.pack.inputs import PackInputs, prepare_inputs
from balancer_cli.pack.placement import Packer, place_epochs

__all__ = [
    "ALGORITHMS",
    "OVERSIZE_POLICIES",
    "PackConfig",
    "PackInputs",
    "PackResult",
    "prepare_inputs",
    "resolve_thresholds",
    "run_search",
    "place_epochs",
    "make_packer",
    "with_phase_ranks",
    "pack_manifest",
    "pack_inputs",
]

#: Packers ``pack`` can write a manifest with; the last two are the baselines' packers.
ALGORITHMS = ("balanced", "isf", "llm-ffd", "random", "dataloader")
OVERSIZE_POLICIES = ("isolate", "drop", "error")
#: ISF acceptance bound as a share of the cap when neither the user nor the search gives one.
DEFAULT_BOUND_SHARE = 0.9


@dataclass(frozen=True)
class PackConfig:
    """Every parameter of a pack run (all of it lands in the manifest metadata).

    Attributes:
        world_size: data-parallel ranks R.
        micro_batches: groups per rank per step M.
        algorithm: one of :data:`ALGORITHMS`.
        caps: ``((module, cap), ...)``: encoder items / LLM tokens per group. When some module has
            no cap, the threshold search picks all caps, using the given ones as upper limits.
        bounds: ``((module, bound), ...)``: ISF acceptance bounds Q'; default from the search or
            ``0.9 x cap``.
        iterations: ISF sampling iterations C.
        oversize: what to do with a sample over a cap on its own: isolate, drop or error.
        epochs: epochs to pack (each with seed ``seed + epoch``).
        seed: base seed.
        cost_model: cost model of :func:`balancer_cli.cost.samples.sample_costs` (``tokens``, ``flops``).
        cost_presets: ``((module, preset or model file), ...)`` for the ``flops`` cost model.
        target_group_size: optional samples-per-group target handed to the search.
        batch_size: fixed samples per group of the ``random`` algorithm (default: the mean group
            size the caps give, rounded).
        lengths_files: input paths, recorded in the metadata for ``balancer report``.
        post_balance: add ``<m>_rank`` columns from :mod:`balancer_cli.replay.post_balance` (the rank
            that runs encoder m's phase for each row).
    """

    world_size: int = 1
    micro_batches: int = 1
    algorithm: str = "balanced"
    caps: tuple[tuple[str, int], ...] = ()
    bounds: tuple[tuple[str, int], ...] = ()
    iterations: int = 50
    oversize: str = "isolate"
    epochs: int = 1
    seed: int = 0
    cost_model: str = "tokens"
    cost_presets: tuple[tuple[str, str], ...] = ()
    target_group_size: int | None = None
    batch_size: int | None = None
    lengths_files: tuple[str, ...] = ()
    post_balance: bool = False


@dataclass(frozen=True)
class PackResult:
    """What :func:`pack_manifest` returns; hand it to :func:`balancer_cli.manifest.write_manifest`.

    Attributes:
        rows: placements sorted by (step, rank, micro, order within group).
        dropped_sample, dropped_reason: samples never placed, with why.
        epoch_num_steps: steps of each epoch.
        meta: the manifest metadata (parameters, fingerprint, summary metrics).
        search: the threshold search result when the search ran, else None.
    """

    rows: ManifestRows
    dropped_sample: np.ndarray
    dropped_reason: tuple[str, ...]
    epoch_num_steps: list[int]
    meta: Mapping[str, Any]
    search: Any = field(default=None, compare=False)


def _by_module(pairs: Sequence[tuple[str, int]], modules: Sequence[str], what: str) -> dict[str, int]:
    given = dict(pairs)
    for module, value in given.items():
        if module not in modules:
            raise UsageError(f"{what} for unknown module '{module}' (modules here: {', '.join(modules)})",
                             fix=f"use one of: {', '.join(modules)}")
        if int(value) <= 0:
            raise UsageError(f"{what} {module}={value} must be positive", fix="give a positive integer")
    return {m: int(v) for m, v in given.items()}


def _option(module: str) -> str:
    return "--max-llm-tokens" if module == LLM else f"--max-{module}-items"


def _ok_rows(inputs: PackInputs, matrix_N: np.ndarray) -> np.ndarray:
    """Rows of ``matrix_N`` without a scan error: the matrix itself (no copy) when every sample is fine."""
    return matrix_N if inputs.ok_N.all() else matrix_N[inputs.ok_N]


def _check_caps_fit(inputs: PackInputs, caps_K: np.ndarray) -> None:
    """Fail when no sample fits under the caps at all: every group would be an oversize one."""
    load = _ok_rows(inputs, inputs.load_NK)
    if len(load) and not (load <= caps_K).all(axis=1).any():
        k = int(np.argmax([(load[:, k] > caps_K[k]).mean() for k in range(len(caps_K))]))
        module, smallest = inputs.modules[k], int(load[:, k].min())
        raise UsageError(
            f"{_option(module)} {int(caps_K[k])} is smaller than every sample "
            f"(smallest: {smallest} {inputs.load_unit(module)})",
            fix=f"raise {_option(module)} to at least {smallest}, typically to several samples' worth")


def _default_max_caps(inputs: PackInputs) -> np.ndarray:
    """Upper limits for the search when the user gives none: the largest sample, at least a few typical ones."""
    load = _ok_rows(inputs, inputs.load_NK)
    largest = load.max(axis=0)
    typical = np.percentile(load, 90, axis=0) * 8
    return np.maximum(np.maximum(largest, typical), 1).astype(np.int64)


def run_search(inputs: PackInputs, config: PackConfig, **search_options: Any) -> Any:
    """Run the threshold search over the samples without error.

    Caps given in ``config.caps`` are the search's upper limits (memory limits); other modules are
    limited by :func:`_default_max_caps`. ``search_options`` go to
    :func:`balancer_cli.pack.search.search_thresholds` (``grid``, ``sample_size``, ...).
    """
    from balancer_cli.pack.search import search_thresholds  # the packer's search; heavy, import late

    caps = _by_module(config.caps, inputs.modules, "cap")
    max_caps_K = _default_max_caps(inputs)
    for k, module in enumerate(inputs.modules):
        max_caps_K[k] = caps.get(module, max_caps_K[k])
    algorithm = config.algorithm if config.algorithm in ("balanced", "isf") else "balanced"
    return search_thresholds(
        _ok_rows(inputs, inputs.load_NK), _ok_rows(inputs, inputs.cost_NK), world_size=config.world_size,
        micro_batches=config.micro_batches, max_caps_K=max_caps_K, target_group_size=config.target_group_size,
        seed=config.seed, algorithm=algorithm, **search_options)


def resolve_thresholds(inputs: PackInputs, config: PackConfig) -> tuple[np.ndarray, np.ndarray, Any]:
    """Caps and ISF bounds per module (K,), running the search when a cap is missing.

    Returns:
        ``(caps_K, bounds_K, search_result_or_None)``.
    """
    caps = _by_module(config.caps, inputs.modules, "cap")
    bounds = _by_module(config.bounds, inputs.modules, "bound")
    search = None
    if all(m in caps for m in inputs.modules):
        caps_K = np.array([caps[m] for m in inputs.modules], dtype=np.int64)
    else:
        search = run_search(inputs, config)
        caps_K = np.asarray(search.best_caps_K, dtype=np.int64)
        if config.algorithm == "isf":  # our packer's search reports bounds = caps: keep ISF's defaults then
            for k, module in enumerate(inputs.modules):
                bounds.setdefault(module, int(search.best_bounds_K[k]))
    _check_caps_fit(inputs, caps_K)
    bounds_K = np.array([bounds.get(m, max(1, math.floor(DEFAULT_BOUND_SHARE * c)))
                         for m, c in zip(inputs.modules, caps_K)], dtype=np.int64)
    bad = np.flatnonzero(bounds_K > caps_K)
    if len(bad):
        m = inputs.modules[int(bad[0])]
        raise UsageError(f"bound {m}={int(bounds_K[bad[0]])} exceeds its cap {int(caps_K[bad[0]])}",
                         fix="an ISF acceptance bound Q' must be <= the cap Q")
    return caps_K, bounds_K, search


def make_packer(inputs: PackInputs, config: PackConfig, caps_K: np.ndarray, bounds_K: np.ndarray,
                algorithm: str | None = None) -> Packer:
    """``epoch -> Packing`` for one algorithm over the samples without error, seeded ``seed + epoch``."""
    algorithm = algorithm or config.algorithm
    ids = np.flatnonzero(inputs.ok_N)
    load = _ok_rows(inputs, inputs.load_NK)
    cost = _ok_rows(inputs, inputs.cost_NK)
    common = dict(oversize=config.oversize, sample_ids=ids)
    if algorithm == "balanced":
        from balancer_cli.pack.packers.balanced import pack_balanced

        # G a multiple of R x M, so no group is left out of a full step.
        group_multiple = config.world_size * config.micro_batches
        # Sources join refinement's objective so that groups (and so steps) are even mixes.
        source = _ok_rows(inputs, inputs.source_codes_N)
        return lambda epoch: pack_balanced(load, caps_K, seed=config.seed + epoch, cost_NK=cost,
                                           group_multiple=group_multiple, source_N=source,
                                           module_names=inputs.modules, **common)
    if algorithm == "isf":
        from balancer_cli.pack.packers.isf import pack_isf

        return lambda epoch: pack_isf(load, caps_K, bounds_K, iterations=config.iterations,
                                      seed=config.seed + epoch, module_names=inputs.modules, **common)
    from balancer_cli.pack.packers import baselines

    if algorithm == "llm-ffd":
        return lambda epoch: baselines.pack_llm_ffd(load, caps_K, seed=config.seed + epoch, **common)
    if algorithm in ("random", "dataloader"):
        batch = config.batch_size or baselines.default_batch_size(load, caps_K)
        return lambda epoch: baselines.pack_random(len(ids), batch, seed=config.seed + epoch, sample_ids=ids)
    raise UsageError(f"unknown algorithm {algorithm!r}", fix=f"use one of: {', '.join(ALGORITHMS)}")


def with_phase_ranks(rows: ManifestRows, inputs: PackInputs, world_size: int) -> ManifestRows:
    """Add ``<m>_rank`` columns: the rank that runs encoder m's phase for each row (post-balancing).

    Raises:
        UsageError: the post-balancing module is not part of this installation.
    """
    try:
        from balancer_cli.replay.post_balance import manifest_phase_ranks
    except ImportError:
        raise UsageError("--post-balance needs balancer_cli.replay.post_balance, which this installation lacks",
                         fix="drop --post-balance or install a balancer_cli that ships post-balancing") from None
    costs = {m: inputs.cost_NK[:, k] for k, m in enumerate(inputs.modules)}  # encoders first, llm last
    phase_ranks = manifest_phase_ranks(rows, costs, world_size)
    extra = dict(rows.extra)
    for module, rank in phase_ranks.items():
        extra[f"{module}_rank"] = np.asarray(rank, dtype=np.int32)
    return ManifestRows(rows.step, rows.rank, rows.micro, rows.sample, extra)


def _check_config(config: PackConfig) -> None:
    if config.world_size < 1 or config.micro_batches < 1 or config.epochs < 1:
        raise UsageError("--dp, --micro-batches and --epochs must be >= 1", fix="give positive integers")
    if config.oversize not in OVERSIZE_POLICIES:
        raise UsageError(f"unknown --oversize {config.oversize!r}", fix=f"use one of: {', '.join(OVERSIZE_POLICIES)}")
    if config.algorithm not in ALGORITHMS:
        raise UsageError(f"unknown algorithm {config.algorithm!r}", fix=f"use one of: {', '.join(ALGORITHMS)}")


def pack_manifest(lengths: LengthsTable, config: PackConfig) -> PackResult:
    """Pack a lengths table into manifest rows (pure; write with :func:`write_manifest`).

    Raises:
        InputError: no sample can be packed (every one has a scan error) or unknown columns.
        UsageError: bad options, caps below every sample, more ranks x micro-batches than groups.
    """
    _check_config(config)
    inputs = prepare_inputs(lengths, config.cost_model, config.cost_presets)
    return pack_inputs(inputs, config, lengths_fingerprint=lengths.fingerprint)


def pack_inputs(inputs: PackInputs, config: PackConfig, *, lengths_fingerprint: str) -> PackResult:
    """:func:`pack_manifest` from already prepared inputs (:func:`prepare_inputs` of the lengths table).

    Lets a caller drop the Arrow lengths table while packing (the inputs hold all packing needs),
    which lowers the peak memory of large runs. Same result as :func:`pack_manifest`.
    """
    from balancer_cli.report.evaluate import evaluate_rows

    _check_config(config)
    if not inputs.ok_N.any():
        first = next(e for e in inputs.error_N if e is not None)
        raise InputError(f"all {inputs.num_samples} samples have a scan error (first: {first})",
                         fix="fix the dataset and re-run `balancer scan`")
    caps_K, bounds_K, search = resolve_thresholds(inputs, config)
    packer = make_packer(inputs, config, caps_K, bounds_K)
    rows, dropped_sample, dropped_reason, epoch_num_steps = place_epochs(
        inputs, packer, world_size=config.world_size, micro_batches=config.micro_batches,
        epochs=config.epochs, seed=config.seed)
    if config.post_balance:
        rows = with_phase_ranks(rows, inputs, config.world_size)
    summary = evaluate_rows(inputs, rows, dropped_sample, dropped_reason, caps_K=caps_K,
                            world_size=config.world_size, micro_batches=config.micro_batches,
                            epoch_num_steps=epoch_num_steps).metrics
    meta = {
        "algorithm": config.algorithm,
        "params": {
            "caps": {m: int(c) for m, c in zip(inputs.modules, caps_K)},
            "bounds": {m: int(b) for m, b in zip(inputs.modules, bounds_K)},
            "cap_units": {m: inputs.load_unit(m) for m in inputs.modules},
            "iterations": config.iterations,
            "oversize": config.oversize,
            "cost_model": config.cost_model,
            "cost_presets": dict(config.cost_presets),
            "target_group_size": config.target_group_size,
            "batch_size": config.batch_size,
            "searched": search is not None,
            "search": None if search is None else {
                "algorithm": search.algorithm, "sample_size": int(search.sample_size),
                "candidates": len(search.candidates), "best_objective": round(float(search.candidates[0].objective), 6),
                "grid_axes": {m: [int(v) for v in axis] for m, axis in zip(inputs.modules, search.grid_axes)},
            },
            "post_balance": config.post_balance,
        },
        "seed": config.seed,
        "epochs": config.epochs,
        "world_size": config.world_size,
        "micro_batches": config.micro_batches,
        "num_samples": inputs.num_samples,
        "modules": list(inputs.modules),
        "lengths_fingerprint": lengths_fingerprint,
        "lengths_files": list(config.lengths_files),
        "summary": summary,
    }
    return PackResult(rows, dropped_sample, dropped_reason, epoch_num_steps, meta, search)
