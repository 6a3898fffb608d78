"""NVFP4 weights (pipeline.quant.nvfp4): the quantizer's grid and scales, the two-DequantizeLinear
graph against its decoded FP32 twin (ONNX's reference evaluator decodes the FP4 graph; ONNX Runtime
runs the twin), the opset rule, the report's bits per weight, and what TensorRT-RTX 1.7 builds
(sm120) and refuses (sm89, sm86, sm75: "HW-specific datatypes: fp4_e2m1"). About 10 s."""
from __future__ import annotations


import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, defs, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from pipeline.errors import EXIT_BAD_INPUT, QuantizationError
from pipeline.quant import nvfp4
from pipeline.trt import report as engine_report

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def test_values_are_e2m1_scales_e4m3_and_each_value_is_the_nearest_grid_point():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 24)) * np.exp(rng.standard_normal((1, 24)))).astype(np.float32)
    q = nvfp4.quantize(w)
    assert q.values.dtype == ml_dtypes.float4_e2m1fn and q.block_scales.dtype == ml_dtypes.float8_e4m3fn
    assert q.values.shape == (64, 24) and q.block_scales.shape == (64 // 16, 24)
    assert q.tensor_scale == np.float32(np.abs(w).max() / (6 * 448))
    v = q.values.astype(np.float32)
    assert set(np.abs(v).ravel()) <= set(E2M1)
    s = np.repeat(q.scales(), 16, axis=0)
    assert np.all(s > 0) and float(q.block_scales.astype(np.float32).max()) <= 448
    ideal = w / s  # the value before rounding: |ideal| <= 6 (up to the FP8 scale's rounding), nearest point taken
    dist = np.abs(np.abs(ideal)[..., None] - E2M1).min(-1)
    assert np.all(np.isclose(np.abs(np.abs(ideal) - np.abs(v)), dist, rtol=0, atol=1e-6) | (np.abs(ideal) > 6))
    assert np.all((v == 0) | (np.sign(v) == np.sign(ideal)))
    assert np.array_equal(q.decode(), v * s)  # the decode is exact: at most 2 significant bits times a float32
    assert float(np.sqrt(np.mean((q.decode() - w) ** 2)) / np.sqrt(np.mean(w ** 2))) < 0.12


def test_zero_blocks_and_a_zero_tensor_decode_to_zero():
    w = np.zeros((32, 4), np.float32)
    w[16:, 1] = np.linspace(-1, 1, 16)
    q = nvfp4.quantize(w)
    assert np.all(q.decode()[:16] == 0) and np.all(q.decode()[:, [0, 2, 3]] == 0)
    assert np.all(nvfp4.quantize(np.zeros((16, 2), np.float32)).decode() == 0)


def test_a_k_not_dividing_into_16_blocks_and_a_nan_are_refused_naming_them():
    with pytest.raises(QuantizationError, match=r"MatMul 'mm': K = 40 is not a multiple of NVFP4's 16-element") as e:
        nvfp4.quantize(np.ones((40, 8), np.float32), "MatMul 'mm'")
    assert e.value.exit_code == EXIT_BAD_INPUT
    w = np.ones((16, 8), np.float32)
    w[3, 5] = np.nan
    with pytest.raises(QuantizationError, match=r"w: element \(3, 5\) is nan"):
        nvfp4.quantize(w, "w")


def tied_graph(k: int = 64, n: int = 48, vocab: int = 40, opset: int = 19) -> onnx.ModelProto:
    """ids -> Gather(emb [V, K]) -> MatMul w1 [K, N] (h1) and MatMul Transpose(emb) (logits: a tied lm_head)."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal((vocab, k)).astype(np.float32), "emb")]
    nodes = [helper.make_node("Gather", ["emb", "ids"], ["h0"], name="gather"),
             helper.make_node("MatMul", ["h0", "w1"], ["h1"], name="mm1"),
             helper.make_node("Transpose", ["emb"], ["embT"], name="tr", perm=[1, 0]),
             helper.make_node("MatMul", ["h0", "embT"], ["logits"], name="lm_head")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
                          [helper.make_tensor_value_info("h1", TensorProto.FLOAT, ["b", "s", n]),
                           helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", vocab])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def test_the_fp4_graph_and_its_decoded_twin_compute_the_same_function():
    model = tied_graph()
    decoded = onnx.ModelProto()
    decoded.CopyFrom(model)
    done = nvfp4.rewrite_matmuls(model, decoded)
    assert [(r.node, r.weight, r.k, r.n) for r in done] == [("mm1", "w1", 64, 48), ("lm_head", "emb", 64, 40)]
    for m in (model, decoded):
        onnx.checker.check_model(m, full_check=True)
    assert (model.opset_import[0].version, model.ir_version) == (23, 11)
    assert (decoded.opset_import[0].version, decoded.ir_version) == (19, 9)  # the export's: any ONNX Runtime reads it
    assert [n.op_type for n in decoded.graph.node] == ["Gather", "MatMul", "MatMul"]  # the Transpose is gone
    assert {t.name for t in model.graph.initializer} >= {"emb", "nvfp4.w1.values", "nvfp4.emb.T.block_scales"}
    assert "w1" not in {t.name for t in model.graph.initializer}  # the FP32 weight no GEMM reads is dropped
    # ONNX's reference evaluator runs the two DequantizeLinear; its weight is the twin's, bit for bit
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    outs = [f"nvfp4.{w}.dequantized" for w in ("w1", "emb.T")]
    probe = helper.make_model(helper.make_graph(dq, "dq", [], [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                                                              for o in outs], list(model.graph.initializer)),
                              opset_imports=[helper.make_opsetid("", 23)], ir_version=11)
    twin = {t.name: numpy_helper.to_array(t) for t in decoded.graph.initializer}
    for name, got in zip(outs, ReferenceEvaluator(probe).run(None, {})):
        assert np.array_equal(got.view(np.uint32), twin[name].view(np.uint32)), name
    ids = np.array([[0, 5, 39], [1, 2, 3]], np.int64)
    ref = ReferenceEvaluator(model).run(None, {"ids": ids})
    cpu = ort.InferenceSession(decoded.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})
    for a, b in zip(ref, cpu):
        assert np.allclose(a, b, rtol=1e-6, atol=1e-5)


def test_onnx_runtime_has_no_fp4_dequantize_linear_on_cpu():
    """Why the decoded twin exists (ONNX Runtime 1.31: NOT_IMPLEMENTED); fails once it gains one."""
    model = tied_graph()
    nvfp4.rewrite_matmuls(model, onnx.ModelProto(), skip=frozenset())  # the twin is not needed here
    with pytest.raises(Exception, match="NOT_IMPLEMENTED|not implemented|Could not find an implementation"):
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_raising_to_opset_23_changes_only_types_and_optional_attributes_from_21():
    """nvfp4.raise_opset's claim, against onnx.defs: each op whose schema changed at opset 22 or 23
    kept its inputs, outputs and attributes, but for DequantizeLinear's ``output_dtype`` and
    QuantizeLinear's ``precision``, both optional (defaults: the old behaviour)."""
    added = {}
    for s in defs.get_all_schemas_with_history():
        if s.domain != "" or s.since_version not in (22, 23):
            continue
        try:
            p = defs.get_schema(s.name, s.since_version - 1)
        except defs.SchemaError:
            continue  # new at 22/23: not in an older graph
        io = lambda x: [i.name for i in x.inputs] + [o.name for o in x.outputs]  # noqa: E731
        assert io(s) == io(p), s.name
        extra = set(s.attributes) - set(p.attributes)
        assert set(p.attributes) <= set(s.attributes), s.name
        if extra:
            added[s.name] = {a: s.attributes[a].required for a in extra}
    assert added == {"DequantizeLinear": {"output_dtype": False}, "QuantizeLinear": {"precision": False}}
    model = tied_graph(opset=17)
    nvfp4.raise_opset(model)
    assert (model.opset_import[0].version, model.ir_version) == (23, 11)


def test_the_report_counts_nvfp4_gemms_and_their_bits_against_the_floor():
    model = tied_graph()
    nvfp4.rewrite_matmuls(model, onnx.ModelProto())
    rows = engine_report.block_weight_formats(model)
    n = 64 * 48 + 64 * 40
    assert list(rows) == ["NVFP4 block 16"] and rows["NVFP4 block 16"]["gemms"] == 2
    assert rows["NVFP4 block 16"]["weights"] == n
    assert rows["NVFP4 block 16"]["bits_per_weight"] == pytest.approx(4 + 8 / 16 + 32 * 2 / n)
    assert rows["NVFP4 block 16"]["floor_bits"] == pytest.approx(rows["NVFP4 block 16"]["bits_per_weight"])
    assert engine_report.floor_bits("INT4 block 32") == 5.0  # Q4_0
    assert engine_report.floor_bits("INT4 block 32 + offsets") == 6.0  # Q4_1, Q4_K
    assert engine_report.floor_bits("INT8 block 32") == 9.0  # Q8_0
    assert engine_report.floor_bits("INT4 block 128") == 4.25 and engine_report.floor_bits("NVFP4 block 16") == 4.5
    with pytest.raises(ValueError, match="not a block form"):
        engine_report.floor_bits("FP8")


def test_tensorrt_rtx_builds_a_576_by_1536_nvfp4_gemm_for_sm120_and_refuses_sm89_sm86_sm75():
    import rtx_graphs

    rtx_graphs.rtx_backend()  # or skip, naming why TensorRT-RTX cannot be used here
    k, n = 576, 1536
    w = np.random.default_rng(2).standard_normal((k, n)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", n])],
                          [numpy_helper.from_array(w, "w")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    nvfp4.rewrite_matmuls(model, onnx.ModelProto())
    blob = model.SerializeToString()

    def build(target: str):
        return rtx_graphs.build_one_input(blob, target, k=k, summarize=True)

    size, _, summary = build("sm120")
    assert summary.weight_only_gemms == {"mm": "FP4"}
    assert size is not None and size < k * n * 2 / 2  # under half an FP16 weight: the weights stay 4-bit
    for target in ("sm89", "sm86", "sm75"):
        size, log, _ = build(target)
        assert size is None and f"Cannot compile for target(s) {target}" in log and "fp4_e2m1" in log
