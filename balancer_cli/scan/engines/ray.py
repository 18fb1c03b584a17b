"""Ray Data engine for ``balancer scan``: measure blocks on a cluster, resumably.

The local engine and this one differ only in *where* ``measure_block`` runs. Both take the same
block descriptions (``iter_blocks``), call the same ``measure_block`` and hand the per-block tables,
in block order, to the same :func:`~balancer_cli.scan.pipeline.assemble`, so both write the same
lengths file, byte for byte. Here:

1. The driver lists the blocks and claims ``OUT.parts/`` for this run (``manifest.json`` holds the
   run key: config, tool version, the inputs' sizes and modification times, the number of blocks).
2. Blocks without a valid shard become a Ray Dataset (one row and one Ray block per scan block); a
   ``map_batches`` stage measures each on a worker and writes ``OUT.parts/block-<index>.parquet``
   atomically, tagged with the run key and the block's own key (file, byte/row range, first sample).
   Only a small summary row per block travels back through the object store.
3. The driver yields the tables in block order as soon as the next one is done (reading shards),
   so the caller's progress bar advances while the cluster works.

Failures: a block whose measurement raises is retried ``block_retries`` times by Ray Data (a lost
worker is resubmitted by Ray Core); a block that still fails is reported by index, file, line and
reason after every other block has finished. With ``--strict``, the first bad sample in sample order
is raised as in the local engine (it is not retried: it is a property of the data). An interrupted
run keeps its finished shards: rerunning the same command skips every block whose shard carries the
same run key and block key; any change to the inputs or options starts afresh.

Workers write the shards themselves, so on a multi-node cluster ``OUT`` must be on storage every
node can write (like the inputs, which every node reads).

Example:
    >>> from balancer_cli.scan.engines.ray import parts_dir_for
    >>> parts_dir_for("out/lengths.parquet").as_posix()
    'out/lengths.parquet.parts'
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from balancer_cli import __version__
from balancer_cli._fsutil import (
    atomic_path,
    bytes_fingerprint,
    claim_parts_dir,
    remove_parts_dir,
)
from balancer_cli._ray import ray_session
from balancer_cli.errors import InputError, SampleError

__all__ = ["SHARD_KEY", "RayOptions", "parts_dir_for", "run_key", "block_key", "run_blocks", "remove_parts"]

#: Schema metadata key of a shard: JSON with the run key, block key and block index.
SHARD_KEY = b"balancer_shard"
_MANIFEST = "manifest.json"


@dataclass(frozen=True, kw_only=True)
class RayOptions:
    """Where the Ray scan keeps its shards, which cluster it uses, how hard it retries.

    Attributes:
        parts_dir: work directory for shards (``parts_dir_for(out)``); ``None`` uses a temporary
            one (no resume across runs).
        address: an existing cluster (``auto``, ``host:6379``, ``ray://host:10001``); ``None``
            starts a local cluster for this run and stops it afterwards.
        num_cpus: CPUs of the local cluster (ignored with ``address``); ``None`` uses all cores.
        object_store_bytes: object store of the local cluster; ``None`` lets Ray choose.
        block_retries: retries of a block whose measurement raised, before it counts as failed.
        keep_parts: keep ``parts_dir`` after the output is written (see :func:`remove_parts`).
        notify: called with one line when a run resumes (e.g. ``click.echo`` to stderr).
    """

    parts_dir: str | None = None
    address: str | None = None
    num_cpus: int | None = None
    object_store_bytes: int | None = None
    block_retries: int = 3
    keep_parts: bool = False
    notify: Callable[[str], None] | None = None


def parts_dir_for(out_path: str | os.PathLike) -> Path:
    """The work directory of a Ray scan writing ``out_path``: ``<out_path>.parts`` beside it.

    Example:
        >>> parts_dir_for("out/lengths.parquet").name
        'lengths.parquet.parts'
    """
    out = Path(out_path)
    return out.with_name(out.name + ".parts")


def run_key(config: Any, blocks: Sequence[Any]) -> str:
    """Fingerprint of everything that decides the shards' contents.

    The config, the tool version, the number of blocks and each input's size and modification
    time (cheap to read on shared storage; the content fingerprint is computed once, for the
    final metadata). Each block's own range is in :func:`block_key`.
    """
    inputs = {}
    for block in blocks:
        path = str(getattr(block, "path", ""))
        if path not in inputs:
            try:
                st = os.stat(path)
                inputs[path] = [st.st_size, st.st_mtime_ns]
            except OSError:
                inputs[path] = None
    config_meta = asdict(config) if is_dataclass(config) else repr(config)
    payload = json.dumps({"config": config_meta, "tool_version": __version__, "num_blocks": len(blocks),
                          "inputs": inputs}, sort_keys=True, default=repr)
    return bytes_fingerprint(payload.encode())


def block_key(block: Any) -> str:
    """Fingerprint of one block description (its ``repr``: file, format, range, first sample).

    Example:
        >>> from balancer_cli.scan.blocks import RecordBlock
        >>> block = RecordBlock(path="d.jsonl", format="jsonl", source="d", first_sample=0, num_records=1, stop=9)
        >>> block_key(block) == block_key(RecordBlock(**{**vars(block), "first_sample": 1}))
        False
    """
    return bytes_fingerprint(repr(block).encode())


def _path(parts_dir: Path, index: int, suffix: str) -> Path:
    return parts_dir / f"block-{index:08d}.{suffix}"


def _shard_tag(path: Path) -> dict | None:
    """The tag a shard was written with, or None if it is missing or unreadable."""
    try:
        raw = (pq.read_schema(path).metadata or {}).get(SHARD_KEY)
        return json.loads(raw) if raw else None
    except (OSError, pa.ArrowException, ValueError):
        return None


def _prepare_parts(parts_dir: Path, key: str, keys: Sequence[str]) -> list[bool]:
    """Claim ``parts_dir`` for run ``key``; return, per block, whether its shard can be reused."""
    claim_parts_dir(parts_dir)  # a folder balancer did not create is refused, never emptied
    for partial in parts_dir.glob(".block-*.tmp"):  # writes cut short by a crash
        partial.unlink(missing_ok=True)
    manifest = parts_dir / _MANIFEST
    try:
        previous = json.loads(manifest.read_text()).get("run_key")
    except (OSError, ValueError, AttributeError):
        previous = None
    if previous != key:
        # Another run's shards (other inputs, options or tool version): never mix them in.
        for stale in parts_dir.glob("block-*"):
            stale.unlink()
        with atomic_path(manifest) as tmp:
            tmp.write_text(json.dumps({"run_key": key, "num_blocks": len(keys), "tool_version": __version__},
                                      sort_keys=True))
        return [False] * len(keys)
    reusable = []
    for index, bkey in enumerate(keys):
        tag = _shard_tag(_path(parts_dir, index, "parquet"))
        reusable.append(tag is not None and tag.get("run_key") == key and tag.get("block_key") == bkey)
    return reusable


class _MeasureAndWrite:
    """The ``map_batches`` function: measure each block of the batch and write its shard.

    Returns one summary row per block (its index); the measured table goes to the shard, so the
    object store never holds lengths. A bad sample under ``strict`` is written down (not raised:
    retrying cannot fix data); any other exception is written down and re-raised for Ray to retry.
    """

    def __init__(self, measure: Callable, config: Any, parts_dir: str, key: str) -> None:
        self.measure, self.config, self.parts_dir, self.key = measure, config, Path(parts_dir).resolve(), key
        # Blocks keep the paths as the user gave them (error texts quote them, as the local engine
        # does), so relative paths must resolve against the driver's folder on every node.
        self.cwd = os.getcwd()

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, list]:
        previous = os.getcwd()
        os.chdir(self.cwd)
        try:
            return self._measure_batch(batch)
        finally:
            os.chdir(previous)

    def _measure_batch(self, batch: Mapping[str, Any]) -> dict[str, list]:
        indices = []
        for index, payload in zip(batch["block_index"], batch["block"]):
            index = int(index)
            block = None
            try:
                block = pickle.loads(payload)
                table = self.measure(block, self.config)
            except SampleError as exc:  # a measure that raises instead of returning the parts
                table = ("sample_error", exc.message, exc.kind, exc.file, exc.line, exc.fix)
            except Exception as exc:
                reason = f"{type(exc).__name__}: {exc}"
                _write_text(_path(self.parts_dir, index, "error"), reason)
                raise RuntimeError(f"block {index} ({_describe(block)}): {reason}") from exc
            if isinstance(table, tuple):  # a bad sample under --strict: data, so never retried
                _write_text(_path(self.parts_dir, index, "sample_error"), json.dumps(list(table)))
                indices.append(index)
                continue
            tag = {"run_key": self.key, "block_key": block_key(block), "block_index": index}
            table = table.replace_schema_metadata({SHARD_KEY: json.dumps(tag, sort_keys=True).encode()})
            with atomic_path(_path(self.parts_dir, index, "parquet")) as tmp:
                # Non-compliant nested names keep `list<item>`, so the table reads back identical.
                pq.write_table(table, tmp, compression="zstd", use_compliant_nested_type=False)
            for stale in ("error", "sample_error"):
                _path(self.parts_dir, index, stale).unlink(missing_ok=True)
            indices.append(index)
        return {"block_index": indices}


def _write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def _describe(block: Any) -> str:
    """A short description of a block for error messages: file, first line/row, record count."""
    if block is None or getattr(block, "path", None) is None:
        return repr(block)[:120]
    parts = [str(block.path)]
    if getattr(block, "first_line", None) is not None:
        parts.append(f"from line/row {block.first_line}")
    if getattr(block, "num_records", None) is not None:
        parts.append(f"{block.num_records} records")
    return ", ".join(parts)


def _stream(ray, blocks, todo, config, parts_dir, key, measure, options) -> Iterator[list[int]]:
    """Run the Ray Data pipeline over the blocks ``todo``; yield finished block indices as they come."""
    import ray.data

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    # Let every other block finish when one keeps failing: its shard is simply missing.
    context.max_errored_blocks = -1
    retry_args: dict[str, Any] = {}
    if hasattr(context, "max_map_retries"):  # Ray >= 2.5x retries the function in place
        context.retried_map_errors, context.max_map_retries = True, options.block_retries
    else:
        retry_args = {"max_retries": options.block_retries, "retry_exceptions": True}
    # cloudpickle: block classes and measure functions defined in scripts travel too.
    items = [{"block_index": i, "block": ray.cloudpickle.dumps(blocks[i])} for i in todo]
    dataset = ray.data.from_items(items, override_num_blocks=len(items))
    measured = dataset.map_batches(_MeasureAndWrite(measure, config, str(parts_dir), key),
                                   batch_size=1, **retry_args)
    for batch in measured.iter_batches(batch_size=None, batch_format="pyarrow"):
        yield batch.column("block_index").to_pylist()


def _read_shard(path: Path) -> pa.Table:
    # Without the shard tag: exactly the table ``measure`` returned on the worker.
    return pq.read_table(path).replace_schema_metadata(None)


def run_blocks(blocks: Iterable[Any], config: Any, jobs: int | None = None, options: RayOptions | None = None, *,
               measure: Callable[[Any, Any], Any] | None = None) -> Iterator[tuple[Any, pa.Table]]:
    """Measure ``blocks`` on Ray; yield ``(block, table)`` in block order, like the local engine.

    The ``run_blocks`` of the engine contract of :mod:`balancer_cli.scan.engines`.

    Args:
        blocks: block descriptions in sample order (``iter_blocks``).
        config: the scan config, passed to ``measure`` (must pickle).
        jobs: CPUs of the local cluster when ``options`` does not say (ignored with an address).
        options: shards directory, cluster and retries.
        measure: ``measure(block, config)`` returning a table, or a bad sample's parts under
            ``--strict``; default :func:`~balancer_cli.scan.measure.measure_job`.

    Raises:
        UsageError: Ray is not installed.
        SampleError: with ``config.strict``, the first bad sample in sample order.
        InputError: blocks that failed after their retries (finished shards are kept: rerun to
            resume), or an unreachable cluster.
    """
    if options is None:
        options = RayOptions(num_cpus=jobs or None)
    if measure is None:
        from balancer_cli.scan.measure import measure_job as measure
    blocks = list(blocks)
    temporary = options.parts_dir is None
    parts_dir = Path(tempfile.mkdtemp(prefix="balancer-scan-")) if temporary else Path(options.parts_dir)
    key = run_key(config, blocks)
    reusable = _prepare_parts(parts_dir, key, [block_key(b) for b in blocks])
    finished = {i for i, ok in enumerate(reusable) if ok}
    todo = [i for i, ok in enumerate(reusable) if not ok]
    if finished and options.notify is not None:
        options.notify(f"resuming from {parts_dir}: {len(finished)} of {len(blocks)} blocks already measured")
    position = 0

    def ready() -> Iterator[tuple[Any, pa.Table]]:
        nonlocal position
        while position < len(blocks) and position in finished:
            strict_error = _path(parts_dir, position, "sample_error")
            if strict_error.is_file():
                from balancer_cli.scan.measure import unwrap_job

                unwrap_job(tuple(json.loads(strict_error.read_text())))  # raises the SampleError
            yield blocks[position], _read_shard(_path(parts_dir, position, "parquet"))
            position += 1

    yield from ready()
    if todo:
        with ray_session(options) as ray:
            for indices in _stream(ray, blocks, todo, config, parts_dir, key, measure, options):
                finished.update(indices)
                yield from ready()
    if position < len(blocks):
        missing = [i for i in range(len(blocks)) if i not in finished]
        shown = "; ".join(f"block {i} ({_describe(blocks[i])}): {_last_error(parts_dir, i)}" for i in missing[:3])
        more = f"; and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise InputError(
            f"{len(missing)} of {len(blocks)} blocks failed after {options.block_retries} retries: {shown}{more}",
            fix=("fix the cause and rerun" if temporary else
                 f"fix the cause and rerun the same command: the {len(blocks) - len(missing)} finished "
                 f"blocks are kept in {parts_dir} and are not measured again"))
    if temporary:
        shutil.rmtree(parts_dir, ignore_errors=True)


def remove_parts(options: RayOptions) -> None:
    """Delete the shards once the lengths table is safely written (unless ``keep_parts``)."""
    if options.parts_dir is not None and not options.keep_parts:
        remove_parts_dir(options.parts_dir)  # only a folder that carries balancer's marker


def _last_error(parts_dir: Path, index: int) -> str:
    try:
        return _path(parts_dir, index, "error").read_text()
    except OSError:
        return "its worker was lost"
