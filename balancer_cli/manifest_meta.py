"""The metadata of a manifest, read and checked once when it is opened (:func:`balancer_cli.manifest.open_manifest`).

Every reader (the replay, the report, the planners, calibration) reads these fields as they are:
a commit record certifies the bytes, not what a tool that rewrote the file and its record put
there. A field of the wrong type or range was a crash far from its cause (``num_samples: "329"``:
a TypeError in the row reader; ``10**13``: a MemoryError; ``row_group_first_steps: [5]``: an
Arrow index error), a silent truncation (``micro_batches: 1.5``), or a usage error about a
command-line flag nobody passed (``seed: -1``). Here each is one :class:`ManifestError` naming
the file, the field and its value.

Example:
    >>> meta = {"schema_version": 2, "num_samples": 4, "num_steps": 2, "world_size": 2, "micro_batches": 1,
    ...         "row_group_first_steps": [0], "epoch_num_steps": [2], "seed": 0}
    >>> check_meta("m/manifest.parquet", meta, num_row_groups=1)
    >>> check_meta("m/manifest.parquet", {**meta, "micro_batches": 1.5}, num_row_groups=1)
    Traceback (most recent call last):
    ...
    balancer_cli.errors.ManifestError: m/manifest.parquet: metadata field 'micro_batches' is 1.5, not an integer in 1..2097151; fix: re-run `balancer pack` (the metadata was edited after it was written)
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from balancer_cli.errors import ManifestError

__all__ = ["KEY_COLUMNS", "MAX_SAMPLES", "METADATA_KEY", "READABLE_SCHEMA_VERSIONS", "check_meta", "read_meta"]

#: Schema versions this package reads (:data:`balancer_cli.manifest.SCHEMA_VERSION` writes the newest).
READABLE_SCHEMA_VERSIONS = (1, 2)
#: The Parquet schema metadata key holding the JSON metadata.
METADATA_KEY = b"balancer"
#: The integer columns every manifest has, in sort order.
KEY_COLUMNS = ("step", "rank", "micro", "sample")
_FOREIGN = "pass a folder `balancer pack` wrote, or re-run `balancer pack` into it"

#: The most samples a manifest may name (~1.1e12): far past any dataset, and past it the replay's
#: per-sample tables could not be allocated.
MAX_SAMPLES = 1 << 40
#: The most ranks or micro-batches a step may have (``StepShape.MOST``, ``--dp``'s own range).
_MAX_SHAPE = (1 << 21) - 1
_FIX = "re-run `balancer pack` (the metadata was edited after it was written)"


def read_meta(file: Any) -> tuple[pq.ParquetFile, dict[str, Any]]:
    """``(the opened Parquet file, its checked metadata)`` of a manifest file.

    Raises:
        ManifestError: unreadable Parquet or metadata, no key columns, an unknown schema version,
            or a field :func:`check_meta` refuses.
    """
    try:
        parquet = pq.ParquetFile(file)
        raw = (parquet.schema_arrow.metadata or {}).get(METADATA_KEY)
        meta = json.loads(raw) if raw else None
    except (OSError, pa.ArrowException, ValueError) as exc:  # ValueError: JSON, or bytes that are no UTF-8
        raise ManifestError(f"{file}: unreadable manifest ({' '.join(str(exc).split())})",
                            fix="re-run `balancer pack`") from None
    if not meta or not isinstance(meta, dict):
        raise ManifestError(f"{file}: no 'balancer' metadata; not a manifest written by balancer pack", fix=_FOREIGN)
    schema = parquet.schema_arrow
    odd = [n for n in KEY_COLUMNS if (i := schema.get_field_index(n)) < 0 or not pa.types.is_integer(schema.types[i])]
    if odd:
        raise ManifestError(f"{file}: no single integer column '{odd[0]}'; not a balancer pack manifest", fix=_FOREIGN)
    version = meta.get("schema_version")
    if version not in READABLE_SCHEMA_VERSIONS:
        raise ManifestError(f"{file}: manifest schema_version {version}, this balancer_cli reads "
                            f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))}",
                            fix="re-run `balancer pack` with this version")
    check_meta(file, meta, num_row_groups=parquet.num_row_groups)
    return parquet, meta


def check_meta(file: Any, meta: Mapping[str, Any], *, num_row_groups: int) -> None:
    """Raise :class:`ManifestError` unless the fields readers use hold what ``balancer pack`` writes.

    Args:
        file: the manifest file (named in the message).
        meta: its decoded ``balancer`` metadata.
        num_row_groups: the Parquet file's row groups (``row_group_first_steps`` indexes them).
    """
    def fail(name: str, value: Any, expected: str) -> ManifestError:
        held = "missing" if name not in meta and "." not in name else _shown(value)
        return ManifestError(f"{file}: metadata field '{name}' is {held}, not {expected}", fix=_FIX)

    def integer(name: str, low: int, high: int, value: Any = None) -> int:
        value = meta.get(name) if value is None else value
        if type(value) is not int or not low <= value <= high:  # a bool, float or str is an edit
            raise fail(name, value, f"an integer in {low}..{high}")
        return value

    for name, low, high in (("num_steps", 0, 1 << 40), ("world_size", 1, _MAX_SHAPE), ("micro_batches", 1, _MAX_SHAPE)):
        integer(name, low, high)
    num_steps = meta["num_steps"]
    for name, high in (("num_samples", MAX_SAMPLES), ("seed", (1 << 63) - 1)):  # (a reader needing one says so)
        if name in meta:
            integer(name, 0, high)
    epochs = meta.get("epoch_num_steps", [num_steps])
    if not isinstance(epochs, list) or not all(type(v) is int and v >= 0 for v in epochs) or sum(epochs) != num_steps:
        raise fail("epoch_num_steps", epochs, f"a list of step counts summing to num_steps {num_steps}")
    if "epochs" in meta and meta["epochs"] != len(epochs):
        raise fail("epochs", meta["epochs"], f"the {len(epochs)} epochs of epoch_num_steps")
    starts = meta.get("row_group_first_steps")
    if (not isinstance(starts, list) or len(starts) != num_row_groups or not all(type(v) is int for v in starts)
            or starts[:1] not in ([], [0]) or any(b < a for a, b in itertools.pairwise(starts))
            or (starts and starts[-1] >= max(num_steps, 1))):
        raise fail("row_group_first_steps", starts,
                   f"the first step of each of the file's {num_row_groups} row groups (0 first, ascending)")
    for name in ("algorithm",):
        if name in meta and not isinstance(meta[name], str):
            raise fail(name, meta[name], "a name")
    for name in ("lengths_files", "report_baselines"):
        if name in meta and not (isinstance(meta[name], list) and all(isinstance(v, str) for v in meta[name])):
            raise fail(name, meta[name], "a list of names")
    params = meta.get("params", {})
    if not isinstance(params, dict):
        raise fail("params", params, "an object")
    for name in ("caps", "bounds"):
        values = params.get(name, {})
        if not isinstance(values, dict) or not all(isinstance(k, str) and type(v) is int and v >= 1
                                                   for k, v in values.items()):
            raise fail(f"params.{name}", values, "an object of positive integers by module")


def _shown(value: Any) -> str:
    """A field's value as the message shows it: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
