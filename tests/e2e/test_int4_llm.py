"""End to end: recipes/int4-llm.yaml on the real SmolLM2-135M (its Q4_1 GGUF blocks as INT4).

Its export is fp8-llm's (the same model and export section, so the same stage key): the run starts
from the session's cache record of that stage (conftest.smollm2_export). Validate runs on 8 windows
and 2 prompts to keep it short (about 3 min on two shared cores after the export).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("smollm2")]


@pytest.fixture(scope="module")
def int4_run(smollm2_export, tmp_path_factory):
    from pipeline.recipe.load import load_recipe
    from pipeline.run.runner import run_pipeline

    ws = tmp_path_factory.mktemp("int4-llm")
    path = ROOT / "recipes" / "int4-llm.yaml"
    (ws / "artifacts" / "int4-llm" / "export").mkdir(parents=True)
    shutil.copy(smollm2_export / "stage.json", ws / "artifacts" / "int4-llm" / "export" / "stage.json")
    over = {"work_dir": str(ws / "artifacts"), "output_dir": str(ws / "model_repository"),
            "validate.max_windows": 8, "validate.generation": {"prompts": 2, "new_tokens": 8}}
    return run_pipeline(load_recipe(path, over), path, quiet=True)


def test_int4_llm_passes_its_gates_with_the_files_own_blocks(int4_run):
    man = int4_run.manifest
    assert man["stages"]["export"]["cache_hit"], "int4-llm's export key no longer equals fp8-llm's"
    assert int4_run.passed and man["verdict"] == "pass", man["gates"]
    q = int4_run.artifacts["quantize"]
    assert q.calibration["gemm_formats"] == {"Q4_1 -> INT4 block 32 + offsets": 210, "Q8_0 -> INT8 block 32": 1}
    assert (q.calibration["rounded_offsets"], q.calibration["max_weight_error"]) == (0, 0.0)
    m = man["metrics"]
    assert m["kld_mean"] < 1e-6 and abs(m["relative_perplexity_increase"]) < 1e-5 and m["quantized_fraction"] == 1.0
    # validate ran the CPU graph (the lm_head's INT8 blocks as INT4 halves), timed as served
    assert Path(q.ort_path).name == "model_cpu.onnx" and q.calibration["cpu_graph"]["int8_gemms_as_int4_halves"] == [
        "node_linear_210"]
    assert m["decode_speedup_vs_fp32"] > 0 and len(m["decode_speedup_vs_fp32_spread"]) == 2


def test_one_tensorrt_rtx_engine_for_three_targets_with_weight_only_gemms(int4_run):
    b, q = int4_run.artifacts["build"], int4_run.artifacts["quantize"]
    assert (b.status, b.backend, b.reason) == ("ok", "tensorrt-rtx", ""), b.reason  # no GEMM "left in FP32"
    assert Path(b.engine_path).name == "model.rtx-sm86-sm89-sm120.engine"
    stamp = json.loads(Path(b.stamp_path).read_text())
    # the lookup outside the engine (build.embedding_lookup: runtime): the INT8 table is in it once, for the lm_head:
    # 119.9 MB here, under 0.47x the FP16 engine's 282.8 MB (151.9 MB with the lookup inside)
    assert stamp["targets"] == ["sm86", "sm89", "sm120"] and 100e6 < stamp["engine_bytes"] < 0.47 * 282_791_052
    assert q.calibration["engine_graph_tied_table"]["bytes_saved"] == 4 * 49152 * 576  # no FP32 table in the graph
    lookup = stamp["embedding_lookup"]
    assert (lookup["engine_input"], lookup["replaces"], lookup["form"]) == ("inputs_embeds", "input_ids", "int8_blocks")
    assert lookup["tensors"] == {"values": {"dtype": "int8", "shape": [49152, 576]},
                                 "scales": {"dtype": "float32", "shape": [49152, 18]}}
    assert (Path(b.engine_path).parent / lookup["file"]).stat().st_size == lookup["bytes"]
    assert set(q.quantized_nodes) == set(stamp["network"]["weight_only_gemms"])
    assert {k: r["gemms"] for k, r in stamp["weight_formats"].items()} == {"INT4 block 32 + offsets": 210,
                                                                           "INT8 block 32": 1}


def test_the_served_model_runs_matmulnbits_at_accuracy_level_1(int4_run):
    from pipeline.triton.config import parse_config

    repo = Path(int4_run.artifacts["triton"].repository)
    for model in ("smollm2_int4", "smollm2_int4_generate"):
        params = parse_config((repo / model / "config.pbtxt").read_text()).parameters
        assert json.loads(params["session_config"].string_value) == {"session.qdq_matmulnbits_accuracy_level": "1"}
    compute = parse_config((repo / "smollm2_int4" / "config.pbtxt").read_text())
    assert compute.backend == "python" and compute.parameters["graph_optimization_level"].string_value == "all"
