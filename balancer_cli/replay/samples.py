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
    >>> samples.cost_NK.tolist(), samples.load_NK.tolist(), samples.caps_K.tolist()
    ([[512.0, 300.0], [0.0, 40.0]], [[300, 2], [40, 0]], [512, 4])
    >>> samples.step_tokens(0, np.arange(2))
    StepTokens(step=0, num_samples=2, llm_tokens=340, loss_tokens=None)
"""

from __future__ import annotations

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


@dataclass(frozen=True, kw_only=True)
class ReplaySamples:
    """Per-sample quantities of a manifest's samples, indexed by sample (all ``None`` without lengths).

    Attributes:
        llm_tokens_N: (N,) LLM tokens of each sample.
        loss_tokens_N: (N,) int64 loss tokens, when the table has a ``loss_tokens`` column.
        cost_NK: (N, K) float64 cost of each module (encoders first, ``llm`` last).
        load_NK, caps_K: (N, K) int64 quantities the packer capped (encoder items, LLM tokens)
            and its (K,) caps (``meta["params"]["caps"]``), for the capped modules the table has.
    """

    llm_tokens_N: np.ndarray | None = None
    loss_tokens_N: np.ndarray | None = None
    cost_NK: np.ndarray | None = None
    load_NK: np.ndarray | None = None
    caps_K: np.ndarray | None = None

    def __post_init__(self) -> None:
        if (self.load_NK is None) != (self.caps_K is None):
            raise ValueError("load_NK and caps_K come together")

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
            >>> ReplaySamples.from_lengths(make_lengths_table(np.array([7]), {}), open_manifest(out)).cost_NK.tolist()
            [[7.0]]
        """
        where, num_samples = manifest.path, int(manifest.meta["num_samples"])
        if lengths.num_samples != num_samples:
            raise ManifestError(f"{where}: the lengths table has {lengths.num_samples} samples, the manifest "
                                f"{num_samples}", fix="pass the lengths table the manifest was packed from")
        manifest.check_lengths(lengths.fingerprint, required=False)
        loss = None
        if "loss_tokens" in lengths.table.column_names:
            loss = np.asarray(lengths.table.column("loss_tokens").fill_null(0).to_numpy(), dtype=np.int64)
        cost_NK = np.stack(list(sample_costs(lengths).values()), axis=1).astype(np.float64)
        load_NK, caps_K = _capped_loads(lengths, manifest)
        return cls(llm_tokens_N=lengths.llm_tokens(), loss_tokens_N=loss, cost_NK=cost_NK, load_NK=load_NK,
                   caps_K=caps_K)

    def step_tokens(self, step: int, samples_n: np.ndarray) -> StepTokens:
        """Token counts of replay step ``step`` holding ``samples_n`` (needs the lengths table).

        Example:
            >>> ReplaySamples(llm_tokens_N=np.array([5, 7, 9])).step_tokens(3, np.array([0, 2]))
            StepTokens(step=3, num_samples=2, llm_tokens=14, loss_tokens=None)
        """
        loss = None if self.loss_tokens_N is None else int(self.loss_tokens_N[samples_n].sum())
        return StepTokens(step, len(samples_n), int(self.llm_tokens_N[samples_n].sum()), loss)


def _capped_loads(lengths: LengthsTable, manifest: ManifestFile) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The packer's caps (``meta["params"]["caps"]``: encoder items, LLM tokens per group) and the
    matching per-sample quantities, so elastic batches respect them too."""
    caps = ((manifest.meta.get("params") or {}).get("caps")) or {}
    columns, limits = [], []
    for module, cap in caps.items():
        if module == LLM:
            columns.append(lengths.llm_tokens())
        elif module in lengths.modules:
            columns.append(lengths.items(module))
        else:  # a cap on a module this table lacks bounds nothing here
            continue
        limits.append(int(cap))
    if not columns:
        return None, None
    return np.stack(columns, axis=1).astype(np.int64), np.asarray(limits, dtype=np.int64)

