"""``ManifestBatchSampler``: replay a manifest's balanced groups in any PyTorch training job.

A PyTorch ``Sampler`` over :class:`~balancer_cli.replay.cursor.ManifestReplay`: it finds this
process's data-parallel rank and world size (:func:`~balancer_cli.runtime.ranks.resolve_rank`:
explicit, a process group, a ``DeviceMesh``, or the environment) and replays the manifest for
it, so it plugs into ``DataLoader(dataset, batch_sampler=sampler, num_workers=...)``.
Epochs, resume by seeking, elastic replay and ``step_tokens`` are the replay's (see
:mod:`balancer_cli.replay.cursor` and ``docs/runtime.md``); the elastic replay report is logged
under ``balancer_cli.runtime``.

Trainers that call ``set_epoch`` on ``loader.batch_sampler.sampler`` (Lightning, accelerate's
prepared loaders, Fabric) reach :meth:`ManifestBatchSampler.set_epoch` through
:attr:`ManifestBatchSampler.sampler`; a trainer that shards the batches again (accelerate's
``prepare``) makes iterating raise (:mod:`~balancer_cli.runtime.trainers`).

Example:
    >>> import numpy as np, tempfile
    >>> from balancer_cli.manifest import ManifestRows, write_manifest
    >>> out = tempfile.mkdtemp()
    >>> rows = ManifestRows(step=np.array([0, 0, 0, 1, 1]), rank=np.array([0, 0, 1, 0, 1]),
    ...                     micro=np.zeros(5, int), sample=np.array([2, 0, 1, 4, 3]))
    >>> _ = write_manifest(out, rows, dropped_sample=np.array([], np.int64), dropped_reason=[],
    ...                    meta={"world_size": 2, "micro_batches": 1, "num_samples": 5, "seed": 0})
    >>> list(ManifestBatchSampler(out, rank=0, world_size=2)), list(ManifestBatchSampler(out, rank=0, world_size=1))
    ([[2, 0], [4]], [[2, 0], [1], [4], [3]])
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch.utils.data import Sampler

from balancer_cli.lengths import LengthsTable
from balancer_cli.replay.cursor import ManifestReplay
from balancer_cli.replay.elastic import ElasticReport
from balancer_cli.replay.samples import StepTokens
from balancer_cli.runtime.ranks import resolve_rank
from balancer_cli.runtime.trainers import EpochForwarder, check_not_resharded

__all__ = ["ManifestBatchSampler"]

logger = logging.getLogger("balancer_cli.runtime")


class ManifestBatchSampler(Sampler[list[int]]):
    """Yield this rank's groups of a manifest as lists of sample indices.

    Args:
        manifest_dir: a ``balancer pack`` output directory (or its ``manifest.parquet``).
        rank, world_size: this process's data-parallel rank and the number of ranks; default from
            ``dp_group``/``mesh``, else ``RANK``/``WORLD_SIZE``, else ``torch.distributed``, else
            0 and 1 (see :func:`~balancer_cli.runtime.ranks.resolve_rank`).
        epoch: the epoch to replay first (see :meth:`set_epoch`).
        lengths: the lengths table (path or :class:`LengthsTable`) the manifest was packed from;
            checked against the manifest's fingerprint, used for :meth:`step_tokens` and to
            balance elastic replay by cost (else by group size).
        dataset: when given, ``len(dataset)`` must equal the manifest's ``num_samples``.
        dp_group: the data-parallel process group (under tensor/pipeline parallelism): rank and
            size are ``torch.distributed.get_rank(dp_group)`` and ``get_world_size(dp_group)``.
        mesh, mesh_dim: a ``DeviceMesh`` and its data-parallel dimension name(s) (default ``dp``
            or ``batch``, or the only one of a 1-D mesh).
        plan_cache: where elastic plans are kept (:mod:`balancer_cli.replay.plan_cache`): ``True``
            for ``<manifest_dir>/elastic-plans`` (read when there; written by rank 0 when missing
            and the folder is writable), a folder to use instead, or ``False`` to plan every pass
            as it goes (see :class:`~balancer_cli.replay.cursor.ManifestReplay`).

    Raises:
        ManifestError: unreadable or corrupt manifest, wrong schema version, or a dataset/lengths
            table that does not match it.
        UsageError: a rank outside ``0..world_size-1``, a rank source that contradicts another
            (see :func:`~balancer_cli.runtime.ranks.resolve_rank`); when iterated, a trainer that
            shards the batches again (accelerate's ``prepare``).

    Attributes:
        sampler: an :class:`~balancer_cli.runtime.trainers.EpochForwarder`, where trainers that set the epoch on
            ``loader.batch_sampler.sampler`` find :meth:`set_epoch`.
    """

    def __init__(
        self,
        manifest_dir: str | os.PathLike,
        rank: int | None = None,
        world_size: int | None = None,
        epoch: int = 0,
        *,
        lengths: str | os.PathLike | LengthsTable | None = None,
        dataset: Any = None,
        dp_group: Any = None,
        mesh: Any = None,
        mesh_dim: str | Sequence[str] | None = None,
        plan_cache: bool | str | os.PathLike = True,
    ) -> None:
        super().__init__()
        rank, world_size = resolve_rank(rank, world_size, dp_group=dp_group, mesh=mesh, mesh_dim=mesh_dim)
        self._replay = ManifestReplay(manifest_dir, rank, world_size, epoch, lengths=lengths, dataset=dataset,
                                      logger=logger, plan_cache=plan_cache)
        self.sampler = EpochForwarder(self)

    def __iter__(self) -> Iterator[list[int]]:
        check_not_resharded(self)
        return iter(self._replay)

    def __len__(self) -> int:
        """Batches the next ``iter()`` yields: the rest of the epoch after a resume, else all of it."""
        check_not_resharded(self)
        return len(self._replay)

    @property
    def rank(self) -> int:
        return self._replay.rank

    @property
    def world_size(self) -> int:
        return self._replay.world_size

    @property
    def manifest_world_size(self) -> int:
        """The world size the manifest was packed for."""
        return self._replay.manifest_world_size

    @property
    def micro_batches(self) -> int:
        """The manifest's micro-batches per rank per step."""
        return self._replay.micro_batches

    @property
    def batches_per_step(self) -> int:
        """Batches per rank per step at this world size (gradient accumulation steps)."""
        return self._replay.batches_per_step

    @property
    def num_samples(self) -> int:
        """Samples of the dataset the manifest was packed for."""
        return self._replay.num_samples

    @property
    def fingerprint(self) -> str:
        """The manifest's fingerprint (saved in states)."""
        return self._replay.fingerprint

    @property
    def elastic_report(self) -> ElasticReport | None:
        """What elastic replay changed (``None`` at the packed world size)."""
        return self._replay.elastic_report

    @property
    def num_epochs_packed(self) -> int:
        return self._replay.num_epochs_packed

    @property
    def epoch(self) -> int:
        return self._replay.epoch

    @property
    def steps_per_epoch(self) -> int:
        """Replay steps of the current epoch from its start at this world size."""
        return self._replay.steps_per_epoch

    @property
    def next_step(self) -> int:
        """Replay step of the next batch this sampler yields (0 unless resumed or iterating)."""
        return self._replay.next_step

    @property
    def next_micro(self) -> int:
        """Batches of :attr:`next_step` this rank already yielded."""
        return self._replay.next_micro

    def set_epoch(self, epoch: int) -> None:
        """Replay epoch ``epoch`` from its start (see :meth:`ManifestReplay.set_epoch`).

        Calling it again before iterating changes nothing (trainers call it once on the loader's
        batch sampler and once on :attr:`sampler`); right after :meth:`load_state_dict`, the
        loaded epoch keeps the resume point.
        """
        self._replay.set_epoch(epoch)

    def batches_in_step(self, step: int) -> int:
        """This rank's batches at replay ``step`` (see :meth:`ManifestReplay.batches_in_step`)."""
        return self._replay.batches_in_step(step)

    def state_dict(self, step: int | None = None) -> dict:
        """Where to resume: a small JSON-able dict, the same on every rank.

        Args:
            step: ``None`` for the sampler's own position (the batch after the last one it
                yielded; what torchdata's ``StatefulDataLoader`` saves). With DataLoader workers
                the sampler runs ahead of training, so a plain training loop passes the replay
                ``step`` it is about to start instead (a state at that step's first batch).
        """
        return self._replay.state_dict(step)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume at the next unconsumed batch, seeking (also at another world size)."""
        self._replay.load_state_dict(state_dict)

    def step_tokens(self, step: int) -> StepTokens:
        """Global token counts of replay step ``step`` of the current epoch (needs ``lengths=``)."""
        return self._replay.step_tokens(step)
