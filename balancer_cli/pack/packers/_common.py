"""Input validation and the oversize policy shared by every packer.

A sample whose load exceeds a cap in some module cannot share a group. The policy says what
happens to it: ``isolate`` (its own group, ``isolated=True``), ``drop`` (listed with the reason
``oversize: <module> <value> > cap <cap>``) or ``error`` (an :class:`InputError` naming the
sample, the value, the cap and the fix).

Example:
    >>> import numpy as np
    >>> load = np.array([[1, 10], [5, 30]])
    >>> split = split_oversize(load, np.array([4, 100]), policy="drop", sample_ids=None)
    >>> split.fit.tolist(), split.dropped.tolist(), split.dropped_reason
    ([0], [1], ('oversize: module0 5 > cap 4',))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from balancer_cli.errors import InputError, UsageError
from balancer_cli.pack.types import OVERSIZE_POLICIES, Packing

__all__ = ["OversizeSplit", "check_inputs", "over_caps", "split_oversize", "module_label", "assemble"]



def module_label(k: int, num_modules: int, module_names: Sequence[str] | None) -> str:
    """Human name of column k: the given name, else ``module<k>`` (the last column is ``llm``).

    Example:
        >>> module_label(0, 2, None), module_label(1, 2, None), module_label(0, 2, ("vision", "llm"))
        ('module0', 'llm', 'vision')
    """
    if module_names is not None and k < len(module_names):
        return str(module_names[k])
    return "llm" if k == num_modules - 1 else f"module{k}"


def check_inputs(load_NK: np.ndarray, caps_K: np.ndarray, sample_ids: np.ndarray | None,
                 oversize: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate a packer's inputs (shapes, whole non-negative loads, caps >= 1, the policy).

    Args:
        load_NK: (N, K) per-sample load, the LLM last.
        caps_K: (K,) caps per group.
        sample_ids: (N,) sample index of each row, or None for ``arange(N)``.
        oversize: one of :data:`OVERSIZE_POLICIES`.

    Returns:
        (load int64 (N, K), caps int64 (K,), sample ids int64 (N,)).

    Raises:
        InputError: an empty or malformed load table.
        UsageError: caps, policy or ids that do not match the loads.

    Example:
        >>> load, caps, ids = check_inputs([[1, 10], [2, 20]], [4, 100], None, "isolate")
        >>> load.dtype.name, caps.tolist(), ids.tolist()
        ('int64', [4, 100], [0, 1])
    """
    load = np.asarray(load_NK)
    if load.ndim != 2:
        raise InputError(f"loads must be a 2-D (samples x modules) array, got shape {load.shape}",
                         fix="pass one column per module, the LLM last")
    if load.shape[0] == 0:
        raise InputError("no samples to pack (the lengths table is empty or every sample has an error)",
                         fix="check the lengths table with `balancer scan` and its error column")
    if load.shape[1] == 0:
        raise InputError("loads have no module column", fix="pass at least the LLM tokens column")
    if not np.issubdtype(load.dtype, np.integer):
        if not np.all(np.isfinite(load)) or np.any(load != np.round(load)):
            raise InputError("loads must be whole numbers (items or tokens)", fix="pass integer counts")
    load = np.asarray(load, dtype=np.int64)  # no copy when already int64
    if (load < 0).any():
        i = int(np.argwhere(load < 0)[0][0])
        raise InputError(f"sample row {i} has a negative load {load[i].tolist()}", fix="re-run `balancer scan`")
    caps = np.asarray(caps_K, dtype=np.float64).reshape(-1)
    if len(caps) != load.shape[1]:
        raise UsageError(f"{len(caps)} caps given for {load.shape[1]} modules", fix="give one cap per module")
    if not np.all(caps >= 1) or not np.all(np.isfinite(caps)):
        raise UsageError(f"caps must be positive whole numbers, got {caps.tolist()}", fix="raise the caps to >= 1")
    if oversize not in OVERSIZE_POLICIES:
        raise UsageError(f"unknown {{oversize}} policy {oversize!r}", fix=f"use one of: {', '.join(OVERSIZE_POLICIES)}")
    if sample_ids is None:
        ids = np.arange(load.shape[0], dtype=np.int64)
    else:
        ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
        if len(ids) != load.shape[0]:
            raise UsageError(f"{len(ids)} sample ids for {load.shape[0]} rows", fix="pass one id per row")
    return load, caps.astype(np.int64), ids


@dataclass(frozen=True)
class OversizeSplit:
    """Rows that fit the caps and what the policy did with the others.

    Attributes:
        fit: (F,) row indices that fit every cap.
        isolated: (I,) row indices that get a group of their own.
        dropped: (D,) row indices dropped; ``dropped_reason`` says why.
    """

    fit: np.ndarray
    isolated: np.ndarray
    dropped: np.ndarray
    dropped_reason: tuple[str, ...]


