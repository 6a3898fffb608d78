"""The clip search for 8-bit Q/DQ: a per-tensor amax chosen by the loss of quantizing to the
target format, in place of the max (one implementation for activations and weights).

:mod:`pipeline.quant.calibrate` runs it on calibration histograms (methods ``mse``, ``kl``);
:func:`pipeline.quant.qdq.quantize_weight` on each weight (recipe ``quantize.weight_clip``). It reads
only a format's ``name``, ``np_type`` and ``qmax`` (:class:`pipeline.quant.qdq.QFormat`).
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from pipeline.errors import QuantizationError

#: histogram bins of a weight's |w| (as calibration's, pipeline.quant.calibrate.NUM_BINS)
BINS = 2048


class Grid(Protocol):
    """What the search reads of a format (:class:`pipeline.quant.qdq.QFormat`)."""

    name: str
    np_type: type
    qmax: float


#: losses of the clip search (:func:`clip_amax`): ``mse`` expected squared error, ``kl`` KL divergence
CLIP_LOSSES = ("mse", "kl")
#: the clip search keeps the largest amax whose loss is within this fraction of the best one:
#: a tensor whose clipping gains less keeps its max (ties never depend on the last float bits)
CLIP_TIE = 0.01


def clip_amax(hist: np.ndarray, edges: np.ndarray, fmt: Grid, loss: str = "mse", candidates: int = 128) -> float:
    """The clip search: the amax that minimises ``loss`` of quantizing |x| to ``fmt``, over a histogram.

    Each of ``candidates`` amax values, ``k / candidates`` of the histogram's top (the upper edge
    of its last non-empty bin, i.e. the max), clips at amax and rounds to the format's grid
    (:func:`fake_quant`: E4M3 for FP8, integers for INT8) every bin centre:

    * ``mse``: the expected squared error ``sum_b n_b (c_b - q(c_b))^2``;
    * ``kl``: ``KL(P || Q)`` of the bins up to amax: P the histogram with the clipped mass in
      its last bin, Q the unclipped bins' mass spread evenly over the non-empty bins that round
      to one grid point (TensorRT's entropy calibration, Migacz, "8-bit Inference with
      TensorRT", GTC 2017, on the format's own grid, so FP8's uneven one too).

    The largest candidate within :data:`CLIP_TIE` of the best loss wins: a tensor without
    outliers keeps its max. Used for activations (``quantize.calibration.method`` ``mse`` / ``kl``,
    on the calibration histograms) and weights (``quantize.weight_clip``, :func:`weight_clip_ratio`).

    Args:
        hist: counts ``[bins]`` of |x| (or the symmetric histogram of x: ``|centres|`` are used).
        edges: float ``[bins + 1]`` bin edges.
        fmt: the target format (its ``qmax``).
        loss: one of :data:`CLIP_LOSSES`.

    Returns:
        amax (float, > 0 when any count is).

    Raises:
        QuantizationError: an unknown loss.
    """
    if loss not in CLIP_LOSSES:
        raise QuantizationError(f"clip search: loss {loss!r}: expected one of {list(CLIP_LOSSES)}")
    centers = np.abs((edges[:-1] + edges[1:]) / 2).astype(np.float64)
    weights = hist.astype(np.float64)
    nz = weights > 0
    if not nz.any():
        return float(np.abs(edges).max())
    upper = np.maximum(np.abs(edges[:-1]), np.abs(edges[1:])).astype(np.float64)
    top = float(upper[nz].max())
    amaxes = top * np.arange(1, candidates + 1) / candidates
    errs = np.array([_clip_loss(centers, weights, nz, a, fmt, loss) for a in amaxes])
    ok = np.flatnonzero(errs <= errs.min() + CLIP_TIE * abs(errs.min()) + 1e-300)
    return float(amaxes[ok.max()])


def _clip_loss(centers: np.ndarray, weights: np.ndarray, nz: np.ndarray, amax: float, fmt: Grid,
               loss: str) -> float:
    q = fake_quant(centers, amax, fmt)
    if loss == "mse":
        return float(np.sum(weights * (centers - q) ** 2))
    inside = centers <= amax
    last = int(np.flatnonzero(inside).max()) if inside.any() else 0
    p = np.where(inside, weights, 0.0)
    p[last] += weights[~inside].sum()  # clipped values land at amax: P holds them in its last bin
    cand = np.where(inside, weights, 0.0)  # Q: the unclipped bins, each grid point's mass spread evenly
    keep = cand > 0
    _, level = np.unique(q[keep], return_inverse=True)
    qd = np.zeros_like(p)
    qd[keep] = (np.bincount(level, weights=cand[keep]) / np.bincount(level))[level]
    p, qd = p / p.sum(), qd / max(qd.sum(), 1e-300)
    on = p > 0
    return float(np.sum(p[on] * np.log(p[on] / np.maximum(qd[on], 1e-12))))


def weight_clip_ratio(w: np.ndarray, fmt: Grid, loss: str, axis: int | None = None) -> float:
    """The clip ratio (amax / max, in (0, 1]) of a weight under :func:`clip_amax`.

    Per tensor (``axis`` None): the search on the histogram of |w|. Per channel: on the histogram
    of ``|w| / amax_channel`` (every channel's values on one scale), so one ratio clips every channel.

    Args:
        w: float32 weight, any shape; ``axis``: its output-channel axis for per-channel scales.
        fmt: the weights' format (``QFormat.weights()``); loss: one of :data:`CLIP_LOSSES`.
    """
    a = np.abs(w.astype(np.float64))
    if axis is not None:
        reduce = tuple(i for i in range(w.ndim) if i != axis)
        cmax = a.max(axis=reduce, keepdims=True)
        a = a / np.where(cmax > 0, cmax, 1.0)
    top = float(a.max())
    if top <= 0:
        return 1.0
    hist, edges = np.histogram(a, bins=BINS, range=(0.0, top))
    return min(1.0, clip_amax(hist, edges, fmt, loss) / top)


def fake_quant(x: np.ndarray, amax: float, fmt: Grid) -> np.ndarray:
    """``x`` clipped at ``amax`` and rounded to the format's grid (INT8: integers; FP8: E4M3
    values), float64, the Q/DQ pair's values."""
    scale = amax / fmt.qmax
    y = np.clip(x / scale, -fmt.qmax, fmt.qmax)
    y = np.round(y) if fmt.np_type is np.int8 else y.astype(fmt.np_type).astype(np.float64)
    return y * scale
