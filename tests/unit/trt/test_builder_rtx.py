"""Real engine builds with TensorRT-RTX (a core dependency; its builder needs no GPU).

Small Q/DQ graphs (tests/rtx_graphs.py) and the tiny Llama's quantized graph are parsed
and built for real: strongly typed network, several optimization profiles, the stamp,
the report section, the check build for a target TensorRT-RTX lacks, and parser errors
with their exit codes.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.trt import backends as engine_backends
from pipeline.trt import builder as engine_builder
from pipeline.trt import report as engine_report
from pipeline.trt import stamp as engine_stamp
from pipeline import targets as serving_targets
from pipeline.artifacts import ResolvedProfile, TensorSpec
from pipeline.errors import EXIT_BAD_INPUT, EXIT_INTERNAL, RecipeError
from pipeline.recipe.schema import Recipe
from pipeline.recipe.load import load_recipe
from pipeline.stages import build
from conftest import ROOT
from rtx_graphs import QDQ_INPUTS, write_qdq_matmuls, write_unbuildable
from test_build import make_recipe

pytestmark = pytest.mark.skipif(engine_backends.import_problem(engine_backends.TENSORRT_RTX) is not None,
                                reason="tensorrt-rtx-cu12-bindings/-libs not installed (core dependencies)")

PREFILL = {"name": "prefill", "dims": {"batch": {"min": 1, "opt": 2, "max": 4}, "sequence": {"min": 1, "opt": 16, "max": 64}}}
DECODE = {"name": "decode", "dims": {"batch": {"min": 1, "opt": 8, "max": 8}, "sequence": {"min": 1, "opt": 1, "max": 1}}}
BATCH = {"name": "batch", "dims": {"batch": {"min": 1, "opt": 2, "max": 4}}}


def rtx_recipe(tmp_path: Path, profiles: list[dict], **build_fields) -> Recipe:
    data = make_recipe(tmp_path, profiles).model_dump(by_alias=True)
    data["build"].update({"targets": ["sm89"], **build_fields})
    return Recipe.model_validate(data)


def stamp_of(art) -> dict:
    return json.loads(Path(art.stamp_path).read_text())


def test_qdq_graph_builds_for_sm89_with_two_profiles(tmp_path):
    recipe = rtx_recipe(tmp_path, [PREFILL, DECODE])
    art = build.build_from_onnx(recipe, write_qdq_matmuls(tmp_path / "q.onnx"), QDQ_INPUTS, tmp_path / "build",
                    quantized_nodes=["mm1", "mm2"])
    assert (art.status, art.backend, art.reason) == ("ok", "tensorrt-rtx", "")
    assert art.summary.startswith("TensorRT-RTX 1.7.1.116 engine for sm89: ")
    assert f"{Path(art.engine_path).stat().st_size:,} bytes, built in " in art.summary
    assert Path(art.engine_path).name == "model.rtx-sm89.engine"
    assert art.plan_path is None  # not a plan Triton's tensorrt_plan backend can load
    stamp = stamp_of(art)
    assert stamp["backend"] == "tensorrt-rtx" and stamp["tensorrt_version"] == engine_backends.TENSORRT_RTX.version()
    assert (stamp["targets"], stamp["compute_capability"], stamp["check_only"]) == (["sm89"], "8.9", False)
    assert stamp["engine_bytes"] == Path(art.engine_path).stat().st_size > 0
    assert stamp["build_wall_s"] > 0 and stamp["builder_peak_rss_mib"] > 0
    assert [p["name"] for p in stamp["profiles"]] == ["prefill", "decode"]
    assert stamp["profiles"][1]["shapes"]["x"] == {"min": [1, 1, 16], "opt": [8, 1, 16], "max": [8, 1, 16]}
    net = stamp["network"]
    assert net["low_precision_gemms"] == {"mm1": "INT8", "mm2": "INT8"}
    assert (net["qdq_layers"], net["gemms"], net["layers_by_type"]["MATRIX_MULTIPLY"]) == (8, 2, 2)
    assert not (tmp_path / "cache" / "tiny.cache").exists()  # TensorRT-RTX: timing cache calls are no-ops
    assert stamp["timing_cache"].startswith("not used: TensorRT-RTX ignores timing caches")
    section = (tmp_path / "build" / engine_report.SECTION_FILE).read_text()
    assert ("| GEMMs with INT8/FP8 operands | 2 of 2 engine matrix multiplies, attention's included "
            "(quantize stage: 2 weight GEMMs) |") in section
    assert "| backend | TensorRT-RTX 1.7" in section and "WARNING" not in section
    assert "| Q/DQ layers kept | 8 (ONNX graph: 8 Q/DQ nodes) |" in section


def test_a_gemm_left_in_fp32_by_the_network_is_a_warning_naming_it(tmp_path):
    art = build.build_from_onnx(rtx_recipe(tmp_path, [PREFILL]), write_qdq_matmuls(tmp_path / "q.onnx", quantize_second=False),
                    QDQ_INPUTS, tmp_path / "build", quantized_nodes=["mm1", "mm2"])
    assert art.status == "ok"
    assert art.reason.startswith("1 of the 2 GEMMs the quantize stage quantized have no INT8/FP8 operands")
    assert art.reason.endswith("higher precision than validate measured: mm2")
    assert "- WARNING: 1 of the 2 GEMMs" in (tmp_path / "build" / engine_report.SECTION_FILE).read_text()


def test_several_targets_make_one_engine(tmp_path):
    recipe = rtx_recipe(tmp_path, [PREFILL], targets=["sm86", "sm89"])
    art = build.build_from_onnx(recipe, write_qdq_matmuls(tmp_path / "q.onnx"), QDQ_INPUTS, tmp_path / "build")
    assert Path(art.engine_path).name == "model.rtx-sm86-sm89.engine"
    assert stamp_of(art)["compute_capability"] == "8.6,8.9"


def test_hopper_target_gets_a_labelled_sm89_check(tmp_path):
    art = build.build_from_onnx(rtx_recipe(tmp_path, [PREFILL], targets=["sm90"]), write_qdq_matmuls(tmp_path / "q.onnx"),
                    QDQ_INPUTS, tmp_path / "build")
    assert art.status == "ok" and Path(art.engine_path).name == "check.rtx-sm89.engine"
    assert stamp_of(art)["check_only"] is True and stamp_of(art)["targets"] == ["sm89"]
    assert "sm90: not a TensorRT-RTX target" in art.reason
    assert "parse-and-build CHECK for sm89" in art.reason and "not a deployable engine for sm90" in art.reason
    assert "--saveEngine=model.plan" in (tmp_path / "build" / "trtexec.sh").read_text()  # the real target's build


def test_rtx_stamp_is_refused_for_tensorrt_plan(tmp_path):
    art = build.build_from_onnx(rtx_recipe(tmp_path, [PREFILL]), write_qdq_matmuls(tmp_path / "q.onnx"), QDQ_INPUTS,
                    tmp_path / "build")
    h100 = serving_targets.Target("10.8.0.43", "9.0", "H100")
    result = engine_stamp.check_stamp(stamp_of(art), h100, "whatever")
    assert len(result.errors) == 1
    assert result.errors[0].startswith("backend: engine built by TensorRT-RTX 1.7")
    assert "Triton's tensorrt_plan backend (datacenter TensorRT 10.8.0.43) cannot load; serve the ONNX graph" in result.errors[0]


def test_inconsistent_profile_is_refused_by_the_real_builder():
    backend = engine_backends.TENSORRT_RTX
    trt = backend.module()
    builder = trt.Builder(trt.Logger(trt.Logger.ERROR))
    prof = ResolvedProfile("decode", {"x": {"min": [1, 8], "opt": [1, 4], "max": [1, 16]}})
    with pytest.raises(engine_builder.EngineBuildError, match=r"build.profiles 'decode': TensorRT rejected the optimization "
                                                      r"profile \(x min \[1, 8\] opt \[1, 4\] max \[1, 16\]\); each "
                                                      r"axis needs min <= opt <= max"):
        engine_builder.add_profile(backend, builder, builder.create_builder_config(), prof, ["x"])


def test_parser_refusal_of_a_model_node_is_exit_2(tmp_path):
    recipe = rtx_recipe(tmp_path, [BATCH], targets=["sm86"])
    with pytest.raises(engine_builder.EngineBuildError) as err:
        build.build_from_onnx(recipe, write_unbuildable(tmp_path / "bad.onnx"), [TensorSpec("x", "float32", ["batch", 16])],
                  tmp_path / "build")
    assert err.value.exit_code == EXIT_BAD_INPUT and not isinstance(err.value, engine_builder.InsertedNodeRejected)
    msg = str(err.value)
    assert "TensorRT-RTX 1.7.1.116 ONNX parser rejected" in msg
    assert "node 'to_string' (Cast): " in msg and "Unsupported data type for the Cast operator" in msg
    assert "profile 'batch': x min [1, 16] opt [2, 16] max [4, 16]" in msg
    assert "part of the model itself" in msg


def test_parser_refusal_of_a_node_the_pipeline_inserted_is_exit_3(tmp_path):
    exported = write_unbuildable(tmp_path / "exported.onnx", cast_name="original")  # has no node 'to_string'
    with pytest.raises(engine_builder.InsertedNodeRejected) as err:
        build.build_from_onnx(rtx_recipe(tmp_path, [BATCH]), write_unbuildable(tmp_path / "bad.onnx"),
                  [TensorSpec("x", "float32", ["batch", 16])], tmp_path / "build", source_onnx=exported)
    assert err.value.exit_code == EXIT_INTERNAL
    assert "to_string: inserted by the pipeline (quantize stage), so this is a pipeline bug" in str(err.value)


def test_no_garbage_collection_runs_while_tensorrt_calls_the_logger(tmp_path, monkeypatch):
    """TensorRT calls the Python logger holding its own locks: a collection there could free an
    earlier build's IBuilder, whose destructor waits on that lock (a worker hung so in a test run)."""
    import gc

    enabled_in_callback: list[bool] = []
    real = engine_builder.make_logger

    def recording(backend, sink):
        logger = real(backend, sink)
        log = type(logger).log

        def spy(self, severity, msg):
            enabled_in_callback.append(gc.isenabled())
            log(self, severity, msg)

        monkeypatch.setattr(type(logger), "log", spy)
        return logger

    monkeypatch.setattr(engine_builder, "make_logger", recording)
    monkeypatch.setattr(engine_builder, "ISOLATED", False)  # the patch above lives in this process
    with pytest.raises(engine_builder.EngineBuildError):  # the parser logs its refusal through the logger
        build.build_from_onnx(rtx_recipe(tmp_path, [BATCH]), write_unbuildable(tmp_path / "bad.onnx"),
                              [TensorSpec("x", "float32", ["batch", 16])], tmp_path / "build")
    assert enabled_in_callback and not any(enabled_in_callback)
    assert gc.isenabled()  # on again after the failed build


