"""The fold-point scale search: per-channel scales ``s`` for one fold point, chosen on calibration
activations by the output error of the quantized GEMMs that read it.

A fold point (:mod:`pipeline.quant.fold_points`) is an activation ``X`` (``[N, C]`` rows, float32)
read by one or more weight GEMMs ``W_k`` (``[C, out_k]``), whose producer can absorb ``1 / s``
while each ``W_k`` absorbs ``s`` (``X W = (X / s) (diag(s) W)``: the FP32 graph is unchanged). What
changes is what the quantizer sees. This module picks ``s`` by a grid search over one exponent
``alpha``, minimising the block output error::

    loss(s) = sum_k || X W_k - Qa(X / s) Qw(diag(s) W_k) ||_F^2

(``Qw``: the weight quantizer, fake-quantized in float32; ``Qa``: the activation quantizer, identity
for weight-only precisions). Candidates, for ``alpha`` in :data:`GRID`:

* ``family="awq"``: ``s_j = mean_n |X_nj| ** alpha`` (AWQ: Lin et al., "AWQ: Activation-aware Weight
  Quantization for On-Device LLM Compression and Acceleration", MLSys 2024, eq. 5). ``alpha = 0`` is
  ``s = 1``, no scaling.
* ``family="smoothquant"``: ``s_j = max_n |X_nj| ** alpha / max_k max_o |W_k[j, o]| ** (1 - alpha)``
  (Xiao et al., "SmoothQuant", ICML 2023, eq. 4), each alpha searched rather than one fixed.

Every candidate is normalised to ``s / sqrt(max(s) min(s))`` (as AWQ's reference code does: the
loss of an absmax quantizer does not change under a common factor, the float range does). The
no-scaling baseline ``s = 1`` is always a candidate (``alpha = None`` where it is not a grid point),
so the result is never worse than not folding on the search's own rows. Ties go to the smaller
alpha (no scaling before any alpha). The search is deterministic: its inputs are fixed rows (the
caller samples them with a fixed seed, :func:`pipeline.quant.calibrate.collect_rows`), numpy's
float32 GEMMs in a fixed order, no randomness.

``groups`` ties channels to one scale: under grouped-query attention the value projection's output
channel ``j`` (of a KV head) feeds ``o_proj``'s input channel ``h * head_dim + d`` of every query head
``h`` of its group, so ``o_proj``'s ``C = heads * head_dim`` input channels map onto the fold site's
``G = kv_heads * head_dim`` channels; the statistics are pooled per site channel (mean of the means,
max of the maxima) and the scale of site channel ``g`` multiplies every GEMM row ``c`` with
``groups[c] == g``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pipeline.errors import QuantizationError

#: the exponents tried: 0, 0.05, ..., 1 (AWQ's reference grid has 20 points over [0, 1))
GRID: tuple[float, ...] = tuple(round(i / 20, 2) for i in range(21))
FAMILIES = ("awq", "smoothquant")
#: floor on statistics and scales, so a dead channel never divides by zero
_EPS = 1e-5

#: ``w [C, out] float32 -> fake-quantized w``, same shape and dtype
WeightQuantizer = Callable[[np.ndarray], np.ndarray]
#: ``x [N, C] float32 -> fake-quantized x`` (W8A8); None for weight-only
ActQuantizer = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class ScaleSearch:
    """The result of :func:`search` for one fold point.

    Attributes:
        scales: float32 ``[G]`` per fold-site channel, > 0 (all 1 when no scaling won).
        groups: int64 ``[C]``: the site channel of each GEMM input row (``arange(C)`` without tying).
        alpha: the winning exponent; None when the no-scaling baseline won and is not a grid point
            (the smoothquant family; for awq ``alpha = 0`` is the baseline).
        loss: the block output error of the winner (sum of squares, float64).
        baseline: the block output error without scaling (``s = 1``).
        losses: alpha -> loss of every grid candidate.
        family: ``"awq"`` or ``"smoothquant"``.
    """

    scales: np.ndarray
    groups: np.ndarray
    alpha: float | None
    loss: float
    baseline: float
    family: str
    losses: dict[float, float] = field(default_factory=dict)

    @property
    def row_scales(self) -> np.ndarray:
        """float32 ``[C]``: the scale each GEMM input row is multiplied by (``scales[groups]``)."""
        return self.scales[self.groups]

    @property
    def scaled(self) -> bool:
        """Whether folding changes anything (some scale differs from 1)."""
        return bool(np.any(self.scales != 1.0))

    def summary(self) -> dict:
        """JSON-ready: alpha, loss, baseline, their ratio and the scale range."""
        return {"family": self.family, "alpha": self.alpha, "loss": self.loss, "baseline": self.baseline,
                "loss_vs_baseline": self.loss / self.baseline if self.baseline > 0 else 1.0,
                "scale_range": [float(self.scales.min()), float(self.scales.max())]}


def block_output_error(x: np.ndarray, weights: Sequence[np.ndarray], row_scales: np.ndarray | None,
                       quantize_weight: WeightQuantizer, quantize_act: ActQuantizer | None = None,
                       reference: Sequence[np.ndarray] | None = None) -> float:
    """``sum_k || X W_k - Qa(X / s) Qw(diag(s) W_k) ||_F^2`` (float64).

    Args:
        x: float32 ``[N, C]`` activation rows.
        weights: float32 ``[C, out_k]`` weights reading ``x``.
        row_scales: float32 ``[C]`` (``s``), or None for ``s = 1``.
        quantize_weight / quantize_act: the fake quantizers (module notes).
        reference: the ``X W_k`` products when already computed (same order as ``weights``).
    """
    xs = x if row_scales is None else x / row_scales[None, :]
    xq = quantize_act(xs) if quantize_act is not None else xs
    total = 0.0
    for i, w in enumerate(weights):
        ws = w if row_scales is None else w * row_scales[:, None]
        ref = reference[i] if reference is not None else x @ w
        diff = ref - xq @ quantize_weight(ws)
        total += float(np.einsum("ij,ij->", diff, diff, dtype=np.float64))
    return total


def candidate_scales(x: np.ndarray, weights: Sequence[np.ndarray], alpha: float, family: str,
                     groups: np.ndarray) -> np.ndarray:
    """float32 ``[G]``: the normalised candidate for one ``alpha`` (module notes), ``G = groups.max() + 1``.

    Raises:
        QuantizationError: an unknown family or alpha outside [0, 1].
    """
    if family not in FAMILIES:
        raise QuantizationError(f"fold-point scale search: family {family!r}; valid: {', '.join(FAMILIES)}")
    if not 0.0 <= alpha <= 1.0:
        raise QuantizationError(f"fold-point scale search: alpha {alpha} is outside [0, 1]")
    g = int(groups.max()) + 1
    absx = np.abs(x)
    if family == "awq":
        per_row = absx.mean(axis=0, dtype=np.float64)
        stat = np.bincount(groups, weights=per_row, minlength=g) / np.bincount(groups, minlength=g)
        s = np.maximum(stat, _EPS) ** alpha
    else:
        xmax = np.zeros(g)
        np.maximum.at(xmax, groups, absx.max(axis=0).astype(np.float64))
        wmax = np.zeros(g)
        np.maximum.at(wmax, groups, np.max([np.abs(w).max(axis=1) for w in weights], axis=0).astype(np.float64))
        s = np.maximum(xmax, _EPS) ** alpha / np.maximum(wmax, _EPS) ** (1.0 - alpha)
    s = s / np.sqrt(s.max() * s.min())
    return np.clip(s, _EPS, 1.0 / _EPS).astype(np.float32)


def search(x: np.ndarray, weights: Sequence[np.ndarray], quantize_weight: WeightQuantizer,
           quantize_act: ActQuantizer | None = None, *, family: str = "awq", grid: Sequence[float] = GRID,
           groups: np.ndarray | None = None) -> ScaleSearch:
    """Grid-search the fold point's per-channel scales (module notes: loss, candidates, ties).

    Args:
        x: float32 ``[N, C]`` calibration rows of the activation the GEMMs read (N >= 1).
        weights: float32 ``[C, out_k]``, every weight GEMM reading ``x`` (``X @ W_k``).
        quantize_weight: fake weight quantizer, e.g. INT4 blocks along ``C``
            (:func:`pipeline.quant.int4.fake_quantize`).
        quantize_act: fake activation quantizer (W8A8), or None (weight-only).
        family: ``"awq"`` (mean |X| ** alpha) or ``"smoothquant"`` (max |X| ** alpha / max |W| ** (1 - alpha)).
        grid: the exponents tried, each in [0, 1].
        groups: int ``[C]`` site channel of each row (channels tied to one scale, e.g. GQA); None:
            one scale per channel.

    Returns:
        The :class:`ScaleSearch`; ``scales`` all 1 when no candidate beats the baseline.

    Raises:
        QuantizationError: shapes that do not fit (names them), no rows, non-finite activations,
            an unknown family or an alpha outside [0, 1].
    """
    x = np.ascontiguousarray(x, np.float32)
    if x.ndim != 2 or x.shape[0] == 0:
        raise QuantizationError(f"fold-point scale search: activations {x.shape} are not [N >= 1, C] rows")
    c = x.shape[1]
    bad = [tuple(w.shape) for w in weights if w.ndim != 2 or w.shape[0] != c]
    if not weights or bad:
        raise QuantizationError(f"fold-point scale search: weights {bad or 'none'} do not have the {c} input rows "
                                "of the activation")
    if not np.isfinite(x).all():
        raise QuantizationError("fold-point scale search: the activation rows hold NaN or infinite values")
    groups = np.arange(c, dtype=np.int64) if groups is None else np.asarray(groups, np.int64)
    if groups.shape != (c,) or groups.min() < 0 or set(np.unique(groups)) != set(range(int(groups.max()) + 1)):
        raise QuantizationError(f"fold-point scale search: groups must map the {c} channels onto 0..G-1, each used")
    weights = [np.ascontiguousarray(w, np.float32) for w in weights]
    reference = [x @ w for w in weights]
    baseline = block_output_error(x, weights, None, quantize_weight, quantize_act, reference)
    g = int(groups.max()) + 1
    best = (baseline, 0.0 if family == "awq" else None, np.ones(g, np.float32))
    losses: dict[float, float] = {}
    for alpha in sorted(grid):
        if family == "awq" and alpha == 0.0:
            losses[alpha] = baseline
            continue
        s = candidate_scales(x, weights, alpha, family, groups)
        losses[alpha] = block_output_error(x, weights, s[groups], quantize_weight, quantize_act, reference)
        if losses[alpha] < best[0]:  # strictly: a tie keeps the smaller alpha (or no scaling)
            best = (losses[alpha], alpha, s)
    return ScaleSearch(scales=best[2], groups=groups, alpha=best[1], loss=best[0], baseline=baseline,
                       family=family, losses=losses)
