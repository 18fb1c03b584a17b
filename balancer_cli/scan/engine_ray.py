"""Ray Data engine for ``balancer scan``: measure blocks on a cluster, resumably.

The local engine and this one share everything except *where* ``measure_block`` runs: the same
block descriptions (from ``iter_blocks``) go through the same ``measure_block``, and the same
assembly turns the per-block tables into one lengths table in sample order. Only the measured
blocks travel differently:

1. The driver lists the blocks and writes ``OUT.parts/manifest.json`` (the run key: inputs,
   config, block size, tool version).
2. Blocks without a valid shard become a Ray Dataset (one row per block, one Ray block per scan
   block) and a ``map_batches`` stage measures each one on a worker and writes its table to
   ``OUT.parts/block-<index>.parquet`` atomically, tagged with the run key and the block's key.
   A failing block is retried by Ray (``max_retries``, application errors included); a block that
   still fails is reported by index, file and record range, while every other block finishes.
3. The driver reads the shards in block order and hands them to the shared assembly.

An interrupted run (Ctrl-C, a lost node, a failing block) keeps its finished shards: rerunning the
same command skips every block whose shard exists and carries the same run key and block key.
A changed input file, config or block size changes the run key and starts from scratch.

Workers write the shards themselves, so on a multi-node cluster ``OUT`` must be on storage every
node can write (the same shared storage the inputs are read from).

Example:
    >>> from balancer_cli.scan.engine_ray import parts_dir_for
    >>> parts_dir_for("out/lengths.parquet").as_posix()
    'out/lengths.parquet.parts'
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from balancer_cli import __version__
from balancer_cli.errors import InputError, UsageError
from balancer_cli.fsutil import atomic_path, bytes_fingerprint

__all__ = [
    "RayOptions",
    "RayScanStats",
    "parts_dir_for",
    "run_key",
    "block_key",
    "measure_blocks_ray",
    "import_ray",
]

#: Schema metadata key of a shard: JSON with the run key, block key and block index.
SHARD_KEY = b"balancer_shard"
_MANIFEST = "manifest.json"
_SHARD_GLOB = "block-*.parquet"
_INSTALL_FIX = "install the extra: pip install 'balancer_cli[ray]'"


@dataclass(frozen=True)
class RayOptions:
    """How to reach (or start) the Ray cluster and how hard to retry.

    Attributes:
        address: an existing cluster (``ray://host:10001``, ``host:6379`` or ``auto``); ``None``
            starts a local cluster for this run and stops it afterwards.
        num_cpus: CPUs of the local cluster (ignored with ``address``); ``None`` uses all.
        object_store_bytes: object store size of the local cluster; ``None`` lets Ray choose.
        block_retries: how many times Ray retries a block whose measurement raised or whose
            worker died, before the block is reported as failed.
        keep_parts: keep ``OUT.parts/`` after a successful run (it is removed by default).
    """

    address: str | None = None
    num_cpus: int | None = None
    object_store_bytes: int | None = None
    block_retries: int = 3
    keep_parts: bool = False


@dataclass(frozen=True)
class RayScanStats:
    """What a Ray scan did: blocks in total, reused from an earlier run, measured now."""

    blocks: int
    reused: int
    measured: int
    seconds: float


def parts_dir_for(out_path: str | os.PathLike) -> Path:
    """The work directory of a Ray scan writing ``out_path``: ``<out_path>.parts`` beside it."""
    out = Path(out_path)
    return out.with_name(out.name + ".parts")


def run_key(inputs_meta: Any, config_meta: Any, block_size: int) -> str:
    """Fingerprint of everything that decides the shards' contents (JSON-able arguments).

    ``inputs_meta`` should carry each input's size and content fingerprint, ``config_meta`` the
    scan config, so that editing either invalidates the shards of an interrupted run.
    """
    payload = json.dumps({"inputs": inputs_meta, "config": config_meta, "block_size": block_size,
                          "tool_version": __version__}, sort_keys=True, default=repr)
    return bytes_fingerprint(payload.encode())


def block_key(block: Any) -> str:
    """Fingerprint of one block description (its ``repr``: file, format, record range, first sample)."""
    return bytes_fingerprint(repr(block).encode())


def import_ray():
    """Import ``ray`` and ``ray.data`` or raise a :class:`UsageError` that says how to install them."""
    try:
        import ray
        import ray.data  # noqa: F401  (the submodule must be importable too)
    except ImportError as exc:
        raise UsageError(f"--engine ray needs Ray Data, which is not installed ({exc})", fix=_INSTALL_FIX) from None
    return ray


def _shard_path(parts_dir: Path, index: int) -> Path:
    return parts_dir / f"block-{index:08d}.parquet"


def _error_path(parts_dir: Path, index: int) -> Path:
    return parts_dir / f"block-{index:08d}.error"


def _shard_tag(path: Path) -> dict | None:
    """The tag a shard was written with, or None if it is missing or unreadable."""
    try:
        raw = (pq.read_schema(path).metadata or {}).get(SHARD_KEY)
        return json.loads(raw) if raw else None
    except (OSError, pa.ArrowException, ValueError):
        return None


def _prepare_parts(parts_dir: Path, key: str, keys: Sequence[str]) -> list[bool]:
    """Make ``parts_dir`` belong to run ``key``; return, per block, whether its shard is reusable."""
    manifest = parts_dir / _MANIFEST
    previous = None
    if manifest.is_file():
        try:
            previous = json.loads(manifest.read_text()).get("run_key")
        except (OSError, ValueError):
            previous = None
    if previous != key:
        # Another run's shards (other inputs, config or block size): never mix them in.
        for stale in [*parts_dir.glob(_SHARD_GLOB), *parts_dir.glob("block-*.error")]:
            stale.unlink()
        with atomic_path(manifest) as tmp:
            tmp.write_text(json.dumps({"run_key": key, "num_blocks": len(keys), "tool_version": __version__},
                                      sort_keys=True))
        return [False] * len(keys)
    done = []
    for index, bkey in enumerate(keys):
        tag = _shard_tag(_shard_path(parts_dir, index))
        done.append(tag is not None and tag.get("run_key") == key and tag.get("block_key") == bkey)
    return done


class _MeasureAndWrite:
    """The ``map_batches`` UDF: measure each block of the batch and write its shard.

    Returns one summary row per block (index, rows, errored samples, seconds); the measured
    table itself goes to the shard, so the object store never holds the lengths.
    """

    def __init__(self, measure: Callable, config: Any, parts_dir: str, key: str) -> None:
        self.measure, self.config, self.parts_dir, self.key = measure, config, Path(parts_dir), key

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, list]:
        out: dict[str, list] = {"block_index": [], "num_rows": [], "num_errors": [], "seconds": []}
        for index, payload in zip(batch["block_index"], batch["block"]):
            index = int(index)
            start = time.perf_counter()
            block = None
            try:
                block = pickle.loads(payload)
                table = self.measure(block, self.config)
            except Exception as exc:
                # Leave the reason where the driver finds it if the retries run out too, then
                # let Ray retry the block.
                reason = f"{type(exc).__name__}: {exc}"
                with atomic_path(_error_path(self.parts_dir, index)) as tmp:
                    tmp.write_text(reason)
                raise RuntimeError(f"block {index} ({_describe(block) if block else '?'}): {reason}") from exc
            tag = {"run_key": self.key, "block_key": block_key(block), "block_index": index}
            table = table.replace_schema_metadata({SHARD_KEY: json.dumps(tag, sort_keys=True).encode()})
            with atomic_path(_shard_path(self.parts_dir, index)) as tmp:
                pq.write_table(table, tmp, compression="zstd")
            _error_path(self.parts_dir, index).unlink(missing_ok=True)
            out["block_index"].append(index)
            out["num_rows"].append(table.num_rows)
            out["num_errors"].append(_count_errors(table))
            out["seconds"].append(time.perf_counter() - start)
        return out


def _count_errors(table: pa.Table) -> int:
    if "error" not in table.column_names:
        return 0
    return table.num_rows - table.column("error").null_count


def _describe(block: Any) -> str:
    """A short human description of a block: its file and where its records start."""
    path = getattr(block, "path", None)
    if path is None:
        return repr(block)[:120]
    parts = [str(path)]
    first_line, count = getattr(block, "first_line", None), getattr(block, "num_records", None)
    if first_line is not None:
        parts.append(f"line/row {first_line}")
    if count is not None:
        parts.append(f"{count} records")
    return ", ".join(parts)


def _init_ray(ray, options: RayOptions) -> bool:
    """Connect to ``options.address`` or start a local cluster; True if this call started Ray."""
    if ray.is_initialized():
        return False
    if options.address:
        try:
            ray.init(address=options.address, log_to_driver=False, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise InputError(f"cannot connect to the Ray cluster at {options.address!r} ({exc})",
                             fix="start it with `ray start --head` or pass the right --ray-address") from None
        return True
    # A local cluster: workers must import this very copy of balancer_cli, installed or not.
    package_parent = str(Path(__file__).resolve().parents[2])
    pythonpath = os.pathsep.join([package_parent, *[p for p in sys.path if p]])
    ray.init(num_cpus=options.num_cpus, object_store_memory=options.object_store_bytes,
             include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    return True


def measure_blocks_ray(
    blocks: Iterable[Any],
    config: Any,
    parts_dir: str | os.PathLike,
    key: str,
    *,
    measure: Callable[[Any, Any], pa.Table],
    options: RayOptions = RayOptions(),
    progress: bool = False,
) -> tuple[list[pa.Table], RayScanStats]:
    """Measure every block on Ray and return the per-block tables in block order.

    Args:
        blocks: the block descriptions, in sample order (``iter_blocks``'s output).
        config: the scan config, passed to ``measure`` unchanged (must pickle).
        parts_dir: the work directory for shards (see :func:`parts_dir_for`).
        key: the run key (see :func:`run_key`); shards of another key are discarded.
        measure: ``measure(block, config) -> pa.Table``, the local engine's function.
        options: cluster and retry options.
        progress: show a tqdm bar of blocks on stderr.

    Returns:
        ``(tables, stats)``: one table per block, as ``measure`` returned it, and what was done.

    Raises:
        UsageError: Ray is not installed.
        InputError: blocks that still failed after the retries (their shards are missing; the
            others are kept, so rerunning resumes).
    """
    start = time.perf_counter()
    blocks = list(blocks)
    parts_dir = Path(parts_dir)
    parts_dir.mkdir(parents=True, exist_ok=True)
    keys = [block_key(block) for block in blocks]
    done = _prepare_parts(parts_dir, key, keys)
    todo = [index for index, ok in enumerate(done) if not ok]
    if todo:
        _run_pipeline(blocks, todo, config, parts_dir, key, measure, options, progress)
    tables = [_read_shard(_shard_path(parts_dir, index)) for index in range(len(blocks))]
    stats = RayScanStats(blocks=len(blocks), reused=len(blocks) - len(todo), measured=len(todo),
                         seconds=time.perf_counter() - start)
    return tables, stats


def finish_parts(parts_dir: str | os.PathLike, options: RayOptions) -> None:
    """Remove the work directory after the lengths table was written (unless ``keep_parts``)."""
    if not options.keep_parts:
        shutil.rmtree(parts_dir, ignore_errors=True)


def _read_shard(path: Path) -> pa.Table:
    # One chunk per block and no shard tag: exactly what the local engine's measure returned.
    return pq.read_table(path).combine_chunks().replace_schema_metadata(None)


def _run_pipeline(blocks, todo, config, parts_dir, key, measure, options, progress) -> None:
    ray = import_ray()
    started = _init_ray(ray, options)
    data_logger = logging.getLogger("ray.data")
    level = data_logger.level
    data_logger.setLevel(logging.ERROR)  # per-run INFO lines would drown the progress bar
    try:
        import ray.data

        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False
        # Let every other block finish when one keeps failing: its shard is simply missing.
        context.max_errored_blocks = -1
        retry_args: dict[str, Any] = {}
        if hasattr(context, "max_map_retries"):
            # Ray >= 2.5x: retry the UDF in place. Lost workers are retried by Ray Core anyway.
            context.retried_map_errors, context.max_map_retries = True, options.block_retries
        else:
            retry_args = {"max_retries": options.block_retries, "retry_exceptions": True}
        # cloudpickle, so blocks and measure functions defined in scripts travel too.
        items = [{"block_index": index, "block": ray.cloudpickle.dumps(blocks[index])} for index in todo]
        dataset = ray.data.from_items(items, override_num_blocks=len(items))
        measured = dataset.map_batches(
            _MeasureAndWrite(measure, config, str(parts_dir), key), batch_size=1, **retry_args)
        _drain(measured, len(todo), progress)
    finally:
        data_logger.setLevel(level)
        if started:
            ray.shutdown()
    missing = [index for index in todo if not _shard_path(parts_dir, index).is_file()]
    if missing:
        shown = "; ".join(f"block {i} ({_describe(blocks[i])}): {_last_error(parts_dir, i)}" for i in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise InputError(
            f"{len(missing)} of {len(blocks)} blocks failed after {options.block_retries} retries: {shown}{more}",
            fix=f"fix the cause; the {len(blocks) - len(missing)} finished shards are kept in "
                f"{parts_dir}, so rerunning the same command measures only the failed blocks",
        )


def _last_error(parts_dir: Path, index: int) -> str:
    try:
        return _error_path(parts_dir, index).read_text()
    except OSError:
        return "its worker was lost"


def _drain(dataset, total: int, progress: bool) -> None:
    """Run the pipeline, advancing a progress bar as block summaries stream back."""
    from tqdm import tqdm

    with tqdm(total=total, unit="block", desc="scan (ray)", disable=not progress, file=sys.stderr) as bar:
        for batch in dataset.iter_batches(batch_size=None, batch_format="pyarrow"):
            bar.update(batch.num_rows)
