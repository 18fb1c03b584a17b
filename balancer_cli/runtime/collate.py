"""``PackedCollator``: turn one packed group into one padding-free sequence for varlen attention.

Packing balances *groups*; training on a group as one sequence (no padding) is the point of it.
The collator concatenates the group's samples into a single ``(1, T)`` row and returns what
transformers' models read to keep the samples apart (the conventions of transformers'
``DataCollatorWithFlattening``):

- ``position_ids`` restart at 0 at every sample;
- ``cu_seq_lens_q`` / ``cu_seq_lens_k``: flash-attention's varlen ``cu_seqlens`` (int32,
  ``(n+1,)``, ``[0, L0, L0+L1, ...]``) and ``max_length_q`` / ``max_length_k`` (its ``max_seqlen``,
  a Python int);
- ``labels``: each sample's labels (its ``input_ids`` when it has none), the first token of every
  sample set to ``-100``, so no sample's first token is predicted from the previous sample's last;
- encoder inputs (``pixel_values``, ``image_grid_thw``, ...) concatenated along dim 0 in sample
  order (a sample without images adds nothing), per-token keys (``mm_token_type_ids``)
  concatenated like ``input_ids``, sample ids (``index``) kept as a list.

Which attention implementation isolates the samples (transformers 5.x):

- ``flash_attention_2``/``3``: from ``cu_seq_lens_*``/``max_length_*`` (or, without them, from
  the restarting ``position_ids``).
- ``sdpa``, ``eager`` (and ``flex_attention``, same mask builder): the mask builder finds the
  sample boundaries in ``position_ids``, but **only when there is no KV cache**: call the model
  with ``use_cache=False``
  (the HF ``Trainer`` sets ``config.use_cache = False``); a model called with a cache in training
  lets samples attend to each other, silently. Or set ``block_mask`` for an explicit 4D
  block-diagonal causal ``attention_mask`` (``torch.bool`` for sdpa, a float dtype, the model's,
  for eager), which works whatever the cache; it costs ``T*T`` elements.
- Multimodal models (Qwen2-VL family): a sample may carry its own multi-axis rope positions as
  ``position_ids`` of shape ``(P, L)`` (or ``(P, 1, L)``, what the model's ``get_rope_index``
  returns); they are concatenated and the text positions are put on top, giving ``(P+1, 1, T)``,
  the form Qwen2-VL reads as packed (row 0 finds the boundaries, rows 1.. rotate). Without them
  the model would number the packed row as one sequence. These models also pass ``**kwargs`` to
  their vision tower, which takes ``cu_seq_lens_q`` there too: with flash attention set
  ``flash_kwargs=False`` (the text positions still separate the samples).

Example:
    >>> collate = PackedCollator()
    >>> batch = collate([{"input_ids": [5, 6, 7], "index": 4}, {"input_ids": [8, 9], "labels": [-100, 3], "index": 0}])
    >>> batch["input_ids"].tolist(), batch["position_ids"].tolist(), batch["labels"].tolist()
    ([[5, 6, 7, 8, 9]], [[0, 1, 2, 0, 1]], [[-100, 6, 7, -100, 3]])
    >>> batch["cu_seq_lens_q"].tolist(), batch["max_length_q"], batch["index"]
    ([0, 3, 5], 3, [4, 0])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from balancer_cli.errors import UsageError

__all__ = ["PackedCollator"]

_IDS, _LABELS, _POSITIONS, _MASK = "input_ids", "labels", "position_ids", "attention_mask"
_FIX_KEYS = ("list it in token_keys (one value per token), concat_keys (joined along dim 0) "
             "or list_keys (kept as a list)")


@dataclass(frozen=True, kw_only=True)
class PackedCollator:
    """Collate a group of samples into one packed sequence (see the module docstring).

    A sample is a mapping with ``input_ids`` (``(L,)`` or ``(1, L)``: a list, numpy array or
    tensor) and any of: ``labels`` (same length), the keys below, ``position_ids`` of shape
    ``(P, L)`` (multi-axis rope positions) and an all-ones ``attention_mask`` (dropped: a packed
    sequence has no padding). Any other key is an error, so nothing is dropped unnoticed.

    Attributes:
        token_keys: per-token keys, concatenated like ``input_ids`` into ``(1, T)``; a key must be
            in every sample or in none.
        concat_keys: keys joined along dim 0 in sample order (encoder inputs: Qwen2-VL's
            ``pixel_values`` rows are patches, ``image_grid_thw`` one row per image); samples
            without the key add nothing; trailing shapes must agree.
        list_keys: keys kept as a list, one entry per sample (sample ids); a sample without it
            gives ``None``.
        flash_kwargs: return ``cu_seq_lens_q``/``_k`` and ``max_length_q``/``_k``.
        block_mask: ``None``, or the dtype of a 4D ``(1, 1, T, T)`` block-diagonal causal
            ``attention_mask``: ``torch.bool`` (True = attend; sdpa) or a float dtype (0 or the
            dtype's lowest value, added to the scores; eager and sdpa, in the model's dtype).
        ignore_index: the label of the first token of every sample.

    Raises:
        UsageError: when built, a ``block_mask`` that is neither ``torch.bool`` nor a float
            dtype; when called, an empty group, or a sample without ``input_ids``, with an empty
            or non-1-D sequence, labels or per-token values of another length, an encoder input
            of another trailing shape, padding, or a key it does not know. The one-line message
            names the sample (its place in the group, and its ``index`` when it has one) and the key.

    Example (a Qwen2-VL sample, rope positions from the model's ``get_rope_index``)::

        sample["position_ids"] = model.model.get_rope_index(
            sample["input_ids"][None], sample["mm_token_type_ids"][None],
            image_grid_thw=sample.get("image_grid_thw"))[0]           # (3, 1, L)
        batch = PackedCollator()(group)   # position_ids (4, 1, T), pixel_values of every image
        loss = model(**batch, use_cache=False).loss
    """

    token_keys: tuple[str, ...] = ("mm_token_type_ids", "token_type_ids")
    concat_keys: tuple[str, ...] = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    list_keys: tuple[str, ...] = ("index",)
    flash_kwargs: bool = True
    block_mask: torch.dtype | None = None
    ignore_index: int = -100

    def __post_init__(self) -> None:
        if self.block_mask is not None and self.block_mask != torch.bool and not self.block_mask.is_floating_point:
            raise UsageError(f"block_mask {self.block_mask} is neither torch.bool nor a float dtype",
                             fix="pass torch.bool (sdpa) or the model's float dtype (eager)")

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if len(samples) == 0:
            raise UsageError("the group to collate has no samples", fix="collate groups of one or more samples")
        ids, labels, rope, tokens, concat = [], [], [], {}, {}
        for i, sample in enumerate(samples):
            where = self._where(i, sample)
            self._check_keys(where, sample)
            ids.append(x := _sequence(where, _IDS, sample[_IDS]))
            length = len(x)
            if length == 0:
                raise UsageError(f"{where}: '{_IDS}' is empty", fix="drop empty samples before packing")
            y = _sequence(where, _LABELS, sample[_LABELS]) if _LABELS in sample else x
            _same_length(where, _LABELS, len(y), length)
            labels.append(y)
            if _MASK in sample and not bool((m := _sequence(where, _MASK, sample[_MASK])).all()):
                raise UsageError(f"{where}: '{_MASK}' masks {int((m == 0).sum())} of {length} tokens; a packed "
                                 f"sequence has no padding", fix="pass unpadded samples (drop the padding)")
            rope.append(_rope_positions(where, sample[_POSITIONS], length) if _POSITIONS in sample else None)
            for key in self.token_keys:
                if key in sample:
                    values = _sequence(where, key, sample[key])
                    _same_length(where, key, len(values), length)
                    tokens.setdefault(key, []).append(values)
            for key in self.concat_keys:
                if key in sample:
                    concat.setdefault(key, []).append(_rows(where, key, sample[key], concat.get(key)))
        return self._assemble(samples, ids, labels, rope, tokens, concat)

    def _assemble(self, samples, ids, labels, rope, tokens, concat) -> dict[str, Any]:
        n = len(ids)
        length_n = torch.tensor([len(x) for x in ids])
        start_n = torch.cumsum(length_n, 0) - length_n
        total = int(length_n.sum())
        # Positions restart at every sample: a token's position is its offset from its sample's start.
        position_T = torch.arange(total) - torch.repeat_interleave(start_n, length_n)
        label_T = torch.cat(labels).to(torch.long)
        label_T[start_n] = self.ignore_index
        batch: dict[str, Any] = {_IDS: torch.cat(ids).to(torch.long)[None], _LABELS: label_T[None]}
        batch[_POSITIONS] = self._positions(position_T, rope, samples)
        if self.flash_kwargs:
            cu = torch.zeros(n + 1, dtype=torch.int32)
            cu[1:] = torch.cumsum(length_n, 0)
            batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = cu
            batch["max_length_q"] = batch["max_length_k"] = int(length_n.max())
        if self.block_mask is not None:
            batch[_MASK] = _block_causal_mask(length_n, self.block_mask)
        for key, values in tokens.items():
            if len(values) != n:
                missing = next(i for i, s in enumerate(samples) if key not in s)
                raise UsageError(f"{self._where(missing, samples[missing])}: has no '{key}' but other samples of "
                                 f"the group have it", fix="give the per-token key to every sample or to none")
            batch[key] = torch.cat(values)[None]
        for key, values in concat.items():
            batch[key] = torch.cat(values, 0)
        for key in self.list_keys:
            if any(key in s for s in samples):
                batch[key] = [s.get(key) for s in samples]
        return batch

    def _positions(self, position_T: torch.Tensor, rope: list, samples) -> torch.Tensor:
        if all(r is None for r in rope):
            return position_T[None]
        if any(r is None for r in rope) or len({r.shape[0] for r in rope}) > 1:
            i = next(i for i, r in enumerate(rope) if r is None or r.shape[0] != rope[0].shape[0])
            raise UsageError(f"{self._where(i, samples[i])}: '{_POSITIONS}' must have the same number of rows in "
                             f"every sample of the group", fix="compute them for every sample (get_rope_index)")
        # Row 0, the restarting text positions, is where the model finds the sample boundaries.
        return torch.cat([position_T[None], torch.cat(rope, 1).to(torch.long)], 0)[:, None]

    def _check_keys(self, where: str, sample: Mapping[str, Any]) -> None:
        if not isinstance(sample, Mapping):
            raise UsageError(f"{where} is a {type(sample).__name__}, not a mapping of keys to values",
                             fix="return a dict from the dataset's __getitem__")
        if _IDS not in sample:
            raise UsageError(f"{where} has no '{_IDS}'", fix="give every sample its token ids under 'input_ids'")
        known = {_IDS, _LABELS, _POSITIONS, _MASK, *self.token_keys, *self.concat_keys, *self.list_keys}
        unknown = [key for key in sample if key not in known]
        if unknown:
            raise UsageError(f"{where}: the collator does not know key '{unknown[0]}'", fix=_FIX_KEYS)

    def _where(self, i: int, sample: Any) -> str:
        ident = next((f", {key} {sample[key]!r}" for key in self.list_keys
                      if isinstance(sample, Mapping) and key in sample), "")
        return f"sample {i} of the group{ident}"


def _sequence(where: str, key: str, value: Any) -> torch.Tensor:
    """A per-token value as a 1-D tensor (a ``(1, L)`` row, what tokenizers return, is accepted)."""
    x = torch.as_tensor(value)
    if x.ndim == 2 and x.shape[0] == 1:
        x = x[0]
    if x.ndim != 1:
        raise UsageError(f"{where}: '{key}' has shape {tuple(x.shape)}; packing takes one sequence, (L,) or (1, L)",
                         fix="collate unbatched samples")
    return x


def _same_length(where: str, key: str, got: int, length: int) -> None:
    if got != length:
        raise UsageError(f"{where}: '{key}' has {got} values, '{_IDS}' has {length} tokens",
                         fix=f"give '{key}' one value per token")


def _rope_positions(where: str, value: Any, length: int) -> torch.Tensor:
    """A sample's multi-axis rope positions as ``(P, L)``."""
    x = torch.as_tensor(value)
    if x.ndim == 3 and x.shape[1] == 1:  # get_rope_index's (P, 1, L)
        x = x[:, 0]
    if x.ndim != 2 or x.shape[1] != length:
        raise UsageError(f"{where}: '{_POSITIONS}' has shape {tuple(x.shape)}, not (P, {length}) rope positions",
                         fix="drop 1-D position_ids (the collator numbers tokens itself) or give (P, L) ones")
    return x


def _rows(where: str, key: str, value: Any, earlier: list[torch.Tensor] | None) -> torch.Tensor:
    """An encoder input, rows along dim 0, whose trailing shape matches the group's earlier samples."""
    x = torch.as_tensor(value)
    if x.ndim == 0:
        raise UsageError(f"{where}: '{key}' is a scalar; it is joined along dim 0", fix=f"give '{key}' as rows")
    if earlier and x.shape[1:] != earlier[0].shape[1:]:
        raise UsageError(f"{where}: '{key}' has shape {tuple(x.shape)}, earlier samples of the group have "
                         f"(n, {', '.join(map(str, earlier[0].shape[1:]))})",
                         fix=f"give '{key}' the same trailing shape in every sample")
    return x


def _block_causal_mask(length_n: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(1, 1, T, T)``: token q attends to token k when both are in one sample and k <= q."""
    segment_T = torch.repeat_interleave(torch.arange(len(length_n)), length_n)
    total = len(segment_T)
    keep_TT = (segment_T[:, None] == segment_T[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    if dtype == torch.bool:
        return keep_TT[None, None]
    mask = torch.zeros(total, total, dtype=dtype)
    return mask.masked_fill_(~keep_TT, torch.finfo(dtype).min)[None, None]
