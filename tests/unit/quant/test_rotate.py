"""Offline Hadamard rotations R1 and R2 (pipeline.quant.rotate) on a tiny random Llama with
grouped-query attention (4 heads, 2 KV heads) and a tied lm_head: the rotated FP32 graph computes
the unrotated one's logits to float tolerance, at prefill and at a decode step fed its own cache."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from pipeline.errors import QuantizationError
from pipeline.models.text_generation.model import prefill_feeds
from pipeline.quant import qdq, rotate
from pipeline.recipe.load import load_recipe
from tiny import export_tiny, run_graph

#: a tiny-model export and quantize-stage runs: over a minute on 2 cores (make test runs it; make test-fast does not)
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_model, tiny_export):
    ws = tmp_path_factory.mktemp("rotate")
    return export_tiny(ws, tiny_model, tiny_export), ws


_run = run_graph


@pytest.mark.parametrize("n", [1, 2, 4, 8, 12, 20, 24, 48, 64, 576, 768])
def test_hadamard(n):
    h = rotate.hadamard(n)
    np.testing.assert_array_equal(h @ h.T, n * np.eye(n, dtype=np.int64))
    r = rotate.rotation(n)
    np.testing.assert_allclose(r @ r.T, np.eye(n), atol=1e-12)


def test_no_hadamard_of_an_odd_order():
    with pytest.raises(QuantizationError, match="order 6"):
        rotate.hadamard(6)


@pytest.mark.parametrize("r1,r2", [(True, False), (False, True), (True, True)])
def test_rotated_graph_is_equivalent(exported, r1, r2):
    exp, ws = exported
    model = onnx.load(exp.onnx_path)
    targets = qdq.find_targets(model, ["MatMul", "Gemm"])
    report = rotate.rotate(model, targets, r1=r1, r2=r2)
    if r1:
        assert len(report.norms) == 5 and len(report.writers) == 4 and len(report.readers) == 10  # 2 blocks + final
        assert report.lm_head.startswith("tied: +MatMul") and report.added_bytes == 32 * 32 * 4
    if r2:
        assert len(report.r2) == 2 and report.head_dim == 8
    out = ws / f"rotated_{r1}_{r2}.onnx"
    onnx.save(model, str(out))
    # the weight GEMMs are the same nodes: the added MatMul reads no initializer the Q/DQ policy takes
    after = {t.node for t in qdq.find_targets(model, ["MatMul", "Gemm"])}
    assert {t.node for t in targets} <= after and len(after - {t.node for t in targets}) == (1 if r1 else 0)
    ids = np.random.default_rng(5).integers(0, 1000, size=(3, 9))
    first = prefill_feeds(exp, ids)
    ref, got = _run(exp.onnx_path, first), _run(out, first)
    scale = np.abs(ref["logits"]).max()
    assert np.abs(got["logits"] - ref["logits"]).max() <= 2e-5 * scale
    # a decode step fed each graph's own cache (R2 rotates what the V cache holds)
    batch, seq = ids.shape
    step = {"input_ids": np.full((batch, 1), 17, np.int64), "attention_mask": np.ones((batch, seq + 1), np.int64)}
    ref2 = _run(exp.onnx_path, {**step, **{"past_key_values." + k[8:]: v for k, v in ref.items()
                                           if k.startswith("present.")}})
    got2 = _run(out, {**step, **{"past_key_values." + k[8:]: v for k, v in got.items() if k.startswith("present.")}})
    assert np.abs(got2["logits"] - ref2["logits"]).max() <= 2e-5 * np.abs(ref2["logits"]).max()
    if r2:
        v_ref, v_got = ref["present.0.value"], got["present.0.value"]
        assert np.abs(v_ref - v_got).max() > 1e-3  # the V cache holds rotated values
        np.testing.assert_allclose(np.linalg.norm(v_got, axis=-1), np.linalg.norm(v_ref, axis=-1), rtol=1e-4)


def test_a_graph_without_an_embedding_is_refused(exported):
    exp, _ = exported
    model = onnx.load(exp.onnx_path)
    gather = next(n for n in model.graph.node if n.op_type == "Gather" and n.input[1] == "input_ids")
    gather.input[1] = gather.output[0] + "_elsewhere"
    with pytest.raises(QuantizationError, match="one embedding Gather"):
        rotate.rotate(model, qdq.find_targets(model, ["MatMul"]))


def test_the_quantize_stage_rotates_with_the_same_qdq(exported):
    """``quantize.rotate: true``: the same GEMMs get Q/DQ, the added MatMul none, and the FP8
    graph runs; the report records the rotation."""
    from pipeline.context import Progress, StageContext
    from pipeline.stages import quantize

    exp, ws = exported
    path = ws / "recipes" / "tiny-llm.yaml" if (ws / "recipes" / "tiny-llm.yaml").is_file() else next(ws.rglob("*.yaml"))
    arts = {}
    for rot in (False, True):
        recipe = load_recipe(path, {"quantize.rotate": rot, "work_dir": str(ws / f"rot{rot}")})
        arts[rot] = quantize.run(StageContext(recipe, path, ws / f"rot{rot}" / recipe.name, "quantize",
                                              Progress(False)), exp)
    assert arts[True].quantized_nodes == arts[False].quantized_nodes
    assert arts[True].calibration["rotate"]["lm_head"].startswith("tied: +MatMul")
    model = onnx.load(arts[True].onnx_path)
    dq_inputs = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    mms = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in dq_inputs]
    assert len(mms) == len(arts[False].quantized_nodes)
    ids = np.random.default_rng(6).integers(0, 1000, size=(2, 7))
    out = _run(arts[True].onnx_path, prefill_feeds(exp, ids))
    assert np.isfinite(out["logits"]).all()
