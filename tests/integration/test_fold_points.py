"""Every fold point of a tiny random Llama with grouped-query attention (4 heads, 2 KV heads) keeps
the FP32 graph's function when random per-channel scales are folded into it: prefill logits, and a
decode step fed the folded graph's own cache (v -> o scales what the V cache holds)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from pipeline.errors import QuantizationError
from pipeline.models.text_generation.model import prefill_feeds
from pipeline.quant import fold_points, qdq
from tiny import export_tiny, run_graph


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_model, tiny_export):
    ws = tmp_path_factory.mktemp("foldpoints")
    return export_tiny(ws, tiny_model, tiny_export), ws


_run = run_graph


def _decode(exp, first: dict, prefill: dict[str, np.ndarray], token: int = 17) -> dict:
    """One decode step after ``first``'s prefill, fed that graph's own ``present.*`` as past."""
    batch, seq = first["input_ids"].shape
    feeds = {"input_ids": np.full((batch, 1), token, np.int64), "attention_mask": np.ones((batch, seq + 1), np.int64)}
    for name in prefill:
        if name.startswith("present."):
            feeds["past_key_values." + name[len("present."):]] = prefill[name]
    return feeds


def test_fold_points_of_a_gqa_llama(exported):
    exp, _ = exported
    model = onnx.load(exp.onnx_path)
    targets = qdq.find_targets(model, ["MatMul"])
    points, skipped = fold_points.find(model, targets)
    kinds = sorted(p.kind for p in points)
    # 2 blocks x (attention norm -> q/k/v, MLP norm -> gate/up, up -> down, v -> o)
    assert kinds == ["attention"] * 2 + ["linear"] * 2 + ["norm"] * 4, (kinds, skipped)
    assert not skipped
    for p in points:
        if p.kind == "attention":
            assert "o_proj" in p.gemms[0].scope and p.channels == 16 and len(p.groups) == 32  # head_dim 8, 2 of 4
            # query heads 0, 1 read KV head 0; 2, 3 read KV head 1 (repeat_kv)
            assert list(p.groups[:8]) == list(range(8)) and list(p.groups[8:16]) == list(range(8))
            assert list(p.groups[16:24]) == list(range(8, 16))
    # default SmoothQuant kinds leave v -> o out
    local, why = fold_points.find(model, targets, ("norm", "linear"))
    assert len(local) == 6 and len(why) == 2


@pytest.mark.parametrize("kind", ["norm", "linear", "attention"])
def test_folded_graph_is_equivalent(exported, kind):
    exp, ws = exported
    model = onnx.load(exp.onnx_path)
    targets = qdq.find_targets(model, ["MatMul"])
    points, _ = fold_points.find(model, targets, (kind,))
    assert points
    rng = np.random.default_rng(3)
    for k, p in enumerate(points):  # scales over two decades, so a wrong channel map cannot hide
        fold_points.apply(model, p, np.exp(rng.uniform(-2.3, 2.3, p.channels)).astype(np.float32), f"t{k}")
    out = ws / f"folded_{kind}.onnx"
    onnx.save(model, str(out))
    ids = np.random.default_rng(5).integers(0, 1000, size=(3, 9))
    first = prefill_feeds(exp, ids)
    ref, got = _run(exp.onnx_path, first), _run(out, first)
    scale = np.abs(ref["logits"]).max()
    assert np.abs(got["logits"] - ref["logits"]).max() <= 2e-5 * scale
    ref2, got2 = _run(exp.onnx_path, _decode(exp, first, ref)), _run(out, _decode(exp, first, got))
    assert np.abs(got2["logits"] - ref2["logits"]).max() <= 2e-5 * np.abs(ref2["logits"]).max()
    if kind == "attention":  # the V cache holds V / s; the K cache is untouched
        assert not np.allclose(got["present.0.value"], ref["present.0.value"], rtol=1e-3)
        assert np.allclose(got["present.0.key"], ref["present.0.key"], rtol=1e-5, atol=1e-6)


def test_bad_scales_are_refused(exported):
    exp, _ = exported
    model = onnx.load(exp.onnx_path)
    points, _ = fold_points.find(model, qdq.find_targets(model, ["MatMul"]), ("norm",))
    with pytest.raises(QuantizationError, match=r"must be \[32\], finite and > 0"):
        fold_points.apply(model, points[0], np.zeros(32, np.float32), "x")
    with pytest.raises(QuantizationError, match="unknown kinds"):
        fold_points.find(model, [], ("rotation",))
