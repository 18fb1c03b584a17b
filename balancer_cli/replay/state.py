"""The replay's resume state: what it records, and what a resume checks before it trusts it (no torch).

A state is a small JSON-able dict, the same on every rank::

    {"version": 2, "fingerprint": "9c1e...", "lengths": "51f0..." or null, "caps": {"vision": 12, "llm": 4167} or null,
     "world_size": 8, "epoch": 0, "step": 1210, "position": 1210, "batch_in_step": 0, "head": null}

- **Identity**: ``fingerprint`` (the manifest's), ``lengths`` (the fingerprint of the lengths
  table given as ``lengths=``, ``null`` without one) and ``caps`` (the packer's caps that elastic
  batches keep, ``null`` when none apply). They decide how an elastic step is cut into batches.
- **Position**: ``world_size`` (the ranks that saved it), ``epoch``, ``step`` (the replay step of
  the next batch), ``position`` (where that step starts in the epoch's step order),
  ``batch_in_step`` (batches of it every rank has taken; a count past the step's last batch
  means that many batches after ``position``) and ``head`` (an interrupted step of an earlier
  world size that opens this one, itself a state).

A resume refuses, with a :class:`~balancer_cli.errors.ManifestError` naming what differs, a
state of another manifest, and a state whose remaining batches depend on a plan it cannot
rebuild: saved inside an elastic step (``batch_in_step > 0`` at a world size other than the
manifest's) or carrying a ``head``, with another lengths table (or none) or other caps. Every
other state resumes whatever ``lengths=`` is now: at a step boundary, or inside a step replayed as
packed, the samples still due do not depend on it. Version-1 states (no identity fields) are
read as before, trusting ``lengths=``.

Example:
    >>> identity = ReplayIdentity(fingerprint="ab12", lengths=None, caps=None)
    >>> state = make_state(identity, 2, {"epoch": 0, "step": 3, "position": 3, "batch_in_step": 1, "head": None})
    >>> state["version"], state["lengths"], read_state(state, identity, manifest_world_size=2)["step"]
    (2, None, 3)
    >>> read_state(dict(state, fingerprint="ffff"), identity, manifest_world_size=2)
    Traceback (most recent call last):
    balancer_cli.errors.ManifestError: the sampler state was saved for another manifest (fingerprint ffff, this one has ab12); fix: resume with the manifest the checkpoint was trained on
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from balancer_cli.errors import ManifestError, is_int

__all__ = ["MAX_HEAD_DEPTH", "POSITION_KEYS", "STATE_VERSION", "ReplayIdentity", "make_state", "needs_saved_plan", "read_state"]

STATE_VERSION = 2
_READS = (1, 2)
#: The cursor: where the next batch is (``head`` nests the same keys plus ``world_size``).
POSITION_KEYS = ("epoch", "step", "position", "batch_in_step", "head")
_HEAD_KEYS = ("world_size", "step", "position", "batch_in_step", "head")
_FIX_CORRUPT = "resume from a state that state_dict() returned, unchanged (it is JSON-able)"


@dataclass(frozen=True, kw_only=True)
class ReplayIdentity:
    """What, besides the position, decides the batches a replay yields.

    Attributes:
        fingerprint: the manifest's fingerprint.
        lengths: the lengths table's fingerprint, ``None`` without ``lengths=``.
        caps: the packer's caps elastic batches keep, ``{module: cap}``; ``None`` when none apply.
    """

    fingerprint: str
    lengths: str | None
    caps: Mapping[str, int] | None

    def describe(self) -> str:
        """``lengths table 51f0c2a9e1d3, caps vision 12, llm 4167`` (what a mismatch error quotes)."""
        text = f"lengths table {self.lengths[:12]}" if self.lengths else "no lengths table"
        if self.caps:
            text += ", caps " + ", ".join(f"{m} {c}" for m, c in self.caps.items())
        return text


def make_state(identity: ReplayIdentity, world_size: int, cursor: Mapping[str, Any]) -> dict:
    """The state to save: identity, the world size and the cursor (:data:`POSITION_KEYS`)."""
    caps = None if identity.caps is None else {m: int(c) for m, c in identity.caps.items()}
    return {"version": STATE_VERSION, "fingerprint": identity.fingerprint, "lengths": identity.lengths,
            "caps": caps, "world_size": int(world_size), **{k: cursor[k] for k in POSITION_KEYS}}


def needs_saved_plan(state: Mapping[str, Any], manifest_world_size: int) -> bool:
    """Whether the batches still due after ``state`` depend on the plan that saved it (its lengths
    and caps): inside an elastic step, or with an interrupted step of another world size ahead.

    Example:
        >>> cursor = {"world_size": 3, "batch_in_step": 1, "head": None}
        >>> needs_saved_plan(cursor, 4), needs_saved_plan(dict(cursor, world_size=4), 4)
        (True, False)
    """
    return state.get("head") is not None or (int(state["batch_in_step"]) > 0
                                             and int(state["world_size"]) != manifest_world_size)


def read_state(state_dict: Mapping[str, Any], identity: ReplayIdentity, manifest_world_size: int) -> dict:
    """Check a saved state against this replay; return its cursor plus ``world_size``.

    Raises:
        ManifestError: an unknown version, a corrupt state, another manifest, or (for a state
            that needs the plan that saved it, see :func:`needs_saved_plan`) another lengths
            table or other caps than the saved ones.
    """
    if not isinstance(state_dict, Mapping):
        raise ManifestError(f"the sampler state is a {type(state_dict).__name__}, not a dict", fix=_FIX_CORRUPT)
    state = dict(state_dict)
    version = state.get("version")
    if not is_int(version) or version not in _READS:
        raise ManifestError(f"sampler state version {version}, this balancer_cli reads versions "
                            f"{', '.join(map(str, _READS))}",
                            fix="resume with the balancer_cli version that saved the checkpoint")
    if state.get("fingerprint") != identity.fingerprint:
        raise ManifestError(f"the sampler state was saved for another manifest (fingerprint {state.get('fingerprint')}, "
                            f"this one has {identity.fingerprint})",
                            fix="resume with the manifest the checkpoint was trained on")
    _check_identity_fields(state)
    cursor = _cursor(state, top=True)
    if version >= 2 and needs_saved_plan(cursor, manifest_world_size):
        saved = ReplayIdentity(fingerprint=identity.fingerprint, lengths=state.get("lengths"), caps=state.get("caps"))
        if (saved.lengths, _caps(saved.caps)) != (identity.lengths, _caps(identity.caps)):
            raise ManifestError(
                f"the sampler state was saved inside step {cursor['step']} of an elastic replay on "
                f"{cursor['world_size']} ranks with {saved.describe()}; this replay has {identity.describe()}, "
                f"so the batches left in that step cannot be rebuilt (some samples would repeat or be lost)",
                fix="pass the same {lengths} as the run that saved the state (or none if it had none), "
                    "or resume from a state saved at a step boundary (state_dict(step=...))")
    return cursor


#: The deepest chain of ``head`` states accepted: each world-size change mid-step adds one, and a
#: real run has a handful; a deeper one is corrupt (and would exhaust the recursion limit).
MAX_HEAD_DEPTH = 64


def _check_identity_fields(state: Mapping[str, Any]) -> None:
    """``lengths`` a string or None, ``caps`` None or ``{module: integer >= 0}``."""
    lengths, caps = state.get("lengths"), state.get("caps")
    if lengths is not None and not isinstance(lengths, str):
        raise ManifestError(f"the sampler state has lengths {lengths!r}, not a fingerprint string", fix=_FIX_CORRUPT)
    if caps is not None and not (isinstance(caps, Mapping)
                                 and all(isinstance(m, str) and is_int(c) and c >= 0 for m, c in caps.items())):
        raise ManifestError(f"the sampler state has caps {caps!r}, not a mapping of module to integer", fix=_FIX_CORRUPT)


def _caps(caps: Mapping[str, int] | None) -> dict | None:
    return None if not caps else {str(m): int(c) for m, c in caps.items()}


def _cursor(state: Mapping[str, Any], top: bool, depth: int = 0) -> dict:
    """The cursor of a state (or of a ``head``), with every field checked."""
    if depth > MAX_HEAD_DEPTH:
        raise ManifestError(f"the sampler state nests more than {MAX_HEAD_DEPTH} head states", fix=_FIX_CORRUPT)
    keys = ("world_size",) + (POSITION_KEYS if top else _HEAD_KEYS[1:])
    missing = [k for k in keys if k not in state]
    if missing:
        raise ManifestError(f"the sampler state lacks {', '.join(missing)}", fix=_FIX_CORRUPT)
    out: dict[str, Any] = {}
    for key in keys:
        if key == "head":
            continue
        value = state[key]
        least = 1 if key == "world_size" else 0
        if not is_int(value) or value < least:
            raise ManifestError(f"the sampler state has {key} {value!r}, not an integer >= {least}", fix=_FIX_CORRUPT)
        out[key] = int(value)
    head = state.get("head")
    if head is not None and not isinstance(head, Mapping):
        raise ManifestError(f"the sampler state has head {head!r}, not a state", fix=_FIX_CORRUPT)
    out["head"] = None if head is None else _cursor(head, top=False, depth=depth + 1)
    return out
