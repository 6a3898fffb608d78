"""``quantize.weights.pad``: a block size that does not divide a GEMM's K, zero-padded
(:func:`pipeline.quant.int4.rewrite_rtn` with ``pad``). On tiny FP32 graphs: the padded GEMM equals the
unpadded dequantized GEMM through ONNX Runtime (unfused and fused into MatMulNBits), GEMMs on one input
share one Pad, the refusal names the option, and TensorRT-RTX builds a padded block-128 GEMM on
K = 576 (SmolLM2's hidden size) for sm86, sm89 and sm120."""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.errors import QuantizationError
from pipeline.quant import int4


def qkv_graph(k: int, ns: tuple[int, ...], seed: int = 0) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``x [b, s, k]`` read by one MatMul per ``n`` in ``ns`` (FP32 weights ``[k, n]``), outputs ``y{i}``."""
    rng = np.random.default_rng(seed)
    weights = {f"w{i}": rng.standard_normal((k, n)).astype(np.float32) for i, n in enumerate(ns)}
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"], name=f"mm{i}") for i in range(len(ns))]
    graph = helper.make_graph(nodes, "qkv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", k])],
                              [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["b", "s", n])
                               for i, n in enumerate(ns)],
                              [numpy_helper.from_array(w, name) for name, w in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), weights


def run(model: onnx.ModelProto, x: np.ndarray, level, tmp_path) -> tuple[list[np.ndarray], Counter]:
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    so.add_session_config_entry(*int4.ORT_ACCURACY_CONFIG)
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x}), Counter(n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node)


def test_padded_form_is_the_short_last_block_rounded_and_zeros():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 96)).astype(np.float32)  # [N, K]: blocks of 64 -> one whole block, one of 32 + 32 zeros
    form = int4.rtn_form(w, 64, pad=True)
    assert form.values.shape == (8, 128) and form.scales.shape == (8, 2) and int4.padded_k(96, 64) == 128
    assert not form.values[:, 96:].any()
    np.testing.assert_array_equal(form.scales[:, 1], np.abs(w[:, 64:]).max(axis=1) / np.float32(7))
    np.testing.assert_array_equal(form.values[:, :64], int4.rtn_form(w[:, :64], 64).values)
    np.testing.assert_array_equal(form.values[:, 64:96], int4.rtn_form(w[:, 64:], 32).values)
    np.testing.assert_array_equal(int4.fake_quantize(w.T, 64, pad=True), form.dequantized()[:, :96].T)
    x = rng.standard_normal((40, 96)).astype(np.float32)
    clips = int4.clip_search(x, w.T, 64, pad=True)
    assert clips.shape == (8, 2) and ((clips > 0) & (clips <= 1)).all()
    with pytest.raises(QuantizationError, match=r"K = 96 .*quantize\.weights\.pad: true"):
        int4.rtn_form(w, 64)


def test_padded_gemms_equal_the_unpadded_dequantized_gemms_in_onnx_runtime(tmp_path):
    k, ns, bs = 96, (48, 16, 16), 64  # q/k/v-like: three GEMMs on one input, K = 96 padded to 128
    model, weights = qkv_graph(k, ns)
    done = int4.rewrite_rtn(model, block_size=bs, pad=True)
    assert [(d.k, d.padded_k, d.onnx_form) for d in done] == [(96, 128, "INT4 block 64")] * 3
    pads = [n for n in model.graph.node if n.op_type == "Pad"]
    assert len(pads) == 1 and pads[0].input[0] == "x"  # one Pad shared by the three GEMMs
    assert all(n.input[0] == pads[0].output[0] for n in model.graph.node if n.op_type == "MatMul")
    onnx.checker.check_model(model, full_check=True)
    x = np.random.default_rng(2).standard_normal((2, 5, k)).astype(np.float32)
    # the reference: the unpadded dequantized weights (the form's first K rows) in a plain FP32 MatMul
    deq = {name: int4.rtn_form(np.ascontiguousarray(w.T), bs, pad=True).dequantized()[:, :k].T
           for name, w in weights.items()}
    ref_model, _ = qkv_graph(k, ns)
    for t in ref_model.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(deq[t.name]), t.name))
    ref, _ = run(ref_model, x, ort.GraphOptimizationLevel.ORT_DISABLE_ALL, tmp_path)
    plain, ops = run(model, x, ort.GraphOptimizationLevel.ORT_DISABLE_ALL, tmp_path)
    assert ops["DequantizeLinear"] == 3 and ops["Pad"] == 1
    fused, fops = run(model, x, ort.GraphOptimizationLevel.ORT_ENABLE_ALL, tmp_path)
    assert fops["MatMulNBits"] == 3 and "DequantizeLinear" not in fops and "MatMul" not in fops
    for i, w in enumerate(deq.values()):
        # float32 summation only: the zero rows add exactly 0 (bound as tests/unit/quant/test_gguf_blocks.py)
        bound = (2 * k + 4) * 2.0**-24 * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64))
        expect = x.astype(np.float64) @ w.astype(np.float64)
        assert (np.abs(ref[i] - expect) <= bound).all()
        assert (np.abs(plain[i] - expect) <= bound).all()
        assert (np.abs(fused[i] - expect) <= bound).all()


def test_without_pad_the_block_is_refused_naming_the_gemm_k_and_the_option():
    model, _ = qkv_graph(96, (16,))
    with pytest.raises(QuantizationError) as err:
        int4.rewrite_rtn(model, block_size=64)
    assert "mm0 (K = 96)" in str(err.value) and "quantize.weights.pad: true" in str(err.value)
    assert [n.op_type for n in model.graph.node] == ["MatMul"]  # nothing rewritten


def test_tensorrt_rtx_builds_a_padded_block_128_gemm_on_k_576_for_ampere_ada_blackwell(tmp_path):
    import rtx_graphs

    rtx_graphs.rtx_backend()  # or skip, naming why TensorRT-RTX cannot be used here
    k = 576
    model, _ = qkv_graph(k, (64, 32))
    assert [d.padded_k for d in int4.rewrite_rtn(model, block_size=128, pad=True)] == [640, 640]
    blob = model.SerializeToString()

    def build(target: str) -> tuple[bool, str]:
        size, log, _ = rtx_graphs.build_one_input(blob, target, k=k)
        return size is not None, log

    for target in ("sm86", "sm89", "sm120"):
        built, log = build(target)
        assert built, f"{target}: {log}"
