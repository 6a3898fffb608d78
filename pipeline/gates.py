"""Accuracy gates: one type (:class:`pipeline.recipe.Gate`), used by ``validate.gates``
and, later, ``quantize.accuracy_budget``.

A gate names a metric that its model kind writes to ``validate/metrics.json`` and
exactly one bound (``max`` or ``min``). This module knows which metrics each kind
produces (:func:`kind_metrics`), checks a gate list against them before any work
(:func:`problems`) and turns measured metrics into verdicts (:func:`evaluate`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipeline.artifacts import GateResult
from pipeline.errors import InternalError

if TYPE_CHECKING:
    from pipeline.recipe import Gate

Loc = tuple[str | int, ...]

_TEXT_GENERATION = frozenset({
    "relative_perplexity_increase",  # (ppl_candidate - ppl_fp32) / ppl_fp32
    "token_agreement",  # greedy tokens equal to FP32's, fraction in [0, 1]
    "prompts_identical",  # prompts whose greedy tokens all equal FP32's (count)
    "mean_common_prefix_tokens",  # greedy tokens before the first difference, mean over prompts
    "perplexity_fp32",  # the reference itself (a floor on the eval data)
    # against FP32 per scored token, as llama.cpp's --kl-divergence (pipeline/metrics/llm_quality.py)
    "perplexity_ratio", "perplexity_ratio_stderr",  # PPL(cand) / PPL(fp32) and its standard error
    "kld_mean", "kld_p50", "kld_p90", "kld_p99", "kld_p999", "kld_max",  # KL(fp32 || cand), nats
    "top1_agreement",  # teacher-forced: same argmax at each scored position, fraction
    "delta_p_rms", "delta_p_p01", "delta_p_p99",  # p_cand - p_fp32 of the correct token
    "speedup_vs_fp32",  # median FP32 / candidate prefill latency in ONNX Runtime (pipeline/metrics/speed.py)
    "quantized_fraction",  # Q/DQ weight GEMMs / all weight GEMMs (validate, from the quantize artifact)
})
_SENTENCE_EMBEDDING = frozenset({
    "spearman_drop_wordsim353", "spearman_drop_simlex999",  # Spearman points (x100) lost vs FP32
    "spearman_drop_max",  # the larger of the two
    "mean_cosine", "min_cosine",  # candidate vs FP32 embeddings of the held-out sentences
})
_IMAGE_CLASSIFICATION = frozenset({
    "top1_accuracy_drop",  # top-1 accuracy points (x100) lost vs FP32, on the labels
    "top1_agreement",  # fraction of inputs whose top-1 class equals FP32's
})

_GENERIC = frozenset({
    "mean_cosine", "min_cosine",  # cosine of candidate vs FP32 outputs (worst output counts)
    "max_abs_diff", "rel_l2",  # largest absolute difference; relative L2 error
    "top1_agreement",  # argmax of class-score outputs equal to FP32's
})

#: allowed shortfall of ``speedup_vs_fp32`` below a gate's ``min`` (timing noise), fraction;
#: how it was measured: :mod:`pipeline.metrics.speed`.
SPEEDUP_MARGIN = 0.10
#: gate metric -> allowed shortfall below a ``min`` bound (timing noise)
NOISE_MARGINS = {"speedup_vs_fp32": SPEEDUP_MARGIN}

#: Model kind -> the metric names its validate stage writes that a gate may name.
#: Old kind names are kept so a recipe is checked the same before and after the rename.
#: (To be replaced by each kind's adapter declaring its metrics; see :func:`kind_metrics`.)
METRICS: dict[str, frozenset[str]] = {
    "text-generation": _TEXT_GENERATION,
    "causal-lm": _TEXT_GENERATION,
    "sentence-embedding": _SENTENCE_EMBEDDING,
    "encoder": _SENTENCE_EMBEDDING,
    "image-classification": _IMAGE_CLASSIFICATION,
    "generic": _GENERIC,
}


def kind_metrics(kind: str) -> frozenset[str]:
    """The metric names a gate may name for model kind ``kind``.

    Raises:
        KeyError: no metric list is known for ``kind`` (the message lists the known kinds).
    """
    try:
        return METRICS[kind]
    except KeyError:
        raise KeyError(f"model kind {kind!r} declares no gate metrics; kinds with metrics: {sorted(METRICS)}") from None


def problems(gates: Sequence[Gate], kind: str, at: Loc) -> list[tuple[Loc, str]]:
    """What is wrong with ``gates`` for a ``kind`` model, as ``(key path, message)``:
    a metric the kind does not produce (naming the valid ones) or two gates with one
    name (their junit test case names must differ). ``at`` is the list's key path,
    e.g. ``("validate", "gates")``; each problem's path adds the gate index.
    """
    try:
        valid = kind_metrics(kind)
    except KeyError as e:
        return [(at, e.args[0])] if gates else []
    out: list[tuple[Loc, str]] = []
    seen: dict[str, int] = {}
    for i, gate in enumerate(gates):
        if gate.metric not in valid:
            out.append(((*at, i, "metric"), f"{gate.metric!r} is not a metric of a {kind} model; "
                        f"valid: {sorted(valid)}"))
        if gate.label in seen:
            out.append(((*at, i), f"gate name {gate.label!r} is also the name of gate {seen[gate.label]}; "
                        "give one of them its own name (name: <text>)"))
        seen.setdefault(gate.label, i)
    return out


def evaluate(gates: Sequence[Gate], metrics: dict, prefix: str = "") -> list[GateResult]:
    """One verdict per gate, on metric ``prefix + gate.metric`` (``engine.`` where a
    TensorRT engine ships and was measured).

    A metric without a finite value (``null`` in ``metrics.json``, with a
    ``<metric>_reason``; NaN; inf) fails its gate and is reported as NaN.

    Args:
        gates: the recipe's gates, in order.
        metrics: metric name -> number or None, as the validate stage writes them.
        prefix: prepended to every gate's metric name.

    A ``min`` gate on a timing metric (:data:`NOISE_MARGINS`: ``speedup_vs_fp32``, "keep
    only if faster") passes at ``value >= min - margin`` (0.10: see
    :mod:`pipeline.metrics.speed`); its result's ``bound`` is that effective bound, so
    the report reads e.g. ``speedup_vs_fp32 = 0.95 (bound >= 0.9)`` for ``min: 1.0``.

    Returns:
        ``GateResult(name, metric, value, bound, op, passed)`` per gate; ``op`` is
        ``"<="`` for a ``max`` bound, ``">="`` for a ``min`` bound.

    Raises:
        InternalError: a gate's metric is missing from ``metrics`` (the recipe check
            refuses gates on metrics the kind does not produce, so this is a bug).
    """
    out = []
    for gate in gates:
        metric = prefix + gate.metric
        if metric not in metrics:
            raise InternalError(f"gate {gate.label!r} needs metric {metric!r}, which was not measured; "
                           f"measured: {sorted(metrics)}")
        raw = metrics[metric]
        value = math.nan if raw is None else float(raw)
        if gate.max is not None:
            op, bound, passed = "<=", gate.max, value <= gate.max
        else:
            assert gate.min is not None  # the schema requires exactly one bound
            bound = gate.min - NOISE_MARGINS.get(gate.metric, 0.0)  # documented noise margin (speedup)
            op, passed = ">=", value >= bound
        out.append(GateResult(gate.label, metric, value, float(bound), op, bool(passed and math.isfinite(value))))
    return out
