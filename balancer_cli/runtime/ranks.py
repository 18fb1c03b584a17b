"""Which data-parallel rank this process is, and how many there are.

Example:
    >>> resolve_rank(1, 4)
    (1, 4)
"""

from __future__ import annotations

import os

import torch

from balancer_cli.replay.cursor import check_rank

__all__ = ["resolve_rank"]


def resolve_rank(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)``: explicit values, else ``RANK``/``WORLD_SIZE``, else torch.distributed, else (0, 1).

    Raises:
        UsageError: ``world_size < 1`` or ``rank`` outside ``0..world_size-1``.

    Example:
        >>> resolve_rank(1, 4)
        (1, 4)
    """
    if rank is None or world_size is None:
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            env = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        elif torch.distributed.is_available() and torch.distributed.is_initialized():
            env = torch.distributed.get_rank(), torch.distributed.get_world_size()
        else:
            env = 0, 1
        rank = env[0] if rank is None else rank
        world_size = env[1] if world_size is None else world_size
    return check_rank(rank, world_size, fix="pass {rank} in 0..{world_size}-1, or set RANK and WORLD_SIZE")
