"""What replay takes from the lengths table: per-sample costs, capped loads and token counts.

A manifest alone says which samples form each group. With the lengths table it was packed from,
replay also knows each sample's per-module **cost** (elastic re-planning balances it), its
**load** under each of the packer's caps (elastic batches keep them) and its LLM and loss
tokens (:class:`StepTokens`, for loss normalization). Without the table every sample costs 1
and nothing is capped.

Example:
    >>> import numpy as np, tempfile
    >>> from balancer_cli.lengths import make_lengths_table
    >>> from balancer_cli.manifest import ManifestRows, open_manifest, write_manifest
    >>> lengths = make_lengths_table(np.array([300, 40]), {"vision": (np.array([512, 0]), np.array([2, 0]))})
    >>> out = tempfile.mkdtemp()
    >>> rows = ManifestRows(step=np.zeros(2, int), rank=np.zeros(2, int), micro=np.zeros(2, int), sample=np.arange(2))
    >>> _ = write_manifest(out, rows, dropped_sample=np.array([], np.int64), dropped_reason=[],
    ...                    meta={"world_size": 1, "micro_batches": 1, "num_samples": 2, "seed": 0,
    ...                          "params": {"caps": {"vision": 4, "llm": 512}}})
    >>> samples = ReplaySamples.from_lengths(lengths, open_manifest(out))
    >>> samples.costs([0, 1]).tolist(), samples.caps, samples.loads([0, 1]).tolist(), samples.caps_K.tolist()
    ([[512.0, 300.0], [0.0, 40.0]], {'llm': 512, 'vision': 4}, [[300, 2], [40, 0]], [512, 4])
    >>> samples.step_tokens(0, np.arange(2))
    StepTokens(step=0, num_samples=2, llm_tokens=340, loss_tokens=None)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from balancer_cli.cost.samples import sample_costs
from balancer_cli.errors import ManifestError
from balancer_cli.lengths import LLM, LengthsTable
from balancer_cli.manifest import ManifestFile

__all__ = ["StepTokens", "ReplaySamples"]


@dataclass(frozen=True)
class StepTokens:
    """Global token counts of one replay step (all ranks together).

    Attributes:
        step: the replay step within the epoch.
        num_samples: samples in the step.
        llm_tokens: summed ``llm_tokens`` of its samples.
        loss_tokens: summed ``loss_tokens`` (tokens that carry a loss), when the lengths table
            has that column; else ``None``.
    """

    step: int
    num_samples: int
    llm_tokens: int
    loss_tokens: int | None

    @property
    def normalizer(self) -> int:
        """What to divide the summed loss by: loss tokens when known, else LLM tokens."""
        return self.llm_tokens if self.loss_tokens is None else self.loss_tokens


class ReplaySamples:
    """Per-sample quantities of a manifest's samples, for the samples asked (``None`` without lengths).

    Nothing is computed up front: a replay at the packed world size that never asks for
    ``step_tokens`` computes nothing, and a resume plans its first steps from the rows of those
    steps alone. Once the samples asked add up to a sixteenth of the table, each quantity is
    computed for the whole table at once and kept.

    Args:
        lengths: the lengths table (``None``: every sample costs 1, nothing is capped).
        caps: the packer's caps to keep, ``{module: cap}`` (``llm`` or an encoder of ``lengths``).

    Attributes:
        fingerprint: the lengths table's fingerprint, ``None`` without one.
        caps: the caps elastic batches keep (``None`` when none apply).
        caps_K: their (K,) values, in the order of ``caps``.
    """

    def __init__(self, lengths: LengthsTable | None = None, caps: Mapping[str, int] | None = None) -> None:
        self.lengths = lengths
        self.fingerprint = None if lengths is None else lengths.fingerprint
        self.caps = dict(caps) if caps and lengths is not None else None
        self._arrays: dict[str, np.ndarray | None] = {}
        self._asked = 0

    @classmethod
    def from_lengths(cls, lengths: LengthsTable, manifest: ManifestFile) -> ReplaySamples:
        """The quantities of ``lengths``, checked against the manifest packed from it.

        Raises:
            ManifestError: the table has another number of samples, or another fingerprint
                than the one the manifest records.

        Example:
            >>> import numpy as np, tempfile
            >>> from balancer_cli.lengths import make_lengths_table
            >>> from balancer_cli.manifest import ManifestRows, open_manifest, write_manifest
            >>> out, one = tempfile.mkdtemp(), np.zeros(1, int)
            >>> _ = write_manifest(out, ManifestRows(step=one, rank=one, micro=one, sample=one), dropped_sample=one[:0],
            ...                    dropped_reason=[], meta={"world_size": 1, "micro_batches": 1, "num_samples": 1, "seed": 0})
            >>> ReplaySamples.from_lengths(make_lengths_table(np.array([7]), {}), open_manifest(out)).costs([0]).tolist()
            [[7.0]]
        """
        where, num_samples = manifest.path, int(manifest.meta["num_samples"])
        if lengths.num_samples != num_samples:
            raise ManifestError(f"{where}: the lengths table has {lengths.num_samples} samples, the manifest "
                                f"{num_samples}", fix="pass the lengths table the manifest was packed from")
        manifest.check_lengths(lengths.fingerprint, required=False)
        # A cap on a module this table lacks bounds nothing here.
        caps = ((manifest.meta.get("params") or {}).get("caps")) or {}
        kept = {m: int(c) for m, c in caps.items() if m == LLM or m in lengths.modules}
        return cls(lengths, kept)

    @property
    def caps_K(self) -> np.ndarray | None:
        return np.asarray(list(self.caps.values()), dtype=np.int64) if self.caps else None

    def costs(self, samples: np.ndarray) -> np.ndarray | None:
        """(n, K) float64 cost of each module (encoders first, ``llm`` last) of ``samples``."""
        return self._take("cost", samples)

    def loads(self, samples: np.ndarray) -> np.ndarray | None:
        """(n, K) int64 quantities the packer capped (in the order of ``caps``) of ``samples``."""
        return self._take("load", samples) if self.caps else None

    def step_tokens(self, step: int, samples_n: np.ndarray) -> StepTokens:
        """Token counts of replay step ``step`` holding ``samples_n`` (needs the lengths table).

        Example:
            >>> from balancer_cli.lengths import make_lengths_table
            >>> ReplaySamples(make_lengths_table(np.array([5, 7, 9]))).step_tokens(3, np.array([0, 2]))
            StepTokens(step=3, num_samples=2, llm_tokens=14, loss_tokens=None)
        """
        loss = self._take("loss_tokens", samples_n)
        llm = self._take("llm_tokens", samples_n)
        return StepTokens(step, len(samples_n), int(llm.sum()), None if loss is None else int(loss.sum()))

    def _take(self, name: str, samples: np.ndarray) -> np.ndarray | None:
        """Quantity ``name`` of ``samples``: from the whole-table array once there is one, else
        from those rows alone (the same values: every quantity is per sample)."""
        if self.lengths is None:
            return None
        samples = np.asarray(samples, dtype=np.int64)
        if name not in self._arrays:
            self._asked += len(samples)
            if self._asked * _WHOLE_TABLE_AFTER < self.lengths.num_samples:
                rows = LengthsTable(self.lengths.table.take(samples), self.lengths.metadata, self.fingerprint)
                return _COMPUTE[name](rows, self.caps or {})
            self._arrays[name] = _COMPUTE[name](self.lengths, self.caps or {})
        array = self._arrays[name]
        return None if array is None else array[samples]


#: A quantity is computed for the whole table once the samples asked reach 1/16 of it.
_WHOLE_TABLE_AFTER = 16


def _loss_tokens(lengths: LengthsTable, caps: Mapping[str, int]) -> np.ndarray | None:
    if "loss_tokens" not in lengths.table.column_names:
        return None
    return np.asarray(lengths.table.column("loss_tokens").fill_null(0).to_numpy(), dtype=np.int64)


def _capped_loads(lengths: LengthsTable, caps: Mapping[str, int]) -> np.ndarray:
    """The per-sample quantities the packer's caps bound (LLM tokens, encoder items), in the
    order of ``caps``, so elastic batches respect them too."""
    columns = [lengths.llm_tokens() if module == LLM else lengths.items(module) for module in caps]
    return np.stack(columns, axis=1).astype(np.int64, copy=False)


_COMPUTE = {
    "llm_tokens": lambda lengths, caps: lengths.llm_tokens(),
    "loss_tokens": _loss_tokens,
    "cost": lambda lengths, caps: np.stack(list(sample_costs(lengths).values()), axis=1).astype(np.float64, copy=False),
    "load": _capped_loads,
}
