"""What a different attention graph would save per decode step (not a test; input for a decision).

The exported LLM (torch SDPA through the dynamo exporter) does, per layer and step:
Concat(past, new) -> Unsqueeze -> Expand (GQA: K/V repeated to every query head) -> Reshape ->
Transpose(K) -> Mul(K, sqrt(scale)) -> MatMul -> Add(mask) -> Softmax -> MatMul. Every op after
the Concat copies the whole (expanded) KV, so the step grows with the past. This script builds
``--layers`` copies of one layer's attention (batch 1, one query token, SmolLM2's 9 query / 3
KV heads, head_dim 64) in three forms and times them in ONNX Runtime at past P in ``--pasts``,
interleaved:

* ``exported``: the pattern above;
* ``grouped``: no Expand; the query heads of a KV head become rows of one MatMul
  (Q [B, H_kv, group * n, D] @ K^T), the scale applied to Q, one Transpose of the un-expanded K;
* ``grouped_kq``: as ``grouped`` with the scores computed transposed, ``K @ Q^T`` (standard
  ONNX, no copy of K: only the [group, T] scores are transposed back);
* ``grouped_transb``: as ``grouped`` with ``com.microsoft.FusedMatMul(transB=1)``: no Transpose;
* ``static_kv``: as ``grouped`` over a cache that already holds the new entry (no Concat: the
  floor of a graph that writes K/V into a static buffer at a position index);

and prints ms per step for all layers (the fastest of the repeats, and the median), and the
growth from the smallest to the largest past.
With ``--graph-ms LO HI`` (the served graph's own step at the smallest and largest past, from
benchmarks/kv_step_cost.py) it also estimates each form's step ratio: the real step at the
largest past, less the ``exported`` growth, plus the form's growth, over the step at the smallest.

    .venv/bin/python benchmarks/attention_pattern_cost.py [--graph-ms 16.6 21.1]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

HEADS, KV_HEADS, DIM = 9, 3, 64


def layer(i: int, form: str) -> tuple[list, list[str]]:
    """Nodes of layer ``i``'s attention (inputs q{i}, k{i}, v{i}, past_k{i}, past_v{i}, mask);
    returns (nodes, its output names: attention output and the two presents)."""
    p = f"l{i}_"
    if form == "static_kv":  # the new entry already written into the cache buffer: no Concat
        nodes = [helper.make_node("Identity", [f"past_{t}{i}"], [p + t.upper()]) for t in ("k", "v")]
    else:
        nodes = [helper.make_node("Concat", [f"past_k{i}", f"k{i}"], [p + "K"], axis=2),
                 helper.make_node("Concat", [f"past_v{i}", f"v{i}"], [p + "V"], axis=2)]
    if form == "exported":
        for t in ("K", "V"):
            nodes += [helper.make_node("Unsqueeze", [p + t, "axis2"], [p + t + "u"]),
                      helper.make_node("Shape", [p + t], [p + t + "s"]),
                      helper.make_node("Gather", [p + t + "s", "idx2"], [p + t + "len"]),
                      helper.make_node("Concat", ["expand_head", p + t + "len", "dim"], [p + t + "eshape"], axis=0),
                      helper.make_node("Expand", [p + t + "u", p + t + "eshape"], [p + t + "e"]),
                      helper.make_node("Concat", ["heads_shape", p + t + "len", "dim"], [p + t + "rshape"], axis=0),
                      helper.make_node("Reshape", [p + t + "e", p + t + "rshape"], [p + t + "r"])]
        nodes += [helper.make_node("Transpose", [p + "Kr"], [p + "Kt"], perm=[0, 1, 3, 2]),
                  helper.make_node("Mul", [p + "Kt", "sqrt_scale"], [p + "Kts"]),
                  helper.make_node("Mul", [f"q{i}", "sqrt_scale"], [p + "qs"]),
                  helper.make_node("MatMul", [p + "qs", p + "Kts"], [p + "S"]),
                  helper.make_node("Add", [p + "S", "mask"], [p + "Sm"]),
                  helper.make_node("Softmax", [p + "Sm"], [p + "P"], axis=-1),
                  helper.make_node("MatMul", [p + "P", p + "Vr"], [p + "out"])]
        return nodes, [p + "out", p + "K", p + "V"]
    nodes += [helper.make_node("Mul", [f"q{i}", "scale"], [p + "qs"]),  # [1, 9, 1, D] -> [1, 3, 3, D]
              helper.make_node("Reshape", [p + "qs", "group_shape"], [p + "qg"])]  # [1, 3, group, D]
    if form in ("grouped", "static_kv"):
        nodes += [helper.make_node("Transpose", [p + "K"], [p + "Kt"], perm=[0, 1, 3, 2]),
                  helper.make_node("MatMul", [p + "qg", p + "Kt"], [p + "S"])]
    elif form == "grouped_kq":  # scores transposed: K @ Q^T [1, 3, T, group]; only small tensors are transposed
        nodes += [helper.make_node("Transpose", [p + "qg"], [p + "qgt"], perm=[0, 1, 3, 2]),
                  helper.make_node("MatMul", [p + "K", p + "qgt"], [p + "St"]),
                  helper.make_node("Transpose", [p + "St"], [p + "S"], perm=[0, 1, 3, 2])]
    else:
        nodes += [helper.make_node("FusedMatMul", [p + "qg", p + "K"], [p + "S"], domain="com.microsoft",
                                   transB=1, alpha=1.0)]
    nodes += [helper.make_node("Add", [p + "S", "mask"], [p + "Sm"]),
              helper.make_node("Softmax", [p + "Sm"], [p + "P"], axis=-1),
              helper.make_node("MatMul", [p + "P", p + "V"], [p + "og"]),
              helper.make_node("Reshape", [p + "og", "heads_out"], [p + "out"])]
    return nodes, [p + "out", p + "K", p + "V"]


def model(form: str, layers: int) -> bytes:
    f32 = TensorProto.FLOAT
    inits = [numpy_helper.from_array(np.array([2], np.int64), "idx2"),
             numpy_helper.from_array(np.array([2], np.int64), "axis2"),
             numpy_helper.from_array(np.array([1, KV_HEADS, HEADS // KV_HEADS], np.int64), "expand_head"),
             numpy_helper.from_array(np.array([1, HEADS], np.int64), "heads_shape"),
             numpy_helper.from_array(np.array([DIM], np.int64), "dim"),
             numpy_helper.from_array(np.array([1, KV_HEADS, HEADS // KV_HEADS, DIM], np.int64), "group_shape"),
             numpy_helper.from_array(np.array([1, HEADS, 1, DIM], np.int64), "heads_out"),
             numpy_helper.from_array(np.array(DIM ** -0.25, np.float32), "sqrt_scale"),
             numpy_helper.from_array(np.array(DIM ** -0.5, np.float32), "scale")]
    nodes, inputs, outputs = [], [helper.make_tensor_value_info("mask", f32, [1, 1, 1, "total"])], []
    for i in range(layers):
        n, outs = layer(i, form)
        nodes += n
        inputs += [helper.make_tensor_value_info(f"q{i}", f32, [1, HEADS, 1, DIM]),
                   *[helper.make_tensor_value_info(f"{t}{i}", f32, [1, KV_HEADS, 1, DIM]) for t in ("k", "v")],
                   *[helper.make_tensor_value_info(f"past_{t}{i}", f32, [1, KV_HEADS, "past", DIM]) for t in ("k", "v")]]
        outputs += [helper.make_tensor_value_info(o, f32, None) for o in outs]
    graph = helper.make_graph(nodes, form, inputs, outputs, inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 9
    return m.SerializeToString()


def feeds(layers: int, past: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {"mask": np.zeros((1, 1, 1, past + 1), np.float32)}
    for i in range(layers):
        out[f"q{i}"] = rng.standard_normal((1, HEADS, 1, DIM)).astype(np.float32)
        for t in ("k", "v"):
            out[f"{t}{i}"] = rng.standard_normal((1, KV_HEADS, 1, DIM)).astype(np.float32)
            out[f"past_{t}{i}"] = rng.standard_normal((1, KV_HEADS, past, DIM)).astype(np.float32)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--pasts", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--graph-ms", type=float, nargs=2, metavar=("LO", "HI"),
                        help="the served graph's own step (ms) at the smallest and largest past (kv_step_cost.py)")
    args = parser.parse_args()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC  # as the served Q/DQ graph
    options.log_severity_level = 3
    forms = ("exported", "grouped", "grouped_kq", "grouped_transb", "static_kv")
    sessions = {f: ort.InferenceSession(model(f, args.layers), options, providers=["CPUExecutionProvider"])
                for f in forms}
    data = {p: feeds(args.layers, p) for p in args.pasts}
    static = {p: {**feeds(args.layers, p + 1), "mask": data[p]["mask"]} for p in args.pasts}  # cache holds P + 1
    ref = {p: sessions["exported"].run(None, data[p]) for p in args.pasts}
    for f in ("grouped", "grouped_kq", "grouped_transb"):  # same attention output and presents
        for p in args.pasts:
            got = sessions[f].run(None, data[p])
            for a, b in zip(got, ref[p]):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    times = {(f, p): [] for f in forms for p in args.pasts}
    for _ in range(args.repeats):  # interleaved, so load drift hits every form alike
        for (f, p), got in times.items():
            start = time.perf_counter()
            sessions[f].run(None, static[p] if f == "static_kv" else data[p])
            got.append((time.perf_counter() - start) * 1e3)
    lo, hi = min(args.pasts), max(args.pasts)
    # min: the least disturbed run (other load only ever adds time); median alongside
    report = {f: {str(p): round(float(np.min(times[f, p])), 3) for p in args.pasts} for f in forms}
    for f in forms:
        report[f]["growth_ms"] = round(report[f][str(hi)] - report[f][str(lo)], 3)
        report[f]["median"] = {str(p): round(float(np.median(times[f, p])), 3) for p in args.pasts}
    if args.graph_ms:  # the real graph at lo and hi, with the exported attention growth swapped for another's
        g_lo, g_hi = args.graph_ms
        for f in forms:
            report[f"estimated_step_ratio_{hi}_{lo}_{f}"] = round(
                (g_hi - report["exported"]["growth_ms"] + report[f]["growth_ms"]) / g_lo, 3)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
