"""Every parameter of a pack run, validated once, and the seeded random streams of a run.

:class:`PackConfig` is the value object the CLI, :func:`balancer_cli.run.pack_to_dir` and Python
users build; everything it holds lands in the manifest metadata (:meth:`PackConfig.to_meta`), from
which :meth:`PackConfig.from_meta` rebuilds it (``balancer report`` re-packs the baselines so).

:func:`rng` gives each consumer of randomness its own named stream per epoch, so the packer and
the assigner of an epoch never share draws, and ``(seed 0, epoch 1)`` differs from
``(seed 1, epoch 0)``.

Example:
    >>> config = PackConfig(world_size=2, caps={"llm": 4096}, epochs=2)
    >>> config.shape.groups_per_step, config.caps
    (2, (('llm', 4096),))
    >>> PackConfig.from_meta({**config.to_meta(), "epoch_num_steps": [3, 3]}) == config
    True
    >>> PackConfig(oversize="squeeze")
    Traceback (most recent call last):
    ...
    balancer_cli.errors.UsageError: unknown oversize 'squeeze'; fix: use one of: isolate, drop, error
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

import numpy as np

from balancer_cli.errors import ManifestError, UsageError, check_int
from balancer_cli.manifest import StepShape
from balancer_cli.pack.types import OVERSIZE_POLICIES, Oversize

if TYPE_CHECKING:
    from balancer_cli.pack.packers.registry import Algorithm

CostModelName = Literal["tokens", "flops", "measured"]

__all__ = ["PackConfig", "CostModelName", "Stream", "STREAMS", "MAX_CAP", "MAX_TARGET_GROUP_SIZE", "rng", "stream_seed"]


Stream = Literal["pack", "assign", "search", "window", "polish", "trade"]
#: The named random streams of a pack run; a stream's index is part of its seed.
STREAMS: tuple[str, ...] = get_args(Stream)

Pairs = tuple[tuple[str, int], ...]

#: The largest cap or bound (items or tokens of one group): int32's range, far past any GPU's
#: memory, and small enough that sums of a group's loads never overflow the packers' int64.
MAX_CAP = (1 << 31) - 1
#: The largest ``target_group_size``: the search scales the caps by it, so past this they would
#: leave every integer type (a million samples in one group is past any training job).
MAX_TARGET_GROUP_SIZE = 1_000_000


def _pairs(value: Mapping[str, int] | Sequence[tuple[str, int]], name: str) -> Pairs:
    """``{m: v}`` or ``((m, v), ...)`` -> ``((m, int v), ...)`` with integers in 1..MAX_CAP, in the given order."""
    items = tuple(value.items()) if isinstance(value, Mapping) else tuple(tuple(x) for x in value)
    for module, number in items:
        if (isinstance(number, bool) or not isinstance(number, (int, np.integer)) or number <= 0
                or number > MAX_CAP):
            raise UsageError(f"{{{name}[{module}]}} {number!r} must be a positive integer up to {MAX_CAP}",
                             fix=f"give a positive integer of at most {MAX_CAP}")
    return tuple((str(m), int(v)) for m, v in items)


def _positive(config: PackConfig, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value is not None:
            check_int(name, value, least=1, fix=f"give a positive {{{name}}}")


@dataclass(frozen=True, kw_only=True, slots=True)
class PackConfig:
    """Every parameter of a pack run (all of it lands in the manifest metadata).

    Attributes:
        world_size: data-parallel ranks R.
        micro_batches: groups per rank per step M.
        algorithm: a packer of :data:`balancer_cli.pack.packers.registry.PACKERS`.
        caps: ``{module: cap}`` (or pairs): encoder items / LLM tokens per group, each at most
            :data:`MAX_CAP`. When some module has no cap, the threshold search picks all caps, using
            the given ones as upper limits.
        bounds: ``{module: bound}``: ISF acceptance bounds Q'; default from the search or 0.9 x cap.
        iterations: ISF sampling iterations C.
        oversize: what to do with a sample over a cap on its own (:data:`OVERSIZE_POLICIES`).
        epochs: epochs to pack, each with its own random streams.
        seed: base seed (>= 0).
        cost_model: a cost model of :data:`balancer_cli.cost.samples.COST_MODELS`.
        cost_presets: ``{module: preset or model file}`` for the ``flops`` cost model.
        costs: the calibration of the ``measured`` cost model
            (:class:`~balancer_cli.cost.measured.MeasuredCosts` or the path of a costs.json, read here).
        target_group_size: optional samples-per-group target handed to the search (1 to
            :data:`MAX_TARGET_GROUP_SIZE`).
        batch_size: fixed samples per group of the ``random`` packer (default: the mean group size
            the caps give, rounded).
        lengths_files: input paths, recorded in the metadata for ``balancer report``.
        post_balance: add ``<m>_rank`` columns (the rank that runs encoder m's phase per row).
        window_samples: pack in windows of about this many samples (:mod:`balancer_cli.pack.windows`);
            None: one window.
    """

    world_size: int = 1
    micro_batches: int = 1
    algorithm: Algorithm = "balanced"
    caps: Pairs = ()
    bounds: Pairs = ()
    iterations: int = 50
    oversize: Oversize = "isolate"
    epochs: int = 1
    seed: int = 0
    cost_model: CostModelName = "tokens"
    cost_presets: tuple[tuple[str, str], ...] = ()
    costs: Any = None
    target_group_size: float | None = None
    batch_size: int | None = None
    lengths_files: tuple[str, ...] = ()
    post_balance: bool = False
    window_samples: int | None = None
    shape: StepShape = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from balancer_cli.cost.samples import COST_MODELS
        from balancer_cli.pack.packers.registry import PACKERS

        _positive(self, "world_size", "micro_batches", "epochs", "iterations", "batch_size", "window_samples")
        target = self.target_group_size
        if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float, np.number))
                                   or not 1 <= target <= MAX_TARGET_GROUP_SIZE):
            raise UsageError(f"{{target_group_size}} must be a number >= 1 and <= {MAX_TARGET_GROUP_SIZE}, "
                             f"not {target!r}", fix=f"give a mean group size from 1 to {MAX_TARGET_GROUP_SIZE} samples")
        check_int("seed", self.seed, least=0, fix="give a non-negative seed")
        for name, choices in (("algorithm", tuple(PACKERS)), ("oversize", OVERSIZE_POLICIES),
                              ("cost_model", tuple(COST_MODELS))):
            if getattr(self, name) not in choices:
                raise UsageError(f"unknown {{{name}}} {getattr(self, name)!r}", fix=f"use one of: {', '.join(choices)}")
        set_ = object.__setattr__  # frozen: normalize once, here
        set_(self, "caps", _pairs(self.caps, "caps"))
        set_(self, "bounds", _pairs(self.bounds, "bounds"))
        presets = self.cost_presets
        set_(self, "costs", _calibration(self.cost_model, self.costs))
        set_(self, "cost_presets", tuple(presets.items()) if isinstance(presets, Mapping) else tuple(map(tuple, presets)))
        set_(self, "lengths_files", tuple(str(p) for p in self.lengths_files))
        set_(self, "shape", StepShape(world_size=int(self.world_size), micro_batches=int(self.micro_batches)))

    def to_meta(self) -> dict[str, Any]:
        """The run's parameters as manifest metadata (the packer adds resolved caps, bounds, search)."""
        return {
            "algorithm": self.algorithm,
            "params": {
                "iterations": self.iterations, "oversize": self.oversize, "cost_model": self.cost_model,
                "cost_presets": dict(self.cost_presets),
                **({"costs": self.costs.to_json()} if self.costs is not None else {}),
                "target_group_size": self.target_group_size,
                "batch_size": self.batch_size, "post_balance": self.post_balance,
                "window_samples": self.window_samples,
                "caps": dict(self.caps), "bounds": dict(self.bounds),
            },
            "seed": self.seed, "epochs": self.epochs, "world_size": self.world_size,
            "micro_batches": self.micro_batches, "lengths_files": list(self.lengths_files),
        }

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any], where: str = "the manifest", **overrides: Any) -> PackConfig:
        """The config a manifest was packed with, from its metadata; its resolved caps and bounds are
        the config's caps and bounds (so re-packing needs no search). ``overrides`` replace fields.

        Raises:
            ManifestError: the metadata (of ``where``) holds parameters no run could have had.
            UsageError: ``overrides`` do (a caller's own options).
        """
        try:
            config = cls._recorded(meta)
        except UsageError as exc:  # the record's fault, not an option's: exit 1, named by field
            raise ManifestError(f"{where}: its recorded parameters are invalid ({exc.for_flags({}).split('; fix: ')[0]})",
                                fix="re-run `balancer pack` (the metadata was edited after it was written)") from None
        return dataclasses.replace(config, **overrides) if overrides else config

    @classmethod
    def _recorded(cls, meta: Mapping[str, Any]) -> PackConfig:
        params = meta.get("params", {})
        fields = dict(
            world_size=int(meta["world_size"]), micro_batches=int(meta["micro_batches"]),
            algorithm=str(meta.get("algorithm", "balanced")),
            caps=tuple((m, int(c)) for m, c in params.get("caps", {}).items()),
            bounds=tuple((m, int(b)) for m, b in params.get("bounds", {}).items()),
            iterations=int(params.get("iterations", 50)), oversize=str(params.get("oversize", "isolate")),
            epochs=int(meta.get("epochs", len(meta.get("epoch_num_steps", [1])))), seed=int(meta.get("seed", 0)),
            cost_model=str(params.get("cost_model", "tokens")),
            cost_presets=tuple(sorted(dict(params.get("cost_presets", {})).items())),
            costs=_costs_from_meta(params.get("costs")),
            target_group_size=params.get("target_group_size"), batch_size=params.get("batch_size"),
            lengths_files=tuple(meta.get("lengths_files", ())), post_balance=bool(params.get("post_balance", False)),
            window_samples=params.get("window_samples"))
        return cls(**fields)

    def epoch_seed(self, epoch: int, stream: Stream) -> int:
        """The integer seed of ``stream`` in ``epoch`` (see :func:`stream_seed`)."""
        return stream_seed(self.seed, epoch, stream)


