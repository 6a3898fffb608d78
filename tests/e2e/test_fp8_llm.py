"""End to end on the real SmolLM2-135M and real held-out news text (minutes)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from conftest import ROOT, llm_overrides

pytestmark = pytest.mark.e2e


def test_fp8_llm_passes_its_gate(fp8_llm_run):
    man = fp8_llm_run.manifest
    m = man["metrics"]
    assert fp8_llm_run.passed and man["verdict"] == "pass"
    assert m["perplexity_fp8"] <= m["perplexity_fp32"] * 1.015
    assert 10 < m["perplexity_fp32"] < 200  # a real LM on news text, not a constant
    assert 0.0 <= m["token_agreement"] <= 1.0 and m["generation_prompts"] >= 8
    assert m["generation_new_tokens"] == 32


def test_manifest_records_stages_versions_and_inputs(fp8_llm_run):
    man = json.loads(Path(fp8_llm_run.manifest_path).read_text())
    assert set(man["stages"]) == {"export", "quantize", "build", "validate", "triton"}
    for name, st in man["stages"].items():
        assert st["status"] in ("ok", "skipped"), (name, st)
        assert st["wall_s"] >= 0
    # no GPU here: a real TensorRT-RTX engine for the recipe's target, not run (validate measures the ONNX graph)
    build = fp8_llm_run.artifacts["build"]
    assert man["stages"]["build"]["status"] == "ok" and build.backend == "tensorrt-rtx", man["stages"]["build"]
    assert man["stages"]["build"]["reason"].startswith("TensorRT-RTX 1.7.1.116 engine for sm89: ")
    stamp = json.loads(Path(build.stamp_path).read_text())
    assert stamp["engine_bytes"] > 100e6 and stamp["targets"] == ["sm89"]
    assert set(fp8_llm_run.artifacts["quantize"].quantized_nodes) <= set(stamp["network"]["low_precision_gemms"])
    assert "not run" in fp8_llm_run.artifacts["validate"].metrics["validated_artifact"]
    assert man["versions"]["tensorrt"] == "absent"
    for tool in ("torch", "onnx", "onnxruntime", "transformers"):
        assert man["versions"][tool] != "absent"
    assert len(man["inputs"]["model_file"]["sha256"]) == 64
    junit = (Path(fp8_llm_run.manifest_path).parent / "junit.xml").read_text()
    assert 'name="max_relative_perplexity_increase"' in junit and "<failure" not in junit


def test_export_is_dynamic_and_matches_torch_at_several_shapes(fp8_llm_run):
    exp = fp8_llm_run.artifacts["export"]
    batches = sorted({c["shapes"]["input_ids"][0] for c in exp.shape_checks})
    assert {1, 3, 7} <= set(batches)
    assert len({c["point"]["past_sequence"] for c in exp.shape_checks}) >= 3
    assert all(c["passed"] for c in exp.shape_checks)
    specs = {s.name: s.shape for s in exp.inputs}
    assert specs["input_ids"] == ["batch", "sequence"]
    assert specs["past_key_values.0.key"][0] == "batch" and specs["past_key_values.0.key"][2] == "past_sequence"


def test_quantized_graph_is_what_tensorrt_builds(fp8_llm_run):
    q = fp8_llm_run.artifacts["quantize"]
    model = onnx.load(q.onnx_path, load_external_data=False)
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    assert opset >= 19
    inits = {i.name: i for i in model.graph.initializer}
    qdq = [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert len(qdq) > 100
    for n in qdq:
        zp = onnx.numpy_helper.to_array(inits[n.input[2]]).astype(np.float32)
        assert not zp.any() and inits[n.input[2]].data_type == onnx.TensorProto.FLOAT8E4M3FN
        assert (onnx.numpy_helper.to_array(inits[n.input[1]]) > 0).all()
    assert not any("lm_head" in n for n in q.quantized_nodes)


def test_tight_gate_fails_with_reason(fp8_llm_run, llm_workspace, capsys):
    from pipeline.cli.app import main

    rc = main(["build", str(ROOT / "recipes" / "fp8-llm.yaml"), "--quiet",
               *[f"--set={k}={v}" for k, v in llm_overrides(llm_workspace).items()],
               "--set", "validate.gates.0.max=0.0001"])
    assert rc == 1
    # the passing run's record stays; the refused run's goes to failed/
    report = (llm_workspace / "artifacts" / "fp8-llm" / "failed" / "report.md").read_text()
    row = next(r for r in report.splitlines() if r.startswith("| max_relative_perplexity_increase |"))
    assert "**FAIL**" in row and "<= 0.0001" in row and " ± " in row  # value ± its standard error
    man = json.loads((llm_workspace / "artifacts" / "fp8-llm" / "failed" / "manifest.json").read_text())
    assert json.loads((llm_workspace / "artifacts" / "fp8-llm" / "manifest.json").read_text())["verdict"] == "pass"
    assert man["stages"]["export"]["cache_hit"] and man["stages"]["quantize"]["cache_hit"]
    assert man["stages"]["triton"]["status"] == "skipped"


def test_int64_token_inputs_stay_int64_through_to_triton(fp8_llm_run):
    from pipeline.triton.config import parse_config

    q = fp8_llm_run.artifacts["quantize"]
    model = onnx.load(q.onnx_path, load_external_data=False)
    types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    assert types["input_ids"] == types["attention_mask"] == onnx.TensorProto.INT64
    repo = Path(fp8_llm_run.artifacts["triton"].repository)
    cfg = parse_config((repo / "smollm2_fp8" / "config.pbtxt").read_text())
    dtypes = {i.name: i.data_type for i in cfg.input}
    assert dtypes["input_ids"] == dtypes["attention_mask"] == 9  # TYPE_INT64
    for path in repo.glob("*/config.pbtxt"):
        parse_config(path.read_text())
