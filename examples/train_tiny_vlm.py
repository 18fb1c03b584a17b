"""Train a tiny vision-language model on a manifest with DDP and measure how long ranks wait.

A tiny ViT encodes each sample's image patches, a linear projector maps them into a tiny causal
decoder that also reads the sample's text tokens. Weights are random and inputs are synthesized
deterministically from the lengths table (sample i gets ``vision_tokens[i]`` patch vectors and
``llm_tokens[i]`` token ids, times ``--token-scale``; the ViT attends within each image, tile or
frame), so each rank's compute follows the real workload of the samples the manifest gives it.

Each optimizer step runs the rank's micro-batches without gradient sync, then times an explicit
``barrier`` (the time this rank waits for the slowest one) before all-reducing the gradients. The
per-rank compute CPU time is
gathered too: on a machine shared with other jobs, ``max_r cpu_r - cpu_r`` is the wait an idle
machine would show (wall-clock waits there include other processes' noise). The
loss of a step is ``sum over its tokens / step_tokens(step).normalizer`` on every rank, and the
gradients are summed, so the update is the mean over the step's tokens whatever the balance.

Run (CPU, gloo)::

    torchrun --nproc_per_node 2 examples/train_tiny_vlm.py --manifest OUT --lengths LENGTHS --steps 20
    torchrun --nproc_per_node 2 examples/train_tiny_vlm.py --manifest OUT --lengths LENGTHS --steps 20 --baseline random

On GPUs the same command uses nccl. ``--json FILE`` writes the summary for scripts.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from balancer_cli.lengths import read_lengths
from balancer_cli.runtime import ManifestBatchSampler
from balancer_cli.replay.reader import ManifestReader

PATCH_DIM = 48  # 4 x 4 x 3 pixels per patch

# A finished gloo collective is freed by whichever thread drops its last reference, and freeing its
# tensors takes the GIL: when gloo's worker thread does it while the interpreter exits, the process
# aborts ("terminate called without an active exception") after all the work succeeded. The last
# step's and the final collectives' handles are held to the end, so the main thread frees them;
# only a few are kept (a handle keeps its tensors alive: the all-reduce's holds a gradient copy).
_RECENT_WORK: collections.deque = collections.deque(maxlen=4)


class TinyVLM(nn.Module):
    """ViT (2 layers) -> projector -> causal decoder (2 layers) -> LM head."""

    def __init__(self, dim: int = 64, vocab: int = 512, layers: int = 2) -> None:
        super().__init__()
        self.patch = nn.Linear(PATCH_DIM, dim)
        block = lambda: nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)  # noqa: E731
        self.vit = nn.ModuleList(block() for _ in range(layers))
        self.project = nn.Linear(dim, dim)
        self.embed = nn.Embedding(vocab, dim)
        self.decoder = nn.ModuleList(block() for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def sample_loss(self, patches: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Summed next-token loss of one sample and its number of loss tokens."""
        x = self.embed(ids)[None]
        if patches.numel():
            v = self.patch(patches)  # (items, tokens per item, dim): attention within each image/frame
            for layer in self.vit:
                v = layer(v)
            v = v.reshape(1, -1, v.shape[-1])
            n = min(v.shape[1], x.shape[1] - 1)  # image placeholders lead the LLM sequence
            x = torch.cat([self.project(v[:, :n]), x[:, n:]], dim=1)
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        for layer in self.decoder:
            x = layer(x, src_mask=causal, is_causal=True)
        logits = self.head(x[0, :-1])
        return nn.functional.cross_entropy(logits, ids[1:], reduction="sum"), len(ids) - 1


