"""Fit a served ONNX graph to the IR version and opsets the serving runtime reads.

A graph saved by a newer ``onnx`` carries a newer IR version (onnx 1.18: IR 11), which an
older ONNX Runtime refuses to load. Lowering ``ir_version`` is lossless when the graph
uses nothing the lower IR lacks: the IR version history in ``onnx/onnx.proto``
(``enum Version``) says what each version added (element types, proto fields), and
:func:`onnx.helper.find_min_ir_version_for` gives the lowest IR its opsets need.
Opsets are never converted (operator semantics change between opsets): a graph
whose ai.onnx opset the runtime does not implement is refused.
"""
from __future__ import annotations

from collections.abc import Iterator

import onnx
from onnx import helper

from pipeline.errors import TritonConfigError
from pipeline.onnx_io import tensors
from pipeline.targets import OnnxReader

#: element type name -> the IR version that added it (onnx.proto ``enum Version`` comments).
TYPE_IR = {"FLOAT8E4M3FN": 9, "FLOAT8E4M3FNUZ": 9, "FLOAT8E5M2": 9, "FLOAT8E5M2FNUZ": 9,
           "UINT4": 10, "INT4": 10, "FLOAT4E2M1": 11, "FLOAT8E8M0": 12, "UINT2": 13, "INT2": 13,
           "FLOAT6E2M3": 14, "FLOAT6E3M2": 14}
_TYPE_IR = {getattr(onnx.TensorProto, k): v for k, v in TYPE_IR.items() if hasattr(onnx.TensorProto, k)}
_LATEST_KNOWN_TYPE = max(_TYPE_IR, default=0)


def required_ir(model: onnx.ModelProto) -> tuple[int, str]:
    """(the lowest IR version that holds ``model``, why). Counts its opsets, every element
    type of its tensors, value infos and type attributes, multi-device configuration
    (IR 11) and the fields IR 10 added (function overloads, metadata_props on nodes,
    graphs and functions). An element type newer than :data:`TYPE_IR` knows counts as
    the model's own IR version (nothing is assumed about it)."""
    need, why = helper.find_min_ir_version_for(list(model.opset_import)), "its opsets"
    for elem in _elem_types(model):
        ir = _TYPE_IR.get(elem, model.ir_version if elem > _LATEST_KNOWN_TYPE else 0)
        if ir > need:
            need, why = ir, f"element type {onnx.TensorProto.DataType.Name(elem) if elem <= _LATEST_KNOWN_TYPE else elem}"
    graphs = list(_graphs(model.graph))
    nodes = [n for g in graphs for n in g.node] + [n for f in model.functions for n in f.node]
    if len(getattr(model, "configuration", ())) or any(len(getattr(n, "device_configurations", ())) for n in nodes):
        if need < 11:
            need, why = 11, "multi-device configuration"
    if need < 10 and (any(n.metadata_props for n in nodes) or any(g.metadata_props for g in graphs)
                      or any(f.overload or f.metadata_props for f in model.functions)):
        need, why = 10, "metadata_props on nodes / graphs or function overloads"
    return need, why


def fit_to_reader(model: onnx.ModelProto, reader: OnnxReader, where: str) -> bool:
    """Lower ``model.ir_version`` in place to what ``reader`` reads when that is lossless;
    returns whether it changed.

    Raises:
        TritonConfigError: the graph needs a higher IR version, or uses an ai.onnx opset
            outside the reader's range; names both versions, the container and ``where``.
    """
    runtime = f"Triton {reader.release}'s onnxruntime backend (ONNX Runtime {reader.onnxruntime})"
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    lo, hi = reader.opsets
    if opset is not None and not lo <= opset <= hi:
        raise TritonConfigError(f"{where}: ai.onnx opset {opset}, but {runtime} reads opsets {lo}-{hi}; export "
                                f"with opset <= {hi} or declare a newer container in triton.serving.container")
    if model.ir_version <= reader.max_ir:
        return False
    need, why = required_ir(model)
    if need > reader.max_ir:
        raise TritonConfigError(f"{where}: ONNX IR version {model.ir_version} (it needs >= {need} for {why}), but "
                                f"{runtime} reads IR <= {reader.max_ir}; declare a newer container in "
                                "triton.serving.container")
    model.ir_version = reader.max_ir
    return True


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _graphs(g)


def _elem_types(model: onnx.ModelProto) -> Iterator[int]:
    """Every element type the model names: tensors, value infos, ``to``-like attributes."""
    yield from (t.data_type for t in tensors(model))
    for g in _graphs(model.graph):
        for vi in [*g.input, *g.output, *g.value_info]:
            if vi.type.HasField("tensor_type"):
                yield vi.type.tensor_type.elem_type
        for node in g.node:
            yield from (a.i for a in node.attribute if a.name in ("to", "output_dtype", "dtype") and a.type == a.INT)
