"""Per-phase post-balancing plans (OrchMLLM): which rank runs each sample in each phase of a step.

After every rank holds its mini-batch, each phase of the step (each encoder, then the LLM) is
balanced on its own: a batch balanced for the LLM is rarely balanced for the vision or audio
encoder. For each phase the planner

1. splits the step's samples into R balanced bins: longest-processing-time-first (LPT) refined by
   local moves/swaps on the most loaded bin (``attention="varlen"``: load = summed sample cost),
   or an optimal sorted contiguous split found by binary search on the answer
   (``attention="padded"``: load = batch size x largest sample cost);
2. matches bins to ranks so that as many samples as possible stay where they are (greedy
   maximum overlap by rank, then by node; or the Hungarian method with ``matching="hungarian"``);
3. sends moved samples back home (or into their home node) wherever that keeps the phase's
   maximum load, and keeps the phase unchanged if balancing does not lower its maximum
   (:mod:`balancer_cli.replay.post_balance.search`).

The LLM phase (last module) keeps every sample on its home rank unless ``balance_llm=True`` and
balancing strictly lowers the LLM maximum. The gradient is the same either way: the global batch
does not change, only which rank computes which sample.

Example:
    >>> import numpy as np
    >>> costs_by_rank = [np.array([[9., 5.], [8., 5.]]), np.array([[1., 5.], [0., 5.]])]
    >>> plan = plan_post_balance(costs_by_rank, modules=("vision", "llm"))
    >>> [d.tolist() for d in plan.destinations[0]], plan.load_before[0].tolist(), plan.load_after[0].tolist()
    ([[0, 1], [1, 1]], [17.0, 1.0], [9.0, 9.0])
    >>> [d.tolist() for d in plan.destinations[1]]  # the LLM phase stays home
    [[0, 0], [1, 1]]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from balancer_cli.errors import PlanError, UsageError
from balancer_cli.replay.post_balance.loads import (
    ATTENTION_MODES,
    apply_cost_coeffs,
    phase_loads,
)
from balancer_cli.replay.post_balance.search import MATCHINGS, PhaseInput, balance_phase

__all__ = ["PostBalancePlan", "plan_post_balance"]


@dataclass(frozen=True, eq=False)
class PostBalancePlan:
    """Where each sample of one step runs in each phase.

    Samples are numbered per rank: sample ``j`` of rank ``r`` is row ``j`` of
    ``costs_by_rank[r]``. Globally they are flattened rank by rank (``offsets``).

    Attributes:
        modules: phase names, encoders first, the LLM last.
        attention: ``"varlen"`` or ``"padded"`` per module.
        world_size: R.
        ranks_per_node: ranks per node used to prefer intra-node moves (None: flat).
        offsets: (R + 1,) int64 start of each rank's samples in the flattened order.
        dest_KN: (K, N) int32 rank that runs each flattened sample in each phase.
        load_before, load_after: (K, R) float64 predicted load per phase and rank.
        lower_bound: (K,) ``max(total / R, largest sample)`` per phase.
    """

    modules: tuple[str, ...]
    attention: tuple[str, ...]
    world_size: int
    ranks_per_node: int | None
    offsets: np.ndarray
    dest_KN: np.ndarray
    load_before: np.ndarray
    load_after: np.ndarray
    lower_bound: np.ndarray

    @property
    def num_samples(self) -> int:
        return int(self.offsets[-1])

    @property
    def llm_index(self) -> int:
        return len(self.modules) - 1

    def index(self, module: int | str) -> int:
        """Phase index of ``module`` (an index or a module name)."""
        if isinstance(module, str):
            if module not in self.modules:
                raise UsageError(f"module {module!r} is not in this plan ({', '.join(self.modules)})",
                                 fix="use one of the plan's module names")
            return self.modules.index(module)
        if not -len(self.modules) <= module < len(self.modules):
            raise UsageError(f"module index {module} out of range for {len(self.modules)} modules")
        return module % len(self.modules)

    @cached_property
    def home_N(self) -> np.ndarray:
        """(N,) int32 rank that holds each flattened sample (its data rank)."""
        return np.repeat(np.arange(self.world_size, dtype=np.int32), np.diff(self.offsets))

    @cached_property
    def destinations(self) -> tuple[tuple[np.ndarray, ...], ...]:
        """``destinations[m][r]``: (n_r,) int32 rank that runs module m's phase for rank r's samples."""
        cuts = self.offsets[1:-1]
        return tuple(tuple(np.split(self.dest_KN[m], cuts)) for m in range(len(self.modules)))

    @cached_property
    def send_counts(self) -> np.ndarray:
        """(K, R, R) int64: ``send_counts[m, r, q]`` samples rank r sends to rank q for phase m."""
        r = self.world_size
        flat = self.home_N.astype(np.int64)[None, :] * r + self.dest_KN.astype(np.int64)
        return np.stack([np.bincount(f, minlength=r * r).reshape(r, r) for f in flat])

    @property
    def moved(self) -> np.ndarray:
        """(K,) int64 samples that leave their data rank in each phase."""
        return (self.dest_KN != self.home_N[None, :]).sum(axis=1)

    def moved_cross_node(self) -> np.ndarray:
        """(K,) int64 samples that leave their data rank's node in each phase (flat: = moved)."""
        if not self.ranks_per_node:
            return self.moved
        p = self.ranks_per_node
        return (self.dest_KN // p != self.home_N[None, :] // p).sum(axis=1)

    def phase_samples(self, module: int | str, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Samples rank ``rank`` runs in ``module``'s phase, in canonical order (data rank, index).

        Returns:
            ``(src_rank, local_index)``, both int64 arrays. This is the order in which
            :class:`~balancer_cli.runtime.dispatch.PhaseDispatcher` delivers them.
        """
        flat = np.flatnonzero(self.dest_KN[self.index(module)] == rank)
        src = self.home_N[flat].astype(np.int64)
        return src, flat - self.offsets[src]


def _stack_checked(arrays, width):
    """The (N, K) costs of 2-D ``arrays`` stacked rank by rank, or PlanError at the first cost
    (in rank, sample, module order) that is not a finite number >= 0."""
    cost_NK = np.concatenate(arrays, axis=0) if arrays else np.zeros((0, width))
    bad = ~(cost_NK >= 0) | (cost_NK == np.inf)  # NaN compares false
    if bad.any():
        i, m = divmod(int(np.argmax(bad)), width)
        ends = np.cumsum([a.shape[0] for a in arrays])  # only on error
        r = int(np.searchsorted(ends, i, side="right"))
        j = i - (int(ends[r - 1]) if r else 0)
        raise PlanError(f"rank {r} sample {j} module {m}: cost {arrays[r][j, m]!r} is not a finite number >= 0",
                        fix="costs must be finite and non-negative")
    return cost_NK


def _check_inputs(costs_by_rank, modules, attention, cost_coeffs, matching):
    """``(cost_NK, counts, names, modes)``: the validated costs flattened rank by rank."""
    if not isinstance(costs_by_rank, (list, tuple)) or not costs_by_rank:
        raise UsageError("costs_by_rank must be a non-empty list with one (n_r, K) array per rank")
    arrays = [np.asarray(costs, dtype=np.float64) for costs in costs_by_rank]
    shapes = [a.shape for a in arrays]
    if len(set(shapes)) == 1 and len(shapes[0]) == 2:  # the usual case: n samples on every rank
        width, shape_error = shapes[0][1], None
        counts = np.full(len(arrays), shapes[0][0], dtype=np.int64)
    else:
        widths = {shape[1] for shape in shapes if len(shape) == 2}
        if len(widths) > 1:
            raise PlanError(f"ranks report costs for different numbers of modules: {sorted(widths)}",
                            fix="every rank must report the same modules in the same order, the LLM last")
        width = widths.pop() if widths else 0
        arrays = [a.reshape(0, width) if a.ndim == 1 and a.size == 0 else a for a in arrays]  # a rank without samples
        shape_error = next((r for r, a in enumerate(arrays) if a.ndim != 2), None)
        counts = np.array([a.shape[0] if a.ndim == 2 else 0 for a in arrays], dtype=np.int64)
    # one check over all costs; the first problem in rank order is the one reported
    cost_NK = _stack_checked(arrays[:shape_error], width)
    if shape_error is not None:
        shape = arrays[shape_error].shape
        raise PlanError(f"costs of rank {shape_error} have shape {shape}, expected (samples, modules)",
                        fix="pass one (n_r, K) array per rank, one column per module, the LLM last")
    if width == 0:
        raise PlanError("costs have no module columns", fix="pass at least the LLM column")
    names = tuple(modules) if modules is not None else tuple(f"m{i}" for i in range(width - 1)) + ("llm",)
    if len(names) != width:
        raise UsageError(f"{len(names)} module names for {width} cost columns")
    modes = (attention,) * width if isinstance(attention, str) else tuple(attention)
    if len(modes) != width or any(a not in ATTENTION_MODES for a in modes):
        raise UsageError(f"{{attention}} must be one of {ATTENTION_MODES} or one per module, got {attention!r}")
    if cost_coeffs is not None and len(cost_coeffs) != width:
        raise UsageError(f"cost_coeffs needs one (alpha, beta[, gamma]) or None per module ({width}), got {len(cost_coeffs)}")
    if cost_coeffs is not None and any(c is not None and len(c) not in (2, 3) for c in cost_coeffs):
        raise UsageError(f"each cost_coeffs entry is (alpha, beta), (alpha, beta, gamma) or None, got {list(cost_coeffs)!r}")
    if matching not in MATCHINGS:
        raise UsageError(f"unknown matching {matching!r}", fix=f"use one of: {', '.join(MATCHINGS)}")
    return cost_NK, counts, names, modes


def plan_post_balance(
    costs_by_rank: Sequence[np.ndarray],
    ranks_per_node: int | None = None,
    *,
    modules: Sequence[str] | None = None,
    attention: str | Sequence[str] = "varlen",
    cost_coeffs: Sequence[tuple[float, ...] | None] | None = None,
    balance_llm: bool = False,
    matching: str = "greedy",
    move_tolerance: float = 0.0,
    refine_iters: int | None = None,
    refine_candidates: int = 8,
) -> PostBalancePlan:
    """Plan one step's per-phase rebalancing across ranks.

    Args:
        costs_by_rank: R arrays of shape (n_r, K): per sample of rank r, its cost in each of K
            modules (encoders first, the LLM last). With ``cost_coeffs`` the columns are lengths.
        ranks_per_node: ranks per node; moves then prefer the sample's own node.
        modules: K module names (default ``m0, m1, ..., llm``).
        attention: ``"varlen"`` (packed sequences: load = summed cost) or ``"padded"`` (padded
            micro-batch: load = count x largest cost), one for all modules or one per module.
        cost_coeffs: per module ``(alpha, beta)`` for cost = ``alpha*len + beta*len**2``, or
            ``(alpha, beta, gamma)`` adding ``gamma`` per sample (a calibration's
            :meth:`~balancer_cli.cost.measured.MeasuredCosts.cost_coeffs`), or None to take the
            column as a precomputed cost.
        balance_llm: also rebalance the LLM phase (only applied if it lowers the LLM maximum).
        matching: ``"greedy"`` (fast, default) or ``"hungarian"`` (exact max overlap; scipy).
        move_tolerance: accept a maximum load up to this fraction above the plan made without
            it (``move_tolerance=0``) in exchange for fewer moves: the tolerant plan's maximum is
            at most ``1 + move_tolerance`` times that plan's, and it never moves more samples
            (with ``ranks_per_node``: never more cross-node moves, then never more moves).
        refine_iters: local-search iterations per phase (default ``4R + 64``).
        refine_candidates: least loaded bins tried per local-search iteration.

    Returns:
        The frozen :class:`PostBalancePlan`; same inputs give the same plan on every rank.

    Raises:
        PlanError: malformed costs (shape, NaN, negative). UsageError: bad option values.

    Example:
        >>> costs_by_rank = [np.array([[9., 5.], [8., 5.]]), np.array([[1., 5.], [0., 5.]])]
        >>> plan = plan_post_balance(costs_by_rank, modules=("vision", "llm"))
        >>> plan.load_after.tolist(), plan.moved.tolist()
        ([[9.0, 9.0], [10.0, 10.0]], [1, 0])
    """
    cost_NK, counts, names, modes = _check_inputs(costs_by_rank, modules, attention, cost_coeffs, matching)
    num_ranks = len(counts)
    if ranks_per_node is not None and ranks_per_node < 1:
        raise UsageError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    if move_tolerance < 0:
        raise UsageError(f"move_tolerance must be >= 0, got {move_tolerance}")
    offsets = np.concatenate([[0], np.cumsum(counts)])
    if cost_coeffs is not None:
        cost_NK = apply_cost_coeffs(cost_NK, cost_coeffs)
    home_N = np.repeat(np.arange(num_ranks, dtype=np.int64), counts)
    iters = 4 * num_ranks + 64 if refine_iters is None else refine_iters
    num_modules = len(names)
    dest_KN = np.empty((num_modules, len(home_N)), np.int32)
    before = np.zeros((num_modules, num_ranks))
    after = np.zeros((num_modules, num_ranks))
    lower = np.zeros(num_modules)
    for m in range(num_modules):
        cost_N = np.ascontiguousarray(cost_NK[:, m])
        before[m] = phase_loads(cost_N, home_N, num_ranks, modes[m])
        lower[m] = max(cost_N.sum() / num_ranks, cost_N.max(initial=0.0))
        dest_N = home_N
        if num_ranks > 1 and len(cost_N) and (m < num_modules - 1 or balance_llm):
            phase = PhaseInput(cost_N=cost_N, home_N=home_N, num_ranks=num_ranks, ranks_per_node=ranks_per_node or 1,
                               attention=modes[m], refine_iters=iters, refine_candidates=refine_candidates)
            dest_N = balance_phase(phase, matching, move_tolerance)
        dest_KN[m] = dest_N
        after[m] = phase_loads(cost_N, dest_N, num_ranks, modes[m])
    for a in (offsets, dest_KN, before, after, lower):
        a.setflags(write=False)
    return PostBalancePlan(names, modes, num_ranks, ranks_per_node, offsets, dest_KN, before, after, lower)
