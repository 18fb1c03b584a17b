"""Balance metrics shared with the OmniBal paper: Dist Ratio, Pad Ratio, utilization.

For a step s, module m and rank r, ``T(s, r)`` is the summed cost of the rank's groups at that
step; :func:`step_loads` builds that (S, R) matrix from per-sample placements. All metrics are
pure numpy functions, used by the report (computed from a written manifest) and by benchmarks.

- **Dist Ratio** (inter-rank imbalance), per step: ``sum_r (max_r T - T(s, r)) / (max_r T * R)``;
  :func:`dist_ratio` is its mean over steps. 0 is perfect.
- **Pad Ratio** (intra-batch padding) if each group were a padded micro-batch of B samples:
  ``sum_i (t_max - t_i) / (t_max * B)`` pooled over groups as ``sum(pad) / sum(t_max * B)``.
- **Utilization**: ``sum_s sum_r T / (R * sum_s max_r T)``, the share of rank time spent working
  when each step waits for its slowest rank; :func:`step_utilization` does the same for a whole
  step whose modules run one after another (step time = ``sum_m max_r T``).
- **Random step mix distance**: :func:`random_mix_distance`, the total-variation distance from
  the global source mix that a random draw of a step's size is expected to have (what the
  packer's mixing steps compare their steps against before they run).

Example:
    >>> import numpy as np
    >>> load_SR = step_loads(np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1]), np.array([4., 2., 3., 3.]),
    ...                      num_steps=2, world_size=2)
    >>> load_SR.tolist(), dist_ratio(load_SR), utilization(load_SR)
    ([[4.0, 2.0], [3.0, 3.0]], 0.125, 0.8571428571428571)
    >>> pad_ratio(np.array([0, 0, 1]), np.array([4., 2., 5.]))  # 2 pad tokens / (4*2 + 5*1)
    0.15384615384615385
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
    "step_loads",
    "dist_ratio_per_step",
    "dist_ratio",
    "utilization",
    "step_utilization",
    "pad_ratio",
    "random_mix_distance",
]


def step_loads(step_P: np.ndarray, rank_P: np.ndarray, cost_P: np.ndarray, *, num_steps: int,
               world_size: int) -> np.ndarray:
    """Sum per-placement costs into the (S, R) matrix ``T(s, r)``.

    Args:
        step_P, rank_P: (P,) step and rank of each placed sample.
        cost_P: (P,) cost of each placed sample in one module.
        num_steps, world_size: the matrix shape (steps without placements stay 0).

    Returns:
        (num_steps, world_size) float64.
    """
    flat = np.asarray(step_P, dtype=np.int64) * world_size + np.asarray(rank_P, dtype=np.int64)
    sums = np.bincount(flat, weights=np.asarray(cost_P, dtype=np.float64), minlength=num_steps * world_size)
    return sums[: num_steps * world_size].reshape(num_steps, world_size)


def dist_ratio_per_step(load_SR: np.ndarray) -> np.ndarray:
    """(S,) Dist Ratio of each step; a step with no load at all counts as balanced (0)."""
    load_SR = np.asarray(load_SR, dtype=np.float64)
    if load_SR.size == 0:
        return np.zeros(load_SR.shape[0])
    peak_S = load_SR.max(axis=1)
    idle_S = (peak_S[:, None] - load_SR).sum(axis=1)
    denom_S = peak_S * load_SR.shape[1]
    return np.divide(idle_S, denom_S, out=np.zeros_like(idle_S), where=denom_S > 0)


def dist_ratio(load_SR: np.ndarray) -> float:
    """Mean over steps of the per-step Dist Ratio (0 = every rank equally loaded at every step)."""
    per_step = dist_ratio_per_step(load_SR)
    return float(per_step.mean()) if len(per_step) else 0.0


def utilization(load_SR: np.ndarray) -> float:
    """``sum T / (R * sum_s max_r T)``; 1.0 when there is no load at all (nothing waits)."""
    load_SR = np.asarray(load_SR, dtype=np.float64)
    if load_SR.size == 0:
        return 1.0
    busy = float(load_SR.max(axis=1).sum()) * load_SR.shape[1]
    return float(load_SR.sum()) / busy if busy > 0 else 1.0


def step_utilization(loads_SR: Sequence[np.ndarray]) -> float:
    """Utilization of whole steps whose modules run one after another.

    Args:
        loads_SR: one (S, R) matrix per module, all in the same time unit.

    Returns:
        ``sum_m sum T_m / (R * sum_s sum_m max_r T_m)``.

    Example:
        >>> step_utilization([np.array([[2., 0.]]), np.array([[0., 2.]])])
        0.5
    """
    loads = [np.asarray(x, dtype=np.float64) for x in loads_SR]
    if not loads or loads[0].size == 0:
        return 1.0
    world_size = loads[0].shape[1]
    busy = sum(float(x.max(axis=1).sum()) for x in loads) * world_size
    work = sum(float(x.sum()) for x in loads)
    return work / busy if busy > 0 else 1.0


def pad_ratio(group_P: np.ndarray, cost_P: np.ndarray) -> float:
    """Pooled Pad Ratio if every group were a padded micro-batch.

    Args:
        group_P: (P,) group id of each placed sample (any non-negative ints).
        cost_P: (P,) per-sample length in the module (e.g. tokens).

    Returns:
        ``sum_g sum_i (t_max_g - t_i) / sum_g (t_max_g * B_g)``; 0 when nothing has length.
    """
    group_P = np.asarray(group_P, dtype=np.int64)
    cost_P = np.asarray(cost_P, dtype=np.float64)
    if len(group_P) == 0:
        return 0.0
    _, dense = np.unique(group_P, return_inverse=True)
    num_groups = int(dense.max()) + 1
    t_max_G = np.full(num_groups, -np.inf)
    np.maximum.at(t_max_G, dense, cost_P)
    size_G = np.bincount(dense, minlength=num_groups)
    padded = float((t_max_G * size_G).sum())
    return (padded - float(cost_P.sum())) / padded if padded > 0 else 0.0


def random_mix_distance(share_O: np.ndarray, size_S: np.ndarray) -> np.ndarray:
    """(S,) expected total-variation distance from the mix ``share_O`` of a random draw of
    ``size_S`` samples: ``0.5 * sum_o E|share - p_o|``, ``E|share - p| ~ sqrt(2 / pi) sqrt(p (1 - p) / size)``.

    Example:
        >>> round(float(random_mix_distance(np.array([0.5, 0.5]), np.array([100.0]))[0]), 4)
        0.0399
    """
    share_O = np.asarray(share_O, dtype=np.float64)
    size_S = np.asarray(size_S, dtype=np.float64)
    return 0.5 * (np.sqrt(2.0 / np.pi) * np.sqrt(share_O[None, :] * (1.0 - share_O[None, :]) / size_S[:, None]).sum(axis=1))
