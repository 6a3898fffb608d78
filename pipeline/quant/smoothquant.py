"""SmoothQuant on the ONNX graph: move activation outliers into the weights.

Xiao et al. 2023, "SmoothQuant: Accurate and Efficient Post-Training
Quantization for Large Language Models" (ICML 2023). For each input channel j
of a weight GEMM ``Y = X W`` (``W`` ``[in, out]``)::

    s_j = max|X_j| ** alpha / max|W_j,:| ** (1 - alpha)
    Y = (X / s) (diag(s) W)

``X / s`` is folded into the op that produces ``X``, so the FP32 graph computes
the same function:

* an RMSNorm / LayerNorm scale: ``Mul(normalized, gamma[C])`` -> ``gamma / s``;
* the previous linear layer through an elementwise product: ``down_proj``'s input
  is ``SiLU(gate) * up``, linear in ``up``'s output channels, so ``W_up[:, j] / s_j``.

GEMMs that share one input (q/k/v after the attention norm, gate/up after the
MLP norm) share one ``s``: the weight maximum is taken over all of them. The fold
points and the folding are :mod:`pipeline.quant.fold_points`' (shared with the AWQ
scale search, :mod:`pipeline.quant.fold_search`). ``o_proj``'s input (v -> o, folded
into ``v_proj``'s output channels) is a fold point there, but this step leaves it out
by default (``smooth(kinds=...)``), as it always has, so recipes quantize as before;
an input produced by anything else is left unsmoothed and reported.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from pipeline.errors import QuantizationError
from pipeline.quant.qdq import Target

#: lower bound on amax and on s, so a dead channel cannot divide by zero
_EPS = 1e-5


@dataclass
class SmoothReport:
    """What :func:`smooth` did: activation tensor -> how it was folded."""

    folded: dict[str, str] = field(default_factory=dict)  # act -> "norm:<init>" or "linear:<node>"
    skipped: dict[str, str] = field(default_factory=dict)  # act -> reason
    scales: dict[str, np.ndarray] = field(default_factory=dict)  # act -> s [C]

    def summary(self) -> dict:
        """JSON-ready: counts, the skipped activations with reasons, and s's range per folded input."""
        return {"smoothed_inputs": len(self.folded), "skipped_inputs": dict(self.skipped),
                "folded_into": dict(self.folded),
                "scale_range": {a: [float(s.min()), float(s.max())] for a, s in self.scales.items()}}


def smoothing_scales(act_amax: np.ndarray, weights: list[np.ndarray], alpha: float) -> np.ndarray:
    """``s_j = max|X_j|^alpha / max|W_j|^(1-alpha)`` for one shared input.

    Args:
        act_amax: float ``[C]`` per-channel abs-max of the input over calibration data.
        weights: float32 ``[C, out_k]`` weights of every GEMM reading that input
            (the maximum over all of them is used).
        alpha: migration strength in [0, 1]; 0 leaves activations, 1 moves everything to weights.

    Returns:
        float32 ``[C]``, strictly positive and finite.

    Raises:
        QuantizationError: alpha outside [0, 1], or a weight whose rows differ from ``C``.
    """
    if not 0.0 <= alpha <= 1.0:
        raise QuantizationError(f"quantize.smoothquant.alpha: {alpha} is outside [0, 1]")
    c = act_amax.shape[0]
    bad = [w.shape for w in weights if w.ndim != 2 or w.shape[0] != c]
    if bad:
        raise QuantizationError(f"smoothquant: weights {bad} do not have {c} input rows")
    w_amax = np.max([np.abs(w).max(axis=1) for w in weights], axis=0)
    s = np.maximum(act_amax, _EPS) ** alpha / np.maximum(w_amax, _EPS) ** (1.0 - alpha)
    return np.clip(s, _EPS, 1.0 / _EPS).astype(np.float32)


