"""Execute a post-balancing plan: per-phase all-to-all of encoder inputs and outputs.

A :class:`~balancer_cli.replay.post_balance.PostBalancePlan` says which rank runs each sample in each
phase. :class:`PhaseDispatcher` moves one module's inputs from the rank that holds each sample
(its data rank) to the rank that runs the module for it, and the module's outputs on to the rank
that runs the sample's LLM phase, with ``torch.distributed.all_to_all_single`` and variable split
sizes (per-sample row counts are exchanged first, so samples may have any number of rows). Both
transfers are differentiable: gradients travel back the same way, so a step with dispatching
gives the same outputs and gradients as one without.

Order contract: on every rank, the samples a phase runs are in canonical order, by (data rank,
index on that rank) (:meth:`PostBalancePlan.phase_samples`). With the LLM phase at home (the
default), :meth:`PhaseDispatcher.gather` returns each rank's own samples in its own order.

Example (every rank runs this; ``pixels`` is this rank's packed vision input)::

    from balancer_cli.runtime.dispatch import PhaseDispatcher, plan_from_local_costs

    cost_nK = np.stack([vision_cost, llm_cost], axis=1)          # this rank's samples
    plan = plan_from_local_costs(cost_nK, modules=("vision", "llm"))  # one all_gather
    vision = PhaseDispatcher(plan, "vision")
    remote = vision.scatter(pixels, lengths=tiles_per_sample)      # (rows, C, H, W) to run here
    feats = vit(remote)                                             # any row-wise encoder
    local_feats = vision.gather(feats, lengths=vision.remote_lengths)  # back home, own order
    # local_feats[i] rows belong to this rank's sample i (vision.home_lengths rows each)

Every rank must call ``scatter``/``gather`` (collectives), and every rank's gathered output must
reach the loss (``loss + out.sum() * 0`` where a rank has nothing to use) so that every rank also
runs the backward all-to-all; if inputs require grad on some ranks only (a rank without samples
passing a plain empty tensor), pass ``sync_backward=True`` on every rank. Tensors must have the same
dtype and trailing shape on all ranks; a rank without samples passes a (0, ...) tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from balancer_cli._index import concat_ranges
from balancer_cli.errors import UsageError
from balancer_cli.replay.post_balance import PostBalancePlan, plan_post_balance

__all__ = ["PhaseDispatcher", "all_to_all_rows", "plan_from_local_costs"]


class _AllToAllRows(torch.autograd.Function):
    """``all_to_all_single`` over rows whose backward sends gradients back the reverse way.

    ``anchor`` (a scalar that requires grad, or None) makes the output require grad even when
    ``x`` does not, so that this rank joins the backward all-to-all like the others.
    """

    @staticmethod
    def forward(ctx, x, recv_rows, send_rows, group, anchor):
        ctx.recv_rows, ctx.send_rows, ctx.group = recv_rows, send_rows, group
        out = x.new_empty((sum(recv_rows), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_rows, send_rows, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_x = grad_out.new_empty((sum(ctx.send_rows), *grad_out.shape[1:]))
        dist.all_to_all_single(grad_x, grad_out.contiguous(), ctx.send_rows, ctx.recv_rows, group=ctx.group)
        return (grad_x if ctx.needs_input_grad[0] else None), None, None, None, None


def all_to_all_rows(x: torch.Tensor, send_rows: Sequence[int], recv_rows: Sequence[int], group=None, *,
                    sync_backward: bool = False) -> torch.Tensor:
    """Differentiable variable-size all-to-all: rows ``x[sum(send_rows[:q]):...]`` go to rank q.

    Args:
        x: (sum(send_rows), ...) rows grouped by destination rank.
        send_rows: R rows to send to each rank.
        recv_rows: R rows to receive from each rank (must match the senders' ``send_rows``).
        group: process group (default: the world).
        sync_backward: join the backward all-to-all even if ``x`` does not require grad (set it
            on every rank when some ranks' inputs require grad and others' do not, e.g. empty).

    Returns:
        (sum(recv_rows), ...) rows grouped by source rank.

    Example (one process here; in a job every rank calls it with its own rows):
        >>> import tempfile
        >>> dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/init", rank=0, world_size=1)
        >>> all_to_all_rows(torch.arange(3.0), send_rows=[3], recv_rows=[3]).tolist()
        [0.0, 1.0, 2.0]
        >>> dist.destroy_process_group()
    """
    anchor = None
    if sync_backward and torch.is_grad_enabled() and not x.requires_grad and x.is_floating_point():
        anchor = torch.zeros((), device=x.device, requires_grad=True)
    return _AllToAllRows.apply(x, [int(v) for v in recv_rows], [int(v) for v in send_rows], group, anchor)


def _row_index(sample_order: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Row indices that list the rows of samples ``sample_order`` of a packed tensor, in that order."""
    starts = np.concatenate([[0], np.cumsum(lengths)])[:-1]
    return concat_ranges(starts[sample_order], lengths[sample_order])


class _Route:
    """One all-to-all of samples: who sends what where, and how to reorder on arrival."""

    def __init__(self, send_to: np.ndarray, recv_from: np.ndarray, arrival: np.ndarray, world_size: int):
        # send_to: destination rank of each local item (local order); recv_from: source rank of
        # each item this rank gets, in arrival order; arrival: canonical position of each arrival.
        self.send_to, self.recv_from, self.world_size = send_to, recv_from, world_size
        self.send_order = np.argsort(send_to, kind="stable")
        self.send_counts = np.bincount(send_to, minlength=world_size).tolist()
        self.recv_counts = np.bincount(recv_from, minlength=world_size).tolist()
        self.to_canonical = np.argsort(arrival, kind="stable")  # arrival position of canonical k
        self.identity = bool((self.to_canonical == np.arange(len(arrival))).all())

    def run(self, x: torch.Tensor, lengths: np.ndarray, group, sync_backward: bool) -> tuple[torch.Tensor, np.ndarray]:
        lengths = np.asarray(lengths, dtype=np.int64)
        send_len = lengths[self.send_order]
        # the counts travel on the data's device (NCCL only moves GPU tensors)
        len_in = torch.from_numpy(np.ascontiguousarray(send_len)).to(x.device)
        len_out = torch.empty(sum(self.recv_counts), dtype=torch.int64, device=x.device)
        dist.all_to_all_single(len_out, len_in, self.recv_counts, self.send_counts, group=group)
        recv_len = len_out.cpu().numpy()
        send_rows = np.bincount(self.send_to, weights=lengths, minlength=self.world_size).astype(np.int64)
        recv_rows = np.bincount(self.recv_from, weights=recv_len, minlength=self.world_size).astype(np.int64)
        rows = _row_index(self.send_order, lengths)
        in_place = len(rows) == x.shape[0] and bool((rows == np.arange(len(rows))).all())
        send = x if in_place else x.index_select(0, torch.from_numpy(rows).to(x.device))
        out = all_to_all_rows(send, send_rows.tolist(), recv_rows.tolist(), group, sync_backward=sync_backward)
        if self.identity:
            return out, recv_len
        back = _row_index(self.to_canonical, recv_len)
        return out.index_select(0, torch.from_numpy(back).to(out.device)), recv_len[self.to_canonical]


def _routes(plan: PostBalancePlan, module: int, rank: int) -> tuple[_Route, _Route]:
    """The scatter and gather routes of ``rank`` for ``module`` (pure: no communication)."""
    dest = plan.dest_KN[module].astype(np.int64)
    to_llm = plan.dest_KN[plan.llm_index].astype(np.int64)
    lo, hi = plan.offsets[rank], plan.offsets[rank + 1]
    here = np.flatnonzero(dest == rank)  # this phase's samples on this rank, canonical
    # scatter: arrivals come by source rank, each in its local order: already canonical
    scatter = _Route(dest[lo:hi], plan.home_N[here].astype(np.int64), np.arange(len(here)), plan.world_size)
    # gather: to each sample's LLM-phase rank; arrivals by encoder rank, canonical by flat id
    mine = np.flatnonzero(to_llm == rank)
    arrive_from = dest[mine]
    arrival_sorted = np.argsort(arrive_from, kind="stable")
    gather = _Route(to_llm[here], arrive_from[arrival_sorted], arrival_sorted, plan.world_size)
    return scatter, gather


class PhaseDispatcher:
    """Moves one module's inputs to the ranks that run it and its outputs to the LLM-phase ranks.

    Args:
        plan: this step's plan (identical on every rank).
        module: the module (name or index) whose phase this dispatcher serves. For the LLM
            module, :meth:`scatter` moves the LLM inputs (text tokens, labels) to the LLM-phase
            rank (only needed with ``balance_llm=True``).
        group: process group (default: the world); its size must be ``plan.world_size``.
        rank: this rank in ``group`` (default: ``dist.get_rank(group)``).

    Attributes (after :meth:`scatter` / :meth:`gather`):
        remote_lengths: rows of each sample received by :meth:`scatter` (canonical order).
        home_lengths: rows of each sample returned by :meth:`gather` (LLM-phase canonical order).

    Example (one process here, so nothing moves; see the module docstring for a job):
        >>> import tempfile
        >>> from balancer_cli.replay.post_balance import plan_post_balance
        >>> dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/init", rank=0, world_size=1)
        >>> vision = PhaseDispatcher(plan_post_balance([np.ones((2, 2))], modules=("vision", "llm")), "vision")
        >>> remote = vision.scatter(torch.arange(6.0).reshape(3, 2), lengths=[1, 2])
        >>> vision.remote_lengths.tolist(), vision.gather(remote * 2, lengths=vision.remote_lengths).tolist()
        ([1, 2], [[0.0, 2.0], [4.0, 6.0], [8.0, 10.0]])
        >>> dist.destroy_process_group()
    """

    def __init__(self, plan: PostBalancePlan, module: int | str, group=None, rank: int | None = None):
        self.plan = plan
        self.module = plan.index(module)
        self.group = group
        self.rank = dist.get_rank(group) if rank is None else rank
        size = dist.get_world_size(group)
        if size != plan.world_size:
            raise UsageError(f"the plan is for {plan.world_size} ranks but the process group has {size}",
                             fix="build the plan from the costs of every rank of this group")
        self._scatter, self._gather = _routes(plan, self.module, self.rank)
        self.num_local = len(self._scatter.send_to)
        self.num_remote = len(self._gather.send_to)
        self.num_home = len(self._gather.recv_from)
        self.remote_lengths: np.ndarray | None = None
        self.home_lengths: np.ndarray | None = None

    def phase_samples(self) -> tuple[np.ndarray, np.ndarray]:
        """``(data_rank, local_index)`` of the samples :meth:`scatter` delivers here, in order."""
        return self.plan.phase_samples(self.module, self.rank)

    def scatter(self, inputs, lengths: Sequence[int] | None = None, *, sync_backward: bool = False):
        """Send this rank's samples' inputs to the ranks that run this phase for them.

        Args:
            inputs: a list of per-sample tensors ``(L_j, ...)`` (this rank's samples, in order),
                or one packed tensor ``(sum L_j, ...)`` with ``lengths``.
            lengths: rows per sample of a packed tensor (default: one row per sample).
            sync_backward: take part in the backward all-to-all even if ``inputs`` do not require
                grad here (needed on every rank when inputs require grad on some ranks only).

        Returns:
            The samples this rank runs in this phase, in canonical order: a list of tensors for
            a list input, else a packed tensor (rows per sample in :attr:`remote_lengths`).
        """
        out, self.remote_lengths = self._run(self._scatter, inputs, lengths, self.num_local, sync_backward)
        return out

    def gather(self, outputs, lengths: Sequence[int] | None = None, *, sync_backward: bool = False):
        """Send this phase's outputs to each sample's LLM-phase rank (differentiable).

        Args:
            outputs: per-sample outputs for the samples :meth:`scatter` delivered, in that order:
                a list of tensors or a packed tensor with ``lengths`` (rows per sample; default
                one row per sample). Outputs may have a different row count than the inputs.
            sync_backward: as in :meth:`scatter`.

        Returns:
            This rank's LLM-phase samples' outputs in canonical order (with the LLM phase at
            home: this rank's own samples in order), as a list or packed (:attr:`home_lengths`).
        """
        out, self.home_lengths = self._run(self._gather, outputs, lengths, self.num_remote, sync_backward)
        return out

    def _run(self, route: _Route, data, lengths, expected: int, sync_backward: bool):
        as_list = isinstance(data, (list, tuple))
        if as_list:
            if len(data) != expected:
                raise UsageError(f"rank {self.rank}: got {len(data)} samples, the plan has {expected} here")
            if not data:
                raise UsageError(f"rank {self.rank}: an empty list has no dtype or feature shape",
                                 fix="pass a packed (0, ...) tensor when a rank has no samples")
            lengths_n = np.array([t.shape[0] for t in data], dtype=np.int64)
            packed = torch.cat(list(data), dim=0)
        else:
            packed = data
            lengths_n = np.ones(expected, np.int64) if lengths is None else np.asarray(
                lengths.cpu() if isinstance(lengths, torch.Tensor) else lengths, dtype=np.int64)
            if len(lengths_n) != expected or int(lengths_n.sum()) != packed.shape[0]:
                raise UsageError(f"rank {self.rank}: {len(lengths_n)} lengths summing to {int(lengths_n.sum())} "
                                 f"for {expected} samples and {packed.shape[0]} rows",
                                 fix="pass one row count per sample that add up to the tensor's rows")
        out, out_lengths = route.run(packed, lengths_n, self.group, sync_backward)
        if as_list:
            return list(torch.split(out, out_lengths.tolist(), dim=0)), out_lengths
        return out, out_lengths


def _collective_device(group) -> torch.device:
    """Where collective buffers must live: the current GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def plan_from_local_costs(cost_nK: np.ndarray, group=None, **plan_kwargs) -> PostBalancePlan:
    """Build this step's plan at run time from every rank's local costs (one all_gather).

    Every rank passes its own (n_r, K) costs; after an all_gather of the counts and one of the
    (padded) costs, every rank runs the same deterministic planner on the same input and so
    holds the same plan.

    Args:
        cost_nK: (n_r, K) this rank's per-sample costs (encoders first, the LLM last).
        group: process group (default: the world).
        **plan_kwargs: passed to :func:`~balancer_cli.replay.post_balance.plan_post_balance`.

    Example (one process here; in a job every rank passes its own samples' costs):
        >>> import tempfile
        >>> dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/init", rank=0, world_size=1)
        >>> plan = plan_from_local_costs(np.array([[3.0, 1.0], [1.0, 1.0]]), modules=("vision", "llm"))
        >>> plan.world_size, plan.load_after.tolist()
        (1, [[4.0], [2.0]])
        >>> dist.destroy_process_group()
    """
    costs = torch.as_tensor(np.asarray(cost_nK, dtype=np.float64))
    if costs.ndim != 2:
        raise UsageError(f"local costs must be (samples, modules), got shape {tuple(costs.shape)}")
    device = _collective_device(group)
    size = dist.get_world_size(group)
    # counts and module count first, so that every rank pads to the same shape
    shape = torch.tensor([costs.shape[0], costs.shape[1]], dtype=torch.int64, device=device)
    shapes = [torch.zeros(2, dtype=torch.int64, device=device) for _ in range(size)]
    dist.all_gather(shapes, shape, group=group)
    n = [int(s[0]) for s in shapes]
    width = max(int(s[1]) for s in shapes)
    padded = torch.zeros((max(n), width), dtype=torch.float64, device=device)
    padded[: costs.shape[0], : costs.shape[1]] = costs.to(device)
    gathered = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    # a rank with another module count is named by the planner's own check
    return plan_post_balance([g[:k, : int(s[1])].cpu().numpy() for g, k, s in zip(gathered, n, shapes)],
                             **plan_kwargs)
