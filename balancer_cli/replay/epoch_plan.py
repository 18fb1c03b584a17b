"""The replay plan of an epoch: its steps in order, grouped into units, and each rank's batches.

An epoch's manifest steps are replayed in order (``set_epoch(e)`` for ``e`` beyond the packed
epochs replays epoch ``e mod E`` with its steps permuted by ``numpy.random.default_rng([seed, e])``).
At the packed world size every step is one **unit** replayed as packed (after a resume from
another world size, the interrupted step's rest is re-planned first, merged with the next step
when too small for every rank). At another world size steps too small for every rank are merged
into runs (:func:`~balancer_cli.replay.elastic.form_runs`) and each unit is re-planned by
:mod:`balancer_cli.replay.replan`, a pure function of the manifest, the world size and the
resume state, so every rank computes the same plan on its own. Every rank has the same number of
batches in every unit; only a unit of fewer samples than ranks (what is left of an epoch resumed
on more ranks) has one batch per rank, empty on the ranks past its last sample.

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
    ([2, 2], [([2, 0, 1], [0, 2, 3]), ([4, 3], [0, 1, 2])])
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from balancer_cli.manifest import MANIFEST_FILE
from balancer_cli.metrics import dist_ratio_per_step
from balancer_cli.replay.elastic import ElasticReport, batches_per_rank, form_runs
from balancer_cli.replay.plan_cache import (
    PlanCache,
    PlanFileInvalid,
    plan_cache_path,
    write_plan_cache,
)
from balancer_cli.replay.reader import ManifestReader
from balancer_cli.replay.replan import UnitWindow, WindowPlan, plan_units
from balancer_cli.replay.samples import ReplaySamples

__all__ = ["EpochPlan", "EpochPlanner"]

#: A reshuffled epoch is replayed in windows of about this many of a rank's samples: each row
#: group is read once per window, and a window's batches are held as lists.
_WINDOW_SAMPLES = 1 << 20
_ELASTIC_WINDOW = 256  # units planned at once in elastic replay (a pass opens with 1, 2, 4, ... units)
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
        native_from: the units from this one on are single manifest steps replayed as packed
            (0 at the packed world size; 1 there after a resume that re-plans an interrupted
            step of another world size; ``U`` at another world size).
    """

    start_step: int
    order: np.ndarray
    bounds: np.ndarray
    batches: np.ndarray
    head: list | None
    head_state: Mapping | None
    native_from: int

    @property
    def native(self) -> bool:
        """Every unit is a manifest step replayed as packed."""
        return self.native_from == 0


