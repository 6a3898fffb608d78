"""``pipeline publish`` to S3-compatible storage, against moto's S3
server on 127.0.0.1 and, for the round trip, the real tritonserver of the pytriton wheel
reading ``s3://127.0.0.1:<port>/bucket/prefix``.

The repository published is the tiny KV-cache LM of tests/serve_tiny.py (a hand-made ONNX
graph: seconds, where building tests/tiny.py's random Llama through the pipeline takes
minutes on this shared CPU); its run directory gets a manifest with the verdict under test.
The serve copy (``prepare``: python-onnxruntime, the wheel's server has only the python
backend) is what is published and served.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import MOTO_BUCKET, ROOT
from pipeline.errors import EXIT_ENVIRONMENT, EXIT_GATE_FAILED, EnvironmentFault, GateFailed, PipelineError, RepositoryCorrupt
from pipeline.fsutil import file_sha256
from pipeline.recipe.schema import DynamicBatching
from pipeline.remote import s3
from pipeline.remote.s3 import RECORD, S3Location, publish_recipe
from pipeline.serve.prepare import prepare, with_triton
from pipeline.triton.config import parse_config
from serve_tiny import llm_artifacts, llm_recipe
from test_repository import reference_generate

BUCKET = MOTO_BUCKET
PROMPTS = [[1, 2, 3], [4, 5, 6]]


@pytest.fixture
def client(moto_s3):
    import boto3

    return boto3.client("s3")


def write_manifest(recipe, verdict: str = "pass") -> Path:
    run_dir = Path(recipe.work_dir) / recipe.name
    run_dir.mkdir(parents=True, exist_ok=True)
    gates = [{"name": "perplexity", "passed": verdict == "pass", "message": f"perplexity gate: {verdict}"}]
    (run_dir / "manifest.json").write_text(json.dumps({"verdict": verdict, "gates": gates}))
    return run_dir / "manifest.json"


@pytest.fixture
def built(tmp_path):
    """(recipe, artifacts, served): the tiny LM's serve copy written, manifest verdict pass."""
    recipe, artifacts = llm_recipe(tmp_path), llm_artifacts(tmp_path)
    served = prepare(recipe, artifacts, backends=["python"])
    write_manifest(recipe)
    return recipe, artifacts, served


def loc_for(tmp_path: Path) -> S3Location:
    return S3Location.parse(f"s3://{BUCKET}/runs/{tmp_path.name}")


def live_config(client, loc: S3Location, model: str):
    return parse_config(client.get_object(Bucket=BUCKET, Key=loc.key(model, "config.pbtxt"))["Body"].read().decode())


def keys(client, loc: S3Location) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=loc.prefix + "/")
    return sorted(o["Key"][len(loc.prefix) + 1:] for page in pages for o in page.get("Contents", []))


