"""GGUF blocks in the ONNX graph: blocked DequantizeLinear + MatMul (opset 21), plus an offset term.

:func:`block_matmul` writes ``y = x @ W^T`` for a GGUF weight ``W [N, K]`` split by
:meth:`pipeline.quant.gguf_blocks.BlockTensor.dq_form` into integers, positive block scales and
block offsets (``W = values * scales + offsets`` per block of ``block_size`` along ``K``)::

    values [K, N] INT4/INT8 --DequantizeLinear(axis=0, block_size)--> [K, N] float32
    x [.., K] --------------------------------------------MatMul----> y_main [.., N]
    x [.., K] -Reshape-> [.., K/bs, bs] -ReduceSum(-1)-> [.., K/bs] -MatMul(offsets [K/bs, N])-> y_off
    y = y_main + y_off                                     (the offset branch only when offsets exist)

since ``sum_k x_k (v_k s_b + o_b) = sum_k x_k v_k s_b + sum_b (sum_{k in b} x_k) o_b``. Zero points
are left out (0: ONNX's default), as TensorRT accepts only 0; TensorRT-RTX 1.7 refuses UINT4 with
a zero point, so GGML's unsigned codes are re-centred (``q - 8``) with the rest in the offsets.

Measured here (TensorRT-RTX 1.7 builds without a GPU): blocked INT4 DequantizeLinear (block 32,
axis 0) + MatMul and the offset branch build for sm86, sm89 and sm120 and are refused for sm75
("HW-specific datatypes: int4"); blocked INT8 (block 16 or 32) builds for sm86/89/120; INT8 scales
must be > 0. ONNX Runtime 1.31 at graph optimization level ``all`` fuses the DequantizeLinear +
MatMul into ``com.microsoft.MatMulNBits``; its default ``accuracy_level`` 4 quantizes the activations
to INT8, so set session config ``session.qdq_matmulnbits_accuracy_level`` to ``"1"``
(:data:`ORT_ACCURACY_CONFIG`) to compute in FP32.

Tolerance: the forms without offsets (Q8_0, Q6_K, Q4_0 whose scales are all positive) hold GGML's
float32 weight exactly, and so do Q4_0's offsets (``-d``). Q4_1 / Q4_K offsets ``fl(m + 8d)`` may
round once per block, so the form's weight ``W'`` differs from GGML's exact ``d*q + m`` by at most
half an ulp of the offset, and from GGML's float32 weight ``W`` by that plus half an ulp of ``W``
(:func:`pipeline.quant.gguf_blocks.form_error`; ``W' = W`` exactly in all 4,202,496 blocks of
SmolLM2-135M-Instruct.Q4_1.gguf). Against the exact product ``x @ W^T``, the output obeys
``|y - x @ W^T| <= (K + K/bs + 2) * 2**-24 * (|x| @ |W|^T) + sum_b |sum_{k in b} x_k| * max_{k in b} |W' - W|``
(float32 summation; the last term is 0 where the form is exact). tests/test_gguf_blocks.py checks
it for every type through ONNX Runtime (MatMulNBits, accuracy level 1); measured errors are about
1% of the bound (K = 256: 2e-5 to 2e-4).
"""
from __future__ import annotations

import hashlib
from collections.abc import Collection
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, external_data_helper, helper, numpy_helper

from pipeline.errors import QuantizationError
from pipeline.onnx_io import initializer_array
from pipeline.quant.gguf_blocks import (FLOAT_TYPES, SUPPORTED, BlockTensor, DQForm, GGUFWeightError, form_error,
                                        from_bytes, hf_module, hf_row_order, prove_decode, read_tensor)
from pipeline.quant.qdq import node_scope

#: the ONNX Runtime session config entry that keeps MatMulNBits in FP32 (``accuracy_level`` 1)
ORT_ACCURACY_CONFIG = ("session.qdq_matmulnbits_accuracy_level", "1")
#: blocked DequantizeLinear (``block_size``) and INT4 need default-domain opset 21 and IR 10
MIN_OPSET, MIN_IR = 21, 10
#: the GGUF name of the (tied) token embedding
EMBEDDING = "token_embd.weight"


@dataclass(frozen=True)
class Rewritten:
    """One MatMul now computing with a GGUF tensor's blocks.

    ``node``: the MatMul's name (kept by the new MatMul); ``tensor`` / ``ggml_type``: the GGUF
    tensor; ``onnx_form``: ``"INT4 block 32"``, ``"INT4 block 32 + offsets"``, ...;
    ``row_order``: ``"gguf"`` or ``"llama q/k reverse permutation"``; ``rounded_offsets``: blocks
    whose offset was rounded (:func:`pipeline.quant.gguf_blocks.form_error`) of ``blocks``;
    ``max_weight_error``: max |DQ form weight - GGML's float32 weight|.
    """

    node: str
    tensor: str
    ggml_type: str
    onnx_form: str
    row_order: str
    rounded_offsets: int
    blocks: int
    max_weight_error: float


def onnx_form(form: DQForm) -> str:
    """``"INT4 block 32 + offsets"`` and the like."""
    return f"INT{form.bits} block {form.block_size}" + (" + offsets" if form.offsets is not None else "")


def weight_initializers(form: DQForm, prefix: str) -> list[TensorProto]:
    """``{prefix}.values`` (INT4 / INT8 ``[K, N]``), ``{prefix}.scales`` (float32 ``[K/bs, N]``)
    and, with offsets, ``{prefix}.offsets`` (float32 ``[K/bs, N]``). INT4 is packed two per byte,
    low nibble first (``onnx.numpy_helper.from_array`` of an ``ml_dtypes.int4`` array)."""
    values, scales, offsets = form.onnx_arrays()
    if form.bits == 4:
        values = values.astype(ml_dtypes.int4)
    inits = [numpy_helper.from_array(values, f"{prefix}.values"), numpy_helper.from_array(scales, f"{prefix}.scales")]
    if offsets is not None:
        inits.append(numpy_helper.from_array(offsets, f"{prefix}.offsets"))
    return inits


