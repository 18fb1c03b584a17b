"""Model presets for the FLOPs cost model and the planners, plus a YAML/JSON loader for others.

Every preset copies the shape fields of the model's public ``config.json`` (Hugging Face hub
page named in ``source``). Only what the formulas of :mod:`balancer_cli.cost.flops` need is kept:
layers, hidden size, FFN size, attention heads, KV heads, vocabulary, patch/image size, the MLP
kind (gated SwiGLU or plain GELU) and, for encoders, how many tokens one item (tile, image,
30 s audio clip) feeds the encoder and the LLM.

Example:
    >>> m = get_model("internlm2-20b")
    >>> (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_kv_heads)
    (48, 6144, 16384, 8)
    >>> get_model("internvit-6b").tokens_per_item   # (448 / 14)^2 patches + 1 class token
    1025
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from balancer_cli.errors import InputError, UsageError

__all__ = ["KINDS", "PRESETS", "ModelConfig", "get_model", "load_model_file", "preset_names"]

#: Model kinds: the encoder modules with presets, then ``llm``.
KINDS = ("vision", "audio", "llm")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Shape of one transformer model (an encoder or an LLM).

    Attributes:
        name: preset name or file stem.
        kind: ``vision``, ``audio`` or ``llm``.
        num_layers: transformer layers.
        hidden_size: model width h.
        ffn_hidden_size: MLP width f.
        num_heads: attention (query) heads a; head dim = h / a.
        num_kv_heads: key/value heads (grouped-query attention); = num_heads for MHA.
        gated_mlp: True for SwiGLU (three h x f matrices), False for GELU MLPs (two).
        causal: causal self-attention (LLMs) or bidirectional (encoders).
        vocab_size: LLM vocabulary (0 for encoders).
        tied_embeddings: LLM input embedding shared with the output head.
        patch_size, image_size: ViT patch/image side in pixels (0 when not a fixed-size ViT).
        in_channels: input channels of the patch embedding (3 RGB; 128 mel bins for Whisper).
        temporal_patch_size: frames per patch (Qwen2-VL's 3D patches use 2).
        tokens_per_item: tokens the encoder runs per item when fixed (tile/image/clip); 0 when
            the item size varies (read ``<m>_tokens``/``<m>_seqlens`` from the lengths table).
        merge: encoder tokens merged into one LLM token by the projector (InternVL pixel
            shuffle 0.5: 4; Qwen2-VL 2x2 merger: 4; LLaVA: 1).
        class_tokens: extra tokens per item dropped before the projector (ViT [CLS]).
        projector_hidden_size: inner width of the encoder's 2-layer MLP projector; 0 means the
            LLM's hidden size (InternVL ``mlp1``, LLaVA); Qwen2-VL's merger uses 4 x 1280 = 5120.
        source: where the numbers come from.

    Raises:
        UsageError: an unknown kind, a size that is not positive, heads that do not divide the
            width, ``merge < 1``, or more ``class_tokens`` than ``tokens_per_item``.

    Example:
        >>> m = ModelConfig(name="tiny", kind="llm", num_layers=2, hidden_size=256, ffn_hidden_size=1024,
        ...                 num_heads=4, num_kv_heads=2, gated_mlp=True, causal=True, vocab_size=1000)
        >>> m.head_dim, m.kv_size
        (64, 128)
    """

    name: str
    kind: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    gated_mlp: bool
    causal: bool
    vocab_size: int = 0
    tied_embeddings: bool = False
    patch_size: int = 0
    image_size: int = 0
    in_channels: int = 3
    temporal_patch_size: int = 1
    tokens_per_item: int = 0
    merge: int = 1
    class_tokens: int = 0
    projector_hidden_size: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UsageError(f"field 'kind' is {self.kind!r}", fix=f"use one of: {', '.join(KINDS)}")
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_heads", "num_kv_heads"):
            if getattr(self, name) <= 0:
                raise UsageError(f"field {name!r} must be > 0", fix=f"set {name} to a positive integer")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise UsageError(f"field 'num_heads' ({self.num_heads}) must divide hidden_size ({self.hidden_size}) "
                             f"and be a multiple of num_kv_heads ({self.num_kv_heads})", fix="check the head counts")
        if self.merge < 1:
            raise UsageError("field 'merge' must be >= 1", fix="use 1 when the projector keeps every token")
        # The class tokens are part of an item's tokens: more of them would leave an item a negative
        # number of tokens for the projector (and the planners negative layer costs).
        if self.tokens_per_item and self.class_tokens > self.tokens_per_item:
            raise UsageError(f"field 'class_tokens' ({self.class_tokens}) exceeds tokens_per_item "
                             f"({self.tokens_per_item})",
                             fix="count the class tokens within tokens_per_item (patches + class tokens)")

    @property
    def head_dim(self) -> int:
        """Width of one attention head: hidden_size / num_heads."""
        return self.hidden_size // self.num_heads

    @property
    def kv_size(self) -> int:
        """Width of K (and of V): num_kv_heads x head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def llm_tokens_per_item(self) -> int:
        """LLM tokens one fixed-size item becomes after the projector (0 if items vary)."""
        return (self.tokens_per_item - self.class_tokens) // self.merge if self.tokens_per_item else 0


def _hf(repo: str) -> str:
    """The ``config.json`` page of a Hugging Face hub model."""
    return f"https://huggingface.co/{repo}/blob/main/config.json"


def _vit(name, layers, h, f, heads, patch, image, *, cls, merge, source) -> ModelConfig:
    """A fixed-size ViT (MHA, GELU MLP) over square ``image``-pixel items of ``patch``-pixel patches."""
    return ModelConfig(name=name, kind="vision", num_layers=layers, hidden_size=h, ffn_hidden_size=f, num_heads=heads,
                       num_kv_heads=heads, gated_mlp=False, causal=False, patch_size=patch, image_size=image,
                       tokens_per_item=(image // patch) ** 2 + cls, merge=merge, class_tokens=cls, source=source)


def _llm(name, layers, h, f, heads, kv, vocab, source) -> ModelConfig:
    """A decoder LLM with SwiGLU MLPs and grouped-query attention."""
    return ModelConfig(name=name, kind="llm", num_layers=layers, hidden_size=h, ffn_hidden_size=f, num_heads=heads,
                       num_kv_heads=kv, gated_mlp=True, causal=True, vocab_size=vocab, source=source)


#: Presets from public configs (see each ``source``).
PRESETS: dict[str, ModelConfig] = {m.name: m for m in (
    # InternViT: 448 px tiles, 14 px patches, one [CLS]; InternVL's pixel shuffle (downsample 0.5)
    # merges 2x2 patches, so a tile is 1024 / 4 = 256 LLM tokens.
    _vit("internvit-300m", 24, 1024, 4096, 16, 14, 448, cls=1, merge=4, source=_hf("OpenGVLab/InternViT-300M-448px")),
    # V1-5 keeps 45 of the 48 layers of InternViT-6B (num_hidden_layers 45 in its config).
    _vit("internvit-6b", 45, 3200, 12800, 25, 14, 448, cls=1, merge=4,
         source=_hf("OpenGVLab/InternViT-6B-448px-V1-5")),
    # Qwen2-VL's ViT: depth 32, embed_dim 1280, mlp_ratio 4, 16 heads, 14 px patches over 2 frames,
    # 2x2 spatial merge; native resolution, so tokens per image vary (tokens_per_item 0).
    ModelConfig(name="qwen2-vl-vit", kind="vision", num_layers=32, hidden_size=1280, ffn_hidden_size=5120,
                num_heads=16, num_kv_heads=16, gated_mlp=False, causal=False, patch_size=14, temporal_patch_size=2,
                merge=4, projector_hidden_size=5120, source=_hf("Qwen/Qwen2-VL-7B-Instruct") + " (vision_config)"),
    _vit("siglip-so400m", 27, 1152, 4304, 16, 14, 384, cls=0, merge=1, source=_hf("google/siglip-so400m-patch14-384")),
    _vit("clip-vit-l-336", 24, 1024, 4096, 16, 14, 336, cls=1, merge=1, source=_hf("openai/clip-vit-large-patch14-336")),
    # Whisper large-v3 encoder: 128 mel bins, a 30 s clip is 3000 frames -> 1500 positions after the
    # stride-2 convolution (max_source_positions 1500).
    ModelConfig(name="whisper-large-v3-encoder", kind="audio", num_layers=32, hidden_size=1280, ffn_hidden_size=5120,
                num_heads=20, num_kv_heads=20, gated_mlp=False, causal=False, in_channels=128, tokens_per_item=1500,
                source=_hf("openai/whisper-large-v3")),
    _llm("qwen2-7b", 28, 3584, 18944, 28, 4, 152064, _hf("Qwen/Qwen2-7B")),
    _llm("qwen2-72b", 80, 8192, 29568, 64, 8, 152064, _hf("Qwen/Qwen2-72B")),
    _llm("internlm2-20b", 48, 6144, 16384, 48, 8, 92544, _hf("internlm/internlm2-20b")),
    _llm("llama3-8b", 32, 4096, 14336, 32, 8, 128256, _hf("meta-llama/Meta-Llama-3-8B")),
    _llm("llama3-70b", 80, 8192, 28672, 64, 8, 128256, _hf("meta-llama/Meta-Llama-3-70B")),
    _llm("yi-34b", 60, 7168, 20480, 56, 8, 64000, _hf("01-ai/Yi-34B")),
)}

_REQUIRED = ("kind", "num_layers", "hidden_size", "ffn_hidden_size", "num_heads")
_INT_FIELDS = {f.name for f in fields(ModelConfig) if f.type in ("int", int)}
_BOOL_FIELDS = {f.name for f in fields(ModelConfig) if f.type in ("bool", bool)}


def preset_names(kind: str | None = None) -> list[str]:
    """Preset names, optionally only those of one kind (``vision``, ``audio``, ``llm``).

    Example:
        >>> preset_names("audio")
        ['whisper-large-v3-encoder']
    """
    return [n for n, m in PRESETS.items() if kind is None or m.kind == kind]


def get_model(name_or_path: str | os.PathLike | ModelConfig, kind: str | None = None) -> ModelConfig:
    """A preset by name, or a model described by a YAML/JSON file.

    Args:
        name_or_path: preset name (see :data:`PRESETS`), a ``.yaml``/``.yml``/``.json`` path, or
            an already built :class:`ModelConfig` (returned as is).
        kind: when given, the model must be of this kind (an LLM where an LLM is expected).

    Raises:
        UsageError: unknown preset (the message lists the presets) or wrong kind.
        InputError: unreadable file or a missing/invalid field (names the file and field).

    Example:
        >>> get_model("qwen2-7b", kind="llm").num_kv_heads
        4
        >>> get_model("siglip-so400m", kind="vision").tokens_per_item
        729
    """
    if isinstance(name_or_path, ModelConfig):
        model = name_or_path
    else:
        text = str(name_or_path)
        if text in PRESETS:
            model = PRESETS[text]
        elif text.lower().endswith((".yaml", ".yml", ".json")) or Path(text).is_file():
            model = load_model_file(text)
        else:
            listed = preset_names(kind if kind in KINDS else None)
            raise UsageError(f"unknown model preset {text!r}",
                             fix=f"use one of: {', '.join(listed)}; or a YAML/JSON file with the model's shape")
    if kind is not None and model.kind != kind and not (kind != "llm" and model.kind != "llm"):
        raise UsageError(f"model {model.name!r} is a {model.kind} model, expected {kind}",
                         fix=f"use one of: {', '.join(preset_names(kind))}")
    return model


def load_model_file(path: str | os.PathLike) -> ModelConfig:
    """Read a model shape from YAML or JSON (keys: the :class:`ModelConfig` field names).

    Required: ``kind``, ``num_layers``, ``hidden_size``, ``ffn_hidden_size``, ``num_heads``; LLMs
    also ``vocab_size``. Defaults: ``num_kv_heads = num_heads``, ``gated_mlp`` true for LLMs,
    ``causal`` true for LLMs, ``name`` the file stem.

    Example YAML::

        kind: llm
        num_layers: 40
        hidden_size: 5120
        ffn_hidden_size: 13824
        num_heads: 40
        vocab_size: 32000

    Raises:
        InputError: the file is missing, unparsable, or a field is missing, unknown or invalid.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "tiny.json"
        >>> _ = path.write_text('{"kind": "llm", "num_layers": 2, "hidden_size": 256, "ffn_hidden_size": 512, '
        ...                     '"num_heads": 4, "vocab_size": 100}')
        >>> m = load_model_file(path)
        >>> m.name, m.num_kv_heads, m.gated_mlp
        ('tiny', 4, True)
    """
    import yaml  # lazy: only model files need it

    path = Path(path)
    try:
        raw = path.read_text()
    except OSError as exc:
        raise InputError(f"{path}: cannot read model file ({exc.strerror or exc})",
                         fix="pass a preset name or an existing YAML/JSON file") from None
    try:
        data = json.loads(raw) if path.suffix.lower() == ".json" else yaml.safe_load(raw)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise InputError(f"{path}: not valid {'JSON' if path.suffix.lower() == '.json' else 'YAML'} ({exc})".replace("\n", " "),
                         fix="fix the syntax of the model file") from None
    if not isinstance(data, Mapping):
        raise InputError(f"{path}: expected a mapping of model fields, got {type(data).__name__}",
                         fix=f"write keys such as {', '.join(_REQUIRED)}")
    return _from_mapping(data, path)


def _from_mapping(data: Mapping[str, Any], path: Path) -> ModelConfig:
    """A :class:`ModelConfig` from a model file's mapping; every error names ``path``."""
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise InputError(f"{path}: unknown field {unknown[0]!r}", fix=f"known fields: {', '.join(sorted(known))}")
    kind = data.get("kind")
    required = _REQUIRED + (("vocab_size",) if kind == "llm" else ())
    for name in required:
        if name not in data or data[name] is None:
            raise InputError(f"{path}: field {name!r} is missing", fix=f"add '{name}: <value>' to the file")
    values: dict[str, Any] = {"name": str(data.get("name") or path.stem), "kind": kind,
                              "num_kv_heads": data.get("num_heads"), "gated_mlp": kind == "llm",
                              "causal": kind == "llm"}
    for name, value in data.items():
        if name in ("name", "kind", "source"):
            continue
        if name in _BOOL_FIELDS:
            if not isinstance(value, bool):
                raise InputError(f"{path}: field {name!r} is {value!r}, expected true or false", fix=f"set {name}: true|false")
        elif name in _INT_FIELDS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InputError(f"{path}: field {name!r} is {value!r}, expected a non-negative integer",
                                 fix=f"set {name} to an integer")
        values[name] = value
    values["source"] = str(data.get("source", path))
    try:
        return ModelConfig(**values)
    except UsageError as error:  # the shape's own checks; a file's mistakes are input errors
        raise InputError(f"{path}: {error.message}", fix=error.fix) from None
