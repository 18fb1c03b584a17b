"""Fitting measured times: non-negative least squares of a group's cost features, and its quality.

A group's measured time is fitted as ``a*sum(l^2) + b*sum(l) + c*count + d`` with every coefficient
``>= 0`` (a negative per-token or per-sample time would let the packer "earn" time by adding
samples). The fit minimizes the *relative* error (each row weighted by ``1/time``): packed groups
span two orders of magnitude, and a plain least-squares fit would be exact on the largest groups
and wrong by 2x on the small ones.

With at most four features, non-negative least squares is solved exactly by trying every subset of
active features (16 least-squares solves) and keeping the feasible one with the least residual:
no iterative solver, no tolerance, the same answer on every machine.

Example:
    >>> import numpy as np
    >>> f_S4 = np.array([[1., 1, 1, 1], [4, 2, 1, 1], [9, 3, 1, 1], [8, 4, 2, 1], [50, 10, 2, 1]])
    >>> t_S = f_S4 @ np.array([0.5, 2.0, 0.0, 1.0])
    >>> [round(float(c), 6) for c in nnls_fit(f_S4, t_S)]
    [0.5, 2.0, 0.0, 1.0]
    >>> fit_quality(f_S4 @ nnls_fit(f_S4, t_S), t_S)
    (1.0, 0.0)
"""

from __future__ import annotations

from itertools import combinations

import numpy as np

__all__ = ["FEATURES", "fit_quality", "group_features", "nnls_fit", "scale_fit"]

#: The features of a group, in the order of every ``(..., 4)`` feature array: the sum of squared
#: lengths (attention), the sum of lengths (matmuls), the number of sequences (per-sample or
#: per-item overhead) and 1 (per-group overhead).
FEATURES = ("quadratic", "linear", "count", "constant")


def group_features(lengths: np.ndarray | list[int] | tuple[int, ...]) -> np.ndarray:
    """The (4,) features of one group from the lengths of its sequences (samples or items).

    Example:
        >>> group_features([3, 4]).tolist()
        [25.0, 7.0, 2.0, 1.0]
    """
    l = np.asarray(lengths, dtype=np.float64)
    return np.array([float((l * l).sum()), float(l.sum()), float(len(l)), 1.0])


def nnls_fit(features_SF: np.ndarray, seconds_S: np.ndarray, *, relative: bool = True) -> np.ndarray:
    """Non-negative least squares ``features_SF @ coeffs_F ~ seconds_S``; (F,) coefficients >= 0.

    Args:
        features_SF: one row per measured shape (see :data:`FEATURES`); F <= 6.
        seconds_S: the measured times, > 0 when ``relative``.
        relative: weight each row by ``1/seconds`` (minimize relative errors).

    Raises:
        ValueError: mismatched shapes, non-finite values, or more than 6 features.
    """
    f = np.asarray(features_SF, dtype=np.float64)
    t = np.asarray(seconds_S, dtype=np.float64)
    if f.ndim != 2 or t.shape != (f.shape[0],) or f.shape[1] > 6:
        raise ValueError(f"features {f.shape} and times {t.shape} do not match (at most 6 features)")
    if not (np.isfinite(f).all() and np.isfinite(t).all()):
        raise ValueError("features and times must be finite")
    w = 1.0 / np.maximum(t, np.finfo(np.float64).tiny) if relative else np.ones_like(t)
    # Scale each column to unit size so the solves are well conditioned; undone at the end.
    scale = np.abs(f).max(axis=0)
    scale[scale == 0] = 1.0
    a = f / scale * w[:, None]
    b = t * w
    best, best_res = np.zeros(f.shape[1]), float(b @ b)
    for size in range(1, f.shape[1] + 1):
        for active in combinations(range(f.shape[1]), size):
            cols = list(active)
            coef, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if (coef < 0).any():
                continue
            res = b - a[:, cols] @ coef
            value = float(res @ res)
            if value < best_res - 1e-15 * max(1.0, best_res):
                best = np.zeros(f.shape[1])
                best[cols] = coef
                best_res = value
    return best / scale


def fit_quality(predicted_S: np.ndarray, seconds_S: np.ndarray) -> tuple[float, float]:
    """``(R^2, worst relative error)`` of predictions against measured times.

    R^2 is ``1 - SS_res / SS_tot``; with one shape (or equal times) it is 1.0 when the predictions
    are exact and 0.0 otherwise.
    """
    p = np.asarray(predicted_S, dtype=np.float64)
    t = np.asarray(seconds_S, dtype=np.float64)
    res = float(((t - p) ** 2).sum())
    tot = float(((t - t.mean()) ** 2).sum())
    r2 = 1.0 - res / tot if tot > 0 else (1.0 if res == 0 else 0.0)
    rel = np.abs(p - t) / np.maximum(np.abs(t), np.finfo(np.float64).tiny)
    return round(r2, 12), round(float(rel.max()) if len(rel) else 0.0, 12)


def scale_fit(proxy_S: np.ndarray, seconds_S: np.ndarray) -> float:
    """The best constant ``k`` for ``seconds ~ k * proxy`` (relative least squares, ``k >= 0``).

    Used to compare a proxy (FLOPs, tokens) with the measured times on equal terms.

    Example:
        >>> round(scale_fit(np.array([1.0, 2.0]), np.array([3.0, 6.0])), 9)
        3.0
    """
    return float(nnls_fit(np.asarray(proxy_S, dtype=np.float64)[:, None], seconds_S)[0])
