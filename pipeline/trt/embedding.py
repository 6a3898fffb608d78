"""The token embedding lookup outside the engine (``build.embedding_lookup: runtime``).

The engine is built from a copy of the graph whose embedding ``Gather`` is gone: it takes
``inputs_embeds`` ``[batch, sequence, hidden]`` where it took the token ids, the interface of
TensorRT Edge-LLM's LLM engines (binding ``inputs_embeds``; its runtime gathers the rows with its
own kernel from an FP16 table, or an FP8 one with FP32 per-group scales ``[vocab, hidden / block]``).
The table goes beside the engine as :data:`TABLE_FILE` (safetensors), in the form the graph held it:

* INT8 blocks (the tied lm_head's, which the int4 quantize stage lets the Gather read:
  :func:`pipeline.quant.int4.share_tied_table`): ``values`` int8 ``[vocab, hidden]`` and ``scales``
  float32 ``[vocab, hidden / block_size]``; a row decodes as ``values * repeat(scales, block_size)``,
  exactly what the graph's DequantizeLinear gave;
* a plain table (an FP32 or FP16 initializer, possibly through a Cast): ``weight`` ``[vocab, hidden]``.

Why: TensorRT-RTX 1.7 keeps one copy of a DequantizeLinear's constant per reader, so a table read
by both the lm_head GEMM and the Gather is stored twice in the engine (SmolLM2's INT8 table: 31.9 MB
per copy). With the lookup outside, the engine holds it once, for the lm_head.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from pipeline.onnx_io import graph_index, initializer_array
from pipeline.trt.builder import EngineBuildError

#: the engine input that replaces the token ids (TensorRT Edge-LLM's binding name)
INPUT = "inputs_embeds"
#: the table written beside the engine
TABLE_FILE = "embedding.safetensors"
_INTEGER_TYPES = (TensorProto.INT64, TensorProto.INT32)


@dataclass(frozen=True)
class EmbeddingCut:
    """What :func:`cut` did. ``ids_input``: the graph input the Gather read (e.g. ``input_ids``),
    no longer an input; ``gather``: the removed node; ``form``: ``"int8_blocks"`` or ``"table"``;
    ``dtype``: ``inputs_embeds``' element type (numpy name); ``vocab`` x ``hidden``: the table;
    ``block_size``: of ``int8_blocks`` (None for a table); ``tensors``: the arrays of
    :data:`TABLE_FILE` (name -> array)."""

    ids_input: str
    gather: str
    form: str
    dtype: str
    vocab: int
    hidden: int
    block_size: int | None
    tensors: dict[str, np.ndarray] = field(repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        """The table's bytes (the arrays, without the file's header)."""
        return sum(a.nbytes for a in self.tensors.values())

    def decoded(self) -> np.ndarray:
        """The table as the graph's Gather read it, ``[vocab, hidden]`` of :attr:`dtype`."""
        if self.form == "table":
            return self.tensors["weight"]
        scales = np.repeat(self.tensors["scales"], self.block_size, axis=1)
        return (self.tensors["values"].astype(scales.dtype) * scales).astype(self.dtype)

    def metadata(self) -> dict[str, str]:
        """The safetensors header's ``__metadata__``: how a runtime decodes the file."""
        how = ("row = values[id] * repeat(scales[id], block_size)" if self.form == "int8_blocks"
               else "row = weight[id]")
        meta = {"form": self.form, "engine_input": INPUT, "replaces": self.ids_input, "decode": how,
                "dtype": self.dtype, "vocab": str(self.vocab), "hidden": str(self.hidden)}
        if self.block_size:
            meta["block_size"] = str(self.block_size)
        return meta


