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
   maximum load, and keeps the phase unchanged if balancing does not lower its maximum.

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
from balancer_cli.replay.post_balance import kernels as K

__all__ = ["ATTENTION_MODES", "PostBalancePlan", "plan_post_balance", "phase_loads", "apply_cost_coeffs"]

ATTENTION_MODES = ("varlen", "padded")
MATCHINGS = ("greedy", "hungarian")


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
        dest_MN: (M, N) int32 rank that runs each flattened sample in each phase.
        load_before, load_after: (M, R) float64 predicted load per phase and rank.
        lower_bound: (M,) ``max(total / R, largest sample)`` per phase.
    """

    modules: tuple[str, ...]
    attention: tuple[str, ...]
    world_size: int
    ranks_per_node: int | None
    offsets: np.ndarray
    dest_MN: np.ndarray
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
        return tuple(tuple(np.split(self.dest_MN[m], cuts)) for m in range(len(self.modules)))

    @cached_property
    def send_counts(self) -> np.ndarray:
        """(M, R, R) int64: ``send_counts[m, r, q]`` samples rank r sends to rank q for phase m."""
        r = self.world_size
        flat = self.home_N.astype(np.int64)[None, :] * r + self.dest_MN.astype(np.int64)
        return np.stack([np.bincount(f, minlength=r * r).reshape(r, r) for f in flat])

    @property
    def moved(self) -> np.ndarray:
        """(M,) int64 samples that leave their data rank in each phase."""
        return (self.dest_MN != self.home_N[None, :]).sum(axis=1)

    def moved_cross_node(self) -> np.ndarray:
        """(M,) int64 samples that leave their data rank's node in each phase (flat: = moved)."""
        if not self.ranks_per_node:
            return self.moved
        p = self.ranks_per_node
        return (self.dest_MN // p != self.home_N[None, :] // p).sum(axis=1)

    def phase_samples(self, module: int | str, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Samples rank ``rank`` runs in ``module``'s phase, in canonical order (data rank, index).

        Returns:
            ``(src_rank, local_index)``, both int64 arrays. This is the order in which
            :class:`~balancer_cli.runtime.dispatch.PhaseDispatcher` delivers them.
        """
        flat = np.flatnonzero(self.dest_MN[self.index(module)] == rank)
        src = self.home_N[flat].astype(np.int64)
        return src, flat - self.offsets[src]


def apply_cost_coeffs(lengths_nM: np.ndarray, cost_coeffs: Sequence[tuple[float, float] | None]) -> np.ndarray:
    """Turn per-module lengths into costs ``alpha * len + beta * len**2`` (None keeps the column).

    Example:
        >>> apply_cost_coeffs(np.array([[10., 3.]]), [(1.0, 0.1), None]).tolist()
        [[20.0, 3.0]]
    """
    out = np.array(lengths_nM, dtype=np.float64, copy=True)
    for m, coeff in enumerate(cost_coeffs):
        if coeff is not None:
            alpha, beta = coeff
            out[:, m] = alpha * out[:, m] + beta * out[:, m] ** 2
    return out


def phase_loads(cost_N: np.ndarray, rank_N: np.ndarray, world_size: int, attention: str = "varlen") -> np.ndarray:
    """(R,) load of one phase: summed cost (varlen) or ``count x max cost`` (padded).

    Example:
        >>> phase_loads(np.array([3., 1., 2.]), np.array([0, 0, 1]), 2, "padded").tolist()
        [6.0, 2.0]
    """
    cost_N = np.asarray(cost_N, dtype=np.float64)
    rank_N = np.asarray(rank_N, dtype=np.int64)
    if attention == "varlen":
        return np.bincount(rank_N, weights=cost_N, minlength=world_size)[:world_size]
    count = np.bincount(rank_N, minlength=world_size)[:world_size]
    peak = np.zeros(world_size)
    np.maximum.at(peak, rank_N, cost_N)
    return count * peak


def _check_inputs(costs_by_rank, modules, attention, cost_coeffs, matching):
    if not isinstance(costs_by_rank, (list, tuple)) or not costs_by_rank:
        raise UsageError("costs_by_rank must be a non-empty list with one (n_r, M) array per rank")
    raw = [np.asarray(costs, dtype=np.float64) for costs in costs_by_rank]
    widths = {a.shape[1] for a in raw if a.ndim == 2}
    if len(widths) > 1:
        raise PlanError(f"ranks report costs for different numbers of modules: {sorted(widths)}",
                        fix="every rank must report the same modules in the same order, the LLM last")
    width = widths.pop() if widths else 0
    arrays = []
    for r, a in enumerate(raw):
        if a.ndim == 1 and a.size == 0:  # a rank without samples
            a = a.reshape(0, width)
        if a.ndim != 2:
            raise PlanError(f"costs of rank {r} have shape {a.shape}, expected (samples, modules)",
                            fix="pass one (n_r, M) array per rank, one column per module, the LLM last")
        arrays.append(a)
        bad = ~np.isfinite(a) | (a < 0)
        if bad.any():
            j, m = (int(x) for x in np.argwhere(bad)[0])
            raise PlanError(f"rank {r} sample {j} module {m}: cost {a[j, m]!r} is not a finite number >= 0",
                            fix="costs must be finite and non-negative")
    if width == 0:
        raise PlanError("costs have no module columns", fix="pass at least the LLM column")
    names = tuple(modules) if modules is not None else tuple(f"m{i}" for i in range(width - 1)) + ("llm",)
    if len(names) != width:
        raise UsageError(f"{len(names)} module names for {width} cost columns")
    modes = (attention,) * width if isinstance(attention, str) else tuple(attention)
    if len(modes) != width or any(a not in ATTENTION_MODES for a in modes):
        raise UsageError(f"attention must be one of {ATTENTION_MODES} or one per module, got {attention!r}")
    if cost_coeffs is not None and len(cost_coeffs) != width:
        raise UsageError(f"cost_coeffs needs one (alpha, beta) or None per module ({width}), got {len(cost_coeffs)}")
    if matching not in MATCHINGS:
        raise UsageError(f"unknown matching {matching!r}", fix=f"use one of: {', '.join(MATCHINGS)}")
    return arrays, names, modes


def _hungarian(bin_n, home_n, num_bins, ranks_per_node):
    try:
        from scipy.optimize import linear_sum_assignment
    except ImportError:  # pragma: no cover - scipy present in the test environment
        raise UsageError("matching='hungarian' needs scipy", fix="pip install scipy, or use matching='greedy'") from None
    n = len(bin_n)
    weight = np.zeros((num_bins, num_bins))
    np.add.at(weight, (bin_n, home_n), float(n + 1))  # staying on the rank dominates
    if ranks_per_node and ranks_per_node > 1:
        nodes = -(-num_bins // ranks_per_node)
        per_node = np.zeros((num_bins, nodes))
        np.add.at(per_node, (bin_n, home_n // ranks_per_node), 1.0)
        weight += np.repeat(per_node, ranks_per_node, axis=1)[:, :num_bins]
    rows, cols = linear_sum_assignment(weight, maximize=True)
    rank_of_bin = np.empty(num_bins, np.int64)
    rank_of_bin[rows] = cols
    return rank_of_bin


def _balance_phase(cost_n, home_n, num_ranks, ranks_per_node, attention, refine_iters, refine_candidates,
                   matching, move_tolerance):
    """Balanced destinations (N,) int64 for one phase (not yet compared with doing nothing)."""
    order = np.argsort(-cost_n, kind="stable")
    cost_sorted = np.ascontiguousarray(cost_n[order])
    bin_n = np.empty(len(cost_n), np.int64)
    iters = 4 * num_ranks + 64 if refine_iters is None else refine_iters
    if attention == "varlen":
        bins_sorted, load = K.lpt_bins(cost_sorted, num_ranks)
        bin_n[order] = bins_sorted
        K.refine_bins(cost_n, bin_n, load, iters, refine_candidates)
    else:
        starts = _padded_starts(cost_sorted, num_ranks)
        bin_n[order] = np.repeat(np.arange(num_ranks), np.diff(starts))
    if matching == "greedy":
        rank_of_bin = K.match_bins(bin_n, home_n, num_ranks, ranks_per_node or 1)
    else:
        rank_of_bin = _hungarian(bin_n, home_n, num_ranks, ranks_per_node)
    dest_n = rank_of_bin[bin_n]
    peak = phase_loads(cost_n, dest_n, num_ranks, attention).max()
    cap = peak * (1.0 + move_tolerance)
    # cheapest first: the most samples go back home under the cap
    back_order = order[::-1].copy()
    K.move_back(cost_n, dest_n, home_n, back_order, num_ranks, cap, ranks_per_node or 1, attention == "padded")
    if attention == "varlen":
        # More candidates: start from home and move only the excess (two shedding policies,
        # node-aware and flat), then local search. They usually move far fewer samples; the one
        # with the fewest moves (cross-node moves first) among those within the cap wins.
        # (Padded phases have none: a balanced padded split regroups samples by length, and
        # shedding from home never met the cap in our measurements.)
        rpn = ranks_per_node or 1
        best_key = _move_key(dest_n, home_n, rpn)
        for node_aware in ((True, False) if rpn > 1 else (False,)):
            for policy in (0, 1):
                repaired, load = K.repair_from_home(cost_n, home_n, num_ranks, cap, rpn if node_aware else 1, policy)
                if load.max() > cap:
                    K.refine_bins(cost_n, repaired, load, iters, refine_candidates)
                if load.max() <= cap:
                    K.move_back(cost_n, repaired, home_n, back_order, num_ranks, cap, rpn, False)
                    key = _move_key(repaired, home_n, rpn)
                    if key < best_key:
                        dest_n, best_key = repaired, key
    return dest_n


def _move_key(dest_n, home_n, ranks_per_node):
    """(cross-node moves, moves): what a candidate costs in traffic, slow links first."""
    moved = int((dest_n != home_n).sum())
    if ranks_per_node <= 1:
        return (moved, moved)
    return (int((dest_n // ranks_per_node != home_n // ranks_per_node).sum()), moved)


def _padded_starts(cost_sorted: np.ndarray, num_bins: int) -> np.ndarray:
    """Optimal sorted contiguous split for padded batches: binary search on the max load."""
    n = len(cost_sorted)
    if n == 0:
        return np.zeros(num_bins + 1, np.int64)
    lo = max(float(cost_sorted[0]), float(cost_sorted.sum()) / num_bins) * (1 - 1e-12)  # infeasible or optimal
    _, hi, starts = K.padded_split(cost_sorted, num_bins, float(cost_sorted[0]) * n)  # one batch: feasible
    best = starts
    for _ in range(200):
        if hi - lo <= 1e-12 * hi:
            break
        mid = 0.5 * (lo + hi)
        used, achieved, starts = K.padded_split(cost_sorted, num_bins, mid)
        if used <= num_bins:
            hi, best = achieved, starts  # achieved <= mid: a real load, so hi stays attainable
        else:
            lo = mid
    return best


def plan_post_balance(
    costs_by_rank: Sequence[np.ndarray],
    ranks_per_node: int | None = None,
    *,
    modules: Sequence[str] | None = None,
    attention: str | Sequence[str] = "varlen",
    cost_coeffs: Sequence[tuple[float, float] | None] | None = None,
    balance_llm: bool = False,
    matching: str = "greedy",
    move_tolerance: float = 0.0,
    refine_iters: int | None = None,
    refine_candidates: int = 8,
) -> PostBalancePlan:
    """Plan one step's per-phase rebalancing across ranks.

    Args:
        costs_by_rank: R arrays of shape (n_r, M): per sample of rank r, its cost in each of M
            modules (encoders first, the LLM last). With ``cost_coeffs`` the columns are lengths.
        ranks_per_node: ranks per node; moves then prefer the sample's own node.
        modules: M module names (default ``m0, m1, ..., llm``).
        attention: ``"varlen"`` (packed sequences: load = summed cost) or ``"padded"`` (padded
            micro-batch: load = count x largest cost), one for all modules or one per module.
        cost_coeffs: per module ``(alpha, beta)`` for cost = ``alpha*len + beta*len**2`` or None
            to take the column as a precomputed cost.
        balance_llm: also rebalance the LLM phase (only applied if it lowers the LLM maximum).
        matching: ``"greedy"`` (fast, default) or ``"hungarian"`` (exact max overlap; scipy).
        move_tolerance: allow the maximum load to rise by this fraction above the balanced one
            to keep more samples home (0: never worse than the balanced split).
        refine_iters: local-search iterations per phase (default ``4R + 64``).
        refine_candidates: least loaded bins tried per local-search iteration.

    Returns:
        The frozen :class:`PostBalancePlan`; same inputs give the same plan on every rank.

    Raises:
        PlanError: malformed costs (shape, NaN, negative). UsageError: bad option values.
    """
    arrays, names, modes = _check_inputs(costs_by_rank, modules, attention, cost_coeffs, matching)
    num_ranks = len(arrays)
    if ranks_per_node is not None and ranks_per_node < 1:
        raise UsageError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    if move_tolerance < 0:
        raise UsageError(f"move_tolerance must be >= 0, got {move_tolerance}")
    counts = np.array([a.shape[0] for a in arrays], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    costs_NM = np.concatenate(arrays, axis=0) if offsets[-1] else np.zeros((0, len(names)))
    if cost_coeffs is not None:
        costs_NM = apply_cost_coeffs(costs_NM, cost_coeffs)
    home_n = np.repeat(np.arange(num_ranks, dtype=np.int64), counts)
    num_modules = len(names)
    dest_MN = np.empty((num_modules, len(home_n)), np.int32)
    before = np.zeros((num_modules, num_ranks))
    after = np.zeros((num_modules, num_ranks))
    lower = np.zeros(num_modules)
    for m in range(num_modules):
        cost_n = np.ascontiguousarray(costs_NM[:, m])
        before[m] = phase_loads(cost_n, home_n, num_ranks, modes[m])
        lower[m] = max(cost_n.sum() / num_ranks, cost_n.max(initial=0.0))
        dest_n = home_n
        if num_ranks > 1 and len(cost_n) and (m < num_modules - 1 or balance_llm):
            balanced = _balance_phase(cost_n, home_n, num_ranks, ranks_per_node, modes[m], refine_iters,
                                      refine_candidates, matching, move_tolerance)
            # never worse than doing nothing: keep the phase as is unless it strictly improves
            if phase_loads(cost_n, balanced, num_ranks, modes[m]).max() < before[m].max():
                dest_n = balanced
        dest_MN[m] = dest_n
        after[m] = phase_loads(cost_n, dest_n, num_ranks, modes[m])
    for a in (offsets, dest_MN, before, after, lower):
        a.setflags(write=False)
    return PostBalancePlan(names, modes, num_ranks, ranks_per_node, offsets, dest_MN, before, after, lower)
