"""An engine is placed in a repository only when its stamp matches the DECLARED serving target
(recipe triton.serving), never this machine's tensorrt package."""
from __future__ import annotations

import json

import pytest

from conftest import ROOT
from pipeline.trt import stamp as engine_stamp
from pipeline.artifacts import BuildArtifact
from pipeline.errors import TritonConfigError
from pipeline.recipe.load import load_recipe
from pipeline.stages.triton import check_engine

SERVING = {"container": "25.01-trtllm-python-py3", "gpu": "H100"}  # TensorRT 10.8.0.43, compute capability 9.0


def _recipe(serving=SERVING):
    return load_recipe(ROOT / "recipes" / "fp8-llm.yaml", {"triton.serving": serving})


def _build(tmp_path, **stamp):
    path = tmp_path / "engine_stamp.json"
    path.write_text(json.dumps(stamp))
    return BuildArtifact("ok", "", str(tmp_path / "model.plan"), str(path), str(tmp_path / "trtexec.sh"), [])


def _stamp(recipe, **changes):
    return {"tensorrt_version": "10.8.0.43", "compute_capability": "9.0", "gpu_name": "NVIDIA H100 80GB HBM3",
            "recipe_hash": recipe.engine_hash, **changes}


@pytest.fixture(autouse=True)
def no_local_tensorrt(monkeypatch):
    """The deploy check must not consult this machine's TensorRT or GPU."""
    def refuse():
        raise AssertionError("check_engine consulted the local tensorrt / GPU")

    monkeypatch.setattr(engine_stamp, "tensorrt_version", refuse)
    monkeypatch.setattr(engine_stamp, "gpu_info", refuse)


def test_matching_stamp_is_accepted(tmp_path):
    recipe = _recipe()
    assert check_engine(recipe, _build(tmp_path, **_stamp(recipe))) == []


def test_build_number_may_differ(tmp_path):
    recipe = _recipe()
    assert check_engine(recipe, _build(tmp_path, **_stamp(recipe, tensorrt_version="10.8.0.99"))) == []


@pytest.mark.parametrize("field, value, message", [
    ("tensorrt_version", "10.13.0.35", "tensorrt_version: engine has '10.13.0.35', the serving runtime "
                                       "nvcr.io/nvidia/tritonserver:25.01-trtllm-python-py3 has '10.8.0.43'"),
    ("compute_capability", "8.9", "compute_capability: engine has '8.9', the serving GPU 'H100' has '9.0'"),
    ("recipe_hash", "0" * 64, "recipe changed"),
])
def test_mismatched_stamp_is_refused(tmp_path, field, value, message):
    recipe = _recipe()
    with pytest.raises(TritonConfigError, match="refused") as err:
        check_engine(recipe, _build(tmp_path, **_stamp(recipe, **{field: value})))
    assert message in str(err.value)


def test_same_capability_other_gpu_model_is_a_warning(tmp_path):
    recipe = _recipe()
    [warning] = check_engine(recipe, _build(tmp_path, **_stamp(recipe, gpu_name="NVIDIA H200")))
    assert warning.startswith("gpu_name: engine has 'NVIDIA H200', the serving GPU is 'H100': same compute capability")


def test_declared_explicit_tensorrt_and_gpu(tmp_path):
    recipe = _recipe({"tensorrt": "10.13.0", "gpu": "NVIDIA L40S"})
    stamp = _stamp(recipe, tensorrt_version="10.13.0.35", compute_capability="8.9", gpu_name="NVIDIA L40S")
    assert check_engine(recipe, _build(tmp_path, **stamp)) == []
    with pytest.raises(TritonConfigError, match="the serving runtime has '10.13.0'"):
        check_engine(recipe, _build(tmp_path, **{**stamp, "tensorrt_version": "10.8.0.43"}))


def test_engine_without_declared_serving_runtime_is_refused(tmp_path):
    recipe = load_recipe(ROOT / "recipes" / "fp8-llm.yaml")
    assert recipe.triton.serving is None
    with pytest.raises(TritonConfigError, match="triton.serving is not declared"):
        check_engine(recipe, _build(tmp_path, **_stamp(recipe)))


def test_gate_change_keeps_the_engine_hash():
    a = load_recipe(ROOT / "recipes" / "fp8-llm.yaml")
    b = load_recipe(ROOT / "recipes" / "fp8-llm.yaml", {"validate.gates.0.max": 0.5})
    c = load_recipe(ROOT / "recipes" / "fp8-llm.yaml", {"quantize.calibration.method": "entropy"})
    assert a.engine_hash == b.engine_hash != c.engine_hash


def test_missing_stamp_is_refused(tmp_path):
    b = BuildArtifact("ok", "", str(tmp_path / "model.plan"), None, str(tmp_path / "trtexec.sh"), [])
    with pytest.raises(TritonConfigError, match="no engine_stamp.json"):
        check_engine(_recipe(), b)
