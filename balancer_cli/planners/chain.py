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

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from balancer_cli.cost import flops as F
from balancer_cli.cost.samples import CostModel, module_features
from balancer_cli.lengths import LLM, LengthsTable

__all__ = ["Form", "Layer", "build_chain", "evaluate", "group_features", "features_at", "sequential_groups",
           "explicit_features"]

#: A linear form: ``((feature, coefficient), ...)``.
Form = tuple


def evaluate(form: Form, features: Mapping[str, object]):
    """Value of a linear form on features (scalars or (G,) arrays; a missing feature counts 0)."""
    total = 0.0
    for key, coef in form:
        if coef:
            total = total + coef * np.asarray(features.get(key, 0.0), dtype=np.float64)
    return total


@dataclass(frozen=True)
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
        return self.kind == "layer"

    def train_flops(self, features: Mapping[str, object]):
        """Forward + backward FLOPs (backward = 2 x forward, [N21] in :mod:`balancer_cli.cost.flops`)."""
        return (1.0 + F.BACKWARD_FACTOR) * evaluate(self.fwd, features)


def build_chain(model: CostModel) -> list[Layer]:
    """The MLLM's layers in pipeline order: per encoder stem, layers, projector; LLM embedding,
    layers, head. Per-GPU numbers (tensor parallel ``model.tp`` with sequence parallelism)."""
    tp, attn, drop = model.tp, model.attention, model.dropout
    chain: list[Layer] = []
    carried: Form = ()  # projected outputs of earlier encoders travel with later cuts
    llm = model.llm
    for module, enc in model.encoders:
        tok, sq, side = f"{module}.tokens", f"{module}.sumsq", f"{module}.side"
        hidden_out = ((tok, F.BYTES * enc.hidden_size / tp),) + carried
        stem_act = ((tok, F.stem_activation_bytes_per_token(enc) / tp),)
        chain.append(Layer(f"{module}.stem", module, "stem", F.stem_params(enc) / tp,
                           ((tok, F.stem_flops_per_token(enc) / tp),), (stem_act,) * 3, ((), (), ()), hidden_out))
        chain += _layers(module, enc, tok, sq, hidden_out, attn, drop, tp)
        proj_act = ((side, F.projector_activation_bytes_per_token(enc, llm) / tp),)
        carried = carried + ((side, F.BYTES * llm.hidden_size / tp),)
        chain.append(Layer(f"{module}.projector", module, "projector", F.projector_params(enc, llm) / tp,
                           ((side, F.projector_flops_per_token(enc, llm) / tp),), (proj_act,) * 3, ((), (), ()), carried))
    tok, sq = f"{LLM}.tokens", f"{LLM}.sumsq"
    hidden_out = ((tok, F.BYTES * llm.hidden_size / tp),)
    chain.append(Layer(f"{LLM}.embedding", LLM, "embedding", F.embedding_params(llm) / tp, (), ((), (), ()),
                       ((), (), ()), hidden_out))
    chain += _layers(LLM, llm, tok, sq, hidden_out, attn, drop, tp)
    head_act = ((tok, F.head_activation_bytes_per_token(llm, tp)),)
    chain.append(Layer(f"{LLM}.head", LLM, "head", F.head_params(llm) / tp, ((tok, F.head_flops_per_token(llm, tp)),),
                       (head_act,) * 3, ((), (), ()), ()))
    return chain


def _layers(module, cfg, tok, sq, out, attn, drop, tp) -> list[Layer]:
    acts = tuple(F.layer_activation_bytes(cfg, mode, attention=attn, dropout=drop, tp=tp) for mode in F.RECOMPUTE_MODES)
    act_forms = tuple(((tok, a.per_token), (sq, a.per_sumsq)) for a in acts)
    extras = tuple(((tok, t), (sq, s)) for t, s in (F.recompute_flops(cfg, mode, attention=attn, tp=tp)
                                                     for mode in F.RECOMPUTE_MODES))
    per_token, per_sumsq = F.layer_flops(cfg, tp)
    fwd = ((tok, per_token), (sq, per_sumsq))
    params = F.layer_params(cfg) / tp
    return [Layer(f"{module}.layer.{i}", module, "layer", params, fwd, act_forms, extras, out)
            for i in range(cfg.num_layers)]


def group_features(model: CostModel, lengths: LengthsTable, group_of_sample: np.ndarray,
                   num_groups: int | None = None) -> dict[str, np.ndarray]:
    """Workload features of every group: ``{"<module>.<feature>": (G,) float64}``.

    Args:
        model: the cost model (decides how encoder workloads are read).
        lengths: the lengths table.
        group_of_sample: (N,) group index of each sample, -1 for samples in no group.
        num_groups: G (default: max index + 1).
    """
    group_of_sample = np.asarray(group_of_sample, dtype=np.int64)
    g = int(num_groups if num_groups is not None else group_of_sample.max(initial=-1) + 1)
    placed = group_of_sample >= 0
    feats: dict[str, np.ndarray] = {}
    modules = [(m, model.encoder(m)) for m in lengths.modules] + [(LLM, model.llm)]
    for module, cfg in modules:
        for name, values in zip(("tokens", "sumsq", "side"), module_features(lengths, module, cfg)):
            feats[f"{module}.{name}"] = np.bincount(group_of_sample[placed], weights=values[placed], minlength=g)
    return feats


def features_at(features: Mapping[str, np.ndarray], index) -> dict[str, float]:
    """One group's features (``index`` an int) or the mean group's (``index="mean"``)."""
    if index == "mean":
        return {k: float(np.mean(v)) for k, v in features.items()}
    return {k: float(v[index]) for k, v in features.items()}


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
    encoders)."""
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
