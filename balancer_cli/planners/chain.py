"""The layer chain of an MLLM and the group workloads the planners evaluate it on.

The chain is what a pipeline cuts: for each encoder its stem (patch embedding), its layers and
its projector, then the LLM's embedding, layers and output head. Each :class:`Layer` holds
*linear forms* over group workload features (``"<module>.tokens"``, ``"<module>.sumsq"``,
``"<module>.side"``: see :func:`balancer_cli.cost.samples.module_features`), so one chain serves every
group: a typical (mean) group for stage times, the heaviest group for memory.

Example:
    >>> from balancer_cli.cost.samples import CostModel
    >>> chain = build_chain(CostModel.build("qwen2-7b", {"vision": "qwen2-vl-vit"}))
    >>> len(chain), chain[0].name, chain[-1].name
    (64, 'vision.stem', 'llm.head')
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from balancer_cli.cost import flops
from balancer_cli.cost.samples import CostModel, module_features
from balancer_cli.lengths import LLM, LengthsTable

__all__ = ["Form", "Layer", "build_chain", "evaluate", "layer_costs", "layer_out_bytes", "group_features",
           "mean_features", "sequential_groups", "explicit_features"]

#: A linear form: ``((feature, coefficient), ...)``.
Form = tuple


def evaluate(form: Form, features: Mapping[str, object]):
    """Value of a linear form on features (scalars or (G,) arrays; a missing feature counts 0).

    Example:
        >>> float(evaluate((("llm.tokens", 2.0), ("llm.sumsq", 0.5)), {"llm.tokens": 3}))
        6.0
    """
    total = 0.0
    for key, coef in form:
        if coef:
            total = total + coef * np.asarray(features.get(key, 0.0), dtype=np.float64)
    return total


@dataclass(frozen=True, kw_only=True, slots=True)
class Layer:
    """One cuttable unit of the pipeline.

    Attributes:
        name: e.g. ``vision.layer.3``, ``llm.head``.
        module: ``vision``/``audio``/``llm``.
        kind: ``stem``, ``layer``, ``projector``, ``embedding`` or ``head``.
        params: weights (per GPU, i.e. divided by tp).
        fwd: forward FLOPs per GPU (form).
        act: stored activation bytes per micro-batch for recompute ``none``/``selective``/``full``.
        extra: forward FLOPs a recompute mode adds, same order (``none`` adds 0).
        out: bytes a stage sends when the cut falls after this layer.

    Example:
        >>> layer = build_chain(CostModel.build("llama3-8b"))[1]
        >>> layer.name, layer.kind, layer.recomputable
        ('llm.layer.0', 'layer', True)
    """

    name: str
    module: str
    kind: str
    params: float
    fwd: Form
    act: tuple[Form, Form, Form]
    extra: tuple[Form, Form, Form]
    out: Form

    @property
    def recomputable(self) -> bool:
        """Only transformer layers have recompute modes; stems, projectors and the head do not."""
        return self.kind == "layer"

    def train_flops(self, features: Mapping[str, object]):
        """Forward + backward FLOPs (backward = 2 x forward, [N21] in :mod:`balancer_cli.cost.flops`).

        Example:
            >>> model = CostModel.build("llama3-8b")
            >>> round(float(build_chain(model)[1].train_flops(explicit_features(model, 4096, {}))) / 1e12, 2)
            5.77
        """
        return (1.0 + flops.BACKWARD_FACTOR) * evaluate(self.fwd, features)


def build_chain(model: CostModel) -> list[Layer]:
    """The MLLM's layers in pipeline order: per encoder stem, layers, projector; LLM embedding,
    layers, head. Per-GPU numbers (tensor parallel ``model.tp`` with sequence parallelism).

    Example:
        >>> [layer.name for layer in build_chain(CostModel.build("llama3-8b"))][:2]
        ['llm.embedding', 'llm.layer.0']
    """
    tp, attn, drop = model.tp, model.attention, model.dropout
    chain: list[Layer] = []
    carried: Form = ()  # projected outputs of earlier encoders travel with later cuts
    llm = model.llm
    for module, enc in model.encoders:
        tok, sq, side = f"{module}.tokens", f"{module}.sumsq", f"{module}.side"
        hidden_out = ((tok, flops.BYTES * enc.hidden_size / tp),) + carried
        stem_act = ((tok, flops.stem_activation_bytes_per_token(enc) / tp),)
        chain.append(Layer(name=f"{module}.stem", module=module, kind="stem", params=flops.stem_params(enc) / tp,
                           fwd=((tok, flops.stem_flops_per_token(enc) / tp),), act=(stem_act,) * 3, extra=_NO_EXTRA,
                           out=hidden_out))
        chain += _layers(module, enc, tok, sq, hidden_out, attn, drop, tp)
        proj_act = ((side, flops.projector_activation_bytes_per_token(enc, llm) / tp),)
        carried = carried + ((side, flops.BYTES * llm.hidden_size / tp),)
        chain.append(Layer(name=f"{module}.projector", module=module, kind="projector",
                           params=flops.projector_params(enc, llm) / tp,
                           fwd=((side, flops.projector_flops_per_token(enc, llm) / tp),), act=(proj_act,) * 3,
                           extra=_NO_EXTRA, out=carried))
    tok, sq = f"{LLM}.tokens", f"{LLM}.sumsq"
    hidden_out = ((tok, flops.BYTES * llm.hidden_size / tp),)
    chain.append(Layer(name=f"{LLM}.embedding", module=LLM, kind="embedding", params=flops.embedding_params(llm) / tp,
                       fwd=(), act=((), (), ()), extra=_NO_EXTRA, out=hidden_out))
    chain += _layers(LLM, llm, tok, sq, hidden_out, attn, drop, tp)
    head_act = ((tok, flops.head_activation_bytes_per_token(llm, tp)),)
    chain.append(Layer(name=f"{LLM}.head", module=LLM, kind="head", params=flops.head_params(llm) / tp,
                       fwd=((tok, flops.head_flops_per_token(llm, tp)),), act=(head_act,) * 3, extra=_NO_EXTRA, out=()))
    return chain


#: Added FLOPs of the three recompute modes for a layer that is never recomputed.
_NO_EXTRA: tuple[Form, Form, Form] = ((), (), ())


def _layers(module, cfg, tok, sq, out, attn, drop, tp) -> list[Layer]:
    """The ``cfg.num_layers`` identical transformer layers of one module."""
    acts = tuple(flops.layer_activation_bytes(cfg, mode, attention=attn, dropout=drop, tp=tp)
                 for mode in flops.RECOMPUTE_MODES)
    act_forms = tuple(((tok, a.per_token), (sq, a.per_sumsq)) for a in acts)
    extras = tuple(((tok, t), (sq, s)) for t, s in (flops.recompute_flops(cfg, mode, attention=attn, tp=tp)
                                                     for mode in flops.RECOMPUTE_MODES))
    per_token, per_sumsq = flops.layer_flops(cfg, tp)
    fwd = ((tok, per_token), (sq, per_sumsq))
    params = flops.layer_params(cfg) / tp
    return [Layer(name=f"{module}.layer.{i}", module=module, kind="layer", params=params, fwd=fwd, act=act_forms,
                  extra=extras, out=out)
            for i in range(cfg.num_layers)]


def layer_costs(chain: Sequence[Layer], features: Mapping[str, object]) -> np.ndarray:
    """Training FLOPs of each layer of ``chain`` for one group's ``features``, float64.

    Example:
        >>> model = CostModel.build("llama3-8b")
        >>> costs = layer_costs(build_chain(model), explicit_features(model, 4096, {}))
        >>> len(costs), float(costs[0])
        (34, 0.0)
    """
    return np.asarray([layer.train_flops(features) for layer in chain], dtype=np.float64)


def layer_out_bytes(chain: Sequence[Layer], features: Mapping[str, object]) -> np.ndarray:
    """Bytes a stage sends when a cut falls after each layer of ``chain``, float64.

    Example:
        >>> model = CostModel.build("llama3-8b")
        >>> layer_out_bytes(build_chain(model), explicit_features(model, 4096, {}))[[0, -1]].tolist()
        [33554432.0, 0.0]
    """
    return np.array([float(evaluate(layer.out, features)) for layer in chain])


def group_features(model: CostModel, lengths: LengthsTable, group_of_sample: np.ndarray) -> dict[str, np.ndarray]:
    """Workload features of every group: ``{"<module>.<feature>": (G,) float64}``.

    Args:
        model: the cost model (decides how encoder workloads are read).
        lengths: the lengths table.
        group_of_sample: (N,) group index of each sample, -1 for samples in no group; G is the
            largest index + 1.

    Example:
        >>> from balancer_cli.lengths import make_lengths_table
        >>> lt = make_lengths_table(np.array([100, 200, 300]))
        >>> group_features(CostModel.build("llama3-8b"), lt, np.array([0, 0, 1]))["llm.tokens"].tolist()
        [300.0, 300.0]
    """
    group_of_sample = np.asarray(group_of_sample, dtype=np.int64)
    g = int(group_of_sample.max(initial=-1) + 1)
    placed = group_of_sample >= 0
    feats: dict[str, np.ndarray] = {}
    modules = [(m, model.encoder(m)) for m in lengths.modules] + [(LLM, model.llm)]
    for module, cfg in modules:
        for name, values in zip(("tokens", "sumsq", "side"), module_features(lengths, module, cfg)):
            feats[f"{module}.{name}"] = np.bincount(group_of_sample[placed], weights=values[placed], minlength=g)
    return feats


def mean_features(features: Mapping[str, np.ndarray]) -> dict[str, float]:
    """The mean group's features: the typical group the planners time stages with.

    Example:
        >>> mean_features({"llm.tokens": np.array([1000.0, 3000.0])})
        {'llm.tokens': 2000.0}
    """
    return {k: float(np.mean(v)) for k, v in features.items()}


def sequential_groups(llm_tokens: np.ndarray, ok: np.ndarray, group_llm_tokens: int) -> np.ndarray:
    """Groups of consecutive samples, a new one starting when the next sample would pass
    ``group_llm_tokens`` (a stand-in for a packer when only a lengths table is given).

    Example:
        >>> sequential_groups(np.array([3, 3, 3, 9, 1]), np.ones(5, bool), 6).tolist()
        [0, 0, 1, 2, 3]
    """
    group = np.full(len(llm_tokens), -1, dtype=np.int64)
    current, used = -1, group_llm_tokens  # forces a new group at the first sample
    for i in np.flatnonzero(ok):  # a plain loop: one pass, only over a lengths table
        t = int(llm_tokens[i])
        if used + t > group_llm_tokens and used > 0:
            current, used = current + 1, 0
        group[i] = current
        used += t
    return group


def explicit_features(model: CostModel, llm_tokens: int, items: Mapping[str, int],
                      item_tokens: Mapping[str, int] | None = None) -> dict[str, float]:
    """Features of one group given by hand: the LLM as one sequence of ``llm_tokens``; each
    encoder ``items`` items of ``tokens_per_item`` (or ``item_tokens[m]`` for native-resolution
    encoders).

    Raises:
        ValueError: a native-resolution encoder has items but no ``item_tokens``.

    Example:
        >>> model = CostModel.build("qwen2-7b", {"vision": "internvit-300m"})
        >>> feats = explicit_features(model, 1000, {"vision": 2})   # 2 tiles of 1025 tokens, 256 LLM tokens each
        >>> feats["llm.sumsq"], feats["vision.tokens"], feats["vision.side"]
        (1000000.0, 2050.0, 512.0)
    """
    feats = {f"{LLM}.tokens": float(llm_tokens), f"{LLM}.sumsq": float(llm_tokens) ** 2, f"{LLM}.side": float(llm_tokens)}
    for module, cfg in model.encoders:
        n = float(items.get(module, 0))
        per = cfg.tokens_per_item or (item_tokens or {}).get(module)
        if n and not per:
            raise ValueError(f"{module}: {cfg.name} has no fixed tokens per item; give item tokens")
        per = float(per or 0)
        side = n * (cfg.llm_tokens_per_item if cfg.tokens_per_item else per / cfg.merge)
        feats.update({f"{module}.tokens": n * per, f"{module}.sumsq": n * per * per, f"{module}.side": side})
    return feats
