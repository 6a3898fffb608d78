"""Streaming, mergeable calibration statistics (pipeline.quant.calibrate)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.quant import calibrate, qdq

TENSORS = ["x", "h"]  # the inputs of the two GEMMs a quantizer would calibrate


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    """x[B,16] -> MatMul -> h=Relu -> MatMul -> y; h -> MatMul -> z ("logits": needed by nothing calibrated)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
             for name, shape in (("w1", (16, 32)), ("w2", (32, 8)), ("w3", (32, 64)))]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["a"], name="up"),
             helper.make_node("Relu", ["a"], ["h"], name="act"),
             helper.make_node("MatMul", ["h", "w2"], ["y"], name="down"),
             helper.make_node("MatMul", ["h", "w3"], ["z"], name="head")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 8]),
                           helper.make_tensor_value_info("z", TensorProto.FLOAT, ["b", 64])], inits)
    path = tmp_path_factory.mktemp("cal") / "g.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)], ir_version=9), str(path))
    return path


def _batches(n: int, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": (rng.standard_normal((4, 16)) * (1 + i)).astype(np.float32)} for i in range(n)]


def _activations(path, batches) -> dict[str, np.ndarray]:
    """x and h of every batch, flattened (h by ONNX Runtime, from an unmodified session)."""
    model = onnx.load(str(path))
    model.graph.output.append(helper.make_tensor_value_info("h", TensorProto.FLOAT, None))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    hs = [sess.run(["h"], b)[0] for b in batches]
    return {"x": np.concatenate([b["x"].ravel() for b in batches]), "h": np.concatenate([h.ravel() for h in hs])}


def test_max_is_the_abs_max_of_every_batch(graph):
    batches = _batches(5)
    amax = calibrate.collect_amax(graph, TENSORS, batches, "max", qdq.FORMATS["int8"])
    acts = _activations(graph, batches)
    assert amax["x"] == float(np.abs(acts["x"]).max())
    assert amax["h"] == pytest.approx(float(np.abs(acts["h"]).max()), rel=1e-6)


def test_augmented_graph_outputs_only_the_calibrated_statistics(graph):
    model = onnx.load(str(graph))
    names = calibrate._augment(model, TENSORS, fetch_values=False)
    outputs = [o.name for o in model.graph.output]
    assert sorted(outputs) == sorted(n for t in TENSORS for n in names[t])
    assert not {"y", "z"} & set(outputs)
    ops = {n.name for n in model.graph.node}
    assert "head" not in ops and "down" not in ops  # nothing calibrated needs them: pruned
    assert {i.name for i in model.graph.initializer} == {"w1"}


@pytest.mark.parametrize("method", ["max", "percentile", "entropy", "mse"])
def test_merging_two_halves_equals_the_whole(graph, method):
    batches = _batches(6)
    first, second = batches[:2], batches[2:]
    whole = calibrate.collect_stats(graph, TENSORS, batches, method)
    ranges = calibrate.merge_stats(calibrate.collect_stats(graph, TENSORS, first, method),
                                   calibrate.collect_stats(graph, TENSORS, second, method))
    _assert_same(ranges, whole)
    if method != "max":  # histograms: each part bins over the merged ranges
        whole = calibrate.collect_stats(graph, TENSORS, batches, method, ranges=whole)
        ranges = calibrate.merge_stats(calibrate.collect_stats(graph, TENSORS, first, method, ranges=ranges),
                                       calibrate.collect_stats(graph, TENSORS, second, method, ranges=ranges))
        _assert_same(ranges, whole)
        assert all(int(s.hist.sum()) == _activations(graph, batches)[t].size for t, s in whole.tensors.items())
    if method != "entropy":  # its threshold search takes a minute; it reads only the stats compared above
        assert ranges.amax(qdq.FORMATS["fp8"]) == whole.amax(qdq.FORMATS["fp8"])
    assert ranges.batches == whole.batches == 6


def _assert_same(a: calibrate.CalibrationStats, b: calibrate.CalibrationStats) -> None:
    for t in TENSORS:
        sa, sb = a.tensors[t], b.tensors[t]
        assert (sa.lo, sa.hi, sa.abs_lo) == (sb.lo, sb.hi, sb.abs_lo)
        assert (sa.hist is None) == (sb.hist is None)
        if sa.hist is not None:
            assert np.array_equal(sa.hist, sb.hist) and np.array_equal(sa.edges, sb.edges)


def test_histograms_over_different_ranges_do_not_merge(graph):
    a = calibrate.collect_stats(graph, TENSORS, _batches(1), "percentile")
    b = calibrate.collect_stats(graph, TENSORS, _batches(3), "percentile")
    ha = calibrate.collect_stats(graph, TENSORS, _batches(1), "percentile", ranges=a)
    hb = calibrate.collect_stats(graph, TENSORS, _batches(3), "percentile", ranges=b)
    with pytest.raises(ValueError, match="different ranges"):
        calibrate.merge_stats(ha, hb)
    with pytest.raises(calibrate.QuantizationError, match="needs histograms"):
        a.amax(qdq.FORMATS["int8"])


def test_unknown_tensor_and_method_are_named(graph):
    with pytest.raises(calibrate.QuantizationError, match="'nope'"):
        calibrate.collect_stats(graph, ["nope"], _batches(1), "max")
    with pytest.raises(calibrate.QuantizationError, match="'minmax'"):
        calibrate.collect_stats(graph, TENSORS, _batches(1), "minmax")


def test_activation_rows_are_the_sampled_positions_and_leave_the_graph_unchanged(graph):
    """collect_rows adds its outputs for the session only: the caller's graph (AWQ folds into it
    afterwards) keeps its outputs, and the rows are the graph's values at the sampled positions."""
    model = onnx.load(str(graph))
    before = model.SerializeToString()
    batches = _batches(3)
    rows = calibrate.collect_rows(model, ["h", "a"], batches, rows=5, seed=7)
    assert model.SerializeToString() == before
    h = _activations(graph, batches)["h"].reshape(-1, 32)  # 12 positions
    pick = np.sort(np.random.default_rng(7).choice(12, size=5, replace=False))
    assert rows["h"].shape == (5, 32) and np.allclose(rows["h"], h[pick], rtol=1e-6, atol=1e-6)
    assert np.array_equal(np.maximum(rows["a"], 0), rows["h"])  # same positions in every tensor
