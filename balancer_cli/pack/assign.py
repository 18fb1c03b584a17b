# DEV SHIM (untracked) - replaced by the packer branch
import numpy as np
from balancer_cli.pack.types import Assignment
def assign_groups(cost_GK, *, world_size, micro_batches, seed=0):
    G = len(cost_GK); per = world_size * micro_batches
    S = G // per
    order = np.argsort(-np.asarray(cost_GK).sum(axis=1), kind="stable")
    step = np.full(G, -1, np.int32); rank = np.zeros(G, np.int32); micro = np.zeros(G, np.int32)
    for j, g in enumerate(order[: S * per]):
        step[g] = j % S; rank[g] = (j // S) % world_size; micro[g] = j // (S * world_size)
    return Assignment(step, rank, micro, S)
