"""Explicit Q/DQ placement for TensorRT's strongly typed networks.

Policy: quantize the inputs of weight GEMMs (MatMul/Gemm with a 2-D constant
weight) and of convolutions (Conv with a constant ``[C_out, C_in/groups, *k]``
weight), which TensorRT fuses into FP8/INT8 GEMM / convolution kernels:

* activation: ``x -> QuantizeLinear -> DequantizeLinear -> GEMM``, per-tensor
  scale ``amax / qmax`` from calibration, zero point 0;
* weight: stored already quantized (FP8 E4M3 or INT8) with one
  ``DequantizeLinear`` in front of the GEMM, per-tensor or per output channel.

``qmax`` is 448 for FP8 E4M3 (OCP 8-bit floating point spec, E4M3 max normal)
and 127 for INT8 (symmetric, -128 unused, as TensorRT requires). The layout
follows NVIDIA's "Explicit Quantization" section of the TensorRT developer guide.
"""
from __future__ import annotations

import copy
import fnmatch
from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pipeline.errors import QuantizationError
from pipeline.onnx_io import initializer_array
from pipeline.ort_sessions import SATURATION_SAFE_INT8
from pipeline.recipe.schema import ExcludeConfig


@dataclass(frozen=True)
class QFormat:
    """An 8-bit format: activations use ``qmax``, weights ``weight_qmax`` (``None``: ``qmax``);
    ``weight_clip``: how each weight's amax is chosen (``max``, or the clip search's loss,
    :func:`pipeline.quant.clip.weight_clip_ratio`; recipe ``quantize.weight_clip``)."""

    name: str
    onnx_type: int
    np_type: type
    qmax: float
    weight_qmax: float | None = None
    weight_clip: str = "max"

    def weights(self) -> "QFormat":
        """The format the weights are quantized in (``qmax`` = :attr:`weight_qmax` when set)."""
        return self if self.weight_qmax is None else replace(self, qmax=self.weight_qmax, weight_qmax=None)


FORMATS = {
    "fp8": QFormat("fp8", TensorProto.FLOAT8E4M3FN, ml_dtypes.float8_e4m3fn, 448.0),
    "int8": QFormat("int8", TensorProto.INT8, np.int8, 127.0),
}


def quant_format(precision: str, reduce_range: bool = False, weight_clip: str = "max") -> QFormat:
    """The Q/DQ format of ``precision`` (``fp8`` / ``int8``); ``reduce_range``: INT8 weights
    within +-:data:`pipeline.ort_sessions.SATURATION_SAFE_INT8` (7 bits), which ONNX Runtime's
    integer kernels multiply exactly on every x86 CPU (recipe ``quantize.reduce_range``);
    ``weight_clip``: ``max`` or a clip-search loss (recipe ``quantize.weight_clip``).

    Raises:
        KeyError: ``precision`` has no Q/DQ format.
        ValueError: ``reduce_range`` with a precision other than ``int8``.
    """
    fmt = FORMATS[precision] if weight_clip == "max" else replace(FORMATS[precision], weight_clip=weight_clip)
    if not reduce_range:
        return fmt
    if precision != "int8":
        raise ValueError(f"reduce_range needs precision int8, not {precision!r}")
    return replace(fmt, weight_qmax=float(SATURATION_SAFE_INT8))


@dataclass(frozen=True)
class Target:
    """One weight GEMM: ``node`` consumes activation ``act`` and weight ``weight``."""

    node: str
    scope: str
    act: str
    weight: str
    weight_axis: int  # output-channel axis of the weight tensor


