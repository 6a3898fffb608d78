"""What the deployed server can read: the served graph's IR version and opset
against the serving-runtime table (pipeline.targets), down-converted where lossless."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper

from pipeline.cli import app as cli
from pipeline import targets as serving_targets
from pipeline.errors import TritonConfigError
from pipeline.triton.ir_version import fit_to_reader, required_ir
from test_onnx_source import byte_graph, onnx_workspace


def add_graph(ir: int, opset: int = 21, initializer: TensorProto | None = None) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "g", [x], [y],
                              initializer=[initializer] if initializer is not None else [])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir)


def test_table_gives_each_known_release_its_onnxruntime_and_range():
    reader = serving_targets.onnxruntime_reader("24.10-py3")
    assert (reader.release, reader.onnxruntime, reader.max_ir, reader.opsets) == ("24.10", "1.19.2", 10, (7, 21))
    assert serving_targets.onnxruntime_reader(None) == reader  # the release deploy k8s names by default
    for release, ort in serving_targets.TRITON_ONNXRUNTIME.items():
        r = serving_targets.onnxruntime_reader(release)
        minor = ".".join(ort.split(".")[:2])
        assert (r is None) == (minor not in serving_targets.ONNXRUNTIME_READS), release
        if r is not None:
            assert (r.max_ir, r.opsets[1]) == serving_targets.ONNXRUNTIME_READS[minor]


def test_ir_11_graph_is_lowered_to_what_24_10_reads_and_still_valid():
    model = add_graph(11)
    assert required_ir(model)[0] == 10  # opset 21 needs IR 10
    assert fit_to_reader(model, serving_targets.onnxruntime_reader("24.10"), "m.onnx") is True
    assert model.ir_version == 10
    onnx.checker.check_model(model)
    assert fit_to_reader(model, serving_targets.onnxruntime_reader("24.10"), "m.onnx") is False  # already fits


def test_ir_that_cannot_be_lowered_or_an_opset_out_of_range_is_refused_naming_both():
    fp4 = helper.make_tensor("w", TensorProto.FLOAT4E2M1, [2], [0.5, 1.0])
    model = add_graph(11, initializer=fp4)
    with pytest.raises(TritonConfigError) as err:
        fit_to_reader(model, serving_targets.onnxruntime_reader("24.10"), "m.onnx")
    msg = str(err.value)
    assert "m.onnx: ONNX IR version 11 (it needs >= 11 for element type FLOAT4E2M1)" in msg
    assert "Triton 24.10's onnxruntime backend (ONNX Runtime 1.19.2) reads IR <= 10" in msg
    with pytest.raises(TritonConfigError, match=r"ai.onnx opset 23, but Triton 24.10's .* reads opsets 7-21"):
        fit_to_reader(add_graph(10, opset=23), serving_targets.onnxruntime_reader("24.10"), "m.onnx")


def test_build_publishes_an_ir_11_onnx_source_as_ir_10(tmp_path):
    model = byte_graph()
    model.ir_version = 11
    path = onnx_workspace(tmp_path, model)
    assert cli.main(["build", str(path), "--quiet", "--set", "triton.target=onnxruntime"]) == 0
    repo = Path(yaml.safe_load(path.read_text())["output_dir"])
    served = onnx.load(str(repo / "custom_int8" / "1" / "model.onnx"))
    assert served.ir_version == 10
    assert cli.main(["verify-repo", str(repo)]) == 0
    import onnxruntime as ort

    sess = ort.InferenceSession(served.SerializeToString())
    feeds = {i.name: np.ones((1, 3), np.int64) for i in sess.get_inputs()}
    assert all(np.isfinite(o).all() for o in sess.run(None, feeds))
