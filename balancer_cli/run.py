"""Library entry points of the file-to-file commands: what ``balancer scan``, ``search``, ``pack`` and
``report`` do.

The CLI parses options and calls one of these; Python users call them the same way. Each reads
its inputs, runs the pure core (:mod:`balancer_cli.pack.pipeline`, :mod:`balancer_cli.report.build`)
and writes its outputs, and returns the summary the CLI prints.

Example:
    >>> import tempfile, numpy as np
    >>> from balancer_cli.lengths import make_lengths_table, write_lengths
    >>> from balancer_cli.pack.config import PackConfig
    >>> tmp = tempfile.mkdtemp()
    >>> write_lengths(make_lengths_table(np.arange(100, 140)), f"{tmp}/lengths.parquet")
    >>> summary = pack_to_dir([f"{tmp}/lengths.parquet"], f"{tmp}/out", PackConfig(world_size=2, caps={"llm": 500}),
    ...                       baselines=("random",))
    >>> sorted(summary["files"]), summary["dropped"]["count"], list(summary["baselines"])
    (['json', 'md', 'png'], 0, ['random'])
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from balancer_cli._fsutil import check_output, claim_parts_dir, remove_parts_dir
from balancer_cli._memory import release_freed_memory
from balancer_cli.commit import (
    check_replaceable,
    committed_folder,
    read_commit,
    write_commit,
)
from balancer_cli.errors import InputError, ManifestError, UsageError
from balancer_cli.lengths import read_lengths
from balancer_cli.manifest import (
    REPORT_JSON,
    REPORT_MD,
    REPORT_PNG,
    open_manifest,
    write_manifest,
)
from balancer_cli.pack.config import PackConfig
from balancer_cli.pack.packers import registry
from balancer_cli.report.plot_worker import PlotWorker, want_worker

__all__ = ["scan_to_file", "pack_to_dir", "report_dir", "search_to_files", "PACK_PHASES", "SEARCH_PHASES"]

#: Called after each phase of a long run (for a progress bar): read, pack, write, report.
OnPhase = Callable[[str], None]
#: The phases :func:`pack_to_dir` reports to ``on_phase``.
PACK_PHASES = ("read", "pack", "write", "report")
#: The phases :func:`search_to_files` reports to ``on_phase``.
SEARCH_PHASES = ("read", "search", "write")


def scan_to_file(inputs: Sequence[str | os.PathLike], output: str | os.PathLike, config: Any, *,
                 engine: str = "local", ray_address: str | None = None, keep_parts: bool = False,
                 jobs: int | None = None, progress: Callable[[int], None] | None = None,
                 notify: Callable[[str], None] | None = None, **scan_options: Any) -> dict[str, Any]:
    """Measure every sample of ``inputs`` and write the lengths table to ``output`` (atomically).

    Args:
        inputs: dataset files / folders, concatenated in order.
        output: the lengths Parquet file to write.
        config: a :class:`~balancer_cli.scan.measure.ScanConfig` (model, tokenizer, template, ...).
        engine: ``local`` or ``ray``; the output is byte-identical.
        ray_address: ``ray``: an existing cluster (default: a local one of ``jobs`` CPUs).
        keep_parts: ``ray``: keep the per-block shards (``OUTPUT.parts/``) afterwards; an
            interrupted ray scan resumes from them when rerun.
        jobs: worker processes or CPUs (default: all cores).
        progress: called with the samples of each finished block.
        notify: called with one line when a ray scan resumes.
        scan_options: ``block_size``, ``image_root``, ``format``, ``split``, ``hf_builder`` of
            :func:`~balancer_cli.scan.pipeline.scan`.

    Returns:
        The scan summary plus ``output``, ``seconds`` and ``samples_per_s``.

    Raises:
        UsageError: ``ray_address`` or ``keep_parts`` without the ray engine.
        InputError: ``output`` is, holds or lies inside an input, or is not a regular file.
    """
    import time

    from balancer_cli.lengths import write_lengths
    from balancer_cli.scan.patterns import expand_pattern
    from balancer_cli.scan.pipeline import scan

    inputs_as_files = [p for given in inputs for p in expand_pattern(str(given))]  # a quoted shard pattern too
    check_output(output, inputs_as_files)
    engine_options = None
    if engine == "ray":
        from balancer_cli.scan.engines.ray import RayOptions, parts_dir_for

        parts = parts_dir_for(output)
        if parts.exists() and not parts.is_dir():
            raise InputError(f"{parts} (the ray engine's work folder for {output}) exists and is not a folder",
                             fix="move it away, or write the output elsewhere")
        check_output(parts, inputs_as_files, folder=True)
        engine_options = RayOptions(parts_dir=str(parts), address=ray_address, num_cpus=jobs or None,
                                    keep_parts=keep_parts, notify=notify)
    elif keep_parts or ray_address:
        raise UsageError("{ray_address} and {keep_parts} apply to the ray engine only", fix="add {engine} ray")
    started = time.perf_counter()
    result = scan([str(p) for p in inputs], config, jobs=jobs, engine=engine, progress=progress,
                  engine_options=engine_options, **scan_options)
    _writable(output, lambda: write_lengths(result.lengths, output))
    if engine_options is not None:
        from balancer_cli.scan.engines.ray import remove_parts

        remove_parts(engine_options)
    seconds = time.perf_counter() - started
    return {**result.summary, "output": str(output), "seconds": round(seconds, 3),
            "samples_per_s": round(result.summary["samples"] / max(seconds, 1e-9), 1)}


def pack_to_dir(lengths_files: Sequence[str | os.PathLike], out: str | os.PathLike, config: PackConfig, *,
                baselines: Sequence[str] = registry.names(baseline=True),
                on_phase: OnPhase | None = None, memory_gb: float | None = None, engine: str = "local",
                ray_address: str | None = None, keep_parts: bool = False,
                notify: Callable[[str], None] | None = None,
                on_window: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Pack lengths files into ``out/``: manifest, dropped list and the report against ``baselines``.

    Args:
        lengths_files: lengths Parquet and/or OmniBal token-length JSON files, concatenated in order.
        out: the output directory (created).
        config: the run's parameters; ``lengths_files`` defaults to the absolute input paths.
        baselines: packers to compare with in the report (``balancer report out`` reuses them).
        on_phase: called with each finished phase of :data:`PACK_PHASES`.
        memory_gb: memory budget that sets ``config.window_samples`` when it is None
            (:func:`~balancer_cli.pack.windows.resolve_window_samples`).
        engine: where the manifest's windows are packed: ``local`` or ``ray`` (same output).
        ray_address: ``ray``: an existing cluster (default: a local one with all cores).
        keep_parts: ``ray``: keep ``OUT.parts/`` (the finished windows) afterwards; an interrupted
            run resumes from them when rerun.
        notify: called with one line when a ray run resumes.
        on_window: called with ``(done, total)`` as each window of the manifest's packing is done.

    The whole folder is built under a temporary sibling name and renamed into place with its
    ``_COMMIT.json`` (:func:`balancer_cli.commit.committed_folder`): an interrupted run leaves
    ``out`` as it was. An existing ``out`` is replaced only if balancer wrote it and it holds
    nothing else.

    Returns:
        The summary: ``out``, ``files`` (the report's paths) and the report data.

    Raises:
        BalancerError: bad inputs or options (see :func:`~balancer_cli.pack.pipeline.pack_inputs`).
        InputError: ``out`` is, holds or lies inside an input, or is a folder balancer did not
            write; ``OUT.parts`` exists without balancer's marker.
    """
    import numpy as np

    # Compiled kernels (numba) are imported by pack alone, not by the module (scan needs none).
    from balancer_cli._columns import column_sums
    from balancer_cli._jit import warm_up
    from balancer_cli.pack.inputs import prepare_inputs
    from balancer_cli.pack.pipeline import pack_inputs

    done = on_phase or (lambda phase: None)
    baselines = tuple(registry.get(name).name for name in baselines)
    paths = [str(p) for p in lengths_files]
    check_output(out, paths, folder=True)
    _writable(out, lambda: check_replaceable(out))
    if not config.lengths_files:
        config = dataclasses.replace(config, lengths_files=tuple(os.path.abspath(p) for p in paths))
    # numba's contexts are built off this thread while it reads (docs/scaling.md: 1.2M ~0.1 s wall).
    warm_up(lambda: column_sums(np.zeros((2, 2))))
    table = read_lengths(paths)
    release_freed_memory()  # the files' read buffers (10M: ~170 MB), before the matrices are built
    done("read")
    # Large runs draw report.png in a child that imports matplotlib while this process packs; not
    # under a memory budget, which the child's ~100 MB would not be counted in.
    with PlotWorker() if memory_gb is None and want_worker(table.num_samples) else contextlib.nullcontext() as plotter:
        engine_options = _pack_engine_options(engine, out, table.fingerprint, ray_address, notify)
        if keep_parts and engine_options is None:
            raise UsageError("{keep_parts} applies to the ray engine only", fix="add {engine} ray")
        # Pack from the per-sample matrices alone and drop the Arrow table: the report works on the same
        # matrices (no second read of the lengths), and at 10M samples that keeps ~0.5 GB off the peak.
        inputs = prepare_inputs(table, config.cost_model, config.cost_presets, costs=config.costs,
                                origin=" + ".join(paths))
        fingerprint = table.fingerprint
        del table
        release_freed_memory()
        from balancer_cli.pack.windows import resolve_window_samples

        config = dataclasses.replace(config, window_samples=resolve_window_samples(
            inputs.num_samples, config.window_samples, memory_gb, num_modules=len(inputs.modules),
            epochs=config.epochs, num_sources=len(inputs.source_names)))
        result = pack_inputs(inputs, config, lengths_fingerprint=fingerprint, engine=engine,
                             engine_options=engine_options, on_window=on_window)
        done("pack")
        final = Path(out)

        def write(folder: Path) -> dict[str, Any]:
            nonlocal result
            if plotter is not None:
                from balancer_cli.report.build import early_figure

                # Without a baseline in it the figure is known now: the child draws it meanwhile.
                figure = early_figure(result.evaluation.loads, config.algorithm, baselines)
                if figure is not None:
                    plotter.submit(figure[0], figure[1], **figure[2])
            write_manifest(folder, result.rows, dropped_sample=result.dropped_sample,
                           dropped_reason=result.dropped_reason,
                           # `balancer report OUT` compares with the same baselines by default
                           meta={**result.meta, "report_baselines": list(baselines)},
                           epoch_num_steps=result.epoch_num_steps)
            # The report checks the written rows and reuses their evaluation: hold no second copy meanwhile.
            evaluation, plan, result = result.evaluation, result.plan, None
            release_freed_memory()
            done("write")
            summary = _report(folder, (inputs, fingerprint), baselines, ours=evaluation, plan=plan, plotter=plotter)
            # the paths the files will have once the folder is in place
            return {**summary, "out": str(final), "files": {k: str(final / Path(v).name) for k, v in summary["files"].items()}}

        def commit() -> dict[str, Any]:
            with committed_folder(final) as tmp:
                summary = write(tmp)
            return summary

        summary = _writable(final, commit)
        if engine_options is not None and not keep_parts:
            remove_parts_dir(engine_options.parts_dir)  # ours: it carries the marker this run checked
        done("report")
        return summary


