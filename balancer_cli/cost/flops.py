"""FLOPs, parameter and activation-memory formulas of one transformer layer (and its neighbours).

Every quantity is linear in two workload features of the sequences a layer runs on:

- ``tokens``: the number of tokens (summed over sequences), for the matmuls, and
- ``sumsq``: the sum of squared attention-sequence lengths, for the attention core (one
  sequence per image/tile for encoders, one per packed sub-sequence (= sample) for the LLM,
  as variable-length attention computes them).

So each function returns coefficients ``(per_token, per_sumsq)`` and the planners evaluate them
on mean (typical) or max (heaviest) groups. Units: FLOPs count a multiply-add as 2; memory in
bytes with 16-bit activations. Tensor parallelism (``tp``) assumes sequence parallelism too, so
activations, FLOPs and parameters per GPU are all divided by ``tp`` (Korthikanti et al. 2022,
Sec. 4.2.2, eq. 4).

Sources:
    [N21] Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
          Using Megatron-LM", arXiv:2104.04473, Sec. 5.1 and Appendix (FLOPs of a layer:
          24bsh^2 + 4bs^2h forward; backward = 2x forward; output layer 2bshV).
    [K22] Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
          Models", arXiv:2205.05198, Sec. 4.1 (per-layer activations sbh(34 + 5as/h)), Sec. 4.2
          (tensor/sequence parallel), Sec. 5 (selective recompute removes the 5as/h term; full
          recompute keeps only the 2sbh layer input), Sec. 4.3 (output layer: 4sbv fp32 logits).
    [D23] Dao 2023, "FlashAttention-2", arXiv:2307.08691: no s x s matrix is stored, only the
          fp32 log-sum-exp per head and row; causal masking skips the upper half of the blocks.
    [Z20] Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
          Parameter Models", arXiv:1910.02054, Sec. 3.1 (mixed-precision Adam: 2 + 2 + 12 bytes
          per parameter) and Sec. 5 (stage 1/2/3 partition optimizer states/gradients/parameters).

Example:
    >>> from balancer_cli.cost.presets import get_model
    >>> m = get_model("llama3-8b")
    >>> per_token, per_sumsq = layer_flops(m)
    >>> per_token == 2 * 4096 * (4096 + 2 * 1024) + 2 * 4096 ** 2 + 6 * 4096 * 14336
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from balancer_cli.cost.presets import ModelConfig

__all__ = [
    "ATTENTION_KINDS",
    "BACKWARD_FACTOR",
    "BYTES",
    "RECOMPUTE_MODES",
    "ActivationBytes",
    "embedding_params",
    "head_activation_bytes_per_token",
    "head_flops_per_token",
    "head_params",
    "layer_activation_bytes",
    "layer_flops",
    "layer_params",
    "projector_activation_bytes_per_token",
    "projector_dims",
    "projector_flops_per_token",
    "projector_params",
    "recompute_flops",
    "state_bytes_per_param",
    "stem_activation_bytes_per_token",
    "stem_flops_per_token",
    "stem_params",
]

ATTENTION_KINDS = ("flash", "eager")
RECOMPUTE_MODES = ("none", "selective", "full")
#: Backward = 2 x forward (gradients w.r.t. inputs and weights) [N21].
BACKWARD_FACTOR = 2.0
#: Bytes of one 16-bit activation or weight.
BYTES = 2


def layer_flops(model: ModelConfig, tp: int = 1) -> tuple[float, float]:
    """Forward FLOPs of one transformer layer per GPU: ``(per_token, per_sumsq)``.

    per_token [N21]: Q/K/V projections 2h(h + 2 kv) (grouped-query attention shrinks K and V to
    ``kv = num_kv_heads * head_dim``), output projection 2h^2, MLP 4hf (GELU, two matrices) or
    6hf (SwiGLU, three). With kv = h and f = 4h this is the 24h^2 of [N21].
    per_sumsq [N21]: QK^T and attention-over-values, 2s^2h each = 4h per squared length; causal
    attention computes half of it with FlashAttention-2 [D23].

    Example:
        >>> from balancer_cli.cost.presets import get_model
        >>> layer_flops(get_model("llama3-8b"), tp=2)
        (218103808.0, 4096.0)
    """
    h, kv, f = model.hidden_size, model.kv_size, model.ffn_hidden_size
    per_token = 2 * h * (h + 2 * kv) + 2 * h * h + (6 if model.gated_mlp else 4) * h * f
    per_sumsq = 4 * h * (0.5 if model.causal else 1.0)
    return per_token / tp, per_sumsq / tp


def layer_params(model: ModelConfig) -> int:
    """Weights of one layer: attention h(h + 2kv) + h^2, MLP 3hf or 2hf, two norms 2h (biases ignored).

    Example:
        >>> from balancer_cli.cost.presets import get_model
        >>> layer_params(get_model("llama3-8b"))
        218112000
    """
    h, kv, f = model.hidden_size, model.kv_size, model.ffn_hidden_size
    return h * (h + 2 * kv) + h * h + (3 if model.gated_mlp else 2) * h * f + 2 * h


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationBytes:
    """Stored activation bytes of one layer for one micro-batch: ``per_token * tokens + per_sumsq * sumsq``.

    Example:
        >>> float(ActivationBytes(per_token=10.0, per_sumsq=0.5).of(4, 16))
        48.0
    """

    per_token: float
    per_sumsq: float

    def of(self, tokens, sumsq):
        """Bytes for ``tokens`` tokens whose attention sequences have squared lengths summing to ``sumsq``."""
        return self.per_token * np.asarray(tokens, dtype=np.float64) + self.per_sumsq * np.asarray(sumsq, dtype=np.float64)


def layer_activation_bytes(model: ModelConfig, mode: str = "none", *, attention: str = "flash",
                           dropout: bool = False, tp: int = 1) -> ActivationBytes:
    """Activations one layer keeps for backward, per [K22] Sec. 4.1, generalized to GQA and SwiGLU.

    Per token, 16-bit: norm inputs 2 x 2h; Q/K/V input 2h; Q and K 2h + 2kv; V 2kv; output
    projection input 2h; MLP input 2h; MLP hidden 2 x 2f (GELU: its input and output) or 4 x 2f
    (SwiGLU: gate, up, silu(gate), product); with dropout, two h-byte masks. Eager attention stores
    the softmax output, 2a bytes per token per key (plus the dropout mask a and output 2a with
    dropout), i.e. 2a (5a) per squared sequence length; FlashAttention-2 stores none of it, only the
    fp32 log-sum-exp, 4a bytes per token [D23]. With kv = h, f = 4h, GELU, dropout and eager
    attention this is [K22]'s 34h + 5as.

    Modes [K22] Sec. 5: ``selective`` recomputes the attention core, dropping the per_sumsq term;
    ``full`` keeps only the layer input, 2h per token.

    Example:
        >>> from balancer_cli.cost.presets import get_model
        >>> m = get_model("llama3-8b")
        >>> layer_activation_bytes(m, "none", attention="eager"), layer_activation_bytes(m, "full")
        (ActivationBytes(per_token=167936.0, per_sumsq=64.0), ActivationBytes(per_token=8192.0, per_sumsq=0.0))
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode {mode!r} not in {RECOMPUTE_MODES}")
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention {attention!r} not in {ATTENTION_KINDS}")
    h, kv, f, a = model.hidden_size, model.kv_size, model.ffn_hidden_size, model.num_heads
    if mode == "full":
        return ActivationBytes(per_token=BYTES * h / tp, per_sumsq=0.0)
    per_token = BYTES * (2 * h + h + (h + kv) + kv + h + h + (4 if model.gated_mlp else 2) * f)
    if dropout:
        per_token += 2 * h  # two 1-byte masks of h per token [K22]
    per_sumsq = 0.0
    if attention == "flash":
        per_token += 4 * a  # fp32 log-sum-exp per head [D23]
    elif mode == "none":
        per_sumsq = (5 if dropout else 2) * a
    return ActivationBytes(per_token=per_token / tp, per_sumsq=per_sumsq / tp)


