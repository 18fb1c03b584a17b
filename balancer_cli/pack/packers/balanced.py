"""Our default packer: G nearly identical groups, every module balanced at once.

ISF accepts groups that hit *one* bound and leaves the other modules to chance, so its balance
across ranks depends on how groups are later sorted into steps (which makes steps homogeneous,
unlike random batches). :func:`pack_balanced` instead makes every group carry the same share of
every module, so any assignment of groups to ranks is balanced and steps can stay random mixes.

Algorithm:

1. **Number of groups.** G starts at the lower bound: ``max_k ceil(sum load_k / cap_k)``, or the
   count of samples over half a cap if larger (no two of them share a group), divided by
   ``fill``; the total number of groups (isolated ones included) is rounded up to a multiple of
   ``group_multiple`` (the assigner wants ``world_size x micro_batches``).
2. **Dealing** (vectorized). Samples over half a cap first, then the others by decreasing
   normalized size ``sum_k w_ik / t_k`` (ties broken by a seeded shuffle), are dealt in rounds
   of G: the biggest to the group with the lowest normalized load. A row that breaks a cap gets
   a second chance on the roomiest unused group, then waits for the next round; a few
   stragglers go to the lightest group with room. Every group gets one row per size stratum,
   so groups are random mixes of sources. When dealing strands rows (tight caps), first fit
   decreasing (numba) decides G and dealing is retried with that G (and 1%, 2% more up to
   500k samples); if all fail, first fit's own groups are kept.
3. **Refinement** (numba, ``passes`` times). *Targeted swaps*: for each off-target group g and
   member i, samples whose normalized cost is near ``w_i - t * dev_g`` (t = 1/2, 1) are looked
   up in a grid, and the best swap within the caps is applied. Then *random partners*: every
   one-for-one swap and one-sample move with a few random or opposite-deviation partner groups.
   Objective: ``sum_k ((sum_gk - t_k) / t_k)^2`` with ``t_k = sum w_k / G``; integer item
   counts converge to equal counts where the totals allow. With ``source_N`` the per-group
   count of each source joins the objective (weight ``mix_weight``), so groups are equal source
   mixes and steps stay mixed even when the assigner keeps equal item counts together.

Above 300k rows each full deal is first probed on a 100k-row subsample (a failed deal of 1M rows
costs about a second), and first fit's groups are not refined (the assigner balances them).

Samples are balanced on ``cost_NK`` when given (e.g. FLOPs), else on their loads; caps always
apply to loads. Nothing is sorted by source, so each group is a random mix of sources.

Example:
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> items = rng.integers(0, 6, 400); tokens = 256 * items + rng.integers(20, 400, 400)
    >>> p = pack_balanced(np.stack([items, tokens], 1), np.array([24, 8192]), seed=0)
    >>> from balancer_cli.pack.types import group_sums
    >>> sums = group_sums(p, np.stack([items, tokens], 1))
    >>> p.num_groups, bool(np.ptp(sums[:, 0]) <= 1), bool(sums[:, 1].std() / sums[:, 1].mean() < 0.001)
    (45, True, True)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from balancer_cli.errors import InputError, UsageError
from balancer_cli.pack.packers._common import assemble, check_inputs, split_oversize
from balancer_cli.pack.packers.balanced_kernels import (
    deal_rounds,
    first_fit,
    refine_pass,
    targeted_pass,
)
from balancer_cli.pack.bounds import groups_lower_bound
from balancer_cli.pack.types import Packing

__all__ = ["pack_balanced", "groups_lower_bound"]


def _first_fit_decreasing(rows, load, caps, rng, lookback):
    """Step 2: rows by decreasing normalized size (seeded tie-breaks), first fit; returns the
    group id of each row (aligned with ``rows``) and the number of groups."""
    shuffled = rows[rng.permutation(len(rows))]
    size = (load[shuffled] / caps).sum(axis=1)
    queue = shuffled[np.argsort(-size, kind="stable")]
    # Suffix minimum of each module's load: what every row still to come needs at least.
    min_rest = np.minimum.accumulate(load[queue][::-1], axis=0)[::-1]
    gid, G = first_fit(queue, load, caps, np.ascontiguousarray(min_rest), lookback)
    return queue, gid, G


def _deal(rows, load, weight, caps, G, rng, hard_share=0.5):
    """Step 2b: deal rows in rounds of G, largest normalized row to the lightest group.

    Balanced from the start (unlike first fit) but may strand rows when caps are tight.

    Returns:
        (queue, gid): rows and their group ids, or None when some row found no room.
    """
    target_K = weight[rows].sum(axis=0) / G
    inv_t = np.divide(1.0, target_K, out=np.zeros_like(target_K), where=target_K > 0)
    shuffled = rows[rng.permutation(len(rows))]
    # Rows over half a cap first (no two share a group, and late they find no room), then by
    # normalized cost, so that every group gets one row of each size stratum.
    hard = (load[shuffled] / caps).max(axis=1)
    key = np.where(hard > hard_share, 1e6 + hard, (weight[shuffled] * inv_t).sum(axis=1))
    queue = shuffled[np.argsort(-key, kind="stable")]
    gid = deal_rounds(queue, load, weight, caps, int(G), inv_t, 64)
    if len(gid) != len(queue):
        return None
    return queue, gid


class _DealProbe:
    """Predicts whether dealing N rows into G groups succeeds by dealing a seeded subsample into
    proportionally fewer groups first (large inputs only: a failed full deal costs ~1 s per
    million rows, a probe of ``size`` rows a few ms). Small inputs are always dealt in full."""

    def __init__(self, rows, load, weight, caps, seed, size=100_000, above=300_000):
        self.n = len(rows)
        self.active = self.n > above
        if self.active:
            rng = np.random.default_rng([seed, 7])
            self.rows = np.sort(rng.choice(rows, size, replace=False))
            self.args = (load, weight, caps)
            self.rng = rng

    def likely(self, G: int) -> bool:
        if not self.active:
            return True
        G_sub = max(1, int(np.ceil(G * len(self.rows) / self.n)))
        return _deal(self.rows, *self.args, G_sub, self.rng) is not None


def _padded(queue, gid, G, weight, load, width):
    """(G, width) member table (-1 padded), counts and per-group sums."""
    order = np.argsort(gid, kind="stable")
    count = np.bincount(gid, minlength=G).astype(np.int64)
    S = max(int(count.max()), width)
    members = np.full((G, S), -1, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(count)[:-1]])
    sorted_g = gid[order]
    members[sorted_g, np.arange(len(order)) - starts[sorted_g]] = queue[order]
    wsum = np.stack([np.bincount(gid, weight[queue, k], minlength=G) for k in range(weight.shape[1])], axis=1)
    lsum = np.stack([np.bincount(gid, load[queue, k], minlength=G) for k in range(load.shape[1])], axis=1)
    lsum = np.rint(lsum).astype(np.int64)
    return members, count, wsum, lsum


def _fill_empty(members, count, wsum, lsum, weight, load):
    """Give every empty group the last sample of one of the groups with the most samples."""
    while (count == 0).any():
        empty = np.flatnonzero(count == 0)
        donors = np.argsort(-count, kind="stable")[: len(empty)]
        donors = donors[count[donors] >= 2]
        empty = empty[: len(donors)]
        count[donors] -= 1
        moved = members[donors, count[donors]]
        members[donors, count[donors]] = -1
        members[empty, 0] = moved
        count[empty] = 1
        wsum[donors] -= weight[moved]
        lsum[donors] -= load[moved]
        wsum[empty] = weight[moved]
        lsum[empty] = load[moved]


def pack_balanced(
    load_NK: np.ndarray,
    caps_K: np.ndarray,
    *,
    seed: int = 0,
    oversize: str = "isolate",
    sample_ids: np.ndarray | None = None,
    cost_NK: np.ndarray | None = None,
    group_multiple: int = 1,
    num_groups: int | None = None,
    fill: float = 1.0,
    passes: int | None = None,
    partners: int = 3,
    lookback: int = 64,
    max_samples: int | None = None,
    deal: bool = True,
    targeted: bool = True,
    cell_width: float = 0.01,
    scan: int = 8,
    source_N: np.ndarray | None = None,
    mix_weight: float = 1e-2,
    max_sources: int = 16,
    module_names: Sequence[str] | None = None,
) -> Packing:
    """Pack samples into nearly identical groups under per-module caps (see the module docstring).

    Args:
        load_NK: (N, K) int per-sample load: items per encoder module, LLM tokens last.
        caps_K: (K,) caps per group (Qv..., Qt).
        seed: seeds the tie-breaking shuffle and the refinement's partner choice.
        oversize: ``isolate`` | ``drop`` | ``error`` for samples over a cap on their own.
        sample_ids: (N,) sample index of each row (default ``arange(N)``).
        cost_NK: (N, K) float cost to balance (default: the loads).
        group_multiple: the number of groups, isolated oversize ones included, is made a
            multiple of this (pass ``world_size * micro_batches``).
        num_groups: force G (rounded up to ``group_multiple``; raised if the caps need more).
        fill: target fill of the binding cap; G = lower bound / fill. 1.0 = fewest groups.
        passes: refinement passes (0 disables refinement); default: 8 for small inputs down
            to 2 for a million samples or more.
        partners: candidate partner groups per group and pass.
        lookback: open groups first fit tries per sample.
        max_samples: most samples in one group (default 2.5x the mean group size + 4).
        deal: try dealing (balanced start) before falling back to first fit.
        targeted: run targeted swaps (grid lookup of the sample that cancels a group's
            deviation) before each random-partner pass.
        cell_width: grid cell size of targeted swaps, as a share of a group's target.
        scan: samples tried per grid cell lookup.
        source_N: (N,) source code (or name) of each row. When given, refinement also evens
            out each group's sample count per source (the ``max_sources - 1`` most frequent
            sources, the rest as one), so groups are equal source mixes and steps stay mixed
            whatever the assigner sorts on.
        mix_weight: weight of the per-source terms in the squared objective (the modules' is 1).
        max_sources: sources tracked (memory: N x max_sources floats during refinement).
        module_names: names used in drop reasons and errors.

    Returns:
        A :class:`Packing` (balanced groups first, then isolated oversize samples).

    Raises:
        InputError: empty input, or an oversize sample under ``oversize="error"``.
        UsageError: bad caps, ``fill`` or ``group_multiple``.
    """
    load, caps, ids = check_inputs(load_NK, caps_K, sample_ids, oversize)
    if not 0 < fill <= 1:
        raise UsageError(f"fill must lie in (0, 1], got {fill}", fix="use --fill 1.0")
    if group_multiple < 1:
        raise UsageError(f"group_multiple must be >= 1, got {group_multiple}", fix="pass world_size * micro_batches")
    weight = load.astype(np.float64) if cost_NK is None else np.asarray(cost_NK, dtype=np.float64)
    if weight.shape != load.shape:
        raise UsageError(f"cost shape {weight.shape} differs from load shape {load.shape}", fix="pass (N, K) costs")
    split = split_oversize(load, caps, policy=oversize, sample_ids=ids, module_names=module_names)
    rows = split.fit
    if len(rows) == 0:
        return assemble((np.zeros(0, np.int64), np.zeros(1, np.int64)), split, ids)
    rng = np.random.default_rng(seed)
    lb = groups_lower_bound(load[rows], caps)
    # Samples per group are capped too (an extra "module" of one per sample): it bounds the
    # member table's width, and so the refinement's memory and time.
    max_count = int(max_samples) if max_samples else int(np.ceil(2.5 * len(rows) / lb)) + 4
    load_c = np.column_stack([load, np.ones(len(load), np.int64)])
    caps_c = np.append(caps, max_count)
    n_iso = len(split.isolated)

    def rounded(G: int) -> int:
        # The total, isolated oversize groups included, is what must be a multiple.
        return min(-(-(G + n_iso) // group_multiple) * group_multiple - n_iso, len(rows))

    G = rounded(int(np.ceil(lb / fill)) if num_groups is None else max(int(num_groups), lb))
    probe = _DealProbe(rows, load_c, weight, caps_c, seed)
    dealt = _deal(rows, load_c, weight, caps_c, G, rng) if deal and probe.likely(G) else None
    if dealt is None:
        # Dealing stranded samples (tight caps): first fit decides how many groups are needed,
        # then dealing is tried once more with that many, else first fit's groups are kept.
        queue, gid, G_ffd = _first_fit_decreasing(rows, load_c, caps_c, rng, lookback)
        G_ffd = rounded(max(G, G_ffd))
        # Dealt groups are random mixes; first-fit ones cluster similar samples. So dealing
        # gets up to 2% more groups than first fit needs before first fit is kept.
        extra = (1.01, 1.02) if len(rows) <= 500_000 else ()  # each try costs a full deal
        for G_try in sorted({G_ffd} | {rounded(int(np.ceil(G_ffd * f))) for f in extra}):
            dealt = (_deal(rows, load_c, weight, caps_c, G_try, rng)
                     if deal and G_try > G and probe.likely(G_try) else None)
            if dealt is not None:
                break
        G = G_try if dealt is not None else G_ffd
    from_first_fit = dealt is None
    if dealt is not None:
        queue, gid = dealt
    members, count, wsum, lsum = _padded(queue, gid, G, weight, load, width=max_count)
    del load_c, queue, gid, dealt  # large (N,) temporaries: keep the refinement's peak memory low
    if (count == 0).any():
        if count.max() < 2 and (count == 0).sum() > 0:
            raise InputError(f"{len(rows)} samples cannot fill {G} groups", fix="lower --world-size or --micro-batches")
        _fill_empty(members, count, wsum, lsum, weight, load)
    target_K = wsum.sum(axis=0) / G
    inv_t = np.divide(1.0, target_K, out=np.zeros_like(target_K), where=target_K > 0)
    inv_t2 = inv_t**2
    tol = 1e-12
    if passes is None:
        # About 10M pair evaluations' worth of passes: 8 for 70k samples, 2 for 1.2M.
        passes = int(np.clip(round(2.5e6 / len(rows)), 2, 8))
        if from_first_fit and probe.active:
            # First fit's groups cluster similar samples; local search cannot make them equal
            # (1.2M synthetic: group CV 0.39 -> 0.32 after 2 passes, 2.5 s) and the assigner's
            # sorting balances them anyway (Dist Ratio 0.0001 / 0.0009 with or without).
            passes = 0
    grid = _weight_grid(rows, weight, inv_t, cell_width) if targeted and passes > 0 else None
    K = weight.shape[1]
    if source_N is not None and passes > 0 and mix_weight > 0:
        # Per-source sample counts join the objective with a small weight: groups become
        # equal mixes of sources too, so whatever class of groups the assigner puts in a step
        # (e.g. equal item counts), the step stays a random-like mix.
        weight, wsum, target_K, inv_t, inv_t2 = _with_sources(
            np.asarray(source_N).reshape(-1), rows, members, count, weight, wsum, mix_weight, max_sources)
    for _ in range(passes):
        changed = 0
        if grid is not None:
            group_of, pos = _membership(members, count, len(load))
            changed += targeted_pass(rng.permutation(G), members, count, group_of, pos, wsum, lsum, weight, load, caps,
                                     target_K, inv_t, inv_t2, *grid, scan, tol)
        cand = _partners(wsum[:, :K], target_K[:K], inv_t[:K], partners, rng)
        changed += refine_pass(rng.permutation(G), cand, members, count, wsum, lsum, weight, load, caps, target_K,
                               inv_t2, tol)
        if changed == 0:
            break
    offsets = np.concatenate([[0], np.cumsum(count)]).astype(np.int64)
    mask = np.arange(members.shape[1])[None, :] < count[:, None]
    order_rows = members[mask]  # row-major: group by group
    return assemble((order_rows, offsets), split, ids)


def _with_sources(source_N, rows, members_GS, count_G, weight_NK, wsum_GK, mix_weight, max_sources):
    """Append per-source one-hot columns to the weights and group sums; their objective terms
    get ``mix_weight``. Returns (weight, wsum, target, inv_t, inv_t2) extended."""
    if len(source_N) != len(weight_NK):
        raise UsageError(f"source_N has {len(source_N)} rows, loads {len(weight_NK)}", fix="pass one source per sample")
    _, code = np.unique(source_N, return_inverse=True)
    code = code.reshape(-1)
    freq = np.bincount(code[rows])
    keep = np.argsort(-freq, kind="stable")[: max(1, max_sources - 1)]
    col = np.full(len(freq), len(keep), dtype=np.int64)  # rare sources share the last column
    col[keep] = np.arange(len(keep))
    S = len(keep) + int(len(freq) > len(keep))
    G, K = wsum_GK.shape
    mix_NS = np.zeros((len(weight_NK), S))
    mix_NS[rows, col[code[rows]]] = 1.0
    mask = np.arange(members_GS.shape[1])[None, :] < count_G[:, None]
    msum_GS = np.zeros((G, S))
    np.add.at(msum_GS, (np.repeat(np.arange(G), count_G), col[code[members_GS[mask]]]), 1.0)
    weight = np.hstack([weight_NK, mix_NS])
    wsum = np.ascontiguousarray(np.hstack([wsum_GK, msum_GS]))
    target_K = wsum.sum(axis=0) / G
    inv_t = np.divide(1.0, target_K, out=np.zeros_like(target_K), where=target_K > 0)
    inv_t2 = inv_t**2
    inv_t2[K:] *= mix_weight
    return weight, wsum, target_K, inv_t, inv_t2


def _membership(members_GS, count_G, num_rows):
    """(group_of_N, pos_N) for the packed rows (-1 elsewhere)."""
    G, S = members_GS.shape
    mask = np.arange(S)[None, :] < count_G[:, None]
    group_of = np.full(num_rows, -1, dtype=np.int64)
    pos = np.full(num_rows, -1, dtype=np.int64)
    rows = members_GS[mask]
    group_of[rows] = np.repeat(np.arange(G), count_G)
    pos[rows] = np.nonzero(mask)[1]
    return group_of, pos


def _weight_grid(rows, weight_NK, inv_t_K, width):
    """Bucket rows by normalized weight (cells of ``width`` per module, at most ~2M cells)."""
    u = weight_NK[rows] * inv_t_K
    top = u.max(axis=0)
    while np.prod(np.floor(top / width) + 1) > 2**21:
        width *= 1.5
    dims = (np.floor(top / width) + 1).astype(np.int64)
    cell_k = np.minimum(np.floor(u / width).astype(np.int64), dims - 1)
    cell = np.ravel_multi_index(cell_k.T, dims)
    order = np.argsort(cell, kind="stable")
    cell_start = np.concatenate([[0], np.cumsum(np.bincount(cell, minlength=int(np.prod(dims))))]).astype(np.int64)
    cell_of = np.full(len(weight_NK), -1, dtype=np.int64)
    cell_of[rows] = cell
    return cell_of, cell_start, rows[order].astype(np.int64), float(width), dims


def _partners(wsum_GK, target_K, inv_t, partners, rng):
    """(G, C) candidate partners: half random, half opposite along a random direction."""
    G, K = wsum_GK.shape
    n_opp = partners // 2
    cand = rng.integers(0, G, size=(G, partners))
    if n_opp and G > 1:
        dev = (wsum_GK - target_K) * inv_t
        key = dev @ rng.standard_normal(K)
        by_key = np.argsort(key, kind="stable")
        rank = np.empty(G, dtype=np.int64)
        rank[by_key] = np.arange(G)
        mirror = G - 1 - rank
        offs = np.arange(n_opp) - n_opp // 2
        pos = np.clip(mirror[:, None] + offs[None, :], 0, G - 1)
        cand[:, :n_opp] = by_key[pos]
    return cand
