"""recipe triton.serving: container / TensorRT / GPU tables and schema errors (pipeline.targets)."""
from __future__ import annotations

import pytest

from conftest import ROOT
from pipeline import targets as serving_targets
from pipeline.errors import RecipeError
from pipeline.recipe.load import load_recipe
from pipeline.recipe.precisions import capability_problem


def _load(cfg):
    return load_recipe(ROOT / "recipes" / "fp8-llm.yaml", {"triton.serving": cfg})


def test_container_release_resolves_tensorrt_and_capability():
    t = serving_targets.declared_target(_load({"container": "25.03-trtllm-python-py3", "gpu": "NVIDIA H100 80GB HBM3"})
                                .triton.serving)
    assert t == serving_targets.Target("10.9.0.34", "9.0", "NVIDIA H100 80GB HBM3", "25.03-trtllm-python-py3")
    assert t.image == "nvcr.io/nvidia/tritonserver:25.03-trtllm-python-py3"


def test_explicit_tensorrt_with_a_plain_py3_release():
    t = serving_targets.declared_target(_load({"container": "25.01", "tensorrt": "10.8.0", "gpu": "L4"}).triton.serving)
    assert (t.tensorrt, t.compute_capability, t.image) == ("10.8.0", "8.9", "nvcr.io/nvidia/tritonserver:25.01-py3")


def test_unknown_release_lists_the_known_ones():
    with pytest.raises(RecipeError) as err:
        _load({"container": "23.01-trtllm-python-py3", "gpu": "H100"})
    msg = str(err.value)
    assert "triton.serving: Value error, container '23.01-trtllm-python-py3'" in msg
    assert "known containers: 24.08-trtllm-python-py3," in msg and "25.12-trtllm-python-py3" in msg
    assert "Give the TensorRT version explicitly" in msg


@pytest.mark.parametrize("cfg, message", [
    ({"gpu": "H100"}, "give a Triton container tag"),
    ({"container": "25.01-trtllm-python-py3", "tensorrt": "10.9.0", "gpu": "H100"},
     "tensorrt '10.9.0' contradicts container '25.01-trtllm-python-py3', which ships TensorRT 10.8.0.43"),
    ({"tensorrt": "10.8.0", "gpu": "Quadro K600"}, "gpu 'Quadro K600': compute capability unknown"),
    ({"tensorrt": "10.8", "gpu": "H100"}, "triton.serving.tensorrt: String should match pattern"),
    ({"tensorrt": "10.8.0", "gpu": "H100", "cuda": "12.8"}, "triton.serving.cuda: unknown key"),
])
def test_schema_errors_name_the_field(cfg, message):
    with pytest.raises(RecipeError) as err:
        _load(cfg)
    assert message in str(err.value)


def test_explicit_compute_capability_for_an_unlisted_gpu():
    t = serving_targets.declared_target(_load({"tensorrt": "10.8.0", "gpu": "Quadro K600", "compute_capability": "3.0"})
                                .triton.serving)
    assert t.compute_capability == "3.0"


@pytest.mark.parametrize("name, cap", [
    ("NVIDIA H100 80GB HBM3", "9.0"), ("NVIDIA A10", "8.6"), ("NVIDIA A100-SXM4-80GB", "8.0"),
    ("NVIDIA L40S", "8.9"), ("NVIDIA L40", "8.9"), ("NVIDIA GeForce RTX 4090", "8.9"), ("Tesla T4", "7.5"),
    ("NVIDIA B200", "10.0"), ("Quadro K600", None),
])
def test_gpu_capability(name, cap):
    assert serving_targets.gpu_capability(name) == cap


@pytest.mark.parametrize("declared, actual, same", [
    ("H100", "NVIDIA H100 80GB HBM3", True), ("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3", True),
    ("H100", "NVIDIA H200", False), ("A10", "NVIDIA A100-SXM4-80GB", False), ("L40", "NVIDIA L40S", False),
])
def test_same_gpu_model(declared, actual, same):
    assert serving_targets.same_gpu_model(declared, actual) is same


def test_tensorrt_versions_compare_on_major_minor_patch():
    assert serving_targets.same_tensorrt("10.8.0.43", "10.8.0")
    assert not serving_targets.same_tensorrt("10.8.0.43", "10.8.1.2")
    with pytest.raises(ValueError, match="not major.minor.patch"):
        serving_targets.tensorrt_triple("10.8")


def test_fp8_threshold():
    assert capability_problem("fp8", "8.9", "x") is None and capability_problem("fp8", "10.0", "x") is None
    assert capability_problem("fp8", "8.6", "this GPU (A10)") == \
        "FP8 needs compute capability >= 8.9; this GPU (A10) has compute capability 8.6"