def cut(model: onnx.ModelProto, base_dir: str | Path = "") -> EmbeddingCut:
    """In place: remove the embedding Gather and take ``inputs_embeds`` where it read the token ids.

    The Gather is the one with ``axis`` 0 (or -2) whose indices are an integer graph input and whose
    table is a constant: an initializer ``[V, H]``, a Cast of one, or the INT8 blocks of a
    DequantizeLinear (``[V, H]`` along axis 1, or ``[H, V]`` along axis 0 behind a Transpose
    ``perm [1, 0]``; ``H`` a whole number of blocks). Every other reader of the ids must be a Shape
    node (opset 15+: it reads ``inputs_embeds`` instead, over the same axes, through ``start`` /
    ``end``). The Gather becomes an Identity of ``inputs_embeds`` (its readers are unchanged). The
    nodes and initializers only the Gather used are dropped (what a subgraph reads is kept);
    ``inputs_embeds`` takes the ids' place among the inputs, with their dims plus ``H``.

    Args:
        model: the graph TensorRT is built from (possibly loaded without external data: ``base_dir``
            is then the model file's folder).

    Returns:
        What was cut, with the table's arrays.

    Raises:
        EngineBuildError: (exit 2) no such Gather, more than one, a table in another form (named with
            the op that produced it), another reader of the ids than a Shape node (named: a node, one
            whose subgraph reads them, or a graph output), ids without a shape, a Shape of them below
            opset 15, or a tensor already named ``inputs_embeds``.
    """
    g = model.graph
    inits, producer, _ = graph_index(g)
    inputs = {v.name: v for v in g.input if v.name not in inits}
    candidates = [n for n in g.node if n.op_type == "Gather" and len(n.input) == 2 and n.input[1] in inputs
                  and inputs[n.input[1]].type.tensor_type.elem_type in _INTEGER_TYPES
                  and _axis(n) in (0, -2) and _is_constant(n.input[0], inits, producer)]
    if len(candidates) != 1:
        found = ", ".join(f"{n.name} (indices {n.input[1]})" for n in candidates) or "none"
        raise EngineBuildError(
            "build.embedding_lookup: runtime needs exactly one Gather of a constant table by an integer graph "
            f"input (the token ids); found {found}. Use embedding_lookup: engine for this graph")
    gather = candidates[0]
    ids = gather.input[1]
    if INPUT in producer or INPUT in inits or any(v.name == INPUT for v in g.input):
        raise EngineBuildError(f"build.embedding_lookup: runtime: the graph already has a tensor named {INPUT}, the "
                               "input that would replace the token ids. Use embedding_lookup: engine")
    others = [n for n in g.node if n is not gather and ids in _reads(n)]
    bad = [f"{n.name} ({n.op_type})" for n in others if n.op_type != "Shape" or n.input[0] != ids]
    bad += [f"the graph output {ids}"] if any(o.name == ids for o in g.output) else []
    if bad:
        raise EngineBuildError(
            f"build.embedding_lookup: runtime: {ids} is read by {', '.join(bad)} besides the embedding Gather "
            f"{gather.name}; only Shape nodes can read inputs_embeds in its place. Use embedding_lookup: engine")
    ids_info = inputs[ids]
    if not ids_info.type.tensor_type.HasField("shape"):
        raise EngineBuildError(f"build.embedding_lookup: runtime: the graph input {ids} has no shape, so "
                               f"{INPUT}'s rank is unknown; give it one (e.g. [batch, sequence])")
    rank = len(ids_info.type.tensor_type.shape.dim)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if others and opset < 15:
        raise EngineBuildError(
            f"build.embedding_lookup: runtime: {others[0].name} (Shape) reads {ids}; reading the same axes of "
            f"{INPUT} needs Shape's start / end, opset 15 or later (the graph's is {opset}). Export with "
            "export.opset 15 or later, or use embedding_lookup: engine")
    found = _table(gather, inits, producer, str(base_dir))
    for n in others:
        n.input[0] = INPUT
        _shape_of_leading_axes(n, rank)
    embeds = helper.make_tensor_value_info(INPUT, helper.np_dtype_to_tensor_dtype(np.dtype(found.dtype)), None)
    dims = embeds.type.tensor_type.shape.dim  # the ids' dims as they are (a dim without name or size too)
    dims.extend(ids_info.type.tensor_type.shape.dim)
    dims.add().dim_value = found.hidden
    where = list(g.input).index(ids_info)
    g.input.remove(ids_info)
    g.input.insert(where, embeds)
    chain = _producers(gather.input[0], producer)
    at = list(g.node).index(gather)
    g.node.remove(gather)  # its output, now an Identity of inputs_embeds: no reader changes
    g.node.insert(at, helper.make_node("Identity", [INPUT], [gather.output[0]], name=f"{gather.name}/{INPUT}"))
    _drop_dead(g, chain, gather.input[0])
    return found


