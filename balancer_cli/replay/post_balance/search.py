"""Balancing one phase of a step: balanced bins, kept in place, only the excess moved.

For one phase (one module's work over a step's samples) the search

1. splits the samples into R balanced bins: longest-processing-time-first (LPT) refined by local
   moves/swaps on the most loaded bin (``"varlen"``), or the optimal sorted contiguous split found
   by binary search on the answer (``"padded"``);
2. matches bins to ranks so that many samples stay where they are (:data:`MATCHINGS`: greedy
   maximum overlap by rank, then by node, or the Hungarian method);
3. keeps, among the candidates within the balanced split's maximum, the one with the fewest moves
   (cross-node moves first): the matched split with moved samples sent back home where they fit
   and (varlen) placements that start from home and shed only the excess;
4. keeps the phase as it is unless that strictly lowers its maximum. With ``move_tolerance`` it
   then searches again under ``1 + move_tolerance`` times that plan's maximum, the plan itself a
   candidate: the tolerant plan is at most that much worse and never moves more samples.

Example:
    >>> import numpy as np
    >>> phase = PhaseInput(cost_N=np.array([9., 8., 1., 0.]), home_N=np.array([0, 0, 1, 1]), num_ranks=2)
    >>> balance_phase(phase).tolist()
    [0, 1, 1, 1]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from balancer_cli.errors import UsageError
from balancer_cli.replay.post_balance import kernels, placement_kernels
from balancer_cli.replay.post_balance.loads import ATTENTION_MODES, phase_loads

__all__ = ["MATCHINGS", "PhaseInput", "balance_phase"]


@dataclass(frozen=True, kw_only=True)
class PhaseInput:
    """One phase of a step, as the search sees it.

    Attributes:
        cost_N, home_N: (N,) cost and data rank of each sample of the step (flattened rank by rank).
        num_ranks: R.
        ranks_per_node: ranks per node (1: flat); moves then prefer the sample's own node.
        attention: ``"varlen"`` or ``"padded"`` (:data:`~balancer_cli.replay.post_balance.loads.ATTENTION_MODES`).
        refine_iters, refine_candidates: the local search's iterations and least loaded bins tried.
    """

    cost_N: np.ndarray
    home_N: np.ndarray
    num_ranks: int
    ranks_per_node: int = 1
    attention: str = "varlen"
    refine_iters: int = 64
    refine_candidates: int = 8

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_MODES:
            raise UsageError(f"{{attention}} must be one of {ATTENTION_MODES}, got {self.attention!r}")
        if self.ranks_per_node < 1:
            raise UsageError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")

    def peak(self, dest_N: np.ndarray) -> float:
        """The phase's maximum load with samples at ``dest_N``."""
        return phase_loads(self.cost_N, dest_N, self.num_ranks, self.attention).max()


def balance_phase(phase: PhaseInput, matching: str = "greedy", move_tolerance: float = 0.0) -> np.ndarray:
    """(N,) int64 rank that runs each sample in this phase; never worse than doing nothing.

    Args:
        phase: the phase's costs, homes and options.
        matching: how balanced bins find their ranks (:data:`MATCHINGS`).
        move_tolerance: accept a maximum up to this fraction above the plan without it, for fewer moves.

    Example:
        >>> phase = PhaseInput(cost_N=np.full(4, 3.0), home_N=np.zeros(4, int), num_ranks=2)
        >>> balance_phase(phase).tolist(), balance_phase(phase, move_tolerance=0.5).tolist()  # loads 6/6, 9/3
        ([0, 1, 0, 1], [0, 1, 0, 0])
    """
    order, balanced_N = _balanced_split(phase, matching)
    before = phase.peak(phase.home_N)

    def no_worse(dest_N):  # keep the phase as is unless the plan strictly improves it
        return dest_N if phase.peak(dest_N) < before else phase.home_N

    dest_N = no_worse(_fewest_moves(phase, balanced_N, order, phase.peak(balanced_N)))
    if move_tolerance > 0:
        cap = phase.peak(dest_N) * (1.0 + move_tolerance)
        dest_N = no_worse(_fewest_moves(phase, balanced_N, order, cap, incumbent_N=dest_N))
    return dest_N


def _lpt_bins(phase: PhaseInput, order: np.ndarray, cost_sorted: np.ndarray) -> np.ndarray:
    bin_N = np.empty(len(order), np.int64)
    bins_sorted, load = kernels.lpt_bins(cost_sorted, phase.num_ranks)
    bin_N[order] = bins_sorted
    kernels.refine_bins(phase.cost_N, bin_N, load, phase.refine_iters, phase.refine_candidates, order)
    return bin_N


def _padded_bins(phase: PhaseInput, order: np.ndarray, cost_sorted: np.ndarray) -> np.ndarray:
    bin_N = np.empty(len(order), np.int64)
    starts = _padded_starts(cost_sorted, phase.num_ranks)
    bin_N[order] = np.repeat(np.arange(phase.num_ranks), np.diff(starts))
    return bin_N


#: Attention mode -> the (N,) balanced bin of each sample (samples given by descending cost).
_BINS: dict[str, Callable[[PhaseInput, np.ndarray, np.ndarray], np.ndarray]] = {
    "varlen": _lpt_bins,
    "padded": _padded_bins,
}


