"""Model families ``balancer calibrate`` can build from a config folder, and how each module runs a group.

A family turns a transformers ``config.json`` into one runnable module per balancer module
(``vision``, ``llm``), built with random weights (no checkpoint) and ``layers`` transformer layers,
and runs one packed group of given sequence lengths forward and backward the way training does:

- **vision** (Qwen2-VL ViT): the group's items as one patch sequence with ``grid_thw`` rows
  ``(1, h, w)``, ``h * w`` = the item's patches, attention per item (``cu_seqlens``), then the merger;
- **llm**: the group's samples as one packed sequence, positions restarting per sample and causal
  attention within each sample only (variable-length attention: ``flash_attention_2`` natively;
  ``sdpa``/``eager`` run per sample through an attention function registered with transformers'
  ``AttentionInterface``), then the LM head and the cross-entropy loss.

:data:`FAMILIES` maps a config's ``model_type`` to its family. Qwen2-VL (and any config whose
``model_type`` transformers' ``AutoModelForCausalLM`` knows, LLM only) are supported.

Example:
    >>> sorted(FAMILIES)[:2]
    ['causal-lm', 'qwen2_5_vl']
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from balancer_cli.cost.presets import ModelConfig
from balancer_cli.errors import UsageError
from balancer_cli.lengths import LLM

__all__ = ["ATTENTIONS", "FAMILIES", "Family", "Runner", "family_for"]

#: The ``--attention`` choices.
ATTENTIONS = ("sdpa", "eager", "flash_attention_2")

#: One group forward + backward: ``run(lengths)`` for the group's sequence lengths (its ``layers``
#: attribute is the number of layers it was built with).
Runner = Callable[[Sequence[int]], None]


@dataclass(frozen=True, kw_only=True)
class Family:
    """One model family: its modules, their layer counts, FLOPs shapes and runners.

    Attributes:
        name: the family name.
        modules: balancer modules it has, encoders first, ``llm`` last.
        num_layers: ``(config, module) -> layers`` of the full model.
        quantum: ``module -> multiple`` every sequence length must be (patch grid).
        model_config: ``(config, module) -> ModelConfig`` for the FLOPs comparison.
        build: ``(config, module, layers, device, dtype, attention) -> Runner``.
    """

    name: str
    modules: tuple[str, ...]
    num_layers: Callable[[Any, str], int]
    quantum: Callable[[str], int]
    model_config: Callable[[Any, str], ModelConfig]
    build: Callable[..., Runner]


def _varlen(base: Callable, *, explicit_mask: bool) -> Callable:
    """An attention function running ``base`` causally once per packed sample (``cu_seq_lens_q``
    boundaries); ``explicit_mask``: ``base`` needs the causal mask as a tensor (eager), else it takes
    ``is_causal`` (sdpa)."""

    def forward(module, query, key, value, attention_mask, **kwargs):
        cu = kwargs.pop("cu_seq_lens_q")
        for name in ("cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids"):
            kwargs.pop(name, None)
        bounds = cu.tolist()
        outs = []
        for start, stop in zip(bounds[:-1], bounds[1:]):
            n = stop - start
            mask = (torch.full((n, n), float("-inf"), dtype=query.dtype, device=query.device).triu(1)[None, None]
                    if explicit_mask else None)
            out, _ = base(module, query[:, :, start:stop], key[:, :, start:stop], value[:, :, start:stop], mask,
                          **kwargs, **({} if explicit_mask else {"is_causal": True}))
            outs.append(out)
        return torch.cat(outs, dim=1), None

    return forward


def _attention_name(attention: str) -> str:
    """The transformers attention implementation that gives ``attention`` variable-length semantics."""
    if attention == "flash_attention_2":
        return attention
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import eager_attention_forward

    name = f"balancer_varlen_{attention}"
    base = sdpa_attention_forward if attention == "sdpa" else eager_attention_forward
    AttentionInterface.register(name, _varlen(base, explicit_mask=attention == "eager"))
    return name


def _packed_kwargs(lengths: Sequence[int], device: torch.device) -> dict[str, Any]:
    """Position ids restarting per sample and the ``cu_seqlens`` of a packed group."""
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    longest = int(max(lengths))
    return {"position_ids": positions, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
            "max_length_q": longest, "max_length_k": longest}


def _llm_runner(body: torch.nn.Module, head: torch.nn.Module, vocab: int, device: torch.device,
                positions: Callable[[torch.Tensor], torch.Tensor]) -> Runner:
    """Forward + backward of a packed LLM group through ``body`` and ``head`` (mean token cross-entropy)."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    masks = {"full_attention": None, "sliding_attention": None}  # attention is per sample (no dense mask)

    def run(lengths: Sequence[int]) -> None:
        total = int(sum(lengths))
        ids = torch.randint(vocab, (1, total), generator=generator).to(device)
        kwargs = _packed_kwargs(lengths, device)
        kwargs["position_ids"] = positions(kwargs["position_ids"])
        hidden = body(input_ids=ids, attention_mask=masks, use_cache=False, **kwargs).last_hidden_state
        logits = head(hidden).float()
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), ids.view(-1))
        loss.backward()

    run.layers = len(getattr(body, "layers", ()))
    return run