def smooth(model: onnx.ModelProto, targets: list[Target], act_amax: dict[str, np.ndarray],
           alpha: float, kinds: tuple[str, ...] = ("norm", "linear")) -> SmoothReport:
    """Apply SmoothQuant in place to ``model`` (weights loaded) for the MatMul ``targets``.

    The fold points and the folding are :mod:`pipeline.quant.fold_points`' (one implementation
    with the AWQ search). Modified tensors get new initializers (``<name>_smooth<k>``), so a weight
    or norm scale shared by other nodes is never changed under them.

    Args:
        model: FP32 graph with its initializers loaded.
        targets: weight GEMMs (:func:`pipeline.quant.qdq.find_targets`); only MatMul
            targets with ``[in, out]`` weights (axis 1) are smoothed.
        act_amax: per-channel abs-max ``[C]`` of each target's input
            (:func:`pipeline.quant.calibrate.collect_channel_amax`).
        alpha: migration strength, ``quantize.smoothquant.alpha``.
        kinds: the fold kinds used (:data:`pipeline.quant.fold_points.KINDS`); the default leaves
            v -> o out, as this step always has (``"attention"`` adds it: a KV channel's scale is
            taken from the largest amax and weight row of the o_proj input rows it feeds).

    Returns:
        The :class:`SmoothReport`.

    Raises:
        QuantizationError: an input lacks per-channel statistics, or alpha is invalid.
    """
    from pipeline.quant import fold_points

    names = {t.node: t for t in targets}
    missing = [t for t in targets if t.act not in act_amax]
    if missing:
        raise QuantizationError(f"smoothquant: input {missing[0].act!r} of {missing[0].node!r} has no per-channel "
                                "statistics")
    points, skipped = fold_points.find(model, targets, kinds)
    report = SmoothReport(skipped=dict(skipped))
    for k, point in enumerate(points):
        amax = np.zeros(point.channels)
        np.maximum.at(amax, point.groups, np.asarray(act_amax[point.act], np.float64))
        weights = [fold_points.current_weight(model, names[t.node]) for t in point.gemms]
        if point.channels != len(point.groups):  # tied rows: a site channel takes its rows' maximum
            tied = np.zeros((point.channels, 1))
            np.maximum.at(tied[:, 0], point.groups, np.max([np.abs(w).max(axis=1) for w in weights], axis=0))
            weights = [tied]
        s = smoothing_scales(amax, weights, alpha)
        fold_points.apply(model, point, s, f"smooth{k}")
        report.folded[point.act] = point.describe()
        report.scales[point.act] = s
    return report


#: calibration rows (token positions) sampled per fold point for ``mode: search``
SEARCH_ROWS = 1024


def w8a8_quantizers(fmt, per_channel: bool):
    """The W8A8 fake quantizers of the fold-point search (:func:`pipeline.quant.fold_search.search`):
    ``(weights [C, out] -> float32, activations [N, C] -> float32)``. Weights as the Q/DQ graph
    stores them (:func:`pipeline.quant.qdq.quantize_weight`, per tensor or per output channel, amax
    = max); activations per tensor with amax = the rows' own max (calibration method ``max``),
    rounded to the format's grid (E4M3 or INT8)."""
    from dataclasses import replace

    from pipeline.quant import clip, qdq

    wfmt = replace(fmt, weight_clip="max").weights()

    def weight(w: np.ndarray) -> np.ndarray:
        return qdq.dequantized(*qdq.quantize_weight(w, wfmt, 1 if per_channel else None)[:2],
                               1 if per_channel else None)

    def act(x: np.ndarray) -> np.ndarray:
        amax = float(np.abs(x).max())
        return clip.fake_quant(x, amax if amax > 0 else 1.0, fmt).astype(np.float32)

    return weight, act


def search_and_fold(model: onnx.ModelProto, targets: list[Target], batches: list[dict[str, np.ndarray]], fmt,
                    per_channel: bool, *, rows: int = SEARCH_ROWS, scales: dict[str, np.ndarray] | None = None,
                    progress=None) -> tuple[dict, dict[str, np.ndarray]]:
    """``quantize.smoothquant.mode: search``: at every fold point (all four kinds, v -> o with one
    scale per KV channel under GQA), per-channel scales searched by the one fold-point search
    (:func:`pipeline.quant.fold_search.search`, SmoothQuant's family: one alpha per fold point, the
    no-scaling baseline always a candidate) against the block output error of the W8A8 quantizer
    (:func:`w8a8_quantizers`), then folded (:func:`pipeline.quant.fold_points.apply`). Points are
    searched and folded in graph order, each on the weights the earlier folds left (a site such as
    ``up_proj`` is also a GEMM of another point); the activation rows are the FP32 graph's (the
    folds before a point never change its input, only its own does).

    Args:
        model: FP32 graph, weights loaded (modified in place).
        targets: the weight GEMMs to quantize; a fold point whose GEMMs are not all among them is left.
        batches: calibration feeds (rows are sampled with a fixed seed, :func:`pipeline.quant.calibrate.collect_rows`).
        fmt: the Q/DQ format (:func:`pipeline.quant.qdq.quant_format`); per_channel: the recipe's weights.
        scales: pinned site scales by activation (the pin's ``channel_amax`` in this mode): folded
            as given, nothing searched.

    Returns:
        ``(report, site scales by activation, float32 [G])``.

    Raises:
        QuantizationError: pinned scales that do not fit a fold point (or one missing).
    """
    import contextlib

    from pipeline.quant import calibrate, fold_points, fold_search

    step = progress.step if progress is not None else (lambda _text: contextlib.nullcontext())
    wanted = {t.node for t in targets}
    points, skipped = fold_points.find(model, targets)
    points = [p for p in points if {t.node for t in p.gemms} <= wanted]
    by_node = {t.node: t for t in targets}
    qw, qa = w8a8_quantizers(fmt, per_channel)
    found: dict[str, np.ndarray] = {}
    report: dict = {"mode": "search", "rows": rows, "grid": list(fold_search.GRID), "family": "smoothquant",
                    "loss": "block output error, W8A8", "fold_points": {}, "skipped": skipped}
    if scales is None:
        with step(f"smoothquant search: activation rows at {len(points)} fold points"):
            acts = calibrate.collect_rows(model, sorted({p.act for p in points}), batches, rows)
    with step(f"smoothquant search: {len(fold_search.GRID)} alphas at {len(points)} fold points ({fmt.name} W8A8)"):
        for k, p in enumerate(points):
            if scales is not None:
                if p.act not in scales or scales[p.act].shape != (p.channels,):
                    raise QuantizationError(f"smoothquant search: no pinned scales [{p.channels}] for {p.act!r}")
                s = np.asarray(scales[p.act], np.float32)
                info = {"pinned": True}
            else:
                weights = [fold_points.current_weight(model, by_node[t.node]) for t in p.gemms]
                res = fold_search.search(acts.pop(p.act), weights, qw, qa, family="smoothquant", groups=p.groups)
                s, info = res.scales, res.summary()
            if np.any(s != 1.0):
                fold_points.apply(model, p, s, f"sqs{k}")
            found[p.act] = s
            report["fold_points"][p.act] = {"kind": p.kind, "site": p.site.name, **info}
    report["scaled_points"] = int(sum(np.any(s != 1.0) for s in found.values()))
    return report, found


