"""The quantize stage's graph transforms before Q/DQ that need a file of their own: the Hadamard rotation
(:mod:`pipeline.quant.rotate`). SmoothQuant is :func:`pipeline.quant.smoothquant.prepare`."""
from __future__ import annotations

from pathlib import Path

import onnx
from onnx.external_data_helper import load_external_data_for_model

from pipeline import onnx_io
from pipeline.context import StageContext
from pipeline.quant import qdq



ROTATED = "rotated_fp32.onnx"

def rotated(ctx: StageContext, model: onnx.ModelProto, src: Path, targets: list[qdq.Target],
             kept: list[qdq.Target]) -> tuple[onnx.ModelProto, list[qdq.Target], Path, dict]:
    """``quantize.rotate``: R1 and R2 folded into the FP32 graph (:func:`pipeline.quant.rotate.rotate`),
    saved as ``<stage>/rotated_fp32.onnx`` and read back lazily, so what follows (SmoothQuant,
    calibration, the search, Q/DQ) sees it as the exported graph. The GEMMs to quantize are the same
    nodes as before (the MatMul added before a tied lm_head is not one of them).

    Raises:
        QuantizationError: the graph is not Llama-shaped (:func:`pipeline.quant.rotate.rotate`).
    """
    from pipeline.quant import rotate

    load_external_data_for_model(model, str(src.parent))
    with ctx.progress.step("rotate: Hadamard R1 (residual stream) and R2 (v -> o) folded into the weights"):
        report = rotate.rotate(model, targets)
    path = ctx.stage_dir / ROTATED
    onnx_io.save_model_atomic(model, path)
    del model
    model = onnx.load(str(path), load_external_data=False)
    names = {t.node for t in kept}
    kept = [t for t in qdq.find_targets(model, list(ctx.recipe.quantize.quantize_op_types)) if t.node in names]
    return model, kept, path, report.summary()
