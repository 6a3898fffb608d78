"""Fold points of the ONNX graph: where per-channel scales move between an activation and the
weight GEMMs reading it without changing what the FP32 graph computes.

For a GEMM input ``X [.., C]`` read by MatMuls ``Y_k = X W_k`` (``W_k [C, out_k]``), and per-channel
scales ``s [C]``::

    Y_k = (X / s) (diag(s) W_k)

``diag(s) W_k`` is a new weight initializer; ``X / s`` must be absorbed by the op producing ``X``.
Four fold points of a Llama / SwiGLU block qualify (:data:`KINDS`):

* ``norm`` (norm -> q/k/v, norm -> gate/up): ``X = Mul(normalized, gamma [C])``; ``gamma / s``.
* ``linear`` (up -> down): ``X = Mul(SiLU(gate), up)``, ``up = MatMul(h, W_up [H, C])`` read by
  nothing else; the product is linear in ``up``'s output channels: ``W_up[:, j] / s_j``.
* ``attention`` (v -> o): ``X`` is ``o_proj``'s input, attention's output. ``softmax(Q K^T) V`` is a
  per-channel-linear function of ``V``'s channels (the softmax weights mix positions, never
  channels), and the reshapes / transposes in between only move heads, so ``W_v[:, j] / s_j`` (and
  a bias ``b_v[j] / s_j``) scales channel ``j`` of ``o_proj``'s input rows of every query head
  reading that KV head. Under grouped-query attention (``heads = g * kv_heads``) query head ``h``
  reads KV head ``h // g`` (transformers' ``repeat_kv``), so ``o_proj``'s input row
  ``h * head_dim + d`` gets the scale of ``v_proj``'s output channel ``(h // g) * head_dim + d``
  (:attr:`FoldPoint.groups`). The cache output ``present.N.value`` then holds ``V / s``; only the
  graph reads it back (as ``past_key_values.N.value``), so a decode loop is unchanged, but a cache
  from the unfolded graph must not be fed to the folded one.

The path from ``v_proj`` to ``o_proj`` is checked op by op (:func:`_attention_path`): only
Reshape, Transpose keeping the last axis last, Concat with a graph input (the past cache),
Expand / Unsqueeze / Identity, and a MatMul reading the path as its ``B`` (the attention
probabilities times ``V``); anything else (a rotary embedding, a softmax) leaves the point out, with
the reason. ``head_dim`` and ``kv_heads`` come from the past cache input's static shape
``[batch, kv_heads, past, head_dim]``.

tests/unit/quant/test_fold_points.py checks every kind on a tiny random Llama with GQA (4 heads,
2 KV heads): the folded FP32 graph gives the unfolded graph's logits to float tolerance.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from pipeline import onnx_io
from pipeline.errors import QuantizationError
from pipeline.quant.qdq import Target

KINDS = ("norm", "linear", "attention")
#: ops that move a value's channels without mixing them (the v -> o path)
_PASS = {"Reshape", "Transpose", "Expand", "Unsqueeze", "Identity", "Concat", "MatMul"}


@dataclass
class FoldPoint:
    """One activation whose channel scales can be folded.

    Attributes:
        act: the activation ``X`` the GEMMs read (``[.., C]``).
        gemms: the MatMul targets reading ``act`` (``[C, out]`` weights, axis 1).
        kind: ``norm``, ``linear`` or ``attention`` (module notes).
        site: the node whose initializer input absorbs ``1 / s`` (the norm's Mul, ``up_proj``'s or
            ``v_proj``'s MatMul).
        site_input: that input's index.
        channels: ``G``, the site's channel count (``C``, or ``kv_heads * head_dim`` for attention).
        groups: int64 ``[C]``: the site channel of each GEMM input row.
        bias: ``(Add node, input index)`` of a ``[G]`` bias after the site MatMul (attention), or None.
    """

    act: str
    gemms: list[Target]
    kind: str
    site: onnx.NodeProto
    site_input: int
    channels: int
    groups: np.ndarray
    bias: tuple[onnx.NodeProto, int] | None = None

    def describe(self) -> str:
        """``"norm:<node>"`` and the like (reports)."""
        return f"{self.kind}:{self.site.name}"


def find(model: onnx.ModelProto, targets: list[Target], kinds: tuple[str, ...] = KINDS
         ) -> tuple[list[FoldPoint], dict[str, str]]:
    """The fold points of ``model`` among the inputs of the MatMul ``targets``.

    Args:
        model: the FP32 graph (weights may stay on disk: only shapes and small initializers are read).
        targets: weight GEMMs (:func:`pipeline.quant.qdq.find_targets`).
        kinds: the fold kinds wanted (:data:`KINDS`).

    Returns:
        ``(points in graph order, {activation: why it is no fold point})``.
    """
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise QuantizationError(f"fold points: unknown kinds {bad}; valid: {', '.join(KINDS)}")
    g = model.graph
    inits, producer, consumers = onnx_io.graph_index(g)
    nodes = {n.name: n for n in g.node}
    by_act: dict[str, list[Target]] = defaultdict(list)
    for t in targets:
        by_act[t.act].append(t)
    points, skipped = [], {}
    for act, group in by_act.items():
        if any(nodes[t.node].op_type != "MatMul" or t.weight_axis != 1 for t in group):
            skipped[act] = "not a MatMul with an [in, out] weight"
            continue
        if {n.name for n in consumers[act]} != {t.node for t in group}:
            skipped[act] = "read by nodes other than the weight GEMMs (folding would change them)"
            continue
        c = int(inits[group[0].weight].dims[0])
        point = _local(act, group, producer.get(act), inits, producer, consumers, c, kinds)
        if point is None and "attention" in kinds:
            point = _attention(act, group, model, inits, producer, consumers, c)
        if isinstance(point, FoldPoint):
            points.append(point)
        else:
            skipped[act] = point or (f"produced by {_op(producer.get(act))}: no norm scale, linear layer or "
                                     "value projection to fold into")
    return points, skipped


def _local(act, group, node, inits, producer, consumers, c, kinds):
    """A ``norm`` or ``linear`` point (module notes), or None."""
    if node is None or node.op_type != "Mul":
        return None
    ident = np.arange(c, dtype=np.int64)
    for idx, name in enumerate(node.input):
        if name in inits and tuple(inits[name].dims) == (c,):
            return FoldPoint(act, group, "norm", node, idx, c, ident) if "norm" in kinds else None
    if any(name in inits for name in node.input):
        return None
    for name in node.input:
        mm = producer.get(name)
        if (mm is not None and mm.op_type == "MatMul" and len(consumers[name]) == 1 and mm.input[1] in inits
                and len(inits[mm.input[1]].dims) == 2 and inits[mm.input[1]].dims[1] == c):
            return FoldPoint(act, group, "linear", mm, 1, c, ident) if "linear" in kinds else None
    return None


def _attention(act, group, model, inits, producer, consumers, c) -> FoldPoint | str | None:
    """The ``attention`` point whose GEMM is ``o_proj`` reading ``act``, or why not, or None."""
    if len(group) != 1:
        return None
    g = model.graph
    graph_inputs = {i.name: i for i in g.input}
    outputs = {o.name for o in g.output}
    for v in g.node:  # candidate value projections: MatMul with an [H, G] initializer
        if v.op_type != "MatMul" or v.input[1] not in inits or len(inits[v.input[1]].dims) != 2:
            continue
        site_c = int(inits[v.input[1]].dims[1])
        if c % site_c:
            continue
        out, bias = v.output[0], None
        nxt = consumers[out]
        if len(nxt) == 1 and nxt[0].op_type == "Add":
            other = [i for i in nxt[0].input if i != out]
            if len(other) == 1 and other[0] in inits and tuple(inits[other[0]].dims) == (site_c,):
                bias = (nxt[0], list(nxt[0].input).index(other[0]))
                out = nxt[0].output[0]
        past = _attention_path(out, act, consumers, graph_inputs, outputs)
        if past is None:
            continue
        if site_c == c:
            return FoldPoint(act, group, "attention", v, 1, site_c, np.arange(c, dtype=np.int64), bias)
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in graph_inputs[past].type.tensor_type.shape.dim] \
            if past else []
        if len(dims) != 4 or not dims[1] or not dims[3] or dims[1] * dims[3] != site_c:
            return (f"value projection {v.name!r} has {site_c} channels for {c} attention channels (GQA) and no "
                    "past cache input [batch, kv_heads, past, head_dim] with static kv_heads and head_dim")
        kv_heads, head_dim = dims[1], dims[3]
        heads = c // head_dim
        per_group = heads // kv_heads
        h, d = np.divmod(np.arange(c, dtype=np.int64), head_dim)
        return FoldPoint(act, group, "attention", v, 1, site_c, (h // per_group) * head_dim + d, bias)
    return None


def _attention_path(start: str, end: str, consumers, graph_inputs: dict, outputs: set[str]) -> str | None:
    """The past-cache graph input the ``start`` -> ``end`` path concatenates ("" if none), when every
    consumer of every tensor on the path from ``start`` is a channel-preserving op (module notes)
    and the path reaches ``end``; else None."""
    seen, front, past, reached = {start}, [start], "", False
    while front:
        t = front.pop()
        if t == end:
            reached = True
            continue
        users = consumers.get(t, [])
        if not users and t not in outputs:
            return None
        for n in users:
            if n.op_type not in _PASS:
                return None
            if n.op_type == "MatMul" and (n.input[1] != t or n.input[0] in seen):
                return None  # V must be the B of probs @ V
            if n.op_type == "Transpose":
                perm = next((list(a.ints) for a in n.attribute if a.name == "perm"), None)
                if perm is None or perm[-1] != len(perm) - 1:
                    return None
            if n.op_type in ("Reshape", "Expand", "Unsqueeze") and n.input[0] != t:
                return None
            if n.op_type == "Concat":
                others = [i for i in n.input if i != t]
                if any(i not in graph_inputs for i in others):
                    return None
                past = others[0] if others else past
            for o in n.output[:1]:
                if o not in seen:
                    seen.add(o)
                    front.append(o)
    return past if reached else None


def apply(model: onnx.ModelProto, point: FoldPoint, site_scales: np.ndarray, tag: str,
          base_dir: str = "") -> None:
    """Fold ``site_scales`` (float32 ``[G]``, > 0) into ``model`` in place: each GEMM weight's rows
    times ``site_scales[groups]``, the site's initializer (and bias) divided by ``site_scales``. New
    initializers ``<old>_<tag>`` are written, so a tensor shared with other nodes never changes under
    them; the old ones are dropped when nothing reads them any more.

    Raises:
        QuantizationError: ``site_scales`` is not ``[G]``, finite and > 0.
    """
    s = np.asarray(site_scales, np.float32)
    if s.shape != (point.channels,) or not np.isfinite(s).all() or (s <= 0).any():
        raise QuantizationError(f"fold point {point.describe()}: scales {s.shape} must be [{point.channels}], "
                                "finite and > 0")
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    nodes = {n.name: n for n in g.node}
    rows = s[point.groups]
    for t in point.gemms:
        node = nodes[t.node]
        w = _load(inits[node.input[1]], base_dir)
        _replace_input(g, inits, node, 1, w * rows[:, None], f"{node.input[1]}_{tag}")
    arr = _load(inits[point.site.input[point.site_input]], base_dir)
    folded = arr / s if arr.ndim == 1 else arr / s[None, :]
    _replace_input(g, inits, point.site, point.site_input, folded, f"{point.site.input[point.site_input]}_{tag}")
    if point.bias is not None:
        add, idx = point.bias
        _replace_input(g, inits, add, idx, _load(inits[add.input[idx]], base_dir) / s, f"{add.input[idx]}_{tag}")
    drop_unused(g)


def _load(t: onnx.TensorProto, base_dir: str) -> np.ndarray:
    from onnx import external_data_helper

    if external_data_helper.uses_external_data(t) and not t.HasField("raw_data"):
        probe = onnx.TensorProto()
        probe.CopyFrom(t)
        return numpy_helper.to_array(probe, base_dir).astype(np.float32)
    return numpy_helper.to_array(t).astype(np.float32)


def current_weight(model: onnx.ModelProto, t: Target, base_dir: str = "") -> np.ndarray:
    """float32 ``[C, out]``: the weight target ``t``'s MatMul reads now (after earlier folds)."""
    node = next(n for n in model.graph.node if n.name == t.node)
    return _load(next(i for i in model.graph.initializer if i.name == node.input[1]), base_dir)


def _replace_input(g: onnx.GraphProto, inits: dict, node: onnx.NodeProto, idx: int, value: np.ndarray,
                   name: str) -> None:
    """Point ``node.input[idx]`` at a new initializer ``name`` (``inits`` stays current)."""
    tensor = numpy_helper.from_array(np.ascontiguousarray(value, np.float32), name)
    g.initializer.append(tensor)
    inits[name] = tensor
    node.input[idx] = name


def drop_unused(g: onnx.GraphProto) -> None:
    """Drop initializers no node (or graph output) reads."""
    used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    for i in reversed(range(len(g.initializer))):
        if g.initializer[i].name not in used:
            del g.initializer[i]


def _op(node: onnx.NodeProto | None) -> str:
    return "a graph input" if node is None else f"{node.op_type} node {node.name!r}"