class SyntheticVLMData(torch.utils.data.Dataset):
    """Sample i: its encoder tokens as patch vectors, split evenly over its items (images, tiles,
    frames: the ViT attends within an item), and ``llm_tokens[i]`` token ids; seeded by i."""

    def __init__(self, lengths_path: str, token_scale: float, vocab: int = 512) -> None:
        lengths = read_lengths(lengths_path)
        zeros = np.zeros(lengths.num_samples, dtype=np.int64)
        vision = sum((lengths.tokens(m) for m in lengths.modules), zeros)
        items = sum((lengths.items(m) for m in lengths.modules), zeros)
        self.vision = np.maximum((vision * token_scale).astype(np.int64), 0)
        self.items = np.where(self.vision > 0, np.clip(items, 1, None), 0)
        self.llm = np.maximum((lengths.llm_tokens() * token_scale).astype(np.int64), 2)
        self.vocab = vocab

    def __len__(self) -> int:
        return len(self.llm)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(int(i))
        items = int(self.items[i])
        per_item = -(-int(self.vision[i]) // items) if items else 0
        return (torch.randn(items, per_item, PATCH_DIM, generator=g),
                torch.randint(0, self.vocab, (int(self.llm[i]),), generator=g))


class RandomGroups(torch.utils.data.Sampler):
    """Baseline: each step's samples in random groups of equal sample count (length-unaware batching),
    dealt to this job's ranks, whatever world size the manifest was packed for."""

    def __init__(self, manifest: str, rank: int, world_size: int, seed: int = 0) -> None:
        self.reader, self.rank, self.world_size, self.seed = ManifestReader(manifest), rank, world_size, seed
        self.batches_per_step = self.reader.micro_batches

    def __iter__(self):
        M = self.reader.micro_batches
        G = self.world_size * M
        for step in range(self.reader.num_steps):
            samples = np.random.default_rng([self.seed, step]).permutation(self.reader.step_samples(step))
            groups = np.array_split(samples, G)
            yield from (g.tolist() for g in groups[self.rank * M:(self.rank + 1) * M])

    def __len__(self) -> int:
        return self.reader.num_steps * self.reader.micro_batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--manifest", required=True)
    parser.add_argument("--lengths", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--baseline", choices=["balanced", "random"], default="balanced")
    parser.add_argument("--token-scale", type=float, default=None,
                        help="multiply token counts (default 1 on GPU, 0.125 on CPU)")
    parser.add_argument("--json", default=None, help="write the summary as JSON to this file (rank 0)")
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    args = parser.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # shows the elastic replay report
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    scale = args.token_scale if args.token_scale is not None else (1.0 if cuda else 0.125)
    torch.manual_seed(0)

    dataset = SyntheticVLMData(args.lengths, scale)
    sampler = ManifestBatchSampler(args.manifest, lengths=args.lengths, dataset=dataset)
    batches = sampler if args.baseline == "balanced" else RandomGroups(args.manifest, rank, world)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=batches, collate_fn=lambda b: b, num_workers=1)
    model = nn.parallel.DistributedDataParallel(TinyVLM().to(device))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)

    records, micro, step = [], 0, 0
    compute = compute_cpu = 0.0
    for batch in loader:
        sync()
        t0, c0 = time.perf_counter(), time.thread_time()
        with model.no_sync():  # gradients accumulate locally; one explicit sync per step below
            for patches, ids in batch:
                loss, _ = model.module.sample_loss(patches.to(device), ids.to(device))
                (loss / sampler.step_tokens(step).normalizer).backward()
        sync()
        compute += time.perf_counter() - t0
        compute_cpu += time.thread_time() - c0
        micro += 1
        if micro < batches.batches_per_step:
            continue
        t1 = time.perf_counter()
        dist.barrier()  # waits for the slowest rank: the imbalance cost
        wait = time.perf_counter() - t1
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads])
        _wait(dist.all_reduce(flat, async_op=True))  # sum: the loss is already normalized by the global token count
        _unflatten(flat, grads)
        opt.step()
        opt.zero_grad(set_to_none=False)
        # CPU time of the compute is immune to other processes on a shared machine: the slowest
        # rank's CPU time minus ours is the wait an otherwise idle machine would show.
        cpu = torch.tensor([compute_cpu], dtype=torch.float64, device=device)  # nccl gathers device tensors
        cpus = [torch.zeros_like(cpu) for _ in range(world)]
        _wait(dist.all_gather(cpus, cpu, async_op=True))
        cpu_wait = max(float(c) for c in cpus) - compute_cpu
        records.append((compute, wait, compute_cpu, cpu_wait))
        if not args.quiet:
            print(f"rank {rank} step {step:4d} compute {compute * 1e3:8.1f} ms  wait {wait * 1e3:8.1f} ms  "
                  f"(cpu {compute_cpu * 1e3:8.1f} ms, cpu wait {cpu_wait * 1e3:8.1f} ms)", flush=True)
        step, micro, compute, compute_cpu = step + 1, 0, 0.0, 0.0
        if step >= args.steps:
            break

    totals = torch.tensor([[sum(r[i] for r in records) for i in range(4)]], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(totals) for _ in range(world)]
    _wait(dist.all_gather(gathered, totals, async_op=True))
    if rank == 0:
        per_rank = torch.cat(gathered).cpu().tolist()
        share = lambda c, w: sum(r[w] for r in per_rank) / sum(r[c] + r[w] for r in per_rank)  # noqa: E731
        wait_share, cpu_wait_share = share(0, 1), share(2, 3)
        summary = {"batching": args.baseline, "steps": step, "world_size": world, "token_scale": scale,
                   "compute_s_per_rank": [round(r[0], 3) for r in per_rank],
                   "wait_s_per_rank": [round(r[1], 3) for r in per_rank], "wait_share": round(wait_share, 4),
                   "cpu_compute_s_per_rank": [round(r[2], 3) for r in per_rank],
                   "cpu_wait_s_per_rank": [round(r[3], 3) for r in per_rank],
                   "cpu_wait_share": round(cpu_wait_share, 4)}
        print(f"{args.baseline}: {step} steps on {world} ranks, waiting share {wait_share:.1%} measured at the "
              f"barrier, {cpu_wait_share:.1%} from per-rank compute CPU time "
              f"(compute s per rank {summary['compute_s_per_rank']}, wait s {summary['wait_s_per_rank']})", flush=True)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(summary, handle)
    dist.barrier()  # leave together: no rank tears gloo down while another still talks
    dist.destroy_process_group()


def _wait(work: dist.Work) -> None:
    """Wait for a collective started with ``async_op=True`` and hold its handle (see ``_RECENT_WORK``)."""
    work.wait()
    _RECENT_WORK.append(work)


def _unflatten(flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


if __name__ == "__main__":
    main()