def recompute_flops(model: ModelConfig, mode: str, *, attention: str = "flash", tp: int = 1) -> tuple[float, float]:
    """Extra forward FLOPs per step that a recompute mode adds: ``(per_token, per_sumsq)``.

    ``full`` reruns the whole layer forward; ``selective`` reruns only the attention core
    (QK^T, softmax, attention over V) [K22] Sec. 5; with FlashAttention the core is recomputed in
    its own backward anyway, so selective recomputation adds (and saves) nothing.

    Example:
        >>> from balancer_cli.cost.presets import get_model
        >>> m = get_model("llama3-8b")
        >>> recompute_flops(m, "full"), recompute_flops(m, "selective"), recompute_flops(m, "selective", attention="eager")
        ((436207616.0, 8192.0), (0.0, 0.0), (0.0, 8192.0))
    """
    per_token, per_sumsq = layer_flops(model, tp)
    if mode == "full":
        return per_token, per_sumsq
    if mode == "selective" and attention == "eager":
        return 0.0, per_sumsq
    return 0.0, 0.0


# --- encoder stem (patch embedding / Whisper convolutions) ------------------------------------

def stem_flops_per_token(model: ModelConfig) -> float:
    """Forward FLOPs per encoder token of the input stem.

    ViT patch embedding: a (C p^2 t) x h matmul per patch [N21 rule: 2 x in x out]. Whisper: two
    kernel-3 convolutions, C -> h on the 2 input frames of every output position, then h -> h with
    stride 2 (Radford et al. 2022, "Robust Speech Recognition via Large-Scale Weak Supervision",
    Sec. 2.2).

    Example:
        >>> from balancer_cli.cost.presets import get_model
        >>> stem_flops_per_token(get_model("internvit-300m"))   # 2 x (3 x 14^2) x 1024
        1204224.0
    """
    h = model.hidden_size
    if model.patch_size:
        return 2.0 * model.in_channels * model.patch_size ** 2 * model.temporal_patch_size * h
    return 2.0 * (2 * model.in_channels * 3 * h + 3 * h * h)


