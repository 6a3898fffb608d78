"""Q/DQ placement on a small real graph (a torch MLP exported with dynamo)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from pipeline.errors import QuantizationError
from pipeline.quant import calibrate, qdq
from pipeline.recipe.schema import ExcludeConfig
from pipeline.ort_sessions import ort_session


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@pytest.fixture(scope="module")
def mlp_onnx(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("mlp") / "mlp.onnx"
    batch = torch.export.Dim("batch", min=1, max=64)
    torch.onnx.export(MLP().eval(), (torch.randn(4, 16),), str(path), dynamo=True,
                      dynamic_shapes={"x": {0: batch}}, input_names=["x"], output_names=["y"], opset_version=19)
    return path


def test_targets_are_weight_gemms_with_output_channel_axis(mlp_onnx):
    model = onnx.load(str(mlp_onnx))
    targets = qdq.find_targets(model, ["MatMul", "Gemm"])
    assert len(targets) == 2
    assert {t.scope.split(".")[-1] for t in targets} == {"up", "down"}


def test_exclusion_that_matches_nothing_names_the_pattern(mlp_onnx):
    model = onnx.load(str(mlp_onnx))
    targets = qdq.find_targets(model, ["MatMul", "Gemm"])
    with pytest.raises(QuantizationError, match=r"'\*attention\*'"):
        qdq.apply_exclusions(model, targets, ExcludeConfig(nodes=["*attention*"]))
    with pytest.raises(QuantizationError, match="'Softmax'"):
        qdq.apply_exclusions(model, targets, ExcludeConfig(op_types=["Softmax"]))
    kept, excluded = qdq.apply_exclusions(model, targets, ExcludeConfig(nodes=["*down*"]))
    assert [t.scope.split(".")[-1] for t in kept] == ["up"] and len(excluded) == 1


@pytest.mark.parametrize("precision, per_channel", [("fp8", False), ("int8", True)])
def test_qdq_graph_runs_and_stays_close(mlp_onnx, tmp_path, precision, per_channel):
    model = onnx.load(str(mlp_onnx))
    fmt = qdq.FORMATS[precision]
    targets = qdq.find_targets(model, ["MatMul", "Gemm"])
    rng = np.random.default_rng(0)
    batches = [{"x": rng.standard_normal((8, 16)).astype(np.float32)} for _ in range(4)]
    amax = calibrate.collect_amax(mlp_onnx, sorted({t.act for t in targets}), batches, "max", fmt)
    out = tmp_path / "q.onnx"
    onnx.save(qdq.insert_qdq(model, targets, amax, fmt, per_channel), str(out))
    ref = ort_session(str(mlp_onnx)).run(None, batches[0])[0]
    got = ort_session(str(out)).run(None, batches[0])[0]
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert 0 < rel < 0.1  # quantized: not identical, but close
    qmodel = onnx.load(str(out))
    dq_w = [n for n in qmodel.graph.node if n.op_type == "DequantizeLinear" and n.input[0].endswith("_quantized")
            and not n.input[0].startswith("x")]
    axes = [a.i for n in dq_w for a in n.attribute if a.name == "axis"]
    assert axes == ([t.weight_axis for t in targets] if per_channel else [])


def test_weight_quantization_saturates_instead_of_overflowing():
    w = np.array([[1000.0, -0.001], [3.0, 0.0]], np.float32)
    q, scale = qdq.quantize_weight(w, qdq.FORMATS["fp8"], axis=None)
    assert np.isfinite(q.astype(np.float32)).all()
    assert scale == pytest.approx(1000.0 / 448.0)


@pytest.mark.parametrize("bad", [np.inf, np.nan, 0.0, -1.0])
def test_invalid_amax_names_the_tensor(bad):
    with pytest.raises(QuantizationError, match="attn_mask_add"):
        qdq.scale_from_amax(bad, qdq.FORMATS["int8"], "attn_mask_add")


def test_mse_amax_clips_outliers():
    edges = np.linspace(-100, 100, 2049)
    hist = np.zeros(2048)
    hist[1000:1048] = 1000  # bulk near zero
    hist[-1] = 1  # one outlier at the edge
    amax = calibrate.mse_amax(hist, edges, qdq.FORMATS["int8"])
    assert amax < 100


def test_lazily_loaded_external_weights_give_the_same_qdq_graph(mlp_onnx, tmp_path):
    """Q/DQ insertion reading each weight from external data (the > 2 GiB path)
    matches the in-memory path bit for bit, and drops the replaced FP32 weights."""
    from onnx.external_data_helper import uses_external_data

    from pipeline import onnx_io

    src = onnx_io.save_model_atomic(onnx.load(str(mlp_onnx)), tmp_path / "src" / "model.onnx", external_data=True)
    fmt = qdq.FORMATS["fp8"]
    rng = np.random.default_rng(1)
    batches = [{"x": rng.standard_normal((8, 16)).astype(np.float32)} for _ in range(2)]
    lazy = onnx.load(str(src), load_external_data=False)
    targets = qdq.find_targets(lazy, ["MatMul", "Gemm"])
    amax = calibrate.collect_amax(src, sorted({t.act for t in targets}), batches, "max", fmt, scratch_dir=tmp_path)
    assert amax == calibrate.collect_amax(mlp_onnx, sorted({t.act for t in targets}), batches, "max", fmt)
    out_lazy = onnx_io.save_model_atomic(
        qdq.insert_qdq(lazy, targets, amax, fmt, True, base_dir=str(src.parent), inplace=True),
        tmp_path / "lazy" / "model.onnx", external_data=True, base_dir=src.parent)
    assert not any(i.name in {t.weight for t in targets} for i in lazy.graph.initializer)
    assert not any(uses_external_data(t) and t.HasField("raw_data")
                   for t in onnx_io.tensors(lazy))
    ref = tmp_path / "ref.onnx"
    onnx.save(qdq.insert_qdq(onnx.load(str(mlp_onnx)), targets, amax, fmt, True), str(ref))
    assert onnx_io.check_loadable(out_lazy) is None
    got = ort_session(str(out_lazy)).run(None, batches[0])[0]
    np.testing.assert_array_equal(got, ort_session(str(ref)).run(None, batches[0])[0])


def test_unnamed_nodes_are_named_before_quantization_and_refused_otherwise():
    """Other exporters may leave node names empty; Q/DQ placement addresses nodes by name."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from pipeline.errors import QuantizationError
    from pipeline.onnx_io import name_nodes
    from pipeline.quant.qdq import find_targets

    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("MatMul", ["h", "w"], ["y"]),
             helper.make_node("Relu", ["y"], ["z"], name="MatMul_1")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4])], [w])
    model = helper.make_model(graph)
    with pytest.raises(QuantizationError, match="unnamed or duplicate-named MatMul nodes"):
        find_targets(model, ["MatMul"])
    assert name_nodes(model) == 2
    assert [n.name for n in model.graph.node] == ["MatMul_0", "MatMul_1_1", "MatMul_1"]
    assert [t.node for t in find_targets(model, ["MatMul"])] == ["MatMul_0", "MatMul_1_1"]
    onnx.checker.check_model(model)