def test_s3_urls_in_boto3_and_triton_forms(monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    plain = S3Location.parse("s3://bucket/a/b/")
    assert (plain.bucket, plain.prefix, plain.endpoint, plain.url, plain.triton_url) == (
        "bucket", "a/b", None, "s3://bucket/a/b", "s3://bucket/a/b")
    local = S3Location.parse("s3://127.0.0.1:9000/bucket/p")
    assert (local.endpoint, local.url, local.triton_url) == ("http://127.0.0.1:9000", "s3://bucket/p", "s3://127.0.0.1:9000/bucket/p")
    tls = S3Location.parse("s3://https://minio.svc:443/bucket/p")
    assert (tls.endpoint, tls.triton_url) == ("https://minio.svc:443", "s3://https://minio.svc:443/bucket/p")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://store.local")
    assert plain.triton_url == "s3://store.local:80/bucket/a/b"
    assert plain.key("m", "1", "model.py") == "a/b/m/1/model.py" and S3Location.parse("s3://bucket").key("m") == "m"
    for bad, why in (("/tmp/x", "expected s3://bucket/prefix"), ("s3://", "no bucket"), ("s3://Bad_Bucket/x", "not a valid S3 bucket")):
        with pytest.raises(PipelineError, match=why):
            S3Location.parse(bad)


@pytest.mark.parametrize("recipe, front", [
    ("recipes/fp8-llm.yaml", ["smollm2_generate"]),
    ("recipes/int8-encoder.yaml", ["minilm_int8_ensemble"]),
    ("recipes/int8-textline-orientation.yaml", ["textline_cls_int8_ensemble"]),
    ("examples/custom-model/recipe.yaml", []),  # generic: clients call the compute model, no ensemble
])
def test_front_models_are_the_adapters(recipe, front):
    """A generic recipe was given an ``_ensemble`` it does not have."""
    from pipeline.recipe.load import load_recipe

    assert s3.front_models(load_recipe(ROOT / recipe)) == front


def test_gate_refuses_a_failed_verdict_a_missing_run_and_a_tampered_copy(built, client, tmp_path):
    recipe, _, served = built
    loc = loc_for(tmp_path)
    manifest = write_manifest(recipe, "fail")
    with pytest.raises(GateFailed, match=r"verdict 'fail', not 'pass': nothing is published\n  perplexity gate: fail") as e:
        publish_recipe(recipe, loc, serve_copy=True)
    assert e.value.exit_code == EXIT_GATE_FAILED
    manifest.unlink()
    with pytest.raises(GateFailed, match="manifest.json: missing; build the recipe first"):
        publish_recipe(recipe, loc, serve_copy=True)
    write_manifest(recipe)
    model_py = served.repository / "tiny" / "1" / "model.py"
    model_py.write_text(model_py.read_text() + "\n# edited\n")
    with pytest.raises(RepositoryCorrupt, match=r"fails verification, nothing published:\n.*tiny/1/model.py: sha256") as e:
        publish_recipe(recipe, loc, serve_copy=True)
    assert e.value.exit_code == EXIT_ENVIRONMENT
    with pytest.raises(PipelineError, match="holds no model of recipe 'tiny-llm'"):
        publish_recipe(recipe, loc)  # model_repository/ was never built here
    run = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**run, "recipe_hash": "f" * 64}))  # built from other overrides
    with pytest.raises(PipelineError, match=r"its passing run built recipe hash ffffffffffff, and this recipe \(with its "
                                            rf"--set overrides\) hashes {recipe.digest[:12]}: nothing published") as e:
        publish_recipe(recipe, loc, serve_copy=True)
    assert e.value.exit_code == 2
    assert keys(client, loc) == []


def test_publish_uploads_hashed_versions_then_flips_config_and_rolls_back(built, client, tmp_path):
    recipe, _, served = built
    loc = loc_for(tmp_path)
    first = publish_recipe(recipe, loc, serve_copy=True)
    assert (first["version"], first["previous"], first["models"]) == (1, None, ["tiny", "tiny_generate"])
    local = {f"{m}/1/{p.relative_to(served.repository / m / '1').as_posix()}": p
             for m in first["models"] for p in (served.repository / m / "1").rglob("*") if p.is_file()}
    assert keys(client, loc) == sorted([*local, "tiny/config.pbtxt", "tiny_generate/config.pbtxt",
                                        f"tiny/1/{RECORD}", f"tiny_generate/1/{RECORD}"])
    for key, path in local.items():
        head = client.head_object(Bucket=BUCKET, Key=loc.key(key))
        assert head["Metadata"]["sha256"] == file_sha256(path)
    for model in first["models"]:
        cfg = live_config(client, loc, model)
        assert list(cfg.version_policy.specific.versions) == [1]
        local_cfg = parse_config((served.repository / model / "config.pbtxt").read_text())
        cfg.ClearField("version_policy")
        assert cfg == local_cfg  # only the version policy differs from the local config
    man = json.loads((Path(recipe.work_dir) / recipe.name / "manifest.json").read_text())
    assert man["verdict"] == "pass" and [(p["action"], p["version"], p["to"]) for p in man["published"]] == [
        ("publish", 1, loc.url)]
    assert man["published"][0]["triton_url"].startswith("s3://127.0.0.1:") and man["published"][0]["target"] == "python-onnxruntime"

    second = publish_recipe(recipe, loc, serve_copy=True)
    assert (second["version"], second["previous"]) == (2, 1)
    assert [list(live_config(client, loc, m).version_policy.specific.versions) for m in second["models"]] == [[2], [2]]
    back = publish_recipe(recipe, loc, serve_copy=True, rollback=True)
    assert (back["version"], back["previous"]) == (1, 2)
    assert [list(live_config(client, loc, m).version_policy.specific.versions) for m in back["models"]] == [[1], [1]]
    with pytest.raises(PipelineError, match="no complete version below the live version 1"):
        publish_recipe(recipe, loc, serve_copy=True, rollback=True)
    assert publish_recipe(recipe, loc, serve_copy=True)["version"] == 3  # versions are never reused
    man = json.loads((Path(recipe.work_dir) / recipe.name / "manifest.json").read_text())
    assert [(p["action"], p["version"]) for p in man["published"]] == [("publish", 1), ("publish", 2), ("rollback", 1), ("publish", 3)]


