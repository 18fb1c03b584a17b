"""The replay plan of an epoch: its steps in order, grouped into units, and each rank's batches.

An epoch's manifest steps are replayed in order (``set_epoch(e)`` for ``e`` beyond the packed
epochs replays epoch ``e mod E`` with its steps permuted by ``numpy.random.default_rng([seed, e])``).
At the packed world size every step is one **unit** replayed as packed. At another world size
(or after a resume that re-plans an interrupted step) steps too small for every rank are merged
into runs (:func:`~balancer_cli.replay.elastic.form_runs`) and each unit is re-planned by
:mod:`balancer_cli.replay.replan`, a pure function of the manifest, the world size and the
resume state, so every rank computes the same plan on its own.

Example:
    >>> import numpy as np, tempfile
    >>> from balancer_cli.manifest import ManifestRows, write_manifest
    >>> from balancer_cli.replay.reader import ManifestReader
    >>> from balancer_cli.replay.samples import ReplaySamples
    >>> out = tempfile.mkdtemp()
    >>> rows = ManifestRows(step=np.array([0, 0, 0, 1, 1]), rank=np.array([0, 0, 1, 0, 1]),
    ...                     micro=np.zeros(5, int), sample=np.array([2, 0, 1, 4, 3]))
    >>> _ = write_manifest(out, rows, dropped_sample=np.array([], np.int64), dropped_reason=[],
    ...                    meta={"world_size": 2, "micro_batches": 1, "num_samples": 5, "seed": 0})
    >>> planner = EpochPlanner(ManifestReader(out), ReplaySamples(), seed=0)
    >>> plan = planner.plan(epoch=0, position=0, head_state=None, world_size=1, start_step=0)
    >>> plan.batches.tolist(), list(planner.rank_chunks(plan, rank=0, world_size=1))
    ([2, 2], [([2, 0, 1, 4, 3], [0, 2, 3, 4, 5])])
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from balancer_cli.errors import ManifestError
from balancer_cli.metrics import dist_ratio_per_step
from balancer_cli.replay.elastic import (
    ElasticReport,
    batches_per_rank,
    form_runs,
    plan_step,
)
from balancer_cli.replay.reader import ManifestReader
from balancer_cli.replay.replan import plan_window, plan_window_rank
from balancer_cli.replay.samples import ReplaySamples

__all__ = ["EpochPlan", "EpochPlanner"]

#: A reshuffled epoch is replayed in windows of about this many of a rank's samples: each row
#: group is read once per window, and a window's batches are held as lists.
_WINDOW_SAMPLES = 1 << 20
_ELASTIC_WINDOW = 256  # units planned at once in elastic replay
_CACHED_PLANS = 8
_REPORTED_UNITS = 8  # units the elastic report measures


@dataclass(frozen=True)
class EpochPlan:
    """The replay steps of an epoch from a cursor: unit u covers positions ``bounds[u]..bounds[u+1]``.

    Attributes:
        start_step: the replay step of unit 0.
        order: (S,) manifest steps of the epoch, in replay order.
        bounds: (U+1,) positions into ``order``.
        batches: (U,) batches per rank of each unit.
        head: groups left over from an interrupted step (every rank's); they open unit 0.
        head_state: the saved state that describes ``head``.
        native: units are single manifest steps replayed as packed.
    """

    start_step: int
    order: np.ndarray
    bounds: np.ndarray
    batches: np.ndarray
    head: list | None
    head_state: Mapping | None
    native: bool


class EpochPlanner:
    """Plans a manifest's epochs at any world size, from any resume point (plans are cached).

    Args:
        reader: the manifest.
        samples: per-sample costs and caps (an empty :class:`ReplaySamples`: unit cost, no caps).
        seed: the manifest's seed (the step order of reshuffled epochs).
    """

    def __init__(self, reader: ManifestReader, samples: ReplaySamples, seed: int) -> None:
        self.reader, self.samples, self.seed = reader, samples, seed
        epochs = reader.manifest.epoch_num_steps
        self.epoch_starts = np.concatenate([[0], np.cumsum(epochs)]).astype(np.int64)
        self._plans: dict = {}

    def __getstate__(self) -> dict:
        # Plans are caches, rebuilt on demand.
        return {k: v for k, v in self.__dict__.items() if k != "_plans"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _plans={})

    @property
    def num_epochs_packed(self) -> int:
        return len(self.epoch_starts) - 1

    def epoch_order(self, epoch: int) -> np.ndarray:
        """(S,) manifest steps of ``epoch`` in replay order (a permutation beyond the packed epochs)."""
        base = epoch % self.num_epochs_packed
        first, last = int(self.epoch_starts[base]), int(self.epoch_starts[base + 1])
        if epoch < self.num_epochs_packed:
            return np.arange(first, last, dtype=np.int64)
        return first + np.random.default_rng([self.seed, epoch]).permutation(last - first).astype(np.int64)

    def plan(self, epoch: int, position: int, head_state: Mapping | None, world_size: int,
             start_step: int) -> EpochPlan:
        """The rest of ``epoch`` from manifest position ``position`` on ``world_size`` ranks.

        Args:
            epoch, position: the epoch, and the position in its step order to start at.
            head_state: the state saved mid-step at another world size, whose untaken groups
                open the plan (``None``: none).
            world_size: ranks replaying.
            start_step: the replay step of the first unit.

        Raises:
            ManifestError: fewer samples are left in the epoch than ranks.
        """
        key = (epoch, position, json.dumps(head_state, sort_keys=True), world_size, start_step)
        if key in self._plans:
            return self._plans[key]
        reader = self.reader
        order = self.epoch_order(epoch)
        head = self.remaining_groups(epoch, head_state) if head_state else None
        k = batches_per_rank(reader.world_size, reader.micro_batches, world_size)
        native = world_size == reader.world_size and head is None
        if native:
            bounds = np.arange(position, len(order) + 1, dtype=np.int64)
            batches = np.full(len(bounds) - 1, k, dtype=np.int64)
        else:
            counts = reader.step_sample_counts()[order[position:]]
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
                raise ManifestError(f"{reader.manifest.path}: only {int(unit_n.min())} samples remain in epoch "
                                    f"{epoch}, fewer than the {world_size} ranks replaying it",
                                    fix="replay on fewer ranks")
            bounds = bounds + position
        plan = EpochPlan(start_step, order, bounds, batches, head, head_state, native)
        if len(self._plans) > _CACHED_PLANS:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def unit_groups(self, plan: EpochPlan, unit: int) -> list[np.ndarray]:
        """Every group of one unit (all ranks), in manifest order."""
        groups = list(plan.head) if unit == 0 and plan.head else []
        for pos in range(int(plan.bounds[unit]), int(plan.bounds[unit + 1])):
            groups += self.reader.step_groups(int(plan.order[pos]))
        return groups

    def remaining_groups(self, epoch: int, state: Mapping) -> list[np.ndarray]:
        """Groups not yet yielded by any rank in the step a state was saved in (all ranks)."""
        world_size = int(state["world_size"])
        plan = self.plan(epoch, int(state["position"]), state.get("head"), world_size, int(state["step"]))
        taken = int(state["batch_in_step"])
        return [b for batches in self._unit_batches(plan, 0, world_size) for b in batches[taken:]]

    def rank_chunks(self, plan: EpochPlan, rank: int, world_size: int) -> Iterator[tuple[list[int], list[int]]]:
        """``rank``'s batches of the plan, a chunk at a time: ``(samples, bounds)``, batch ``i`` of a
        chunk at ``samples[bounds[i]:bounds[i + 1]]``."""
        return self._native_chunks(plan, rank) if plan.native else self._elastic_chunks(plan, rank, world_size)

    def elastic_report(self, plan: EpochPlan, world_size: int) -> ElasticReport:
        """What replaying ``plan`` on ``world_size`` ranks changes, measured on its first units."""
        R, M = self.reader.world_size, self.reader.micro_batches
        k = batches_per_rank(R, M, world_size)
        cost_NK = self.samples.cost_NK
        cost_N = np.broadcast_to(np.float64(1.0), (self.reader.num_samples,)) if cost_NK is None else cost_NK.sum(axis=1)
        cost = lambda g: float(cost_N[g].sum())  # noqa: E731
        units = range(min(_REPORTED_UNITS, len(plan.batches)))
        flat = [self._unit_flat(plan, unit) for unit in units]
        planned = plan_window([s for s, _ in flat], [o for _, o in flat], cost_NK, world_size,
                              plan.batches[:len(units)], self.samples.load_NK, self.samples.caps_K)
        packed, replayed = [], []
        for unit in units:
            replayed.append([sum(cost(b) for b in bs) for bs in planned[unit]])
            for pos in range(int(plan.bounds[unit]), int(plan.bounds[unit + 1])):
                groups = self.reader.step_groups(int(plan.order[pos]))
                packed.append([sum(cost(g) for g in groups[r * M:(r + 1) * M]) for r in range(R)])
        G, G2 = R * M, k * world_size
        return ElasticReport(
            manifest_world_size=R, world_size=world_size, micro_batches=M, batches_per_rank=k,
            steps_packed=int(plan.bounds[-1] - plan.bounds[0]), steps_replayed=len(plan.batches),
            splits_per_step=max(G2 - G, 0), merges_per_step=max(G - G2, 0),
            dist_ratio_packed=_mean_dist_ratio(packed), dist_ratio_replayed=_mean_dist_ratio(replayed),
            resumed_mid_step=plan.head is not None)

    # ----------------------------------------------------------------------------- units
    def _unit_batches(self, plan: EpochPlan, unit: int, world_size: int) -> list[list[np.ndarray]]:
        """Every rank's batches of one unit (arrays)."""
        groups = self.unit_groups(plan, unit)
        if plan.native:
            M = self.reader.micro_batches
            return [groups[r * M:(r + 1) * M] for r in range(world_size)]
        cost = self.samples.cost_NK
        if cost is None:
            cost = np.broadcast_to(np.float64(1.0), (self.reader.num_samples,))
        return plan_step(groups, cost, world_size, int(plan.batches[unit]), self.samples.load_NK, self.samples.caps_K)

    def _unit_flat(self, plan: EpochPlan, unit: int) -> tuple[np.ndarray, np.ndarray]:
        """``(samples, group offsets)`` of one unit, all ranks, in manifest order."""
        parts = [(g, np.array([0, len(g)], dtype=np.int64)) for g in plan.head] if unit == 0 and plan.head else []
        parts += [self.reader.step_flat(int(plan.order[pos]))
                  for pos in range(int(plan.bounds[unit]), int(plan.bounds[unit + 1]))]
        if len(parts) == 1:
            return parts[0]
        base = np.cumsum([0] + [len(s) for s, _ in parts[:-1]])
        offsets = np.concatenate([[0]] + [o[1:] + b for (_, o), b in zip(parts, base.tolist())])
        return np.concatenate([s for s, _ in parts]), offsets.astype(np.int64)

    def _native_chunks(self, plan: EpochPlan, rank: int) -> Iterator[tuple[list[int], list[int]]]:
        """``rank``'s batches of the plan's steps as packed, a row group (or window) at a time."""
        reader = self.reader
        lo, hi = int(plan.bounds[0]), int(plan.bounds[-1])
        order = plan.order[lo:hi]
        if not len(order):
            return
        first, last = int(order[0]), int(order[-1]) + 1
        if last - first == len(order) and (len(order) == 1 or bool((np.diff(order) == 1).all())):
            while first < last:  # a packed epoch: consecutive steps, whole row groups at a time
                samples, bounds, first = reader.rank_span(first, last, rank)
                yield samples, bounds
            return
        # A reshuffled epoch: windows of steps, each row group read once per window.
        rows_per_step = max(1, reader.manifest._file.metadata.num_rows // max(1, reader.num_steps))  # noqa: SLF001
        window = max(1, _WINDOW_SAMPLES * reader.world_size // rows_per_step)
        for start in range(0, len(order), window):
            yield reader.rank_steps(order[start:start + window], rank)

    def _elastic_chunks(self, plan: EpochPlan, rank: int, world_size: int) -> Iterator[tuple[list[int], list[int]]]:
        # Windows of units planned at once (vectorized over units); a unit's plan does not depend
        # on the window it is planned in, so every rank and every resume agree.
        samples = self.samples
        for start in range(0, len(plan.batches), _ELASTIC_WINDOW):
            units = range(start, min(start + _ELASTIC_WINDOW, len(plan.batches)))
            flat = [self._unit_flat(plan, unit) for unit in units]
            yield plan_window_rank([s for s, _ in flat], [o for _, o in flat], samples.cost_NK, world_size,
                                   plan.batches[start:start + len(units)], rank, samples.load_NK, samples.caps_K)


def _mean_dist_ratio(loads: list[list[float]]) -> float:
    """Mean Dist Ratio over steps of per-step, per-rank loads (0 for no steps)."""
    return float(np.mean(dist_ratio_per_step(np.array(loads)))) if loads else 0.0
