"""ONNX Runtime sessions: CUDA when present, CPU otherwise."""
from __future__ import annotations

import onnxruntime as ort


def providers() -> list[str]:
    """CUDAExecutionProvider first when this onnxruntime build has it and a GPU answers."""
    avail = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in avail and _usable(p)]


def _usable(provider: str) -> bool:
    if provider != "CUDAExecutionProvider":
        return True
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# ORT's level-2+ graph transformers mishandle FP8 Q/DQ on CPU: the QDQ fusions
# build an invalid MatMulIntegerToFloat, and with those disabled another
# transformer still gives wrong numbers (seen with onnxruntime 1.31). Basic
# optimisations keep the exact simulated-quantization semantics: values are
# quantized and dequantized, the GEMM runs in FP32. FP32 graphs get all of them.


def has_qdq(path: str) -> bool:
    """True when the ONNX graph at ``path`` holds Q/DQ nodes (reads no weights)."""
    import onnx

    model = onnx.load(path, load_external_data=False)
    return any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph.node)


def ort_session(path: str) -> ort.InferenceSession:
    """An InferenceSession for ``path`` (CUDA EP first when usable)."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if has_qdq(path):
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(path, sess_options=opts, providers=providers(),
                                disabled_optimizers=_large_model_optimizers(path))


# Above 2 GiB, ORT's transpose optimizer and constant folding fold a Transpose of
# a large weight (a tied lm_head reading the embedding) into a new initializer
# that ORT then refuses to embed (its 2 GiB limit for in-memory initializers).
_LARGE_MODEL_DISABLED = ["TransposeOptimizer", "ConstantFolding"]


def _large_model_optimizers(path: str) -> list[str]:
    from pipeline.onnx_io import PROTOBUF_LIMIT, files_on_disk_bytes

    return _LARGE_MODEL_DISABLED if files_on_disk_bytes(path) >= PROTOBUF_LIMIT else []
