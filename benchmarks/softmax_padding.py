"""Why batched prompt scoring is not bit-identical to scoring alone on a CPU (docs/serving.md).

The served generation model left-pads each row's past to the longest past of its batch, so a row's
keys sit ``pad`` positions further right in the attention Softmax. ONNX Runtime's CPU Softmax sums
``exp`` in SIMD lanes; a shift that is not a multiple of the vector width regroups the sum, and the
probabilities move by about one float32 ulp. This script measures, on this CPU, the largest change
and the share of changed probabilities for left and right padding of several widths, in one
ONNX Runtime session (``[1, 9, L, L]`` float32 scores, the padding filled with float32's lowest
value as the exported graph's mask does). It prints a table; it asserts nothing (the result depends
on the kernel ONNX Runtime picks for this CPU; on an AVX-512 machine a shift of 8 or 16 was exact).

Usage: python benchmarks/softmax_padding.py
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper


def softmax_session() -> ort.InferenceSession:
    """A one-node Softmax (axis -1) graph over float32 ``[b, h, q, k]``, at the basic level."""
    graph = helper.make_graph([helper.make_node("Softmax", ["p"], ["y"], axis=-1)], "softmax",
                              [helper.make_tensor_value_info("p", TensorProto.FLOAT, ["b", "h", "q", "k"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def main() -> None:
    session, rng, lowest = softmax_session(), np.random.default_rng(0), np.finfo(np.float32).min
    print("| length | pad | side | max abs change | share changed |\n|---|---|---|---|---|")
    for length in (37, 100, 256):
        scores = (3 * rng.standard_normal((1, 9, length, length))).astype(np.float32)
        alone = session.run(None, {"p": scores})[0]
        for pad in (1, 3, 8, 13, 16):
            for side in ("left", "right"):
                padded = np.full((1, 9, length, length + pad), lowest, np.float32)
                cut = slice(pad, None) if side == "left" else slice(0, length)
                padded[..., cut] = scores
                out = session.run(None, {"p": padded})[0][..., cut]
                print(f"| {length} | {pad} | {side} | {np.abs(out - alone).max():.2e} | {(out != alone).mean():.1%} |")


if __name__ == "__main__":
    main()
