"""Our default packer: G nearly identical groups, every module balanced at once.

ISF accepts groups that hit *one* bound and leaves the other modules to chance (its balance then
depends on sorting groups into homogeneous steps). :func:`pack_balanced` gives every group the
same share of every module: any assignment of groups to ranks is balanced, steps stay mixed.

Algorithm:

1. **Number of groups.** G starts at the lower bound (:func:`~balancer_cli.pack.bounds.groups_lower_bound`);
   the total number of groups (isolated ones included) is rounded up to a multiple of
   ``group_multiple`` (the assigner wants ``world_size x micro_batches``).
2. **Dealing** (:func:`~balancer_cli.pack.packers._fill_kernels.deal_rounds`). Samples over half
   a cap first, then the others by decreasing normalized size ``sum_k w_ik / t_k`` (to 0.05%: ties
   broken by a seeded shuffle), are dealt in rounds of G: the biggest to the group with the lowest
   normalized load. A row that breaks a cap gets a second chance on the roomiest unused group,
   then waits for the next round; a few stragglers go to the lightest group with room. Every
   group gets one row per size stratum, so groups are random mixes of sources. Dealing spreads
   room evenly, so under tight caps the last rows would find only fragments of it: the smallest
   rows (15% of the normalized volume, then 50% if needed) and any row dealing strands fill
   the room by first fit, in extra groups when none has room. Over ``MAX_STEP_EXCESS`` (1.03) x the lower
   bound, first fit decreasing's own groups are kept where fewer (rows by summed cap shares, or by the
   binding cap's where the first is over too or it saves 1%; they cluster sources: a harsh 10M in windows
   of 1.1M, 2 of 9 windows mixed 1.35-1.44x, the others 0.96-0.99x). Where still over, or over 1.03x the
   bound in whole steps, groups that fill a binding module of few sizes by cutting-stock patterns are kept
   where fewer (:mod:`~balancer_cli.pack.packers._patterns`).
3. **Refinement** (:func:`~balancer_cli.pack.packers._balanced_refine.refine`,
   :attr:`BalancedOptions.passes` times). *Targeted swaps*: for each off-target group g and
   member i, samples whose normalized cost is near ``w_i - t * dev_g`` (t = 1/2, 1) are looked up
   in a grid, and the best swap within the caps is applied. Then *random partners*: every
   one-for-one swap and one-sample move with a few random or opposite-deviation partner groups.
   Objective: ``sum_k ((sum_gk - t_k) / t_k)^2`` with ``t_k = sum w_k / G``; with ``source_N`` each
   group's count of each source joins it (weight ``MIX_WEIGHT``): groups become equal source mixes.
4. **Class mix** (:func:`~balancer_cli.pack.packers._class_mix.even_class_mix`, with
   ``source_N``): groups of one encoder class (equal discrete sums: what the assigner puts in one
   step) can still hold more of a source than the data as a whole; rows of equal encoder loads
   and near-equal LLM weight trade places between classes until each class holds the global mix.

Samples are balanced on ``cost_NK`` when given (e.g. FLOPs), else on their loads; caps always
apply to loads. :func:`deal_balanced` stops after step 2 (:meth:`DealtGroups.finish` does the rest).

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
from dataclasses import dataclass

import numpy as np

from balancer_cli._columns import column_sums
from balancer_cli._index import take_rows
from balancer_cli._shuffle import shuffled
from balancer_cli.errors import InputError, UsageError, is_int
from balancer_cli.pack.bounds import groups_lower_bound
from balancer_cli.pack.packers._balanced_refine import refine
from balancer_cli.pack.packers._class_mix import even_class_mix
from balancer_cli.pack.packers._common import (
    OversizeSplit,
    assemble,
    check_inputs,
    split_oversize,
)
from balancer_cli.pack.packers._fill_kernels import (
    deal_order,
    deal_rounds,
    first_fit,
    first_fit_orders,
    row_shares,
)
from balancer_cli.pack.packers._patterns import pattern_groups
from balancer_cli.pack.packers._table_kernels import group_tables, load_sums, suffix_min
from balancer_cli.pack.types import Packing

__all__ = ["BalancedOptions", "DealtGroups", "deal_balanced", "pack_balanced", "LOOKBACK", "MAX_STEP_EXCESS"]

#: Open groups first fit tries per sample before opening one (1024: 1.4% fewer steps, 3x the time).
LOOKBACK = 64
#: Rows dealing places one by one (lightest group with room) before it gives up to first fit.
_MAX_STRAGGLERS = 64
#: Rows over this share of a cap are dealt first: no two of them share a group.
_HARD_SHARE = 0.5
#: Dealt groups (and first fit's for stranded rows) are kept up to this many times the lower bound.
MAX_STEP_EXCESS = 1.03
#: Shares of the normalized volume (smallest rows) first fit fills the dealt groups with, in turn.
_FILL_SHARES = (0.15, 0.5)
_PROBE_ABOVE, _PROBE_SIZE = 300_000, 100_000  # above it the fill share is picked on a subsample of this size
#: Above this many rows the refinement stops after 2 passes once the dense modules' group sums vary by
#: at most ``_SETTLED_CV`` (10M in windows of 770k: LLM 0.023 after 2, Dist 0.003 after 2 or 8; one
#: pass less cuts a quarter of the CPU. A three-module 700k: 0.12, Dist 0.0073 after 2, 0.0052 after 4).
_SETTLE_ABOVE, _SETTLED_CV = 600_000, 0.05


@dataclass(frozen=True, kw_only=True, slots=True)
class BalancedOptions:
    """Tuning knobs of :func:`pack_balanced` that the threshold search and tests set.

    Attributes:
        passes: refinement passes (0 disables refinement); ``None``: 8 for small inputs down to 2 for 1M or more.
        max_sources: sources ``source_N`` tracks: the ``max_sources - 1`` most frequent ones, the
            rest as one (memory: N x max_sources floats during refinement).
        class_mix: run step 4 (with ``source_N``). It is for one micro-batch, where a step takes one class of
            groups; with more, the assigner pairs blocks of different classes in a step and the swaps' LLM
            changes cost more mix than they give (48 random inputs).

    Example:
        >>> BalancedOptions(passes=2)
        BalancedOptions(passes=2, max_sources=16, class_mix=True)
        >>> BalancedOptions(passes=-1)
        Traceback (most recent call last):
        ...
        balancer_cli.errors.UsageError: passes must be an integer >= 0 or None, not -1; fix: pass None (automatic)
    """

    passes: int | None = None
    max_sources: int = 16
    class_mix: bool = True

    def __post_init__(self) -> None:
        if self.passes is not None and (not is_int(self.passes) or self.passes < 0):
            raise UsageError(f"passes must be an integer >= 0 or None, not {self.passes!r}",
                             fix="pass None (automatic)")
        if not is_int(self.max_sources) or self.max_sources < 1:
            raise UsageError(f"max_sources must be an integer >= 1, not {self.max_sources!r}",
                             fix="pass max_sources=16 (the default)")


_DEFAULT_OPTIONS = BalancedOptions()


def pack_balanced(
    load_NK: np.ndarray,
    caps_K: np.ndarray,
    *,
    seed: int = 0,
    cost_NK: np.ndarray | None = None,
    group_multiple: int = 1,
    source_N: np.ndarray | None = None,
    module_names: Sequence[str] | None = None,
    oversize: str = "isolate",
    sample_ids: np.ndarray | None = None,
    options: BalancedOptions | None = None,
) -> Packing:
    """Pack samples into nearly identical groups under per-module caps (see the module docstring).

    Args:
        load_NK: (N, K) int per-sample load: items per encoder module, LLM tokens last.
        caps_K: (K,) caps per group (Qv..., Qt).
        seed: seeds the tie-breaking shuffle and the refinement's partner choice.
        cost_NK: (N, K) float cost to balance (default: the loads).
        group_multiple: the number of groups, isolated oversize ones included, is made a multiple of this
            (pass ``world_size * micro_batches``) unless that needs more groups than samples.
        source_N: (N,) source code (or name) of each row. Refinement then also evens out each group's count
            per source: groups are equal source mixes, and steps stay mixed whatever the assigner sorts on.
        module_names: names used in drop reasons and errors (default ``module<k>``, ``llm``).
        oversize: ``isolate`` | ``drop`` | ``error`` for samples over a cap on their own.
        sample_ids: (N,) sample index of each row (default ``arange(N)``).
        options: refinement knobs (:class:`BalancedOptions`; default: automatic passes).

    Returns:
        A :class:`~balancer_cli.pack.types.Packing` (balanced groups first, then isolated oversize samples).

    Raises:
        InputError: empty input, too few samples for the groups, or an oversize sample under ``oversize="error"``.
        UsageError: bad caps, ``group_multiple``, ``cost_NK`` or ``source_N`` shapes.

    Example:
        >>> import numpy as np
        >>> from balancer_cli.pack.types import group_sums
        >>> load_NK = np.array([[2, 300], [1, 200], [1, 250], [2, 150], [0, 400], [2, 500]])
        >>> p = pack_balanced(load_NK, np.array([3, 700]), group_multiple=2, options=BalancedOptions(passes=1))
        >>> p.num_groups, group_sums(p, load_NK)[:, 0].tolist()  # 2 vision items in every group
        (4, [2, 2, 2, 2])
    """
    dealt = deal_balanced(load_NK, caps_K, seed=seed, cost_NK=cost_NK, group_multiple=group_multiple,
                          module_names=module_names, oversize=oversize, sample_ids=sample_ids)
    return dealt.finish(source_N=source_N, options=options, in_place=True)


def deal_balanced(
    load_NK: np.ndarray,
    caps_K: np.ndarray,
    *,
    seed: int = 0,
    cost_NK: np.ndarray | None = None,
    group_multiple: int = 1,
    module_names: Sequence[str] | None = None,
    oversize: str = "isolate",
    sample_ids: np.ndarray | None = None,
) -> DealtGroups:
    """Steps 1-2 of :func:`pack_balanced` (arguments alike): the dealt groups, to finish later.

    ``deal_balanced(...).finish(source_N=..., options=...)`` is ``pack_balanced(...)``, byte for
    byte; a :class:`DealtGroups` finishes any number of times (the threshold search deals every
    candidate, then refines only the promising ones, without dealing them again).

    Example:
        >>> import numpy as np
        >>> load_NK = np.array([[2, 300], [1, 200], [1, 250], [2, 150], [0, 400], [2, 500]])
        >>> dealt, one = deal_balanced(load_NK, np.array([3, 700]), group_multiple=2), BalancedOptions(passes=1)
        >>> p = pack_balanced(load_NK, np.array([3, 700]), group_multiple=2, options=one)
        >>> dealt.finish(options=one).order.tolist() == dealt.finish(options=one).order.tolist() == p.order.tolist()
        True
    """
    load, caps, ids = check_inputs(load_NK, caps_K, sample_ids, oversize)
    if group_multiple < 1:
        raise UsageError(f"group_multiple {group_multiple} must be >= 1", fix="pass {world_size} x {micro_batches}")
    weight = load.astype(np.float64) if cost_NK is None else np.asarray(cost_NK, dtype=np.float64)
    if weight.shape != load.shape:
        raise UsageError(f"cost shape {weight.shape} differs from load shape {load.shape}", fix="pass (N, K) costs")
    split = split_oversize(load, caps, policy=oversize, sample_ids=ids, module_names=module_names)
    tables, rng = None, np.random.default_rng(seed)
    if len(split.fit):
        tables = _initial_groups(split.fit, load, weight, caps, group_multiple, len(split.isolated), seed, rng)
    return DealtGroups(load=load, weight=weight, caps=caps, ids=ids, split=split, tables=tables,
                       rng_state=rng.bit_generator.state, group_multiple=group_multiple)


@dataclass(frozen=True, kw_only=True, eq=False, slots=True)
class DealtGroups:
    """Dealt groups of :func:`deal_balanced`, and the random state the refinement continues from.

    :meth:`finish` refines copies of its tables, so it can run again.

    Attributes:
        load, weight, caps, ids: the checked inputs ((N, K) loads and weights, (K,) caps, (N,) ids).
        split: the rows in groups (``split.fit``) and the oversize ones set apart.
        tables: ``(members_GX, count_G, wsum_GK, lsum_GK)`` of the groups (None: no row fits).
        rng_state: the seeded generator's state after dealing.
        group_multiple: the multiple the group count was rounded to.
    """

    load: np.ndarray
    weight: np.ndarray
    caps: np.ndarray
    ids: np.ndarray
    split: OversizeSplit
    tables: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None
    rng_state: dict
    group_multiple: int

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays this object holds of its own (the inputs it was given excluded)."""
        own = [self.ids, self.split.fit, self.split.isolated, self.split.dropped, *(self.tables or ())]
        return int(sum(a.nbytes for a in own))

    def finish(self, *, source_N: np.ndarray | None = None, options: BalancedOptions | None = None,
               in_place: bool = False) -> Packing:
        """Steps 3-4 of :func:`pack_balanced` (``source_N``, ``options`` alike): the packing.
        ``in_place``: refine the tables themselves (no copy, ~25 B a sample), to finish only once."""
        options = _DEFAULT_OPTIONS if options is None else options
        if self.tables is None:  # no row fits the caps
            return assemble((np.zeros(0, np.int64), np.zeros(1, np.int64)), self.split, self.ids)
        members, count, wsum, lsum = self.tables if in_place else (t.copy() for t in self.tables)
        rng = np.random.default_rng(0)
        rng.bit_generator.state = self.rng_state
        passes = options.passes
        if passes is None:
            # ~10M pair evaluations: 8 passes for 70k samples, 2 for 1.2M; first fit's groups too (one
            # size, so one source: harsh 392k at --dp 16 x 2 mixed 2.95x worse than random unrefined, 0.39x refined).
            passes = int(np.clip(round(2.5e6 / len(self.split.fit)), 2, 8))
        sums = None  # the groups' weight sums, then their per-source counts (from the refinement)
        if passes > 0:
            sums = refine(members, count, wsum, lsum, self.weight, self.load, self.caps, self.split.fit,
                          passes=passes, source_N=source_N, max_sources=options.max_sources, rng=rng,
                          settled_cv=_SETTLED_CV if len(self.split.fit) > _SETTLE_ABOVE else 0.0)
        offsets = np.concatenate([[0], np.cumsum(count)]).astype(np.int64)
        mask = np.arange(members.shape[1])[None, :] < count[:, None]
        order_rows = members[mask]  # row-major: group by group
        if source_N is not None and options.class_mix:
            even_class_mix(order_rows, offsets, self.weight, self.load, self.caps, source_N,
                           max_sources=options.max_sources, step_groups=self.group_multiple, sums_GKO=sums)
        return assemble((order_rows, offsets), self.split, self.ids)