def stem_params(model: ModelConfig) -> int:
    """Stem weights (plus learned position embeddings of fixed-size ViTs).

    Example:
        >>> from balancer_cli.cost.presets import get_model
        >>> stem_params(get_model("internvit-300m"))   # 3 x 14^2 x 1024 + 1025 x 1024
        1651712
    """
    h = model.hidden_size
    if model.patch_size:
        return model.in_channels * model.patch_size ** 2 * model.temporal_patch_size * h + model.tokens_per_item * h
    return model.in_channels * 3 * h + 3 * h * h


def stem_activation_bytes_per_token(model: ModelConfig) -> float:
    """The stem keeps its 16-bit input for the weight gradient.

    Example:
        >>> from balancer_cli.cost.presets import get_model
        >>> stem_activation_bytes_per_token(get_model("internvit-300m"))   # 2 x 3 x 14^2
        1176
    """
    if model.patch_size:
        return BYTES * model.in_channels * model.patch_size ** 2 * model.temporal_patch_size
    return BYTES * (2 * model.in_channels + 2 * model.hidden_size)


# --- projector (encoder -> LLM) ----------------------------------------------------------------

def projector_dims(enc: ModelConfig, llm: ModelConfig) -> tuple[int, int, int]:
    """``(in, mid, out)`` of the 2-layer MLP projector: in = encoder width x merged tokens
    (InternVL ``mlp1`` after pixel shuffle; Qwen2-VL ``PatchMerger``; LLaVA ``mm_projector``).

    Example:
        >>> from balancer_cli.cost.presets import get_model
        >>> projector_dims(get_model("qwen2-vl-vit"), get_model("qwen2-7b"))
        (5120, 5120, 3584)
    """
    d_in = enc.hidden_size * enc.merge
    return d_in, enc.projector_hidden_size or llm.hidden_size, llm.hidden_size


