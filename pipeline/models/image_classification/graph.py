"""The classifier's ONNX graph, as shipped and as the pipeline hands it on.

``rapidocr-onnxruntime`` ships ``models/ch_ppocr_mobile_v2.0_cls_infer.onnx``
(PaddleOCR mobile v2.0 text-direction classifier, exported by Paddle2ONNX,
opset 11): input ``x`` float32 ``[-1, 3, ?, ?]``, output
``save_infer_model/scale_0.tmp_1`` float32 ``[-1, 2]`` (softmax over
0 / 180 degrees). Its weights are ``Constant`` nodes and every Conv is
followed by a BatchNormalization.

:func:`prepare` writes the graph the stages use: ONNX Runtime's basic
(ONNX-standard) optimizations fold the constants into initializers and the
BatchNormalizations into the Conv weights (the layout Q/DQ placement and
TensorRT's INT8 convolution fusion expect), the opset goes to 13 (per-channel
DequantizeLinear), unused opset domains are dropped, and the dims get names:
``x`` ``[batch, 3, height, width]``, output ``[batch, 2]``.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import onnx

from pipeline.errors import ExportError

PACKAGE = "rapidocr_onnxruntime"
MODEL_FILE = "models/ch_ppocr_mobile_v2.0_cls_infer.onnx"
INPUT_DIMS: tuple[str | int | None, ...] = ("batch", 3, "height", "width")
OPSET = 13


def package_file(package: str = PACKAGE, path: str = MODEL_FILE) -> Path:
    """``path`` inside the installed ``package`` (the shipped classifier by default), as the
    recipe's ``source: {onnx: path, package: package}`` finds it: without importing the
    package (rapidocr imports OpenCV, which this tool does not install).

    Raises:
        ModelFileError: the package is not installed, or the file is missing from it.
    """
    from pipeline.sources.model import OnnxSource

    return OnnxSource(onnx=path, package=package).location()


def prepare(src: str | Path, dst: str | Path, dims: tuple[str | int | None, ...] = INPUT_DIMS,
            opset: int = OPSET) -> onnx.ModelProto:
    """Write the optimized, dim-named graph of ``src`` to ``dst`` and return it.

    Args:
        src: an image-classifier ONNX file with one 4-D input and one 2-D output.
        dims: per input axis, a name (symbolic dim), a size > 0 (fixed), or None / -1
            (kept as shipped); axis 0 must be a name, which the output's axis 0 takes too.

    Raises:
        ExportError: the graph is not one 4-D input -> one 2-D output, or ONNX
            Runtime / the opset converter refuses it (names ``src``).
    """
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.optimized_model_filepath = str(Path(tmp) / "basic.onnx")
        try:
            ort.InferenceSession(str(src), options, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own untyped errors
            raise ExportError(f"model: ONNX Runtime cannot load {src}: {e}") from None
        model = onnx.load(options.optimized_model_filepath)
    _name_dims(model, dims, src)
    used = {n.domain for n in model.graph.node}
    keep = [o for o in model.opset_import if o.domain in used or o.domain in ("", "ai.onnx")]
    del model.opset_import[:]
    model.opset_import.extend(keep)
    try:
        model = onnx.version_converter.convert_version(model, opset) if _opset(model) < opset else model
        onnx.checker.check_model(model)
    except Exception as e:  # the converter raises bare RuntimeErrors
        raise ExportError(f"model: {src} cannot be converted to opset {opset}: {e}") from None
    onnx.save(model, str(dst))
    return model


def _opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def _name_dims(model: onnx.ModelProto, dims: tuple, src) -> None:
    inits = {i.name for i in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in inits]
    outputs = list(model.graph.output)
    in_shape = inputs[0].type.tensor_type.shape.dim if len(inputs) == 1 else []
    out_shape = outputs[0].type.tensor_type.shape.dim if len(outputs) == 1 else []
    if not isinstance(dims[0], str):
        raise ExportError(f"model: {src}: the batch axis (0) needs a dim name, got {dims[0]!r}; valid: e.g. 'batch'")
    if len(in_shape) != len(dims) or len(out_shape) != 2:
        raise ExportError(f"model: {src} has inputs {[i.name for i in inputs]} and outputs "
                          f"{[o.name for o in outputs]}; valid: one {len(dims)}-D image input and one "
                          f"[batch, classes] output")
    for dim, name in zip(in_shape, dims):
        if isinstance(name, str):
            dim.Clear()
            dim.dim_param = name
        elif isinstance(name, int) and name > 0:
            dim.Clear()
            dim.dim_value = name
    out_shape[0].Clear()
    out_shape[0].dim_param = dims[0]
