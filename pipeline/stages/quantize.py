"""Stage 2, quantize: explicit Q/DQ (FP8 E4M3, INT8) calibrated on real text, or FP16."""
from __future__ import annotations

import numpy as np
import onnx

from pipeline import data, graph_checks
from pipeline.artifacts import ExportArtifact, QuantizedArtifact
from pipeline.context import StageContext
from pipeline.errors import QuantizationError
from pipeline.models import registry
from pipeline.quant import calibrate, qdq


def run(ctx: StageContext, exp: ExportArtifact) -> QuantizedArtifact:
    """Write ``quantize/model.onnx`` in the recipe's precision.

    Raises:
        QuantizationError: bad exclusions, too little or out-of-profile
            calibration data, FP8 below opset 19, or an invalid scale.
        GraphCheckError: the result breaks a TensorRT Q/DQ rule.
    """
    q = ctx.recipe.quantize
    out = ctx.stage_dir / "model.onnx"
    model = onnx.load(exp.onnx_path)  # with its external weights, saved back as one file
    if q.precision == "fp32":
        onnx.save(model, str(out))
        return QuantizedArtifact(str(out), "fp32", [], [])
    if q.precision == "fp16":
        return _fp16(model, out)
    _check_opset(model, q.precision)
    targets = qdq.find_targets(model, list(q.quantize_op_types))
    kept, excluded = qdq.apply_exclusions(model, targets, q.exclude)
    if not kept:
        raise QuantizationError("quantize: no weight GEMM is left to quantize after exclusions")
    fmt = qdq.FORMATS[q.precision]
    batches = calibration_batches(ctx, exp)
    acts = sorted({t.act for t in kept})
    with ctx.progress.step(f"calibrate: {q.calibration.method} over {len(batches)} batches, {len(acts)} tensors"):
        amax = calibrate.collect_amax(exp.onnx_path, acts, batches, q.calibration.method, fmt, q.calibration.percentile)
    qmodel = qdq.insert_qdq(model, kept, amax, fmt, q.per_channel_weights)
    graph_checks.check_qdq_graph(qmodel)
    onnx.save(qmodel, str(out))
    info = {"method": q.calibration.method, "samples": int(sum(b["input_ids"].shape[0] for b in batches)),
            "seq_len": q.calibration.seq_len, "amax": {k: round(v, 6) for k, v in amax.items()}}
    return QuantizedArtifact(str(out), q.precision, [t.node for t in kept], [t.node for t in excluded], info)


def _check_opset(model: onnx.ModelProto, precision: str) -> None:
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if precision == "fp8" and opset < 19:
        raise QuantizationError(f"export.opset: FP8 Q/DQ needs opset >= 19, the graph has opset {opset}")


def _fp16(model: onnx.ModelProto, out) -> QuantizedArtifact:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    half = convert_float_to_float16(model, keep_io_types=True)
    onnx.save(half, str(out))
    return QuantizedArtifact(str(out), "fp16", [], [], {"method": "cast", "keep_io_types": True})


def calibration_batches(ctx: StageContext, exp: ExportArtifact) -> list[dict[str, np.ndarray]]:
    """Feed dicts of real text windows from the calibration split.

    Raises:
        QuantizationError: fewer windows than ``min_samples`` (the recipe schema
            already refused batch/sequence sizes outside the first profile).
    """
    cal = ctx.recipe.quantize.calibration
    tok = registry.load_tokenizer(exp.tokenizer_dir)
    docs = data.load_documents(cal.dataset, cal.split)
    windows = data.token_windows(tok, docs, cal.seq_len, cal.samples)
    if len(windows) < cal.min_samples:
        raise QuantizationError(
            f"quantize.calibration: split [{cal.split.start}, {cal.split.stop}) gives {len(windows)} windows of "
            f"{cal.seq_len} tokens, below min_samples={cal.min_samples}; widen the split or shorten seq_len"
        )
    adapter = registry.adapter(ctx.recipe.model)
    return [adapter.feeds_for_ids(exp, windows[i : i + cal.batch_size]) for i in range(0, len(windows), cal.batch_size)]