def failing_after(count: int):
    """An upload_object that uploads ``count`` objects, then fails as a dropped connection would."""
    from botocore.exceptions import EndpointConnectionError

    real, calls = s3.upload_object, []

    def upload(*args, **kwargs):
        calls.append(args[3])
        if len(calls) > count:
            raise EndpointConnectionError(endpoint_url="http://127.0.0.1/simulated-drop")
        real(*args, **kwargs)

    return upload


def test_a_failed_upload_leaves_the_live_version_and_is_never_reused(built, client, tmp_path, monkeypatch):
    recipe, _, _ = built
    loc = loc_for(tmp_path)
    publish_recipe(recipe, loc, serve_copy=True)
    live_before = {m: client.get_object(Bucket=BUCKET, Key=loc.key(m, "config.pbtxt"))["Body"].read() for m in ("tiny", "tiny_generate")}
    monkeypatch.setattr(s3, "upload_object", failing_after(2))
    with pytest.raises(EnvironmentFault, match=r"uploading version 2 \(the live version 1 is unchanged\) failed") as e:
        publish_recipe(recipe, loc, serve_copy=True)
    assert e.value.exit_code == EXIT_ENVIRONMENT
    monkeypatch.undo()
    assert {m: client.get_object(Bucket=BUCKET, Key=loc.key(m, "config.pbtxt"))["Body"].read() for m in live_before} == live_before
    partial = [k for k in keys(client, loc) if "/2/" in k]
    assert len(partial) == 2 and not any(k.endswith(RECORD) for k in partial)
    third = publish_recipe(recipe, loc, serve_copy=True)
    assert (third["version"], third["previous"]) == (3, 1)
    assert publish_recipe(recipe, loc, serve_copy=True, rollback=True)["version"] == 1  # skips the incomplete 2


