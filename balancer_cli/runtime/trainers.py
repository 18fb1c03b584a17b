"""Trainers that wrap a DataLoader: keep a ``ManifestBatchSampler``'s plan through them.

A ``ManifestBatchSampler`` already yields this rank's batches. Some trainers shard a loader's
batches over the processes a second time:

- **accelerate**: ``accelerator.prepare(loader)`` wraps the batch sampler in a
  ``BatchSamplerShard`` (each process takes every ``num_processes``-th batch: half of its own
  on 2 processes), or with ``dispatch_batches=True`` in a ``DataLoaderDispatcher`` (process 0
  iterates and splits its batches over all). :func:`prepare_manifest_loader` gives the loader
  what ``prepare`` gives it (device placement, the end-of-loader flag ``accumulate()`` uses,
  RNG sync) without either; :func:`check_not_resharded` (run by the sampler whenever it is
  iterated or measured) raises a ``UsageError`` on every process instead of halving silently.
- **Lightning** (``use_distributed_sampler=False``), accelerate's prepared loaders and Fabric
  call ``set_epoch`` on ``loader.batch_sampler.sampler``, not on the batch sampler:
  ``ManifestBatchSampler.sampler`` is an :class:`EpochForwarder`, which forwards it.

accelerate is imported only by :func:`prepare_manifest_loader`; the check reads the caller's
frames (no import).

Example:
    >>> from accelerate import Accelerator  # doctest: +SKIP
    >>> accelerator = Accelerator(gradient_accumulation_steps=sampler.batches_per_step)  # doctest: +SKIP
    >>> loader = prepare_manifest_loader(accelerator, DataLoader(dataset, batch_sampler=sampler))  # doctest: +SKIP
    >>> model, optimizer = accelerator.prepare(model, optimizer)  # doctest: +SKIP
"""

from __future__ import annotations

import sys
from typing import Any

from balancer_cli.errors import UsageError

__all__ = ["prepare_manifest_loader", "check_not_resharded", "EpochForwarder"]

#: How far up the stack the wrapper that iterates (or measures) the sampler may sit: a
#: ``BatchSamplerShard`` calls it directly; a ``DataLoaderDispatcher`` through the DataLoader's
#: iterator (up to 6 frames with workers).
_DEPTH = 10

_FIX = ("build the loader with balancer_cli.runtime.prepare_manifest_loader(accelerator, loader) instead of "
        "accelerator.prepare(loader): the sampler already yields this process's batches")


def check_not_resharded(sampler: Any, depth: int = _DEPTH) -> None:
    """Raise when accelerate's ``BatchSamplerShard`` or ``DataLoaderDispatcher`` over more than
    one process is consuming ``sampler`` (called from the sampler's ``__iter__`` and ``__len__``).

    Raises:
        UsageError: the sampler is being re-sharded; the message says how to prepare the loader.

    Example:
        >>> check_not_resharded(object())  # nothing re-shards here
    """
    try:
        frame = sys._getframe(2)  # the caller of the sampler's __iter__ or __len__
    except ValueError:  # called with no Python caller (from C at the top of a thread)
        return
    for _ in range(depth):
        if frame is None:
            return
        if frame.f_globals.get("__name__", "").startswith("accelerate."):
            _check_frame_owner(frame.f_locals.get("self"), sampler)
        frame = frame.f_back


def _check_frame_owner(owner: Any, sampler: Any) -> None:
    kind = type(owner).__name__  # type(), not __class__: accelerate's loaders pretend to be DataLoaders
    if kind == "BatchSamplerShard" and getattr(owner, "batch_sampler", None) is sampler:
        processes = int(getattr(owner, "num_processes", 1))
        if processes > 1:
            raise UsageError(f"accelerate wrapped the ManifestBatchSampler in a BatchSamplerShard over {processes} "
                             f"processes: each would keep 1 of every {processes} of its own batches (1/{processes} "
                             f"of the manifest, the plan's balance lost)", fix=_FIX)
    elif kind == "DataLoaderDispatcher":
        base = getattr(owner, "base_dataloader", None)
        processes = int(getattr(getattr(owner, "state", None), "num_processes", 1))
        if getattr(base, "batch_sampler", None) is sampler and processes > 1:
            raise UsageError(f"accelerate's dispatch_batches=True iterates the ManifestBatchSampler on process 0 "
                             f"and splits its batches over all {processes} processes (every process would train "
                             f"on slices of process 0's batches)", fix=_FIX + " (or set dispatch_batches=False)")


