"""The packers a manifest is compared with: random batching and LLM-only first-fit decreasing.

- :func:`pack_random`: shuffle, then cut into groups of a fixed batch size; no cap is looked at,
  so groups can exceed memory caps. Placed in order (a plain distributed data loader, the status
  quo) or by the balancing assigner, it gives the ``dataloader`` and ``random`` baselines.
- :func:`pack_llm_ffd`: first-fit decreasing on LLM tokens under the LLM cap only, as LLM
  trainers pack sequences; encoder items are ignored, so encoder load is left to chance.

OmniBal's ISF (:func:`balancer_cli.pack.packers.isf.pack_isf`) is the third baseline. The
registry (:mod:`balancer_cli.pack.packers.registry`) names them all; the report places their groups
with the same assigner and row ordering as the manifest itself, so every metric compares like
with like.

Example:
    >>> import numpy as np
    >>> p = pack_llm_ffd(np.array([[0, 60], [0, 50], [0, 40], [0, 30]]), np.array([9, 100]))
    >>> [g.tolist() for g in p.groups()]
    [[0, 2], [1, 3]]
"""

from __future__ import annotations

import math

import numpy as np

from balancer_cli._shuffle import permutation, shuffled
from balancer_cli._sort import int_order
from balancer_cli.errors import InputError
from balancer_cli.pack.packers._fill_kernels import first_fit_tree
from balancer_cli.pack.types import Packing

__all__ = ["pack_random", "pack_llm_ffd", "default_batch_size"]


def default_batch_size(load_NK: np.ndarray, caps_K: np.ndarray) -> int:
    """Samples per group that gives as many groups as perfectly full packing under the caps.

    Args:
        load_NK: (N, K) per-sample load.
        caps_K: (K,) caps per group.

    Returns:
        ``N / max_k ceil(sum load_k / cap_k)``, rounded, at least 1.

    Example:
        >>> import numpy as np
        >>> default_batch_size(np.array([[1, 100]] * 10), np.array([10, 250]))
        2
    """
    load_NK = np.asarray(load_NK)
    groups = max(1, max(math.ceil(load_NK[:, k].sum() / caps_K[k]) for k in range(load_NK.shape[1])))
    return max(1, round(len(load_NK) / groups))


def pack_random(num_samples: int, batch_size: int, *, seed: int = 0, sample_ids: np.ndarray | None = None) -> Packing:
    """Random batching: a seeded permutation cut into groups of ``batch_size`` (the last may be smaller).

    Args:
        num_samples: N, the samples to batch (rows of ``sample_ids``).
        batch_size: samples per group.
        seed: seeds the permutation.
        sample_ids: (N,) sample index of each row (default ``arange(num_samples)``).

    Returns:
        The :class:`~balancer_cli.pack.types.Packing` (nothing isolated or dropped).

    Example:
        >>> pack_random(5, 2, seed=0).group_sizes().tolist()
        [2, 2, 1]
    """
    ids = np.arange(num_samples, dtype=np.int64) if sample_ids is None else np.asarray(sample_ids, dtype=np.int64)
    order = shuffled(np.random.default_rng(seed), ids)
    offsets = np.append(np.arange(0, len(ids), batch_size, dtype=np.int64), len(ids))
    return Packing(order, offsets, np.zeros(len(offsets) - 1, bool), np.array([], np.int64), ())


def _first_fit(sizes: np.ndarray, cap: int) -> np.ndarray:
    """Bin index per item (items in the given order) under exact first fit (leftmost bin with room).

    First fit leaves at most one bin at most half full, so it opens fewer than ``2 * sum / cap + 1``
    bins: a max segment tree of remaining room that wide always has an unopened bin (and is far
    smaller than n leaves).
    """
    n = len(sizes)
    most_bins = min(n, 2 * int(np.sum(sizes, dtype=np.int64)) // max(cap, 1) + 2)
    width = 1
    while width < max(most_bins, 1):
        width *= 2
    return first_fit_tree(np.ascontiguousarray(sizes, dtype=np.int64), int(cap), width)


def pack_llm_ffd(load_NK: np.ndarray, caps_K: np.ndarray, *, seed: int = 0, oversize: str = "isolate",
                 sample_ids: np.ndarray | None = None) -> Packing:
    """First-fit decreasing on LLM tokens (the last column) under the LLM cap only.

    Ties are broken by a seeded shuffle, so epochs differ. Samples over the LLM cap on their own
    are isolated, dropped (reason ``oversize``) or rejected, as ``oversize`` says.

    Args:
        load_NK: (N, K) per-sample load; only the LLM tokens (last column) are packed.
        caps_K: (K,) caps; only the LLM cap (last) applies.
        seed: seeds the tie-breaking shuffle.
        oversize: ``isolate`` | ``drop`` | ``error`` for samples over the LLM cap.
        sample_ids: (N,) sample index of each row (default ``arange(N)``).

    Returns:
        The :class:`~balancer_cli.pack.types.Packing`: packed groups, then isolated samples.

    Raises:
        InputError: a sample over the LLM cap under ``oversize="error"``.

    Example:
        >>> import numpy as np
        >>> p = pack_llm_ffd(np.array([[0, 90], [0, 150], [0, 20]]), np.array([1, 100]), oversize="drop")
        >>> [g.tolist() for g in p.groups()], p.dropped.tolist()
        ([[0], [2]], [1])
    """
    load_NK = np.asarray(load_NK)
    ids = np.arange(len(load_NK), dtype=np.int64) if sample_ids is None else np.asarray(sample_ids, dtype=np.int64)
    tokens = load_NK[:, -1].astype(np.int64)
    cap = int(caps_K[-1])
    drawn = permutation(np.random.default_rng(seed), len(tokens))
    key = tokens[drawn]
    order = drawn[int_order(key.max() - key)] if len(key) else drawn  # argsort(-key, stable)
    over = tokens[order] > cap
    if over.any() and oversize == "error":
        i = int(order[np.argmax(over)])
        raise InputError(f"sample {int(ids[i])} has {int(tokens[i])} LLM tokens, over the cap {cap}",
                         fix="raise {caps[llm]} or use {oversize} isolate|drop")
    fit = order[~over]
    bins = _first_fit(tokens[fit], cap)
    by_bin = int_order(bins)
    counts = np.bincount(bins, minlength=int(bins.max()) + 1 if len(bins) else 0)
    sizes = [counts[counts > 0].astype(np.int64)]
    members = [ids[fit[by_bin]]]
    isolated = [np.zeros(len(sizes[0]), bool)]
    dropped, reasons = np.array([], np.int64), ()
    if oversize == "isolate":
        members.append(ids[order[over]])
        sizes.append(np.ones(int(over.sum()), np.int64))
        isolated.append(np.ones(int(over.sum()), bool))
    else:
        dropped = ids[order[over]]
        reasons = ("oversize",) * len(dropped)
    offsets = np.concatenate([[0], np.cumsum(np.concatenate(sizes))]).astype(np.int64)
    return Packing(np.concatenate(members).astype(np.int64), offsets, np.concatenate(isolated), dropped, reasons)

