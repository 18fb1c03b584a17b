"""Post-balancing one step across 4 CPU processes (gloo): plan, dispatch, check against no dispatch.

Each rank draws 8 samples from the InternVL lengths; a sample's vision input is one 16-dim row
per 448 px tile; the "vision encoder" is a Linear layer with the same weights on every rank.
Every rank builds the same plan from one all_gather of costs, sends its tiles to the rank that
runs its vision phase, and gets the features back; the result must equal running the encoder
locally. Run: ``python examples/post_balance_gloo.py``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WORLD, PER_RANK, DIM = 4, 8, 16


def worker(rank: int, init_file: str) -> None:
    from balancer_cli.lengths import read_lengths
    from balancer_cli.runtime.dispatch import PhaseDispatcher, plan_from_local_costs

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    lengths = read_lengths(ROOT.parent / "shared/data/internvl-lengths/ai2d_train_12k_wh_token_lengths.json")
    pick = np.random.default_rng(rank).choice(lengths.num_samples, PER_RANK, replace=False)
    tiles, llm = lengths.items("vision")[pick], lengths.llm_tokens()[pick]
    # cost per tile: 1025 tokens, linear + attention term; the LLM phase stays home
    cost_nK = np.column_stack([tiles * (1025 + 1025 ** 2 / 6144), llm + llm ** 2 / 24576.0])
    plan = plan_from_local_costs(cost_nK, modules=("vision", "llm"))

    torch.manual_seed(0)
    vit = torch.nn.Linear(DIM, DIM)
    pixels = torch.randn(int(tiles.sum()), DIM, generator=torch.Generator().manual_seed(100 + rank))
    vision = PhaseDispatcher(plan, "vision")
    remote = vision.scatter(pixels, lengths=tiles)           # tiles this rank encodes
    feats = vision.gather(vit(remote), lengths=vision.remote_lengths)  # back home, own order
    local = vit(pixels)
    feats.sum().backward()
    err = (feats - local).abs().max().item()
    if rank == 0:
        print(f"vision load per rank before: {plan.load_before[0].round().tolist()}")
        print(f"vision load per rank after:  {plan.load_after[0].round().tolist()}")
        print(f"max/mean before {plan.load_before[0].max() / plan.load_before[0].mean():.3f}, "
              f"after {plan.load_after[0].max() / plan.load_after[0].mean():.3f}; "
              f"samples moved {int(plan.moved[0])} of {plan.num_samples}")
    dist.barrier()
    print(f"rank {rank}: encodes {vision.num_remote} samples ({int(remote.shape[0])} tiles) "
          f"instead of {PER_RANK} ({int(tiles.sum())} tiles); max |dispatched - local| = {err:.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(os.path.join(tmp, "init"),), nprocs=WORLD, join=True)
