"""The capacity plan's GPU weight bytes for weight-only INT4: half a byte per INT4 weight,
and a tied lm_head (MatMul on Transpose(table)) counted beside the FP32 table its Gather still reads."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from pipeline.plan import capacity as P


def test_int4_weights_and_a_tied_lm_head():
    table, w = np.zeros((10, 8), np.float32), np.zeros((8, 4), np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["h"], name="embed"),
         helper.make_node("MatMul", ["h", "w"], ["y"], name="mm"),
         helper.make_node("Transpose", ["table"], ["table_t"], name="t", perm=[1, 0]),
         helper.make_node("MatMul", ["h", "table_t"], ["logits"], name="lm_head")],
        "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", 10])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(w, "w")])
    cpu, gpu, params, quantized = P.weight_bytes_by_target(helper.make_model(graph), ["mm", "lm_head"], "int4")
    assert (params, quantized, cpu) == (112, 112, 112 * 4)
    assert gpu == 32 // 2 + 80 // 2 + 80 * 4  # INT4 weights; the table once quantized, once FP32 for the Gather