def _hungarian(bin_N, home_N, num_bins, ranks_per_node):
    try:
        from scipy.optimize import linear_sum_assignment
    except ImportError:  # pragma: no cover - scipy present in the test environment
        raise UsageError("matching='hungarian' needs scipy", fix="pip install scipy, or use matching='greedy'") from None
    n = len(bin_N)
    pairs = np.bincount(bin_N * num_bins + home_N, minlength=num_bins * num_bins)
    weight = pairs.reshape(num_bins, num_bins) * float(n + 1)  # staying on the rank dominates
    if ranks_per_node and ranks_per_node > 1:
        nodes = -(-num_bins // ranks_per_node)
        per_node = np.bincount(bin_N * nodes + home_N // ranks_per_node, minlength=num_bins * nodes)
        weight += np.repeat(per_node.reshape(num_bins, nodes).astype(np.float64), ranks_per_node, axis=1)[:, :num_bins]
    rows, cols = linear_sum_assignment(weight, maximize=True)
    rank_of_bin = np.empty(num_bins, np.int64)
    rank_of_bin[rows] = cols
    return rank_of_bin


def _greedy(bin_N, home_N, num_bins, ranks_per_node):
    # The kernel is looked up when called, so swapping it for its Python source (tests) applies here too.
    return placement_kernels.match_bins(bin_N, home_N, num_bins, ranks_per_node)


#: Matching -> ``rank_of_bin`` (R,) from each sample's bin and home, the bins, and ranks per node.
_MATCHERS: dict[str, Callable[[np.ndarray, np.ndarray, int, int], np.ndarray]] = {
    "greedy": _greedy,
    "hungarian": _hungarian,
}
MATCHINGS = tuple(_MATCHERS)


def _balanced_split(phase: PhaseInput, matching: str) -> tuple[np.ndarray, np.ndarray]:
    """``(order, dest_N)``: samples by descending cost, and R balanced bins matched to ranks so
    that many samples stay home."""
    order = kernels.descending_order(phase.cost_N)  # = argsort(-cost, kind="stable")
    bin_N = _BINS[phase.attention](phase, order, np.ascontiguousarray(phase.cost_N[order]))
    rank_of_bin = _MATCHERS[matching](bin_N, phase.home_N, phase.num_ranks, phase.ranks_per_node)
    return order, rank_of_bin[bin_N]


def _fewest_moves(phase: PhaseInput, balanced_N: np.ndarray, order: np.ndarray, cap: float,
                  incumbent_N: np.ndarray | None = None) -> np.ndarray:
    """The candidate with the fewest moves (cross-node moves first) among those with every load
    within ``cap``: the balanced split with moved samples sent back home where they fit, the
    shed-from-home candidates (varlen), and ``incumbent_N`` (which wins ties) when given."""
    cost_N, home_N, num_ranks, rpn = phase.cost_N, phase.home_N, phase.num_ranks, phase.ranks_per_node
    # cheapest first: the most samples go back home under the cap
    back_order = order[::-1].copy()
    dest_N = balanced_N.copy()
    placement_kernels.move_back(cost_N, dest_N, home_N, back_order, num_ranks, cap, rpn, phase.attention == "padded")
    best_key = _move_key(dest_N, home_N, rpn)
    if incumbent_N is not None and _move_key(incumbent_N, home_N, rpn) <= best_key:
        dest_N, best_key = incumbent_N, _move_key(incumbent_N, home_N, rpn)
    if phase.attention == "varlen":
        # More candidates: start from home and move only the excess (two shedding policies,
        # node-aware and flat), then local search. They usually move far fewer samples; the one
        # with the fewest moves (cross-node moves first) among those within the cap wins.
        # (Padded phases have none: a balanced padded split regroups samples by length, and
        # shedding from home never met the cap in our measurements.) What is shed does not
        # depend on node awareness, only where it goes: each policy sheds once.
        shed = [placement_kernels.shed_from_home(cost_N, home_N, num_ranks, cap, policy) for policy in (0, 1)]
        for node_aware in ((True, False) if rpn > 1 else (False,)):
            for policy in (0, 1):
                repaired, load, pool = shed[policy]
                if node_aware:  # the flat pass uses the shed result next
                    repaired, load = repaired.copy(), load.copy()
                placement_kernels.place_shed(cost_N, home_N, repaired, load, pool, cap, rpn if node_aware else 1)
                if load.max() > cap:
                    kernels.refine_bins(cost_N, repaired, load, phase.refine_iters, phase.refine_candidates, order,
                                        cap)
                if load.max() <= cap:
                    placement_kernels.move_back(cost_N, repaired, home_N, back_order, num_ranks, cap, rpn, False)
                    key = _move_key(repaired, home_N, rpn)
                    if key < best_key:
                        dest_N, best_key = repaired, key
    return dest_N


def _move_key(dest_N, home_N, ranks_per_node):
    """(cross-node moves, moves): what a candidate costs in traffic, slow links first."""
    moved = int((dest_N != home_N).sum())
    if ranks_per_node <= 1:
        return (moved, moved)
    return (int((dest_N // ranks_per_node != home_N // ranks_per_node).sum()), moved)


def _padded_starts(cost_sorted: np.ndarray, num_bins: int) -> np.ndarray:
    """Optimal sorted contiguous split for padded batches: binary search on the max load."""
    n = len(cost_sorted)
    if n == 0:
        return np.zeros(num_bins + 1, np.int64)
    lo = max(float(cost_sorted[0]), float(cost_sorted.sum()) / num_bins) * (1 - 1e-12)  # infeasible or optimal
    _, hi, starts = kernels.padded_split(cost_sorted, num_bins, float(cost_sorted[0]) * n)  # one batch: feasible
    best = starts
    for _ in range(200):
        if hi - lo <= 1e-12 * hi:
            break
        mid = 0.5 * (lo + hi)
        used, achieved, starts = kernels.padded_split(cost_sorted, num_bins, mid)
        if used <= num_bins:
            hi, best = achieved, starts  # achieved <= mid: a real load, so hi stays attainable
        else:
            lo = mid
    return best
