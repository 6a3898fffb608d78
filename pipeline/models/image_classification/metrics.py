"""Classification metrics of a candidate against the FP32 reference and the labels.

Names (``validate/metrics.json`` and gates): ``top1_accuracy_fp32`` and
``top1_accuracy_candidate`` (fractions of samples whose argmax is the label),
``top1_accuracy_drop`` (reference minus candidate accuracy, in percentage
points: positive = the candidate is worse), ``top1_agreement`` (fraction of
samples where candidate argmax == reference argmax) and ``samples``.
"""
from __future__ import annotations

import numpy as np

METRICS = ("top1_accuracy_fp32", "top1_accuracy_candidate", "top1_accuracy_drop", "top1_agreement", "samples")


def top1(scores: np.ndarray) -> np.ndarray:
    """Argmax class per row of ``scores`` float ``[n, classes]`` -> int64 ``[n]``.

    Raises:
        ValueError: ``scores`` is not 2-D or has no rows.
    """
    scores = np.asarray(scores)
    if scores.ndim != 2 or scores.shape[0] == 0:
        raise ValueError(f"scores of shape {scores.shape}: valid: [n >= 1, classes]")
    return scores.argmax(axis=1).astype(np.int64)


def accuracy(scores: np.ndarray, labels: np.ndarray) -> float:
    """Fraction (0..1) of rows whose argmax equals the label (int ``[n]``).

    Raises:
        ValueError: shapes disagree, or a label is outside ``[0, classes)``.
    """
    labels = np.asarray(labels, np.int64).reshape(-1)
    pred = top1(scores)
    if labels.shape != pred.shape:
        raise ValueError(f"{pred.shape[0]} score rows but {labels.shape[0]} labels")
    if labels.min() < 0 or labels.max() >= scores.shape[1]:
        raise ValueError(f"labels span [{labels.min()}, {labels.max()}]; valid: [0, {scores.shape[1] - 1}]")
    return float((pred == labels).mean())


def compare(reference: np.ndarray, candidate: np.ndarray, labels: np.ndarray) -> dict:
    """Every metric of :data:`METRICS` for reference and candidate scores
    (float ``[n, classes]`` each, same order as ``labels`` int ``[n]``), and the gate
    metrics' standard errors (:func:`stderrs`).

    Raises:
        ValueError: the shapes disagree (see :func:`accuracy`).
    """
    reference, candidate = np.asarray(reference), np.asarray(candidate)
    if reference.shape != candidate.shape:
        raise ValueError(f"reference scores {reference.shape} and candidate scores {candidate.shape} differ in shape")
    ref_acc, cand_acc = accuracy(reference, labels), accuracy(candidate, labels)
    labels = np.asarray(labels, np.int64).reshape(-1)
    per_image = {"top1_accuracy_drop": 100.0 * ((top1(reference) == labels).astype(np.float64)
                                                - (top1(candidate) == labels)),
                 "top1_agreement": (top1(reference) == top1(candidate)).astype(np.float64)}
    return {
        "top1_accuracy_fp32": ref_acc,
        "top1_accuracy_candidate": cand_acc,
        "top1_accuracy_drop": 100.0 * (ref_acc - cand_acc),
        "top1_agreement": float(per_image["top1_agreement"].mean()),
        "samples": int(reference.shape[0]),
        **stderrs(per_image),
    }


def stderrs(per_image: dict[str, np.ndarray]) -> dict:
    """``<metric>_stderr`` of each gate metric, a paired bootstrap over images
    (:mod:`pipeline.metrics.uncertainty`: the reference and candidate of one image are
    resampled together), and their ``stderr_basis``; fewer than 2 images: a reason instead."""
    from pipeline.metrics import uncertainty
    from pipeline.recipe.gates import BASIS_KEY, STDERR_SUFFIX

    n = len(next(iter(per_image.values())))
    if n < 2:
        return {f"{m}{STDERR_SUFFIX}_reason": "one eval image has no spread" for m in per_image}
    ones, counts = np.ones(n), uncertainty.resample_counts(n)
    out: dict = {f"{m}{STDERR_SUFFIX}": uncertainty.ratio_of_sums_stderr(v, ones, counts=counts)
                 for m, v in per_image.items()}
    out[BASIS_KEY] = {m: uncertainty.basis(n, "images", n, "eval images") for m in per_image}
    return out