def prepare(sq, out_dir, progress, src, model: onnx.ModelProto, kept: list[Target],
            batches: list[dict[str, np.ndarray]], channel_amax: dict[str, np.ndarray] | None = None,
            fmt=None, per_channel: bool = False) -> tuple[onnx.ModelProto, list[Target], str, dict, dict[str, np.ndarray]]:
    """The SmoothQuant step of quantization (``sq``: the recipe's ``quantize.smoothquant``; ``out_dir``:
    where the smoothed graph goes; ``progress``: the console). It never sees the stage.

    Without ``sq``, returns ``model`` as given (weights not loaded). With it,
    loads ``model``'s weights from beside ``src``,
    collects per-channel input amax over ``batches``, smooths the inputs of the
    MatMul targets in ``kept`` and writes the smoothed FP32 graph to
    ``<out_dir>/smoothed_fp32.onnx`` (per-tensor calibration then runs on it).

    Args:
        channel_amax: a pinned per-channel amax (:mod:`pipeline.quant.pin`): used instead of
            collecting it over ``batches``; with ``mode: search`` the pinned site scales instead
            (folded as given, :func:`search_and_fold`).
        fmt, per_channel: the Q/DQ format and ``quantize.per_channel_weights`` (``mode: search``'s quantizer).

    Returns:
        ``(model, kept targets re-found in it, graph path to calibrate, info for the artifact,
        the per-channel amax used: float32 [channels] per activation, empty without SmoothQuant)``.

    Raises:
        QuantizationError: see :func:`smooth`.
    """
    from pathlib import Path

    from onnx.external_data_helper import load_external_data_for_model

    from pipeline import onnx_io
    from pipeline.quant import calibrate, qdq

    if sq is None:
        return model, kept, str(src), {}, {}
    load_external_data_for_model(model, str(Path(src).parent))
    mm = [t for t in kept if t.weight_axis == 1 and t.node in {n.name for n in model.graph.node if n.op_type == "MatMul"}]
    acts = sorted({t.act for t in mm})
    if getattr(sq, "mode", "alpha") == "search":
        if fmt is None:
            raise QuantizationError("quantize.smoothquant.mode: search needs the Q/DQ format (fp8 or int8)")
        info, chan = search_and_fold(model, mm, batches, fmt, per_channel, scales=channel_amax, progress=progress)
    else:
        with progress.step(f"smoothquant: per-channel amax of {len(acts)} GEMM inputs, alpha {sq.alpha}"):
            chan = channel_amax if channel_amax is not None else calibrate.collect_channel_amax(model, acts, batches)
            report = smooth(model, mm, chan, sq.alpha)
        info = {"alpha": sq.alpha, **report.summary()}
    path = Path(out_dir) / "smoothed_fp32.onnx"
    onnx_io.save_model_atomic(model, path)
    names = {t.node for t in kept}
    kept = [t for t in qdq.find_targets(model, [n for n in ("MatMul", "Gemm", "Conv")]) if t.node in names]
    return model, kept, str(path), info, chan
