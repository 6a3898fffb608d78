"""plan-step assemble's SKU branches on a faked cache: each GPU step's ``result.json`` (and engine) put
into moto's S3 as the GPU steps lay them out, the CPU stages' artifacts faked, no build run.

A failed SKU that is not optional blocks publishing (exit 4 naming it); an optional one is left out of
``cc_model_filenames`` and named in ``assemble.json``; a simulated SKU never publishes."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import boto3
import onnx
import pytest
from onnx import TensorProto, helper

from conftest import MOTO_BUCKET, ROOT
from pipeline.errors import EXIT_ENVIRONMENT, PipelineError
from pipeline.remote import plan as P
from pipeline.triton.config import parse_config

CONTAINER = "25.12-trtllm-python-py3"


@pytest.fixture
def setup(moto_s3, tmp_path, request):
    """A plan of int8-llm for L4 and H100 under a fresh cache prefix (``optional``: the SKUs marked so),
    its assemble recipe, faked CPU artifacts, and a function that puts a SKU's result."""
    optional = getattr(request, "param", [])
    cache = f"s3://{MOTO_BUCKET}/assemble-{tmp_path.name}"
    plan = P.make_plan(ROOT / "recipes" / "int8-llm.yaml", ["L4", "H100"], cache, container=CONTAINER,
                       optional=optional, publish_to=f"{cache}/published")
    recipe, _ = P.step_recipe(plan, "assemble", tmp_path / "step")
    graph = tmp_path / "model.onnx"
    onnx.save(helper.make_model(helper.make_graph(
        [helper.make_node("Identity", ["input_ids"], ["logits"])], "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])])), str(graph))
    arts = {"build": SimpleNamespace(profiles=[]), "quantize": SimpleNamespace(ort_path=str(graph))}
    s3 = boto3.client("s3")

    def put(sku: str, status: str, **stamp_changes) -> None:
        key = plan.prefix("skus", sku)
        s = plan.sku(sku)
        base = {"sku": sku, "product": s.product, "compute_capability": s.compute_capability,
                "container": plan.container, "tensorrt_version": plan.tensorrt, "recipe_hash": recipe.engine_hash}
        if status == "failed":
            res = {**base, "status": "failed", "error": "BuildError: out of memory in the builder"}
        elif status == "simulated":
            res = {**base, "status": "simulated", "files": {},
                   "stamp": {**base, "simulated": True, "reason": "no GPU here (simulated on request)"}}
        else:
            stamp = {"backend": "tensorrt", "tensorrt_version": plan.tensorrt, "compute_capability":
                     s.compute_capability, "gpu_name": sku, "recipe_hash": recipe.engine_hash, **stamp_changes}
            files = {}
            for rel, body in (("model.plan", f"engine of {sku}".encode()),
                              ("engine_stamp.json", json.dumps(stamp).encode())):
                s3.put_object(Bucket=MOTO_BUCKET, Key=f"{key}/{rel}", Body=body)
                files[rel] = {"key": f"{key}/{rel}", "sha256": hashlib.sha256(body).hexdigest(), "size": len(body)}
            res = {**base, "status": "ok", "stamp": stamp, "files": files}
        s3.put_object(Bucket=MOTO_BUCKET, Key=f"{key}/{P.RESULT}", Body=json.dumps(res).encode())

    def published() -> list[str]:
        got = s3.list_objects_v2(Bucket=MOTO_BUCKET, Prefix=plan.loc.key("published"))
        return [o["Key"] for o in got.get("Contents", [])]

    return SimpleNamespace(plan=plan, recipe=recipe, arts=arts, put=put, s3=s3, published=published,
                           scratch=tmp_path / "step" / "scratch")


def run(env) -> dict:
    return P.assemble(env.plan, env.recipe, env.arts, P._client(env.plan), env.scratch)


def cc_files(env) -> dict[str, str]:
    name = env.recipe.triton.model_name
    return dict(parse_config((env.scratch / "repository" / name / "config.pbtxt").read_text()).cc_model_filenames)


def test_a_failed_sku_that_is_not_optional_blocks_publishing(setup):
    setup.put("L4", "ok")
    setup.put("H100", "failed")
    with pytest.raises(PipelineError) as e:
        run(setup)
    assert e.value.exit_code == EXIT_ENVIRONMENT
    assert "refusing to publish" in str(e.value) and "failed and not optional: H100: build failed" in str(e.value)
    assert "L4" not in str(e.value).split("failed and not optional:")[1]
    assert setup.published() == []
    summary = json.loads((setup.scratch / "assemble.json").read_text())
    assert summary["ok"] == ["L4"] and list(summary["failed"]) == ["H100"] and summary["published"] is None
    assert cc_files(setup) == {"8.9": "model.sm89.plan"}  # written for inspection, the failed SKU left out


@pytest.mark.parametrize("setup", [["H100"]], indirect=True)
def test_an_optional_failed_sku_is_left_out_of_cc_model_filenames_and_named(setup):
    setup.put("L4", "ok")
    setup.put("H100", "failed")
    summary = run(setup)
    assert summary["ok"] == ["L4"] and summary["left_out_optional"] == ["H100"]
    assert "out of memory" in summary["failed"]["H100"]
    assert json.loads((setup.scratch / "assemble.json").read_text()) == summary
    assert cc_files(setup) == {"8.9": "model.sm89.plan"}
    vdir = setup.scratch / "repository" / setup.recipe.triton.model_name / str(setup.recipe.triton.version)
    assert sorted(p.name for p in vdir.iterdir()) == ["model.sm89.plan"]
    assert (vdir / "model.sm89.plan").read_bytes() == b"engine of L4"
    index = json.loads((setup.scratch / "repository" / "repository.json").read_text())
    assert index[setup.recipe.triton.model_name]["gpus"] == ["L4"]
    assert summary["published"] is not None and setup.published()


@pytest.mark.parametrize("setup", [["H100"]], indirect=True)
def test_a_missing_result_or_a_refused_stamp_counts_as_failed(setup):
    setup.put("L4", "ok", compute_capability="8.6")  # an engine of another architecture
    with pytest.raises(PipelineError) as e:  # H100 (optional) has no result at all
        run(setup)
    msg = str(e.value)
    assert e.value.exit_code == EXIT_ENVIRONMENT and "L4: engine refused" in msg and "8.6" in msg
    summary = json.loads((setup.scratch / "assemble.json").read_text())
    assert summary["left_out_optional"] == ["H100"] and "no result" in summary["failed"]["H100"]
    assert setup.published() == []


@pytest.mark.parametrize("setup", [["L4", "H100"]], indirect=True)
def test_simulated_skus_refuse_publishing_even_when_optional(setup):
    setup.put("L4", "simulated")
    setup.put("H100", "ok")
    with pytest.raises(PipelineError) as e:
        run(setup)
    assert e.value.exit_code == EXIT_ENVIRONMENT
    assert "simulated (no engine was built): L4: no GPU here" in str(e.value) and "H100" not in str(e.value)
    assert setup.published() == []
    assert cc_files(setup) == {"8.9": "model.sm89.plan", "9.0": "model.sm90.plan"}  # listed; only H100's file
