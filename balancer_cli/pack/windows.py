"""Pack windows: runs of whole steps, each packed and assigned from its own slice of the samples.

A run of N samples is cut into ``ceil(N / W)`` windows of equal size (within one sample), so no
window is a small remainder; windows under a minimum (enough samples for a few steps, from the
caps) merge: there are never more than ``N // minimum`` of them.
Each epoch draws its windows afresh: every source's samples are shuffled (the epoch's ``window``
stream) and dealt round-robin over the windows, so every window holds the global source mix
to within one sample per source. A window is then packed and assigned on its own
(:func:`~balancer_cli.pack.window_place.place_window`, the unit of work of every engine), with
seeds of its own; its steps follow the previous window's. One window reproduces the unwindowed
run exactly (window 0 keeps the run's seeds).

Memory: a window's packer holds ~``BYTES_PER_SAMPLE`` per sample of the window, so
:func:`window_samples_for` turns a memory budget into W.

Example:
    >>> import numpy as np
    >>> members = window_members(np.array([0, 0, 0, 0, 1, 1]), 2, seed=0, epoch=0)
    >>> [m.tolist() for m in members], num_windows(10, 4), num_windows(3, 4)
    ([[1, 3, 5], [0, 2, 4]], 3, 1)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from balancer_cli._shuffle import shuffle
from balancer_cli.errors import UsageError
from balancer_cli.pack._evaluate_kernel import code_counts
from balancer_cli.pack._window_kernels import fill_windows
from balancer_cli.pack.assign import MAX_SOURCES
from balancer_cli.pack.bounds import groups_lower_bound
from balancer_cli.pack.config import PackConfig, stream_seed
from balancer_cli.pack.packers import registry
from balancer_cli.pack.types import dense_ids, index_dtype

__all__ = [
    "BYTES_PER_SAMPLE",
    "HELD_BYTES_PER_SAMPLE",
    "TAIL_BYTES_PER_SAMPLE",
    "MODULE_BYTES_PER_SAMPLE",
    "EPOCH_BYTES_PER_SAMPLE",
    "SOURCE_BYTES_PER_SAMPLE",
    "FREE_SOURCES",
    "BASE_BYTES",
    "DEFAULT_MEMORY_GB",
    "MAX_WINDOW_SAMPLES",
    "WindowedConfig",
    "WindowTask",
    "WindowResult",
    "num_windows",
    "min_window_samples",
    "window_members",
    "window_count",
    "WindowMembers",
    "plan_windows",
    "window_samples_for",
    "resolve_window_samples",
]

#: Peak bytes per sample of packing one window (packer working arrays, the window's slices of the
#: load/cost matrices, its placed groups; measured ~145 B at windows of 1M, rounded up).
BYTES_PER_SAMPLE = 200
#: Bytes every sample holds while the windows pack (loads, costs, sources, ids, window
#: membership, the windows placed so far): 34 B fitted to the peaks of 1.2M, 3M and 10M samples
#: in windows of 300k to 1.5M (a window sample 186 B), rounded up.
HELD_BYTES_PER_SAMPLE = 46
#: Bytes every sample holds once packed (the merged rows beside the windows' results, then the
#: metrics and the manifest written): the peak of a 100M run in windows of 1M, 66 B, rounded up.
TAIL_BYTES_PER_SAMPLE = 68
#: What each module past two adds per sample to a window and to the held and packed bytes: a
#: window's working tables widen, and three-module windows trade across steps
#: (3M three-module samples in windows of 375k: 387 B per window sample; their costs and loads
#: 8 B more per sample). Held: 20 B, which keeps three modules at the 66 B held before the
#: two-module refit (3M three-module samples at --memory-gb 0.55 peaked at 94% of it).
MODULE_BYTES_PER_SAMPLE = (200, 20, 8)
#: What each epoch past the first adds per sample while the windows pack and once they are packed:
#: its window plan and placed windows (12.5 B measured at 10M), then its rows, per-step loads and
#: the report's check reading the rows back (17.6 B measured at 10M in three epochs); rounded up.
EPOCH_BYTES_PER_SAMPLE = (14, 20)
#: What each source past :data:`FREE_SOURCES` adds to a window sample, up to the
#: :data:`~balancer_cli.pack.assign.MAX_SOURCES` the refinement and the step stages count per
#: group (each group's count of each: 10M samples of 500 sources peaked 65 MiB over 4 sources in
#: windows of 791k, 102 MiB in windows of 1.25M: ~80 B a window sample for 12 sources more).
SOURCE_BYTES_PER_SAMPLE = 7
#: Sources :data:`BYTES_PER_SAMPLE` covers (measured with 4).
FREE_SOURCES = 4
#: The libraries' own memory (numpy, Arrow, numba and its loaded kernels, matplotlib drawing
#: report.png in the process): a run of 2,000 samples peaks at 304 MiB; rounded up.
BASE_BYTES = 320 * 2**20
#: Memory budget that sets the default window size when neither W nor a budget is given.
DEFAULT_MEMORY_GB = 8.0
#: Most samples a window holds unless ``--window-samples`` says otherwise: past ~1.5M rows the
#: refinement's random partners miss the cache on every lookup, so smaller windows are faster
#: (10M: 38 s in windows of 1.43M against 44.5 s in one, same Dist, steps and mix) and leaner.
MAX_WINDOW_SAMPLES = 1_500_000
#: A window holds at least this many steps' worth of samples (smaller ones merge).
MIN_WINDOW_STEPS = 4


def min_window_samples(load_nK: np.ndarray, caps_K: np.ndarray, groups_per_step: int) -> int:
    """Samples of :data:`MIN_WINDOW_STEPS` steps at the caps' mean group size (the smallest window).

    Example:
        >>> min_window_samples(np.full((1000, 1), 10), np.array([40]), 8)  # 4 samples per group
        128
    """
    n = len(load_nK)
    groups = max(1, groups_lower_bound(np.asarray(load_nK), np.asarray(caps_K)) if n else 1)
    return int(np.ceil(MIN_WINDOW_STEPS * groups_per_step * n / groups))


def window_samples_for(memory_gb: float, num_samples: int = 0, num_modules: int = 2, epochs: int = 1,
                       num_sources: int = 1) -> int:
    """Samples per window so that a run over ``num_samples`` of ``num_modules`` modules (the LLM
    counted) peaks within ``memory_gb`` GiB: the budget less :data:`BASE_BYTES` and
    :data:`HELD_BYTES_PER_SAMPLE` per sample, over :data:`BYTES_PER_SAMPLE`; and the packed run
    (:data:`TAIL_BYTES_PER_SAMPLE`) must fit too. Modules past two add :data:`MODULE_BYTES_PER_SAMPLE`,
    epochs past one :data:`EPOCH_BYTES_PER_SAMPLE`, sources past :data:`FREE_SOURCES`
    :data:`SOURCE_BYTES_PER_SAMPLE` to a window sample.

    Raises:
        UsageError: a budget that is not positive, or too small to hold the samples at all.

    Example:
        >>> window_samples_for(8.0), window_samples_for(8.0, 100_000_000)
        (41271951, 18271951)
        >>> window_samples_for(8.0, 100_000_000, num_modules=3)  # vision, audio and the LLM
        4135975
        >>> window_samples_for(1.0, 10_000_000), window_samples_for(1.0, 10_000_000, num_sources=500)
        (1390987, 979568)
        >>> window_samples_for(8.0, 50_000_000), window_samples_for(8.0, 50_000_000, epochs=2)
        (29771951, 26271951)
    """
    if not memory_gb > 0:
        raise UsageError(f"{{memory_gb}} must be > 0, not {memory_gb!r}", fix="pass the memory budget in GiB, e.g. 8")
    n, extra, more_epochs = int(num_samples), max(0, int(num_modules) - 2), max(0, int(epochs) - 1)
    window, held, tail = (base + extra * more for base, more in zip(
        (BYTES_PER_SAMPLE, HELD_BYTES_PER_SAMPLE, TAIL_BYTES_PER_SAMPLE), MODULE_BYTES_PER_SAMPLE))
    held, tail = (b + more_epochs * more for b, more in zip((held, tail), EPOCH_BYTES_PER_SAMPLE))
    window += SOURCE_BYTES_PER_SAMPLE * (min(int(num_sources), MAX_SOURCES) - min(int(num_sources), FREE_SOURCES))
    budget = int(memory_gb * 2**30)
    free = budget - BASE_BYTES - held * n
    if free < window * min(n, 100_000) or BASE_BYTES + tail * n > budget:
        need = max(BASE_BYTES + held * n + window * min(n, 100_000), BASE_BYTES + tail * n) / 2**30
        in_epochs = f" in {int(epochs)} epochs" if more_epochs else ""
        raise UsageError(f"{{memory_gb}} {memory_gb:g} GiB cannot hold {n:,} samples of {int(num_modules)} modules"
                         f"{in_epochs} (~{need:.2f} GiB at the least)",
                         fix=f"raise {{memory_gb}} to {math.ceil(need * 10) / 10:g} or more")
    return max(1, free // window)


def resolve_window_samples(num_samples: int, window_samples: int | None, memory_gb: float | None,
                           num_modules: int = 2, epochs: int = 1, num_sources: int = 1) -> int | None:
    """W for a run: the given one, else the one ``memory_gb`` (default :data:`DEFAULT_MEMORY_GB`)
    allows for ``num_modules`` modules, ``epochs`` epochs and ``num_sources`` sources
    (:func:`window_samples_for`), at most :data:`MAX_WINDOW_SAMPLES`; None (one window) when all
    ``num_samples`` fit in one.

    Example:
        >>> resolve_window_samples(10, 4, None), resolve_window_samples(10, None, None)
        (4, None)
        >>> resolve_window_samples(10_000_000, None, None)
        1500000
    """
    if window_samples is not None and memory_gb is not None:
        raise UsageError("{window_samples} and {memory_gb} both set the window size",
                         fix="give one of them")
    if window_samples is not None:
        return int(window_samples)
    budget = min(window_samples_for(DEFAULT_MEMORY_GB if memory_gb is None else memory_gb, num_samples, num_modules,
                                    epochs, num_sources), MAX_WINDOW_SAMPLES)
    return budget if num_samples > budget else None


def num_windows(num_samples: int, window_samples: int | None, min_samples: int = 1) -> int:
    """Windows of a run: ``ceil(N / W)``, but none under ``min_samples`` (at least 1 window)."""
    if not window_samples:
        return 1
    n = int(num_samples)
    return max(1, min(-(-n // int(window_samples)), n // max(1, int(min_samples))))


def window_members(source_n: np.ndarray, windows: int, *, seed: int, epoch: int) -> list[np.ndarray]:
    """(n_w,) sorted positions of each window's samples: every source dealt round-robin.

    Sources are dealt one after another from where the previous stopped, so window sizes differ
    by at most one sample and each window's count of every source by at most one; which of a
    source's samples go where is a seeded shuffle of its labels (the epoch's ``window`` stream,
    one shuffle per source in code order; :mod:`~balancer_cli.pack._window_kernels`).
    """
    n = len(source_n)
    if windows <= 1 or n == 0:
        return [np.arange(n)] + [np.arange(0)] * (max(1, windows) - 1)
    rng = np.random.default_rng(stream_seed(seed, epoch, "window"))
    codes = np.asarray(source_n).reshape(-1)
    if codes.dtype.kind not in "iu" or codes.dtype == np.uint64:
        codes = dense_ids(codes)  # names (or uint64, whose arithmetic numba does in floats): 0..S-1, same order
    lowest, highest = int(codes.min()), int(codes.max())
    if highest - lowest >= n:  # codes spread wider than the samples: 0..S-1, same order
        codes = dense_ids(codes)
        lowest, highest = 0, int(codes.max())
    count = code_counts(codes, highest - lowest + 1, lowest)
    # Position k of the sources' layout goes to window k % windows: the labels repeated (np.tile;
    # np.resize, the same array, concatenates n / windows copies one by one: 10M, 0.26 s vs 4 ms).
    labels = np.tile(np.arange(windows, dtype=np.min_scalar_type(-windows)), -(-n // windows))[:n]
    start = 0
    for size in count.tolist():
        if size > 1:
            shuffle(rng, labels[start:start + size])
        start += size
    out = np.empty(n, dtype=index_dtype(n))
    bounds = fill_windows(labels, codes, lowest, count, int(windows), out)
    return [out[bounds[w]:bounds[w + 1]] for w in range(windows)]


def window_count(load_nK: np.ndarray, config: PackConfig, caps_K: np.ndarray) -> tuple[int, int]:
    """``(windows, fewest samples a window holds)`` for the samples of ``load_nK`` under ``config``
    and ``caps_K``: :func:`num_windows` with :func:`min_window_samples`.

    Example:
        >>> window_count(np.full((40, 1), 10), PackConfig(world_size=2, window_samples=20), np.array([20]))
        (2, 16)
    """
    least = min_window_samples(load_nK, caps_K, config.shape.groups_per_step)
    return num_windows(len(load_nK), config.window_samples, least), least


class WindowMembers(NamedTuple):
    """Which samples each window of each epoch packs (:func:`plan_windows`).

    ``members[e][w]`` holds the (n_w,) sorted positions, in the sample view's rows, of window
    ``w`` of epoch ``e``. Every packer of a run packs the same windows (the same seed, W and caps),
    so the report's baselines plan them once, or reuse the plan ``pack`` packed its manifest with
    (10M in 8 windows: ~0.4 s per plan, the windows' fill and the sources' label shuffles).
    """

    members: tuple[tuple[np.ndarray, ...], ...]

    @property
    def windows(self) -> int:
        """Windows of each epoch."""
        return len(self.members[0]) if self.members else 0


def plan_windows(view: registry.SampleView, config: PackConfig, caps_K: np.ndarray) -> WindowMembers:
    """The windows of every epoch for ``view`` (the samples without a scan error) under ``config``
    and ``caps_K``.

    Example:
        >>> view = registry.SampleView(ids_n=np.arange(40), load_nK=np.full((40, 1), 10), cost_nK=np.full((40, 1), 10.),
        ...                            source_n=np.zeros(40, np.int8), modules=("llm",))
        >>> plan = plan_windows(view, PackConfig(world_size=2, window_samples=20), np.array([20]))
        >>> plan.windows, [len(m) for m in plan.members[0]]
        (2, [20, 20])
    """
    windows, _ = window_count(view.load_nK, config, caps_K)
    return WindowMembers(tuple(tuple(window_members(view.source_n, windows, seed=config.seed, epoch=epoch))
                            for epoch in range(config.epochs)))


@dataclass(frozen=True)
class WindowedConfig:
    """A :class:`PackConfig` as one window sees it: its own seeds, everything else shared.

    Window 0 keeps the run's own seeds, so a single window packs exactly as an unwindowed run.
    """

    base: PackConfig
    window: int

    def __getattr__(self, name: str):
        if name == "base":  # not set yet (e.g. while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.base, name)

    def epoch_seed(self, epoch: int, stream: str) -> int:
        """The seed of ``stream`` in ``epoch`` for this window."""
        return stream_seed(self.base.seed, epoch, stream, window=self.window)


@dataclass(frozen=True, kw_only=True)
class WindowTask:
    """One window of one epoch to pack and assign (what an engine runs; picklable)."""

    packer: str
    config: PackConfig
    caps_K: np.ndarray
    bounds_K: np.ndarray
    epoch: int
    window: int

    @property
    def window_config(self) -> PackConfig | WindowedConfig:
        """The config as this window sees it (its seeds; window 0 keeps the run's)."""
        return self.config if self.window == 0 else WindowedConfig(self.config, self.window)


class WindowResult(NamedTuple):
    """A placed window: groups in packing order with their slots, and what was left out.

    ``order_P`` holds dataset sample ids group by group (``offsets_G`` (G + 1,)); groups with
    ``step_G < 0`` were left out by the assigner; steps count from 0 within the window.
    """

    order_P: np.ndarray
    offsets_G: np.ndarray
    step_G: np.ndarray
    rank_G: np.ndarray
    micro_G: np.ndarray
    num_steps: int
    dropped: np.ndarray
    dropped_reason: tuple[str, ...]