class EpochPlanner:
    """Plans a manifest's epochs at any world size, from any resume point (plans are cached).

    Args:
        reader: the manifest.
        samples: per-sample costs and caps (an empty :class:`ReplaySamples`: unit cost, no caps).
        seed: the manifest's seed (the step order of reshuffled epochs).
        plan_dir: where elastic plans are kept (:mod:`~balancer_cli.replay.plan_cache`); ``None``:
            neither read nor written.
        build_plans: write them there when they are missing (one rank does).
        logger: where writing them is reported.
    """

    def __init__(self, reader: ManifestReader, samples: ReplaySamples, seed: int, *,
                 plan_dir: str | os.PathLike | None = None, build_plans: bool = False,
                 logger: logging.Logger | None = None) -> None:
        self.reader, self.samples, self.seed = reader, samples, seed
        self.plan_dir, self.build_plans = (None if plan_dir is None else Path(plan_dir)), build_plans
        self.logger = logger or logging.getLogger(__name__)
        epochs = reader.manifest.epoch_num_steps
        self.epoch_starts = np.concatenate([[0], np.cumsum(epochs)]).astype(np.int64)
        self._plans: dict = {}
        self._caches: dict[int, PlanCache | None] = {}
        self._built: set[int] = set()  # world sizes whose plan file this planner wrote (or failed to)
        self._rejected: dict[Path, tuple | None] = {}  # plan files that failed their checks, by (inode, size, mtime)

    def __getstate__(self) -> dict:
        # Plans and mapped plan files are caches, rebuilt on demand.
        return {k: v for k, v in self.__dict__.items() if k not in ("_plans", "_caches")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _plans={}, _caches={})

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
        """
        key = (epoch, position, json.dumps(head_state, sort_keys=True), world_size, start_step)
        if key in self._plans:
            return self._plans[key]
        reader = self.reader
        order = self.epoch_order(epoch)
        head = self.remaining_groups(epoch, head_state) if head_state else None
        if head is not None and not head:  # nothing of the interrupted step is left
            head, head_state = None, None
        k = batches_per_rank(reader.world_size, reader.micro_batches, world_size)
        packed = world_size == reader.world_size
        if packed and head is None:
            bounds = np.arange(position, len(order) + 1, dtype=np.int64)
            batches = np.full(len(bounds) - 1, k, dtype=np.int64)
            native_from = 0
        else:
            rest = order[position:]
            counts = reader.step_sample_counts(int(rest.min()), int(rest.max()) + 1)[rest] if len(rest) else rest
            head_n = sum(len(g) for g in head) if head else 0
            need = k * world_size
            if packed:
                # Only the interrupted step's rest is re-planned (with the next step when it is too
                # small to give every rank its batches); the steps after it replay as packed, as
                # a state saved after it (no head, the packed world size) says they do.
                first = 0 if head_n >= need else min(1, len(counts))
                bounds = np.concatenate([[0], np.arange(first, len(counts) + 1)])
            elif head and head_n >= need:
                bounds = np.concatenate([[0], form_runs(counts, need)])
            else:
                bounds = form_runs(counts, need, head_n)
            csum = np.concatenate([[0], np.cumsum(counts)])
            unit_n = csum[bounds[1:]] - csum[bounds[:-1]]
            if len(unit_n):
                unit_n[0] += head_n
            # Fewer samples than ranks happens only in the last unit: one batch per rank.
            batches = np.maximum(np.minimum(k, unit_n // world_size), 1)
            bounds = bounds + position
            native_from = 1 if packed else len(batches)
        plan = EpochPlan(start_step, order, bounds, batches, head, head_state, native_from)
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
        return [b for batches in self._unit_batches(plan, 0, world_size) for b in batches[taken:] if len(b)]

    def rank_chunks(self, plan: EpochPlan, rank: int, world_size: int) -> Iterator[tuple[list[int], list[int]]]:
        """``rank``'s batches of the plan, a chunk at a time: ``(samples, bounds)``, batch ``i`` of a
        chunk at ``samples[bounds[i]:bounds[i + 1]]``."""
        yield from self._elastic_chunks(plan, rank, world_size, plan.native_from)
        yield from self._native_chunks(plan, rank, plan.native_from)

    def elastic_report(self, plan: EpochPlan, world_size: int) -> ElasticReport:
        """What replaying ``plan`` on ``world_size`` ranks changes, measured on its first units."""
        R, M = self.reader.world_size, self.reader.micro_batches
        k = batches_per_rank(R, M, world_size)
        units = range(min(_REPORTED_UNITS, plan.native_from))
        planned = self._plan_window(plan, 0, len(units), world_size)
        # Summed cost of a group or batch, looked up among the samples of the measured units only.
        window = planned.window.samples_P
        cost_PK = self.samples.costs(window)
        by_sample = np.argsort(window)
        keys = window[by_sample]
        cost_P = (np.ones(len(window)) if cost_PK is None else cost_PK.sum(axis=1))[by_sample]
        cost = lambda g: float(cost_P[np.searchsorted(keys, g)].sum())  # noqa: E731
        packed, replayed = [], []
        for unit in units:
            replayed.append([sum(cost(b) for b in bs) for bs in planned.unit_batches(unit)])
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
        if unit >= plan.native_from:
            groups = self.unit_groups(plan, unit)
            M = self.reader.micro_batches
            return [groups[r * M:(r + 1) * M] for r in range(world_size)]
        return self._plan_window(plan, unit, unit + 1, world_size).unit_batches(0)

    def _plan_window(self, plan: EpochPlan, first: int, last: int, world_size: int) -> WindowPlan:
        """Every rank's batches of units ``first .. last - 1`` (a unit's plan does not depend on the
        window it is planned in, so every rank and every resume agree)."""
        s, window = self.samples, self._window(plan, first, last)
        return plan_units(window, s.costs(window.samples_P), world_size, plan.batches[first:last],
                          s.loads(window.samples_P), s.caps_K)

    def _window(self, plan: EpochPlan, first: int, last: int) -> UnitWindow:
        """Units ``first .. last - 1`` of the plan, flat (every rank's groups, in manifest order)."""
        lo, hi = int(plan.bounds[first]), int(plan.bounds[last])
        samples, step_S1, group_G1 = self.reader.steps_flat(plan.order[lo:hi])
        rel = plan.bounds[first:last + 1] - lo
        unit_U1, unit_group_U1 = step_S1[rel], rel * self.reader.groups_per_step
        if first == 0 and plan.head:  # the interrupted step's groups open unit 0
            sizes = np.fromiter((len(g) for g in plan.head), dtype=np.int64, count=len(plan.head))
            head_n = int(sizes.sum())
            samples = np.concatenate([*plan.head, samples]).astype(np.int64)
            group_G1 = np.concatenate([np.cumsum(sizes) - sizes, group_G1 + head_n])
            unit_U1 = np.concatenate([[0], unit_U1[1:] + head_n])
            unit_group_U1 = np.concatenate([[0], unit_group_U1[1:] + len(sizes)])
        return UnitWindow(samples, unit_U1.astype(np.int64), group_G1.astype(np.int64), unit_group_U1.astype(np.int64))

    def _native_chunks(self, plan: EpochPlan, rank: int, first_unit: int) -> Iterator[tuple[list[int], list[int]]]:
        """``rank``'s batches of units ``first_unit ..`` (steps as packed), a row group (or window) at a time."""
        reader = self.reader
        lo, hi = int(plan.bounds[first_unit]), int(plan.bounds[-1])
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

    def _elastic_chunks(self, plan: EpochPlan, rank: int, world_size: int,
                        units: int) -> Iterator[tuple[list[int], list[int]]]:
        """``rank``'s batches of units ``0 .. units - 1`` (re-planned), a window at a time."""
        # Windows of units planned at once (or read from the plan file); a pass opens with small
        # windows (1, 2, 4, ... units), so its first batch (a resume's) waits for one unit, not 256.
        if not units:
            return
        cache = self.plan_cache(world_size)
        first, size = 0, 1
        while first < units:
            last = min(first + size, units)
            flat = None if cache is None else self._cached(cache, plan, first, last, rank)
            samples, bounds = flat or self._plan_window(plan, first, last, world_size).rank_flat(rank)
            yield samples.tolist(), bounds.tolist()
            first, size = last, min(2 * size, _ELASTIC_WINDOW)

    @staticmethod
    def _cached(cache: PlanCache, plan: EpochPlan, first: int, last: int, rank: int):
        """``rank``'s batches of units ``first .. last - 1`` from the plan file, when each unit is one
        step planned there (not a run of small steps, nor an interrupted step's rest)."""
        lo, hi = int(plan.bounds[first]), int(plan.bounds[last])
        if (first == 0 and plan.head) or hi - lo != last - first or (plan.batches[first:last] != cache.batches).any():
            return None
        return cache.rank_steps(plan.order[lo:hi], rank)

    # ----------------------------------------------------------------------------- plan files
    def plan_cache(self, world_size: int) -> PlanCache | None:
        """The plan file of ``world_size`` ranks: opened, else written first (with ``build_plans``,
        once). A missing file is looked for again at the next pass: another rank may have written it."""
        cache = self._caches.get(world_size)
        if cache is None and self.plan_dir is not None:
            cache = self._caches[world_size] = self._open_plans(world_size)
        return cache

    def _open_plans(self, world_size: int) -> PlanCache | None:
        reader, samples = self.reader, self.samples
        k = batches_per_rank(reader.world_size, reader.micro_batches, world_size)
        path = plan_cache_path(self.plan_dir, fingerprint=reader.fingerprint,
                               manifest_bytes=os.path.getsize(Path(reader.manifest.path) / MANIFEST_FILE),
                               lengths=samples.fingerprint, caps=samples.caps, world_size=world_size, batches=k)
        cache = self._verified(path, world_size, k)
        if cache is not None or not self.build_plans or world_size in self._built:
            return cache
        self._built.add(world_size)
        start = time.perf_counter()
        try:
            self._write_plans(path, world_size, k)
        except OSError as error:  # a read-only folder: plan as the replay goes
            self.logger.debug("elastic plans not kept in %s: %s", path, error)
            return None
        self.logger.info("planned every step of the manifest for %d ranks in %.2f s, kept in %s (later runs read it)",
                         world_size, time.perf_counter() - start, path)
        return self._verified(path, world_size, k)

    def _verified(self, path: Path, world_size: int, k: int) -> PlanCache | None:
        """The plan file at ``path`` once it passes its checks, else ``None`` (one warning per file
        version: the planner then writes it again, or another rank plans as the replay goes)."""
        try:  # a file that failed is not read and reported again at every pass, unless it changed
            info = path.stat()
            version = (info.st_ino, info.st_size, info.st_mtime_ns)
        except OSError:
            version = None
        if version is not None and self._rejected.get(path) == version:
            return None
        try:
            return PlanCache.open(path, step_samples=self.reader.step_sample_counts(), epoch_starts=self.epoch_starts,
                                  num_samples=self.reader.num_samples, world_size=world_size, batches=k)
        except PlanFileInvalid as error:
            self._rejected[path] = version
            self.logger.warning("elastic plan file %s is not used: %s; %s", path, error,
                                "planning it again" if self.build_plans and world_size not in self._built
                                else "planning as the replay goes")
            return None

    def _write_plans(self, path: Path, world_size: int, k: int) -> None:
        """Plan every step that is a unit of its own (at least ``k * R'`` samples) and write the plans."""
        counts = self.reader.step_sample_counts()
        steps = np.flatnonzero(counts >= k * world_size)
        slot_S = np.full(len(counts), -1, dtype=np.int64)
        slot_S[steps] = np.arange(len(steps))
        alone = EpochPlan(0, steps, np.arange(len(steps) + 1), np.full(len(steps), k, dtype=np.int64), None, None,
                          len(steps))

        def plans() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for first in range(0, len(steps), _ELASTIC_WINDOW):
                window = self._plan_window(alone, first, min(first + _ELASTIC_WINDOW, len(steps)), world_size)
                yield window.window.samples_P[window.perm_P], window.bnd_B1

        write_plan_cache(path, slot_S, int(counts[steps].sum()), world_size, k, plans())


def _mean_dist_ratio(loads: list[list[float]]) -> float:
    """Mean Dist Ratio over steps of per-step, per-rank loads (0 for no steps)."""
    return float(np.mean(dist_ratio_per_step(np.array(loads)))) if loads else 0.0
