"""``quantize.precision: nvfp4`` end to end on the tiny random Llama (tests/tiny.py): quantize (rtn,
every weight GEMM, the tied lm_head included), a real TensorRT-RTX engine for sm120 from the FP4
graph with an FP16 engine of the same export beside it (``build.compare_fp16``), validate and the
Triton repository on the decoded FP32 twin; and ``check`` refusing NVFP4 below sm100 and INT4 on
sm75 (exit 2, naming the target and the format)."""
from __future__ import annotations

import json
import subprocess
import sys

import onnx
import pytest
import yaml

from conftest import ROOT
from pipeline.errors import EXIT_BAD_INPUT
from pipeline.recipe.load import load_recipe
from pipeline.run.runner import run_pipeline
from pipeline.trt import backends as engine_backends
from tiny import seed_export, tiny_recipe

RTX_PROBLEM = engine_backends.import_problem(engine_backends.TENSORRT_RTX)
NVFP4 = {"precision": "nvfp4", "weights": {"method": "rtn"}}


def nvfp4_recipe(ws, model_dir, **changes):
    return tiny_recipe(ws, model_dir, quantize=NVFP4, **{"build.backend": "tensorrt-rtx", "build.targets": ["sm120"],
                                                         "triton.target": "python-onnxruntime", **changes})


@pytest.mark.skipif(RTX_PROBLEM is not None, reason=str(RTX_PROBLEM))
def test_nvfp4_quantizes_builds_for_sm120_and_validates_the_decoded_graph(tiny_model, tiny_export, tmp_path):
    path = nvfp4_recipe(tmp_path, tiny_model, **{"build.compare_fp16": True})
    seed_export(tmp_path, tiny_export)
    result = run_pipeline(load_recipe(path), path, quiet=True,
                          only=["export", "quantize", "build", "validate", "triton"])
    run = tmp_path / "artifacts" / "tiny-llm"
    art = result.artifacts["quantize"]
    info = art.calibration
    assert art.precision == "nvfp4" and len(art.quantized_nodes) == 2 * 7 + 1  # 7 per layer, the lm_head
    assert info["gemm_formats"] == {"FP32 -> NVFP4 block 16": 15} and info["cpu_graph"].startswith(
        "FP4 simulated: decoded to FP32 on this CPU")
    assert 0 < info["rel_rms_weight_error"] < 0.15 and info["weights_from"] == "the FP32 export, rounded to NVFP4 (rtn)"
    fp4 = onnx.load(str(run / "quantize" / "model.onnx"), load_external_data=False)
    twin = onnx.load(art.ort_path, load_external_data=False)
    assert (fp4.opset_import[0].version, fp4.ir_version) == (23, 11)
    assert not [n for n in twin.graph.node if n.op_type == "DequantizeLinear"]
    assert twin.opset_import[0].version == yaml.safe_load(path.read_text())["export"]["opset"]
    stamp = json.loads(next((run / "build").glob("engine_stamp.json")).read_text())
    assert stamp["targets"] == ["sm120"] and not stamp.get("check_only")
    assert set(stamp["network"]["weight_only_gemms"].values()) == {"FP4"}
    assert len(stamp["network"]["weight_only_gemms"]) == 15
    assert stamp["weight_formats"]["NVFP4 block 16"]["gemms"] == 15
    assert stamp["fp16_engine_bytes"] > 0 and stamp["engine_bytes_vs_fp16"] == stamp["engine_bytes"] / stamp[
        "fp16_engine_bytes"]
    # Larger than FP16 here (2.07x measured): the tied 49,152 x 32 embedding dominates this tiny model, and its
    # Gather keeps the FP32 table (6.3 MB) beside the lm_head's FP4 copy, where the FP16 engine holds one FP16 table.
    tables = [list(t.dims) for t in fp4.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2]
    assert len(tables) == 1 and tables[0][0] > 40_000 and tables[0][1] == 32  # the Gather's FP32 table, alone
    section = (run / "build" / "engine.md").read_text()
    assert "NVFP4 block 16: 15 GEMMs" in section and "engine vs FP16" in section
    note = result.artifacts["validate"].metrics["validated_artifact"]
    assert "model.decoded.onnx in ONNX Runtime (FP4 simulated: decoded to FP32 on this CPU" in note
    served = list((tmp_path / "model_repository").rglob("model.onnx"))
    assert served and not [n for m in served for n in onnx.load(str(m), load_external_data=False).graph.node
                           if n.op_type == "DequantizeLinear"]


@pytest.mark.parametrize("precision, target, fmt", [("nvfp4", "sm89", "NVFP4"), ("nvfp4", "sm86", "NVFP4"),
                                                    ("nvfp4", "sm90", "NVFP4"), ("int4", "sm75", "INT4")])
def test_check_refuses_a_format_below_its_compute_capability(precision, target, fmt, tiny_model, tmp_path):
    quantize = NVFP4 if precision == "nvfp4" else {"precision": "int4", "weights": {"method": "source"}}
    path = tiny_recipe(tmp_path, tiny_model, quantize=quantize, **{"build.targets": [target],
                                                                   "triton.target": "python-onnxruntime"})
    done = subprocess.run([sys.executable, "-m", "pipeline", "check", str(path)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == EXIT_BAD_INPUT, done.stdout + done.stderr
    assert f"build.targets.0: {target}: {fmt} needs compute capability" in done.stdout + done.stderr
    assert not (tmp_path / "artifacts").exists()  # nothing written