def node_scope(node: onnx.NodeProto) -> str:
    """The torch module path a node came from (dynamo exporter metadata), or ""."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            scopes = [s.strip(" '\"") for s in prop.value.strip("[]").split(",")]
            return scopes[-2] if len(scopes) >= 2 else scopes[-1]
    return ""


def find_targets(model: onnx.ModelProto, op_types: list[str]) -> list[Target]:
    """Weight GEMMs and convolutions of the graph (of ``op_types``), in graph order.

    MatMul ``[K, N]`` weights have output channels on axis 1; Gemm weights on
    axis 0 when ``transB=1`` else axis 1; Conv weights ``[C_out, C_in/groups, *kernel]``
    (1-D to 3-D kernels) on axis 0. Weights must be FP32 initializers (a graph
    whose weights are ``Constant`` nodes needs them folded into initializers first).

    Raises:
        QuantizationError: two nodes of ``op_types`` share a name, or one has none.
    """
    inits = {i.name: i for i in model.graph.initializer}
    names = [n.name for n in model.graph.node if n.op_type in op_types]
    if "" in names or len(set(names)) < len(names):
        raise QuantizationError("quantize: the graph has unnamed or duplicate-named "
                                f"{'/'.join(op_types)} nodes; Q/DQ placement addresses nodes by name "
                                "(pipeline.onnx_io.name_nodes names them)")
    out = []
    for n in model.graph.node:
        if n.op_type not in op_types or len(n.input) < 2 or n.input[1] not in inits:
            continue
        w = inits[n.input[1]]
        rank_ok = 3 <= len(w.dims) <= 5 if n.op_type == "Conv" else len(w.dims) == 2
        if not rank_ok or w.data_type != TensorProto.FLOAT or n.input[0] in inits:
            continue
        trans_b = next((a.i for a in n.attribute if a.name == "transB"), 0)
        axis = 0 if (n.op_type == "Conv" or (n.op_type == "Gemm" and trans_b)) else 1
        out.append(Target(n.name, node_scope(n), n.input[0], n.input[1], axis))
    return out


def apply_exclusions(model: onnx.ModelProto, targets: list[Target], exclude: ExcludeConfig) -> tuple[list[Target], list[Target]]:
    """Split targets into (kept, excluded).

    Raises:
        QuantizationError: a node pattern or op type matches no node of the graph.
    """
    nodes = model.graph.node
    for pat in exclude.nodes:
        if not any(fnmatch.fnmatchcase(n.name, pat) or fnmatch.fnmatchcase(node_scope(n), pat) for n in nodes):
            raise QuantizationError(
                f"quantize.exclude.nodes: pattern {pat!r} matches no node name or module scope in the graph"
            )
    present = {n.op_type for n in nodes}
    for op in exclude.op_types:
        if op not in present:
            raise QuantizationError(
                f"quantize.exclude.op_types: {op!r} matches no node; the graph's op types are {sorted(present)}"
            )
    op_of = {n.name: n.op_type for n in nodes}

    def excluded(t: Target) -> bool:
        by_pat = any(fnmatch.fnmatchcase(t.node, p) or fnmatch.fnmatchcase(t.scope, p) for p in exclude.nodes)
        return by_pat or op_of[t.node] in exclude.op_types

    return [t for t in targets if not excluded(t)], [t for t in targets if excluded(t)]


def scale_from_amax(amax: np.ndarray | float, fmt: QFormat, name: str) -> np.ndarray:
    """``scale = amax / qmax`` as float32.

    Raises:
        QuantizationError: amax is NaN, infinite or not positive (names ``name``);
            e.g. a tensor carrying an attention mask's -inf gives amax = inf.
    """
    amax = np.asarray(amax, np.float64)
    if not np.all(np.isfinite(amax)) or np.any(amax <= 0):
        bad = amax[~np.isfinite(amax) | (amax <= 0)].ravel()[:3]
        raise QuantizationError(
            f"tensor {name!r}: calibrated amax {bad.tolist()} gives an invalid scale; "
            "exclude its consumer (quantize.exclude) or fix the calibration data"
        )
    return (amax / fmt.qmax).astype(np.float32)


def quantize_weight(w: np.ndarray, fmt: QFormat, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a float32 weight. Returns ``(q, scale)``: ``q`` in ``fmt``'s type, shape of ``w``;
    ``scale`` float32, ``[]`` or ``[w.shape[axis]]``.

    ``axis=None`` gives one scale; otherwise one per index of ``axis``. All-zero
    channels get amax 1 so their scale stays valid.

    FP8 per channel: each channel's scale is the per-tensor scale divided by a power of
    two (channel amax in (qmax/2, qmax] after scaling), not ``amax_c / qmax``. A float
    format's relative rounding does not depend on the scale's exponent, so this keeps
    per-channel's one benefit (small channels leave the subnormal range) and the
    per-tensor rounding of every other value. Measured on SmolLM2-135M (weights only,
    2 x 95 tokens, KL to FP32): per-tensor 0.02685, per-channel ``amax_c / 448``
    0.04287 (down_proj of layers 15-29 alone: +0.0132), power-of-two per-channel
    0.02685; ONNX Runtime's per-axis FP8 DequantizeLinear matched numpy to 2e-8 in
    both. The cause is the scale's mantissa per channel, not the axis, ORT, saturation
    or subnormals.

    With ``fmt.weight_clip`` other than ``max``, every amax is the max times the clip search's
    ratio (:func:`pipeline.quant.clip.weight_clip_ratio`); values beyond it saturate.
    """
    reduce = None if axis is None else tuple(i for i in range(w.ndim) if i != axis)
    amax = np.abs(w).max(axis=reduce)
    amax = np.where(amax > 0, amax, 1.0)
    if fmt.weight_clip != "max":
        from pipeline.quant.clip import weight_clip_ratio

        amax = amax * weight_clip_ratio(w, fmt, fmt.weight_clip, axis)
    if axis is not None and fmt.name == "fp8":
        amax = _pow2_channel_amax(amax)
    scale = scale_from_amax(amax, fmt, "weight")
    bshape = scale if axis is None else np.expand_dims(scale, reduce)
    x = np.clip(w / bshape, -fmt.qmax, fmt.qmax)
    q = np.round(x).astype(fmt.np_type) if fmt.np_type is np.int8 else x.astype(fmt.np_type)
    return q, scale


