"""``ManifestReplay``: one rank's pass over a manifest's groups, with a resumable cursor (no torch).

Each rank yields its own groups as lists of sample indices, in manifest order (step, then micro),
``batches_per_step`` of them per optimizer step. :class:`~balancer_cli.runtime.ManifestBatchSampler`
is this replay as a PyTorch batch sampler; any other loader can iterate it directly.

- **Epochs.** ``set_epoch(e)`` replays epoch ``e`` of a manifest packed with ``E`` epochs. For
  ``e >= E`` it replays epoch ``e mod E`` with its steps in a new order: the permutation
  ``numpy.random.default_rng([seed, e]).permutation(steps of epoch e mod E)`` where ``seed`` is the
  manifest's ``seed`` (groups and their rank placement stay as packed, so balance is unchanged).
- **Resume.** ``state_dict()`` is a small JSON-able dict (:mod:`balancer_cli.replay.state`: the
  manifest, lengths table and caps it was saved with, world size, epoch, replay step, manifest
  position, batches already taken in the current step); ``load_state_dict()`` checks it and seeks
  to the row group of the next unconsumed step, never iterating the steps before it. It is the
  ``Stateful`` protocol of torchdata's ``StatefulDataLoader``
  (:mod:`balancer_cli.replay.loader_state` takes it out of a loader's state).
- **Elastic.** On a world size other than the manifest's, steps are re-planned by
  :mod:`balancer_cli.replay.elastic` (and the plans kept beside the manifest,
  :mod:`balancer_cli.replay.plan_cache`); a state saved anywhere at one world size loads at any
  other, and every sample of the epoch is yielded exactly once over the two runs.
- **Loss normalization.** ``step_tokens(step)`` gives the global LLM (and loss) token count of a
  step, identical on every rank (see ``docs/runtime.md``).

Example:
    >>> import numpy as np, tempfile
    >>> from balancer_cli.manifest import ManifestRows, write_manifest
    >>> out = tempfile.mkdtemp()
    >>> rows = ManifestRows(step=np.array([0, 0, 0, 1, 1]), rank=np.array([0, 0, 1, 0, 1]),
    ...                     micro=np.zeros(5, int), sample=np.array([2, 0, 1, 4, 3]))
    >>> _ = write_manifest(out, rows, dropped_sample=np.array([], np.int64), dropped_reason=[],
    ...                    meta={"world_size": 2, "micro_batches": 1, "num_samples": 5, "seed": 0})
    >>> list(ManifestReplay(out, rank=0, world_size=2)), list(ManifestReplay(out, rank=0, world_size=1))
    ([[2, 0], [4]], [[2, 0], [1], [4], [3]])
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from balancer_cli.errors import ManifestError, UsageError
from balancer_cli.lengths import LengthsTable, read_lengths
from balancer_cli.replay.elastic import ElasticReport, batches_per_rank
from balancer_cli.replay.epoch_plan import EpochPlan, EpochPlanner
from balancer_cli.replay.plan_cache import PLANS_DIR
from balancer_cli.replay.reader import ManifestReader
from balancer_cli.replay.samples import ReplaySamples, StepTokens
from balancer_cli.replay.state import (
    POSITION_KEYS,
    ReplayIdentity,
    make_state,
    read_state,
)

__all__ = ["ManifestReplay", "check_rank"]


def check_rank(rank: int, world_size: int, *, fix: str = "pass {rank} in 0..{world_size}-1") -> tuple[int, int]:
    """``(rank, world_size)`` as ints, once ``rank`` is in ``0..world_size-1``.

    Args:
        rank, world_size: the rank and the number of ranks.
        fix: the advice of the error (a caller that also reads them elsewhere says where).

    Raises:
        UsageError: either is no integer (a bool, float, str), ``world_size < 1``, ``rank`` not in ``0..world_size-1``.

    Example:
        >>> check_rank(1, 4)
        (1, 4)
        >>> check_rank(4, 4)
        Traceback (most recent call last):
        balancer_cli.errors.UsageError: rank 4 is not in 0..3 (world size 4); fix: pass rank in 0..world_size-1
    """
    for name, value in (("rank", rank), ("world_size", world_size)):  # (1.5 or "0" was truncated or compared)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise UsageError(f"{{{name}}} {value!r} is not an integer ({type(value).__name__})",
                             fix=f"pass {{{name}}} as an int")
    if world_size < 1 or not 0 <= rank < world_size:
        raise UsageError(f"{{rank}} {rank} is not in 0..{world_size - 1} (world size {world_size})", fix=fix)
    return int(rank), int(world_size)


class _Cursor:
    """Progress of one iteration: ``n`` batches yielded after skipping ``skip`` of unit 0."""

    __slots__ = ("plan", "state", "skip", "n", "synced", "cum")

    def __init__(self, plan: EpochPlan, state: dict, skip: int) -> None:
        self.plan, self.state, self.skip = plan, state, skip
        self.n = self.synced = 0
        self.cum: np.ndarray | None = None


class ManifestReplay:
    """Yield this rank's groups of a manifest as lists of sample indices.

    Args:
        manifest_dir: a ``balancer pack`` output directory (or its ``manifest.parquet``).
        rank, world_size: this process's data-parallel rank and the number of ranks.
        epoch: the epoch to replay first (see :meth:`set_epoch`).
        lengths: the lengths table (path or :class:`LengthsTable`) the manifest was packed from;
            checked against the manifest's fingerprint, used for :meth:`step_tokens` and to
            balance elastic replay by cost (else by group size).
        dataset: when given, ``len(dataset)`` must equal the manifest's ``num_samples``.
        logger: where the elastic replay report goes (INFO on rank 0, DEBUG elsewhere).
        plan_cache: where elastic plans are kept (:mod:`balancer_cli.replay.plan_cache`): ``True``
            for ``<manifest_dir>/elastic-plans`` (read when there; written by rank 0 when missing
            and the folder is writable), a folder to use instead, or ``False`` to plan every pass
            as it goes.

    Raises:
        ManifestError: unreadable or corrupt manifest, wrong schema version, or a dataset/lengths
            table that does not match it.
        UsageError: ``rank`` outside ``0..world_size-1``.

    Attributes:
        identity: what this replay's states record besides the position (the manifest, the
            lengths table and the caps, :class:`~balancer_cli.replay.state.ReplayIdentity`).

    Example (``out`` is a manifest packed for 2 ranks, as in the module example):
        >>> import numpy as np, tempfile
        >>> from balancer_cli.manifest import ManifestRows, write_manifest
        >>> out = tempfile.mkdtemp()
        >>> rows = ManifestRows(step=np.array([0, 0, 1, 1]), rank=np.array([0, 1, 0, 1]),
        ...                     micro=np.zeros(4, int), sample=np.array([2, 0, 1, 3]))
        >>> _ = write_manifest(out, rows, dropped_sample=np.array([], np.int64), dropped_reason=[],
        ...                    meta={"world_size": 2, "micro_batches": 1, "num_samples": 4, "seed": 0})
        >>> replay = ManifestReplay(out, rank=1, world_size=2)
        >>> it = iter(replay)
        >>> next(it), replay.state_dict()["step"]
        ([0], 1)
        >>> resumed = ManifestReplay(out, rank=1, world_size=2)
        >>> resumed.load_state_dict(replay.state_dict())
        >>> list(resumed)
        [[3]]
    """

    def __init__(
        self,
        manifest_dir: str | os.PathLike,
        rank: int,
        world_size: int,
        epoch: int = 0,
        *,
        lengths: str | os.PathLike | LengthsTable | None = None,
        dataset: Any = None,
        logger: logging.Logger | None = None,
        plan_cache: bool | str | os.PathLike = True,
    ) -> None:
        self._reader = reader = ManifestReader(manifest_dir)
        self.rank, self.world_size = check_rank(rank, world_size)
        self.manifest_world_size, self.micro_batches = reader.world_size, reader.micro_batches
        self.batches_per_step = batches_per_rank(reader.world_size, reader.micro_batches, self.world_size)
        self.num_samples = reader.num_samples
        self.fingerprint = reader.fingerprint
        if dataset is not None and len(dataset) != self.num_samples:
            raise ManifestError(f"{reader.manifest.path}: the dataset has {len(dataset)} samples, the manifest was "
                                f"packed for {self.num_samples}",
                                fix="pass the dataset the lengths table was scanned from (same files, same order)")
        samples = ReplaySamples()
        if lengths is not None:
            table = lengths if isinstance(lengths, LengthsTable) else read_lengths(lengths)
            samples = ReplaySamples.from_lengths(table, reader.manifest)
        self._samples = samples
        self.identity = ReplayIdentity(fingerprint=self.fingerprint, lengths=samples.fingerprint, caps=samples.caps)
        self._logger = logger or logging.getLogger(__name__)
        plan_dir = (Path(reader.manifest.path) / PLANS_DIR if plan_cache is True
                    else None if plan_cache is False else Path(plan_cache))
        self._planner = EpochPlanner(reader, samples, int(reader.manifest.meta.get("seed") or 0), plan_dir=plan_dir,
                                     build_plans=self.rank == 0, logger=self._logger)
        self._report: ElasticReport | None = None
        self._iter_plan: EpochPlan | None = None
        self._resumed = False
        self._cursor: _Cursor | None = None
        self.set_epoch(epoch)

    def __getstate__(self) -> dict:
        # A running iterator's progress is folded into the state; it does not travel itself.
        self._sync()
        return {k: v for k, v in self.__dict__.items() if k not in ("_iter_plan", "_cursor")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _iter_plan=None, _cursor=None)

    # ----------------------------------------------------------------------------- epochs
    @property
    def num_epochs_packed(self) -> int:
        """Epochs the manifest was packed with (``pack --epochs``)."""
        return self._planner.num_epochs_packed

    @property
    def _state(self) -> dict:
        """The cursor (epoch, step, position, batch_in_step, head), synced with a running iterator."""
        self._sync()
        return self._st

    @_state.setter
    def _state(self, state: dict) -> None:
        self._st, self._cursor = state, None  # a running iterator no longer moves the cursor

    @property
    def epoch(self) -> int:
        """The epoch being replayed."""
        return int(self._state["epoch"])

    def set_epoch(self, epoch: int) -> None:
        """Replay epoch ``epoch`` from its start (reshuffled step order beyond the packed epochs).

        Right after :meth:`load_state_dict`, setting the loaded epoch keeps the resume point, so
        the usual ``for epoch in ...: replay.set_epoch(epoch)`` loop resumes correctly.
        """
        if epoch < 0:
            raise UsageError(f"{{epoch}} {epoch} is negative")
        if self._resumed and epoch == self.epoch:
            return
        self._resumed = False
        self._state = {"epoch": int(epoch), "step": 0, "position": 0, "batch_in_step": 0, "head": None}
        self._iter_plan = None

    # ----------------------------------------------------------------------------- planning
    def _current_plan(self) -> EpochPlan:
        s = self._state
        plan = self._planner.plan(s["epoch"], s["position"], s["head"], self.world_size, s["step"])
        if not plan.native and self._report is None:
            self._report = self._planner.elastic_report(plan, self.world_size)
            # Every rank computes the same report; one copy in the log is enough.
            self._logger.log(logging.INFO if self.rank == 0 else logging.DEBUG, "elastic replay: %s",
                             self._report.describe())
        return plan

    @property
    def elastic_report(self) -> ElasticReport | None:
        """What elastic replay changes, measured on the first steps of the first pass (or resume)
        planned; ``None`` at the packed world size. Logged once, when first planned."""
        if self._report is None and self.world_size != self.manifest_world_size:
            self._current_plan()
        return self._report

    def _epoch_plan(self) -> EpochPlan:
        """The plan of the whole current epoch from its start."""
        return self._planner.plan(self.epoch, 0, None, self.world_size, 0)

    def _plan_holding(self, step: int) -> EpochPlan:
        """The plan of the current pass, or of the whole epoch for a step before the pass's start."""
        plan = self._iter_plan or self._current_plan()
        return self._epoch_plan() if step < plan.start_step else plan

    # ----------------------------------------------------------------------------- iteration
    def _at_end(self) -> bool:
        return len(self._current_plan().batches) == 0

    def __iter__(self) -> Iterator[list[int]]:
        if self._at_end() and not self._resumed:
            self.set_epoch(self.epoch)  # a finished epoch replays from its start
        self._iter_plan = plan = self._current_plan()
        cursor = self._cursor = _Cursor(plan, self._st, int(self._st["batch_in_step"]))
        return self._generate(plan, cursor)

    def _generate(self, plan: EpochPlan, cursor: _Cursor) -> Iterator[list[int]]:
        # Chunks come flat (samples, bounds) and each batch is sliced out as it is yielded, so
        # batches die young. The only other per-batch work is the count: state_dict() (called
        # while we are suspended) turns it into a position on demand (_sync).
        # The resume is used up by the pass that runs, not by iter(): torch's multi-worker
        # iterator calls iter() twice and drops the first iterator unstarted, and a state loaded
        # at the end of an epoch must still yield nothing more.
        self._resumed = False
        n = 0
        skip = cursor.skip
        for samples, bounds in self._planner.rank_chunks(plan, self.rank, self.world_size):
            if skip:  # the first chunk opens with the interrupted step
                bounds, skip = bounds[skip:], 0
            for a, b in zip(bounds, bounds[1:]):
                n += 1
                cursor.n = n
                yield samples[a:b]

    def _sync(self) -> None:
        """Bring the cursor state up to the batches the running iterator has yielded."""
        cursor = self._cursor
        if cursor is None or cursor.n == cursor.synced:
            return
        plan, done = cursor.plan, cursor.skip + cursor.n
        if cursor.cum is None:
            cursor.cum = np.cumsum(plan.batches)
        unit = int(np.searchsorted(cursor.cum, done, side="right"))  # units fully yielded
        in_unit = done - (int(cursor.cum[unit - 1]) if unit else 0)
        if unit:
            cursor.state.update(step=plan.start_step + unit, position=int(plan.bounds[unit]), head=None)
        cursor.state["batch_in_step"] = in_unit
        cursor.synced = cursor.n

    def __len__(self) -> int:
        """Batches the next ``iter()`` yields: the rest of the epoch after a resume, else all of it."""
        if self._at_end() and not self._resumed:
            return int(self._epoch_plan().batches.sum())
        return int(self._current_plan().batches.sum()) - int(self._state["batch_in_step"])

    @property
    def steps_per_epoch(self) -> int:
        """Replay steps of the current epoch from its start at this world size."""
        return len(self._epoch_plan().batches)

    @property
    def next_step(self) -> int:
        """Replay step of the next batch this replay yields (0 unless resumed or iterating)."""
        return int(self._state["step"])

    @property
    def next_micro(self) -> int:
        """Batches of :attr:`next_step` this rank already yielded."""
        return int(self._state["batch_in_step"])

    def batches_in_step(self, step: int) -> int:
        """This rank's batches at replay ``step``, the same on every rank: :attr:`batches_per_step`,
        except for the last step of an epoch too short to fill it in elastic replay (1 when fewer
        samples are left than ranks; the ranks past its last sample then get one empty batch)."""
        plan = self._plan_holding(step)
        unit = step - plan.start_step
        return int(plan.batches[unit]) if 0 <= unit < len(plan.batches) else 0

    # ----------------------------------------------------------------------------- resume
    def state_dict(self, step: int | None = None) -> dict:
        """Where to resume: a small JSON-able dict, the same on every rank (its fields and what a
        resume checks: :mod:`balancer_cli.replay.state`).

        Args:
            step: ``None`` for the replay's own position (the batch after the last one it
                yielded; what torchdata's ``StatefulDataLoader`` saves). With DataLoader workers
                the sampler runs ahead of training, so a plain training loop passes the replay
                ``step`` it is about to start instead (a state at that step's first batch).
        """
        cur = dict(self._state)
        if step is not None:
            plan = self._iter_plan or self._current_plan()
            unit = step - plan.start_step
            if not 0 <= unit <= len(plan.batches):
                raise UsageError(f"{{step}} {step} is not in the current pass over epoch {self.epoch} "
                                 f"(steps {plan.start_step}..{plan.start_step + len(plan.batches)})")
            cur.update(step=int(step), position=int(plan.bounds[unit]), batch_in_step=0,
                       head=plan.head_state if unit == 0 else None)
        return make_state(self.identity, self.world_size, cur)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume at the next unconsumed batch, seeking (also at another world size).

        Raises:
            ManifestError: the state is corrupt, of another manifest, or needs the lengths table
                and caps it was saved with and this replay has others (see
                :mod:`balancer_cli.replay.state`).
        """
        state = read_state(state_dict, self.identity, self.manifest_world_size)
        epoch = state["epoch"]
        if state["position"] > len(self._planner.epoch_order(epoch)):
            raise ManifestError(f"the sampler state is at position {state['position']}, past the "
                                f"{len(self._planner.epoch_order(epoch))} steps of epoch {epoch} of this manifest",
                                fix="resume with the manifest the checkpoint was trained on")
        state = self._roll_forward(state)
        if state["world_size"] != self.world_size and state["batch_in_step"] > 0:
            # The interrupted step's leftover groups (every rank's) become the head of the first
            # step here; the saved state itself describes them, so it nests as the head.
            saved = self._planner.plan(epoch, state["position"], state["head"], state["world_size"], state["step"])
            head = {k: state[k] for k in ("world_size", "step", "position", "batch_in_step", "head")}
            state.update(position=int(saved.bounds[1]), batch_in_step=0, head=head)
        self._state = {k: state[k] for k in POSITION_KEYS}
        self._iter_plan = None
        self._resumed = True

    def _roll_forward(self, state: dict) -> dict:
        """The same state with ``batch_in_step`` inside its step: a count past the step's batches
        (torchdata's batches since its last snapshot) moves on to the step that holds the next batch."""
        plan = self._planner.plan(state["epoch"], state["position"], state["head"], state["world_size"], state["step"])
        taken = state["batch_in_step"]
        if not len(plan.batches) or taken < int(plan.batches[0]):
            return state
        cum = np.cumsum(plan.batches)
        if taken > int(cum[-1]):
            raise ManifestError(f"the sampler state is {taken} batches into step {state['step']}, past the "
                                f"{int(cum[-1])} batches left in epoch {state['epoch']}", fix="resume from a state "
                                "that state_dict() (or sampler_state_from_loader) returned, unchanged")
        unit = int(np.searchsorted(cum, taken, side="right"))
        return dict(state, step=plan.start_step + unit, position=int(plan.bounds[unit]), head=None,
                    batch_in_step=taken - int(cum[unit - 1]))

    # ----------------------------------------------------------------------------- loss normalization
    def step_tokens(self, step: int) -> StepTokens:
        """Global token counts of replay step ``step`` of the current epoch (needs ``lengths=``)."""
        if self._samples.lengths is None:
            raise UsageError("step_tokens() needs the lengths table", fix="pass {lengths}=PATH to ManifestBatchSampler")
        plan = self._plan_holding(step)
        unit = step - plan.start_step
        if not 0 <= unit < len(plan.batches):
            raise IndexError(f"step {step} is outside this epoch's steps")
        samples = np.concatenate([np.empty(0, np.int64), *self._planner.unit_groups(plan, unit)])
        return self._samples.step_tokens(step, samples)
