"""Cost models: a module's predicted work per sample.

``tokens`` (the default): the cost of a sample in a module is its token count (``<m>_tokens``,
``llm_tokens``). ``flops``: training FLOPs (forward + backward = 3 x forward) of the module's
real model, from the presets of :mod:`balancer_cli.cost.presets` and the formulas of
:mod:`balancer_cli.cost.flops`: the matmul term per token plus the attention term per sequence (per
image/tile for encoders, per sample for the LLM, whose samples are packed sub-sequences with
variable-length attention). ``measured``: seconds on the user's hardware, fitted by ``balancer
calibrate`` (:mod:`balancer_cli.cost.measured`). :data:`COST_MODELS` maps each name to its
implementation.

How encoder workloads are read from the lengths table:

- fixed-size encoders (InternViT, SigLIP, CLIP, Whisper; ``tokens_per_item > 0``): the encoder
  runs ``<m>_items x tokens_per_item`` tokens, one attention sequence per item, whatever
  ``<m>_tokens`` says (OmniBal JSON stores 256 LLM tokens per tile there);
- native-resolution encoders (Qwen2-VL ViT): ``<m>_tokens`` are the patches the encoder runs,
  ``<m>_seqlens`` the patches of each item when present (else ``tokens / items`` each), and the
  projector emits ``tokens / merge`` LLM tokens.

Example:
    >>> import numpy as np
    >>> from balancer_cli.lengths import make_lengths_table
    >>> lt = make_lengths_table(np.array([300, 40]), {"vision": (np.array([1024, 0]), np.array([1, 0]))})
    >>> {m: c.tolist() for m, c in sample_costs(lt).items()}
    {'vision': [1024.0, 0.0], 'llm': [300.0, 40.0]}
    >>> costs = sample_costs(lt, "flops", vision="internvit-300m", llm="qwen2-7b")
    >>> [round(float(v) / 1e12, 2) for v in costs["vision"]], [round(float(v) / 1e12, 2) for v in costs["llm"]]
    ([2.21, 0.0], [12.78, 1.7])
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from balancer_cli.cost import flops
from balancer_cli.cost.measured import MeasuredCosts, measured_sample_costs, read_costs
from balancer_cli.cost.presets import PRESETS, ModelConfig, get_model
from balancer_cli.errors import UsageError
from balancer_cli.lengths import LLM, LengthsTable

__all__ = ["COST_MODELS", "CostModel", "module_features", "sample_costs"]

#: Encoder modules with a parameter of their own in :func:`sample_costs`, and the option that
#: gives it on the commands (``pack``, ``search``, ``report``, ``plan-*``); any other encoder is
#: given through ``encoders``, in Python only.
_MODEL_OPTIONS = {"vision": "--vision-model", "audio": "--audio-model"}


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    """The models of one MLLM, by module: encoders (``vision``, ``audio``, ...) and the LLM.

    Attributes:
        llm: the LLM's shape.
        encoders: ``((module, ModelConfig), ...)`` in pipeline order.
        attention: ``flash`` (FlashAttention-2, default) or ``eager``.
        tp: tensor-parallel size (with sequence parallelism); FLOPs and memory are per GPU.
        dropout: whether layers train with dropout (adds masks to the stored activations).

    Raises:
        UsageError: an unknown attention kind, ``tp < 1``, or a ``tp`` that does not divide the LLM's
            attention heads and KV heads.

    Example:
        >>> model = CostModel(llm=get_model("llama3-8b"), tp=2)
        >>> model.llm.name, model.encoders, model.tp
        ('llama3-8b', (), 2)
    """

    llm: ModelConfig
    encoders: tuple[tuple[str, ModelConfig], ...] = ()
    attention: str = "flash"
    tp: int = 1
    dropout: bool = False

    def __post_init__(self) -> None:
        if self.attention not in flops.ATTENTION_KINDS:
            raise UsageError(f"unknown {{attention}} {self.attention!r}",
                             fix=f"use one of: {', '.join(flops.ATTENTION_KINDS)}")
        if self.tp < 1:
            raise UsageError(f"tensor-parallel size {self.tp} < 1", fix="pass {tp} 1 or more")
        # Tensor parallelism splits the LLM's attention heads (and KV groups) across the GPUs:
        # Megatron-LM refuses a size that does not divide them, so no plan may be made for one.
        heads, kv = self.llm.num_heads, self.llm.num_kv_heads
        if heads % self.tp or kv % self.tp:
            what = f"{heads} attention heads" + (f" and {kv} KV heads" if kv != heads else "")
            # num_heads is a multiple of num_kv_heads (ModelConfig), so the sizes that work divide kv.
            sizes = ", ".join(str(d) for d in range(1, kv + 1) if kv % d == 0) if kv <= 1024 else f"a divisor of {kv}"
            raise UsageError(f"{{tp}} {self.tp} does not divide the {what} of LLM {self.llm.name!r}",
                             fix=f"use a tensor-parallel size that divides them: {sizes}")

    @classmethod
    def build(cls, llm: str | ModelConfig, encoders: Mapping[str, str | ModelConfig | None] | None = None, *,
              attention: str = "flash", tp: int = 1, dropout: bool = False) -> CostModel:
        """Resolve preset names or model files (see :func:`balancer_cli.cost.presets.get_model`).

        Args:
            llm: the LLM's preset, model file or shape.
            encoders: ``{module: preset, model file or shape}``; modules given ``None`` are left out.
            attention, tp, dropout: as the attributes.

        Raises:
            UsageError: unknown preset, wrong model kind, bad attention or tp.

        Example:
            >>> model = CostModel.build("qwen2-7b", {"vision": "qwen2-vl-vit", "audio": None})
            >>> [(m, c.name) for m, c in model.encoders]
            [('vision', 'qwen2-vl-vit')]
        """
        resolved = tuple((m, get_model(spec, kind="vision")) for m, spec in (encoders or {}).items() if spec is not None)
        return cls(llm=get_model(llm, kind="llm"), encoders=resolved, attention=attention, tp=tp, dropout=dropout)

    def encoder(self, module: str) -> ModelConfig:
        """The model of encoder ``module``.

        Raises:
            UsageError: no model was given for ``module``.

        Example:
            >>> CostModel.build("qwen2-7b", {"vision": "internvit-300m"}).encoder("vision").name
            'internvit-300m'
        """
        for name, config in self.encoders:
            if name == module:
                return config
        where = (f"pass {module}=<preset> (CLI: {_MODEL_OPTIONS[module]})" if module in _MODEL_OPTIONS
                 else f"pass encoders={{'{module}': <preset>}} (no command-line option takes it)")
        raise UsageError(f"the lengths table has module {module!r} but no model was given for it",
                         fix=f"{where}; presets: " + ", ".join(n for n, m in PRESETS.items() if m.kind != LLM))

    def sample_flops(self, lengths: LengthsTable) -> dict[str, np.ndarray]:
        """Training FLOPs per sample per GPU, ``{module: (N,) float64}``, encoders first, ``llm`` last.

        Example:
            >>> import numpy as np
            >>> from balancer_cli.lengths import make_lengths_table
            >>> lt = make_lengths_table(np.array([300, 40]))
            >>> [round(float(v) / 1e12, 2) for v in CostModel.build("qwen2-7b").sample_flops(lt)["llm"]]
            [12.78, 1.7]
        """
        out: dict[str, np.ndarray] = {}
        train = 1.0 + flops.BACKWARD_FACTOR
        for module in lengths.modules:
            enc = self.encoder(module)
            tokens, sumsq, llm_side = module_features(lengths, module, enc)
            per_token, per_sumsq = flops.layer_flops(enc, self.tp)
            fwd = (enc.num_layers * (per_token * tokens + per_sumsq * sumsq)
                   + flops.stem_flops_per_token(enc) / self.tp * tokens
                   + flops.projector_flops_per_token(enc, self.llm) / self.tp * llm_side)
            out[module] = train * fwd
        tokens, sumsq, _ = module_features(lengths, LLM, self.llm)
        per_token, per_sumsq = flops.layer_flops(self.llm, self.tp)
        fwd = (self.llm.num_layers * (per_token * tokens + per_sumsq * sumsq)
               + flops.head_flops_per_token(self.llm, self.tp) * tokens)
        out[LLM] = train * fwd
        return out


def module_features(lengths: LengthsTable, module: str, model: ModelConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-sample workload of a module: ``(tokens, sumsq, llm_side_tokens)``, each (N,) float64.

    ``tokens``: tokens the model runs; ``sumsq``: sum of squared attention-sequence lengths;
    ``llm_side_tokens``: tokens the projector hands the LLM (for the LLM: its own tokens).
    Samples with an error count as zero.

    Example:
        >>> import numpy as np
        >>> from balancer_cli.lengths import make_lengths_table
        >>> lt = make_lengths_table(np.array([300, 40]), {"vision": (np.array([1024, 0]), np.array([1, 0]))})
        >>> [a.tolist() for a in module_features(lt, "vision", get_model("internvit-300m"))]
        [[1025.0, 0.0], [1050625.0, 0.0], [256.0, 0.0]]
    """
    ok = lengths.ok_mask()
    if module == LLM:
        tokens = np.where(ok, lengths.llm_tokens(), 0).astype(np.float64)
        return tokens, tokens ** 2, tokens
    items = np.where(ok, lengths.items(module), 0).astype(np.float64)
    if model.tokens_per_item:
        t = float(model.tokens_per_item)
        return items * t, items * t * t, items * model.llm_tokens_per_item
    tokens = np.where(ok, lengths.tokens(module), 0).astype(np.float64)
    sumsq = lengths.item_sumsq(module)
    return tokens, sumsq, tokens / model.merge