def write_table(found: EmbeddingCut, folder: Path) -> dict:
    """Write ``found``'s arrays to ``folder /`` :data:`TABLE_FILE` (atomically) and return the
    stamp's record: file, bytes, sha256, form, tensors' dtypes and shapes, and how to decode them."""
    from safetensors.numpy import save

    from pipeline.fsutil import write_bytes_atomic

    data = save({k: np.ascontiguousarray(v) for k, v in found.tensors.items()}, metadata=found.metadata())
    path = Path(folder) / TABLE_FILE
    write_bytes_atomic(path, data)
    return {"file": TABLE_FILE, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "tensors": {k: {"dtype": str(v.dtype), "shape": list(v.shape)} for k, v in found.tensors.items()},
            **found.metadata()}


def _reads(node: onnx.NodeProto) -> set[str]:
    """The names ``node`` reads: its inputs and, for If / Loop / Scan, every name its subgraphs' nodes
    read (an outer-scope name among them; ONNX names are unique across scopes)."""
    out = {i for i in node.input if i}
    for a in node.attribute:
        for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            out |= {i for n in sub.node for i in _reads(n)} | {o.name for o in sub.output}
    return out


def _producers(name: str, producer: dict) -> list[onnx.NodeProto]:
    """The nodes that compute ``name`` from initializers, nearest first."""
    out, todo = [], [name]
    while todo:
        node = producer.get(todo.pop(0))
        if node is not None and node not in out:
            out.append(node)
            todo.extend(i for i in node.input if i)
    return out


def _axis(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 0)


def _is_constant(name: str, inits: dict, producer: dict) -> bool:
    if name in inits:
        return True
    node = producer.get(name)
    return node is not None and node.op_type in ("Cast", "Transpose", "DequantizeLinear") and \
        all(not i or _is_constant(i, inits, producer) for i in node.input)


