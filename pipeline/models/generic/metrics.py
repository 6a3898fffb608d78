"""Agreement of a candidate's outputs with the FP32 reference's, per output.

For every output ``o`` (arrays ``[n, ...]``, sample on axis 0, same shape in both):

* ``mean_cosine:o`` / ``min_cosine:o``: cosine similarity of each sample's
  flattened output, candidate vs reference, mean and minimum over samples
  (two all-zero samples count 1, one all-zero sample 0);
* ``max_abs_diff:o``: the largest absolute difference of any element;
* ``rel_l2:o``: ``||cand - ref||_2 / ||ref||_2`` over the whole output
  (0 when both are zero, inf when only the reference is);
* ``top1_agreement:o``, only for outputs that look like class scores (a name
  containing ``logit``, ``score``, ``prob`` or ``class``, float, rank >= 2,
  last axis >= 2): the fraction of positions whose argmax over the last axis
  equals the reference's.

Integer and boolean outputs get ``exact_match:o`` (fraction of equal elements)
and are left out of the float aggregates.

The gateable names are the worst output's value: ``mean_cosine`` and
``min_cosine`` and ``top1_agreement`` the minimum over outputs, ``max_abs_diff``
and ``rel_l2`` the maximum. A candidate with NaN/Inf gets NaN metrics (a gate on
them fails); a non-finite reference is an error.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from pipeline.errors import AccuracyError

_WORST = {"mean_cosine": min, "min_cosine": min, "top1_agreement": min, "max_abs_diff": max, "rel_l2": max}
_CLASS_SCORES = re.compile(r"logit|score|prob|class", re.IGNORECASE)


def looks_like_class_scores(name: str, array: np.ndarray) -> bool:
    """True for a float output of rank >= 2 whose name says it holds class scores
    (``logit``, ``score``, ``prob`` or ``class``) and whose last axis has >= 2 entries."""
    return (np.issubdtype(array.dtype, np.floating) and array.ndim >= 2 and array.shape[-1] >= 2
            and bool(_CLASS_SCORES.search(name)))


def cosines(ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """Per-sample cosine similarity, float64 ``[n]``, of ``[n, ...]`` arrays (flattened per sample)."""
    a = ref.reshape(ref.shape[0] if ref.ndim else 1, -1).astype(np.float64)
    b = cand.reshape(a.shape).astype(np.float64)
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    dot = np.einsum("ij,ij->i", a, b)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = dot / (na * nb)
    cos = np.where((na == 0) & (nb == 0), 1.0, np.where((na == 0) | (nb == 0), 0.0, cos))
    return np.clip(cos, -1.0, 1.0)


def output_agreement(name: str, ref: np.ndarray, cand: np.ndarray) -> dict[str, float]:
    """The metrics of one output (see the module docstring), keyed without the ``:name`` suffix.

    Raises:
        AccuracyError: the shapes differ, or the reference holds NaN/Inf.
    """
    if ref.shape != cand.shape:
        raise AccuracyError(f"validate: output {name!r} has shape {list(cand.shape)} in the candidate and "
                            f"{list(ref.shape)} in the FP32 reference")
    if not np.issubdtype(ref.dtype, np.floating):
        return {"exact_match": float(np.mean(ref == cand)) if ref.size else 1.0}
    if not np.isfinite(ref).all():
        raise AccuracyError(f"validate: the FP32 reference output {name!r} holds NaN/Inf; nothing can be compared")
    if not np.isfinite(cand).all():
        out = {k: math.nan for k in ("mean_cosine", "min_cosine", "max_abs_diff", "rel_l2")}
        return out | ({"top1_agreement": math.nan} if looks_like_class_scores(name, ref) else {})
    cos = cosines(ref, cand)
    diff = cand.astype(np.float64) - ref
    ref_norm, diff_norm = float(np.linalg.norm(ref.astype(np.float64))), float(np.linalg.norm(diff))
    out = {"mean_cosine": float(cos.mean()), "min_cosine": float(cos.min()),
           "max_abs_diff": float(np.abs(diff).max()) if diff.size else 0.0,
           "rel_l2": diff_norm / ref_norm if ref_norm else (0.0 if diff_norm == 0 else math.inf)}
    if looks_like_class_scores(name, ref):
        out["top1_agreement"] = float(np.mean(ref.argmax(-1) == cand.argmax(-1)))
    return out


def _per_sample_top1(ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """Fraction of each sample's positions whose argmax agrees, float64 ``[n]``."""
    same = (ref.argmax(-1) == cand.argmax(-1)).reshape(ref.shape[0], -1)
    return same.mean(axis=1, dtype=np.float64)