def prepare_manifest_loader(accelerator: Any, loader: Any) -> Any:
    """``accelerator.prepare(loader)`` for a loader over a ``ManifestBatchSampler``, without re-sharding.

    The result is accelerate's own prepared loader (a ``DataLoaderShard``) built for one
    process: batches are moved to ``accelerator.device`` (when ``device_placement``), the
    end-of-loader flag that ``accelerator.accumulate()`` reads is kept, RNGs are synced as
    ``prepare`` syncs them, and a torchdata ``StatefulDataLoader`` stays one. It is registered
    with the accelerator and marked prepared, so passing it to ``accelerator.prepare()`` again
    returns it unchanged. Each pass over it calls the sampler's ``set_epoch`` with the loader's
    own epoch counter: call ``loader.set_epoch(epoch)`` (not only the sampler's) at every epoch.

    Args:
        accelerator: an ``accelerate.Accelerator``.
        loader: a ``DataLoader`` (or ``StatefulDataLoader``) whose ``batch_sampler`` is a
            :class:`~balancer_cli.runtime.sampler.ManifestBatchSampler`.

    Raises:
        UsageError: the loader's batch sampler is not a ``ManifestBatchSampler``.

    Example:
        >>> loader = prepare_manifest_loader(accelerator, DataLoader(dataset, batch_sampler=sampler))  # doctest: +SKIP
    """
    from accelerate.data_loader import prepare_data_loader

    batch_sampler = getattr(loader, "batch_sampler", None)
    # A ManifestBatchSampler is known by its forwarder (importing the sampler here would be an
    # import circle: the sampler imports this module).
    forwarder = getattr(batch_sampler, "sampler", None)
    if not (isinstance(forwarder, EpochForwarder) and forwarder._batch_sampler is batch_sampler):
        raise UsageError(f"prepare_manifest_loader() needs a DataLoader whose batch_sampler is a ManifestBatchSampler, "
                         f"not {type(batch_sampler).__name__}",
                         fix="build it as DataLoader(dataset, batch_sampler=ManifestBatchSampler(...))")
    options = {}
    if hasattr(accelerator, "non_blocking"):  # accelerate >= 0.28
        options["non_blocking"] = accelerator.non_blocking
    stateful = type(loader).__name__ == "StatefulDataLoader"
    if stateful or getattr(accelerator, "use_stateful_dataloader", False):
        options["use_stateful_dataloader"] = True
    # One process: accelerate keeps the batch sampler as it is (no BatchSamplerShard, no dispatcher).
    prepared = prepare_data_loader(loader, accelerator.device, num_processes=1, process_index=0, split_batches=False,
                                   put_on_device=accelerator.device_placement, rng_types=list(accelerator.rng_types),
                                   dispatch_batches=False, **options)
    prepared._is_accelerate_prepared = True
    return accelerator.prepare_data_loader(prepared)


class EpochForwarder:
    """``ManifestBatchSampler.sampler``: forwards ``set_epoch`` to the batch sampler.

    Lightning (``use_distributed_sampler=False``), accelerate's prepared loaders and Fabric set
    the epoch on ``loader.sampler`` and ``loader.batch_sampler.sampler``, never on the batch
    sampler itself; without this, every epoch after the first would replay the first.

    Example:
        >>> class Batches:
        ...     epoch = 0
        ...     def set_epoch(self, epoch): self.epoch = epoch
        >>> batches = Batches()
        >>> EpochForwarder(batches).set_epoch(3)
        >>> batches.epoch
        3
    """

    def __init__(self, batch_sampler: Any) -> None:
        # Private: code that finds a ``batch_sampler`` attribute takes its owner for a loader.
        self._batch_sampler = batch_sampler

    @property
    def epoch(self) -> int:
        return self._batch_sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self._batch_sampler.set_epoch(epoch)
