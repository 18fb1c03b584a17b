"""Elastic plans computed once and kept beside the manifest, so later passes and resumes only read them.

Re-planning a manifest step for ``R'`` ranks is a pure function of the step's samples, the
lengths table, the caps and ``R'`` (:mod:`balancer_cli.replay.replan`); a step replayed as its own
unit (one of at least ``k * R'`` samples) has the same plan in every epoch, reshuffled or not, and
after every resume. So the first replay on ``R'`` ranks plans every such step of the manifest
once and writes every rank's batches to one file; later replays (the other ranks of a later
run, later epochs, resumes) memory-map it and slice their batches out, as they would read the
manifest itself. Runs of small steps and a resumed interrupted step are still planned as the
replay goes.

The file is ``<manifest_dir>/elastic-plans/R<R'>-<key>.npy``, one int64 array::

    [magic, PLAN_VERSION, S, C, R', k, P, checksum]   header
    slot_S        (S,)        index of each manifest step among the C planned ones, -1 if not planned
    bnd_B1        (C*R'*k+1,) batch bounds into samples_P, by (step, rank, batch)
    samples_P     (P,)        the samples of every planned step, by (step, rank, batch)

``key`` covers everything a plan depends on: the manifest's fingerprint and file size, the
lengths table's fingerprint (or none), the caps, ``R'``, ``k``, :data:`PLAN_VERSION` (raised
whenever the planning's output changes) and numpy's version, so a stale file is never read. It is written to a
temporary name and renamed into place, so a reader sees a whole file or none, and two writers
write the same bytes.

Like every file the replay reads, the plans are verified when opened, never trusted
(:meth:`PlanCache.open` raises :class:`PlanFileInvalid`, and the replay plans again): ``checksum``
is a ``blake2b`` of every other word of the file, recorded when it is written (an edit, a torn
copy, a file of an earlier format), and the contents must fit the manifest: the planned steps
are those of at least ``k * R'`` samples, each with as many samples as the manifest step, ids in
``0 .. num_samples - 1``, bounds that rise from 0 to ``P``, and no sample twice in an epoch
(one hash and a few vectorized passes over the file: 0.2 s for 10 million samples).

Example:
    >>> import numpy as np, pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "R2-test.npy"
    >>> bnd = np.array([0, 1, 3, 4, 6])  # one planned step, 2 ranks x 2 batches
    >>> write_plan_cache(path, np.array([0, -1]), 6, 2, 2, [(np.array([5, 1, 2, 0, 3, 4]), bnd)])
    >>> cache = PlanCache.open(path, step_samples=np.array([6, 3]), epoch_starts=np.array([0, 2]), num_samples=9,
    ...                        world_size=2, batches=2)
    >>> [a.tolist() for a in cache.rank_steps(np.array([0]), rank=1)], cache.rank_steps(np.array([1]), rank=1)
    ([[0, 3, 4], [0, 1, 3]], None)
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from balancer_cli._fsutil import atomic_path, bytes_fingerprint
from balancer_cli._index import concat_ranges
from balancer_cli.commit import PLANS_DIR as _COMMIT_PLANS_DIR

__all__ = ["PLANS_DIR", "PLAN_VERSION", "PlanCache", "PlanFileInvalid", "plan_cache_path", "write_plan_cache"]

#: Raise whenever the elastic plan of a step changes (replan, its kernels, group_plan).
PLAN_VERSION = 1
_MAGIC = int.from_bytes(b"balplan", "little")
_HEADER = 8
_HASH_WORDS = 1 << 20  # words hashed at a time (8 MiB)
#: The folder of plan files inside a manifest directory.
PLANS_DIR = _COMMIT_PLANS_DIR  # a committed folder may hold it (balancer_cli.commit)


def plan_cache_path(directory: str | os.PathLike, *, fingerprint: str, manifest_bytes: int, lengths: str | None,
                    caps: Mapping[str, int] | None, world_size: int, batches: int) -> Path:
    """Where the plans of one manifest + lengths table + caps on ``world_size`` ranks are kept.

    Example:
        >>> p = plan_cache_path("out/elastic-plans", fingerprint="ab", manifest_bytes=10, lengths=None, caps=None,
        ...                     world_size=3, batches=2)
        >>> p.parent.as_posix(), p.name.startswith("R3-"), p.suffix
        ('out/elastic-plans', True, '.npy')
    """
    # numpy's version too: ranks that read the file and ranks that plan (a file written later)
    # must compute the same floats.
    key = json.dumps({"manifest": fingerprint, "bytes": manifest_bytes, "lengths": lengths,
                      "caps": dict(caps or {}), "world_size": world_size, "batches": batches,
                      "version": PLAN_VERSION, "numpy": np.__version__}, sort_keys=True)
    return Path(directory) / f"R{world_size}-{bytes_fingerprint(key.encode())[:20]}.npy"


class PlanFileInvalid(ValueError):
    """A plan file that fails its verification (internal: the replay then plans again)."""


@dataclass(frozen=True)
class PlanCache:
    """Every rank's batches of the planned steps of a manifest on ``world_size`` ranks (read-only).

    Attributes:
        path: the file.
        world_size, batches: ``R'`` and ``k`` (batches per rank per step).
        slot_S, bnd_B1, samples_P: the arrays of the file (see the module docstring).
    """

    path: Path
    world_size: int
    batches: int
    slot_S: np.ndarray
    bnd_B1: np.ndarray
    samples_P: np.ndarray

    @classmethod
    def open(cls, path: str | os.PathLike, *, step_samples: np.ndarray, epoch_starts: np.ndarray, num_samples: int,
             world_size: int, batches: int) -> PlanCache | None:
        """The plans in ``path`` (memory-mapped) once verified, or ``None`` when it is absent.

        Args:
            path: the file.
            step_samples: (S,) samples of each manifest step.
            epoch_starts: (E+1,) first manifest step of each packed epoch, then ``S``.
            num_samples: samples of the lengths table (ids run ``0 .. num_samples - 1``).
            world_size, batches: ``R'`` and ``k``.

        Raises:
            PlanFileInvalid: the file is not a plan file, fails its checksum, or does not fit the
                manifest (the message says which check it fails).
        """
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, EOFError) as error:
            raise PlanFileInvalid(f"not an array file ({error})") from None
        if array.dtype != np.int64 or array.ndim != 1 or len(array) < _HEADER:
            raise PlanFileInvalid(f"not a plan file (a {array.dtype} array of shape {array.shape})")
        magic, version, S, C, R, k, P, checksum = (int(v) for v in array[:_HEADER])
        expected = (_MAGIC, PLAN_VERSION, len(step_samples), world_size, batches)
        if (magic, version, S, R, k) != expected:
            raise PlanFileInvalid(f"header (magic, version, steps, ranks, batches) {(magic, version, S, R, k)}, "
                                  f"expected {expected}")
        B = C * R * k + 1
        if C < 0 or P < 0 or len(array) != _HEADER + S + B + P:
            raise PlanFileInvalid(f"{len(array)} words, the header gives {C} planned steps and {P} samples")
        if checksum != _checksum(array):
            raise PlanFileInvalid("checksum does not match (edited, truncated or written by an earlier version)")
        at = _HEADER
        slot_S, bnd_B1, samples_P = array[at:at + S], array[at + S:at + S + B], array[at + S + B:]
        _check_contents(slot_S, bnd_B1, samples_P, np.asarray(step_samples, dtype=np.int64),
                        np.asarray(epoch_starts, dtype=np.int64), num_samples, R * k)
        return cls(Path(path), R, k, slot_S, bnd_B1, samples_P)

    def rank_steps(self, steps: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray] | None:
        """``rank``'s batches of ``steps`` (each replayed as its own unit), flat: ``(samples,
        bounds)`` with batch ``i`` at ``samples[bounds[i]:bounds[i + 1]]``; ``None`` when one of
        the steps was not planned here (it is part of a run)."""
        slots = self.slot_S[np.asarray(steps, dtype=np.int64)]
        if (slots < 0).any():
            return None
        R, k = self.world_size, self.batches
        bnd_Ck1 = np.asarray(self.bnd_B1[(slots * (R * k) + rank * k)[:, None] + np.arange(k + 1)])
        rows = concat_ranges(bnd_Ck1[:, 0], bnd_Ck1[:, -1] - bnd_Ck1[:, 0])
        bounds = np.zeros(len(slots) * k + 1, dtype=np.int64)
        np.cumsum(np.diff(bnd_Ck1, axis=1).ravel(), out=bounds[1:])
        return np.asarray(self.samples_P[rows]), bounds


def write_plan_cache(path: str | os.PathLike, slot_S: np.ndarray, num_samples: int, world_size: int, batches: int,
                     plans: Iterable[tuple[np.ndarray, np.ndarray]]) -> None:
    """Write the plans of the steps with ``slot_S >= 0`` (in slot order), atomically.

    Args:
        path: the file to write.
        slot_S: (S,) slot of each manifest step, -1 for the steps not planned.
        num_samples: ``P``, the samples of the planned steps.
        world_size, batches: ``R'`` and ``k``.
        plans: per window of consecutive slots, its samples by (step, rank, batch) and its batch
            bounds into them (``R' * k`` batches per step, from 0).

    Raises:
        OSError: the file cannot be written (the caller then plans as it replays).
    """
    S, C = len(slot_S), int((np.asarray(slot_S) >= 0).sum())
    B = C * world_size * batches + 1
    with atomic_path(path) as tmp:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.int64, shape=(_HEADER + S + B + num_samples,))
        out[:_HEADER] = [_MAGIC, PLAN_VERSION, S, C, world_size, batches, num_samples, 0]
        out[_HEADER:_HEADER + S] = slot_S
        bnd, samples = out[_HEADER + S:_HEADER + S + B], out[_HEADER + S + B:]
        at_b = at_p = 0
        for samples_w, bnd_w in plans:
            bnd[at_b:at_b + len(bnd_w) - 1] = np.asarray(bnd_w[:-1]) + at_p
            samples[at_p:at_p + len(samples_w)] = samples_w
            at_b, at_p = at_b + len(bnd_w) - 1, at_p + len(samples_w)
        if (at_b, at_p) != (B - 1, num_samples):
            raise ValueError(f"plans cover {at_b} batches and {at_p} samples, expected {B - 1} and {num_samples}")
        bnd[B - 1] = num_samples
        out[_HEADER - 1] = _checksum(out)
        out.flush()
        del out, bnd, samples


def _checksum(array: np.ndarray) -> int:
    """``blake2b`` (64 bits, as a signed int64) of every word of a plan file but the checksum's own."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(memoryview(np.ascontiguousarray(array[:_HEADER - 1])).cast("B"))
    body = array[_HEADER:]
    for start in range(0, len(body), _HASH_WORDS):  # a chunk at a time: the mapped file is not copied whole
        digest.update(memoryview(np.ascontiguousarray(body[start:start + _HASH_WORDS])).cast("B"))
    return int.from_bytes(digest.digest(), "little", signed=True)


def _check_contents(slot_S: np.ndarray, bnd_B1: np.ndarray, samples_P: np.ndarray, step_samples: np.ndarray,
                    epoch_starts: np.ndarray, num_samples: int, batches_per_step: int) -> None:
    """Raise :class:`PlanFileInvalid` unless the plans fit the manifest (see the module docstring)."""
    slot_S, bnd_B1 = np.asarray(slot_S), np.asarray(bnd_B1)
    planned = np.flatnonzero(slot_S >= 0)
    # The writer plans exactly the steps that are units of their own, in step order.
    alone = np.flatnonzero(step_samples >= batches_per_step)
    if not np.array_equal(planned, alone) or not np.array_equal(slot_S[planned], np.arange(len(planned))) \
            or bool((slot_S < -1).any()) or len(bnd_B1) != len(planned) * batches_per_step + 1:
        raise PlanFileInvalid(f"plans {len(planned)} steps, the manifest has {len(alone)} steps of at least "
                              f"{batches_per_step} samples")
    if bnd_B1[0] != 0 or bnd_B1[-1] != len(samples_P) or bool((np.diff(bnd_B1) < 0).any()):
        raise PlanFileInvalid("batch bounds do not rise from 0 to the number of samples")
    counts = np.diff(bnd_B1[::batches_per_step]) if len(planned) else np.zeros(0, np.int64)
    if not np.array_equal(counts, step_samples[planned]):
        s = int(planned[np.flatnonzero(counts != step_samples[planned])[0]])
        raise PlanFileInvalid(f"step {s} has {int(counts[slot_S[s]])} samples, the manifest {int(step_samples[s])}")
    for epoch, (first, last) in enumerate(zip(epoch_starts[:-1].tolist(), epoch_starts[1:].tolist())):
        slots = slot_S[first:last]
        slots = slots[slots >= 0]
        if not len(slots):
            continue
        lo, hi = int(bnd_B1[slots[0] * batches_per_step]), int(bnd_B1[(slots[-1] + 1) * batches_per_step])
        samples = np.asarray(samples_P[lo:hi])
        if len(samples) and (int(samples.min()) < 0 or int(samples.max()) >= num_samples):
            raise PlanFileInvalid(f"sample id {int(samples[(samples < 0) | (samples >= num_samples)][0])} "
                                  f"in epoch {epoch} is outside 0..{num_samples - 1}")
        seen = np.zeros(num_samples, dtype=bool)
        seen[samples] = True
        if int(np.count_nonzero(seen)) != len(samples):
            raise PlanFileInvalid(f"{len(samples) - int(np.count_nonzero(seen))} sample(s) placed twice in epoch "
                                  f"{epoch}")
