"""ONNX Runtime optimization level per graph (pipeline.ort_sessions.optimization_level):
FP8 Q/DQ graphs and INT8 graphs with full-range weights at ``basic``, INT8 with
7-bit weights and FP32 at ``all``; the served config asks for the same level.
Why: at ``all`` ORT's integer kernels saturate int16 with full-range INT8 weights on
non-VNNI x86 CPUs, and give the simulated numbers with weights within +-64."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.errors import QuantizationError
from pipeline.quant import qdq
from pipeline.recipe.schema import TritonConfig
from pipeline.ort_sessions import ORT_LEVELS, optimization_level, ort_session
from pipeline.triton.config import compute_config

HIDDEN, FF = 64, 128


def _mlp() -> onnx.ModelProto:
    """x [batch, seq, 64] -> MatMul 64x128 -> Relu -> MatMul 128x64 -> + x -> MatMul 64x32 -> y."""
    rng = np.random.default_rng(0)
    w = {name: numpy_helper.from_array((rng.normal(size=shape) / np.sqrt(shape[0])).astype(np.float32), name)
         for name, shape in (("w1", (HIDDEN, FF)), ("w2", (FF, HIDDEN)), ("w3", (HIDDEN, 32)))}
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h1"], name="up"),
             helper.make_node("Relu", ["h1"], ["r1"], name="act"),
             helper.make_node("MatMul", ["r1", "w2"], ["h2"], name="down"),
             helper.make_node("Add", ["h2", "x"], ["res"], name="residual"),
             helper.make_node("MatMul", ["res", "w3"], ["y"], name="head")]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", HIDDEN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 32])], list(w.values()))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def _feeds(seed: int = 1) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).normal(size=(4, 16, HIDDEN)).astype(np.float32)}


def _quantized(precision: str, reduce_range: bool = False, model: onnx.ModelProto | None = None) -> onnx.ModelProto:
    """``model`` (default: the MLP) with pipeline's Q/DQ on every MatMul, amax = max |activation|
    of the FP32 run; ``reduce_range``: 7-bit INT8 weights (recipe ``quantize.reduce_range``)."""
    model = model or _mlp()
    targets = qdq.find_targets(model, ["MatMul"])
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(helper.make_tensor_value_info(t.act, TensorProto.FLOAT, None) for t in targets)
    sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    acts = sorted({t.act for t in targets})
    values = sess.run(acts, _feeds(seed=2))  # calibration batch, not the compared one
    amax = {name: float(np.abs(v).max()) for name, v in zip(acts, values)}
    return qdq.insert_qdq(model, targets, amax, qdq.quant_format(precision, reduce_range), per_channel=True)


def _run(model: onnx.ModelProto, level: str) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ORT_LEVELS[level]
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(["y"], _feeds())[0]


def test_level_follows_the_quantized_type():
    assert optimization_level(_mlp()) == "all"
    assert optimization_level(_quantized("fp8")) == "basic"
    assert optimization_level(_quantized("int8")) == "basic"  # weights use the full +-127
    assert optimization_level(_quantized("int8", reduce_range=True)) == "all"


@pytest.mark.parametrize("precision,reduce_range,level", [("int8", True, "all"), ("int8", False, "basic"),
                                                          ("fp8", False, "basic")])
def test_ort_session_and_served_config_use_the_same_level(tmp_path, precision, reduce_range, level):
    path = tmp_path / f"{precision}.onnx"
    model = _quantized(precision, reduce_range)
    onnx.save(model, str(path))
    assert optimization_level(str(path)) == level
    assert ort_session(str(path)).run(["y"], _feeds())[0].shape == (4, 16, 32)
    triton = TritonConfig(model_name="m", max_batch_size=8)
    inputs, outputs = [], []
    assert ort_session(str(path)).get_session_options().graph_optimization_level == ORT_LEVELS[level]
    ort_cfg = compute_config(triton, inputs, outputs, target="onnxruntime", qdq=True, graph=str(path))
    assert ort_cfg.optimization.graph.level == (-1 if level == "basic" else 0)
    py_cfg = compute_config(triton, inputs, outputs, target="python-onnxruntime", qdq=True, graph=model)
    assert py_cfg.parameters["graph_optimization_level"].string_value == level
    # weights dequantized once at load only where the served graph runs at basic:
    # at "all" the INT8 weights must stay int8 for ORT's integer kernels
    assert ("dequantize_weights" in py_cfg.parameters) == (level == "basic")


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_int8_at_full_level_matches_simulated_quantization_with_7bit_weights():
    """ORT's integer kernels at "all" against the Q/DQ semantics run in FP32 at "basic"."""
    fp32 = _run(_mlp(), "all")
    model = _quantized("int8", reduce_range=True)
    basic, full = _run(model, "basic"), _run(model, "all")
    # the two levels differ by float accumulation order only (3e-7 measured), far below
    # the quantization error itself (2e-2 measured)
    assert _rel(full, basic) < 1e-5
    assert 1e-3 < _rel(basic, fp32) < 0.05


