"""The GPU path of the build stage without a GPU: a fake ``tensorrt`` module and a fake CUDA
device are injected at the TensorRT / torch.cuda boundary, and build.build_from_onnx() runs its real
code: serving-runtime checks, FP8 hardware check, timing cache, stamp: what needs a GPU. The
parser, the builder and the optimization profiles run for real with TensorRT-RTX in
tests/unit/trt/test_builder_rtx.py."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from pipeline.trt import builder as engine_builder
from pipeline.trt import stamp as engine_stamp
from pipeline import targets as serving_targets
from pipeline.recipe.schema import Recipe
from pipeline.stages import build
from test_build import DECODE, INPUTS, PROFILE, make_recipe, write_onnx

H100 = {"container": "25.01-trtllm-python-py3", "gpu": "H100"}  # TensorRT 10.8.0.43, compute capability 9.0


class FakeProfile:
    def __init__(self) -> None:
        self.shapes: dict[str, tuple] = {}

    def set_shape(self, name, lo, opt, hi) -> None:
        # what TensorRT checks: same rank, min <= opt <= max on every axis
        if not (len(lo) == len(opt) == len(hi) and all(a <= b <= c for a, b, c in zip(lo, opt, hi))):
            raise RuntimeError(f"inconsistent dimensions for {name}: {lo} {opt} {hi}")
        self.shapes[name] = (lo, opt, hi)


class FakeCache:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def serialize(self) -> bytes:
        return b"CACHE:" + str(len(self.data)).encode()


class FakeConfig:
    def __init__(self) -> None:
        self.profiles: list[FakeProfile] = []
        self.cache: FakeCache | None = None
        self.builder_optimization_level = 0

    def set_memory_pool_limit(self, pool, size) -> None:
        self.workspace = size

    def create_timing_cache(self, data: bytes):
        # the real one returns None for bytes it cannot deserialize
        return FakeCache(data) if data == b"" or data.startswith(b"CACHE:") else None

    def set_timing_cache(self, cache, ignore_mismatch) -> bool:
        self.cache = cache
        return True

    def add_optimization_profile(self, profile) -> int:
        self.profiles.append(profile)
        return len(self.profiles) - 1


class FakeBuilder:
    built: list[FakeConfig] = []

    def __init__(self, logger) -> None:
        self.logger = logger

    def create_network(self, flags):
        return types.SimpleNamespace(num_layers=0)  # what engine_report.summarize_network reads

    def create_builder_config(self) -> FakeConfig:
        return FakeConfig()

    def create_optimization_profile(self) -> FakeProfile:
        return FakeProfile()

    def build_serialized_network(self, network, config) -> bytes:
        FakeBuilder.built.append(config)
        return b"PLAN"


class FakeParser:
    num_errors = 0

    def __init__(self, network, logger) -> None:
        pass

    def parse_from_file(self, path: str) -> bool:
        return Path(path).is_file()


def fake_tensorrt(version: str) -> types.ModuleType:
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version

    class ILogger:
        class Severity:
            INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

        def __init__(self) -> None:
            pass

    trt.ILogger = ILogger
    trt.Builder = FakeBuilder
    trt.OnnxParser = FakeParser
    trt.Dims = tuple
    trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=0)
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE=0)
    return trt


@pytest.fixture
def machine(monkeypatch):
    """Call machine(tensorrt_version, (major, minor), gpu_name) to fake this machine."""
    FakeBuilder.built = []

    def make(version: str = "10.8.0.43", capability: tuple[int, int] = (9, 0), name: str = "NVIDIA H100 80GB HBM3"):
        monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(version))
        monkeypatch.setattr(engine_builder, "ISOLATED", False)  # a builder child would import the real module
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=0: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=0: name)

    return make


def recipe_with(tmp_path: Path, serving_cfg: dict | None, precision: str = "fp16", profiles=None) -> Recipe:
    base = make_recipe(tmp_path, profiles or [PROFILE, DECODE]).model_dump(by_alias=True)
    base["triton"]["serving"] = serving_cfg
    if precision != "fp16":
        base["quantize"] = {"precision": precision, "calibration": {"data": {"type": "corpus", "name": "lee_background", "split": {"start": 20, "stop": 30}}, "samples": 8,
                                                                     "seq_len": 16, "batch_size": 2}}
    return Recipe.model_validate(base)


def run(tmp_path: Path, recipe: Recipe):
    return build.build_from_onnx(recipe, write_onnx(tmp_path / "model.onnx"), INPUTS, tmp_path / "build")


def test_matching_machine_builds_engine_and_stamp(tmp_path, machine):
    machine()
    art = run(tmp_path, recipe_with(tmp_path, H100))
    assert art.status == "ok" and art.reason == ""
    assert Path(art.engine_path).read_bytes() == b"PLAN"
    stamp = json.loads(Path(art.stamp_path).read_text())
    assert (stamp["tensorrt_version"], stamp["compute_capability"], stamp["gpu_name"]) == (
        "10.8.0.43", "9.0", "NVIDIA H100 80GB HBM3")
    [config] = FakeBuilder.built
    assert [p.shapes["input_ids"] for p in config.profiles] == [((1, 1), (2, 16), (4, 64)), ((1, 1), (8, 1), (8, 1))]
    assert (tmp_path / "cache" / "tiny.cache").read_bytes() == b"CACHE:0"


def test_missing_serving_declaration_is_refused(tmp_path, machine):
    machine()
    with pytest.raises(engine_stamp.ServingRuntimeError, match="does not declare triton.serving") as err:
        run(tmp_path, recipe_with(tmp_path, None))
    assert "TensorRT 10.8.0.43 and a NVIDIA H100 80GB HBM3 (compute capability 9.0)" in str(err.value)
    assert str(err.value).endswith(
        "known containers with TensorRT 10.8.0.43: 25.01-trtllm-python-py3, 25.02-trtllm-python-py3")
    assert not (tmp_path / "build" / "model.plan").exists() and FakeBuilder.built == []


def test_local_tensorrt_differing_from_the_declared_one_is_refused(tmp_path, machine, monkeypatch):
    machine(version="11.1.0.5")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(engine_stamp.ServingRuntimeError, match="refusing to build") as err:
        run(tmp_path, recipe_with(tmp_path, H100))
    msg = str(err.value)
    assert "tensorrt_version: this machine has '11.1.0.5', the serving runtime " \
           "nvcr.io/nvidia/tritonserver:25.01-trtllm-python-py3 has '10.8.0.43'" in msg
    assert "inside nvcr.io/nvidia/tritonserver:25.01-trtllm-python-py3" in msg
    assert "with trtexec on PATH: sh build/trtexec.sh  (e.g. docker run --rm --gpus all -v \"$PWD\":/work " \
           "-w /work nvcr.io/nvidia/tritonserver:25.01-trtllm-python-py3 sh build/trtexec.sh)" in msg
    assert "tensorrt==10.8.0.*" in msg
    assert FakeBuilder.built == [] and (tmp_path / "build" / "trtexec.sh").is_file()


def test_only_the_build_number_may_differ(tmp_path, machine):
    machine(version="10.8.0.99")
    assert run(tmp_path, recipe_with(tmp_path, H100)).status == "ok"


def test_explicit_tensorrt_version_names_a_known_container(tmp_path, machine):
    machine(version="10.9.0.34")
    with pytest.raises(engine_stamp.ServingRuntimeError) as err:
        run(tmp_path, recipe_with(tmp_path, {"tensorrt": "10.8.0", "gpu": "H100"}))
    assert "tensorrt_version: this machine has '10.9.0.34', the serving runtime has '10.8.0'" in str(err.value)
    assert "inside nvcr.io/nvidia/tritonserver:25.01-trtllm-python-py3" in str(err.value)


def test_other_compute_capability_than_declared_is_refused(tmp_path, machine):
    machine(capability=(8, 9), name="NVIDIA L40S")
    with pytest.raises(engine_stamp.ServingRuntimeError) as err:
        run(tmp_path, recipe_with(tmp_path, H100))
    assert "compute_capability: this machine has '8.9', the serving GPU 'H100' has '9.0'" in str(err.value)
    script = tmp_path / "build" / "trtexec.sh"  # outside the working folder: absolute, no docker example
    assert str(err.value).split("\n")[-1].startswith(
        f"Build on a H100 (compute capability 9.0) inside nvcr.io/nvidia/tritonserver:25.01-trtllm-python-py3, "
        f"with trtexec on PATH: sh {script}; or install")


def test_same_capability_other_gpu_model_builds_with_a_warning(tmp_path, machine):
    machine(name="NVIDIA H200")
    art = run(tmp_path, recipe_with(tmp_path, H100))
    assert art.status == "ok"
    assert art.reason.startswith("gpu_name: this machine has 'NVIDIA H200', the serving GPU is 'H100': "
                                 "same compute capability 9.0")


def test_fp8_on_compute_capability_8_6_is_refused(tmp_path, machine):
    machine(version="10.8.0.43", capability=(8, 6), name="NVIDIA A10")
    with pytest.raises(engine_stamp.ServingRuntimeError) as err:
        run(tmp_path, recipe_with(tmp_path, {"container": "25.01-trtllm-python-py3", "gpu": "A10"}, "fp8"))
    assert "FP8 needs compute capability >= 8.9; this GPU (NVIDIA A10) has compute capability 8.6" in str(err.value)
    assert FakeBuilder.built == []


def test_fp8_for_a_declared_gpu_below_8_9_is_refused(tmp_path, machine):
    machine()
    with pytest.raises(engine_stamp.ServingRuntimeError) as err:
        run(tmp_path, recipe_with(tmp_path, {"container": "25.01-trtllm-python-py3", "gpu": "A100"}, "fp8"))
    assert "FP8 needs compute capability >= 8.9; the serving GPU (A100) has compute capability 8.0" in str(err.value)


def test_fp8_on_8_9_builds(tmp_path, machine):
    machine(capability=(8, 9), name="NVIDIA L4")
    art = run(tmp_path, recipe_with(tmp_path, {"container": "25.01-trtllm-python-py3", "gpu": "L4"}, "fp8"))
    assert art.status == "ok" and art.reason == ""


def test_corrupt_timing_cache_starts_an_empty_one_and_says_so(tmp_path, machine):
    machine()
    cache = tmp_path / "cache" / "tiny.cache"
    cache.parent.mkdir()
    cache.write_bytes(b"\x00garbage")
    art = run(tmp_path, recipe_with(tmp_path, H100))
    assert art.status == "ok"
    assert art.reason == (f"timing cache {cache} is unreadable (corrupt or truncated); started an empty one, "
                          "which replaces the file after this build")
    assert FakeBuilder.built[0].cache.data == b""
    assert cache.read_bytes() == b"CACHE:0"


def test_valid_timing_cache_is_reused(tmp_path, machine):
    machine()
    cache = tmp_path / "cache" / "tiny.cache"
    cache.parent.mkdir()
    cache.write_bytes(b"CACHE:old")
    assert run(tmp_path, recipe_with(tmp_path, H100)).reason == ""
    assert FakeBuilder.built[0].cache.data == b"CACHE:old"


def test_stamp_of_fake_build_passes_the_deploy_check(tmp_path, machine):
    from pipeline.stages.triton import check_engine

    machine(name="NVIDIA H200")
    recipe = recipe_with(tmp_path, H100)
    art = run(tmp_path, recipe)
    assert check_engine(recipe, art) == [
        "gpu_name: engine has 'NVIDIA H200', the serving GPU is 'H100': same compute capability 9.0, so the engine "
        "loads, but its kernels were timed on another GPU model (performance may differ); rebuild on the serving "
        "GPU model for best results"
    ]
    assert serving_targets.declared_target(recipe.triton.serving).tensorrt == "10.8.0.43"
