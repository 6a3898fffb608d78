"""benchmarks/fp8_gemm_hardware.py: which MatMuls it captures from a Q/DQ graph, how it spreads
its choice, and that ``compare`` refuses to run without an FP8 GPU (the GPU part itself ran on a
lent H200; see the script's docstring)."""
from __future__ import annotations

import argparse
import importlib.util

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from conftest import ROOT


def _script():
    spec = importlib.util.spec_from_file_location("fp8_gemm_hardware", ROOT / "benchmarks" / "fp8_gemm_hardware.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _qdq_model(activation=TensorProto.FLOAT8E4M3FN) -> onnx.ModelProto:
    """x -> Q/DQ (``activation`` type) -> MatMul(E4M3 weight, DQ) -> y, plus a float MatMul."""
    fp8 = helper.make_tensor("w_q", TensorProto.FLOAT8E4M3FN, [4, 4], np.arange(16, dtype=np.float32).tolist())
    zero = helper.make_tensor("zp", TensorProto.FLOAT8E4M3FN, [], [0.0])
    act_zero = helper.make_tensor("x_zp", activation, [], [0])
    inits = [fp8, zero, act_zero, numpy_helper.from_array(np.float32(0.5), "x_s"), numpy_helper.from_array(np.float32(0.25), "w_s"),
             numpy_helper.from_array(np.eye(4, dtype=np.float32), "w_float")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_s", "x_zp"], ["x_q"]),
             helper.make_node("DequantizeLinear", ["x_q", "x_s", "x_zp"], ["x_dq"]),
             helper.make_node("DequantizeLinear", ["w_q", "w_s", "zp"], ["w_dq"]),
             helper.make_node("MatMul", ["x_dq", "w_dq"], ["y"]),
             helper.make_node("MatMul", ["y", "w_float"], ["z"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_finds_only_matmuls_with_fp8_operands():
    found = _script()._fp8_matmuls(_qdq_model())
    assert found == [("y", "x_q", "x_s", "w_q", "w_s", "x")]
    assert _script()._fp8_matmuls(_qdq_model(TensorProto.INT8)) == []  # an INT8 activation is not E4M3 bytes


def test_pick_spreads_its_choice_over_the_graph():
    pick = _script()._pick
    found = [(f"linear_{k}",) for k in range(10)] + [("other",)]
    assert [f[0] for f in pick(found, r"linear", 4)] == ["linear_0", "linear_3", "linear_6", "linear_9"]
    assert len(pick(found, r"linear", 50)) == 10


def test_compare_needs_an_fp8_gpu(tmp_path, capsys, monkeypatch):
    script = _script()
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU machine
    assert script.compare(argparse.Namespace(npz=tmp_path / "none.npz")) == 4
    assert "sm_89 or newer" in capsys.readouterr().err
