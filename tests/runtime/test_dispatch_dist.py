"""Real multi-process check of the post-balancing dispatcher (torch.distributed, gloo on CPU).

Three processes run one step with dispatching (encoder inputs to their phase rank, outputs to the
LLM-phase rank) and compare outputs and gradients with the same step computed without any
dispatching, from the same global data.
"""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from dist_util import free_tcp_init_method, shutdown, spawn  # noqa: E402


WORLD = 3
FEAT_IN, FEAT_OUT = 4, 5
# (rows (vision items) per sample on each rank, LLM cost per sample, balance_llm); a text-only
# sample has 0 rows; in the last scenario rank 1 has no samples at all
SCENARIOS = [
    ([[5, 4, 3, 1], [1, 2], [0, 2]], [[1.0, 1.0, 1.0, 1.0], [50.0, 1.0], [1.0, 1.0]], False),
    ([[5, 4, 3, 1], [1, 2], [0, 2]], [[1.0, 1.0, 1.0, 1.0], [50.0, 1.0], [1.0, 1.0]], True),
    ([[6, 2], [], [1, 0, 3]], [[1.0, 1.0], [], [1.0, 1.0, 1.0]], False),
]


def _global_data(ROWS):
    gen = torch.Generator().manual_seed(1234)
    x = [[torch.randn(n, FEAT_IN, generator=gen, dtype=torch.float64) for n in rows] for rows in ROWS]
    w = [[torch.randn(1, FEAT_OUT, generator=gen, dtype=torch.float64) for _ in rows] for rows in ROWS]
    return x, w


def _encoder():
    torch.manual_seed(0)  # identical weights on every rank
    return torch.nn.Linear(FEAT_IN, FEAT_OUT, dtype=torch.float64)


def _loss(rows_out, pooled, w):
    """Per-sample loss: row outputs squared plus pooled output against a per-sample weight."""
    return sum((r ** 2).sum() * 0.5 + (p * wi).sum() for r, p, wi in zip(rows_out, pooled, w))


def _reference(ROWS):
    """The same step without dispatching: every sample's encoder runs on its own rank."""
    x, w = _global_data(ROWS)
    lin = _encoder()
    xs = [[t.clone().requires_grad_(True) for t in rank] for rank in x]
    outs = [[lin(t) for t in rank] for rank in xs]
    pooled = [[o.sum(0, keepdim=True) for o in rank] for rank in outs]
    total = sum(_loss(o, p, wr) for o, p, wr in zip(outs, pooled, w))
    total.backward()
    return outs, pooled, [[t.grad for t in rank] for rank in xs], lin.weight.grad.clone()


def _segment_sum(rows, lengths):
    index = torch.repeat_interleave(torch.arange(len(lengths)), torch.as_tensor(lengths, dtype=torch.int64))
    out = rows.new_zeros((len(lengths), rows.shape[1]))
    return out.index_add(0, index, rows)


def _worker(rank, init_method):
    from balancer_cli.runtime.dispatch import PhaseDispatcher, plan_from_local_costs

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD)
    try:
        for ROWS, LLM_COST, balance_llm in SCENARIOS:
            ref_out, ref_pooled, ref_grad_x, ref_grad_w = _reference(ROWS)
            x, w = _global_data(ROWS)
            cost_nK = np.stack([np.array(ROWS[rank], dtype=np.float64) ** 2,
                                 np.array(LLM_COST[rank], dtype=np.float64)], axis=1).reshape(-1, 2)
            plan = plan_from_local_costs(cost_nK, modules=("vision", "llm"), balance_llm=balance_llm)
            assert plan.moved[0] > 0, "the scenario must move vision samples"
            assert (plan.moved[1] > 0) == balance_llm
            lin = _encoder()
            x_local = [t.clone().requires_grad_(True) for t in x[rank]]
            packed = torch.cat(x_local) if x_local else torch.zeros(0, FEAT_IN, dtype=torch.float64)
            vision = PhaseDispatcher(plan, "vision")
            # a rank without samples passes a plain empty tensor: every rank syncs the backward
            remote = vision.scatter(packed, lengths=ROWS[rank], sync_backward=True)
            feats = lin(remote)
            rows_back = vision.gather(feats, lengths=vision.remote_lengths)
            home_lengths = vision.home_lengths
            pooled_back = vision.gather(_segment_sum(feats, vision.remote_lengths))  # one row per sample
            # the LLM-phase rank also needs each sample's LLM inputs (here: its loss weight)
            w_packed = torch.cat(w[rank]) if w[rank] else torch.zeros(0, FEAT_OUT, dtype=torch.float64)
            w_llm = PhaseDispatcher(plan, "llm").scatter(w_packed)
            src, idx = plan.phase_samples("llm", rank)
            rows_list = list(torch.split(rows_back, home_lengths.tolist()))
            for k, (s, j) in enumerate(zip(src.tolist(), idx.tolist())):
                torch.testing.assert_close(rows_list[k], ref_out[s][j].detach())
                torch.testing.assert_close(pooled_back[k:k + 1], ref_pooled[s][j].detach())
                torch.testing.assert_close(w_llm[k:k + 1], w[s][j])
            if not balance_llm:  # LLM phase at home: own samples in own order
                assert src.tolist() == [rank] * len(ROWS[rank])
            loss = _loss(rows_list, [pooled_back[k:k + 1] for k in range(len(src))], w_llm)
            (loss + 0.0 * rows_back.sum() + 0.0 * pooled_back.sum()).backward()
            for j, t in enumerate(x_local):
                torch.testing.assert_close(t.grad, ref_grad_x[rank][j])
            grad_w = lin.weight.grad.clone()
            dist.all_reduce(grad_w)  # what DDP does: the global batch is unchanged
            torch.testing.assert_close(grad_w, ref_grad_w)
    finally:
        shutdown(dist)


