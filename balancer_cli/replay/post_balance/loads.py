"""The load of a post-balancing phase on each rank, per attention mode, and length-based costs.

A phase's load on a rank is what its slowest part waits for: the summed cost of its samples for
packed sequences (``"varlen"``), or batch size x largest cost for a padded micro-batch
(``"padded"``).

Example:
    >>> import numpy as np
    >>> cost_N, rank_N = np.array([3., 1., 2.]), np.array([0, 0, 1])
    >>> phase_loads(cost_N, rank_N, 2).tolist(), phase_loads(cost_N, rank_N, 2, "padded").tolist()
    ([4.0, 2.0], [6.0, 2.0])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["ATTENTION_MODES", "phase_loads", "apply_cost_coeffs"]


def _summed(cost_N: np.ndarray, rank_N: np.ndarray, world_size: int) -> np.ndarray:
    return np.bincount(rank_N, weights=cost_N, minlength=world_size)[:world_size]


def _padded(cost_N: np.ndarray, rank_N: np.ndarray, world_size: int) -> np.ndarray:
    count = np.bincount(rank_N, minlength=world_size)[:world_size]
    peak = np.zeros(world_size)
    np.maximum.at(peak, rank_N, cost_N)
    return count * peak


#: Attention mode -> the (R,) load of a phase from each sample's cost and rank.
_LOADS: dict[str, Callable[[np.ndarray, np.ndarray, int], np.ndarray]] = {"varlen": _summed, "padded": _padded}
ATTENTION_MODES = tuple(_LOADS)


def phase_loads(cost_N: np.ndarray, rank_N: np.ndarray, world_size: int, attention: str = "varlen") -> np.ndarray:
    """(R,) load of one phase: summed cost (varlen) or ``count x max cost`` (padded).

    Example:
        >>> phase_loads(np.array([3., 1., 2.]), np.array([0, 0, 1]), 2, "padded").tolist()
        [6.0, 2.0]
    """
    return _LOADS[attention](np.asarray(cost_N, dtype=np.float64), np.asarray(rank_N, dtype=np.int64), world_size)


def apply_cost_coeffs(lengths_nK: np.ndarray, cost_coeffs: Sequence[tuple[float, ...] | None]) -> np.ndarray:
    """Turn per-module lengths into costs ``alpha*len + beta*len**2 (+ gamma if len > 0)``; None keeps
    the column. ``(alpha, beta, gamma)`` is what a calibration gives for one sequence per sample
    (:meth:`balancer_cli.cost.measured.MeasuredCosts.cost_coeffs`): gamma is its per-sample time.

    Example:
        >>> apply_cost_coeffs(np.array([[10., 3.], [0., 1.]]), [(1.0, 0.1, 5.0), None]).tolist()
        [[25.0, 3.0], [0.0, 1.0]]
    """
    out = np.array(lengths_nK, dtype=np.float64, copy=True)
    for m, coeff in enumerate(cost_coeffs):
        if coeff is not None:
            alpha, beta, *rest = coeff
            gamma = rest[0] if rest else 0.0
            col = out[:, m]
            out[:, m] = alpha * col + beta * col ** 2 + gamma * (col > 0)
    return out
