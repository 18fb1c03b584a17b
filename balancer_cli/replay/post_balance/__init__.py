"""Batch post-balancing (OrchMLLM): rebalance each phase of a step across ranks.

- :func:`plan_post_balance`: the pure planner (numpy; numba-accelerated when installed); each
  phase is balanced by :mod:`~balancer_cli.replay.post_balance.search` over the loads of
  :mod:`~balancer_cli.replay.post_balance.loads`.
- :func:`manifest_phase_ranks`, :func:`phase_utilization`: the offline hook for
  ``balancer pack --post-balance`` and its metric; :func:`plan_from_phase_ranks` rebuilds a
  step's plan from the manifest's ``<m>_rank`` columns at training time.
- Execution (all-to-all of encoder inputs/outputs) lives in
  :mod:`balancer_cli.runtime.dispatch` (needs torch).

Example:
    >>> import numpy as np
    >>> plan = plan_post_balance([np.array([[4., 1.], [4., 1.]]), np.array([[0., 1.], [0., 1.]])])
    >>> plan.load_before[0].tolist(), plan.load_after[0].tolist(), int(plan.moved[0])
    ([8.0, 0.0], [4.0, 4.0], 1)
"""

from balancer_cli.replay.post_balance.loads import (
    ATTENTION_MODES,
    apply_cost_coeffs,
    phase_loads,
)
from balancer_cli.replay.post_balance.offline import (
    manifest_phase_ranks,
    phase_utilization,
    plan_from_phase_ranks,
)
from balancer_cli.replay.post_balance.plan import PostBalancePlan, plan_post_balance

__all__ = [
    "ATTENTION_MODES",
    "PostBalancePlan",
    "apply_cost_coeffs",
    "manifest_phase_ranks",
    "phase_loads",
    "phase_utilization",
    "plan_from_phase_ranks",
    "plan_post_balance",
]