def block_matmul(form: DQForm, x: str, y: str, *, name: str, prefix: str, x_rank: int,
                 emit_weight: bool = True, x_block_sums: str | None = None
                 ) -> tuple[list[onnx.NodeProto], list[TensorProto]]:
    """Nodes (in order) and initializers computing ``y = x @ W^T`` for ``form``'s ``W [N, K]``.

    Args:
        form: the weight's DQ form (:meth:`~pipeline.quant.gguf_blocks.BlockTensor.dq_form`).
        x: the activation, float32 ``[.., K]`` of rank ``x_rank`` (>= 1; the offset branch's
            Reshape keeps the leading dims with 0s).
        y: the output, float32 ``[.., N]``.
        name: the main MatMul's name (the GEMM's name in reports; other nodes get ``name/...``).
        prefix: the initializers' name prefix (:func:`weight_initializers`); the dequantized
            weight is ``{prefix}.dequantized``.
        emit_weight: False where an earlier GEMM on the same tensor (same ``prefix``) already
            emitted the initializers and the DequantizeLinear, which this one then shares.
        x_block_sums: the name of ``x``'s block sums ``[.., K/bs]`` when another GEMM on ``x``
            made them (its ``name/x_block_sums``); None: make them here.

    Returns:
        ``(nodes, initializers)``: DequantizeLinear (``axis=0``, ``block_size``), MatMul and,
        with offsets, Reshape, ReduceSum (``keepdims=0``), MatMul and Add, with their int64 shape
        and axes constants.
    """
    n, k = form.values.shape
    bs = form.block_size
    inits = weight_initializers(form, prefix) if emit_weight else []
    dq = f"{prefix}.dequantized"
    nodes = [helper.make_node("DequantizeLinear", [f"{prefix}.values", f"{prefix}.scales"], [dq],
                              name=f"{name}/DequantizeLinear", axis=0, block_size=bs)] if emit_weight else []
    if form.offsets is None:
        nodes.append(helper.make_node("MatMul", [x, dq], [y], name=name))
        return nodes, inits
    main, off = f"{y}/main", f"{name}/offset_term"
    nodes.append(helper.make_node("MatMul", [x, dq], [main], name=name))
    sums = x_block_sums
    if sums is None:
        shape, axes, blocks, sums = f"{name}/block_shape", f"{name}/last_axis", f"{name}/x_blocks", f"{name}/x_block_sums"
        inits += [numpy_helper.from_array(np.array([0] * (x_rank - 1) + [k // bs, bs], np.int64), shape),
                  numpy_helper.from_array(np.array([-1], np.int64), axes)]
        nodes += [helper.make_node("Reshape", [x, shape], [blocks], name=f"{name}/Reshape"),
                  helper.make_node("ReduceSum", [blocks, axes], [sums], name=f"{name}/ReduceSum", keepdims=0)]
    nodes += [helper.make_node("MatMul", [sums, f"{prefix}.offsets"], [off], name=f"{name}/offset_MatMul"),
              helper.make_node("Add", [main, off], [y], name=f"{name}/Add")]
    return nodes, inits


# --- rewriting an exported graph ---------------------------------------------------------------


@dataclass(frozen=True)
class _Gemm:
    node: onnx.NodeProto
    weight: str            # the FP32 initializer
    transposed: bool       # B = Transpose(weight) (weight [N, K]); else B = weight [K, N]
    via: str               # the Transpose node's name, when transposed


def _gemms(model: onnx.ModelProto) -> list[_Gemm]:
    """MatMuls whose B is a 2-D FP32 initializer, directly or through ``Transpose(perm=[1, 0])``."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}

    def fp32_2d(name: str) -> bool:
        t = inits.get(name)
        return t is not None and t.data_type == TensorProto.FLOAT and len(t.dims) == 2

    out = []
    for n in g.node:
        if n.op_type != "MatMul" or len(n.input) < 2 or n.input[0] in inits:
            continue
        b = n.input[1]
        if fp32_2d(b):
            out.append(_Gemm(n, b, False, ""))
            continue
        p = producer.get(b)
        perm = next((list(a.ints) for a in p.attribute if a.name == "perm"), None) if p is not None else None
        if p is not None and p.op_type == "Transpose" and perm == [1, 0] and fp32_2d(p.input[0]):
            out.append(_Gemm(n, p.input[0], True, p.name))
    return out


def _fingerprint(w: np.ndarray) -> tuple:
    """Shape and a digest of the values, +0 and -0 alike (``w + 0.0``)."""
    w = np.ascontiguousarray(w, np.float32) + np.float32(0)
    return w.shape, hashlib.blake2b(w.tobytes(), digest_size=16).digest()


def _ranks(model: onnx.ModelProto, names: set[str]) -> dict[str, int]:
    """Ranks of ``names`` from the graph's inputs, value_info and outputs, else from shape
    inference on a light copy (large initializers turned into graph inputs of their type and
    shape; shape inference needs no weights)."""
    g = model.graph
    known = {v.name: len(v.type.tensor_type.shape.dim) for v in [*g.input, *g.value_info, *g.output]
             if v.type.tensor_type.HasField("shape")}
    if names <= known.keys():
        return known
    big = [t for t in g.initializer if external_data_helper.uses_external_data(t) or len(t.raw_data) > 4096]
    big_names = {t.name for t in big}
    light = helper.make_model(
        helper.make_graph(list(g.node), g.name or "g",
                          [*g.input, *(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in big)],
                          list(g.output), [t for t in g.initializer if t.name not in big_names],
                          value_info=list(g.value_info)),
        opset_imports=list(model.opset_import), ir_version=model.ir_version)
    light.functions.extend(model.functions)
    inferred = onnx.shape_inference.infer_shapes(light).graph
    known.update({v.name: len(v.type.tensor_type.shape.dim) for v in [*inferred.value_info, *inferred.output]
                  if v.type.tensor_type.HasField("shape")})
    return known


def _gguf_weights(reader, tensors: Collection[str] | None):
    """``(name, type name, W [N, K] float32 in GGUF row order, row order or None)`` of the 2-D
    tensors of ``reader`` (those in ``tensors`` when given; all but :data:`EMBEDDING` when None);
    supported types decoded here, other types by ``gguf.quants.dequantize`` (to be refused by
    name if a GEMM holds them), types gguf cannot decode skipped."""
    import gguf

    for t in reader.tensors:
        if len(t.shape) != 2 or (t.name not in tensors if tensors is not None else t.name == EMBEDDING):
            continue
        kind = t.tensor_type.name
        if kind in SUPPORTED:
            k, n = (int(s) for s in t.shape)
            w = from_bytes(t.name, kind, t.data, (n, k)).ggml_decode()
        else:
            try:
                w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
            except (NotImplementedError, KeyError, ValueError):
                continue
        order = hf_row_order(reader, t.name)
        yield t.name, kind, w, order


def rewrite_matmuls(model: onnx.ModelProto, reader, *, base_dir: str = "",
                    tensors: Collection[str] | None = None) -> list[Rewritten]:
    """Rewrite, in place, every MatMul whose FP32 weight is a GGUF tensor's decoded weight into
    :func:`block_matmul`'s form (the graph computes the same function, see the module notes).

    A MatMul qualifies when its ``B`` is a 2-D FP32 initializer ``[K, N]``, or
    ``Transpose(perm=[1, 0])`` of one ``[N, K]`` (a tied lm_head), and that weight equals, element
    for element, the decode of a 2-D GGUF tensor ``[N, K]`` in GGUF's row order or with
    llama.cpp's q/k rotary permutation undone (:func:`~pipeline.quant.gguf_blocks.hf_row_order`,
    as transformers loads it). Candidates are found by a digest of the values and then proved
    by :func:`~pipeline.quant.gguf_blocks.prove_decode`. FP32 weights no GEMM uses any more are
    dropped (a table a Gather reads stays FP32), and so are Transposes left unused. The default
    domain's opset is raised to >= 21 and the IR version to >= 10 (no operator the exporter emits
    changed meaning from opset 19 to 21; 20 and 21 added types).

    Args:
        model: the exported graph; may be loaded without external data (``base_dir`` then is
            the model file's folder).
        reader: a ``gguf.GGUFReader`` (:func:`pipeline.quant.gguf_blocks.open_gguf`).
        tensors: GGUF tensor names to use; None: every 2-D tensor but :data:`EMBEDDING` (the tied
            lm_head is :func:`rewrite_tied_lm_head`'s).

    Returns:
        One :class:`Rewritten` per rewritten MatMul, in graph order. MatMuls matching nothing
        are left as they are, unless their module is a GGUF tensor's (below).

    Raises:
        GGUFWeightError: a GEMM's weight is a GGUF tensor of a type not in
            :data:`~pipeline.quant.gguf_blocks.SUPPORTED` (names the tensor, type and node); a
            MatMul of a module the GGUF file holds (its ``pkg.torch.onnx.name_scopes`` ends in
            :func:`~pipeline.quant.gguf_blocks.hf_module`'s name, e.g. ``layers.0.self_attn.q_proj``)
            whose weight is not that tensor's decode (names the tensor and the first differing
            element); a block has a NaN or infinite scale; an INT8 block cannot get a positive scale.
    """
    gemms = _gemms(model)
    if not gemms:
        return []
    inits = {t.name: t for t in model.graph.initializer}
    by_print: dict[tuple, list[_Gemm]] = {}
    for gm in gemms:  # each weight read once, its digest kept, its values dropped
        w = initializer_array(inits[gm.weight], base_dir)
        by_print.setdefault(_fingerprint(w if gm.transposed else w.T), []).append(gm)
    matched: dict[str, tuple[str, str, np.ndarray | None]] = {}  # node -> tensor, type, row order
    for name, kind, w, order in _gguf_weights(reader, tensors):
        for rows in (None, order) if order is not None else (None,):
            for gm in by_print.get(_fingerprint(w if rows is None else w[rows]), []):
                matched.setdefault(gm.node.name, (name, kind, rows))
    _refuse_paired(model, [gm for gm in gemms if gm.node.name not in matched], reader, tensors, base_dir)
    for gm in gemms:
        hit = matched.get(gm.node.name)
        if hit is not None and hit[1] not in SUPPORTED:
            raise GGUFWeightError(
                f"MatMul {gm.node.name!r}: its weight {gm.weight!r} is GGUF tensor {hit[0]!r}, stored as {hit[1]} "
                f"({'a float type' if hit[1] in FLOAT_TYPES else 'a block type'} with no block DequantizeLinear form "
                f"here; supported: {', '.join(SUPPORTED)}); leave it out (tensors=) or keep the FP32 path")
    done = _apply(model, [gm for gm in gemms if gm.node.name in matched], matched, reader, base_dir)
    raise_opset(model)
    return done


def _refuse_paired(model: onnx.ModelProto, unmatched: list[_Gemm], reader, tensors: Collection[str] | None,
                   base_dir: str) -> None:
    """Raise for an unmatched MatMul whose module (``pkg.torch.onnx.name_scopes``, e.g.
    ``model.model.layers.0.self_attn.q_proj``) is a GGUF tensor's (:func:`~pipeline.quant.
    gguf_blocks.hf_module`): its weight should be that tensor's decode and is not."""
    modules = {}
    for t in reader.tensors:
        if len(t.shape) == 2 and (t.name in tensors if tensors is not None else t.name != EMBEDDING):
            module = hf_module(reader, t.name)
            if module is not None:
                modules[module] = t.name
    if not modules:
        return
    inits = {t.name: t for t in model.graph.initializer}
    for gm in unmatched:
        scope = node_scope(gm.node)
        name = next((v for k, v in modules.items() if scope == k or scope.endswith("." + k)), None)
        if name is None:
            continue
        block = read_tensor(reader, name)  # an unsupported type is refused here, by name
        order = hf_row_order(reader, name)
        w = initializer_array(inits[gm.weight], base_dir)
        prove_decode(block if order is None else block.rows(order), w if gm.transposed else w.T,
                     f"MatMul {gm.node.name!r} of module {scope!r}, initializer {gm.weight!r}")


def rewrite_tied_lm_head(model: onnx.ModelProto, reader, *, base_dir: str = "",
                         tensor: str = EMBEDDING) -> Rewritten:
    """Rewrite the lm_head MatMul of a tied embedding: ``logits = h @ Transpose(table)`` where
    ``table [V, H]`` is both the token embedding a Gather reads and, decoded, GGUF tensor
    ``tensor`` (Q8_0 in SmolLM2's file). The MatMul gets the blocks as INT8 (Q8_0: block 32
    along ``H``, exact) through :func:`rewrite_matmuls`; the Gather keeps the FP32 table, which
    Q8_0 decodes to exactly.

    Raises:
        GGUFWeightError: no MatMul reads ``Transpose(table)`` of a table equal to ``tensor``'s
            decode, or that table is not also a Gather's data; as :func:`rewrite_matmuls`.
    """
    tied = [gm for gm in _gemms(model) if gm.transposed and any(
        n.op_type == "Gather" and n.input[0] == gm.weight for n in model.graph.node)]
    if not tied:
        raise GGUFWeightError(f"GGUF tensor {tensor!r}: the graph has no MatMul on Transpose(table) of a table a Gather "
                              "also reads (a tied embedding / lm_head)")
    done = [r for r in rewrite_matmuls(model, reader, base_dir=base_dir, tensors=[tensor])
            if r.node in {gm.node.name for gm in tied}]
    if not done:
        raise GGUFWeightError(f"GGUF tensor {tensor!r} does not decode to the tied table "
                              f"{', '.join(sorted({gm.weight for gm in tied}))} (read by the lm_head MatMul "
                              f"{', '.join(gm.node.name for gm in tied)})")
    return done[0]


#: ops whose definitions from this opset version up to 21 differ only by added types (opsets
#: 20 and 21 added int4/uint4, bfloat16 and float8 to them; DequantizeLinear / QuantizeLinear 21
#: also added block_size and output_dtype, defaulting to the old behaviour). An op of the graph
#: whose definition changed otherwise (DFT, GridSample at 20; ReduceSum at 18 ...) is refused.
TYPES_ONLY_UP_TO_21 = {"Cast": 19, "CastLike": 19, "Constant": 19, "ConstantOfShape": 9, "DequantizeLinear": 19,
                       "QuantizeLinear": 19, "Flatten": 13, "Identity": 19, "If": 19, "Loop": 19, "Scan": 19,
                       "Pad": 19, "QLinearMatMul": 10, "Reshape": 14, "Shape": 15, "Size": 19, "Squeeze": 13,
                       "Unsqueeze": 13, "Transpose": 13, "IsInf": 10, "IsNaN": 13}


def raise_opset(model: onnx.ModelProto) -> None:
    """Default-domain opset >= :data:`MIN_OPSET` and IR version >= :data:`MIN_IR`, in place.

    Raises:
        QuantizationError: an op of the graph (subgraphs included) means something else at
            opset 21 than at the graph's opset (see :data:`TYPES_ONLY_UP_TO_21`); names them.
    """
    ops = [op for op in model.opset_import if op.domain in ("", "ai.onnx")]
    old = ops[0].version if ops else MIN_OPSET
    if old < MIN_OPSET:
        changed = sorted({n.op_type for n in _all_nodes(model.graph) if n.domain in ("", "ai.onnx")
                          and (since := _since(n.op_type, old)) is not None and since != _since(n.op_type, MIN_OPSET)
                          and since < TYPES_ONLY_UP_TO_21.get(n.op_type, 10**6)})
        if changed:
            raise QuantizationError(
                f"block DequantizeLinear needs opset {MIN_OPSET}; the graph's opset {old} ops "
                f"{', '.join(changed)} mean something else at opset {MIN_OPSET}; re-export at opset {MIN_OPSET}")
    for op in ops:
        op.version = max(op.version, MIN_OPSET)
    if not ops:
        model.opset_import.append(helper.make_opsetid("", MIN_OPSET))
    model.ir_version = max(model.ir_version, MIN_IR)


def _since(op_type: str, opset: int) -> int | None:
    from onnx import defs

    try:
        return defs.get_schema(op_type, opset).since_version
    except defs.SchemaError:
        return None


def _all_nodes(g: onnx.GraphProto):
    for n in g.node:
        yield n
        for a in n.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                yield from _all_nodes(sub)


def _apply(model: onnx.ModelProto, gemms: list[_Gemm], matched: dict, reader, base_dir: str) -> list[Rewritten]:
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    ranks = _ranks(model, {gm.node.input[0] for gm in gemms})
    forms: dict[tuple, tuple[BlockTensor, DQForm, str]] = {}
    replacement: dict[int, list[onnx.NodeProto]] = {}
    new_inits: list[TensorProto] = []
    sums: dict[tuple[str, int], str] = {}  # (activation, block size) -> its block sums
    done = []
    for gm in gemms:
        name, _, rows = matched[gm.node.name]
        key = (name, rows is not None)
        first = key not in forms
        if first:
            block = read_tensor(reader, name)
            block = block if rows is None else block.rows(rows)
            forms[key] = (block, block.dq_form(), _prefix(name, rows is not None, inits))
        block, form, prefix = forms[key]
        w = initializer_array(inits[gm.weight], base_dir)
        prove_decode(block, w if gm.transposed else w.T, f"MatMul {gm.node.name!r}, initializer {gm.weight!r}")
        del w
        x, y = gm.node.input[0], gm.node.output[0]
        if x not in ranks and form.offsets is not None:
            raise GGUFWeightError(f"MatMul {gm.node.name!r}: the rank of its input {x!r} is unknown (shape inference "
                                  "gave none); the offset term's Reshape needs it")
        nodes, ins = block_matmul(form, x, y, name=gm.node.name, prefix=prefix, x_rank=ranks.get(x, 0),
                                  emit_weight=first, x_block_sums=sums.get((x, form.block_size)))
        if form.offsets is not None:
            sums.setdefault((x, form.block_size), f"{gm.node.name}/x_block_sums")
        replacement[id(gm.node)] = nodes
        new_inits += ins
        err = form_error(block, form)
        done.append(Rewritten(gm.node.name, name, block.ggml_type, onnx_form(form),
                              "gguf" if rows is None else "llama q/k reverse permutation",
                              err.rounded_offsets, err.blocks, err.max_vs_ggml))
    nodes = [m for n in g.node for m in replacement.get(id(n), [n])]
    del g.node[:]
    g.node.extend(nodes)
    g.initializer.extend(new_inits)
    _drop_unused(g, {gm.via for gm in gemms if gm.via}, {gm.weight for gm in gemms})
    return done


def _prefix(tensor: str, permuted: bool, taken: dict) -> str:
    base = f"gguf.{tensor}" + (".hf_rows" if permuted else "")
    name, i = base, 1
    while f"{name}.values" in taken:
        name, i = f"{base}.{i}", i + 1
    return name


def _drop_unused(g: onnx.GraphProto, transposes: set[str], weights: set[str]) -> None:
    """Drop the Transpose nodes named in ``transposes`` and the initializers in ``weights`` that
    nothing reads any more (graph outputs and subgraphs count as readers)."""
    used = _used_names(g) | {o.name for o in g.output}
    for i in reversed(range(len(g.node))):
        n = g.node[i]
        if n.name in transposes and not set(n.output) & used:
            del g.node[i]
    used = _used_names(g) | {o.name for o in g.output}
    for i in reversed(range(len(g.initializer))):
        if g.initializer[i].name in weights and g.initializer[i].name not in used:
            del g.initializer[i]


def _used_names(g: onnx.GraphProto) -> set[str]:
    used = set()
    for n in g.node:
        used.update(n.input)
        for a in n.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                used |= _used_names(sub) | {o.name for o in sub.output}
    return used


# --- the tied table for TensorRT ---------------------------------------------------------------


@dataclass(frozen=True)
class SharedTable:
    """What :func:`share_tied_table` did: the FP32 ``table`` ``[V, H]`` a Gather read is gone, the
    Gather reads ``Transpose(DequantizeLinear(values))`` of the lm_head's INT8 blocks ``values``
    ``[H, V]`` (``dequantize`` is the DequantizeLinear's name); ``bytes_saved``: the FP32 table's size."""

    table: str
    values: str
    dequantize: str
    bytes_saved: int


def share_tied_table(model: onnx.ModelProto, base_dir: str = "") -> SharedTable | None:
    """In place: the embedding Gather reads the tied lm_head's INT8 blocks instead of its own FP32
    table, so the graph holds one INT8 table (``[H, V]`` values and ``[H / bs, V]`` scales) for both:
    the form a TensorRT engine is built from (SmolLM2: 113.2 MB of FP32 table dropped, 31.9 MB of
    INT8 blocks and FP32 scales kept; TensorRT-RTX 1.7 stores them once per reader, so the engine went
    from 233.1 MB to 151.9 MB). Exact: the table is first proved equal, element for element,
    to the blocks' decode ``values * scales`` (which :func:`rewrite_tied_lm_head` proved equal to
    the GGUF tensor's Q8_0 decode: ``q * d`` with ``|q| <= 127`` and ``d`` an fp16 value is exact
    in float32), so the Gather's output is bit for bit what the FP32 table gave.

    The graph ONNX Runtime runs keeps the FP32 table (the quantize stage's ``cpu_onnx_path``): it
    fuses a DequantizeLinear into a MatMulNBits only when the MatMul is the DequantizeLinear's one
    reader, so the shared form would dequantize all ``H * V`` values on every call (47 ms for
    SmolLM2's; benchmarks/int4_speed.py, part ``table``).

    Args:
        model: a graph from :func:`rewrite_tied_lm_head` (possibly loaded without external data;
            ``base_dir`` is then the model file's folder).

    Returns:
        What was rewritten, or None when the graph has no such pair (no tied lm_head on INT8
        blocks without offsets, a Gather on an FP32 ``[V, H]`` table, ``axis`` 0), or the table
        differs from the blocks' decode in any element: the graph is then left as it was.
    """
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    for dq in list(g.node):
        if _block_size_of(dq) == 0 or not dq.input[0].endswith(".values"):
            continue
        values, scales = inits.get(dq.input[0]), inits.get(dq.input[1])
        if values is None or scales is None or values.data_type != TensorProto.INT8 or len(values.dims) != 2 or \
                f"{dq.input[0].removesuffix('.values')}.offsets" in inits:
            continue
        h, v = (int(d) for d in values.dims)
        for gather in [n for n in g.node if n.op_type == "Gather" and n.input[0] in inits]:
            table = inits[gather.input[0]]
            axis = next((a.i for a in gather.attribute if a.name == "axis"), 0)
            if table.data_type != TensorProto.FLOAT or list(table.dims) != [v, h] or axis != 0:
                continue
            decoded = numpy_helper.to_array(values).astype(np.float32) * np.repeat(
                numpy_helper.to_array(scales), h // int(scales.dims[0]), axis=0)
            if not np.array_equal(initializer_array(table, base_dir), decoded.T):
                return None
            del decoded
            transposed = f"{dq.output[0]}.VxH"
            node = helper.make_node("Transpose", [dq.output[0]], [transposed], name=f"{gather.name}/table_Transpose",
                                    perm=[1, 0])
            gather.input[0] = transposed
            nodes = [n for n in g.node if n is not dq]  # the DequantizeLinear reads initializers only: move it up
            at = nodes.index(gather)
            del g.node[:]
            g.node.extend(nodes[:at] + [dq, node] + nodes[at:])
            if not any(table.name in n.input for n in g.node):
                g.initializer.remove(table)
            return SharedTable(table.name, values.name, dq.name, 4 * v * h)
    return None


def _block_size_of(node: onnx.NodeProto) -> int:
    if node.op_type != "DequantizeLinear":
        return 0
    return next((a.i for a in node.attribute if a.name == "block_size"), 0)


# --- INT8 blocks for ONNX Runtime's CPU kernels ------------------------------------------------


def int4_halves(form: DQForm) -> tuple[DQForm, DQForm]:
    """An INT8 block form ``W = d * q`` (``q`` in [-128, 127], no offsets) as two INT4 block forms
    whose sum is ``W`` exactly in real arithmetic: with ``u = q + 128`` (0..255),
    ``hi = (u >> 4) - 8`` and ``lo = (u & 15) - 8`` (both in [-8, 7]),
    ``q = 16 * hi + lo + 8``, so ``W = (16d) * hi + 8d + d * lo``: ``(values hi, scales 16d,
    offsets 8d)`` and ``(values lo, scales d)``. ``16d`` and ``8d`` are ``d`` times a power of two,
    exact in float32 (a Q8_0 / Q6_K ``d`` is fp16); every element decodes exactly, and a GEMM's
    output differs from the INT8 form's only by the float32 rounding of summing three products
    (the bound in the module notes, with ``2K + K/bs + 3`` terms).

    Why: ONNX Runtime 1.31's MatMulNBits has no FP32-compute (accuracy level 1) kernel for 8 bits
    and dequantizes the whole weight on every call: SmolLM2's lm_head ``[1, 576] x [576, 49152]``
    ran 907 ms against 72 ms in FP32 and 29 ms as two INT4 halves (benchmarks/int4_speed.py).

    Raises:
        ValueError: ``form`` is not 8-bit or has offsets.
    """
    if form.bits != 8 or form.offsets is not None:
        raise ValueError(f"int4_halves: an 8-bit form without offsets is split, got INT{form.bits}"
                         f"{' with offsets' if form.offsets is not None else ''}")
    u = form.values.astype(np.int16) + 128
    hi, lo = ((u >> 4) - 8).astype(np.int8), ((u & 15) - 8).astype(np.int8)
    d = form.scales.astype(np.float32)
    return (DQForm(4, form.block_size, hi, d * np.float32(16), d * np.float32(8)),
            DQForm(4, form.block_size, lo, d, None))


def split_int8_blocks(model: onnx.ModelProto, base_dir: str = "") -> list[str]:
    """In place: every MatMul on an INT8 block DequantizeLinear (``{prefix}.values`` without
    ``{prefix}.offsets``, read by MatMuls alone) computes with :func:`int4_halves` instead: two INT4
    :func:`block_matmul` forms (``{prefix}.hi``: scales 16d and offsets 8d; ``{prefix}.lo``: scales
    d) and an Add, which ONNX Runtime fuses into two 4-bit MatMulNBits with FP32 kernels at
    accuracy level 1. The main MatMul keeps the GEMM's name; the INT8 initializers and
    DequantizeLinear go. For the graph ONNX Runtime runs (validate, the served python-onnxruntime
    model); TensorRT builds the INT8 form.

    Returns:
        The names of the MatMuls rewritten, in graph order.
    """
    from pipeline.quant.gguf_blocks import DQForm

    g = model.graph
    inits = {t.name: t for t in g.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    plans: dict[int, tuple] = {}  # id(MatMul) -> (form halves, prefix, first)
    drop: set[int] = set()
    for dq in g.node:
        if _block_size_of(dq) == 0 or not dq.input[0].endswith(".values"):
            continue
        values, scales = inits.get(dq.input[0]), inits.get(dq.input[1])
        prefix = dq.input[0].removesuffix(".values")
        users = readers.get(dq.output[0], [])
        if values is None or scales is None or values.data_type != TensorProto.INT8 or f"{prefix}.offsets" in inits \
                or not users or any(u.op_type != "MatMul" or list(u.input[1:]) != [dq.output[0]] for u in users) \
                or dq.output[0] in {o.name for o in g.output}:
            continue
        v, s = initializer_array(values, base_dir), initializer_array(scales, base_dir)  # [K, N], [K / bs, N]
        halves = int4_halves(DQForm(8, _block_size_of(dq), np.ascontiguousarray(v.T), np.ascontiguousarray(s.T), None))
        for i, mm in enumerate(users):
            plans[id(mm)] = (halves, prefix, i == 0)
        drop.add(id(dq))
    if not plans:
        return []
    ranks = _ranks(model, {n.input[0] for n in g.node if id(n) in plans})
    nodes, new_inits, done = [], [], []
    for n in g.node:
        if id(n) in drop:
            continue
        if id(n) not in plans:
            nodes.append(n)
            continue
        (hi, lo), prefix, first = plans[id(n)]
        x, y = n.input[0], n.output[0]
        if x not in ranks:
            raise QuantizationError(f"MatMul {n.name!r}: the rank of its input {x!r} is unknown (shape inference gave "
                                    "none); the INT4 halves' offset term needs it")
        a, ia = block_matmul(hi, x, f"{y}/hi", name=n.name, prefix=f"{prefix}.hi", x_rank=ranks[x], emit_weight=first)
        b, ib = block_matmul(lo, x, f"{y}/lo", name=f"{n.name}/lo", prefix=f"{prefix}.lo", x_rank=ranks[x],
                             emit_weight=first)
        nodes += [*a, *b, helper.make_node("Add", [f"{y}/hi", f"{y}/lo"], [y], name=f"{n.name}/halves_Add")]
        new_inits += ia + ib
        done.append(n.name)
    del g.node[:]
    g.node.extend(nodes)
    g.initializer.extend(new_inits)
    used = _used_names(g)
    keep = [t for t in g.initializer if t.name in used or not (t.name.endswith(".values") or t.name.endswith(".scales"))]
    del g.initializer[:]
    g.initializer.extend(keep)
    return done


# --- round to nearest (quantize.weights.method: rtn / awq) -------------------------------------

#: the tied lm_head of a model without GGUF blocks: INT8, blocks of 32 along K (the form source gives
#: SmolLM2's Q8_0 table; about 9 bits per weight, a KL cost far below the INT4 GEMMs')
LM_HEAD_BITS, LM_HEAD_BLOCK = 8, 32


def padded_k(k: int, block_size: int) -> int:
    """``K' = ceil(K / block_size) * block_size``: the rows a zero-padded weight stores (SmolLM2's K = 576
    at block 128: 640)."""
    return -(-k // block_size) * block_size


def pad_hint(k: int) -> str:
    """The block sizes dividing ``k`` and the padding option, for a refusal's message."""
    fits = ", ".join(str(b) for b in (32, 64, 128) if k % b == 0) or "none of 32/64/128"
    return (f"use a block size dividing K ({fits}), or set quantize.weights.pad: true (method rtn / awq: the weight "
            f"stored zero-padded to whole blocks and the activation zero-padded by a Pad before the MatMul)")


def rtn_form(w: np.ndarray, block_size: int, bits: int = 4, *, name: str = "weight",
             clip: np.ndarray | None = None, pad: bool = False) -> DQForm:
    """Symmetric per-block absmax round-to-nearest of ``w [N, K]`` (GGUF orientation: rows = output
    features, blocks of ``block_size`` along ``K``, the input features)::

        scale_b = max_{k in b} |w_k| / qmax          (qmax = 7 for INT4, 127 for INT8; float32)
        values_k = clip(round_half_even(w_k / scale_b), -qmax, qmax)

    so ``values * scale`` is what DequantizeLinear (opset 21, ``block_size``, no zero point) gives. A
    block of zeros gets scale 1 (values 0): scales stay > 0, as TensorRT requires. ``clip``: float32
    ``[N, K' / block_size]`` ratios in (0, 1] multiplying each block's absmax (:func:`clip_search`);
    None: 1. ``pad``: where ``block_size`` does not divide ``K``, ``w`` is first zero-padded to
    ``K' =`` :func:`padded_k` columns: the padded values are 0 and the last block's scale is its real
    weights' absmax (zeros do not change a max), so the form's first ``K`` columns are what rounding
    ``w`` in blocks with a short last one would give.

    Returns:
        The :class:`~pipeline.quant.gguf_blocks.DQForm` (no offsets), values ``[N, K']`` (``K' = K``
        unless padded).

    Raises:
        QuantizationError: ``block_size`` does not divide ``K`` and ``pad`` is False (names ``name`` and
            ``K``; TensorRT refuses a partial block: "The quantization axis must divide into whole
            blocks"), or ``w`` is not 2-D or holds NaN / infinite values.
    """
    if w.ndim != 2:
        raise QuantizationError(f"{name}: weight {w.shape} is not 2-D")
    n, k = w.shape
    if k % block_size and not pad:
        raise QuantizationError(
            f"{name}: quantize.weights.block_size {block_size} does not divide its input dimension K = {k} "
            f"(TensorRT refuses a partial block); {pad_hint(k)}")
    if not np.isfinite(w).all():
        raise QuantizationError(f"{name}: the weight holds NaN or infinite values")
    if k % block_size:
        w = np.pad(np.asarray(w, np.float32), ((0, 0), (0, padded_k(k, block_size) - k)))
        k = w.shape[1]
    qmax = 2 ** (bits - 1) - 1
    blocks = np.asarray(w, np.float32).reshape(n, k // block_size, block_size)
    if clip is not None and (clip.shape != blocks.shape[:2] or not ((clip > 0) & (clip <= 1)).all()):
        raise QuantizationError(f"{name}: clip ratios {clip.shape} must be [{n}, {k // block_size}] in (0, 1]")
    values, scales = _round_blocks(blocks, clip, qmax)
    return DQForm(bits=bits, block_size=block_size, values=values.reshape(n, k), scales=scales, offsets=None)


def _round_blocks(blocks: np.ndarray, clip: np.ndarray | float | None, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """``(values int8 [n, nb, bs], scales float32 [n, nb])`` of float32 ``blocks [n, nb, bs]``:
    ``scale = fl(fl(amax * clip) / qmax)`` (1 for an all-zero block), values rounded half to even and
    clipped to ``+-qmax``."""
    amax = np.abs(blocks).max(axis=2)
    if clip is not None:
        amax = (amax * np.asarray(clip, np.float32)).astype(np.float32)
    scales = np.where(amax > 0, amax / np.float32(qmax), np.float32(1)).astype(np.float32)
    values = np.clip(np.rint(blocks / scales[:, :, None]), -qmax, qmax).astype(np.int8)
    return values, scales


#: clip ratios tried per block by :func:`clip_search` (AWQ's reference: 1 down to 0.5)
CLIP_GRID: tuple[float, ...] = tuple(round(1 - i / 20, 2) for i in range(11))


def clip_search(x: np.ndarray, w: np.ndarray, block_size: int, bits: int = 4,
                grid: tuple[float, ...] = CLIP_GRID, *, pad: bool = False) -> np.ndarray:
    """Per-block clip ratios of ``w [K, N]`` (a MatMul's ``B``) for :func:`rtn_form`: for each block
    ``b`` of output column ``o`` the ratio ``r`` in ``grid`` minimising that block's share of the
    output error on the calibration rows ``x [R, K]``::

        err(o, b, r) = || x[:, b] (w[b, o] - Q_r(w[b, o])) ||^2 = d^T (x_b^T x_b) d

    (``Q_r``: :func:`rtn_form` with ``amax * r``; cross-block terms left out, as in AWQ's weight
    clipping, Lin et al. 2024, ``auto_clip``). Ratio 1 (plain rtn) is tried first and kept on ties,
    so no block's error grows. ``pad``: a ``K`` that ``block_size`` does not divide is zero-padded
    (rows of ``w``, columns of ``x``) to :func:`padded_k`, as :func:`rtn_form` pads; the zero columns
    of ``x`` add nothing to any error.

    Returns:
        float32 ``[N, K' / block_size]`` ratios in (0, 1] (``K' = K`` unless padded).

    Raises:
        QuantizationError: shapes that do not fit, or ``block_size`` not dividing ``K`` without ``pad``.
    """
    k, n = w.shape
    if x.ndim != 2 or x.shape[1] != k or (k % block_size and not pad):
        raise QuantizationError(f"clip search: rows {x.shape} and weight {w.shape} do not fit blocks of {block_size}")
    if k % block_size:
        kp = padded_k(k, block_size)
        x = np.pad(np.asarray(x, np.float32), ((0, 0), (0, kp - k)))
        w = np.pad(np.asarray(w, np.float32), ((0, kp - k), (0, 0)))
        k = kp
    qmax = 2 ** (bits - 1) - 1
    nb = k // block_size
    # one BLAS GEMM per block (numpy's stacked matmul); einsum's contraction paths for these shapes
    # ran ~10x slower (benchmarks/awq_cost.py)
    xb = np.asarray(x, np.float32).reshape(-1, nb, block_size).transpose(1, 0, 2).astype(np.float64)  # [nb, R, bs]
    gram = np.matmul(xb.transpose(0, 2, 1), xb)  # [nb, bs, bs], symmetric
    del xb
    blocks = np.ascontiguousarray(np.asarray(w, np.float32).T).reshape(n, nb, block_size)
    best = np.ones((n, nb), np.float32)
    best_err = np.full((n, nb), np.inf)
    for r in sorted(grid, reverse=True):
        values, scales = _round_blocks(blocks, r, qmax)
        d = (blocks - values * scales[:, :, None]).astype(np.float64).transpose(1, 0, 2)  # [nb, n, bs]
        err = np.einsum("bni,bni->nb", np.matmul(d, gram), d)  # d^T G d per (column, block)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best = np.where(better, np.float32(r), best)
    return best


def fake_quantize(w: np.ndarray, block_size: int, bits: int = 4, *, pad: bool = False) -> np.ndarray:
    """float32 ``[K, N]``: ``w [K, N]`` (a MatMul's ``B``) after :func:`rtn_form` and its
    DequantizeLinear, blocks along ``K``: the weight quantizer of the AWQ search
    (:func:`pipeline.quant.fold_search.search`). The same float32 operations as ``rtn_form(w.T)
    .dequantized().T``, bit for bit, on ``w``'s own layout: no transposed copies, no INT8 values
    (it runs 21 times per fold point). ``pad``: as :func:`rtn_form`, ``K`` zero-padded to
    :func:`padded_k` (zeros leave every block's absmax unchanged); the padded rows are dropped again.

    Raises:
        QuantizationError: ``block_size`` does not divide ``K`` without ``pad``, or ``w`` holds NaN /
            infinite values.
    """
    k, n = w.shape
    if k % block_size and not pad:
        raise QuantizationError(f"fake quantize: block size {block_size} does not divide the weight's K = {k}")
    kp = padded_k(k, block_size) if k % block_size else k
    w = np.asarray(w, np.float32)
    if kp != k:
        w = np.pad(w, ((0, kp - k), (0, 0)))
    qmax = np.float32(2 ** (bits - 1) - 1)
    blocks = w.reshape(kp // block_size, block_size, n)
    amax = np.abs(blocks).max(axis=1)  # [K' / bs, N]; NaN and inf propagate
    if not np.isfinite(amax).all():
        raise QuantizationError("fake quantize: the weight holds NaN or infinite values")
    scales = np.where(amax > 0, amax / qmax, np.float32(1)).astype(np.float32)[:, None, :]
    q = blocks / scales
    np.rint(q, out=q)
    np.clip(q, -qmax, qmax, out=q)
    q *= scales
    return q.reshape(kp, n)[:k]


@dataclass(frozen=True)
class RTNRewritten:
    """One MatMul now computing with round-to-nearest blocks: ``node``, its former FP32 ``weight``
    initializer, ``onnx_form`` (``"INT4 block 64"``), ``k`` and ``n``, and the largest
    ``|DQ weight - FP32 weight| / block absmax`` (at most half a step, ``0.5 / qmax``, where no block is
    clipped); ``padded_k``: the rows the stored weight has when zero-padded (:func:`padded_k`), else
    None."""

    node: str
    weight: str
    onnx_form: str
    k: int
    n: int
    max_relative_error: float
    padded_k: int | None = None


def rewrite_rtn(model: onnx.ModelProto, *, block_size: int, base_dir: str = "",
                skip: Collection[str] = (), clips: dict[str, np.ndarray] | None = None,
                pad: bool = False) -> list[RTNRewritten]:
    """Rewrite, in place, every MatMul whose ``B`` is a 2-D FP32 initializer ``[K, N]`` into
    :func:`block_matmul`'s form with :func:`rtn_form` INT4 blocks of ``block_size``; a tied lm_head
    (``B = Transpose(table)`` of a table a Gather also reads) gets INT8 blocks of
    :data:`LM_HEAD_BLOCK` instead, in its own ``[K, N]`` values (ONNX Runtime fuses it into an 8-bit
    ``MatMulNBits``); the Gather keeps the FP32 table. The opset is raised to 21 (:func:`raise_opset`).

    Args:
        model: the (folded) FP32 graph; external data is read from ``base_dir``.
        block_size: INT4 weights per scale along ``K``.
        skip: MatMul names left FP32 (``quantize.exclude``).
        clips: MatMul name -> per-block clip ratios (:func:`clip_search`); others: 1.
        pad: a GEMM ``x [.., K] @ W [K, N]`` whose ``K`` the block does not divide stores ``W``
            zero-padded to ``K' =`` :func:`padded_k` rows (:func:`rtn_form` with ``pad``: INT4 zeros,
            the last block's scale from its real rows) and reads ``Pad(x)`` (zeros appended on the
            last axis, ``K -> K'``; one Pad per activation, shared by the GEMMs reading it: q/k/v,
            gate/up). Exact: ``Pad(x) @ [W_q; 0] = x @ W_q`` (the zero rows contribute 0), so the
            graph computes the unpadded dequantized GEMM; TensorRT and ONNX Runtime's MatMulNBits see
            whole blocks. Costs ``(K' - K) * N / 2`` bytes of INT4 values per padded GEMM.

    Returns:
        One :class:`RTNRewritten` per rewritten MatMul, in graph order.

    Raises:
        QuantizationError: ``block_size`` does not divide a GEMM's ``K`` and ``pad`` is False (names
            the GEMM and ``K``; checked for every GEMM before anything is rewritten); a padded GEMM's
            input has no known rank; an op changes meaning at opset 21.
    """
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    gathered = {n.input[0] for n in g.node if n.op_type == "Gather"}
    gemms = [gm for gm in _gemms(model) if gm.node.name not in skip and (not gm.transposed or gm.weight in gathered)]
    shapes = {gm.node.name: (tuple(inits[gm.weight].dims)[::-1] if gm.transposed else tuple(inits[gm.weight].dims))
              for gm in gemms}
    bad = [(gm.node.name, shapes[gm.node.name][0]) for gm in gemms
           if shapes[gm.node.name][0] % (LM_HEAD_BLOCK if gm.transposed else block_size)]
    if bad and not pad:
        shown = ", ".join(f"{node} (K = {k})" for node, k in bad[:3])
        raise QuantizationError(
            f"quantize.weights.block_size {block_size} does not divide the input dimension K of {len(bad)} GEMMs: "
            f"{shown}; TensorRT refuses a partial block (\"The quantization axis must divide into whole blocks\"); "
            f"{pad_hint(bad[0][1])}")
    ranks = _ranks(model, {gm.node.input[0] for gm in gemms})
    unranked = [gm.node for gm in gemms if (gm.node.name, shapes[gm.node.name][0]) in bad
                and not ranks.get(gm.node.input[0])]
    if unranked:
        raise QuantizationError(f"MatMul {unranked[0].name!r}: the rank of its input {unranked[0].input[0]!r} is "
                                "unknown (shape inference gave none); quantize.weights.pad's Pad needs it")
    replacement: dict[int, list[onnx.NodeProto]] = {}
    new_inits: list[TensorProto] = []
    done = []
    taken = set(inits)
    padded: dict[tuple[str, int], str] = {}  # (activation, K') -> its Pad's output
    for gm in gemms:
        w = initializer_array(inits[gm.weight], base_dir)
        w_nk = w if gm.transposed else w.T
        bits, bs = (LM_HEAD_BITS, LM_HEAD_BLOCK) if gm.transposed else (4, block_size)
        form = rtn_form(np.ascontiguousarray(w_nk), bs, bits, name=f"MatMul {gm.node.name!r}",
                        clip=None if gm.transposed else (clips or {}).get(gm.node.name), pad=pad)
        k, kp = w_nk.shape[1], form.values.shape[1]
        w_pad = np.pad(w_nk, ((0, 0), (0, kp - k))) if kp != k else w_nk
        err = np.abs(form.dequantized() - w_pad).reshape(w_nk.shape[0], -1, bs).max(axis=2)
        amax = np.abs(w_pad).reshape(w_nk.shape[0], -1, bs).max(axis=2)
        rel = float((err / np.where(amax > 0, amax, 1)).max())
        prefix, i = f"rtn.{gm.weight}", 1
        while f"{prefix}.values" in taken:
            prefix, i = f"rtn.{gm.weight}.{i}", i + 1
        taken.add(f"{prefix}.values")
        x, pre = gm.node.input[0], []
        if kp != k:
            if (x, kp) not in padded:
                r = ranks[x]
                padded[(x, kp)] = f"{x}/padded_to_{kp}"
                pads = np.array([0] * (2 * r - 1) + [kp - k], np.int64)  # begins of every axis, then ends
                new_inits.append(numpy_helper.from_array(pads, f"{gm.node.name}/pads"))
                pre = [helper.make_node("Pad", [x, f"{gm.node.name}/pads"], [padded[(x, kp)]], name=f"{gm.node.name}/Pad",
                                        mode="constant")]
            x = padded[(x, kp)]
        nodes, ins = block_matmul(form, x, gm.node.output[0], name=gm.node.name, prefix=prefix,
                                  x_rank=ranks.get(gm.node.input[0], 0))
        replacement[id(gm.node)] = pre + nodes
        new_inits += ins
        done.append(RTNRewritten(gm.node.name, gm.weight, onnx_form(form), k, w_nk.shape[0], rel,
                                 kp if kp != k else None))
        del w, w_nk, w_pad
    nodes = [m for n in g.node for m in replacement.get(id(n), [n])]
    del g.node[:]
    g.node.extend(nodes)
    g.initializer.extend(new_inits)
    _drop_unused(g, {gm.via for gm in gemms if gm.via}, {gm.weight for gm in gemms})
    raise_opset(model)
    return done
