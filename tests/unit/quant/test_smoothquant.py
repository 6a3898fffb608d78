"""SmoothQuant folded into the FP32 ONNX graph keeps it equivalent,
and moves activation range into the weights."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from pipeline.errors import QuantizationError
from pipeline.models.text_generation.model import prefill_feeds
from pipeline.quant import calibrate, qdq, smoothquant
from pipeline.recipe.load import load_recipe
from pipeline.run.runner import run_pipeline
from pipeline.ort_sessions import ort_session
from tiny import seed_export, tiny_recipe


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_model, tiny_export):
    ws = tmp_path_factory.mktemp("smoothquant")
    path = tiny_recipe(ws, tiny_model)
    seed_export(ws, tiny_export)
    result = run_pipeline(load_recipe(path), path, quiet=True, only=["export"])
    return result.artifacts["export"], ws


def _feeds(exp, seed: int, batch: int = 2, seq: int = 12) -> dict:
    ids = np.random.default_rng(seed).integers(0, 1000, size=(batch, seq))
    return prefill_feeds(exp, ids)


def _logits(path, feeds) -> np.ndarray:
    return ort_session(str(path)).run(["logits"], feeds)[0]


def test_scales_follow_the_formula():
    x = np.array([8.0, 1.0, 0.5])
    w1, w2 = np.array([[1.0, -2.0], [0.5, 0.1], [4.0, 0.0]]), np.array([[0.5], [-3.0], [1.0]])
    s = smoothquant.smoothing_scales(x, [w1, w2], alpha=0.5)
    assert np.allclose(s, np.sqrt(x) / np.sqrt([2.0, 3.0, 4.0]), rtol=1e-6)
    assert np.allclose(smoothquant.smoothing_scales(x, [w1], alpha=1.0), x)
    with pytest.raises(QuantizationError, match="alpha"):
        smoothquant.smoothing_scales(x, [w1], alpha=1.5)


def test_smoothed_fp32_graph_is_equivalent(exported):
    exp, ws = exported
    model = onnx.load(exp.onnx_path)
    targets = qdq.find_targets(model, ["MatMul"])
    acts = sorted({t.act for t in targets})
    amax = calibrate.collect_channel_amax(model, acts, [_feeds(exp, 0), _feeds(exp, 1)])
    assert all(a.shape == (model_dim(model, t),) for t in targets for a in [amax[t.act]])
    report = smoothquant.smooth(model, targets, amax, alpha=0.5)
    # 2 blocks: attention norm (q/k/v), MLP norm (gate/up), up_proj (for down_proj); o_proj skipped
    assert len(report.folded) == 6 and len(report.skipped) == 2
    assert sum(v.startswith("linear:") for v in report.folded.values()) == 2
    assert all("o_proj" in t.scope for t in targets if t.act in report.skipped)
    assert any(np.abs(np.log(s)).max() > 0.1 for s in report.scales.values())  # really rescaled
    out = ws / "smoothed.onnx"
    onnx.save(model, str(out))
    feeds = _feeds(exp, 7, batch=3, seq=9)
    ref, got = _logits(exp.onnx_path, feeds), _logits(out, feeds)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    # the smoothed activations' per-channel ranges are what the formula predicts
    new_targets = qdq.find_targets(model, ["MatMul"])
    after = calibrate.collect_channel_amax(model, sorted(report.scales), [_feeds(exp, 0), _feeds(exp, 1)])
    for act, s in report.scales.items():
        assert np.allclose(after[act], amax[act] / s, rtol=1e-4)
    assert len(new_targets) == len(targets)


def model_dim(model, target) -> int:
    w = next(i for i in model.graph.initializer if i.name == target.weight)
    return int(w.dims[0])


def test_missing_statistics_name_the_input(exported):
    exp, _ = exported
    model = onnx.load(exp.onnx_path)
    targets = qdq.find_targets(model, ["MatMul"])
    with pytest.raises(QuantizationError, match="per-channel statistics"):
        smoothquant.smooth(model, targets, {}, alpha=0.5)