#: the gateable means over samples, and each one's per-sample values (ref, cand -> ``[n]``)
_SAMPLE_MEANS = {"mean_cosine": cosines, "top1_agreement": _per_sample_top1}


def _add_stderr(out: dict, metric: str, per_sample: np.ndarray, output: str) -> None:
    """``<metric>_stderr`` (bootstrap over samples, :mod:`pipeline.metrics.uncertainty`) and its
    ``stderr_basis`` record; below 2 samples a ``_stderr_reason`` instead."""
    from pipeline.metrics import uncertainty
    from pipeline.recipe.gates import BASIS_KEY, STDERR_SUFFIX

    n = len(per_sample)
    if n < 2:
        out[f"{metric}{STDERR_SUFFIX}_reason"] = f"one eval sample ({output}) has no spread"
        return
    out[f"{metric}{STDERR_SUFFIX}"] = uncertainty.ratio_of_sums_stderr(per_sample, np.ones(n))
    out.setdefault(BASIS_KEY, {})[metric] = uncertainty.basis(n, "samples", n, f"eval samples of {output}")


def agreement(ref: Mapping[str, np.ndarray], cand: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Per-output metrics (``<metric>:<output>``) and the gateable worst-output ones.

    Args:
        ref / cand: output name -> array ``[n, ...]`` over all eval samples.

    Returns:
        ``{"mean_cosine": ..., "mean_cosine:<output>": ..., ...}``; ``top1_agreement``
        is NaN with a ``top1_agreement_reason`` when no output looks like class scores.
        ``mean_cosine`` and ``top1_agreement`` (means over samples) also get ``<metric>_stderr``
        of their worst output, a paired bootstrap over samples, with ``stderr_basis``.

    Raises:
        AccuracyError: an output is missing from ``cand``, shapes differ, or the reference is non-finite.
    """
    missing = sorted(set(ref) - set(cand))
    if missing:
        raise AccuracyError(f"validate: the candidate returns no output(s) {missing}; it returns {sorted(cand)}")
    out: dict[str, Any] = {}
    per: dict[str, dict[str, float]] = {k: {} for k in _WORST}  # metric -> output -> value
    for name in ref:
        for metric, value in output_agreement(name, ref[name], cand[name]).items():
            out[f"{metric}:{name}"] = value
            per.get(metric, {})[name] = value
    for metric, values in per.items():
        if not values:
            continue
        if any(math.isnan(v) for v in values.values()):
            out[metric] = math.nan
            continue
        worst = _WORST[metric](values, key=lambda n: values[n])
        out[metric] = values[worst]
        if metric in _SAMPLE_MEANS:
            _add_stderr(out, metric, _SAMPLE_MEANS[metric](ref[worst], cand[worst]), worst)
    if not per["top1_agreement"]:
        out["top1_agreement"] = math.nan
        out["top1_agreement_reason"] = ("no output looks like class scores (a float output of rank >= 2 named "
                                        "*logit*, *score*, *prob* or *class*)")
    for metric in ("mean_cosine", "min_cosine", "max_abs_diff", "rel_l2"):
        if metric not in out:
            out[metric] = math.nan
            out[f"{metric}_reason"] = "no float output to compare"
    return out
