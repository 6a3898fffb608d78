"""The ``int4`` precision row, ``quantize.weights`` and what ``check`` refuses (exit 2, named),
and that the new field at its default changes no shipped recipe's digest, stage key or pin."""
from __future__ import annotations

import json

import pytest

from conftest import ROOT
from pipeline.errors import EXIT_BAD_INPUT, RecipeError
from pipeline.quant import pin
from pipeline.recipe import precisions
from pipeline.recipe.load import load_recipe

INT4 = ROOT / "recipes" / "int4-llm.yaml"
CAL = {"data": {"type": "corpus", "name": "lee_background", "split": {"start": 0, "stop": 20}}, "samples": 8}


def refusal(path, overrides: dict) -> str:
    with pytest.raises(RecipeError) as err:
        load_recipe(path, overrides)
    assert err.value.exit_code == EXIT_BAD_INPUT
    return str(err.value)


def test_the_int4_row():
    row = precisions.facts("int4")
    assert (row.quantize, row.rest, row.calibrated, row.qdq, row.cast) == (True, False, False, True, False)
    assert (row.min_opset, row.min_compute_capability, row.weight_bytes, row.weight_only) == (21, (8, 6), 0.5, True)
    assert precisions.WEIGHT_ONLY == ("int4", "nvfp4") and "int4" in precisions.QUANTIZE and "int4" not in precisions.REST
    assert not any(precisions.facts(n).weight_only for n in precisions.PRECISIONS if n not in ("int4", "nvfp4"))
    assert precisions.runs_on((7, 5)) == ("int8", "fp16", "fp32")
    assert precisions.runs_on((8, 6)) == ("int8", "fp16", "fp32", "int4")


def test_the_shipped_int4_recipe_is_valid():
    r = load_recipe(INT4)
    assert (r.quantize.precision, r.quantize.weights.method, r.quantize.weights.block_size) == ("int4", "source", 32)
    assert r.quantize.calibration is None and r.triton.target == "python-onnxruntime"
    assert r.build.targets == ["sm86", "sm89", "sm120"]


@pytest.mark.parametrize("name", ["fp8-llm", "int8-llm"])
def test_weights_at_its_default_leaves_digests_and_the_shipped_pins_as_they_were(name):
    """``weights`` unset is absent from every dump (the recipe digest, the stage keys and the pins'
    quantize digest read dumps), and the shipped pins' quantize digests still match."""
    r = load_recipe(ROOT / "recipes" / f"{name}.yaml")
    assert r.quantize.weights is None and "weights" not in r.quantize.model_dump(mode="json")
    assert "weights" not in r.model_dump(mode="json", by_alias=True)["quantize"]
    pinned = json.loads((ROOT / "recipes" / "tuned" / f"{name}.json").read_text())["match"]
    fields = pin.match_fields(r, {})
    assert (fields["search_version"], fields["quantize"]) == (pinned["search_version"], pinned["quantize"])


@pytest.mark.parametrize("overrides, message", [
    ({"build.targets": ["sm75", "sm89"]}, "build.targets.0: sm75: INT4 needs compute capability >= 8.6; sm75 has "
                                          "compute capability 7.5; drop it, or quantize to a precision sm75 runs "
                                          "(int8, fp16, fp32)"),
    ({"quantize.weights.method": "awq"}, "weights.method 'awq' searches its scales on calibration data: add a "
                                         "calibration section"),
    ({"quantize.weights": {"method": "rtn", "block_size": 64}, "quantize.calibration": CAL},
     "precision 'int4' is weight-only: its activations stay FP32 and nothing is calibrated with weights.method 'rtn'; "
     "drop the calibration section (only weights.method awq reads one)"),
    ({"quantize.weights.block_size": 128}, "quantize.weights.block_size: 128: method source keeps the GGUF file's "
                                           "blocks, which are 32 weights wide"),
    ({"model.source": {"path": "../tests/data"}}, "model.source: path ../tests/data is not a GGUF file, and "
                                                 "quantize.weights.method: source takes the weights' blocks from one"),
    ({"triton.target": "onnxruntime"}, "triton.target: 'onnxruntime': Triton's stock onnxruntime backend cannot set "
                                       "ONNX Runtime's session.qdq_matmulnbits_accuracy_level"),
    ({"triton.target": "auto"}, "triton.target: 'auto' (auto serves onnxruntime_onnx wherever no datacenter TensorRT "
                                "engine is built)"),
    ({"quantize.exclude.nodes": ["*down_proj*"]}, "quantize.exclude: not implemented yet for int4"),
    ({"quantize.rest_precision": "fp16"}, "quantize.rest_precision: 'fp16': int4 keeps the activations"),
    ({"quantize.weights": None}, "precision 'int4' needs a weights section, e.g. weights: {method: source, "
                                 "block_size: 32}"),
    ({"quantize.calibration": CAL}, "precision 'int4' is weight-only"),
    ({"quantize.weights.pad": True}, "quantize.weights.pad: true: zero padding of K is for precision int4 with method "
                                     "rtn or awq (GGUF blocks are 32 wide and divide every K); drop pad"),
])
def test_check_refuses_naming_the_field(overrides, message):
    assert message in refusal(INT4, overrides)