def _build_model(cls, config, *, attention: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    build = cls.from_config if hasattr(cls, "_model_mapping") else cls._from_config  # Auto* classes, model classes
    model = build(config, attn_implementation="sdpa" if attention != "flash_attention_2" else attention, dtype=dtype)
    return model.to(device).train()


def _set_attention(config, name: str) -> None:
    """Point a built model's config at ``name`` (a registered function transformers did not validate)."""
    config._attn_implementation_internal = name


# -- Qwen2-VL / Qwen2.5-VL ------------------------------------------------------------------------

def _qwen_layers(config, module: str) -> int:
    return int(config.vision_config.depth if module != LLM else config.text_config.num_hidden_layers)


def _qwen_model_config(config, module: str) -> ModelConfig:
    if module == LLM:
        t = config.text_config
        return ModelConfig(name=f"{config.model_type}-llm", kind="llm", num_layers=t.num_hidden_layers,
                           hidden_size=t.hidden_size, ffn_hidden_size=t.intermediate_size,
                           num_heads=t.num_attention_heads, num_kv_heads=t.num_key_value_heads, gated_mlp=True,
                           causal=True, vocab_size=t.vocab_size, tied_embeddings=bool(getattr(t, "tie_word_embeddings", False)))
    v = config.vision_config
    width = getattr(v, "embed_dim", None) or v.hidden_size
    ffn = int(getattr(v, "intermediate_size", 0) or width * v.mlp_ratio)
    merge = v.spatial_merge_size ** 2
    return ModelConfig(name=f"{config.model_type}-vit", kind="vision", num_layers=v.depth, hidden_size=width,
                       ffn_hidden_size=ffn, num_heads=v.num_heads, num_kv_heads=v.num_heads,
                       gated_mlp=config.model_type != "qwen2_vl", causal=False, patch_size=v.patch_size,
                       temporal_patch_size=v.temporal_patch_size, merge=merge, projector_hidden_size=width * merge)


def _qwen_grid(length: int) -> tuple[int, int]:
    """A patch grid ``(h, w)`` of ``length`` patches, both even (the 2x2 merger), as square as it gets."""
    cells = length // 4
    a = int(cells ** 0.5)
    while cells % a:
        a -= 1
    return 2 * a, 2 * (cells // a)


def _qwen_build(config, module: str, layers: int, device: torch.device, dtype: torch.dtype, attention: str) -> Runner:
    import importlib

    is_25 = config.model_type == "qwen2_5_vl"
    prefix = "Qwen2_5_VL" if is_25 else "Qwen2VL"
    modeling = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    if module == LLM:
        text = copy.deepcopy(config.text_config)
        text.num_hidden_layers = layers
        if hasattr(text, "layer_types") and text.layer_types is not None:
            text.layer_types = list(text.layer_types)[:layers] + ["full_attention"] * max(0, layers - len(text.layer_types))
        body = _build_model(getattr(modeling, f"{prefix}TextModel"), text, attention=attention, dtype=dtype,
                            device=device)
        _set_attention(body.config, _attention_name(attention))
        head = torch.nn.Linear(text.hidden_size, text.vocab_size, bias=False, dtype=dtype, device=device)
        # Qwen2-VL's text model takes (4, batch, tokens) positions: text positions, then the 3 M-RoPE axes.
        return _llm_runner(body, head, text.vocab_size, device, lambda p: p[None].expand(4, *p.shape))
    vision = copy.deepcopy(config.vision_config)
    vision.depth = layers
    cls_name = "Qwen2_5_VisionTransformerPretrainedModel" if is_25 else "Qwen2VisionTransformerPretrainedModel"
    model = _build_model(getattr(modeling, cls_name), vision, attention=attention, dtype=dtype, device=device)
    if attention == "eager":
        _set_attention(model.config, "eager")
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2

    def run(lengths: Sequence[int]) -> None:
        grid = torch.tensor([(1, *_qwen_grid(n)) for n in lengths], device=device)
        pixels = torch.randn(int(grid.prod(dim=1).sum()), width, dtype=dtype, device=device)
        out = model(hidden_states=pixels, grid_thw=grid)
        out.pooler_output.float().pow(2).mean().backward()

    run.layers = layers
    return run


# -- any causal LM (LLM only) ---------------------------------------------------------------------

def _lm_model_config(config, module: str) -> ModelConfig:
    return ModelConfig(name=f"{config.model_type}-llm", kind="llm", num_layers=config.num_hidden_layers,
                       hidden_size=config.hidden_size, ffn_hidden_size=config.intermediate_size,
                       num_heads=config.num_attention_heads,
                       num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                       gated_mlp=True, causal=True, vocab_size=config.vocab_size,
                       tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)))


