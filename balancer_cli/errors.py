"""The error family of balancer_cli.

Every error a user can cause derives from :class:`BalancerError` and carries a message that names
the file, line or sample, the offending value, and the fix. The CLI turns them into a one-line
``Error: ...`` and an exit code (2 for usage errors, 1 for everything else); library users catch
them like any exception.

Library errors name *parameters*, never command-line flags: a parameter is written as
``{world_size}`` in the message or fix. ``str(error)`` shows the parameter's name
(``world_size``), which is what a Python caller passed; the CLI calls :meth:`BalancerError.for_flags`
with its command's own map of parameter to flag, so the same error reads ``--dp`` there. A
per-module entry is ``{caps[vision]}``: ``caps[vision]`` in Python, ``--max-vision-items`` (or
``--cap vision``) on the command line. No message can so point a user at a flag that does not exist.

Example:
    >>> err = InputError("lengths.parquet: column 'llm_tokens' is missing", fix="run `balancer scan` first")
    >>> str(err)
    "lengths.parquet: column 'llm_tokens' is missing; fix: run `balancer scan` first"
    >>> err = UsageError("{world_size} 3 needs 3 groups per step", fix="lower {world_size}")
    >>> str(err), err.for_flags({"world_size": "--dp"})
    ('world_size 3 needs 3 groups per step; fix: lower world_size', '--dp 3 needs 3 groups per step; fix: lower --dp')
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Mapping

__all__ = [
    "BalancerError",
    "InputError",
    "UsageError",
    "SampleError",
    "ManifestError",
    "PlanError",
    "PARAMETERS",
    "is_int",
    "check_int",
]


class BalancerError(Exception):
    """Base class of every error balancer_cli raises on purpose.

    Args:
        message: what went wrong, naming the file/line/sample and the value.
        fix: optional hint telling the user what to do about it.
    """

    exit_code: int = 1

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        self.message = message
        self.fix = fix
        super().__init__(message)

    def __str__(self) -> str:
        return self.for_flags({})

    def for_flags(self, flags: Mapping[str, str]) -> str:
        """The one-line text with each ``{parameter}`` written as ``flags[parameter]`` (else its name)."""
        return _PARAMETER.sub(lambda m: _spell(m, flags), self._text())

    def _text(self) -> str:
        """The text before parameters are spelled out; subclasses add their context here."""
        return f"{self.message}; fix: {self.fix}" if self.fix else self.message

    def __reduce__(self) -> tuple:
        # Rebuild without calling __init__, whose keyword-only fields (and a subclass's own
        # signature) Exception's default reduce cannot replay: every attribute comes back as is,
        # so errors cross process pools and Ray workers whole (message, fix, kind, file, line).
        return _rebuild_error, (type(self), self.args, dict(self.__dict__))


#: ``{name}`` or ``{name[key]}`` (one entry of a per-module parameter, e.g. ``{caps[vision]}``) inside
#: a message; in an f-string write ``{{name}}``.
_PARAMETER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?:\[([A-Za-z_][A-Za-z0-9_-]*)\])?\}")


#: The parameters library messages may name. Only these are spelled out: a ``{w}`` that comes from
#: a user's data (a record value, a file name) stays as it is. A test finds every ``{name}`` the
#: package writes into an error and checks it is listed here.
PARAMETERS = frozenset({
    # pack (PackConfig, search, placement, packers)
    "world_size", "micro_batches", "algorithm", "caps", "bounds", "iterations", "oversize", "epochs", "seed",
    "cost_model", "target_group_size", "batch_size", "max_caps_K", "sample_size", "window_samples", "memory_gb",
    # the file-to-file entry points
    "out", "lengths_files", "engine", "ray_address", "keep_parts", "baselines",
    # cost models and planners
    "attention", "tp", "stages", "dp", "zero_stage", "cuts", "manifest", "lengths",
    "group_llm_tokens", "group_vision_items", "group_vision_tokens", "group_audio_items", "gpu_memory_gb",
    # replay
    "rank", "epoch", "step",
})


def _spell(match: re.Match, flags: Mapping[str, str]) -> str:
    name, key = match.group(1), match.group(2)
    if name not in PARAMETERS and name not in flags:
        return match.group(0)  # not a parameter: literal text, e.g. from a user's data
    if key is None:
        return flags.get(name, name)
    keyed = f"{name}[{key}]"
    if keyed in flags:
        return flags[keyed]
    return f"{flags[name]} {key}" if name in flags else keyed


def is_int(value: object) -> bool:
    """A Python or numpy integer, not a bool.

    Example:
        >>> is_int(3), is_int(True), is_int(2.0)
        (True, False, False)
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value: object, *, least: int, most: int | None = None, fix: str) -> None:
    """Raise :class:`UsageError` naming parameter ``{name}`` unless ``value`` is an integer in range.

    Example:
        >>> check_int("epochs", 0, least=1, fix="give a positive {epochs}")
        Traceback (most recent call last):
        ...
        balancer_cli.errors.UsageError: epochs must be an integer >= 1, not 0; fix: give a positive epochs
    """
    if not is_int(value) or value < least or (most is not None and value > most):
        span = f">= {least}" if most is None else f"in {least}..{most}"
        raise UsageError(f"{{{name}}} must be an integer {span}, not {value!r}", fix=fix)


def _rebuild_error(cls: type[BalancerError], args: tuple, state: dict) -> BalancerError:
    """Unpickle a :class:`BalancerError` (see ``BalancerError.__reduce__``)."""
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class InputError(BalancerError):
    """An input file or table is unreadable, empty, or violates its contract (exit code 1)."""


class UsageError(BalancerError):
    """Options that cannot work together or values out of range (exit code 2)."""

    exit_code = 2


class SampleError(BalancerError):
    """One sample cannot be measured (missing image, malformed record, ...).

    In a normal scan this becomes the sample's ``error`` cell; with ``--strict`` it stops the scan.

    Args:
        message: what is wrong with the sample.
        kind: short machine-readable category used in summaries (``missing_file``,
            ``corrupt_image``, ``malformed_record``, ``path_escape``, ``unsupported_image``,
            ``rejected_by_model``, ...).
        file: the input file the sample came from.
        line: 1-based line (JSONL) or record number (JSON list, Parquet row) within ``file``.
    """

    def __init__(
        self,
        message: str,
        *,
        kind: str = "error",
        file: str | None = None,
        line: int | None = None,
        fix: str | None = None,
    ) -> None:
        self.kind = kind
        self.file = file
        self.line = line
        super().__init__(message, fix=fix)

    @property
    def location(self) -> str:
        """``file:line`` (or whatever part of it is known)."""
        if self.file is None:
            return "" if self.line is None else f"record {self.line}"
        return self.file if self.line is None else f"{self.file}:{self.line}"

    def _text(self) -> str:
        text = super()._text()
        return f"{self.location}: {text}" if self.location else text


class ManifestError(BalancerError):
    """A manifest directory is missing, corrupt, of another schema version, or mismatched."""


class PlanError(BalancerError):
    """A planner found no feasible plan (e.g. nothing fits in GPU memory)."""