def over_caps(load_NK: np.ndarray, caps_K: np.ndarray) -> np.ndarray:
    """(N,) bool: rows whose load exceeds at least one cap.

    Column by column: numpy reduces across a row of K = 2-4 entries ~10x slower than it compares
    columns.

    Example:
        >>> over_caps(np.array([[1, 10], [5, 30], [2, 200]]), np.array([4, 100])).tolist()
        [False, True, True]
    """
    return np.logical_or.reduce([load_NK[:, k] > caps_K[k] for k in range(load_NK.shape[1])])


def split_oversize(load_NK: np.ndarray, caps_K: np.ndarray, *, policy: str, sample_ids: np.ndarray | None,
                   module_names: Sequence[str] | None = None) -> OversizeSplit:
    """Apply the oversize policy (see the module docstring).

    Args:
        load_NK: (N, K) int64 per-sample load.
        caps_K: (K,) int64 caps.
        policy: ``isolate`` | ``drop`` | ``error``.
        sample_ids: (N,) sample index of each row (named in the error), or None for ``arange(N)``.
        module_names: names used in drop reasons and errors (default ``module<k>``, ``llm``).

    Returns:
        The :class:`OversizeSplit` of the rows.

    Raises:
        InputError: under ``policy="error"``, naming the first oversize sample, its load and the cap.

    Example:
        >>> import numpy as np
        >>> split_oversize(np.array([[1, 10], [5, 30]]), np.array([4, 100]), policy="isolate", sample_ids=None).isolated
        array([1])
    """
    over_N = over_caps(load_NK, caps_K)
    fit = np.flatnonzero(~over_N)
    rows = np.flatnonzero(over_N)
    if len(rows) == 0 or policy == "isolate":
        return OversizeSplit(fit, rows, np.zeros(0, np.int64), ())
    ids = np.arange(len(load_NK)) if sample_ids is None else np.asarray(sample_ids)
    K = load_NK.shape[1]
    first_k = (load_NK[rows] > caps_K[None, :]).argmax(axis=1)
    reasons = tuple(
        f"oversize: {module_label(k, K, module_names)} {int(load_NK[r, k])} > cap {int(caps_K[k])}"
        for r, k in zip(rows.tolist(), first_k.tolist())
    )
    if policy == "error":
        r, k = int(rows[0]), int(first_k[0])
        module = module_label(k, K, module_names)
        # {caps[vision]}: the CLI spells it as the module's own cap flag (--max-vision-items).
        raise InputError(
            f"sample {int(ids[r])} has {module} load {int(load_NK[r, k])} > cap {int(caps_K[k])} "
            f"({len(rows)} sample(s) exceed a cap)",
            fix=f"raise the cap ({{caps[{module}]}}), or pass {{oversize}} isolate (own group) or {{oversize}} drop",
        )
    return OversizeSplit(fit, np.zeros(0, np.int64), rows, reasons)


def assemble(group_rows: list[np.ndarray] | tuple[np.ndarray, np.ndarray], split: OversizeSplit,
             sample_ids: np.ndarray) -> Packing:
    """Build a :class:`Packing` from packed rows plus isolated and dropped rows.

    Args:
        group_rows: ``(order_rows, offsets)`` of the packed groups, in row indices.
        split: the oversize split (isolated rows become one-sample groups at the end).
        sample_ids: (N,) row -> sample index.

    Returns:
        The packing, in sample ids: packed groups first, then one group per isolated row.

    Example:
        >>> import numpy as np
        >>> split = OversizeSplit(np.array([0, 1]), np.array([2]), np.zeros(0, np.int64), ())
        >>> p = assemble((np.array([1, 0]), np.array([0, 2])), split, np.array([10, 11, 12]))
        >>> [g.tolist() for g in p.groups()], p.isolated.tolist()
        ([[11, 10], [12]], [False, True])
    """
    order_rows, offsets = group_rows
    iso = split.isolated
    order = np.concatenate([np.asarray(order_rows, np.int64), iso.astype(np.int64)])
    offsets = np.concatenate([np.asarray(offsets, np.int64), offsets[-1] + np.arange(1, len(iso) + 1)])
    isolated = np.zeros(len(offsets) - 1, dtype=bool)
    isolated[len(isolated) - len(iso):] = True
    return Packing(
        order=sample_ids[order],
        group_offsets=offsets,
        isolated=isolated,
        dropped=sample_ids[split.dropped].astype(np.int64),
        dropped_reason=split.dropped_reason,
    )
