"""The per-tensor clip search for FP8 / INT8 (pipeline.quant.calibrate.clip_amax): activations
(calibration methods mse, kl) and weights (quantize.weight_clip)."""
from __future__ import annotations

import numpy as np
import pytest

from pipeline.quant import calibrate, clip, qdq


def _abs_hist(x: np.ndarray):
    a = np.abs(x)
    return np.histogram(a, bins=calibrate.NUM_BINS, range=(float(a.min()), float(a.max())))


def _outliers(rng, n: int = 50_000) -> np.ndarray:
    """A Gaussian bulk (sd 1) with 0.01 % of values at 150-200: an LLM activation's shape."""
    x = rng.standard_normal(n)
    x[rng.choice(n, 5, replace=False)] = rng.uniform(150, 200, 5) * rng.choice([-1, 1], 5)
    return x


@pytest.mark.parametrize("fmt,loss,dist", [("fp8", "mse", "normal"), ("fp8", "kl", "normal"), ("fp8", "kl", "uniform"),
                                           ("int8", "kl", "uniform"), ("int8", "kl", "normal")])
def test_no_outliers_keeps_max(fmt, loss, dist):
    rng = np.random.default_rng(0)
    x = rng.uniform(-3, 3, 50_000) if dist == "uniform" else rng.standard_normal(50_000)
    hist, edges = _abs_hist(x)
    assert calibrate.clip_amax(hist, edges, qdq.FORMATS[fmt], loss) == pytest.approx(np.abs(x).max(), rel=1e-6)


@pytest.mark.parametrize("loss", calibrate.CLIP_LOSSES)
def test_int8_outliers_are_clipped(loss):
    x = _outliers(np.random.default_rng(1))
    hist, edges = _abs_hist(x)
    amax = calibrate.clip_amax(hist, edges, qdq.FORMATS["int8"], loss)
    assert 1.0 < amax < 0.95 * np.abs(x).max()  # clipped, not into the bulk


@pytest.mark.parametrize("loss", calibrate.CLIP_LOSSES)
def test_fp8_keeps_sparse_outliers(loss):
    """E4M3's rounding error is relative: a bulk at 1/200 of the max keeps 3 mantissa bits, so
    clipping sparse outliers costs more than it saves; the search keeps max."""
    x = _outliers(np.random.default_rng(1))
    hist, edges = _abs_hist(x)
    assert calibrate.clip_amax(hist, edges, qdq.FORMATS["fp8"], loss) >= 0.95 * np.abs(x).max()


def test_fp8_clips_the_top_binade_of_a_flat_tensor():
    """Where values crowd the top of the range (E4M3's coarsest step), squared error clips a little."""
    x = np.random.default_rng(0).uniform(-3, 3, 50_000)
    hist, edges = _abs_hist(x)
    assert 0.9 * 3 < calibrate.clip_amax(hist, edges, qdq.FORMATS["fp8"], "mse") < 0.99 * np.abs(x).max()


def test_clipping_lowers_the_loss_it_chose_by():
    x = _outliers(np.random.default_rng(2))
    fmt = qdq.FORMATS["int8"]
    hist, edges = _abs_hist(x)
    amax = calibrate.clip_amax(hist, edges, fmt, "mse")

    def err(a):
        return float(np.mean((np.abs(x) - clip.fake_quant(np.abs(x), a, fmt)) ** 2))
    assert err(amax) < err(float(np.abs(x).max()))


def test_unknown_loss_is_refused():
    with pytest.raises(calibrate.QuantizationError, match="loss 'l1'"):
        calibrate.clip_amax(np.ones(4), np.arange(5.0), qdq.FORMATS["fp8"], "l1")


def _spiky_weight(rng) -> np.ndarray:
    """[512, 64] float32, N(0, 0.02) with 4 weights at 0.8 (0.01 %)."""
    w = (rng.standard_normal((512, 64)) * 0.02).astype(np.float32)
    w[[3, 200, 400, 500], [1, 9, 30, 60]] = 0.8
    return w


@pytest.mark.parametrize("axis", [None, 1])
def test_weight_clip_keeps_max_without_outliers(axis):
    plain = np.random.default_rng(3).uniform(-0.1, 0.1, (512, 64)).astype(np.float32)
    fmt = qdq.quant_format("int8", weight_clip="kl")
    assert clip.weight_clip_ratio(plain, fmt, "kl", axis) == 1.0
    q, scale = qdq.quantize_weight(plain, fmt, axis)
    q0, scale0 = qdq.quantize_weight(plain, qdq.FORMATS["int8"], axis)
    np.testing.assert_array_equal(scale, scale0)
    np.testing.assert_array_equal(q, q0)


@pytest.mark.parametrize("loss", calibrate.CLIP_LOSSES)
def test_weight_clip_clips_outliers(loss):
    w = _spiky_weight(np.random.default_rng(3))
    fmt = qdq.quant_format("int8", weight_clip=loss)
    ratio = clip.weight_clip_ratio(w, fmt, loss)
    assert ratio < 0.97
    q, scale = qdq.quantize_weight(w, fmt, None)
    _, scale0 = qdq.quantize_weight(w, qdq.FORMATS["int8"], None)
    np.testing.assert_allclose(scale, scale0 * ratio, rtol=1e-6)
    assert np.abs(q.astype(np.int32)).max() == 127  # the outliers saturate


def test_weight_clip_is_in_the_cache_key():
    from onnx import numpy_helper

    w = _spiky_weight(np.random.default_rng(4))
    t = qdq.Target("n", "", "x", "w", 1)
    cache: dict = {}
    a = qdq.quantized_weight(numpy_helper.from_array(w, "w"), t, qdq.FORMATS["int8"], False, cache=cache)
    b = qdq.quantized_weight(numpy_helper.from_array(w, "w"), t, qdq.quant_format("int8", weight_clip="kl"), False,
                             cache=cache)
    assert float(b[1]) < float(a[1])
