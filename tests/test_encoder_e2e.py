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
    from pipeline.recipe_load import load_recipe
    from pipeline.runner import run_pipeline

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
    from pipeline.recipe_load import load_recipe
    from pipeline.runner import run_pipeline

    # Reuse the finished export (its stage cache) so only quantize runs.
    shutil.copytree(encoder_ws / "artifacts" / "int8-encoder" / "export", tmp_path / "artifacts" / "int8-encoder" / "export")
    recipe = load_recipe(RECIPE, _overrides(tmp_path, **{"quantize.exclude.nodes": ["*no_such_module*"]}))
    with pytest.raises(QuantizationError, match=r"\*no_such_module\*"):
        run_pipeline(recipe, RECIPE, quiet=True)
    man = json.loads((tmp_path / "artifacts" / "int8-encoder" / "manifest.json").read_text())
    assert man["stages"]["export"]["cache_hit"] and man["stages"]["quantize"]["status"] == "failed"