def _writable(out: Path | str, work: Callable[[], Any]) -> Any:
    """``work()``, with an unwritable output reported as one InputError line."""
    try:
        return work()
    except OSError as error:
        raise InputError(f"cannot write to {out}: {error.strerror or error}",
                         fix="choose a writable folder for the output") from None


def _pack_engine_options(engine: str, out: str | os.PathLike, fingerprint: str, ray_address: str | None,
                         notify: Callable[[str], None] | None) -> Any:
    """The Ray engine's options for a pack into ``out`` (windows kept in ``OUT.parts/``), else None."""
    from balancer_cli.pack.engines import get_engine

    get_engine(engine)  # validates the name
    if engine != "ray":
        if ray_address:
            raise UsageError("{ray_address} applies to the ray engine only", fix="add {engine} ray")
        return None
    from balancer_cli._ray import import_ray
    from balancer_cli.pack.engines.ray import RayPackOptions

    import_ray()  # a clear error before any work when the extra is missing
    out = Path(out)
    parts = out.with_name(out.name + ".parts")
    claim_parts_dir(parts)  # refuses a folder of that name that balancer did not create
    return RayPackOptions(run_key=fingerprint, address=ray_address, parts_dir=str(parts), notify=notify)


def report_dir(out: str | os.PathLike, *, lengths_files: Sequence[str | os.PathLike] = (),
               baselines: Sequence[str] | None = None, cost: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Recompute ``out/report.json``, ``report.md`` and ``report.png`` from the written manifest.

    Args:
        out: a manifest directory written by :func:`pack_to_dir`.
        lengths_files: the lengths files it was packed from (default: the paths it recorded);
            checked by fingerprint.
        baselines: packers to compare with (default: those the manifest was reported with).
        cost: measure with another cost model than the packing's: ``{"cost_model", "cost_presets",
            "costs"}`` (see :func:`balancer_cli.report.build.build_report`).

    ``out`` must carry a matching commit record (every checksum is checked) and pass the
    integrity checks of :func:`~balancer_cli.replay.integrity.check_manifest`; the record is
    rewritten with the new report files.

    Returns:
        The summary, as :func:`pack_to_dir` returns it.
    """
    manifest = open_manifest(out, full=True)
    if baselines is None:
        try:
            baselines = tuple(registry.get(n).name for n in manifest.meta.get("report_baselines",
                                                                          registry.names(baseline=True)))
        except UsageError as exc:  # recorded, not passed: the manifest's fault
            raise ManifestError(f"{out}: its recorded report baselines are invalid ({exc.message})",
                                fix="pass {baselines}, or re-run `balancer pack`") from None
    else:
        baselines = tuple(registry.get(name).name for name in baselines)
    given = [str(p) for p in lengths_files]
    paths = given or [str(p) for p in manifest.meta.get("lengths_files", [])]
    if not paths:
        raise ManifestError(f"{out}: the manifest records no lengths files", fix="pass them as {lengths_files}")
    missing = [p for p in paths if not Path(p).is_file()]
    if missing and not given:  # a given path's own error comes from read_lengths (no such file, no regular file)
        raise ManifestError(f"lengths file {missing[0]} (recorded in {out}) no longer exists",
                            fix="pass the lengths files as {lengths_files}")
    for name in (REPORT_JSON, REPORT_MD, REPORT_PNG):  # the report replaces these: never an input
        check_output(manifest.path / name, paths)
    table = read_lengths(paths)
    try:
        summary = _report(out, table, baselines, cost)
        listed = set((read_commit(manifest.path) or {}).get("files", {})) | {REPORT_JSON, REPORT_MD, REPORT_PNG}
        write_commit(manifest.path, sorted(n for n in listed if (manifest.path / n).is_file()))
        return summary
    except OSError as error:
        raise InputError(f"cannot write the report into {out}: {error.strerror or error}",
                         fix="make the manifest directory writable") from None


def search_to_files(lengths_files: Sequence[str | os.PathLike], config: PackConfig, *, grid: int = 5,
                    sample_size: int = 12_000, out: str | os.PathLike | None = None,
                    plot: str | os.PathLike | None = None, on_phase: OnPhase | None = None) -> dict[str, Any]:
    """Rank packing thresholds for the lengths files; optionally write them as JSON and a heat map.

    Args:
        lengths_files: lengths Parquet and/or OmniBal token-length JSON files, concatenated in order.
        config: step shape, algorithm, seed, cost model; its caps are the search's upper limits.
        grid: cap values tried per module.
        sample_size: samples each candidate is evaluated on (a seeded subsample).
        out: write the search as JSON here.
        plot: write the objective heat map (PNG) here.
        on_phase: called with each finished phase of :data:`SEARCH_PHASES`.

    Returns:
        The search data (candidates, best caps, ...) with ``files`` written.
    """
    import json

    from balancer_cli._fsutil import atomic_path
    from balancer_cli.pack.inputs import prepare_inputs
    from balancer_cli.pack.pipeline import run_search
    from balancer_cli.report.search import plot_search, search_data

    done = on_phase or (lambda phase: None)
    for target in (out, plot):
        if target:
            check_output(target, lengths_files)
    if out and plot and os.path.realpath(out) == os.path.realpath(plot):
        raise UsageError(f"the JSON and the plot would both be written to {out}", fix="give them different paths")
    paths = [str(p) for p in lengths_files]
    table = read_lengths(paths)
    inputs = prepare_inputs(table, config.cost_model, config.cost_presets, costs=config.costs, origin=" + ".join(paths))
    done("read")
    result = run_search(inputs, config, grid=grid, sample_size=sample_size)
    done("search")
    data = search_data(result, inputs.modules, extra={
        "world_size": config.world_size, "micro_batches": config.micro_batches, "num_samples": inputs.num_samples,
        "lengths_fingerprint": table.fingerprint, "max_caps": dict(config.caps)})
    files = {}
    if out:
        with atomic_path(out) as tmp:
            tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        files["json"] = str(Path(out))
    if plot:
        with atomic_path(plot) as tmp:
            plot_search(tmp, data)
        files["plot"] = str(Path(plot))
    done("write")
    return {**data, "files": files}


def _report(out: str | os.PathLike, lengths, baselines: Sequence[str], cost: Mapping[str, Any] | None = None,
            ours: Any = None, plan: Any = None, plotter: Any = None) -> dict[str, Any]:
    from balancer_cli.report.build import build_report, write_report

    report = build_report(open_manifest(out), lengths, baselines=baselines, cost=cost, ours=ours, plan=plan)
    written = write_report(out, report, plotter=plotter)
    return {"out": str(Path(out)), "files": {k: str(v) for k, v in written.items()}, **report.data}
