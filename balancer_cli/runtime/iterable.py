"""``ManifestIterableDataset``: a manifest's groups as a torch ``IterableDataset``, in manifest order.

For loaders and frameworks that take an ``IterableDataset`` and no batch sampler. It wraps a
map-style dataset (``__getitem__`` and ``__len__``) and a :class:`ManifestBatchSampler` and yields
this rank's groups in manifest order, each one item: the list of its samples, or the collated
batch when ``collate_fn`` is given (e.g. a :class:`~balancer_cli.runtime.collate.PackedCollator`).

**Use ``DataLoader(dataset, batch_size=None, ...)``**: each item already is a batch, and
``batch_size=None`` turns off the loader's own batching (with the default ``batch_size=1`` every
group would come wrapped in a list of one).

**Workers keep the order.** With ``num_workers=W`` every worker replays the whole index sequence
(cheap: indices only) and loads only its share: worker ``w`` loads groups ``w, w+W, w+2W, ...``
of this rank's sequence. The DataLoader hands out its requests to the workers round-robin
(``_worker_queue_idx_cycle``: request ``i`` to worker ``i mod W``) and, with ``in_order=True``
(the default), returns the results in request order, so request ``i`` is worker ``i mod W``'s
``(i div W)``-th group, which is group ``i``. At the end of the epoch the first worker to run out
answers a request past the last group, so no group is left behind. Each worker loads only its own
groups: the loading (the costly part) is split ``W`` ways.

**Epochs and resume** are the sampler's: call :meth:`set_epoch` every epoch (in the main process:
a fresh iteration copies the dataset into the workers), before iterating. ``persistent_workers=True``
would keep the first epoch's copies, so leave it off. With workers the copies in the workers
advance, not the one in the main process: take ``state_dict(step=s)`` at an optimizer-step
boundary (as with the batch sampler and a prefetching loader), or use torchdata's
``StatefulDataLoader``, which saves every worker's own state and resumes them exactly (the state
then also records which worker loads the next group). Without workers ``state_dict()`` is the
position after the last group yielded.

Example:
    A manifest for 2 ranks whose groups ``[2, 0], [1], [4], [3]`` fill the (step, rank) slots in
    turn, over a dataset of five letters:

    >>> import numpy as np, tempfile
    >>> from balancer_cli.manifest import ManifestRows, StepShape, write_manifest
    >>> step, rank, micro = StepShape(world_size=2, micro_batches=1).slots(np.array([0, 0, 1, 2, 3]))
    >>> out = write_manifest(tempfile.mkdtemp(), ManifestRows(step, rank, micro, np.array([2, 0, 1, 4, 3])),
    ...                      dropped_sample=np.array([], np.int64), dropped_reason=[],
    ...                      meta={"world_size": 2, "micro_batches": 1, "num_samples": 5, "seed": 0})
    >>> list(ManifestIterableDataset("abcde", out, rank=0, world_size=2))
    [['c', 'a'], ['e']]

    Replayed on one rank by two workers, each group joined into a word, in manifest order:

    >>> from torch.utils.data import DataLoader
    >>> words = ManifestIterableDataset("abcde", out, rank=0, world_size=1, collate_fn="".join)
    >>> list(DataLoader(words, batch_size=None, num_workers=2))
    ['ca', 'b', 'e', 'd']
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from balancer_cli.errors import ManifestError, UsageError
from balancer_cli.lengths import LengthsTable
from balancer_cli.runtime.sampler import ManifestBatchSampler

__all__ = ["ManifestIterableDataset"]

_SAMPLER_METHODS = ("__iter__", "__len__", "set_epoch", "state_dict", "load_state_dict")


class ManifestIterableDataset(IterableDataset):
    """Yield this rank's groups of a manifest, loaded from a map-style dataset, in manifest order.

    Args:
        dataset: a map-style dataset (``dataset[i]`` and ``len(dataset)``; ``__getitems__`` is used
            when it has one, as the DataLoader does).
        manifest: a ``balancer pack`` output directory (or its ``manifest.parquet``), or a sampler
            already built (a :class:`ManifestBatchSampler` or a ``ManifestReplay``).
        rank, world_size, epoch, lengths: as for :class:`ManifestBatchSampler` (only with a
            directory: a sampler already has them).
        collate_fn: applied to each group's list of samples in the worker that loads it; ``None``
            yields the list.
        sampler_kwargs: further keyword arguments of :class:`ManifestBatchSampler` (the rank
            sources of a model-parallel job, for instance), with a directory only.

    Raises:
        ManifestError: as :class:`ManifestBatchSampler`; also when ``len(dataset)`` is not the
            manifest's ``num_samples``.
        UsageError: ``rank``/``world_size``/``epoch``/``lengths`` (or other sampler arguments)
            given with a sampler, or a ``manifest`` that is neither a path nor a sampler.
    """

    def __init__(
        self,
        dataset: Any,
        manifest: str | os.PathLike | ManifestBatchSampler,
        rank: int | None = None,
        world_size: int | None = None,
        epoch: int = 0,
        *,
        lengths: str | os.PathLike | LengthsTable | None = None,
        collate_fn: Callable[[list], Any] | None = None,
        **sampler_kwargs: Any,
    ) -> None:
        super().__init__()
        if isinstance(manifest, (str, os.PathLike)):
            sampler = ManifestBatchSampler(manifest, rank, world_size, epoch, lengths=lengths, dataset=dataset,
                                           **sampler_kwargs)
        elif all(hasattr(manifest, name) for name in _SAMPLER_METHODS):
            given = [name for name, value in (("rank", rank), ("world_size", world_size), ("lengths", lengths))
                     if value is not None] + ["epoch"] * (epoch != 0) + sorted(sampler_kwargs)
            if given:
                raise UsageError(f"{', '.join(given)} given with a sampler, which has its own",
                                 fix="pass them to the sampler, or pass the manifest directory")
            sampler = manifest
            if hasattr(dataset, "__len__") and len(dataset) != sampler.num_samples:
                raise ManifestError(f"the dataset has {len(dataset)} samples, the sampler's manifest was packed for "
                                    f"{sampler.num_samples}",
                                    fix="pass the dataset the lengths table was scanned from (same files, same order)")
        else:
            raise UsageError(f"{{manifest}} is a {type(manifest).__name__}, neither a manifest directory nor a "
                             "sampler", fix="pass the `balancer pack` output directory or a ManifestBatchSampler")
        self._dataset, self._sampler, self._collate_fn = dataset, sampler, collate_fn
        # Groups taken since the iteration's origin; group p goes to worker p mod num_workers.
        self._phase = 0

    @property
    def sampler(self) -> ManifestBatchSampler:
        """The replay (``batches_per_step``, ``steps_per_epoch``, ``step_tokens``, ...)."""
        return self._sampler

    @property
    def dataset(self) -> Any:
        """The wrapped map-style dataset."""
        return self._dataset

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        return self._generate(workers, worker)

    def _generate(self, workers: int, worker: int) -> Iterator[Any]:
        for batch in self._sampler:
            mine = self._phase % workers == worker
            self._phase += 1  # before the yield: a state taken while suspended counts this group
            if mine:
                yield self._load(batch)
        self._phase = 0  # the next pass starts the epoch over

    def _load(self, batch: list[int]) -> Any:
        getitems = getattr(self._dataset, "__getitems__", None)
        samples = getitems(batch) if getitems is not None else [self._dataset[i] for i in batch]
        return samples if self._collate_fn is None else self._collate_fn(samples)

    def __len__(self) -> int:
        """Groups the next iteration yields over all workers (the sampler's length)."""
        return len(self._sampler)

    def set_epoch(self, epoch: int) -> None:
        """Replay epoch ``epoch`` (see :meth:`ManifestBatchSampler.set_epoch`); call it in the main process."""
        self._sampler.set_epoch(epoch)
        self._phase = 0

    def state_dict(self, step: int | None = None) -> dict:
        """Where to resume: ``{"sampler": the sampler's state, "phase": groups taken since the origin}``.

        Args:
            step: ``None`` for the position after the last group this copy yielded (exact without
                workers, and in each worker, where torchdata's ``StatefulDataLoader`` takes it);
                a replay step for a state at that step's first group (a plain DataLoader with
                workers: see the module docstring).
        """
        return {"sampler": self._sampler.state_dict(step), "phase": 0 if step is not None else self._phase}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume at the state's position (a state of this class, or a bare sampler state).

        In the main process the next iteration starts afresh, at worker 0. Inside a DataLoader
        worker (torchdata restores each worker's own state there) the phase is kept, so every
        worker goes on with its own share of the groups.
        """
        nested = "sampler" in state_dict
        self._sampler.load_state_dict(state_dict["sampler"] if nested else state_dict)
        self._phase = int(state_dict.get("phase", 0)) if nested and get_worker_info() is not None else 0
