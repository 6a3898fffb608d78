"""Q/DQ graph rules TensorRT enforces, on tiny graphs built with onnx.helper."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.errors import GraphCheckError
from pipeline.checks.graph import check_qdq_graph

F = TensorProto.FLOAT


def init(name: str, values, dtype: int) -> TensorProto:
    arr = np.asarray(values)
    return helper.make_tensor(name, dtype, list(arr.shape), arr.ravel().tolist())


def qdq_pair(prefix: str, src: str, scale: str, zp: str | None) -> list[onnx.NodeProto]:
    """src -> Q -> DQ -> <prefix>_dq; nodes named <prefix>_q / <prefix>_dq."""
    extra = [zp] if zp else []
    return [
        helper.make_node("QuantizeLinear", [src, scale, *extra], [f"{prefix}_q"], name=f"{prefix}_q"),
        helper.make_node("DequantizeLinear", [f"{prefix}_q", scale, *extra], [f"{prefix}_dq"], name=f"{prefix}_dq"),
    ]


def model(nodes, inits, out: str, opset: int = 19, extra_inputs=(), out_shape=None) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", F, [2, 4]), *extra_inputs],
        [helper.make_tensor_value_info(out, F, out_shape)],
        initializer=inits,
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 9
    return m


def errors_of(m: onnx.ModelProto) -> str:
    with pytest.raises(GraphCheckError) as e:
        check_qdq_graph(m)
    return str(e.value)


# --- valid graphs pass --------------------------------------------------------------------


def test_valid_int8_graph_passes():
    inits = [init("s", 0.05, F), init("zp", 0, TensorProto.INT8)]
    m = model([*qdq_pair("a", "x", "s", "zp"), helper.make_node("Relu", ["a_dq"], ["y"])], inits, "y", opset=13, out_shape=[2, 4])
    onnx.checker.check_model(m, full_check=True)
    check_qdq_graph(m)


def test_valid_fp8_graph_with_constant_node_scale_passes():
    nodes = [
        helper.make_node("Constant", [], ["s"], name="scale_const", value=init("v", 0.02, F)),
        helper.make_node("Constant", [], ["zp"], name="zp_const", value=init("z", 0.0, TensorProto.FLOAT8E4M3FN)),
        *qdq_pair("a", "x", "s", "zp"),
        helper.make_node("MatMul", ["a_dq", "w_dq"], ["y"]),
    ]
    # per-channel FP8 weight, stored quantized: DQ only
    w = [
        init("w", np.zeros((4, 3)), TensorProto.FLOAT8E4M3FN),
        init("w_s", [0.1, 0.2, 0.3], F),
        init("w_zp", [0.0, 0.0, 0.0], TensorProto.FLOAT8E4M3FN),
    ]
    nodes.insert(0, helper.make_node("DequantizeLinear", ["w", "w_s", "w_zp"], ["w_dq"], name="w_dq", axis=1))
    m = model(nodes, w, "y", opset=19, out_shape=[2, 3])
    onnx.checker.check_model(m, full_check=True)
    check_qdq_graph(m)


# --- zero points and signedness -----------------------------------------------------------


def test_nonzero_int8_zero_point_names_node_and_tensor():
    inits = [init("s", 0.05, F), init("act_zp", 3, TensorProto.INT8)]
    msg = errors_of(model(qdq_pair("act", "x", "s", "act_zp"), inits, "act_dq"))
    assert "node 'act_q' (QuantizeLinear): zero point 'act_zp' has 1 non-zero value(s) (3)" in msg
    assert "node 'act_dq' (DequantizeLinear): zero point 'act_zp'" in msg


def test_uint8_zero_point_is_rejected_even_when_zero():
    inits = [init("s", 0.05, F), init("u_zp", 0, TensorProto.UINT8)]
    msg = errors_of(model(qdq_pair("u", "x", "s", "u_zp"), inits, "u_dq"))
    assert "node 'u_q' (QuantizeLinear): zero point 'u_zp' is uint8" in msg
    assert "node 'u_dq' (DequantizeLinear): zero point 'u_zp' is uint8" in msg
    assert "signed INT8" in msg


def test_quantize_without_zero_point_defaults_to_uint8():
    msg = errors_of(model(qdq_pair("d", "x", "s", None), [init("s", 0.05, F)], "d_dq"))
    assert "node 'd_q' (QuantizeLinear): output 'd_q' is uint8 (no zero point given, so ONNX defaults to uint8)" in msg
    # the DQ reads that uint8 tensor
    assert "node 'd_dq' (DequantizeLinear): quantized input 'd_q' is uint8" in msg


def test_uint8_embedding_table_on_gather_path():
    nodes = [
        helper.make_node("DequantizeLinear", ["embed_w", "embed_s", "embed_zp"], ["embed_dq"], name="embed_dq"),
        helper.make_node("Gather", ["embed_dq", "ids"], ["y"], name="embed_gather"),
    ]
    inits = [
        init("embed_w", np.full((10, 4), 128), TensorProto.UINT8),
        init("embed_s", 0.01, F),
        init("embed_zp", 128, TensorProto.UINT8),
    ]
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [2])
    msg = errors_of(model(nodes, inits, "y", extra_inputs=[ids]))
    assert "node 'embed_dq' (DequantizeLinear): zero point 'embed_zp' is uint8" in msg
    assert "node 'embed_dq' (DequantizeLinear): zero point 'embed_zp' has 1 non-zero value(s) (128)" in msg


def test_uint8_table_without_zero_point_is_found_from_its_type():
    nodes = [helper.make_node("DequantizeLinear", ["tbl", "tbl_s"], ["y"], name="tbl_dq")]
    inits = [init("tbl", np.zeros((3, 4)), TensorProto.UINT8), init("tbl_s", 0.01, F)]
    assert "node 'tbl_dq' (DequantizeLinear): quantized input 'tbl' is uint8" in errors_of(model(nodes, inits, "y"))


# --- FP8 opset ----------------------------------------------------------------------------


def test_fp8_needs_opset_19():
    inits = [init("s", 0.02, F), init("f8_zp", 0.0, TensorProto.FLOAT8E4M3FN)]
    msg = errors_of(model(qdq_pair("f8", "x", "s", "f8_zp"), inits, "f8_dq", opset=17))
    assert "node 'f8_q' (QuantizeLinear): float8e4m3fn Q/DQ needs default-domain opset >= 19" in msg
    assert "imports opset 17" in msg
    assert "node 'f8_dq'" in msg


# --- scales -------------------------------------------------------------------------------


def test_bad_scales_are_all_listed_with_node_and_tensor():
    nodes, inits = [], [init("zp", 0, TensorProto.INT8)]
    for prefix, value in [("zero", 0.0), ("neg", -0.1), ("nan", np.nan), ("inf", np.inf)]:
        nodes += qdq_pair(prefix, "x", f"{prefix}_scale", "zp")
        inits.append(init(f"{prefix}_scale", value, F))
    nodes.append(helper.make_node("Sum", ["zero_dq", "neg_dq", "nan_dq", "inf_dq"], ["y"]))
    msg = errors_of(model(nodes, inits, "y"))
    assert "8 TensorRT rule(s)" in msg
    assert "node 'zero_q' (QuantizeLinear): scale 'zero_scale' has 1 zero value(s)" in msg
    assert "node 'neg_dq' (DequantizeLinear): scale 'neg_scale' has 1 negative value(s)" in msg
    assert "node 'nan_q' (QuantizeLinear): scale 'nan_scale' has 1 NaN value(s)" in msg
    assert "node 'inf_q' (QuantizeLinear): scale 'inf_scale' has 1 Inf value(s)" in msg
    assert "attention mask" in msg and "amax=inf" in msg


def test_per_channel_scale_counts_each_bad_channel():
    nodes = [helper.make_node("DequantizeLinear", ["w", "w_s", "w_zp"], ["y"], name="w_dq", axis=0)]
    inits = [
        init("w", np.zeros((3, 4)), TensorProto.INT8),
        init("w_s", [0.1, -np.inf, 0.0], F),
        init("w_zp", [0, 0, 0], TensorProto.INT8),
    ]
    msg = errors_of(model(nodes, inits, "y"))
    assert "scale 'w_s' has 1 zero, 1 negative, 1 Inf value(s)" in msg


def test_constant_node_scale_is_checked():
    nodes = [
        helper.make_node("Constant", [], ["c_scale"], name="c", value_float=0.0),
        helper.make_node("Constant", [], ["c_zp"], value=init("z", 0, TensorProto.INT8)),
        *qdq_pair("c", "x", "c_scale", "c_zp"),
    ]
    msg = errors_of(model(nodes, [], "c_dq"))
    assert "node 'c_q' (QuantizeLinear): scale 'c_scale' has 1 zero value(s)" in msg


def test_q_dq_inside_a_subgraph_is_checked():
    body = helper.make_graph(
        qdq_pair("sub", "x", "sub_s", "sub_zp"),
        "then",
        [],
        [helper.make_tensor_value_info("sub_dq", F, None)],
        initializer=[init("sub_s", 0.05, F), init("sub_zp", 7, TensorProto.INT8)],
    )
    nodes = [helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=body, else_branch=body)]
    cond = helper.make_tensor_value_info("cond", TensorProto.BOOL, [])
    msg = errors_of(model(nodes, [], "y", extra_inputs=[cond]))
    assert "node 'sub_q' (QuantizeLinear): zero point 'sub_zp' has 1 non-zero value(s) (7)" in msg
