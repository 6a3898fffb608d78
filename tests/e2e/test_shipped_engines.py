"""Every shipped recipe's quantized graph builds a real TensorRT-RTX engine here.

fp8-llm (tests/e2e/test_fp8_llm.py), int8-encoder (tests/e2e/test_int8_encoder.py), int8-textline-orientation
(tests/integration/test_image_classification.py) and examples/custom-model build theirs in their end-to-end
tests; this covers the other two, through the build stage only, with their pinned tuning results.
int8-llm's export is fp8-llm's (the same model and export section, so the same stage key): its
run starts from the session's cache record of that stage (conftest.smollm2_export).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
@pytest.mark.parametrize("name", [pytest.param("int8-llm", marks=pytest.mark.xdist_group("smollm2")),  # its export
                                  "fp8-encoder"])
def test_shipped_recipe_builds_a_tensorrt_rtx_engine(name, tmp_path, request):
    from pipeline.recipe.load import load_recipe
    from pipeline.run.runner import run_pipeline

    path = ROOT / "recipes" / f"{name}.yaml"
    over = {"work_dir": str(tmp_path / "artifacts"), "output_dir": str(tmp_path / "model_repository")}
    if name == "int8-llm":  # the record names the shared export's files, which stay where they are
        shared = request.getfixturevalue("smollm2_export")
        (tmp_path / "artifacts" / name / "export").mkdir(parents=True)
        shutil.copy(shared / "stage.json", tmp_path / "artifacts" / name / "export" / "stage.json")
    result = run_pipeline(load_recipe(path, over), path, quiet=True, only=["build"])
    if name == "int8-llm":
        assert result.manifest["stages"]["export"]["cache_hit"], "int8-llm's export key no longer equals fp8-llm's"
    arts = result.artifacts
    build = arts["build"]
    assert build.status == "ok" and build.backend == "tensorrt-rtx", build.reason
    assert Path(build.engine_path).stat().st_size > 1_000_000
    stamp = json.loads(Path(build.stamp_path).read_text())
    assert stamp["targets"] == [str(getattr(t, "value", t)) for t in load_recipe(path).build.targets]
    assert set(arts["quantize"].quantized_nodes) <= set(stamp["network"]["low_precision_gemms"])