def test_explicit_rtx_backend_needs_a_target(tmp_path):
    recipe = rtx_recipe(tmp_path, [PREFILL], backend="tensorrt-rtx", targets=[])
    with pytest.raises(engine_backends.BackendChoiceError, match="needs a target: set build.targets"):
        build.build_from_onnx(recipe, write_qdq_matmuls(tmp_path / "q.onnx"), QDQ_INPUTS, tmp_path / "build")


def test_recipe_refuses_fp8_below_sm89_and_rtx_without_a_buildable_target():
    with pytest.raises(RecipeError, match=r"build.targets.0: sm86: FP8 needs compute capability >= 8.9"):
        load_recipe(ROOT / "recipes" / "fp8-llm.yaml", {"build.targets": ["sm86"]})
    with pytest.raises(RecipeError, match=r"build.backend: tensorrt-rtx cannot build for \['sm90'\]"):
        load_recipe(ROOT / "recipes" / "fp8-llm.yaml", {"build.targets": ["sm90"], "build.backend": "tensorrt-rtx"})


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.yaml")) + [ROOT / "examples" / "custom-model" / "recipe.yaml"],
                         ids=lambda p: p.stem if p.stem != "recipe" else p.parent.name)
def test_every_shipped_recipe_declares_a_target_tensorrt_rtx_builds(path):
    recipe = load_recipe(path)
    assert recipe.build.targets and all(t in serving_targets.RTX_TARGETS for t in recipe.build.targets)
    if recipe.quantize.precision == "fp8":
        assert recipe.build.targets == ["sm89"]


