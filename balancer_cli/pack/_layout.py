"""What the stages that swap samples between ranks read of a placed packing: its ranks' loads.

Example:
    >>> import numpy as np
    >>> from balancer_cli.pack.types import Assignment, Packing
    >>> p = Packing(order=np.arange(4), group_offsets=np.array([0, 1, 3, 4]), isolated=np.array([False, False, True]),
    ...             dropped=np.zeros(0, np.int64), dropped_reason=())
    >>> a = Assignment(step=np.array([0, 0, 0]), rank=np.array([0, 1, 1]), micro=np.array([0, 0, 1]), num_steps=1)
    >>> layout = rank_layout(p, a, np.array([[1.0], [2.0], [3.0], [4.0]]))
    >>> layout.slot_G.tolist(), layout.movable_G.tolist(), layout.rank_loads(0).tolist()  # isolated: load, no swap
    ([0, 1, 1], [True, True, False], [1.0, 9.0])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from balancer_cli._index import sum_rows
from balancer_cli.pack.types import Assignment, Packing, group_sums

__all__ = ["RankLayout", "rank_layout"]


@dataclass(frozen=True, kw_only=True)
class RankLayout:
    """A placed packing's groups by rank.

    Attributes:
        order: (P,) int64 the sample at each position, group by group.
        offsets: (G + 1,) int64 each group's first position.
        slot_G: (G,) each group's slot ``step * R + rank``; -1 for a group not placed.
        movable_G: (G,) groups whose samples may swap: placed, not isolated, not empty.
        csum_GK: (G, K) each group's cost sums.
        num_steps: S.
        world_size: R.
    """

    order: np.ndarray
    offsets: np.ndarray
    slot_G: np.ndarray
    movable_G: np.ndarray
    csum_GK: np.ndarray
    num_steps: int
    world_size: int

    def rank_loads(self, k: int) -> np.ndarray:
        """(S * R,) each slot's cost on module ``k``: the sum of its groups, isolated ones included
        (they run on the rank, though they never swap)."""
        on = self.slot_G >= 0
        total = self.num_steps * self.world_size
        return sum_rows(self.slot_G[on], self.csum_GK[on, k][:, None], total)[:, 0]


def rank_layout(packing: Packing, assignment: Assignment, cost_NK: np.ndarray) -> RankLayout:
    """The :class:`RankLayout` of ``packing`` placed by ``assignment``, its sums of ``cost_NK``."""
    offsets = np.asarray(packing.group_offsets, dtype=np.int64)
    step = np.asarray(assignment.step, dtype=np.int64)
    rank = np.asarray(assignment.rank, dtype=np.int64)
    count = np.diff(offsets)
    R = int(rank.max(initial=0)) + 1
    return RankLayout(order=np.asarray(packing.order, dtype=np.int64), offsets=offsets,
                      slot_G=np.where(step >= 0, step * R + rank, -1),
                      movable_G=(step >= 0) & ~np.asarray(packing.isolated, dtype=bool) & (count > 0),
                      csum_GK=group_sums(packing, cost_NK), num_steps=int(assignment.num_steps), world_size=R)
