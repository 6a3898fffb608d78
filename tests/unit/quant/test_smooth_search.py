"""SmoothQuant's per-fold-point search (``quantize.smoothquant.mode: search``) with the W8A8
quantizer on a tiny random Llama with grouped-query attention: all four fold points, the FP32
graph unchanged to float tolerance, the searched loss never above not scaling, and pinned scales
folded without a search give the same graph."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from pipeline.models.text_generation.model import prefill_feeds
from pipeline.ort_sessions import ort_session
from pipeline.quant import qdq, smoothquant
from pipeline.recipe.load import load_recipe
from pipeline.run.runner import run_pipeline
from tiny import seed_export, tiny_recipe

#: a tiny-model export and quantize-stage runs: over a minute on 2 cores (make test runs it; make test-fast does not)
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_model, tiny_export):
    ws = tmp_path_factory.mktemp("smoothsearch")
    path = tiny_recipe(ws, tiny_model)
    seed_export(ws, tiny_export)
    result = run_pipeline(load_recipe(path), path, quiet=True, only=["export"])
    return result.artifacts["export"], ws


def _logits(model_or_path, feeds) -> np.ndarray:
    if isinstance(model_or_path, onnx.ModelProto):
        import onnxruntime as ort

        sess = ort.InferenceSession(model_or_path.SerializeToString(), providers=["CPUExecutionProvider"])
        return sess.run(["logits"], feeds)[0]
    return ort_session(str(model_or_path)).run(["logits"], feeds)[0]


@pytest.mark.parametrize("precision", ["fp8", "int8"])
def test_searched_smoothing_keeps_the_fp32_graph(exported, precision):
    exp, _ = exported
    rng = np.random.default_rng(7)
    batches = [prefill_feeds(exp, rng.integers(0, 1000, size=(2, 16))) for _ in range(2)]
    model = onnx.load(exp.onnx_path)
    targets = qdq.find_targets(model, ["MatMul"])
    report, scales = smoothquant.search_and_fold(model, targets, batches, qdq.quant_format(precision), False, rows=64)
    kinds = sorted(p["kind"] for p in report["fold_points"].values())
    assert kinds == ["attention"] * 2 + ["linear"] * 2 + ["norm"] * 4
    for p in report["fold_points"].values():
        assert p["loss"] <= p["baseline"]
    assert report["scaled_points"] >= 1
    feeds = prefill_feeds(exp, rng.integers(0, 1000, size=(3, 9)))
    ref, got = _logits(exp.onnx_path, feeds), _logits(model, feeds)
    assert np.abs(got - ref).max() <= 2e-5 * np.abs(ref).max()
    # the pin's path: the same scales folded without a search give the same weights
    again = onnx.load(exp.onnx_path)
    smoothquant.search_and_fold(again, targets, batches, qdq.quant_format(precision), False, scales=scales)
    a = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    b = {i.name: onnx.numpy_helper.to_array(i) for i in again.graph.initializer}
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_the_quantize_stage_runs_the_search_with_fp8(exported):
    from pipeline.context import Progress, StageContext
    from pipeline.stages import quantize

    exp, ws = exported
    path = next(ws.rglob("*.yaml"))
    recipe = load_recipe(path, {"quantize.smoothquant": {"mode": "search"}, "work_dir": str(ws / "sqs")})
    art = quantize.run(StageContext(recipe, path, ws / "sqs" / recipe.name, "quantize", Progress(False)), exp)
    info = art.calibration["smoothquant"]
    assert info["mode"] == "search" and len(info["fold_points"]) >= 6  # down_proj is excluded by the tiny recipe
    assert np.isfinite(_logits(art.onnx_path, prefill_feeds(exp, np.arange(12).reshape(2, 6)))).all()
