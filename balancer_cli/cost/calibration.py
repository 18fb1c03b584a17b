"""Which group shapes ``balancer calibrate`` times: a grid drawn from the lengths table's distribution.

A *shape* is the tuple of sequence lengths of one packed group of one module: its samples'
``llm_tokens`` for the LLM, its items' tokens for an encoder (what
:func:`~balancer_cli.cost.measured.sequence_features` reads). Two sets are drawn:

- **fit shapes**: uniform groups ``(l,) * n`` for ``l`` at quantiles of the module's sequence
  lengths and ``n`` doubling from 1 up to the group limit, plus the largest group of each length.
  Uniform groups separate the four features (``sum l^2``, ``sum l``, ``count``, 1), which is what a
  well-posed fit needs.
- **held-out shapes**: groups of real lengths drawn at random from the table, filled to a random
  share of the group limit, the way packed groups look. The fit is judged on these only.

Lengths are rounded up to a multiple of ``quantum`` (Qwen2-VL's ViT needs an even patch grid: 4).

Example:
    >>> import numpy as np
    >>> spec = GridSpec(max_total=64, num_lengths=2, num_heldout=2, seed=0)
    >>> fit, heldout = plan_shapes(np.array([4, 8, 8, 16, 32]), spec)
    >>> sorted({s[0] for s in fit}), max(sum(s) for s in fit) <= 64, len(heldout)
    ([4, 32], True, 2)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from balancer_cli.cost.samples import CostModel
from balancer_cli.errors import UsageError
from balancer_cli.lengths import LLM, LengthsTable

__all__ = [
    "MAX_GROUP_ITEMS",
    "MAX_GROUP_TOKENS",
    "GridSpec",
    "Shape",
    "default_limits",
    "group_proxies",
    "group_shapes",
    "plan_shapes",
    "sequence_lengths",
]

#: One group of one module: the lengths of its sequences.
Shape = tuple[int, ...]

#: The largest LLM group a calibration times, in tokens (``--max-llm-tokens``): 1M tokens, past
#: the longest context windows; every fit shape up to it is built and run, so an unbounded limit
#: would ask for groups no machine holds.
MAX_GROUP_TOKENS = 1 << 20
#: The largest encoder group a calibration times, in items (``--max-vision-items``).
MAX_GROUP_ITEMS = 1 << 12


@dataclass(frozen=True, kw_only=True, slots=True)
class GridSpec:
    """How many shapes to time, and how large a group may get.

    Attributes:
        max_total: the largest sum of lengths in one group (the LLM's token cap), or None.
        max_count: the most sequences in one group (an encoder's item cap), or None.
        num_lengths: quantiles of the length distribution the fit shapes use.
        num_heldout: held-out groups of real lengths.
        quantum: lengths are rounded up to a multiple of this.
        seed: the held-out draw's seed.

    Raises:
        UsageError: neither limit, a limit below 1 or above :data:`MAX_GROUP_TOKENS` /
            :data:`MAX_GROUP_ITEMS`, or fewer than 2 lengths.
    """

    max_total: int | None = None
    max_count: int | None = None
    num_lengths: int = 6
    num_heldout: int = 16
    quantum: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_total is None and self.max_count is None:
            raise UsageError("a calibration grid needs a group limit (max_total or max_count)")
        for name, most in (("max_total", MAX_GROUP_TOKENS), ("max_count", MAX_GROUP_ITEMS)):
            value = getattr(self, name)
            if value is not None and not 1 <= value <= most:
                raise UsageError(f"{name} must be in 1..{most}, not {value}",
                                 fix=f"time groups of at most {most} (the cap you pack with)")
        if self.num_lengths < 2 or self.num_heldout < 1 or self.quantum < 1:
            raise UsageError("a calibration grid needs num_lengths >= 2, num_heldout >= 1 and quantum >= 1")

    def fits(self, shape: Shape) -> bool:
        """Whether a group of these lengths is within the limits."""
        return ((self.max_total is None or sum(shape) <= self.max_total)
                and (self.max_count is None or len(shape) <= self.max_count))


def sequence_lengths(lengths: LengthsTable, module: str) -> np.ndarray:
    """(n,) int64 lengths of every sequence of ``module`` in the measured samples (zeros left out).

    Example:
        >>> from balancer_cli.lengths import make_lengths_table
        >>> lt = make_lengths_table(np.array([300, 40]), {"vision": (np.array([512, 0]), np.array([2, 0]))})
        >>> sequence_lengths(lt, "vision").tolist(), sequence_lengths(lt, "llm").tolist()
        ([256, 256], [300, 40])
    """
    ok = lengths.ok_mask()
    if module == LLM:
        tokens = np.asarray(lengths.llm_tokens(), dtype=np.int64)[ok]
        return tokens[tokens > 0]
    column = f"{module}_seqlens"
    if column in lengths.table.column_names:
        import pyarrow.compute as pc

        seqlens = lengths.table.column(column).combine_chunks().filter(ok)
        flat = np.asarray(pc.list_flatten(seqlens).to_numpy(zero_copy_only=False), dtype=np.int64)
        return flat[flat > 0]
    items = np.asarray(lengths.items(module), dtype=np.int64)[ok]
    tokens = np.asarray(lengths.tokens(module), dtype=np.int64)[ok]
    has = items > 0
    per_item = np.maximum(tokens[has] // items[has], 1)
    return np.repeat(per_item, items[has])


def default_limits(seq_lengths: np.ndarray, module: str, items_per_sample: np.ndarray | None = None
                   ) -> dict[str, int]:
    """Default group limits: ``max_total`` of 8 median samples (LLM), ``max_count`` of 8 median samples'
    items (encoders); never below the 99th percentile of one sample, so the largest groups are covered.

    Example:
        >>> default_limits(np.array([100, 200, 300]), "llm")
        {'max_total': 1600}
    """
    if len(seq_lengths) == 0:
        raise UsageError(f"no sample has {module} sequences to calibrate on",
                         fix="pass a lengths table with this module, or leave it out of --modules")
    if module == LLM:
        return {"max_total": int(max(8 * np.median(seq_lengths), np.percentile(seq_lengths, 99)))}
    per = items_per_sample[items_per_sample > 0] if items_per_sample is not None else np.array([1])
    return {"max_count": int(max(8 * np.median(per), np.percentile(per, 99), 1))}


def _round_up(values: np.ndarray, quantum: int) -> np.ndarray:
    return np.maximum(-(-values // quantum) * quantum, quantum)


def plan_shapes(seq_lengths: np.ndarray, spec: GridSpec) -> tuple[tuple[Shape, ...], tuple[Shape, ...]]:
    """The fit shapes and the held-out shapes of one module (see the module docstring).

    Args:
        seq_lengths: the module's sequence lengths (:func:`sequence_lengths`).
        spec: limits and sizes of the grid.

    Raises:
        UsageError: no lengths, or no sequence fits ``spec.max_total``.
    """
    l = np.asarray(seq_lengths, dtype=np.int64)
    if len(l) == 0:
        raise UsageError("no sequences to calibrate on", fix="pass a lengths table with this module")
    cap = spec.max_total if spec.max_total is not None else int(l.max()) * (spec.max_count or 1)
    usable = _round_up(l, spec.quantum)
    usable = usable[usable <= cap]
    if len(usable) == 0:
        raise UsageError(f"no sequence fits a group of {spec.max_total} tokens (the shortest has {int(l.min())})",
                         fix="raise the group limit (--max-llm-tokens)")
    quantiles = np.quantile(usable, np.linspace(0.0, 1.0, spec.num_lengths), method="nearest")
    fit: list[Shape] = []
    for length in sorted({int(v) for v in _round_up(quantiles, spec.quantum)}):
        most = cap // length if spec.max_count is None else min(cap // length, spec.max_count)
        counts = {1, most}
        n = 2
        while n < most:
            counts.add(n)
            n *= 2
        fit += [(length,) * n for n in sorted(counts) if n >= 1]
    rng = np.random.default_rng(spec.seed)
    heldout: list[Shape] = []
    for _ in range(spec.num_heldout):
        share = rng.uniform(0.15, 1.0)
        group: list[int] = []
        while True:
            candidate = group + [int(usable[rng.integers(len(usable))])]
            if not spec.fits(tuple(candidate)):
                break
            group = candidate
            if sum(group) >= share * cap if spec.max_count is None else len(group) >= share * spec.max_count:
                break
        heldout.append(tuple(group) if group else (int(usable.min()),))
    return tuple(fit), tuple(heldout)


def group_proxies(model: CostModel, module: str, shapes: tuple[Shape, ...]) -> dict[str, np.ndarray]:
    """(S,) training FLOPs and tokens of each group of ``module`` under ``model`` (the proxies a
    calibration is compared with).

    Example:
        >>> from balancer_cli.cost.samples import CostModel
        >>> proxies = group_proxies(CostModel.build("qwen2-7b"), "llm", ((300,), (100, 200)))
        >>> proxies["tokens"].tolist(), bool(proxies["flops"][0] > proxies["flops"][1])
        ([300.0, 300.0], True)
    """
    from balancer_cli.lengths import make_lengths_table

    flat = np.array([l for shape in shapes for l in shape], dtype=np.int64)
    owner = np.repeat(np.arange(len(shapes)), [len(s) for s in shapes])
    if module == LLM:
        table = make_lengths_table(flat)
    else:
        encoder = CostModel(llm=model.llm, encoders=((module, model.encoder(module)),), attention=model.attention)
        table, model = make_lengths_table(np.zeros_like(flat), {module: (flat, np.ones_like(flat))}), encoder
    per_sequence = model.sample_flops(table)[module]
    return {"flops": np.bincount(owner, weights=per_sequence, minlength=len(shapes)),
            "tokens": np.bincount(owner, weights=flat.astype(np.float64), minlength=len(shapes))}


def group_shapes(lengths: LengthsTable, module: str, samples_by_group: list[np.ndarray]) -> list[Shape]:
    """The shape of each group of samples in ``module`` (its samples' LLM lengths, or their items' tokens).

    Example:
        >>> from balancer_cli.lengths import make_lengths_table
        >>> lt = make_lengths_table(np.array([300, 40]), {"vision": (np.array([512, 0]), np.array([2, 0]))})
        >>> group_shapes(lt, "vision", [np.array([0, 1])]), group_shapes(lt, "llm", [np.array([1, 0])])
        ([(256, 256)], [(40, 300)])
    """
    ok = lengths.ok_mask()
    if module == LLM:
        tokens = np.where(ok, lengths.llm_tokens(), 0)
        return [tuple(int(t) for t in tokens[g] if t > 0) for g in samples_by_group]
    column = f"{module}_seqlens"
    if column in lengths.table.column_names:
        seqlens = lengths.table.column(column).to_pylist()
        per_sample = [tuple(int(x) for x in (s or ()) if x > 0) if good else () for s, good in zip(seqlens, ok)]
    else:
        items = np.where(ok, lengths.items(module), 0)
        tokens = np.where(ok, lengths.tokens(module), 0)
        each = np.divide(tokens, items, out=np.zeros(len(items)), where=items > 0).astype(np.int64)
        return [tuple(l for s in g for l in (int(max(each[s], 1)),) * int(items[s])) for g in samples_by_group]
    return [tuple(l for s in g for l in per_sample[s]) for g in samples_by_group]


def memory_cap(coeffs: np.ndarray, budget_bytes: float, module: str, *, shortest: int, longest: int) -> int:
    """The largest cap whose every group fits ``budget_bytes`` under the fitted peak memory
    ``coeffs`` (``a*sum(l^2) + b*sum(l) + c*count + d`` bytes); 0 when not even one sequence fits.

    For the LLM the cap is in tokens and a group of ``T`` tokens is judged at its worst: one
    sequence of ``T`` (attention memory grows with ``l^2``) or ``T / shortest`` sequences of
    ``shortest`` (per-sequence memory). For an encoder the cap is in items, each of ``longest``
    tokens.

    Example:
        >>> memory_cap(np.array([0.0, 2.0, 0.0, 100.0]), 1100.0, "llm", shortest=10, longest=400)
        500
        >>> memory_cap(np.array([0.0, 1.0, 0.0, 0.0]), 1100.0, "vision", shortest=10, longest=100)
        11
    """
    a, b, c, d = (float(x) for x in coeffs)
    room = budget_bytes - d
    if module != LLM:
        per_item = a * longest ** 2 + b * longest + c
        return max(int(room // per_item), 0) if per_item > 0 else 0

    def worst(tokens: int) -> float:
        many = max(tokens // max(shortest, 1), 1)
        return max(a * tokens ** 2 + b * tokens + c, a * many * shortest ** 2 + b * tokens + c * many)

    if room <= 0 or worst(1) > room:
        return 0
    lo, hi = 1, 1
    while worst(hi) <= room and hi < 1 << 40:
        lo, hi = hi, hi * 2
    while lo < hi - 1:  # worst() grows with the tokens: bisect for the last that fits
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if worst(mid) <= room else (lo, mid)
    return lo