def _table(gather: onnx.NodeProto, inits: dict, producer: dict, base_dir: str) -> EmbeddingCut:
    """The Gather's table as one of :class:`EmbeddingCut`'s forms."""
    name = gather.input[0]
    node = producer.get(name)
    cast_to = None
    if node is not None and node.op_type == "Cast" and node.input[0] in inits:
        cast_to = next(a.i for a in node.attribute if a.name == "to")
        name, node = node.input[0], None
    if node is None:
        table = initializer_array(inits[name], base_dir)
        if cast_to is not None:
            table = table.astype(helper.tensor_dtype_to_np_dtype(cast_to))
        if table.ndim != 2:
            raise EngineBuildError(f"build.embedding_lookup: runtime: the table {name} of {gather.name} has shape "
                                   f"{list(table.shape)}, not [vocab, hidden]")
        return _found(gather, "table", table.dtype, table.shape, None, {"weight": table})
    transposed = node.op_type == "Transpose"
    if transposed:
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
        dq = producer.get(node.input[0])
        if perm != [1, 0] or dq is None:
            dq = None
    else:
        dq = node
    if dq is None or dq.op_type != "DequantizeLinear" or any(i and i not in inits for i in dq.input):
        src = node if dq is None or dq.op_type != "DequantizeLinear" else dq
        computed = " (an input not an initializer)" if src is dq else ""
        raise EngineBuildError(
            f"build.embedding_lookup: runtime: the table of {gather.name} comes from {src.op_type} {src.name}"
            f"{computed}; "
            "the forms written beside the engine are an initializer (or a Cast of one) and INT8 blocks of a "
            "DequantizeLinear (behind a Transpose [1, 0] or not). Use embedding_lookup: engine")
    values_t = inits[dq.input[0]]
    if values_t.data_type != TensorProto.INT8:
        kind = TensorProto.DataType.Name(values_t.data_type)
        raise EngineBuildError(
            f"build.embedding_lookup: runtime: the table of {gather.name} is {kind} blocks ({values_t.name}); the "
            "file holds INT8 blocks or a plain table. Use embedding_lookup: engine")
    if len(dq.input) > 2 and dq.input[2] and np.any(initializer_array(inits[dq.input[2]], base_dir)):
        raise EngineBuildError(f"build.embedding_lookup: runtime: {dq.name} has a non-zero zero point; the file "
                               "holds symmetric INT8 blocks. Use embedding_lookup: engine")
    block = next((a.i for a in dq.attribute if a.name == "block_size"), 0)
    axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
    values, scales = initializer_array(values_t, base_dir), initializer_array(inits[dq.input[1]], base_dir)
    if values.ndim == 2:
        axis %= 2  # a negative axis counts from the end
    if transposed:  # [H, V] blocked along H (axis 0) -> the file's [V, H] blocked along H
        values, scales, axis = values.T, scales.T, 1 - axis
    if block <= 0 or axis != 1 or values.ndim != 2 or values.shape[1] % block:
        raise EngineBuildError(
            f"build.embedding_lookup: runtime: {dq.name} is not blocked along the hidden axis in whole blocks "
            f"(block_size {block}, axis {axis} of the [vocab, hidden] table {list(values.shape)}); the file holds "
            "[vocab, hidden] blocks, hidden / block_size per row. Use embedding_lookup: engine")
    return _found(gather, "int8_blocks", scales.dtype, values.shape, block,
                  {"values": np.ascontiguousarray(values), "scales": np.ascontiguousarray(scales)})


def _found(gather: onnx.NodeProto, form: str, dtype: np.dtype, shape: tuple, block: int | None,
           tensors: dict[str, np.ndarray]) -> EmbeddingCut:
    return EmbeddingCut(gather.input[1], gather.name, form, np.dtype(dtype).name, int(shape[0]), int(shape[1]),
                        block, tensors)


def _shape_of_leading_axes(node: onnx.NodeProto, rank: int) -> None:
    """A Shape of the ids reads ``inputs_embeds`` (one more axis) instead: its ``start`` / ``end``
    become explicit and non-negative, counted over the ids' ``rank`` axes."""
    attrs = {a.name: a.i for a in node.attribute}
    start, end = attrs.get("start", 0), attrs.get("end", rank)
    start, end = (min(max(v + rank if v < 0 else v, 0), rank) for v in (start, end))
    del node.attribute[:]
    node.attribute.extend([helper.make_attribute("start", start), helper.make_attribute("end", end)])


def _drop_dead(g: onnx.GraphProto, chain: list[onnx.NodeProto], table: str) -> None:
    """Remove the nodes of ``chain`` (what produced the removed Gather's ``table``) none of whose
    outputs is still read, then the initializers only they (or the Gather) read. Only the chain: a
    subgraph may read any outer name."""
    outputs = {o.name for o in g.output}
    fed = {table} | {i for n in chain for i in n.input}
    for n in chain:  # consumers first: the chain runs from the Gather towards the initializers
        read = {i for m in g.node for i in _reads(m)} | outputs
        if not any(o in read for o in n.output):
            g.node.remove(n)
    read = {i for n in g.node for i in _reads(n)} | outputs
    for t in [t for t in g.initializer if t.name in fed and t.name not in read]:
        g.initializer.remove(t)
    for v in [v for v in g.input if v.name in fed and v.name not in read]:  # an initializer listed as an input
        g.input.remove(v)
