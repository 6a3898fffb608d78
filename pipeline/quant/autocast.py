"""Precision of the rest of the graph (``quantize.rest_precision``), ModelOpt AutoCast's idea.

In a strongly typed TensorRT network every tensor runs in the type the graph
gives it, so FP16/BF16 for attention, the excluded GEMMs and the lm_head must
be written into the ONNX graph. :func:`cast_rest` does it with ONNX Runtime's
``convert_float_to_float16`` (initializers cast, Casts inserted at every
boundary) while keeping in FP32:

* the graph I/O (``keep_io_types``): Triton configs and validate are unchanged;
* the Q/DQ GEMMs: QuantizeLinear, DequantizeLinear and the MatMul/Gemm they
  feed, so TensorRT still fuses them into FP8/INT8 kernels with FP32 scales;
* the numerically sensitive ops: Softmax, normalizations and their
  reductions (RMSNorm is Pow -> ReduceMean -> Add -> Sqrt -> Div), Exp/Log.

BF16 is the FP16 result with every FLOAT16 type and initializer rewritten as
BFLOAT16 (round to nearest even); ONNX Runtime's CPU provider cannot run it, so
validate measures it only through a TensorRT engine.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper
from onnx.external_data_helper import load_external_data_for_model

from pipeline.errors import QuantizationError
from pipeline.recipe.precisions import CAST, REFERENCE, REST

#: op types kept in FP32 besides the Q/DQ GEMMs.
FP32_OPS = ["Softmax", "LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization",
            "ReduceMean", "ReduceSum", "Pow", "Sqrt", "Reciprocal", "Exp", "Log", "Range", "CumSum",
            "QuantizeLinear", "DequantizeLinear"]
GEMMS = ("MatMul", "Gemm")


def qdq_gemms(model: onnx.ModelProto) -> list[str]:
    """Names of MatMul/Gemm nodes with a DequantizeLinear output as an input."""
    dq_out = {o for n in model.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    return [n.name for n in model.graph.node if n.op_type in GEMMS and any(i in dq_out for i in n.input)]


def cast_rest(model: onnx.ModelProto, precision: str, base_dir: str | None = None) -> onnx.ModelProto:
    """``model`` with everything but the I/O, the Q/DQ GEMMs and :data:`FP32_OPS` in ``precision``.

    Args:
        model: an exported (optionally Q/DQ) graph; external weights are read
            from ``base_dir`` first.
        precision: ``fp32`` (returned unchanged), ``fp16`` or ``bf16``.

    Raises:
        QuantizationError: an unknown precision, or a node without a name
            (the block list needs names).
    """
    if precision == REFERENCE:
        return model
    if precision not in CAST:
        raise QuantizationError(f"quantize.rest_precision: {precision!r} is not one of {', '.join(REST)}")
    from onnxruntime.transformers.float16 import convert_float_to_float16

    unnamed = [i for i, n in enumerate(model.graph.node) if not n.name and n.op_type in GEMMS]
    if unnamed:
        raise QuantizationError(f"quantize.rest_precision: GEMM nodes at indices {unnamed[:5]} have no name")
    if base_dir is not None:
        load_external_data_for_model(model, base_dir)
    half = convert_float_to_float16(model, keep_io_types=True, op_block_list=FP32_OPS,
                                    node_block_list=qdq_gemms(model), disable_shape_infer=True)
    _drop_duplicate_casts(half)
    _toposort(half.graph)
    return to_bf16(half) if precision == "bf16" else half


def _toposort(graph: onnx.GraphProto) -> None:
    """Reorder ``graph.node`` so every node follows the producers of its inputs (the
    converter appends the Casts it inserts after their consumers); stable otherwise.

    Raises:
        QuantizationError: the graph has a cycle.
    """
    producer = {out: i for i, n in enumerate(graph.node) for out in n.output if out}
    deps = [{producer[x] for x in n.input if x in producer and producer[x] != i} for i, n in enumerate(graph.node)]
    users: dict[int, list[int]] = {}
    for i, ds in enumerate(deps):
        for d in ds:
            users.setdefault(d, []).append(i)
    waiting = [len(ds) for ds in deps]
    ready = [i for i, w in enumerate(waiting) if w == 0]
    order: list[int] = []
    while ready:
        i = min(ready)
        ready.remove(i)
        order.append(i)
        for u in users.get(i, []):
            waiting[u] -= 1
            if waiting[u] == 0:
                ready.append(u)
    if len(order) != len(graph.node):
        raise QuantizationError("quantize.rest_precision: the converted graph has a cycle")
    nodes = [graph.node[i] for i in order]
    del graph.node[:]
    graph.node.extend(nodes)


def _drop_duplicate_casts(model: onnx.ModelProto) -> None:
    """The converter inserts the same Cast once per blocked consumer of a tensor (same name,
    same output: an invalid graph); keep the first of each identical node."""
    seen: set[bytes] = set()
    keep = []
    for node in model.graph.node:
        key = node.SerializeToString(deterministic=True)
        if node.op_type == "Cast" and key in seen:
            continue
        seen.add(key)
        keep.append(node)
    del model.graph.node[:]
    model.graph.node.extend(keep)


def to_bf16(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rewrite every FLOAT16 initializer, Cast target and value type as BFLOAT16 (in place)."""
    graph = model.graph
    for i, init in enumerate(graph.initializer):
        if init.data_type == TensorProto.FLOAT16:
            graph.initializer[i].CopyFrom(bf16_tensor(numpy_helper.to_array(init).astype(np.float32), init.name))
    for node in graph.node:
        for attr in node.attribute:
            if node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT16:
                attr.i = TensorProto.BFLOAT16
            if attr.HasField("t") and attr.t.data_type == TensorProto.FLOAT16:
                attr.t.CopyFrom(bf16_tensor(numpy_helper.to_array(attr.t).astype(np.float32), attr.t.name))
    for value in [*graph.value_info, *graph.input, *graph.output]:
        if value.type.tensor_type.elem_type == TensorProto.FLOAT16:
            value.type.tensor_type.elem_type = TensorProto.BFLOAT16
    return model


def bf16_tensor(values: np.ndarray, name: str) -> TensorProto:
    """float32 ``values`` as a BFLOAT16 TensorProto (round to nearest even)."""
    bits = values.astype(np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    tensor = TensorProto(name=name, data_type=TensorProto.BFLOAT16, dims=list(values.shape))
    tensor.raw_data = rounded.tobytes()
    return tensor
