"""ONNX Runtime optimization level per graph (pipeline.ort_sessions.optimization_level):
FP8 Q/DQ graphs and INT8 graphs with full-range weights at ``basic``, INT8 with
7-bit weights and FP32 at ``all``; the served config asks for the same level.
Why: at ``all`` ORT's integer kernels saturate int16 with full-range INT8 weights on
non-VNNI x86 CPUs, and give the simulated numbers with weights within +-64."""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.quant import qdq
from pipeline.recipe import TritonConfig
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


def _quantized(precision: str, weight_qmax: float | None = None, monkeypatch=None) -> onnx.ModelProto:
    """The MLP with pipeline's Q/DQ on every MatMul, amax = max |activation| of the FP32 run;
    ``weight_qmax`` narrows the INT8 weight range (64: ORT's "reduce_range")."""
    model = _mlp()
    if weight_qmax is not None:
        plain = qdq.quantize_weight
        monkeypatch.setattr(qdq, "quantize_weight",
                            lambda w, fmt, axis: plain(w, dataclasses.replace(fmt, qmax=weight_qmax), axis))
    targets = qdq.find_targets(model, ["MatMul"])
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(helper.make_tensor_value_info(t.act, TensorProto.FLOAT, None) for t in targets)
    sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    acts = [t.act for t in targets]
    values = sess.run(acts, _feeds(seed=2))  # calibration batch, not the compared one
    amax = {name: float(np.abs(v).max()) for name, v in zip(acts, values)}
    return qdq.insert_qdq(model, targets, amax, qdq.FORMATS[precision], per_channel=True)


def _run(model: onnx.ModelProto, level: str) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ORT_LEVELS[level]
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(["y"], _feeds())[0]


def test_level_follows_the_quantized_type(monkeypatch):
    assert optimization_level(_mlp()) == "all"
    assert optimization_level(_quantized("fp8")) == "basic"
    assert optimization_level(_quantized("int8")) == "basic"  # weights use the full +-127
    assert optimization_level(_quantized("int8", 64.0, monkeypatch)) == "all"


@pytest.mark.parametrize("precision,weight_qmax,level", [("int8", 64.0, "all"), ("int8", None, "basic"),
                                                         ("fp8", None, "basic")])
def test_ort_session_and_served_config_use_the_same_level(tmp_path, monkeypatch, precision, weight_qmax, level):
    path = tmp_path / f"{precision}.onnx"
    model = _quantized(precision, weight_qmax, monkeypatch)
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


def test_int8_at_full_level_matches_simulated_quantization_with_7bit_weights(monkeypatch):
    """ORT's integer kernels at "all" against the Q/DQ semantics run in FP32 at "basic"."""
    fp32 = _run(_mlp(), "all")
    model = _quantized("int8", 64.0, monkeypatch)
    basic, full = _run(model, "basic"), _run(model, "all")
    # the two levels differ by float accumulation order only (3e-7 measured), far below
    # the quantization error itself (2e-2 measured)
    assert _rel(full, basic) < 1e-5
    assert 1e-3 < _rel(basic, fp32) < 0.05


def test_int8_full_range_weights_are_kept_at_basic_because_all_would_be_wrong(monkeypatch):
    """What the rule protects against: with +-127 weights the integer path can saturate
    (31 % on an AVX2 CPU without VNNI; exact on VNNI CPUs); basic stays within the quantization error."""
    model = _quantized("int8")
    fp32 = _run(_mlp(), "all")
    assert optimization_level(model) == "basic"
    assert _rel(_run(model, "basic"), fp32) < 0.05
