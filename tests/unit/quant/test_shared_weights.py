"""ort_sessions.SharedWeights: many in-memory sessions of variants of one graph read its FP32
weights from one copy, and compute what a session of the whole graph computes."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.ort_sessions import SharedWeights


def _graph(w: np.ndarray, b: np.ndarray) -> onnx.ModelProto:
    """y = Relu(x @ Transpose(w) + b): a Transpose of a weight, which ONNX Runtime's transpose
    optimizer and constant folding would rewrite from the weight's values."""
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "wt"], ["h"]),
             helper.make_node("Add", ["h", "b"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", w.shape[1]])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", w.shape[0]])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _opts(level=ort.GraphOptimizationLevel.ORT_ENABLE_BASIC) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = level
    return opts


def test_sessions_share_the_weights_and_compute_what_the_whole_graph_computes():
    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((96, 64)).astype(np.float32), rng.standard_normal(96).astype(np.float32)
    model = _graph(w, b)
    before = model.SerializeToString()
    shared = SharedWeights(model, min_bytes=1024)
    assert list(shared.arrays) == ["w"]  # b (384 bytes) stays in the graph
    stripped = shared.strip(model)
    assert model.SerializeToString() == before  # the source graph is not touched
    assert stripped.ByteSize() < model.ByteSize() - w.nbytes // 2
    [ph] = [t for t in stripped.graph.initializer if t.name == "w"]
    assert ph.data_location == TensorProto.EXTERNAL and not ph.raw_data and list(ph.dims) == [96, 64]

    x = rng.standard_normal((5, 64)).astype(np.float32)
    whole = ort.InferenceSession(before, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    for level in (ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
                  ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
        got = shared.session(stripped, _opts(level)).run(None, {"x": x})[0]
        np.testing.assert_allclose(got, whole, rtol=1e-5, atol=1e-5)
        assert np.abs(got).max() > 0.1  # the weights, not the placeholder's zeros
    assert shared.values["w"].data_ptr() == shared.arrays["w"].ctypes.data  # one copy, read in place


def _conv_graph(rng, tail: str) -> onnx.ModelProto:
    """Conv with a shared weight, then ``tail`` (Mul / BatchNormalization by constants): ONNX Runtime
    fuses those into the Conv's weight from its values."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 6, 6])
    inits = [numpy_helper.from_array(rng.standard_normal((16, 8, 3, 3)).astype(np.float32), "wc")]
    nodes = [helper.make_node("Conv", ["x", "wc"], ["c"], pads=[1, 1, 1, 1])]
    if tail == "Mul":
        inits.append(numpy_helper.from_array(rng.standard_normal((16, 1, 1)).astype(np.float32), "s"))
        nodes.append(helper.make_node("Mul", ["c", "s"], ["y"]))
    else:
        for name in ("g", "b", "m"):
            inits.append(numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), name))
        inits.append(numpy_helper.from_array(rng.uniform(0.5, 2, 16).astype(np.float32), "v"))
        nodes.append(helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["y"]))
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_weights_that_onnx_runtime_would_fuse_are_still_read_from_the_shared_copy():
    """Found by review: Conv + Mul / BatchNormalization fusions read the placeholder's zeros."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 8, 6, 6)).astype(np.float32)
    for tail in ("Mul", "BatchNormalization"):
        model = _conv_graph(rng, tail)
        whole = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        shared = SharedWeights(model, min_bytes=1024)
        assert list(shared.arrays) == ["wc"]
        for level in (ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
            got = shared.session(shared.strip(model), _opts(level)).run(None, {"x": x})[0]
            np.testing.assert_allclose(got, whole, rtol=1e-4, atol=1e-4, err_msg=f"{tail} at {level}")


def test_weights_left_on_disk_are_memory_mapped_not_copied(tmp_path):
    """A graph loaded without its external data: the float weights are read-only maps of the data
    file (no copy in the heap), a non-float external initializer is read into the stripped copy,
    and a session computes what the whole graph computes."""
    rng = np.random.default_rng(1)
    w, b = rng.standard_normal((96, 64)).astype(np.float32), rng.standard_normal(96).astype(np.float32)
    model = _graph(w, b)
    shape = numpy_helper.from_array(np.array([-1, 96], np.int64), "shape")  # a non-float initializer
    model.graph.initializer.append(shape)
    model.graph.node.append(helper.make_node("Reshape", ["y", "shape"], ["z"]))
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 96]))
    whole_graph = model.SerializeToString()
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    lazy = onnx.load(tmp_path / "m.onnx", load_external_data=False)

    shared = SharedWeights(lazy, weights_dir=tmp_path)
    assert sorted(shared.arrays) == ["b", "w"]  # every external float32 one, whatever its size
    assert all(isinstance(a, np.memmap) and not a.flags.writeable for a in shared.arrays.values())
    stripped = shared.strip(lazy)
    [inlined] = [t for t in stripped.graph.initializer if t.name == "shape"]
    assert inlined.data_location == TensorProto.DEFAULT and list(numpy_helper.to_array(inlined)) == [-1, 96]

    x = rng.standard_normal((5, 64)).astype(np.float32)
    whole = ort.InferenceSession(whole_graph, providers=["CPUExecutionProvider"]).run(["z"], {"x": x})[0]
    got = shared.session(stripped, _opts()).run(["z"], {"x": x})[0]
    np.testing.assert_allclose(got, whole, rtol=1e-5, atol=1e-5)
    assert shared.values["w"].data_ptr() == shared.arrays["w"].ctypes.data


def test_a_mapped_weight_outside_its_folder_or_of_the_wrong_length_is_refused(tmp_path):
    w = np.ones((4, 8), np.float32)
    onnx.save(_graph(w, np.zeros(4, np.float32)), tmp_path / "m.onnx", save_as_external_data=True,
              location="m.onnx.data", size_threshold=0)
    for key, value, message in (("location", "../m.onnx.data", "outside"), ("length", "12", "not 4 x")):
        lazy = onnx.load(tmp_path / "m.onnx", load_external_data=False)
        [t] = [t for t in lazy.graph.initializer if t.name == "w"]
        [entry] = [e for e in t.external_data if e.key == key]
        entry.value = value
        (tmp_path / "sub").mkdir(exist_ok=True)
        folder = tmp_path / "sub" if key == "location" else tmp_path
        if key == "location":
            (folder / "m.onnx.data").write_bytes((tmp_path / "m.onnx.data").read_bytes())
        with pytest.raises(ValueError, match=f"initializer w: external data {key} .*{message}"):
            SharedWeights(lazy, weights_dir=folder)
