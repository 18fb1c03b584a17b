"""The ``measured`` cost model: per-module times fitted by ``balancer calibrate`` (``costs.json``).

A module's time for one group is ``a*sum(l^2) + b*sum(l) + c*count + d``, where ``l`` runs over the
group's sequences: its samples' ``llm_tokens`` for the LLM, its items' tokens for an encoder
(``<m>_seqlens`` when the lengths table has them, else ``<m>_tokens / <m>_items`` each), and
``count`` is the number of those sequences. A sample's cost is its share,
``a*sum(l_i^2) + b*sum(l_i) + c*count_i``; the per-group ``d`` is left out, because every rank runs
the same number of groups per step and ``d`` moves no rank relative to another.

``costs.json`` (schema version 1)::

    {"schema_version": 1, "device": "cpu", "dtype": "float32", "attention": "sdpa",
     "versions": {"torch": ..., "transformers": ..., "balancer_cli": ...},
     "config_fingerprint": "<blake2b of config.json>",
     "modules": {"vision": {"coeffs": {"quadratic": a, "linear": b, "count": c, "constant": d},
                            "unit": "seconds", "r2_heldout": ..., "max_rel_err_heldout": ...,
                            "flops_r2_heldout": ..., "per_layer_seconds": [...]}, "llm": {...}}}

Example:
    >>> import numpy as np
    >>> from balancer_cli.lengths import make_lengths_table
    >>> costs = MeasuredCosts.from_json({"schema_version": 1, "modules": {
    ...     "llm": {"coeffs": {"quadratic": 0.0, "linear": 1e-3, "count": 0.5, "constant": 2.0}}}})
    >>> measured_sample_costs(make_lengths_table(np.array([1000, 10])), costs)["llm"].tolist()
    [1.5, 0.51]
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from balancer_cli.cost.fit import FEATURES
from balancer_cli.errors import InputError, UsageError
from balancer_cli.lengths import LLM, LengthsTable

__all__ = ["SCHEMA_VERSION", "MeasuredCosts", "ModuleFit", "measured_sample_costs", "read_costs", "sequence_features"]

SCHEMA_VERSION = 1

#: Optional per-module fields of costs.json kept as they are (quality figures, profiles).
_MODULE_EXTRAS = ("r2_heldout", "max_rel_err_heldout", "flops_r2_heldout", "flops_max_rel_err_heldout",
                  "tokens_r2_heldout", "tokens_max_rel_err_heldout", "per_layer_seconds", "other_seconds",
                  "num_layers", "shapes", "memory")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModuleFit:
    """One module's fitted time ``quadratic*sum(l^2) + linear*sum(l) + count*n + constant`` (seconds).

    Attributes:
        quadratic, linear, count, constant: the coefficients (>= 0).
        unit: ``seconds``.
        extras: the other fields of the module's entry (held-out R^2, per-layer seconds, ...).

    Example:
        >>> ModuleFit(quadratic=0.0, linear=2.0, count=1.0, constant=0.5).group_seconds([3, 4])
        16.5
    """

    quadratic: float
    linear: float
    count: float
    constant: float = 0.0
    unit: str = "seconds"
    extras: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        for name in FEATURES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
                raise ValueError(f"coefficient {name!r} must be a finite number >= 0, not {value!r}")

    @property
    def coeffs(self) -> np.ndarray:
        """(4,) coefficients in the order of :data:`~balancer_cli.cost.fit.FEATURES`."""
        return np.array([float(getattr(self, name)) for name in FEATURES])

    def group_seconds(self, lengths: Any) -> float:
        """Predicted seconds of one group whose sequences have ``lengths``."""
        l = np.asarray(lengths, dtype=np.float64)
        return float(self.quadratic * (l * l).sum() + self.linear * l.sum() + self.count * len(l) + self.constant)

    def extra(self, name: str, default: Any = None) -> Any:
        """One of the optional fields (``r2_heldout``, ``per_layer_seconds``, ...)."""
        return dict(self.extras).get(name, default)


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredCosts:
    """A calibration: fitted times per module and what they were measured on.

    Attributes:
        modules: ``((module, ModuleFit), ...)``, encoders first, ``llm`` last.
        device, dtype, attention: where and how the times were measured.
        versions: ``((package, version), ...)``.
        config_fingerprint: fingerprint of the model's ``config.json``.
    """

    modules: tuple[tuple[str, ModuleFit], ...]
    device: str = "unknown"
    dtype: str = "unknown"
    attention: str = "unknown"
    versions: tuple[tuple[str, str], ...] = ()
    config_fingerprint: str = ""
    settings: tuple[tuple[str, Any], ...] = field(default=())

    def module(self, name: str, *, where: str = "the costs") -> ModuleFit:
        """The fit of module ``name``.

        Raises:
            UsageError: the calibration has no such module.
        """
        for module, fit in self.modules:
            if module == name:
                return fit
        have = ", ".join(m for m, _ in self.modules) or "none"
        raise UsageError(f"{where} have no module {name!r} (calibrated: {have})",
                         fix=f"calibrate it: balancer calibrate CONFIG_DIR --modules {name},... -o costs.json")

    def cost_coeffs(self, modules: tuple[str, ...] | list[str]) -> list[tuple[float, float, float]]:
        """``(linear, quadratic, count)`` per module: the ``cost_coeffs`` of
        :func:`~balancer_cli.replay.post_balance.plan.plan_post_balance` when each column holds one
        sequence length per sample (the LLM's tokens; an encoder with one item per sample). With
        several items per sample, pass :func:`measured_sample_costs` columns instead.

        Example:
            >>> costs = MeasuredCosts(modules=(("llm", ModuleFit(quadratic=1e-9, linear=1e-5, count=1e-3)),))
            >>> costs.cost_coeffs(["llm"])
            [(1e-05, 1e-09, 0.001)]
        """
        return [(fit.linear, fit.quadratic, fit.count) for fit in (self.module(m) for m in modules)]

    def to_json(self) -> dict[str, Any]:
        """The costs.json document (:data:`SCHEMA_VERSION`)."""
        modules = {}
        for name, fit in self.modules:
            modules[name] = {"coeffs": {f: float(getattr(fit, f)) for f in FEATURES}, "unit": fit.unit,
                             **{k: v for k, v in fit.extras}}
        return {"schema_version": SCHEMA_VERSION, "device": self.device, "dtype": self.dtype,
                "attention": self.attention, "versions": dict(self.versions),
                "config_fingerprint": self.config_fingerprint, **dict(self.settings), "modules": modules}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], *, where: str = "costs") -> MeasuredCosts:
        """Parse and check a costs.json document.

        Raises:
            InputError: a wrong schema version, a missing or non-numeric coefficient, a negative one.
        """
        if not isinstance(doc, Mapping):
            raise InputError(f"{where}: expected a JSON object", fix="pass the costs.json `balancer calibrate` wrote")
        version = doc.get("schema_version")
        if version != SCHEMA_VERSION:
            raise InputError(f"{where}: schema_version {version!r} is not {SCHEMA_VERSION}",
                             fix="re-run balancer calibrate with this version")
        raw = doc.get("modules")
        if not isinstance(raw, Mapping) or not raw:
            raise InputError(f"{where}: field 'modules' is missing or empty", fix="pass the costs.json `balancer calibrate` wrote")
        modules = []
        for name, entry in raw.items():
            coeffs = entry.get("coeffs") if isinstance(entry, Mapping) else None
            if not isinstance(coeffs, Mapping):
                raise InputError(f"{where}: module {name!r} has no 'coeffs'", fix="re-run balancer calibrate")
            values = {}
            for f in FEATURES:
                value = coeffs.get(f, 0.0 if f == "constant" else None)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
                    raise InputError(f"{where}: modules.{name}.coeffs.{f} is {value!r}",
                                     fix="coefficients must be finite numbers >= 0; re-run balancer calibrate")
                values[f] = float(value)
            extras = tuple((k, entry[k]) for k in _MODULE_EXTRAS if k in entry)
            modules.append((str(name), ModuleFit(**values, unit=str(entry.get("unit", "seconds")), extras=extras)))
        modules.sort(key=lambda pair: pair[0] == LLM)  # encoders first, llm last
        known = {"schema_version", "device", "dtype", "attention", "versions", "config_fingerprint", "modules"}
        return cls(modules=tuple(modules), device=str(doc.get("device", "unknown")), dtype=str(doc.get("dtype", "unknown")),
                   attention=str(doc.get("attention", "unknown")),
                   versions=tuple(sorted((str(k), str(v)) for k, v in dict(doc.get("versions") or {}).items())),
                   config_fingerprint=str(doc.get("config_fingerprint", "")),
                   settings=tuple((k, v) for k, v in doc.items() if k not in known))


def read_costs(path: str | os.PathLike) -> MeasuredCosts:
    """Read and check a costs.json file.

    Raises:
        InputError: the file is missing, is not JSON, or is not a valid calibration.
    """
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: cannot read costs JSON ({exc})",
                         fix="pass the costs.json `balancer calibrate` wrote (--costs FILE)") from None
    return MeasuredCosts.from_json(doc, where=str(path))


def sequence_features(lengths: LengthsTable, module: str) -> np.ndarray:
    """Per-sample (N, 3) features ``[sum(l^2), sum(l), count]`` over the sample's sequences in ``module``.

    For the LLM a sample is one sequence of ``llm_tokens``; for an encoder its items are, of
    ``<m>_seqlens`` tokens each when present, else ``<m>_tokens / <m>_items`` each. Samples with an
    error have zero features.

    Example:
        >>> from balancer_cli.lengths import make_lengths_table
        >>> lt = make_lengths_table(np.array([300, 40]), {"vision": (np.array([512, 0]), np.array([2, 0]))})
        >>> sequence_features(lt, "vision").tolist()
        [[131072.0, 512.0, 2.0], [0.0, 0.0, 0.0]]
    """
    ok = lengths.ok_mask()
    out = np.zeros((lengths.table.num_rows, 3))
    if module == LLM:
        tokens = np.where(ok, lengths.llm_tokens(), 0).astype(np.float64)
        out[:, 0], out[:, 1], out[:, 2] = tokens * tokens, tokens, (tokens > 0)
        return out
    items = np.where(ok, lengths.items(module), 0).astype(np.float64)
    tokens = np.where(ok, lengths.tokens(module), 0).astype(np.float64)
    out[:, 0] = lengths.item_sumsq(module)
    out[:, 1], out[:, 2] = tokens, items
    return out


def measured_sample_costs(lengths: LengthsTable, costs: MeasuredCosts) -> dict[str, np.ndarray]:
    """Seconds per sample and module, ``{module: (N,) float64}``, encoders first, ``llm`` last.

    Raises:
        UsageError: a module of the lengths table was not calibrated.
    """
    out = {}
    for module in tuple(lengths.modules) + (LLM,):
        fit = costs.module(module)
        out[module] = sequence_features(lengths, module) @ fit.coeffs[:3]
    return out