def _initial_groups(rows, load, weight, caps, group_multiple, num_isolated, seed, rng):
    """Steps 1-2: the groups of ``rows`` (dealt, first fit's or patterns'), as :func:`group_tables` gives them."""
    lb = groups_lower_bound(load, caps, rows=rows)
    # Samples per group are capped too (an extra "module" of one per sample): it bounds the member table.
    max_count = int(np.ceil(2.5 * len(rows) / lb)) + 4
    load_c = np.column_stack([load, np.ones(len(load), np.int64)])
    caps_c = np.append(caps, max_count)

    def rounded(G: int) -> int:
        # The total, isolated oversize groups included, is what must be a multiple.
        return min(-(-(G + num_isolated) // group_multiple) * group_multiple - num_isolated, len(rows))

    # Rounded up to whole steps (few steps: 1.031-1.032x the bound): rounded down sent such deals to first
    # fit's groups, which mix poorly (48 random inputs: 2 of them 0.40x -> 1.65x and 0.55x -> 1.20x).
    limit = rounded(int(np.ceil(lb * MAX_STEP_EXCESS)))
    shares = _FILL_SHARES
    if len(rows) > _PROBE_ABOVE:
        # A full deal of 1M rows costs ~0.7 s, and the groups a share needs hardly depend on the sample's size:
        # a seeded subsample picks the first share (the full data may still need the later ones).
        probed = _probe_fill_share(rows, load_c, weight, caps_c, seed)
        shares = _FILL_SHARES[_FILL_SHARES.index(probed):]
    for fill_share in shares:  # more first fit packs tighter, less deals more evenly
        queue, gid = _deal(rows, load_c, weight, caps_c, rounded(lb), rng, fill_share)
        G = rounded(int(gid.max()) + 1)
        if G <= limit:
            break
    binding = _binding(load, rows, caps) if G > limit else None
    if G > limit:
        # First fit decreasing by summed cap shares, then by the binding cap's: taken where the first is over
        # the limit or it saves 1% of the groups (it clusters sources more: docstring).
        for i, ffd_queue in enumerate(first_fit_orders(rows, load_c, caps_c, rng, binding)):
            ffd_gid, G_ffd = first_fit(ffd_queue, load_c, caps_c, suffix_min(ffd_queue, load_c), LOOKBACK,
                                       np.zeros((0, load_c.shape[1]), np.int64))
            G_ffd = rounded(G_ffd)
            if G_ffd < G and (i == 0 or G > limit or G_ffd < 0.99 * G):
                queue, gid, G = ffd_queue, ffd_gid, G_ffd
    if G > limit or G + num_isolated > MAX_STEP_EXCESS * (rounded(lb) + num_isolated):  # over 1.03x in steps
        binding = _binding(load, rows, caps) if binding is None else binding
        filled = pattern_groups(rows, load_c, caps_c, binding, rng=rng, max_items=max_count)
        G_pat = G if filled is None else rounded(int(filled[1].max()) + 1)
        if G_pat < G:
            (queue, gid), G = filled, G_pat
    members, count, wsum, lsum = group_tables(queue, gid, G, max_count, weight, load)
    if (count == 0).any():
        if count.max() < 2:
            raise InputError(f"{len(rows)} samples cannot fill {G} groups", fix="lower {world_size} or {micro_batches}")
        _fill_empty(members, count, wsum, lsum, weight, load)
    return members, count, wsum, lsum


def _binding(load, rows, caps):  # the module whose cap the rows fill most
    return int(np.argmax(column_sums(take_rows(load, rows)) / caps))


def _probe_fill_share(rows, load, weight, caps, seed):
    """The first of :data:`_FILL_SHARES` whose deal of a seeded subsample of ``_PROBE_SIZE`` rows
    stays within ``MAX_STEP_EXCESS`` x the subsample's lower bound (else the last)."""
    rng = np.random.default_rng([seed, 7])
    sub = np.sort(rng.choice(rows, _PROBE_SIZE, replace=False))
    lb = groups_lower_bound(load[sub][:, :-1], caps[:-1])
    for share in _FILL_SHARES[:-1]:  # the last is the answer whether its deal fits or not: not dealt
        _, gid = _deal(sub, load, weight, caps, lb, rng, share)
        if int(gid.max()) + 1 <= np.ceil(lb * MAX_STEP_EXCESS):
            return share
    return _FILL_SHARES[-1]


def _deal(rows, load, weight, caps, G, rng, fill_share):
    """Step 2 (module docstring): deal the bigger rows in rounds of G; the smallest rows
    (``fill_share`` of the volume) and any row dealing strands fill the room left by first fit.

    Returns:
        (queue, gid): rows in placement order and their group ids (G or more groups).
    """
    # Every row (``rows`` is sorted) of a C-ordered table: the same sum, without a copy (1.2M: 20-60 ms).
    whole = len(rows) == len(weight) and weight.flags.c_contiguous
    target_K = column_sums(weight if whole else take_rows(weight, rows)) / G
    inv_t = np.divide(1.0, target_K, out=np.zeros_like(target_K), where=target_K > 0)
    shuffled_rows = shuffled(rng, rows)
    # Rows over half a cap first (no two share a group, and late they find no room), then by
    # normalized cost, so that every group gets one row of each size stratum.
    hard, size, norm = row_shares(shuffled_rows, load, caps, weight, inv_t)
    order = deal_order(hard, norm, _HARD_SHARE)
    queue = shuffled_rows[order]
    volume = np.cumsum(size[order])
    cut = max(int(np.searchsorted(volume, (1.0 - fill_share) * volume[-1])), min(G, len(queue)))
    gid = deal_rounds(queue[:cut], load, weight, caps, int(G), inv_t, _MAX_STRAGGLERS)
    dealt = gid >= 0
    rest = np.concatenate([queue[:cut][~dealt], queue[cut:]])
    if len(rest) == 0:
        return queue, gid
    rest = first_fit_orders(rest, load, caps, rng)[0]
    lsum_GK = load_sums(gid[dealt], queue[:cut][dealt], load, G)
    rest_gid, _ = first_fit(rest, load, caps, suffix_min(rest, load), LOOKBACK, lsum_GK)
    return np.concatenate([queue[:cut][dealt], rest]), np.concatenate([gid[dealt], rest_gid])


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
        wsum[donors], lsum[donors] = wsum[donors] - weight[moved], lsum[donors] - load[moved]
        wsum[empty], lsum[empty] = weight[moved], load[moved]