def _calibration(cost_model: str, costs: Any) -> Any:
    """The checked calibration of ``costs`` (None unless the cost model is ``measured``)."""
    from balancer_cli.cost.measured import MeasuredCosts, read_costs

    if cost_model != "measured":
        if costs is not None:
            raise UsageError(f"a calibration (costs) was given but {{cost_model}} is {cost_model!r}",
                             fix="add --cost-model measured, or leave --costs out")
        return None
    if costs is None:
        raise UsageError("the measured cost model needs a calibration", fix="pass --costs costs.json (balancer calibrate)")
    return costs if isinstance(costs, MeasuredCosts) else read_costs(costs)


def _costs_from_meta(doc: Any) -> Any:
    """The calibration a manifest recorded (None when it has none)."""
    from balancer_cli.cost.measured import MeasuredCosts

    return None if doc is None else MeasuredCosts.from_json(doc, where="the manifest's recorded costs")


def stream_seed(seed: int, epoch: int, stream: Stream, *, window: int = 0) -> int:
    """The integer seed a packer, assigner or search of one epoch is seeded with.

    Drawn from :class:`numpy.random.SeedSequence` with ``seed`` as entropy and ``(epoch, stream)``
    as spawn key (plus the window for pack windows after the first; window 0 keeps the run's own
    seeds), so every (seed, epoch, stream, window) has its own independent stream. It is below
    2**31, so seeding ``np.random.RandomState(s + i)`` for ISF's iterations stays valid.

    Example:
        >>> stream_seed(0, 1, "pack") != stream_seed(1, 0, "pack") != stream_seed(0, 1, "assign")
        True
        >>> stream_seed(7, 2, "pack") == stream_seed(7, 2, "pack") < 2**31
        True
    """
    if stream not in STREAMS:
        raise UsageError(f"unknown random stream {stream!r}", fix=f"use one of: {', '.join(STREAMS)}")
    key = (int(epoch), STREAMS.index(stream)) + ((int(window),) if window else ())
    sequence = np.random.SeedSequence(entropy=int(seed), spawn_key=key)
    return int(sequence.generate_state(1, np.uint32)[0] >> 1)


def rng(seed: int, epoch: int, stream: Stream) -> np.random.Generator:
    """A generator for ``stream`` of ``epoch`` in a run seeded ``seed``.

    Example:
        >>> float(rng(0, 0, "pack").random()) == float(rng(0, 0, "pack").random())
        True
    """
    return np.random.default_rng(stream_seed(seed, epoch, stream))