def _token_costs(lengths: LengthsTable, model: Callable[[], CostModel],
                 measured: Callable[[], MeasuredCosts]) -> dict[str, np.ndarray]:
    """The ``tokens`` cost model: tokens each module processes (needs no model)."""
    costs = {m: lengths.tokens(m).astype("float64") for m in lengths.modules}
    costs[LLM] = lengths.llm_tokens().astype("float64")
    return costs


def _flops_costs(lengths: LengthsTable, model: Callable[[], CostModel],
                 measured: Callable[[], MeasuredCosts]) -> dict[str, np.ndarray]:
    """The ``flops`` cost model: training FLOPs of the resolved models."""
    return model().sample_flops(lengths)


def _measured_costs(lengths: LengthsTable, model: Callable[[], CostModel],
                    measured: Callable[[], MeasuredCosts]) -> dict[str, np.ndarray]:
    """The ``measured`` cost model: seconds from a ``balancer calibrate`` fit."""
    return measured_sample_costs(lengths, measured())


#: Cost model name -> implementation ``(lengths, model, measured) -> {module: (N,) float64}``, where
#: ``model()`` resolves the :class:`CostModel` of the call's presets and ``measured()`` the
#: calibration of ``costs=`` (each only when it is needed).
COST_MODELS: dict[str, Callable[[LengthsTable, Callable[[], CostModel], Callable[[], MeasuredCosts]],
                                dict[str, np.ndarray]]] = {
    "tokens": _token_costs,
    "flops": _flops_costs,
    "measured": _measured_costs,
}