def _pow2_channel_amax(amax: np.ndarray) -> np.ndarray:
    """Per-channel amax rounded up to ``tensor amax / 2**k`` (k >= 0 integer): float64 ``[C]``."""
    top = float(amax.max())
    k = np.floor(np.log2(top / amax.astype(np.float64)))
    return top / np.exp2(np.maximum(k, 0.0))


def _zero_point(fmt: QFormat, name: str, shape: tuple[int, ...] = ()) -> onnx.TensorProto:
    return numpy_helper.from_array(np.zeros(shape, fmt.np_type), name)


def insert_qdq(model: onnx.ModelProto, targets: list[Target], act_amax: dict[str, float],
               fmt: QFormat, per_channel: bool, *, base_dir: str = "", inplace: bool = False,
               weight_cache: dict | None = None) -> onnx.ModelProto:
    """Return ``model`` (a copy unless ``inplace``) with Q/DQ around every target's inputs.

    The model may be loaded lazily (``load_external_data=False``): each FP32
    weight is then read from ``base_dir`` on its own and only its quantized form
    is kept in memory; the FP32 initializers a target replaced are dropped.
    Works above 2 GiB (nothing is serialized). ``weight_cache`` (a dict the caller
    keeps) holds each quantized weight by name, so repeated calls on variants of one
    graph (the sensitivity and budget trials) quantize every weight once.

    Raises:
        QuantizationError: an activation has no calibrated amax, or an invalid one.
    """
    if not inplace:
        model = copy.deepcopy(model)
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    new_inits, done_act, done_w = [], {}, {}
    by_node = {t.node: t for t in targets}
    nodes = []
    for node in g.node:
        t = by_node.get(node.name)
        if t is not None:
            if t.act not in done_act:
                done_act[t.act] = _act_qdq(t.act, act_amax, fmt, nodes, new_inits)
            if t.weight not in done_w:
                done_w[t.weight] = _weight_dq(inits[t.weight], t, fmt, per_channel, nodes, new_inits, base_dir,
                                              weight_cache)
            node.input[0], node.input[1] = done_act[t.act], done_w[t.weight]
        nodes.append(node)
    used = {i for n in nodes for i in n.input}
    for i in reversed(range(len(g.initializer))):  # in place: kept weights are not copied
        if g.initializer[i].name not in used:
            del g.initializer[i]
    del g.node[:]
    g.node.extend(nodes)
    g.initializer.extend(new_inits)
    return model


def _act_qdq(name: str, amax: dict[str, float], fmt: QFormat, nodes: list, inits: list) -> str:
    if name not in amax:
        raise QuantizationError(f"activation {name!r} has no calibration statistics")
    scale = numpy_helper.from_array(scale_from_amax(amax[name], fmt, name), f"{name}_scale")
    zp = _zero_point(fmt, f"{name}_zero_point")
    inits += [scale, zp]
    q, dq = f"{name}_quantized", f"{name}_dequantized"
    nodes.append(helper.make_node("QuantizeLinear", [name, scale.name, zp.name], [q], name=f"{name}_QuantizeLinear"))
    nodes.append(helper.make_node("DequantizeLinear", [q, scale.name, zp.name], [dq], name=f"{name}_DequantizeLinear"))
    return dq