def projector_flops_per_token(enc: ModelConfig, llm: ModelConfig) -> float:
    """Forward FLOPs per LLM-side token: two matmuls, 2(in x mid + mid x out) [N21 rule].

    Example:
        >>> from balancer_cli.cost.presets import get_model
        >>> projector_flops_per_token(get_model("internvit-300m"), get_model("llama3-8b"))
        67108864.0
    """
    d_in, mid, out = projector_dims(enc, llm)
    return 2.0 * (d_in * mid + mid * out)


def projector_params(enc: ModelConfig, llm: ModelConfig) -> int:
    """Weights of the projector: its two matrices and the norm over its input (2 x in).

    Example:
        >>> from balancer_cli.cost.presets import get_model
        >>> projector_params(get_model("internvit-300m"), get_model("llama3-8b"))
        33562624
    """
    d_in, mid, out = projector_dims(enc, llm)
    return d_in * mid + mid * out + 2 * d_in


def projector_activation_bytes_per_token(enc: ModelConfig, llm: ModelConfig) -> float:
    """Norm input, first matmul input, GELU input and second matmul input, 16-bit [K22 rules].

    Example:
        >>> from balancer_cli.cost.presets import get_model
        >>> projector_activation_bytes_per_token(get_model("internvit-300m"), get_model("llama3-8b"))
        32768
    """
    d_in, mid, _ = projector_dims(enc, llm)
    return BYTES * (2 * d_in + 2 * mid)


# --- LLM embedding and output head -------------------------------------------------------------

def embedding_params(llm: ModelConfig) -> int:
    """The input embedding table, V x h (a lookup: no FLOPs, nothing stored for backward).

    Example:
        >>> from balancer_cli.cost.presets import get_model
        >>> embedding_params(get_model("llama3-8b"))
        525336576
    """
    return llm.vocab_size * llm.hidden_size


def head_flops_per_token(llm: ModelConfig, tp: int = 1) -> float:
    """Output layer: a h x V matmul, 2hV per token [N21].

    Example:
        >>> from balancer_cli.cost.presets import get_model
        >>> head_flops_per_token(get_model("llama3-8b"))
        1050673152.0
    """
    return 2.0 * llm.hidden_size * llm.vocab_size / tp


def head_params(llm: ModelConfig) -> int:
    """Final norm and the output matrix (its own copy on the last stage even when tied).

    Example:
        >>> from balancer_cli.cost.presets import get_model
        >>> head_params(get_model("llama3-8b"))
        525340672
    """
    return llm.vocab_size * llm.hidden_size + llm.hidden_size


def head_activation_bytes_per_token(llm: ModelConfig, tp: int = 1) -> float:
    """Final norm input 2h, output-layer input 2h, fp32 logits for the cross entropy 4V [K22 4.3].

    Example:
        >>> from balancer_cli.cost.presets import get_model
        >>> head_activation_bytes_per_token(get_model("llama3-8b"))
        529408.0
    """
    return (4.0 * llm.hidden_size + 4.0 * llm.vocab_size) / tp


# --- weights, gradients, optimizer states ------------------------------------------------------

def state_bytes_per_param(zero_stage: int = 0, dp: int = 1) -> float:
    """Bytes per parameter of mixed-precision Adam [Z20]: 16-bit weights 2, 16-bit gradients 2,
    fp32 master weights + momentum + variance 12. ZeRO stage 1 shards the 12 over ``dp`` ranks,
    stage 2 also the gradients, stage 3 also the weights (Megatron's distributed optimizer is
    stage 1).

    Example:
        >>> state_bytes_per_param(0), state_bytes_per_param(1, 8), state_bytes_per_param(3, 8)
        (16.0, 5.5, 2.0)
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {zero_stage} not in 0..3")
    weights, grads, optim = 2.0, 2.0, 12.0
    if zero_stage >= 1:
        optim /= dp
    if zero_stage >= 2:
        grads /= dp
    if zero_stage >= 3:
        weights /= dp
    return weights + grads + optim