def test_a_killed_upload_leaves_the_live_version(built, client, tmp_path):
    recipe, _, _ = built
    loc = loc_for(tmp_path)
    publish_recipe(recipe, loc, serve_copy=True)
    code = ("import sys; sys.path.insert(0, 'tests'); from serve_tiny import llm_recipe; from pathlib import Path; "
            "from pipeline.remote.s3 import S3Location, publish_recipe; "
            f"publish_recipe(llm_recipe(Path({str(tmp_path)!r})), S3Location.parse({loc.url!r}), serve_copy=True)")
    env = {**os.environ, "PIPELINE_FAULT": "s3:upload:3"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr  # SIGKILLed at the fault point, after 3 objects of version 2
    assert len([k for k in keys(client, loc) if "/2/" in k]) == 3
    assert [list(live_config(client, loc, m).version_policy.specific.versions) for m in ("tiny", "tiny_generate")] == [[1], [1]]
    assert publish_recipe(recipe, loc, serve_copy=True)["version"] == 3


def test_two_recipes_sharing_a_prefix_cannot_replace_each_others_models(built, client, tmp_path):
    """A second recipe with the same model names published over the first one's live
    models with exit 0. Refused before any upload, exit 2, naming the model, its owner and the field."""
    from pipeline.triton.publish import ModelOwnedElsewhere

    recipe, artifacts, _ = built
    loc = loc_for(tmp_path)
    first = publish_recipe(recipe, loc, serve_copy=True)
    before = keys(client, loc)
    other = llm_recipe(tmp_path / "b").model_copy(update={"name": "other-llm"})
    prepare(other, llm_artifacts(tmp_path / "b"), backends=["python"])
    write_manifest(other)
    for rollback in (False, True):
        with pytest.raises(ModelOwnedElsewhere, match=r"recipe 'other-llm' would replace live models that are not its "
                                                      r"own; nothing was uploaded:\n  model 'tiny' .* is live at version 1 "
                                                      r"published by recipe 'tiny-llm'; it is this recipe's "
                                                      r"triton.model_name\n") as e:
            publish_recipe(other, loc, serve_copy=True, rollback=rollback)
        assert e.value.exit_code == 2 and "'tiny_generate'" in str(e.value)
    assert keys(client, loc) == before
    assert [list(live_config(client, loc, m).version_policy.specific.versions) for m in first["models"]] == [[1], [1]]
    assert publish_recipe(recipe, loc, serve_copy=True)["version"] == 2  # the owner still publishes
    # a live config that `pipeline publish` did not write (no record) is nobody's: refused as well
    client.delete_object(Bucket=BUCKET, Key=loc.key("tiny", "2", RECORD))
    with pytest.raises(ModelOwnedElsewhere, match=r"model 'tiny' .* has a live config.pbtxt \(version 2\) with no "
                                                  "trt-pipeline-version.json"):
        publish_recipe(recipe, loc, serve_copy=True)
    other_loc = S3Location.parse(loc.url + "-other")
    assert publish_recipe(other, other_loc, serve_copy=True)["version"] == 1  # another prefix is free


def test_a_missing_bucket_is_an_environment_fault(built, moto_s3):
    recipe, _, _ = built
    with pytest.raises(EnvironmentFault, match=r"s3://no-such-bucket/x: listing versions failed: NoSuchBucket; "
                                               r"create the bucket first \(aws s3 mb s3://no-such-bucket\)"):
        publish_recipe(recipe, S3Location.parse("s3://no-such-bucket/x"), serve_copy=True)


# --- the round trip through a real tritonserver -----------------------------------------------------


def stream_tokens(url: str, model: str = "tiny_generate") -> list[list[int]]:
    from pipeline.serve.client import StreamClient

    with StreamClient(url, timeout_s=120) as c:
        return [c.generate(model, input_ids=p, max_tokens=8).tokens for p in PROMPTS]


@pytest.mark.server
def test_tritonserver_serves_the_published_versions_from_s3(moto_s3, built, tmp_path, monkeypatch):
    pytest.importorskip("pytriton")
    import tritonclient.grpc as grpcclient

    from pipeline.triton.server import start_server

    recipe, artifacts, served = built
    loc = loc_for(tmp_path)
    onnx_path = served.repository / "tiny" / "1" / "model.onnx"  # what the local repository computes with
    expected = [reference_generate(onnx_path, p, 8) for p in PROMPTS]
    entry = publish_recipe(recipe, loc, serve_copy=True)
    assert entry["triton_url"] == f"s3://127.0.0.1:{os.environ['AWS_ENDPOINT_URL'].rsplit(':', 1)[1]}/{BUCKET}/{loc.prefix}"
    server = start_server(entry["triton_url"], models=served.models, explicit=True, timeout_s=300,
                          workdir=tmp_path / "server")
    try:
        assert stream_tokens(server.grpc_url) == expected
        c = grpcclient.InferenceServerClient(server.grpc_url)
        assert c.is_model_ready("tiny", "1") and c.get_model_config("tiny").config.dynamic_batching.max_queue_delay_microseconds == 100

        # version 2: another batching delay, published from a rewritten serve copy
        changed = with_triton(recipe, dynamic_batching=DynamicBatching(max_queue_delay_microseconds=777))
        prepare(changed, artifacts, backends=["python"])
        assert publish_recipe(recipe, loc, serve_copy=True)["version"] == 2
        for model in served.models:  # explicit model control: load again, the front model last
            c.load_model(model)
        cfg = c.get_model_config("tiny").config
        assert (cfg.dynamic_batching.max_queue_delay_microseconds, list(cfg.version_policy.specific.versions)) == (777, [2])
        assert c.is_model_ready("tiny", "2") and not c.is_model_ready("tiny", "1")
        assert stream_tokens(server.grpc_url) == expected

        # an upload that fails half-way: version 2 stays live, also after a reload
        prepare(with_triton(recipe, dynamic_batching=DynamicBatching(max_queue_delay_microseconds=555)),
                artifacts, backends=["python"])
        monkeypatch.setattr(s3, "upload_object", failing_after(3))
        with pytest.raises(EnvironmentFault, match="the live version 2 is unchanged"):
            publish_recipe(recipe, loc, serve_copy=True)
        monkeypatch.undo()
        for model in served.models:
            c.load_model(model)
        cfg = c.get_model_config("tiny").config
        assert (cfg.dynamic_batching.max_queue_delay_microseconds, list(cfg.version_policy.specific.versions)) == (777, [2])
        assert stream_tokens(server.grpc_url) == expected
        c.close()
    finally:
        code = server.stop()
    assert code == 0, server.logs()[-3000:]
    assert np.all([len(t) > 0 for t in expected])
