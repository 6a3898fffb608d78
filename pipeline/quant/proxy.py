"""A cheap per-GEMM sensitivity proxy for the accuracy-budget search (issue 18 §5).

Measuring every GEMM alone costs one forward pass each (fp8-llm: 210). Instead:

1. ``local_error``: each GEMM's own relative output error under its Q/DQ,
   ``e_i = ||Q(X) Q(W) - X W||^2 / ||X W||^2``, on FP32 input activations ``X`` captured in one
   forward pass over a few tuning windows (``Q`` the same quantization
   :func:`pipeline.quant.qdq.insert_qdq` writes: per-tensor activation scale ``amax / qmax``,
   the weight as :func:`pipeline.quant.qdq.quantize_weight` stores it).
2. ``predicted_gain``: the group trials (all GEMMs quantized but one group) measure what each
   group costs the network metric, ``gain_g``; a GEMM gets its group's gain in proportion to
   its local error, ``gain_i = gain_g * e_i / sum_{j in g} e_j``. So the network decides how
   much a kind of projection matters, and the local error decides which layers' copies matter.

The search (:func:`pipeline.quant.budget.search_fine`) ranks GEMMs by ``gain_i``, predicts the
metric after reverting the top k as ``m(k) = m_all - sum_{i<k} gain_i`` (gains taken additive),
and confirms a few k with full trials.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from pipeline.quant import qdq


def capture_inputs(model: onnx.ModelProto, acts: list[str], feeds: list[dict[str, np.ndarray]],
                   session) -> dict[str, np.ndarray]:
    """FP32 activations ``acts`` over ``feeds``, float32 ``[tokens, features]`` each (rows of all
    batches and positions; the last axis is the GEMM's K). ``session(model) -> InferenceSession``
    builds the session from the graph with ``acts`` as extra outputs (``model`` is restored after;
    memory: the serialized graph, plus tokens x features x 4 bytes per tensor)."""
    outs = model.graph.output
    n = len(outs)
    have = {o.name for o in outs}
    outs.extend(helper.make_empty_tensor_value_info(a) for a in acts if a not in have)
    try:
        sess = session(model)
    finally:
        del outs[n:]
    parts: dict[str, list[np.ndarray]] = {a: [] for a in acts}
    for f in feeds:
        for a, v in zip(acts, sess.run(acts, f)):
            parts[a].append(v.reshape(-1, v.shape[-1]).astype(np.float32))
    return {a: np.concatenate(v) for a, v in parts.items()}


def _qdq_act(x: np.ndarray, amax: float, fmt: qdq.QFormat) -> np.ndarray:
    """``DequantizeLinear(QuantizeLinear(x))`` with scale ``amax / qmax``: float32, shape of ``x``
    (INT8 rounds half to even and saturates at [-128, 127]; FP8 E4M3 saturates at +-448)."""
    scale = np.float32(qdq.scale_from_amax(amax, fmt, "activation"))
    y = x / scale
    if fmt.np_type is np.int8:
        q = np.clip(np.rint(y), -128, 127)
    else:
        q = np.clip(y, -fmt.qmax, fmt.qmax).astype(fmt.np_type).astype(np.float32)
    return (q * scale).astype(np.float32)


def local_error(model: onnx.ModelProto, targets: list[qdq.Target], inputs: dict[str, np.ndarray],
                amax: dict[str, float], fmt: qdq.QFormat, per_channel: bool) -> dict[str, float]:
    """``e_i`` of the module docstring per target node (MatMul weights ``[K, N]``; Gemm with
    ``transB``; other ops, e.g. Conv, get the mean error of the MatMuls). Dimensionless, >= 0."""
    inits = {i.name: i for i in model.graph.initializer}
    out: dict[str, float] = {}
    xq_memo: dict[str, np.ndarray] = {}
    for t in targets:
        if t.act not in inputs or t.weight not in inits:
            continue
        w = numpy_helper.to_array(inits[t.weight]).astype(np.float32)
        if w.ndim != 2:
            continue
        w = w.T if t.weight_axis == 0 else w  # -> [K, N]
        q, scale = qdq.quantize_weight(w, fmt, 1 if per_channel else None)
        wq = q.astype(np.float32) * scale
        x = inputs[t.act]
        if t.act not in xq_memo:
            xq_memo[t.act] = _qdq_act(x, amax[t.act], fmt)
        ref = x @ w
        err = xq_memo[t.act] @ wq - ref
        out[t.node] = float(np.square(err, dtype=np.float64).sum() / max(np.square(ref, dtype=np.float64).sum(), 1e-30))
    rest = float(np.mean(list(out.values()))) if out else 1.0
    return {t.node: out.get(t.node, rest) for t in targets}


def predicted_gain(errors: dict[str, float], group_nodes: dict[str, list[str]],
                   group_gain: dict[str, float]) -> dict[str, float]:
    """``gain_i = max(gain_g, 0) * e_i / sum_{j in g} e_j`` per node of each group in
    ``group_gain`` (metric units, e.g. nats of KL; module docstring)."""
    gain: dict[str, float] = {}
    for g, nodes in group_nodes.items():
        if g not in group_gain:
            continue
        total = sum(errors[n] for n in nodes) or 1.0
        for n in nodes:
            gain[n] = max(group_gain[g], 0.0) * errors[n] / total
    return gain
