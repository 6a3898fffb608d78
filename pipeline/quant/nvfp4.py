"""NVFP4 weight-only GEMMs: FP4 E2M1 values in 16-element blocks along K, one FP8 E4M3 scale per
block and one FP32 scale per tensor, as two DequantizeLinear (opset 23, IR 11)::

    block_scales [K/16, N] FLOAT8E4M3FN --DequantizeLinear(tensor_scale FP32 scalar)--> scales [K/16, N] float32
    values [K, N] FLOAT4E2M1 --DequantizeLinear(scales, axis=0, block_size=16)---------> W [K, N] float32
    x [.., K] --MatMul(W)--> y [.., N]

The weight is ``W[k, n] = v[k, n] * fl(s8[k // 16, n] * t)`` (ONNX DequantizeLinear: the FP8 scale
times the FP32 tensor scale, rounded once to float32, then times the FP4 value, which has at most two
significant bits, so that product is exact unless it underflows).

Quantizer (round to nearest, ``quantize.weights.method: rtn``), as NVIDIA describes NVFP4 (the
"Introducing NVFP4" technical blog, 2025; ModelOpt's NVFP4 recipe): the tensor scale
``t = amax(|W|) / (6 * 448)`` (6: E2M1's largest value, 448: E4M3's), per block
``s8 = E4M3(amax_block / 6 / t)`` (round to nearest even, at most 448), and each value
``v = E2M1(w / fl(s8 * t))`` rounded to the nearest of ±{0, 0.5, 1, 1.5, 2, 3, 4, 6} (ties to even,
saturating at ±6). The casts are ``ml_dtypes``' (float4_e2m1fn, float8_e4m3fn), the bit packing
``onnx.numpy_helper``'s.

Measured here (TensorRT-RTX 1.7.1, no GPU): this form on a 576 x 1536 MatMul builds for sm120
(a 647,180-byte engine for 884,736 weights: the weights stay 4-bit) and is refused for sm89
("Cannot compile for target(s) sm89, because the model contains HW-specific datatypes: fp4_e2m1"),
sm86 and sm75 (fp4_e2m1, fp8_e4m3). ONNX Runtime 1.31 has no FP4 DequantizeLinear on its CPU
provider, so validate and the Triton repository run :func:`decoded_graph`'s twin: the same graph
with each GEMM's weight decoded exactly to FP32 (``W`` above, an initializer) at the export's
opset: "FP4 simulated: decoded to FP32 on this CPU".
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pipeline.errors import QuantizationError
from pipeline.onnx_io import initializer_array
# the GEMM finder and graph helpers of the INT4 writer: one home for "which MatMul has a weight"
from pipeline.quant.int4 import _drop_unused, _gemms, raise_opset as _raise_to_21

#: NVFP4's block: 16 FP4 values along K share one FP8 E4M3 scale
BLOCK = 16
#: the largest magnitudes of E2M1 and E4M3
FP4_MAX, FP8_MAX = 6.0, 448.0
#: FLOAT4E2M1 came with opset 23 and IR version 11 (onnx/docs/Changelog.md, docs/IR.md)
MIN_OPSET, MIN_IR = 23, 11
#: the label of the form in reports (pipeline.trt.report.block_weight_formats)
FORM = f"NVFP4 block {BLOCK}"


@dataclass(frozen=True)
class NVFP4Weight:
    """One GEMM weight in NVFP4.

    ``values``: ``ml_dtypes.float4_e2m1fn [K, N]``; ``block_scales``: ``ml_dtypes.float8_e4m3fn
    [K/16, N]``; ``tensor_scale``: float32 scalar (> 0).
    """

    values: np.ndarray
    block_scales: np.ndarray
    tensor_scale: np.float32

    def scales(self) -> np.ndarray:
        """The FP32 block scales ``fl(s8 * t)`` ``[K/16, N]``, as the first DequantizeLinear computes them."""
        return self.block_scales.astype(np.float32) * np.float32(self.tensor_scale)

    def decode(self) -> np.ndarray:
        """``W [K, N]`` float32, exactly as the two DequantizeLinear compute it (module notes)."""
        s = np.repeat(self.scales(), BLOCK, axis=0)
        return self.values.astype(np.float32) * s


def quantize(w: np.ndarray, where: str = "weight") -> NVFP4Weight:
    """Round ``w [K, N]`` (float32, K a multiple of 16) to NVFP4 (module notes: round to nearest).

    A block whose FP32 scale underflows E4M3 (amax below about ``2**-9 * t * 6``) becomes zeros.

    Raises:
        QuantizationError: ``K`` is not a multiple of 16, or ``w`` holds a NaN or infinity
            (names ``where``, K and the first bad element).
    """
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise QuantizationError(f"{where}: NVFP4 needs a 2-D weight [K, N], got shape {list(w.shape)}")
    k, n = w.shape
    if k % BLOCK:
        raise QuantizationError(f"{where}: K = {k} is not a multiple of NVFP4's {BLOCK}-element blocks (FP4 values "
                                f"per FP8 scale along the GEMM's input dimension); TensorRT refuses a partial block")
    bad = np.argwhere(~np.isfinite(w))
    if bad.size:
        raise QuantizationError(f"{where}: element {tuple(int(i) for i in bad[0])} is {w[tuple(bad[0])]}: NVFP4 needs "
                                "finite weights")
    amax = float(np.abs(w).max()) if w.size else 0.0
    t = np.float32(amax / (FP4_MAX * FP8_MAX)) if amax > 0 else np.float32(1.0)
    if not t > 0:  # amax so small that the tensor scale underflows float32
        t = np.float32(np.finfo(np.float32).tiny)
    blocks = w.reshape(k // BLOCK, BLOCK, n)
    block_amax = np.abs(blocks).max(axis=1)
    s8 = np.minimum(block_amax / np.float32(FP4_MAX) / t, np.float32(FP8_MAX)).astype(ml_dtypes.float8_e4m3fn)
    scale = s8.astype(np.float32) * t
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(scale[:, None, :] > 0, blocks / scale[:, None, :], np.float32(0))
    values = np.clip(v, -FP4_MAX, FP4_MAX).reshape(k, n).astype(ml_dtypes.float4_e2m1fn)
    return NVFP4Weight(values, s8, t)


def initializers(q: NVFP4Weight, prefix: str) -> list[TensorProto]:
    """``{prefix}.values`` (FLOAT4E2M1 ``[K, N]``, two per byte), ``{prefix}.block_scales``
    (FLOAT8E4M3FN ``[K/16, N]``) and ``{prefix}.tensor_scale`` (float32 scalar)."""
    return [numpy_helper.from_array(q.values, f"{prefix}.values"),
            numpy_helper.from_array(q.block_scales, f"{prefix}.block_scales"),
            numpy_helper.from_array(np.array(q.tensor_scale, np.float32), f"{prefix}.tensor_scale")]


def dequantize_nodes(prefix: str, name: str) -> list[onnx.NodeProto]:
    """The two DequantizeLinear making ``{prefix}.dequantized`` (float32 ``[K, N]``)."""
    return [helper.make_node("DequantizeLinear", [f"{prefix}.block_scales", f"{prefix}.tensor_scale"],
                             [f"{prefix}.scales"], name=f"{name}/scale_DequantizeLinear"),
            helper.make_node("DequantizeLinear", [f"{prefix}.values", f"{prefix}.scales"], [f"{prefix}.dequantized"],
                             name=f"{name}/DequantizeLinear", axis=0, block_size=BLOCK)]


@dataclass(frozen=True)
class Rewritten:
    """One MatMul now reading an NVFP4 weight: ``node`` (its name, kept), ``weight`` (the FP32
    initializer it read), ``k``/``n`` (the GEMM's K and N), ``max_abs_error`` (max |decode - FP32
    weight|) and ``rel_rms_error`` (RMS of that error over the RMS of the weight)."""

    node: str
    weight: str
    k: int
    n: int
    max_abs_error: float
    rel_rms_error: float


def rewrite_matmuls(model: onnx.ModelProto, decoded: onnx.ModelProto, *, base_dir: str = "",
                    skip: frozenset[str] = frozenset()) -> list[Rewritten]:
    """Rewrite, in place, every MatMul whose ``B`` is a 2-D FP32 initializer ``[K, N]`` (or
    ``Transpose(perm=[1, 0])`` of one ``[N, K]``: a tied lm_head) and whose node name is not in
    ``skip``: ``model`` gets the NVFP4 form (module notes), ``decoded`` (a copy of the same graph)
    the decoded FP32 weight ``{prefix}.decoded [K, N]``. Weights no GEMM reads any more are dropped
    from both (a table a Gather reads stays), and so are Transposes left unused. ``model``'s
    default-domain opset is raised to 23 and its IR version to 11; ``decoded`` keeps its own.

    Args:
        model, decoded: the exported graph twice (``decoded = ModelProto(); decoded.CopyFrom(model)``),
            possibly loaded without external data (then ``base_dir`` is the model file's folder).

    Returns:
        One :class:`Rewritten` per MatMul, in graph order.

    Raises:
        QuantizationError: a GEMM's K is not a multiple of 16, or its weight is not finite (names
            the MatMul, the initializer and K); an op means something else at opset 21 than at the
            graph's opset (:func:`pipeline.quant.int4.raise_opset`).
    """
    gemms = [g for g in _gemms(model) if g.node.name not in skip]
    inits = {t.name: t for t in model.graph.initializer}
    done: list[Rewritten] = []
    made: dict[tuple[str, bool], tuple[str, NVFP4Weight]] = {}
    replace_q: dict[str, list[onnx.NodeProto]] = {}
    new_q: list[TensorProto] = []
    new_d: list[TensorProto] = []
    for gm in gemms:
        key = (gm.weight, gm.transposed)
        w = initializer_array(inits[gm.weight], base_dir)
        w = w.T if gm.transposed else w  # [K, N]
        where = f"MatMul {gm.node.name!r} (initializer {gm.weight!r}, K = {w.shape[0]}, N = {w.shape[1]})"
        first = key not in made
        if first:
            prefix = f"nvfp4.{gm.weight}" + (".T" if gm.transposed else "")
            q = quantize(w, where)
            made[key] = (prefix, q)
            new_q += initializers(q, prefix)
            new_d.append(numpy_helper.from_array(q.decode(), f"{prefix}.dequantized"))
        prefix, q = made[key]
        err = q.decode() - w
        rms = float(np.sqrt(np.mean(np.square(w, dtype=np.float64)))) if w.size else 0.0
        done.append(Rewritten(gm.node.name, gm.weight, int(w.shape[0]), int(w.shape[1]), float(np.abs(err).max()),
                              float(np.sqrt(np.mean(np.square(err, dtype=np.float64))) / rms) if rms else 0.0))
        del w, err
        mm = helper.make_node("MatMul", [gm.node.input[0], f"{prefix}.dequantized"], list(gm.node.output),
                              name=gm.node.name)
        replace_q[gm.node.name] = (dequantize_nodes(prefix, gm.node.name) if first else []) + [mm]
    for m, extra, nodes_for in ((model, new_q, lambda n: replace_q.get(n.name)),
                                (decoded, new_d, lambda n: [_repoint(n, made, gemms)] if n.name in replace_q else None)):
        g = m.graph
        nodes = [r for n in g.node for r in (nodes_for(n) or [n])]
        del g.node[:]
        g.node.extend(nodes)
        g.initializer.extend(extra)
        _drop_unused(g, {gm.via for gm in gemms if gm.via}, {gm.weight for gm in gemms})
    if done:
        raise_opset(model)
    return done


def _repoint(node: onnx.NodeProto, made: dict, gemms: list) -> onnx.NodeProto:
    """The decoded graph's MatMul: ``B`` is the decoded initializer."""
    gm = next(g for g in gemms if g.node.name == node.name)
    out = onnx.NodeProto()
    out.CopyFrom(node)
    out.input[1] = f"{made[(gm.weight, gm.transposed)][0]}.dequantized"
    return out


def raise_opset(model: onnx.ModelProto) -> None:
    """Default-domain opset >= 23 and IR >= 11, in place. Up to 21 as
    :func:`pipeline.quant.int4.raise_opset` (which refuses ops whose meaning changed); from 21 to 23
    no operator changed meaning: opset 22 added bfloat16 to ops, and opset 23 float4e2m1 (and
    the optional attributes ``output_dtype`` of DequantizeLinear and ``precision`` of
    QuantizeLinear, whose defaults are the old behaviour) (onnx/docs/Changelog.md; checked
    against ``onnx.defs``' schemas in tests/unit/quant/test_nvfp4.py).

    Raises:
        QuantizationError: as :func:`pipeline.quant.int4.raise_opset`.
    """
    _raise_to_21(model)
    for op in model.opset_import:
        if op.domain in ("", "ai.onnx"):
            op.version = max(op.version, MIN_OPSET)
    model.ir_version = max(model.ir_version, MIN_IR)


def is_fp4(t: TensorProto | None) -> bool:
    """``t`` is a FLOAT4E2M1 initializer."""
    return t is not None and t.data_type == TensorProto.FLOAT4E2M1
