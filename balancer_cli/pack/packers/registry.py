"""The packer registry: every way ``pack`` and the report can form groups, by name.

Each :class:`PackerSpec` turns the samples without a scan error (:class:`SampleView`), a
:class:`~balancer_cli.pack.config.PackConfig` and the resolved caps/bounds into an
``epoch -> Packing`` function. The CLI takes ``--algorithm`` choices (``selectable``) and the
report's default baselines (``baseline``) from here, so adding a packer is one entry.

Example:
    >>> names(selectable=True), names(baseline=True)
    (('balanced', 'isf'), ('dataloader', 'random', 'llm-ffd', 'isf'))
    >>> PACKERS["dataloader"].sequential
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from balancer_cli.errors import UsageError
from balancer_cli.manifest import StepShape
from balancer_cli.pack.types import Packing

__all__ = ["Algorithm", "SampleView", "PackerConfig", "PackerSpec", "PACKERS", "names", "get", "Packer"]

#: The registered packer names, as a type (a test keeps it equal to :data:`PACKERS`).
Algorithm = Literal["balanced", "dataloader", "random", "llm-ffd", "isf"]

#: ``epoch -> Packing`` over the samples without error (ids are dataset sample ids).
Packer = Callable[[int], Packing]


@dataclass(frozen=True, kw_only=True, slots=True)
class SampleView:
    """The samples a packer may place (those without a scan error), as (n,) / (n, K) arrays.

    Attributes:
        ids_n: dataset sample ids.
        load_nK: capped quantity per module (encoder items, LLM tokens last).
        cost_nK: balanced cost per module.
        source_n: source code of each sample.
        modules: the K module names.
    """

    ids_n: np.ndarray
    load_nK: np.ndarray
    cost_nK: np.ndarray
    source_n: np.ndarray
    modules: tuple[str, ...]


class PackerConfig(Protocol):
    """What a packer reads of a :class:`~balancer_cli.pack.config.PackConfig` (which validates its
    ``algorithm`` against this registry, so the registry does not import it)."""

    shape: StepShape
    oversize: str
    iterations: int
    batch_size: int | None

    def epoch_seed(self, epoch: int, stream: str) -> int: ...


#: ``(samples, config, caps_K, bounds_K) -> Packer``.
Builder = Callable[[SampleView, PackerConfig, np.ndarray, np.ndarray], Packer]


@dataclass(frozen=True, kw_only=True, slots=True)
class PackerSpec:
    """One packer.

    Attributes:
        name: its name (``--algorithm``, ``--baselines``).
        summary: one line for help texts and docs.
        build: the builder of its ``epoch -> Packing`` function.
        selectable: ``pack --algorithm`` may write a manifest with it.
        baseline: the report compares with it by default.
        sequential: its groups are placed in packing order (a plain data loader), not by the assigner.
        polish: after assignment, samples of equal loads trade steps to even out the steps'
            source mix (:mod:`balancer_cli.pack.step_mix`), then the groups of each slot trade
            samples to even out (:mod:`balancer_cli.pack.polish`), and where steps stay uneven
            samples of one kind trade steps (:mod:`balancer_cli.pack.step_trade`); ours only, so
            the baselines stay as published.
    """

    name: str
    summary: str
    build: Builder
    selectable: bool = False
    baseline: bool = False
    sequential: bool = False
    polish: bool = False


def _balanced(view: SampleView, config: PackerConfig, caps_K: np.ndarray, bounds_K: np.ndarray) -> Packer:
    from balancer_cli.pack.packers.balanced import BalancedOptions, pack_balanced

    # G a multiple of R x M, so no group is left out of a full step; sources join refinement's
    # objective so that groups (and so steps) are even mixes; with one micro-batch a step is one
    # class of groups, so the classes are evened out too.
    options = BalancedOptions(class_mix=config.shape.micro_batches == 1)
    return lambda epoch: pack_balanced(
        view.load_nK, caps_K, seed=config.epoch_seed(epoch, "pack"), cost_NK=view.cost_nK,
        group_multiple=config.shape.groups_per_step, source_N=view.source_n, module_names=view.modules,
        oversize=config.oversize, sample_ids=view.ids_n, options=options)


def _isf(view: SampleView, config: PackerConfig, caps_K: np.ndarray, bounds_K: np.ndarray) -> Packer:
    from balancer_cli.pack.packers.isf import pack_isf

    return lambda epoch: pack_isf(view.load_nK, caps_K, bounds_K, iterations=config.iterations,
                                  seed=config.epoch_seed(epoch, "pack"), module_names=view.modules,
                                  oversize=config.oversize, sample_ids=view.ids_n)


def _llm_ffd(view: SampleView, config: PackerConfig, caps_K: np.ndarray, bounds_K: np.ndarray) -> Packer:
    from balancer_cli.pack.packers.baselines import pack_llm_ffd

    return lambda epoch: pack_llm_ffd(view.load_nK, caps_K, seed=config.epoch_seed(epoch, "pack"),
                                      oversize=config.oversize, sample_ids=view.ids_n)


def _random(view: SampleView, config: PackerConfig, caps_K: np.ndarray, bounds_K: np.ndarray) -> Packer:
    from balancer_cli.pack.packers.baselines import default_batch_size, pack_random

    batch = config.batch_size or default_batch_size(view.load_nK, caps_K)
    return lambda epoch: pack_random(len(view.ids_n), batch, seed=config.epoch_seed(epoch, "pack"),
                                     sample_ids=view.ids_n)


PACKERS: dict[str, PackerSpec] = {spec.name: spec for spec in (
    PackerSpec(name="balanced", summary="ours: groups full and equal on every module, even source mixes",
               build=_balanced, selectable=True, polish=True),
    PackerSpec(name="dataloader", summary="random batches placed in order, as a plain distributed data loader",
               build=_random, baseline=True, sequential=True),
    PackerSpec(name="random", summary="random batches of a fixed size, placed by the assigner",
               build=_random, baseline=True),
    PackerSpec(name="llm-ffd", summary="first-fit decreasing on LLM tokens under the LLM cap only",
               build=_llm_ffd, baseline=True),
    PackerSpec(name="isf", summary="OmniBal's iterative sampling-and-filtering", build=_isf,
               selectable=True, baseline=True),
)}


def names(*, selectable: bool | None = None, baseline: bool | None = None) -> tuple[str, ...]:
    """Registered packer names, in registry order, optionally filtered by role."""
    return tuple(name for name, spec in PACKERS.items()
                 if (selectable is None or spec.selectable == selectable)
                 and (baseline is None or spec.baseline == baseline))


def get(name: str) -> PackerSpec:
    """The packer called ``name`` (raises UsageError naming the choices)."""
    try:
        return PACKERS[name]
    except KeyError:
        raise UsageError(f"unknown {{algorithm}} {name!r}", fix=f"use one of: {', '.join(PACKERS)}") from None
