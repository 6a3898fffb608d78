"""FP8 per-channel weight scales are the per-tensor scale over powers of two,
so per channel never rounds a value worse than per tensor (and rescues small channels)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from pipeline.quant import qdq

FP8 = qdq.FORMATS["fp8"]


def _weight() -> np.ndarray:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 8)).astype(np.float32) * np.array([1, 1, 0.3, 1e-3, 2e-5, 1, 0.7, 5.0], np.float32)
    return w


def _dequant(q: np.ndarray, scale: np.ndarray, axis: int | None) -> np.ndarray:
    return q.astype(np.float32) * (scale if axis is None else np.expand_dims(scale, 0))


def test_fp8_channel_scales_are_the_tensor_scale_over_powers_of_two():
    w = _weight()
    _, st = qdq.quantize_weight(w, FP8, None)
    q, sc = qdq.quantize_weight(w, FP8, 1)
    ratio = st / sc
    assert np.array_equal(ratio, np.exp2(np.round(np.log2(ratio)))) and (ratio >= 1).all()
    assert ratio[7] == 1.0 and ratio[4] >= 2 ** 15  # the largest channel keeps the tensor scale
    peak = np.abs(q.astype(np.float32)).max(axis=0)
    assert ((peak > 224) & (peak <= 448)).all()  # every channel uses the top octave, none saturates


def test_fp8_per_channel_error_is_never_above_per_tensor():
    w = _weight()
    et = np.abs(_dequant(*qdq.quantize_weight(w, FP8, None), None) - w)
    ec = np.abs(_dequant(*qdq.quantize_weight(w, FP8, 1), 1) - w)
    assert (ec <= et).all()
    normal = [0, 1, 2, 5, 6, 7]  # channels in FP8's normal range at the tensor scale: identical rounding
    assert np.array_equal(ec[:, normal], et[:, normal])
    small = 4  # amax ~1e-4 of the tensor's: subnormal or zero per tensor, full precision per channel
    assert ec[:, small].max() < 0.1 * et[:, small].max()


def test_int8_per_channel_still_uses_each_channels_amax():
    w = _weight()
    _, sc = qdq.quantize_weight(w, qdq.FORMATS["int8"], 1)
    np.testing.assert_allclose(sc, np.abs(w).max(axis=0) / 127, rtol=1e-6)


def test_ort_per_axis_fp8_dequantize_matches_numpy():
    w = _weight()
    q, sc = qdq.quantize_weight(w, FP8, 1)
    node = helper.make_node("DequantizeLinear", ["q", "s"], ["y"], axis=1)
    graph = helper.make_graph([node], "dq", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(w.shape))],
                              [numpy_helper.from_array(q, "q"), numpy_helper.from_array(sc, "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    assert q.dtype == ml_dtypes.float8_e4m3fn
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {})[0]
    np.testing.assert_array_equal(got, _dequant(q, sc, 1))
    onnx.checker.check_model(model)
