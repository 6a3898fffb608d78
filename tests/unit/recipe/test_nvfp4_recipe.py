"""The ``nvfp4`` precision row, its ``quantize.weights`` rules (block 16, method rtn) and what
``check`` refuses (exit 2, named); ``build.compare_fp16`` off leaves every shipped recipe's dump as
it was; a TensorRT-RTX check build for an NVFP4 graph goes to sm120 (sm89 has no FP4)."""
from __future__ import annotations

import pytest

from conftest import ROOT
from pipeline.errors import EXIT_BAD_INPUT, RecipeError
from pipeline.recipe import precisions
from pipeline.recipe.load import load_recipe
from pipeline.trt import backends as engine_backends

INT4 = ROOT / "recipes" / "int4-llm.yaml"
NVFP4 = {"quantize.precision": "nvfp4", "quantize.weights": {"method": "rtn"}, "build.targets": ["sm120"]}


def refusal(overrides: dict) -> str:
    with pytest.raises(RecipeError) as err:
        load_recipe(INT4, {**NVFP4, **overrides})
    assert err.value.exit_code == EXIT_BAD_INPUT
    return str(err.value)


def test_the_nvfp4_row():
    row = precisions.facts("nvfp4")
    assert (row.weight_only, row.calibrated, row.min_opset, row.min_compute_capability) == (True, False, 23, (10, 0))
    assert (row.cpu_decoded, row.cpu_simulation) == (True, "FP4 simulated: decoded to FP32 on this CPU")
    assert (row.weight_methods, row.weight_block, row.weight_bytes) == (("rtn",), 16, 4.5 / 8)
    assert "nvfp4" not in precisions.runs_on((9, 0)) and "nvfp4" in precisions.runs_on((12, 0))


def test_an_nvfp4_recipe_gets_block_16_and_python_onnxruntime_or_onnxruntime_serving():
    r = load_recipe(INT4, NVFP4)
    assert (r.quantize.weights.method, r.quantize.weights.block_size) == ("rtn", 16)
    assert load_recipe(INT4, {**NVFP4, "triton.target": "onnxruntime"}).triton.target == "onnxruntime"  # FP32 twin
    assert load_recipe(INT4, {**NVFP4, "quantize.exclude.nodes": ["*lm_head*"]}).quantize.exclude.nodes


@pytest.mark.parametrize("overrides, message", [
    ({"build.targets": ["sm89"]}, "build.targets.0: sm89: NVFP4 needs compute capability >= 10.0; sm89 has compute "
                                  "capability 8.9; drop it, or quantize to a precision sm89 runs"),
    ({"build.targets": ["sm120", "sm86"]}, "build.targets.1: sm86: NVFP4 needs compute capability >= 10.0"),
    ({"quantize.weights": {"method": "source"}}, "quantize.weights.method: 'source' is not a nvfp4 method; valid: rtn"),
    ({"quantize.weights": {"method": "awq"}}, "quantize.weights.method: 'awq' is not a nvfp4 method"),
    ({"quantize.weights": {"method": "rtn", "block_size": 32}}, "weights.block_size: 32, but nvfp4 blocks are 16"),
    ({"quantize.precision": "int4", "quantize.weights": {"method": "source", "block_size": 16}},
     "weights.block_size: 16 is nvfp4's block, not int4's"),
    ({"build.targets": ["sm100"], "build.backend": "tensorrt-rtx"}, "tensorrt-rtx cannot build for ['sm100']"),
])
def test_check_refuses_naming_the_field_and_the_format(overrides, message):
    assert message in refusal(overrides)


@pytest.mark.parametrize("name", ["fp8-llm", "int8-llm", "int4-llm"])
def test_compare_fp16_off_is_absent_from_dumps(name):
    r = load_recipe(ROOT / "recipes" / f"{name}.yaml")
    assert r.build.compare_fp16 is False and "compare_fp16" not in r.build.model_dump(mode="json")
    assert load_recipe(ROOT / "recipes" / f"{name}.yaml", {"build.compare_fp16": True}).build.model_dump()["compare_fp16"]


def test_a_check_build_of_an_nvfp4_graph_targets_sm120():
    assert engine_backends.check_target("nvfp4") == "sm120"
    assert engine_backends.check_target("fp8") == engine_backends.check_target("int4") == "sm89"
    r = load_recipe(INT4, {**NVFP4, "build.targets": ["sm100"], "build.backend": "auto",
                           "build.embedding_lookup": "engine"})  # runtime refuses backend auto
    plan = engine_backends.choose(r, "no CUDA GPU")
    if plan.backend is None:
        pytest.skip(plan.reason)
    assert plan.check_only and plan.targets == ["sm120"]