def test_int8_full_range_weights_are_kept_at_basic_because_all_would_be_wrong():
    """What the rule protects against: with +-127 weights the integer path can saturate
    (31 % on an AVX2 CPU without VNNI; exact on VNNI CPUs); basic stays within the quantization error."""
    model = _quantized("int8")
    fp32 = _run(_mlp(), "all")
    assert optimization_level(model) == "basic"
    assert _rel(_run(model, "basic"), fp32) < 0.05


def _qkv() -> onnx.ModelProto:
    """x [batch, seq, 64] feeding three MatMuls (as Q, K and V projections do) -> their sum y [.., 32]."""
    rng = np.random.default_rng(3)
    w = [numpy_helper.from_array((rng.normal(size=(HIDDEN, 32)) / 8).astype(np.float32), f"w{i}") for i in range(3)]
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"p{i}"], name=f"proj{i}") for i in range(3)]
    nodes += [helper.make_node("Sum", ["p0", "p1", "p2"], ["y"], name="sum")]
    graph = helper.make_graph(
        nodes, "qkv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", HIDDEN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 32])], w)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def _fused_gemms(model: onnx.ModelProto, tmp_path) -> int:
    """MatMulIntegerToFloat nodes in ONNX Runtime's level-"all" optimization of ``model``."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ORT_LEVELS["all"]
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sum(n.op_type == "MatMulIntegerToFloat" for n in onnx.load(opts.optimized_model_filepath).graph.node)


def test_reduce_range_weights_use_seven_bits():
    model = _quantized("int8", reduce_range=True)
    weights = [numpy_helper.to_array(t) for t in model.graph.initializer
               if t.data_type == TensorProto.INT8 and t.name.endswith("_quantized")]
    assert len(weights) == 3 and max(int(np.abs(w.astype(np.int16)).max()) for w in weights) == 64
    with pytest.raises(ValueError, match="reduce_range needs precision int8"):
        qdq.quant_format("fp8", reduce_range=True)


def test_uint8_activations_keep_the_values_and_let_every_shared_gemm_fuse(tmp_path):
    """The CPU graph: same outputs (to float rounding) and all three GEMMs of one shared
    activation Q in ORT's integer kernels at "all"."""
    s8 = _quantized("int8", reduce_range=True, model=_qkv())
    u8 = onnx.ModelProto()
    u8.CopyFrom(s8)
    assert qdq.uint8_activations(u8) == 1  # one shared activation Q/DQ
    zps = [numpy_helper.to_array(t) for t in u8.graph.initializer if t.name == "x_zero_point"]
    assert zps[0].dtype == np.uint8 and int(zps[0]) == 128
    x = _feeds()
    def run(m, level):
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ORT_LEVELS[level]
        return ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(["y"], x)[0]
    assert np.array_equal(run(u8, "basic"), run(s8, "basic"))  # the same Q/DQ arithmetic
    assert _rel(run(u8, "all"), run(s8, "basic")) < 1e-5
    assert optimization_level(u8) == "all"
    assert _fused_gemms(u8, tmp_path) == 3


def test_uint8_activations_refuse_an_asymmetric_zero_point():
    model = _quantized("int8", reduce_range=True, model=_qkv())
    zp = next(t for t in model.graph.initializer if t.name == "x_zero_point")
    zp.CopyFrom(numpy_helper.from_array(np.array(3, np.int8), "x_zero_point"))
    with pytest.raises(QuantizationError, match="x_zero_point.*not INT8 zeros"):
        qdq.uint8_activations(model)