def sample_costs(lengths: LengthsTable, cost_model: str = "tokens", *, vision: str | ModelConfig | None = None,
                 audio: str | ModelConfig | None = None, llm: str | ModelConfig | None = None,
                 encoders: Mapping[str, str | ModelConfig] | None = None, model: CostModel | None = None,
                 attention: str = "flash", costs: MeasuredCosts | str | os.PathLike | None = None
                 ) -> dict[str, np.ndarray]:
    """Per-sample cost of every module: ``{module: (N,) float64}``, encoders first, ``llm`` last.

    Args:
        lengths: the lengths table.
        cost_model: a name of :data:`COST_MODELS`: ``tokens`` (cost = tokens the module
            processes), ``flops`` (training FLOPs of the given models) or ``measured`` (seconds
            fitted by ``balancer calibrate``, :mod:`balancer_cli.cost.measured`).
        vision, audio: encoder presets/model files for the ``vision``/``audio`` modules (flops).
        llm: the LLM preset/model file (flops; required).
        encoders: presets of other encoder modules, ``{module: preset}`` (flops).
        model: a ready :class:`CostModel` (flops; replaces the preset arguments).
        attention: ``flash`` or ``eager`` (flops).
        costs: the calibration, or the path of its costs.json (measured; required).

    Raises:
        UsageError: unknown cost model or preset, no LLM preset or costs, or a module without a model.
        InputError: an unreadable or invalid costs.json.

    Example:
        >>> import numpy as np
        >>> from balancer_cli.lengths import make_lengths_table
        >>> lt = make_lengths_table(np.array([300, 40]))
        >>> sample_costs(lt)["llm"].tolist()
        [300.0, 40.0]
        >>> [round(float(v) / 1e12, 2) for v in sample_costs(lt, "flops", llm="qwen2-7b")["llm"]]
        [12.78, 1.7]
    """
    if cost_model not in COST_MODELS:
        raise UsageError(f"unknown cost model {cost_model!r}", fix=f"use one of: {', '.join(COST_MODELS)}")

    def resolve() -> CostModel:
        if model is not None:
            return model
        if llm is None:
            raise UsageError("the flops cost model needs an LLM preset", fix="pass --llm-model, e.g. --llm-model qwen2-7b")
        specs = {"vision": vision, "audio": audio, **dict(encoders or {})}
        return CostModel.build(llm, specs, attention=attention)

    def calibration() -> MeasuredCosts:
        if costs is None:
            raise UsageError("the measured cost model needs a calibration",
                             fix="pass --costs costs.json (written by balancer calibrate)")
        return costs if isinstance(costs, MeasuredCosts) else read_costs(costs)

    return COST_MODELS[cost_model](lengths, resolve, calibration)
