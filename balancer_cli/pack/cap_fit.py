"""Whether the caps leave samples to pack: checked before any search or packing, so that caps far
below the data fail with the cap to raise, not with a shortage of groups that seems to ask for
smaller caps.

A sample over a cap is isolated in a group of its own, dropped or an error (``--oversize``). Caps
under every sample leave nothing to pack (:func:`check_caps_fit`); caps the user gave can leave
fewer samples under them than one step has groups, a group holding at least one (``drop``), or
group counts from which no split reaches whole steps (``isolate``):
:func:`check_given_caps_fill_a_step` (``--max-llm-tokens 172`` where 3 of 741 samples hold fewer
LLM tokens). The search's caps stay under the caps the user gave, so no candidate could pack such
an input either; where the check cannot tell and the search finds no caps, :func:`name_given_caps`
names the given cap most samples are over.

Example:
    >>> from balancer_cli.lengths import make_lengths_table
    >>> from balancer_cli.pack.config import PackConfig
    >>> from balancer_cli.pack.inputs import prepare_inputs
    >>> inputs = prepare_inputs(make_lengths_table(np.array([100, 4000, 5000, 6000])))
    >>> check_given_caps_fill_a_step(inputs, PackConfig(world_size=2, caps=(("llm", 200),), oversize="drop"))
    Traceback (most recent call last):
    ...
    balancer_cli.errors.UsageError: caps[llm] 200 leaves 1 of 4 samples under the caps, fewer than the 2 groups one step of world_size 2 x micro_batches 1 needs (3 over a cap, which oversize drop drops); fix: raise caps[llm] (the median sample holds 4500 tokens), or lower world_size or micro_batches
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from balancer_cli.errors import UsageError
from balancer_cli.pack.config import PackConfig
from balancer_cli.pack.inputs import PackInputs
from balancer_cli.pack.packers._common import over_caps

__all__ = ["check_caps_fit", "check_given_caps_fill_a_step", "name_given_caps"]


def _most_over(load: np.ndarray, caps_K: np.ndarray) -> int:
    """The module whose cap the most rows of ``load`` are over (the lowest on a tie)."""
    return int(np.argmax([np.count_nonzero(load[:, k] > caps_K[k]) for k in range(len(caps_K))]))


def check_caps_fit(inputs: PackInputs, caps_K: np.ndarray) -> None:
    """Fail when no sample fits under the caps at all: every group would be an oversize one."""
    over = over_caps(inputs.load_NK, caps_K)
    if inputs.ok_N.any() and (over | ~inputs.ok_N).all():
        load = inputs.ok_rows(inputs.load_NK)
        k = _most_over(load, caps_K)
        module, smallest = inputs.modules[k], int(load[:, k].min())
        raise UsageError(
            f"{{caps[{module}]}} {int(caps_K[k])} is smaller than every sample "
            f"(smallest: {smallest} {inputs.load_unit(module)})",
            fix=f"raise {{caps[{module}]}} to at least {smallest}, typically to several samples' worth")


class _GivenCaps(NamedTuple):
    """The caps the user gave (``caps_K``, any load where none was given) against the samples
    without a scan error: how many fit under them all, of how many."""

    fits: int
    total: int
    caps_K: np.ndarray

    def worst(self, inputs: PackInputs) -> tuple[str, int, str]:
        """``(module, cap, fix)``: the given cap over the most samples, and the fix raising it (only
        for an error: a pass over the loads and a median)."""
        load = inputs.ok_rows(inputs.load_NK)
        k = _most_over(load, self.caps_K)
        module = inputs.modules[k]
        return module, int(self.caps_K[k]), (f"raise {{caps[{module}]}} (the median sample holds "
                                             f"{int(np.median(load[:, k]))} {inputs.load_unit(module)})")


def _given_caps(inputs: PackInputs, config: PackConfig) -> _GivenCaps | None:
    """:class:`_GivenCaps`, or None where no cap was given or no sample is over one."""
    given = dict(config.caps)
    if not given or not inputs.ok_N.any():
        return None
    caps_K = np.array([given.get(m, np.iinfo(np.int64).max) for m in inputs.modules], dtype=np.int64)
    # Over every row, then counted where there is no scan error: no copy of the loads' good rows.
    over_N = over_caps(inputs.load_NK, caps_K)
    total = int(np.count_nonzero(inputs.ok_N))
    over = int(np.count_nonzero(over_N & inputs.ok_N))
    return _GivenCaps(total - over, total, caps_K) if over else None


def check_given_caps_fill_a_step(inputs: PackInputs, config: PackConfig) -> None:
    """Fail when the caps the user gave leave too few samples without a scan error under them to
    fill whole steps; the error names the cap over the most samples.

    With ``--oversize drop`` a step needs as many samples under the caps as it has groups. With
    ``isolate`` each sample over a cap is a group of its own, and the groups of the others can be
    split down to single samples, no further: where no multiple of a step's groups lies between
    those counts, no packing fills whole steps. Only where the caps are the cause: with fewer
    samples than a step has groups, raising them would not help (the packer names that shortage).
    """
    given = _given_caps(inputs, config) if config.oversize in ("drop", "isolate") else None
    per_step = config.shape.groups_per_step
    if given is None or given.total < per_step:
        return
    fits, total = given.fits, given.total
    over, step = total - fits, f"one step of {{world_size}} {config.world_size} x {{micro_batches}} {config.micro_batches}"
    if config.oversize == "drop":
        if fits >= per_step:
            return
        why = f"fewer than the {per_step} groups {step} needs ({over} over a cap, which {{oversize}} drop drops)"
        other = ""
    else:
        fewest = over + min(fits, 1)
        if -(-fewest // per_step) * per_step <= total:  # a multiple of a step's groups within reach
            return
        why = (f"and the {over} over a cap are isolated in groups of their own ({{oversize}} isolate): {fewest} to "
               f"{total} groups, none a multiple of the {per_step} of {step}")
        other = ", or drop them with {oversize} drop"
    module, cap, raise_it = given.worst(inputs)
    raise UsageError(f"{{caps[{module}]}} {cap} leaves {fits} of {total} samples under the caps, {why}",
                     fix=f"{raise_it}, or lower {{world_size}} or {{micro_batches}}{other}")


def name_given_caps(inputs: PackInputs, config: PackConfig, error: UsageError) -> UsageError:
    """``error`` (the search finding no caps that fill a step) with the given cap over the most
    samples named where samples are over the caps the user gave: isolated one a group, they can
    leave counts no split reaches a multiple of a step from (``--max-llm-tokens 147`` where 5 of
    446 samples fit, at ``--dp 3``). ``error`` itself where none is.
    """
    # Only the search's finding (its other usage errors are about options, not the data), and only
    # where the caps are the cause: fewer samples than a step's groups fill no step at any caps.
    given = _given_caps(inputs, config) if error.message.startswith("no candidate caps") else None
    if given is None or given.total < config.shape.groups_per_step:
        return error
    module, cap, raise_it = given.worst(inputs)
    return UsageError(f"{error.message}: {given.total - given.fits} of the {given.total} samples are over "
                      f"{{caps[{module}]}} {cap} or another cap given", fix=f"{raise_it}, or {error.fix}")
