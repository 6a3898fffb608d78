"""Rules a Q/DQ ONNX graph must satisfy before it is handed to TensorRT.

TensorRT's explicit quantization accepts only symmetric, signed Q/DQ: INT8
with a zero point of 0, or FP8 E4M3 (which needs opset 19, where the float8
types were added), with finite, positive scales. Breaking any of these fails
deep inside the ONNX parser or the builder, or, worse for an infinite scale,
builds an engine that outputs garbage. :func:`check_qdq_graph` finds every
offender up front and names it.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pipeline.errors import GraphCheckError
from pipeline.recipe.precisions import facts

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
DEFAULT_DOMAINS = ("", "ai.onnx")
UNSIGNED = {TensorProto.UINT8, TensorProto.UINT4, TensorProto.UINT16}
FLOAT8 = {
    TensorProto.FLOAT8E4M3FN,
    TensorProto.FLOAT8E4M3FNUZ,
    TensorProto.FLOAT8E5M2,
    TensorProto.FLOAT8E5M2FNUZ,
}
FP8_MIN_OPSET = facts("fp8").min_opset  # the precision table's
INF_HINT = (
    "an infinite scale usually means calibration saw +/-inf (amax=inf), e.g. an attention "
    "mask's -inf (or finfo.min) reaching the calibrated tensor; exclude that tensor from "
    "quantization or clamp the mask"
)


@dataclass
class _Graph:
    """Constant values and known element types of tensors, by name."""

    consts: dict[str, TensorProto] = field(default_factory=dict)
    types: dict[str, int] = field(default_factory=dict)
    base_dir: str = ""


def check_qdq_graph(model: onnx.ModelProto, *, base_dir: str = "") -> None:
    """Check every QuantizeLinear/DequantizeLinear (subgraphs included).

    Rules (each violation is one line of the error):
      * zero points must be 0 (TensorRT supports symmetric quantization only);
      * the quantized type must be signed: a uint8/uint4/uint16 zero point,
        ``output_dtype``, or a QuantizeLinear without zero point (ONNX then
        defaults to uint8) is rejected, wherever the node sits (Gather /
        embedding paths included);
      * float8 Q/DQ needs default-domain opset >= 19;
      * scales must be finite and > 0 (zero, negative, NaN, Inf rejected).

    Scales and zero points may be initializers or Constant nodes; a scale
    computed at run time cannot be checked and is skipped.

    Args:
        model: the Q/DQ graph. Initializers may live in external data files.
        base_dir: folder of the model file, to read external initializer data
            of scales/zero points when the model was loaded without it.

    Raises:
        GraphCheckError: lists every offending node with the tensor at fault.
    """
    opset = _default_opset(model)
    ctx = _Graph(base_dir=base_dir)
    _collect_graph_info(model.graph, ctx)
    problems: list[str] = []
    for node in _qdq_nodes(model.graph, ctx):
        problems.extend(_check_node(node, ctx, opset))
    if problems:
        raise GraphCheckError(
            f"Q/DQ graph breaks {len(problems)} TensorRT rule(s):\n" + "\n".join(f"  - {p}" for p in problems)
        )


def _default_opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in DEFAULT_DOMAINS:
            return imp.version
    return 0


def _collect_graph_info(graph: onnx.GraphProto, ctx: _Graph) -> None:
    """Record initializers, Constant outputs and declared types of ``graph``."""
    for init in graph.initializer:
        ctx.consts[init.name] = init
        ctx.types[init.name] = init.data_type
    for vi in [*graph.input, *graph.output, *graph.value_info]:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            ctx.types.setdefault(vi.name, vi.type.tensor_type.elem_type)
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in DEFAULT_DOMAINS:
            tensor = _constant_value(node)
            if tensor is not None:
                ctx.consts[node.output[0]] = tensor
                ctx.types[node.output[0]] = tensor.data_type


def _constant_value(node: onnx.NodeProto) -> TensorProto | None:
    """The tensor a Constant node produces (``value`` or ``value_float(s)/int(s)``)."""
    for attr in node.attribute:
        value = helper.get_attribute_value(attr)
        if attr.name == "value":
            return value
        if attr.name in ("value_float", "value_floats"):
            return numpy_helper.from_array(np.asarray(value, dtype=np.float32))
        if attr.name in ("value_int", "value_ints"):
            return numpy_helper.from_array(np.asarray(value, dtype=np.int64))
    return None


def _qdq_nodes(graph: onnx.GraphProto, ctx: _Graph) -> Iterator[onnx.NodeProto]:
    """Q/DQ nodes in graph order, descending into If/Loop/Scan bodies."""
    for node in graph.node:
        if node.op_type in QDQ_OPS and node.domain in DEFAULT_DOMAINS:
            yield node
            qtype = _quantized_type(node, ctx)
            if node.op_type == "QuantizeLinear" and qtype:
                ctx.types[node.output[0]] = qtype
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                _collect_graph_info(sub, ctx)
                yield from _qdq_nodes(sub, ctx)


def _input(node: onnx.NodeProto, i: int) -> str:
    return node.input[i] if i < len(node.input) else ""


def _quantized_type(node: onnx.NodeProto, ctx: _Graph) -> int | None:
    """Element type on the quantized side of a Q/DQ node, or None if unknown."""
    zp = _input(node, 2)
    if zp:
        return ctx.types.get(zp)
    if node.op_type == "QuantizeLinear":
        out = next((a.i for a in node.attribute if a.name == "output_dtype"), 0)
        return out or TensorProto.UINT8
    return ctx.types.get(node.input[0]) or None


def _check_node(node: onnx.NodeProto, ctx: _Graph, opset: int) -> list[str]:
    who = f"node {node.name or '<unnamed>'!r} ({node.op_type})"
    qtype = _quantized_type(node, ctx)
    problems = []
    if qtype in UNSIGNED:
        problems.append(f"{who}: {_type_origin(node, qtype)}; TensorRT needs signed INT8 (zero point int8 0)")
    if qtype in FLOAT8 and opset < FP8_MIN_OPSET:
        problems.append(
            f"{who}: {TensorProto.DataType.Name(qtype).lower()} Q/DQ needs default-domain opset "
            f">= {FP8_MIN_OPSET}, the model imports opset {opset}; re-export with export.opset >= 19"
        )
    problems.extend(_zero_point_problems(node, who, ctx))
    problems.extend(_scale_problems(node, who, ctx))
    return problems


def _type_origin(node: onnx.NodeProto, qtype: int) -> str:
    name = TensorProto.DataType.Name(qtype).lower()
    zp = _input(node, 2)
    if zp:
        return f"zero point {zp!r} is {name}"
    if node.op_type == "QuantizeLinear":
        has_attr = any(a.name == "output_dtype" for a in node.attribute)
        why = "output_dtype" if has_attr else "no zero point given, so ONNX defaults to"
        return f"output {node.output[0]!r} is {name} ({why} {name})"
    return f"quantized input {node.input[0]!r} is {name}"


def _zero_point_problems(node: onnx.NodeProto, who: str, ctx: _Graph) -> list[str]:
    zp = _input(node, 2)
    values = _values(zp, ctx)
    if values is None:
        return []
    nonzero = values[values != 0]
    if nonzero.size == 0:
        return []
    shown = ", ".join(f"{v:g}" for v in np.unique(nonzero)[:4])
    return [
        f"{who}: zero point {zp!r} has {nonzero.size} non-zero value(s) ({shown}); "
        "TensorRT supports only symmetric quantization (zero point 0)"
    ]


def _scale_problems(node: onnx.NodeProto, who: str, ctx: _Graph) -> list[str]:
    scale = _input(node, 1)
    values = _values(scale, ctx)
    if values is None:
        return []
    counts = {
        "zero": int(np.sum(values == 0)),
        "negative": int(np.sum(values < 0)),
        "NaN": int(np.sum(np.isnan(values))),
        "Inf": int(np.sum(np.isinf(values))),
    }
    bad = [f"{n} {kind}" for kind, n in counts.items() if n]
    if not bad:
        return []
    line = f"{who}: scale {scale!r} has {', '.join(bad)} value(s); scales must be finite and > 0"
    return [line + (f" ({INF_HINT})" if counts["Inf"] else "")]


def _values(name: str, ctx: _Graph) -> np.ndarray | None:
    """Constant values of tensor ``name`` as float64, or None if not constant."""
    tensor = ctx.consts.get(name) if name else None
    if tensor is None:
        return None
    return numpy_helper.to_array(tensor, ctx.base_dir).astype(np.float64).ravel()