def quantized_weight(w: onnx.TensorProto, t: Target, fmt: QFormat, per_channel: bool, base_dir: str = "",
                     cache: dict | None = None, values: np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray, int | None]:
    """``(q, scale, axis)`` of target ``t``'s weight ``w`` (:func:`quantize_weight`), from ``cache``
    (keyed by weight, format and axis) when it holds them; ``values``: ``w``'s float32 values
    when the caller holds them (else read from ``w``, or from ``base_dir`` when external)."""
    axis = t.weight_axis if per_channel else None
    key = (w.name, fmt.name, fmt.weights().qmax, fmt.weight_clip, axis)
    if cache is not None and key in cache:
        q, scale = cache[key]
    else:
        q, scale = quantize_weight(initializer_array(w, base_dir) if values is None else values, fmt.weights(), axis)
        if cache is not None:
            cache[key] = (q, scale)
    return q, scale, axis


def dequantized(q: np.ndarray, scale: np.ndarray, axis: int | None) -> np.ndarray:
    """float32 ``q * scale`` (zero point 0, ``scale`` along ``axis``): DequantizeLinear's values,
    each one float32 product as ONNX Runtime computes it."""
    if axis is not None:
        scale = np.expand_dims(scale, tuple(i for i in range(q.ndim) if i != axis))
    return q.astype(np.float32) * scale.astype(np.float32)


def _weight_dq(w: onnx.TensorProto, t: Target, fmt: QFormat, per_channel: bool, nodes: list, inits: list,
               base_dir: str, cache: dict | None = None) -> str:
    q, scale, axis = quantized_weight(w, t, fmt, per_channel, base_dir, cache)
    zp_shape = () if axis is None else scale.shape
    qi = numpy_helper.from_array(q, f"{w.name}_quantized")
    si = numpy_helper.from_array(scale, f"{w.name}_scale")
    zi = _zero_point(fmt, f"{w.name}_zero_point", zp_shape)
    inits += [qi, si, zi]
    attrs = {} if axis is None else {"axis": axis}
    out = f"{w.name}_dequantized"
    nodes.append(helper.make_node("DequantizeLinear", [qi.name, si.name, zi.name], [out], name=f"{w.name}_DequantizeLinear", **attrs))
    return out


def uint8_activations(model: onnx.ModelProto) -> int:
    """Rewrite, in place, every activation QuantizeLinear of INT8 with zero point 0 (and the
    DequantizeLinear sharing its zero point) to UINT8 with zero point 128. The values are the
    same: ``u = q + 128`` and ``(u - 128) * s = q * s`` for every ``q`` in [-127, 127].

    Why: ONNX Runtime's x86 integer GEMMs take u8 activations times s8 weights, and its
    graph transformers convert INT8 activations only in some patterns. Seen with onnxruntime
    1.31.1 at level ``all`` on int8-encoder (7-bit weights): as written, 12 of 30 GEMMs became
    MatMulIntegerToFloat; the Q, K and V projections, which share one activation Q, stayed
    dequantize + FP32 MatMul (also with one Q per GEMM). After this rewrite all 30 fused:
    1.07x -> 1.38x FP32's throughput (AVX-512 VNNI, batch 8 x 64 tokens). TensorRT takes
    INT8 activations only, so this is a CPU graph beside the TensorRT one
    (:class:`pipeline.artifacts.QuantizedArtifact`).

    Returns:
        The number of zero points rewritten.

    Raises:
        QuantizationError: an activation zero point is not INT8 zeros.
    """
    inits = {t.name: t for t in model.graph.initializer}
    names = {n.input[2] for n in model.graph.node if n.op_type == "QuantizeLinear" and len(n.input) > 2}
    for name in sorted(names):
        zp = numpy_helper.to_array(inits[name])
        if zp.dtype != np.int8 or zp.any():
            raise QuantizationError(f"activation zero point {name!r} is {zp.dtype} {zp.ravel()[:3].tolist()}, "
                                    "not INT8 zeros; only symmetric INT8 Q/DQ converts to UINT8")
        inits[name].CopyFrom(numpy_helper.from_array(np.full(zp.shape, 128, np.uint8), name))
    return len(names)
