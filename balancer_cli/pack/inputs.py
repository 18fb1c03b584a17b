"""Per-sample inputs of packers, baselines and metrics: load and cost matrices of a lengths table.

``load_NK`` is what the caps bound (encoder *items* per module, LLM *tokens* last);
``cost_NK`` is what gets balanced (:func:`balancer_cli.cost.samples.sample_costs`, tokens by default).
Columns the lengths contract does not know are refused rather than silently ignored.

Example:
    >>> import numpy as np
    >>> from balancer_cli.lengths import make_lengths_table
    >>> lengths = make_lengths_table(np.array([300, 40]), {"vision": (np.array([512, 0]), np.array([2, 0]))})
    >>> inputs = prepare_inputs(lengths)
    >>> inputs.modules, inputs.load_NK.tolist(), inputs.cost_NK[:, 0].tolist()
    (('vision', 'llm'), [[2, 300], [0, 40]], [512.0, 0.0])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from balancer_cli._arrow import numpy_of
from balancer_cli.cost.measured import MeasuredCosts
from balancer_cli.cost.samples import sample_costs
from balancer_cli.errors import InputError
from balancer_cli.lengths import COLUMNS_FIX, LLM, MEMBER_COLUMNS, LengthsTable
from balancer_cli.pack.types import index_dtype

__all__ = ["EMPTY_ERROR_REASON", "PackInputs", "prepare_inputs"]

#: The dropped reason of a sample whose error text is empty (it failed, but the scan said nothing).
EMPTY_ERROR_REASON = "scan error (no text given)"
#: Samples whose model costs (``flops``, ``measured``) are computed at a time.
_COST_BLOCK = 1 << 20


@dataclass(frozen=True)
class PackInputs:
    """Per-sample matrices every packer, baseline and metric works on.

    Attributes:
        modules: K module names, encoders first, ``llm`` last.
        load_NK: (N, K) int32 (int64 beyond 2^31) capped quantity: encoder items, LLM tokens.
        cost_NK: (N, K) float32 balanced cost (tokens under the default cost model: exact up to
            2^24 tokens a sample; other models keep 7 significant digits).
        ok_N: (N,) bool, samples without a scan error.
        error_rows: (E,) int64, the samples with a scan error, ascending (``flatnonzero(~ok_N)``).
        error_texts: (E,) object, their error texts: one string object per distinct text, so a
            dataset with many failed samples holds no string per sample (10M with 1% failed:
            ~1 MB instead of an (N,) object column of 80 MB).
        source_codes_N: (N,) index into ``source_names`` (int8/int16/int32: the narrowest that fits).
        source_names: the distinct sources.
    """

    modules: tuple[str, ...]
    load_NK: np.ndarray
    cost_NK: np.ndarray
    ok_N: np.ndarray
    error_rows: np.ndarray
    error_texts: np.ndarray
    source_codes_N: np.ndarray
    source_names: tuple[str, ...]

    @property
    def num_samples(self) -> int:
        return len(self.ok_N)

    @property
    def all_ok(self) -> bool:
        """Whether no sample has a scan error (the common case, where the matrices are used whole)."""
        return len(self.error_rows) == 0

    def load_unit(self, module: str) -> str:
        return "tokens" if module == LLM else "items"

    def ok_ids(self) -> np.ndarray:
        """(n,) the samples without a scan error, in the narrowest index type."""
        if self.all_ok:  # without flatnonzero's (N,) int64 copy
            return np.arange(self.num_samples, dtype=index_dtype(self.num_samples))
        return np.flatnonzero(self.ok_N).astype(index_dtype(self.num_samples))

    def ok_rows(self, matrix_N: np.ndarray) -> np.ndarray:
        """Rows of ``matrix_N`` without a scan error: the matrix itself (no copy) when no sample failed."""
        return matrix_N if self.all_ok else matrix_N[self.ok_N]


_KNOWN_SUFFIXES = ("_tokens", "_items", "_seqlens")


def _check_columns(lengths: LengthsTable, origin: str) -> None:
    known = {"sample", "source", "llm_tokens", "error", *MEMBER_COLUMNS}  # tar members: read by the runtime
    known |= {f"{m}{s}" for m in lengths.modules for s in _KNOWN_SUFFIXES}
    unknown = [c for c in lengths.table.column_names if c not in known]
    if unknown:
        name = unknown[0]
        hint = ""
        for suffix in ("_tokens", "_items"):
            if name.endswith(suffix):
                module = name[: -len(suffix)]
                hint = f" (an encoder '{module}' needs both {module}_tokens and {module}_items)"
        raise InputError(f"{origin}: unknown column '{name}'{hint}", fix=COLUMNS_FIX)


def prepare_inputs(lengths: LengthsTable, cost_model: str = "tokens",
                   cost_presets: Mapping[str, str] | Sequence[tuple[str, str]] = (), *,
                   costs: MeasuredCosts | None = None, origin: str = "the lengths table") -> PackInputs:
    """Build the load and cost matrices of a lengths table (raises on unknown columns).

    Args:
        lengths: the lengths table.
        cost_model: ``tokens`` or ``flops`` (:func:`balancer_cli.cost.samples.sample_costs`).
        cost_presets: ``{module: preset or model file}`` for ``flops`` (``llm`` required there).
        costs: the calibration of ``measured``.
        origin: what an error names the table by (the file it was read from).
    """
    _check_columns(lengths, origin)
    modules = tuple(lengths.modules) + (LLM,)
    # Filled column by column in the narrowest exact types: 16 B per sample for two modules
    # instead of 32 (packers widen their window's rows only). Loads, then costs, straight from
    # the table's own integer columns: no (N,) int64 or float64 copies (10M: each one
    # page-faults ~0.1 s, and with all of them alive at once the peak rose 434 MB over the table).
    load_NK = np.empty((lengths.table.num_rows, len(modules)), dtype=_load_dtype(lengths))
    for k, module in enumerate(modules):
        load_NK[:, k] = lengths.llm_tokens(stored=True) if module == LLM else lengths.items(module, stored=True)
    cost_NK = np.empty(load_NK.shape, dtype=np.float32)
    if cost_model == "tokens":
        # sample_costs' "tokens" (a module's cost is its tokens) without its (N,) float64 columns:
        # an integer rounds to float32 the same, directly or through float64.
        for k, module in enumerate(modules):
            cost_NK[:, k] = lengths.tokens(module, stored=True)
    else:
        presets = dict(cost_presets)
        named = {m: presets.pop(m, None) for m in ("vision", "audio", LLM)} if cost_model == "flops" else {}
        # A block of samples at a time: the models' features and terms are (N,) float64 columns, a
        # dozen alive at once (10M FLOPs: +0.55 GB, --memory-gb 1 ended at 1,104 MiB); a sample's
        # cost is its own, so the blocks' costs are the whole table's.
        for lo in range(0, len(cost_NK), _COST_BLOCK):
            part = dataclasses.replace(lengths, table=lengths.table.slice(lo, _COST_BLOCK))
            if cost_model == "flops":
                by_module = sample_costs(part, cost_model, vision=named["vision"], audio=named["audio"],
                                         llm=named[LLM], encoders=presets or None)
            else:
                by_module = sample_costs(part, cost_model, costs=costs)
            for k, module in enumerate(modules):
                cost_NK[lo:lo + part.table.num_rows, k] = by_module.pop(module)
    source = lengths.table.column("source").combine_chunks()
    names = tuple(str(x) for x in source.dictionary.to_pylist())
    codes = np.asarray(numpy_of(source.indices), dtype=np.min_scalar_type(-max(len(names), 1)))
    load_NK.setflags(write=False)  # shared by every packer and metric of a run; lets bounds be remembered
    ok_N = lengths.ok_mask()
    return PackInputs(modules, load_NK, cost_NK, ok_N, *_errors(lengths, ok_N), codes, names)


def _load_dtype(lengths: LengthsTable) -> np.dtype:
    """int32 when every load fits (any real sample), else int64: from Arrow's column maxima, so
    that no column is converted twice."""
    names = [f"{m}_items" for m in lengths.modules] + ["llm_tokens"]
    top = max((pc.max(lengths.table.column(name)).as_py() or 0 for name in names), default=0)
    return np.dtype(np.int32 if top < 2**31 else np.int64)


def _errors(lengths: LengthsTable, ok_N: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(error_rows, error_texts)`` of :class:`PackInputs`: the failed samples and their texts,
    read through a dictionary of the distinct texts."""
    rows = np.flatnonzero(~ok_N)
    if len(rows) == 0:
        return rows.astype(np.int64), np.zeros(0, dtype=object)
    encoded = lengths.table.column("error").take(pa.array(rows)).combine_chunks().dictionary_encode()
    distinct = np.empty(len(encoded.dictionary), dtype=object)
    # An empty text still marks a failed sample; its reason must say something (the dropped list's check).
    distinct[:] = [text or EMPTY_ERROR_REASON for text in encoded.dictionary.to_pylist()]
    return rows.astype(np.int64), distinct[np.asarray(numpy_of(encoded.indices), dtype=np.int64)]