def test_weights_on_another_precision_and_fp8_below_sm89_name_the_precision():
    assert "weights (weight-only blocks) need precision int4 or nvfp4, not 'fp8'" in refusal(
        ROOT / "recipes" / "fp8-llm.yaml", {"quantize.weights": {"method": "source"}})
    assert ("build.targets.0: sm86: FP8 needs compute capability >= 8.9; sm86 has compute capability 8.6; drop it, "
            "or quantize to a precision sm86 runs (int8, fp16, fp32, int4)") in refusal(
        ROOT / "recipes" / "fp8-llm.yaml", {"build.targets": ["sm86"]})


def test_build_test_refuses_method_source():
    from pipeline.errors import PipelineError
    from pipeline.run import smoke

    with pytest.raises(PipelineError, match=r"build --test: quantize.weights.method: source takes the weights' blocks "
                                            r"from the GGUF file") as err:
        smoke.hf_location(load_recipe(INT4))
    assert err.value.exit_code == EXIT_BAD_INPUT


def test_rtn_and_awq_are_valid_without_gguf_blocks():
    """rtn needs no calibration; awq needs one; both take exclusions; the dumps of these recipes
    carry the section as written (the shipped int4-llm recipe keeps its digest: no field was added)."""
    tiny = {"model.source": {"path": "../tests/data"}}
    r = load_recipe(INT4, {**tiny, "quantize.weights": {"method": "rtn", "block_size": 64}})
    assert (r.quantize.weights.method, r.quantize.weights.block_size, r.quantize.calibration) == ("rtn", 64, None)
    r = load_recipe(INT4, {**tiny, "quantize.weights": {"method": "awq", "block_size": 64}, "quantize.calibration": CAL,
                           "quantize.exclude.nodes": ["*lm_head*"]})
    assert r.quantize.weights.method == "awq" and r.quantize.calibration.samples == 8
    assert load_recipe(INT4).quantize.model_dump(mode="json")["weights"] == {"method": "source", "block_size": 32}


def test_pad_is_opt_in_and_absent_from_dumps_at_false():
    """``weights.pad`` false (the default) leaves the dump, so the shipped int4 recipe's digest, and
    every dump of a recipe written before it, are what they were; true is carried."""
    assert "pad" not in load_recipe(INT4).quantize.model_dump(mode="json")["weights"]
    r = load_recipe(INT4, {"model.source": {"path": "../tests/data"},
                           "quantize.weights": {"method": "rtn", "block_size": 128, "pad": True}})
    assert r.quantize.weights.pad and r.quantize.model_dump(mode="json")["weights"] == {
        "method": "rtn", "block_size": 128, "pad": True}
    off = load_recipe(INT4, {"model.source": {"path": "../tests/data"},
                             "quantize.weights": {"method": "rtn", "block_size": 128, "pad": False}})
    assert off.digest == load_recipe(INT4, {"model.source": {"path": "../tests/data"},
                                            "quantize.weights": {"method": "rtn", "block_size": 128}}).digest


def test_embedding_lookup_engine_is_absent_from_dumps_and_runtime_needs_a_target_serving_the_onnx_graph():
    """``build.embedding_lookup`` at ``engine`` (the default) leaves every dump, so the recipe digests and
    build stage keys of recipes without it are what they were; ``runtime`` (int4-llm's) is carried, and
    ``check`` refuses it where Triton could serve the engine (its generation model feeds token ids)."""
    fp8 = load_recipe(ROOT / "recipes" / "fp8-llm.yaml")
    assert fp8.build.embedding_lookup == "engine" and "embedding_lookup" not in fp8.build.model_dump(mode="json")
    assert load_recipe(INT4).build.model_dump(mode="json")["embedding_lookup"] == "runtime"
    for target in ("tensorrt", "auto"):
        message = refusal(INT4, {"triton.target": target, "quantize.weights": {"method": "rtn", "block_size": 32}})
        assert (f"build.embedding_lookup: runtime: the engine then takes inputs_embeds, but triton.target {target!r} "
                "can serve the engine") in message


def test_embedding_lookup_runtime_needs_a_backend_whose_engine_validate_does_not_run():
    """With ``build.backend`` tensorrt (or auto, on a GPU with TensorRT) the build writes a datacenter plan,
    which validate runs with the export's inputs: token ids, where the engine takes ``inputs_embeds``."""
    for backend in ("tensorrt", "auto"):
        message = refusal(INT4, {"build.backend": backend, "quantize.weights": {"method": "rtn", "block_size": 32}})
        assert (f"build.embedding_lookup: runtime: the engine then takes inputs_embeds, but build.backend {backend!r} "
                "builds a datacenter TensorRT engine") in message
    assert load_recipe(INT4, {"build.backend": "none", "quantize.weights": {"method": "rtn", "block_size": 32}})
