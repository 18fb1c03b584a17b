"""``ManifestBatchSampler``: replay a manifest's balanced groups in any PyTorch training job.

Each rank yields its own groups as lists of sample indices, in manifest order (step, then micro),
``batches_per_step`` of them per optimizer step, so it plugs into
``DataLoader(dataset, batch_sampler=sampler, num_workers=...)``.

- **Epochs.** ``set_epoch(e)`` replays epoch ``e`` of a manifest packed with ``E`` epochs. For
  ``e >= E`` it replays epoch ``e mod E`` with its steps in a new order: the permutation
  ``numpy.random.default_rng([seed, e]).permutation(steps of epoch e mod E)`` where ``seed`` is the
  manifest's ``seed`` (groups and their rank placement stay as packed, so balance is unchanged).
- **Resume.** ``state_dict()`` is a small JSON-able dict (epoch, replay step, manifest position,
  batches already taken in the current step, world size, manifest fingerprint);
  ``load_state_dict()`` seeks to the row group of the next unconsumed step, never iterating the
  steps before it. It is the ``Stateful`` protocol of torchdata's ``StatefulDataLoader``.
- **Elastic.** On a world size other than the manifest's, steps are re-planned by
  :mod:`balancer_cli.replay.elastic`; a state saved at one world size loads at another.
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
    >>> list(ManifestBatchSampler(out, rank=0, world_size=2)), list(ManifestBatchSampler(out, rank=0, world_size=1))
    ([[2, 0], [4]], [[2, 0], [1], [4], [3]])
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from balancer_cli.cost.samples import sample_costs
from balancer_cli.errors import ManifestError, UsageError
from balancer_cli.lengths import LLM, LengthsTable, read_lengths
from balancer_cli.replay.elastic import ElasticReport, batches_per_rank, dist_ratio, form_runs, plan_step
from balancer_cli.runtime.ranks import resolve_rank
from balancer_cli.replay.reader import ManifestReader
from balancer_cli.replay.replan import plan_window, plan_window_rank

__all__ = ["ManifestBatchSampler", "StepTokens"]

logger = logging.getLogger("balancer_cli.runtime")

STATE_VERSION = 1
#: A reshuffled epoch is replayed in windows of about this many of a rank's samples: each row
#: group is read once per window, and a window's batches are held as lists.
_WINDOW_SAMPLES = 1 << 20
_ELASTIC_WINDOW = 256  # units planned at once in elastic replay


@dataclass(frozen=True)
class StepTokens:
    """Global token counts of one replay step (all ranks together).

    Attributes:
        step: the replay step within the epoch.
        num_samples: samples in the step.
        llm_tokens: summed ``llm_tokens`` of its samples.
        loss_tokens: summed ``loss_tokens`` (tokens that carry a loss), when the lengths table
            has that column; else ``None``.
    """

    step: int
    num_samples: int
    llm_tokens: int
    loss_tokens: int | None

    @property
    def normalizer(self) -> int:
        """What to divide the summed loss by: loss tokens when known, else LLM tokens."""
        return self.llm_tokens if self.loss_tokens is None else self.loss_tokens


@dataclass(frozen=True)
class _Plan:
    """The replay steps of an epoch from a cursor: unit u covers positions bounds[u]..bounds[u+1]."""

    start_step: int
    order: np.ndarray  # (S,) manifest steps of the epoch, in replay order
    bounds: np.ndarray  # (U+1,) positions into order
    batches: np.ndarray  # (U,) batches per rank of each unit
    head: list | None  # groups left over from an interrupted step; they open unit 0
    head_state: Mapping | None  # the saved state that describes ``head``
    native: bool  # units are single manifest steps replayed as packed


class _Cursor:
    """Progress of one iteration: ``n`` batches yielded after skipping ``skip`` of unit 0."""

    __slots__ = ("plan", "state", "skip", "n", "synced", "cum")

    def __init__(self, plan: _Plan, state: dict, skip: int) -> None:
        self.plan, self.state, self.skip = plan, state, skip
        self.n = self.synced = 0
        self.cum: np.ndarray | None = None


class ManifestBatchSampler(Sampler[list[int]]):
    """Yield this rank's groups of a manifest as lists of sample indices.

    Args:
        manifest_dir: a ``balancer pack`` output directory (or its ``manifest.parquet``).
        rank, world_size: this process's data-parallel rank and the number of ranks; default from
            ``RANK``/``WORLD_SIZE``, else ``torch.distributed``, else 0 and 1.
        epoch: the epoch to replay first (see :meth:`set_epoch`).
        lengths: the lengths table (path or :class:`LengthsTable`) the manifest was packed from;
            checked against the manifest's fingerprint, used for :meth:`step_tokens` and to
            balance elastic replay by cost (else by group size).
        dataset: when given, ``len(dataset)`` must equal the manifest's ``num_samples``.

    Raises:
        ManifestError: unreadable or corrupt manifest, wrong schema version, or a dataset/lengths
            table that does not match it.
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
    ) -> None:
        super().__init__()
        self._reader = ManifestReader(manifest_dir)
        reader, meta = self._reader, self._reader.manifest.meta
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.manifest_world_size, self.micro_batches = reader.world_size, reader.micro_batches
        self.batches_per_step = batches_per_rank(reader.world_size, reader.micro_batches, self.world_size)
        self.num_samples = reader.num_samples
        self.fingerprint = reader.fingerprint
        self._seed = int(meta.get("seed") or 0)
        epochs = self._reader.manifest.epoch_num_steps
        self._epoch_starts = np.concatenate([[0], np.cumsum(epochs)]).astype(np.int64)
        if dataset is not None and len(dataset) != self.num_samples:
            raise ManifestError(f"{reader.manifest.path}: the dataset has {len(dataset)} samples, the manifest was "
                                f"packed for {self.num_samples}",
                                fix="pass the dataset the lengths table was scanned from (same files, same order)")
        self._llm_tokens = self._loss_tokens = None
        self._sample_cost = np.broadcast_to(np.float64(1.0), (self.num_samples,))
        self._cost_Nm: np.ndarray | None = None  # (N, m) per-module cost for elastic balance
        self._load_Nk: np.ndarray | None = None  # (N, K) capped quantities, with the packer's (K,) caps
        self._caps_K: np.ndarray | None = None
        if lengths is not None:
            self._use_lengths(lengths if isinstance(lengths, LengthsTable) else read_lengths(lengths))
        self.elastic_report: ElasticReport | None = None
        self._plans: dict = {}
        self._iter_plan: _Plan | None = None
        self._resumed = False
        self._cursor: _Cursor | None = None
        self.set_epoch(epoch)
        if self.world_size != self.manifest_world_size:
            self._current_plan()  # plans (and logs) the elastic replay up front

    def __getstate__(self) -> dict:
        # Plans are caches; the unit-cost array is a broadcast view that would pickle at full size.
        self._sync()
        state = {k: v for k, v in self.__dict__.items() if k not in ("_plans", "_iter_plan", "_cursor")}
        if self._sample_cost.strides == (0,):
            state["_sample_cost"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _plans={}, _iter_plan=None, _cursor=None)
        if self._sample_cost is None:
            self._sample_cost = np.broadcast_to(np.float64(1.0), (self.num_samples,))

    def _use_lengths(self, lengths: LengthsTable) -> None:
        expected = self._reader.manifest.meta.get("lengths_fingerprint")
        where = self._reader.manifest.path
        if lengths.num_samples != self.num_samples:
            raise ManifestError(f"{where}: the lengths table has {lengths.num_samples} samples, the manifest "
                                f"{self.num_samples}", fix="pass the lengths table the manifest was packed from")
        if expected and expected != lengths.fingerprint:
            raise ManifestError(f"{where}: lengths fingerprint {lengths.fingerprint} differs from the manifest's "
                                f"{expected}", fix="pass the lengths table the manifest was packed from, or re-pack")
        self._llm_tokens = lengths.llm_tokens()
        if "loss_tokens" in lengths.table.column_names:
            self._loss_tokens = np.asarray(lengths.table.column("loss_tokens").fill_null(0).to_numpy(), dtype=np.int64)
        self._cost_Nm = np.stack(list(sample_costs(lengths).values()), axis=1).astype(np.float64)
        self._sample_cost = self._cost_Nm.sum(axis=1)
        self._use_caps(lengths)

    def _use_caps(self, lengths: LengthsTable) -> None:
        """The packer's caps (``meta["params"]["caps"]``: encoder items, LLM tokens per group) and
        the matching per-sample quantities, so elastic batches respect them too."""
        caps = ((self._reader.manifest.meta.get("params") or {}).get("caps")) or {}
        columns, limits = [], []
        for module, cap in caps.items():
            if module == LLM:
                columns.append(lengths.llm_tokens())
            elif module in lengths.modules:
                columns.append(lengths.items(module))
            else:  # a cap on a module this table lacks bounds nothing here
                continue
            limits.append(int(cap))
        if columns:
            self._load_Nk = np.stack(columns, axis=1).astype(np.int64)
            self._caps_K = np.asarray(limits, dtype=np.int64)

    # ----------------------------------------------------------------------------- epochs
    @property
    def num_epochs_packed(self) -> int:
        return len(self._epoch_starts) - 1

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
        return int(self._state["epoch"])

    def set_epoch(self, epoch: int) -> None:
        """Replay epoch ``epoch`` from its start (reshuffled step order beyond the packed epochs).

        Right after :meth:`load_state_dict`, setting the loaded epoch keeps the resume point, so
        the usual ``for epoch in ...: sampler.set_epoch(epoch)`` loop resumes correctly.
        """
        if epoch < 0:
            raise UsageError(f"epoch {epoch} is negative")
        if self._resumed and epoch == self.epoch:
            return
        self._resumed = False
        self._state = {"epoch": int(epoch), "step": 0, "position": 0, "batch_in_step": 0, "head": None}
        self._iter_plan = None

    def _epoch_order(self, epoch: int) -> np.ndarray:
        base = epoch % self.num_epochs_packed
        first, last = int(self._epoch_starts[base]), int(self._epoch_starts[base + 1])
        if epoch < self.num_epochs_packed:
            return np.arange(first, last, dtype=np.int64)
        return first + np.random.default_rng([self._seed, epoch]).permutation(last - first).astype(np.int64)

    # ----------------------------------------------------------------------------- planning
    def _plan_from(self, epoch: int, position: int, head_state: Mapping | None, world_size: int, start_step: int) -> _Plan:
        key = (epoch, position, json.dumps(head_state, sort_keys=True), world_size, start_step)
        if key in self._plans:
            return self._plans[key]
        order = self._epoch_order(epoch)
        head = self._remaining_groups(epoch, head_state) if head_state else None
        k = batches_per_rank(self.manifest_world_size, self.micro_batches, world_size)
        native = world_size == self.manifest_world_size and head is None
        if native:
            bounds = np.arange(position, len(order) + 1, dtype=np.int64)
            batches = np.full(len(bounds) - 1, k, dtype=np.int64)
        else:
            counts = self._reader.step_sample_counts()[order[position:]]
            head_n = sum(len(g) for g in head) if head else 0
            need = k * world_size
            if head and head_n >= need:
                bounds = np.concatenate([[0], form_runs(counts, need)])
            else:
                bounds = form_runs(counts, need, head_n)
            csum = np.concatenate([[0], np.cumsum(counts)])
            unit_n = csum[bounds[1:]] - csum[bounds[:-1]]
            if len(unit_n):
                unit_n[0] += head_n
            batches = np.minimum(k, unit_n // world_size)
            if (batches == 0).any():
                raise ManifestError(f"{self._reader.manifest.path}: only {int(unit_n.min())} samples remain in epoch "
                                    f"{epoch}, fewer than the {world_size} ranks replaying it",
                                    fix="replay on fewer ranks")
            bounds = bounds + position
        plan = _Plan(start_step, order, bounds, batches, head, head_state, native)
        if len(self._plans) > 8:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def _unit_groups(self, plan: _Plan, unit: int) -> list[np.ndarray]:
        groups = list(plan.head) if unit == 0 and plan.head else []
        for pos in range(int(plan.bounds[unit]), int(plan.bounds[unit + 1])):
            groups += self._reader.step_groups(int(plan.order[pos]))
        return groups

    def _plan_unit(self, plan: _Plan, unit: int, world_size: int) -> list[list[np.ndarray]]:
        """Every rank's batches of one unit (arrays)."""
        groups = self._unit_groups(plan, unit)
        if plan.native:
            M = self.micro_batches
            return [groups[r * M:(r + 1) * M] for r in range(world_size)]
        cost = self._sample_cost if self._cost_Nm is None else self._cost_Nm
        return plan_step(groups, cost, world_size, int(plan.batches[unit]), self._load_Nk, self._caps_K)

    def _unit_flat(self, plan: _Plan, unit: int) -> tuple[np.ndarray, np.ndarray]:
        """``(samples, group offsets)`` of one unit, all ranks, in manifest order."""
        parts = [(g, np.array([0, len(g)], dtype=np.int64)) for g in plan.head] if unit == 0 and plan.head else []
        parts += [self._reader.step_flat(int(plan.order[pos]))
                  for pos in range(int(plan.bounds[unit]), int(plan.bounds[unit + 1]))]
        if len(parts) == 1:
            return parts[0]
        base = np.cumsum([0] + [len(s) for s, _ in parts[:-1]])
        offsets = np.concatenate([[0]] + [o[1:] + b for (_, o), b in zip(parts, base.tolist())])
        return np.concatenate([s for s, _ in parts]), offsets.astype(np.int64)

    def _remaining_groups(self, epoch: int, state: Mapping) -> list[np.ndarray]:
        """Groups not yet yielded by any rank in the step a state was saved in (all ranks)."""
        plan = self._plan_from(epoch, int(state["position"]), state.get("head"), int(state["world_size"]),
                               int(state["step"]))
        taken = int(state["batch_in_step"])
        return [b for batches in self._plan_unit(plan, 0, int(state["world_size"])) for b in batches[taken:]]

    def _current_plan(self) -> _Plan:
        s = self._state
        plan = self._plan_from(s["epoch"], s["position"], s["head"], self.world_size, s["step"])
        if not plan.native and self.elastic_report is None:
            self._report(plan)
        return plan

    def _report(self, plan: _Plan) -> None:
        packed, replayed = [], []
        R, M = self.manifest_world_size, self.micro_batches
        cost = lambda g: float(self._sample_cost[g].sum())  # noqa: E731
        units = range(min(8, len(plan.batches)))
        flat = [self._unit_flat(plan, unit) for unit in units]
        planned = plan_window([s for s, _ in flat], [o for _, o in flat], self._cost_Nm, self.world_size, plan.batches[:len(units)],
                              self._load_Nk, self._caps_K)
        for unit in units:
            replayed.append(dist_ratio([sum(cost(b) for b in bs) for bs in planned[unit]]))
            for pos in range(int(plan.bounds[unit]), int(plan.bounds[unit + 1])):
                groups = self._reader.step_groups(int(plan.order[pos]))
                packed.append(dist_ratio([sum(cost(g) for g in groups[r * M:(r + 1) * M]) for r in range(R)]))
        G, G2 = R * M, self.batches_per_step * self.world_size
        self.elastic_report = ElasticReport(
            manifest_world_size=R, world_size=self.world_size, micro_batches=M,
            batches_per_rank=self.batches_per_step,
            steps_packed=int(plan.bounds[-1] - plan.bounds[0]), steps_replayed=len(plan.batches),
            splits_per_step=max(G2 - G, 0), merges_per_step=max(G - G2, 0),
            dist_ratio_packed=float(np.mean(packed)) if packed else 0.0,
            dist_ratio_replayed=float(np.mean(replayed)) if replayed else 0.0,
            resumed_mid_step=plan.head is not None)
        # Every rank computes the same report; one copy in the log is enough.
        logger.log(logging.INFO if self.rank == 0 else logging.DEBUG, "elastic replay: %s",
                   self.elastic_report.describe())

    # ----------------------------------------------------------------------------- iteration
    def _at_end(self) -> bool:
        return len(self._current_plan().batches) == 0

    def __iter__(self) -> Iterator[list[int]]:
        if self._at_end() and not self._resumed:
            self.set_epoch(self.epoch)  # a finished epoch replays from its start
        self._resumed = False  # a state loaded at the end of an epoch yields nothing more
        self._iter_plan = plan = self._current_plan()
        cursor = self._cursor = _Cursor(plan, self._st, int(self._st["batch_in_step"]))
        return self._generate(plan, cursor)

    def _generate(self, plan: _Plan, cursor: _Cursor) -> Iterator[list[int]]:
        # Chunks come flat (samples, bounds) and each batch is sliced out as it is yielded, so
        # batches die young. The only other per-batch work is the count: state_dict() (called
        # while we are suspended) turns it into a position on demand (_sync).
        n = 0
        chunks = self._native_chunks(plan) if plan.native else self._elastic_chunks(plan)
        skip = cursor.skip
        for samples, bounds in chunks:
            if skip:  # the first chunk opens with the interrupted step
                bounds, skip = bounds[skip:], 0
            for a, b in zip(bounds, bounds[1:]):
                n += 1
                cursor.n = n
                yield samples[a:b]

    def _native_chunks(self, plan: _Plan) -> Iterator[tuple[list[int], list[int]]]:
        """This rank's batches of the plan's steps as packed, a row group (or window) at a time."""
        lo, hi = int(plan.bounds[0]), int(plan.bounds[-1])
        order = plan.order[lo:hi]
        if not len(order):
            return
        first, last = int(order[0]), int(order[-1]) + 1
        if last - first == len(order) and (len(order) == 1 or bool((np.diff(order) == 1).all())):
            while first < last:  # a packed epoch: consecutive steps, whole row groups at a time
                samples, bounds, first = self._reader.rank_span(first, last, self.rank)
                yield samples, bounds
            return
        # A reshuffled epoch: windows of steps, each row group read once per window.
        rows_per_step = max(1, self._reader.manifest._file.metadata.num_rows // max(1, self._reader.num_steps))  # noqa: SLF001
        window = max(1, _WINDOW_SAMPLES * self.manifest_world_size // rows_per_step)
        for start in range(0, len(order), window):
            yield self._reader.rank_steps(order[start:start + window], self.rank)

    def _elastic_chunks(self, plan: _Plan) -> Iterator[tuple[list[int], list[int]]]:
        # Windows of units planned at once (vectorized over units); a unit's plan does not depend
        # on the window it is planned in, so every rank and every resume agree.
        for start in range(0, len(plan.batches), _ELASTIC_WINDOW):
            units = range(start, min(start + _ELASTIC_WINDOW, len(plan.batches)))
            flat = [self._unit_flat(plan, unit) for unit in units]
            yield plan_window_rank([s for s, _ in flat], [o for _, o in flat], self._cost_Nm, self.world_size,
                                   plan.batches[start:start + len(units)], self.rank, self._load_Nk, self._caps_K)

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
            return int(self._plan_from(self.epoch, 0, None, self.world_size, 0).batches.sum())
        return int(self._current_plan().batches.sum()) - int(self._state["batch_in_step"])

    @property
    def steps_per_epoch(self) -> int:
        """Replay steps of the current epoch from its start at this world size."""
        return len(self._plan_from(self.epoch, 0, None, self.world_size, 0).batches)

    # ----------------------------------------------------------------------------- resume
    def state_dict(self, step: int | None = None) -> dict:
        """Where to resume: a small JSON-able dict, the same on every rank.

        Args:
            step: ``None`` for the sampler's own position (the batch after the last one it
                yielded; what torchdata's ``StatefulDataLoader`` saves). With DataLoader workers
                the sampler runs ahead of training, so a plain training loop passes the replay
                ``step`` it is about to start instead (a state at that step's first batch).
        """
        cur = dict(self._state)
        if step is not None:
            plan = self._iter_plan or self._current_plan()
            unit = step - plan.start_step
            if not 0 <= unit <= len(plan.batches):
                raise UsageError(f"step {step} is not in the current pass over epoch {self.epoch} "
                                 f"(steps {plan.start_step}..{plan.start_step + len(plan.batches)})")
            cur.update(step=int(step), position=int(plan.bounds[unit]), batch_in_step=0,
                       head=plan.head_state if unit == 0 else None)
        return {"version": STATE_VERSION, "fingerprint": self.fingerprint, "world_size": self.world_size,
                **{k: cur[k] for k in ("epoch", "step", "position", "batch_in_step", "head")}}

    @property
    def next_step(self) -> int:
        """Replay step of the next batch this sampler yields (0 unless resumed or iterating)."""
        return int(self._state["step"])

    @property
    def next_micro(self) -> int:
        """Batches of :attr:`next_step` this rank already yielded."""
        return int(self._state["batch_in_step"])

    def batches_in_step(self, step: int) -> int:
        """This rank's batches at replay ``step``: :attr:`batches_per_step`, except for the last step
        of an epoch too short to fill it in elastic replay."""
        plan = self._iter_plan or self._current_plan()
        if step < plan.start_step:
            plan = self._plan_from(self.epoch, 0, None, self.world_size, 0)
        unit = step - plan.start_step
        return int(plan.batches[unit]) if 0 <= unit < len(plan.batches) else 0

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume at the next unconsumed batch, seeking (also at another world size)."""
        state = dict(state_dict)
        if state.get("version") != STATE_VERSION:
            raise ManifestError(f"sampler state version {state.get('version')}, this balancer_cli reads {STATE_VERSION}")
        if state.get("fingerprint") != self.fingerprint:
            raise ManifestError(f"the sampler state was saved for another manifest (fingerprint {state.get('fingerprint')}, "
                                f"{self._reader.manifest.path} has {self.fingerprint})",
                                fix="resume with the manifest the checkpoint was trained on")
        epoch, step, position, taken = (int(state[k]) for k in ("epoch", "step", "position", "batch_in_step"))
        head = state.get("head")
        if int(state["world_size"]) != self.world_size and taken > 0:
            # The interrupted step's leftover groups (every rank's) become the head of the first
            # step here; the saved state itself describes them, so it nests as the head.
            saved = self._plan_from(epoch, position, head, int(state["world_size"]), step)
            head = {k: state[k] for k in ("world_size", "step", "position", "batch_in_step", "head")}
            position, taken = int(saved.bounds[1]), 0
        self._state = {"epoch": epoch, "step": step, "position": position, "batch_in_step": taken, "head": head}
        self._iter_plan = None
        self._resumed = True

    # ----------------------------------------------------------------------------- loss normalization
    def step_tokens(self, step: int) -> StepTokens:
        """Global token counts of replay step ``step`` of the current epoch (needs ``lengths=``)."""
        if self._llm_tokens is None:
            raise UsageError("step_tokens() needs the lengths table", fix="pass lengths=PATH to ManifestBatchSampler")
        plan = self._iter_plan or self._current_plan()
        if step < plan.start_step:
            plan = self._plan_from(self.epoch, 0, None, self.world_size, 0)
        unit = step - plan.start_step
        if not 0 <= unit < len(plan.batches):
            raise IndexError(f"step {step} is outside this epoch's steps")
        samples = np.concatenate([np.empty(0, np.int64), *self._unit_groups(plan, unit)])
        loss = None if self._loss_tokens is None else int(self._loss_tokens[samples].sum())
        return StepTokens(step, len(samples), int(self._llm_tokens[samples].sum()), loss)