def _lm_build(config, module: str, layers: int, device: torch.device, dtype: torch.dtype, attention: str) -> Runner:
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[:layers]
    model = _build_model(AutoModelForCausalLM, config, attention=attention, dtype=dtype, device=device)
    _set_attention(model.config, _attention_name(attention))
    return _llm_runner(model.get_decoder(), model.get_output_embeddings(), config.vocab_size, device, lambda p: p)


_QWEN = dict(modules=("vision", LLM), num_layers=_qwen_layers, quantum=lambda m: 1 if m == LLM else 4,
             model_config=_qwen_model_config, build=_qwen_build)
#: ``model_type`` -> family (``causal-lm``: any config ``AutoModelForCausalLM`` builds).
FAMILIES: dict[str, Family] = {
    "qwen2_vl": Family(name="qwen2_vl", **_QWEN),
    "qwen2_5_vl": Family(name="qwen2_5_vl", **_QWEN),
    "causal-lm": Family(name="causal-lm", modules=(LLM,), num_layers=lambda c, m: int(c.num_hidden_layers),
                        quantum=lambda m: 1, model_config=_lm_model_config, build=_lm_build),
}


def family_for(config) -> Family:
    """The family of a transformers config.

    Raises:
        UsageError: a model type no family covers.
    """
    if config.model_type in FAMILIES:
        return FAMILIES[config.model_type]
    from transformers import AutoModelForCausalLM

    if type(config) in AutoModelForCausalLM._model_mapping:
        return FAMILIES["causal-lm"]
    raise UsageError(f"balancer calibrate cannot build model type {config.model_type!r}",
                     fix=f"use a config of: {', '.join(k for k in FAMILIES if k != 'causal-lm')}, or any causal LM")