# --- the tiny Llama's quantized graph, through the whole pipeline ---------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_model, tiny_export):
    from pipeline.run.runner import run_pipeline
    from tiny import seed_export, tiny_recipe

    ws = tmp_path_factory.mktemp("tiny-rtx")
    path = tiny_recipe(ws, tiny_model, **{"build.backend": "auto"})
    seed_export(ws, tiny_export)
    return run_pipeline(load_recipe(path), path, quiet=True)


def test_tiny_llm_builds_a_real_sm89_engine_and_ships_the_validated_onnx(tiny_run):
    b, q = tiny_run.artifacts["build"], tiny_run.artifacts["quantize"]
    assert (b.status, b.backend) == ("ok", "tensorrt-rtx"), b.reason
    record = tiny_run.manifest["stages"]["build"]
    assert record["status"] == "ok" and record["reason"] == b.summary, record
    stamp = stamp_of(b)
    assert stamp["targets"] == ["sm89"] and stamp["engine_bytes"] > 0
    # every GEMM the quantize stage quantized has FP8 operands in the strongly typed network
    assert q.quantized_nodes and set(q.quantized_nodes) <= set(stamp["network"]["low_precision_gemms"])
    assert set(stamp["network"]["low_precision_gemms"].values()) == {"FP8"}
    assert "WARNING" not in Path(b.engine_path).with_name(engine_report.SECTION_FILE).read_text()
    note = tiny_run.artifacts["validate"].metrics["validated_artifact"]
    assert note.startswith(f"ONNX graph {q.onnx_path} in ONNX Runtime; an engine was built for sm89 by TensorRT-RTX "
                           "(model.rtx-sm89.engine), not run")
    config = (Path(tiny_run.artifacts["triton"].repository) / "smollm2_fp8" / "config.pbtxt").read_text()
    assert 'platform: "onnxruntime_onnx"' in config or 'backend: "onnxruntime"' in config