@pytest.mark.dist
def test_dispatch_matches_undispatched_step():
    spawn(_worker, (free_tcp_init_method(),), WORLD)


def _simulate(routes, items_by_rank):
    """What ``_Route.run`` does across all ranks, with Python lists instead of all_to_all."""
    world = len(routes)
    outboxes = []
    for route, items in zip(routes, items_by_rank):
        ordered = [items[i] for i in route.send_order]
        cuts = np.cumsum([0] + route.send_counts)
        outboxes.append([ordered[cuts[q]:cuts[q + 1]] for q in range(world)])
    delivered = []
    for q, route in enumerate(routes):
        arrived = [item for src in range(world) for item in outboxes[src][q]]
        assert len(arrived) == sum(route.recv_counts)
        delivered.append([arrived[k] for k in route.to_canonical])
    return delivered


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(0, 5), min_size=1, max_size=5), seed=st.integers(0, 2 ** 16),
       balance_llm=st.booleans())
def test_routes_deliver_every_sample_to_its_phase_rank(sizes, seed, balance_llm):
    from balancer_cli.replay.post_balance import plan_post_balance
    from balancer_cli.runtime.dispatch import _routes

    rng = np.random.default_rng(seed)
    plan = plan_post_balance([rng.integers(0, 20, (n, 3)).astype(float) for n in sizes], balance_llm=balance_llm)
    world = len(sizes)
    for m in range(3):
        routes = [_routes(plan, m, r) for r in range(world)]
        remote = _simulate([s for s, _ in routes], [[(r, j) for j in range(n)] for r, n in enumerate(sizes)])
        for r in range(world):  # scatter: exactly the phase's samples, canonical order
            src, idx = plan.phase_samples(m, r)
            assert remote[r] == list(zip(src.tolist(), idx.tolist()))
        back = _simulate([g for _, g in routes], remote)
        for r in range(world):  # gather: the LLM phase's samples, canonical order
            src, idx = plan.phase_samples("llm", r)
            assert back[r] == list(zip(src.tolist(), idx.tolist()))


def test_dispatcher_single_rank_round_trip_and_bad_usage(tmp_path):
    from balancer_cli.errors import UsageError
    from balancer_cli.replay.post_balance import plan_post_balance
    from balancer_cli.runtime.dispatch import PhaseDispatcher

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        vision = PhaseDispatcher(plan_post_balance([np.ones((2, 2))], modules=("vision", "llm")), "vision")
        x = torch.arange(6.0).reshape(3, 2)
        remote = vision.scatter(x, lengths=[1, 2])
        assert torch.equal(remote, x) and vision.remote_lengths.tolist() == [1, 2]
        back = vision.gather(remote * 2, lengths=vision.remote_lengths)
        assert torch.equal(back, x * 2) and vision.home_lengths.tolist() == [1, 2]
        as_list = vision.scatter([x[:1], x[1:]])
        assert [t.shape[0] for t in as_list] == [1, 2]
        with pytest.raises(UsageError, match="2 lengths summing to 4 for 2 samples and 3 rows"):
            vision.scatter(x, lengths=[2, 2])
        with pytest.raises(UsageError, match="got 1 samples, the plan has 2 here"):
            vision.scatter([x])
        with pytest.raises(UsageError, match="plan is for 2 ranks but the process group has 1"):
            PhaseDispatcher(plan_post_balance([np.ones((1, 2)), np.ones((1, 2))]), 0)
    finally:
        dist.destroy_process_group()
