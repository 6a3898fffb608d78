"""AWQ for weight-only INT4 blocks (``quantize.weights.method: awq``): activation-aware per-channel
scales searched at every fold point of the graph, folded into the FP32 graph, then round to nearest.

Lin et al., "AWQ: Activation-aware Weight Quantization for On-Device LLM Compression and
Acceleration" (MLSys 2024). Per fold point (:mod:`pipeline.quant.fold_points`: norm -> q/k/v,
norm -> gate/up, v -> o with one scale per KV channel under GQA, up -> down), the scales
``s = mean|X| ** alpha`` minimise the block output error of the INT4 GEMMs reading it::

    sum_k || X W_k - (X / s) Q(diag(s) W_k) ||_F^2

(:func:`pipeline.quant.fold_search.search`, ``Q``: :func:`pipeline.quant.int4.fake_quantize` at the
recipe's block size), over :data:`ROWS` calibration rows sampled with a fixed seed
(:func:`pipeline.quant.calibrate.collect_rows`) from the FP32 graph. The searches are independent:
a fold scales a GEMM's input rows or the output columns of the site (``up_proj``, ``v_proj``), and
a column scale moves every block of that column alike, which absmax blocks along ``K`` absorb
exactly, so one fold never changes another point's quantization error. Then AWQ's weight
clipping: per block of each output column, a clip ratio of the block absmax (1 down to 0.5) chosen
by that block's output error on the same rows (:func:`pipeline.quant.int4.clip_search`). After folding, the graph's outputs on the first calibration batch are
checked against the unfolded graph's (:data:`EQUIVALENCE_RTOL`) before
:func:`pipeline.quant.int4.rewrite_rtn` rounds the weights.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from pipeline.errors import QuantizationError
from pipeline.memory import release_freed
from pipeline.quant import calibrate, fold_points, fold_search, int4
from pipeline.quant.qdq import Target

#: calibration rows (token positions) sampled per fold point for the search
ROWS = 2048
#: max |folded - unfolded| / max |unfolded| allowed on each graph output (float32 summation order)
EQUIVALENCE_RTOL = 1e-4


def fold(model: onnx.ModelProto, targets: list[Target], batches: list[dict[str, np.ndarray]], block_size: int,
         *, rows: int = ROWS, clip: bool = True, pad: bool = False, progress=None) -> tuple[dict, dict[str, np.ndarray]]:
    """Search and fold AWQ scales into ``model`` (FP32, weights loaded) in place.

    Args:
        model: the exported FP32 graph with its initializers loaded.
        targets: the weight GEMMs to be quantized (:func:`pipeline.quant.qdq.find_targets` after
            exclusions); fold points whose GEMMs are not all among them are left alone.
        batches: calibration feed dicts.
        block_size: INT4 weights per scale along ``K`` (the quantizer the search uses).
        progress: the console (``step`` context manager), or None.

        clip: also search per-block clip ratios of every fold GEMM's scaled weight
            (:func:`pipeline.quant.int4.clip_search`, AWQ's weight clipping).
        pad: a fold GEMM's ``K`` that ``block_size`` does not divide is quantized zero-padded to whole
            blocks, as :func:`pipeline.quant.int4.rewrite_rtn` with ``pad`` stores it (the search's
            quantizer and the clip ratios ``[N, K' / block_size]`` then match the served weights).

    Returns:
        ``(report, clips)``: the JSON-ready report: per fold point its kind, site, alpha, loss and
        baseline; the totals ``block_output_error`` (AWQ scales, before clipping) and
        ``block_output_error_rtn`` (no scaling) summed over points, the same with the clip ratios
        (``block_output_error_clipped``), the points skipped with reasons, and the equivalence
        check's largest relative difference, and ``seconds``: the wall time (s) of each phase
        (``reference_outputs``, ``activation_rows``, ``scale_search``, ``clip_search``,
        ``fold_and_check``); ``clips``: MatMul name -> float32 ``[N, K / block_size]``
        ratios for :func:`pipeline.quant.int4.rewrite_rtn`.

    Raises:
        QuantizationError: a block size not dividing a fold GEMM's K without ``pad`` (names it); the folded graph
            differs from the unfolded one beyond :data:`EQUIVALENCE_RTOL` (names the output).
    """
    import contextlib
    import time

    seconds: dict[str, float] = {"scale_search": 0.0, "clip_search": 0.0}
    t0 = time.perf_counter()
    step = progress.step if progress is not None else (lambda _text: contextlib.nullcontext())
    wanted = {t.node for t in targets}
    points, skipped = fold_points.find(model, targets)
    points = [p for p in points if {t.node for t in p.gemms} <= wanted]
    before = _outputs(model, batches[0])
    release_freed()  # the reference session's pages, before the activation rows' session
    seconds["reference_outputs"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with step(f"awq: activation rows at {len(points)} fold points over {len(batches)} batches"):
        acts = calibrate.collect_rows(model, sorted({p.act for p in points}), batches, rows)
    seconds["activation_rows"] = time.perf_counter() - t0
    by_node = {t.node: t for t in targets}
    results = []
    clips: dict[str, np.ndarray] = {}
    clipped = 0.0
    with step(f"awq: scale search ({len(fold_search.GRID)} alphas) at {len(points)} fold points, INT4 block {block_size}"):
        for p in points:
            weights = [fold_points.current_weight(model, by_node[t.node]) for t in p.gemms]
            for t, w in zip(p.gemms, weights):
                if w.shape[0] % block_size and not pad:
                    raise QuantizationError(f"MatMul {t.node!r}: quantize.weights.block_size {block_size} does not "
                                            f"divide its input dimension K = {w.shape[0]} (TensorRT refuses a partial "
                                            f"block); {int4.pad_hint(w.shape[0])}")
            x = acts.pop(p.act)
            t0 = time.perf_counter()
            res = fold_search.search(x, weights, lambda w: int4.fake_quantize(w, block_size, pad=pad),
                                     family="awq", groups=p.groups)
            results.append((p, res))
            t1 = time.perf_counter()
            seconds["scale_search"] += t1 - t0
            if clip:  # on the folded operands: X / s and diag(s) W
                xs, rs = x / res.row_scales[None, :], res.row_scales[:, None]
                for t, w in zip(p.gemms, weights):
                    clips[t.node] = int4.clip_search(xs, w * rs, block_size, pad=pad)
                    q = int4.rtn_form(np.ascontiguousarray((w * rs).T), block_size, clip=clips[t.node],
                                      pad=pad).dequantized().T[:w.shape[0]]
                    d = xs @ (w * rs) - xs @ q
                    clipped += float(np.einsum("ij,ij->", d, d, dtype=np.float64))
                seconds["clip_search"] += time.perf_counter() - t1
    t0 = time.perf_counter()
    for k, (p, res) in enumerate(results):
        if res.scaled:
            fold_points.apply(model, p, res.scales, f"awq{k}")
    after = _outputs(model, batches[0])
    worst = _compare(before, after)
    seconds["fold_and_check"] = time.perf_counter() - t0
    return {"rows": rows, "grid": list(fold_search.GRID), "family": "awq", "loss": "block output error",
            "fold_points": {p.act: {"kind": p.kind, "site": p.site.name, "gemms": [t.node for t in p.gemms],
                                    **res.summary()} for p, res in results},
            "skipped": skipped, "scaled_points": sum(res.scaled for _, res in results),
            "block_output_error": sum(res.loss for _, res in results),
            "block_output_error_rtn": sum(res.baseline for _, res in results),
            "block_output_error_clipped": clipped if clip else None, "clip_grid": list(int4.CLIP_GRID) if clip else None,
            "clipped_blocks": int(sum((c < 1).sum() for c in clips.values())),
            "blocks": int(sum(c.size for c in clips.values())),
            "equivalence_max_relative_difference": worst,
            "seconds": {k: round(v, 2) for k, v in seconds.items()}}, clips


def _outputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.enable_cpu_mem_arena = False  # one run: its activations freed after it (the results are the same)
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs() if not o.name.startswith("present.")]  # V / s: checked by logits
    return dict(zip(names, sess.run(names, feeds)))


def _compare(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> float:
    worst = 0.0
    for name, ref in before.items():
        diff = float(np.abs(after[name] - ref).max()) / max(float(np.abs(ref).max()), 1e-30)
        if not diff <= EQUIVALENCE_RTOL:
            raise QuantizationError(f"awq: the folded FP32 graph's output {name!r} differs from the exported graph's "
                                    f"by {diff:.3g} of its range (> {EQUIVALENCE_RTOL:g}): a fold point is not "
                                    "equivalent on this graph; report it, or use quantize.weights.method: rtn")
        worst = max(worst, diff)
    return worst


def load_weights(model: onnx.ModelProto, src: str | Path) -> None:
    """Load ``model``'s external weights from beside ``src`` (in place)."""
    from onnx.external_data_helper import load_external_data_for_model

    load_external_data_for_model(model, str(Path(src).parent))
