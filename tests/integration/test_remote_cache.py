"""The stage cache shared by runners, against
moto's S3 server on 127.0.0.1 (the ``moto_s3`` fixture of conftest.py).

Runner A builds tests/tiny.py's recipe in one folder and pushes every stage; each other
runner is a fresh folder (its own copy of the model, work_dir and output_dir: other
absolute paths, no local cache) building from the same remote prefix.
"""
from __future__ import annotations

import concurrent.futures
import json
import shutil
import threading
from pathlib import Path

import pytest

from conftest import MOTO_BUCKET
from pipeline.context import Progress, StageContext
from pipeline.errors import EXIT_BAD_INPUT, PipelineError
from pipeline.recipe.load import load_recipe
from pipeline.remote.cache import ENV, FORMAT, RemoteCache
from pipeline.remote.s3 import S3Location
from pipeline.run.runner import run_pipeline
from pipeline.triton.publish import read_index, tree_hashes, verify_repository
from tiny import make_tiny_llama, tiny_recipe

STAGES = ["export", "quantize", "build", "validate", "triton"]
PREFIX = "ci/stage-cache"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def cache() -> RemoteCache:
    return RemoteCache(S3Location.parse(f"s3://{MOTO_BUCKET}/{PREFIX}"))


def runner(folder: Path, model: Path, **changes):
    """Build the tiny recipe in ``folder`` with its own copy of the model; (result, cache, recipe)."""
    folder.mkdir(parents=True)
    own = shutil.copytree(model, folder / "model")
    path = tiny_recipe(folder, own, **changes)
    remote = cache()
    result = run_pipeline(load_recipe(path), path, quiet=True, remote=remote)
    return result, remote, load_recipe(path)


@pytest.fixture(scope="module")
def runner_a(moto_s3, tiny_model, tmp_path_factory):
    return runner(tmp_path_factory.mktemp("runner") / "a", tiny_model)


def models_of(recipe) -> dict[str, dict[str, str]]:
    repo = Path(recipe.output_dir)
    return {m: tree_hashes(repo / m) for m, e in read_index(repo).items() if e["recipe"] == recipe.name}


def metrics(result, recipe) -> str:
    """The manifest's metrics, with the runner's run folder (named in notes) as ``RUN``."""
    return json.dumps(result.manifest["metrics"], sort_keys=True).replace(str(Path(recipe.work_dir) / recipe.name), "RUN")


def entry(stage: str, result) -> dict:
    import boto3

    key = json.loads((result.manifest_path.parent / stage / "stage.json").read_text())["key"]
    body = boto3.client("s3").get_object(Bucket=MOTO_BUCKET, Key=f"{PREFIX}/stages/{stage}/{key}.json")["Body"]
    return json.loads(body.read())


def test_runner_a_pushes_every_stage_it_ran(runner_a):
    result, remote, _ = runner_a
    assert result.passed
    assert remote.pushed == STAGES and remote.pulled == [] and remote.warnings == []
    assert result.manifest["remote_cache"]["pushed"] == STAGES
    assert all(not r["cache_hit"] for r in result.manifest["stages"].values())
    exp = entry("export", result)
    assert exp["artifact"]["onnx_path"] == "${run_dir}/export/model.onnx"  # no runner's folder in an entry
    assert {"model.onnx", "model.onnx.data", "tokenizer/tokenizer.json"} <= set(exp["files"])
    tri = entry("triton", result)
    assert tri["artifact"]["repository"] == "${output_dir}" and set(tri["index"]) == set(tri["artifact"]["models"])


def test_runner_b_in_a_fresh_folder_pulls_every_stage_and_publishes_the_same_bytes(runner_a, tiny_model, tmp_path):
    result_a, _, recipe_a = runner_a
    result, remote, recipe = runner(tmp_path / "b", tiny_model)
    assert remote.pulled == STAGES and remote.pushed == [] and remote.warnings == []
    stages = result.manifest["stages"]
    assert {s: (r["cache_hit"], r.get("cache_source")) for s, r in stages.items()} == {s: (True, "remote") for s in STAGES}
    assert result.passed and metrics(result, recipe) == metrics(result_a, recipe_a)
    assert Path(recipe.output_dir) != Path(recipe_a.output_dir)
    assert models_of(recipe) == models_of(recipe_a) and models_of(recipe)  # byte-identical models
    assert verify_repository(Path(recipe.output_dir), recipe=recipe.name) == []
    assert result.artifacts["export"].onnx_path == str(Path(recipe.work_dir) / recipe.name / "export" / "model.onnx")
    report = (result.manifest_path.parent / "report.md").read_text()
    assert "| export | ok | hit (remote) |" in report and str(Path(recipe_a.work_dir)) not in report
    # the pulled stages are now local: a rebuild without the remote cache runs nothing
    again = run_pipeline(recipe, Path(recipe.work_dir).parent / "tiny-llm.yaml", quiet=True)
    assert all(r["cache_hit"] and r.get("cache_source") == "local" for r in again.manifest["stages"].values())


def test_a_changed_quantize_section_reruns_quantize_and_what_follows_only(runner_a, tiny_model, tmp_path):
    result, remote, _ = runner(tmp_path / "c", tiny_model,
                               **{"quantize.exclude": {"nodes": ["*mlp.down_proj*", "*mlp.up_proj*"]}})
    stages = result.manifest["stages"]
    assert stages["export"]["cache_hit"] and stages["export"]["cache_source"] == "remote"
    assert [s for s in STAGES if not stages[s]["cache_hit"]] == ["quantize", "build", "validate", "triton"]
    assert remote.pulled == ["export"] and remote.pushed == ["quantize", "build", "validate", "triton"]
    assert len(result.artifacts["quantize"].excluded_nodes) == 4


def test_a_corrupt_blob_or_a_partial_entry_is_a_miss_with_a_warning(runner_a, tiny_model, tmp_path):
    import boto3

    result_a, _, _ = runner_a
    client = boto3.client("s3")
    onnx_sha = entry("quantize", result_a)["files"]["model.onnx"]["sha256"]
    blob = f"{PREFIX}/blobs/sha256/{onnx_sha}"
    good = client.get_object(Bucket=MOTO_BUCKET, Key=blob)["Body"].read()
    client.put_object(Bucket=MOTO_BUCKET, Key=blob, Body=good[: len(good) // 2] + b"\0" * 8, Metadata={"sha256": onnx_sha})
    tri_key = json.loads((result_a.manifest_path.parent / "triton" / "stage.json").read_text())["key"]
    tri = f"{PREFIX}/stages/triton/{tri_key}.json"
    whole = client.get_object(Bucket=MOTO_BUCKET, Key=tri)["Body"].read()
    client.put_object(Bucket=MOTO_BUCKET, Key=tri, Body=whole[: len(whole) // 2])
    try:
        result, remote, _ = runner(tmp_path / "d", tiny_model)
    finally:
        client.put_object(Bucket=MOTO_BUCKET, Key=tri, Body=whole)  # later tests see A's entry again
    assert result.passed
    stages = result.manifest["stages"]
    assert [s for s in STAGES if not stages[s]["cache_hit"]] == ["quantize", "triton"]
    assert remote.pulled == ["export", "build", "validate"]
    warned = dict(w.split(": ", 1) for w in remote.warnings)
    assert sorted(warned) == ["quantize", "triton"]
    assert f"model.onnx: s3://{MOTO_BUCKET}/{blob}: corrupt or partial" in warned["quantize"]
    assert "treated as a miss, the stage runs here" in warned["triton"] and "JSONDecodeError" in warned["triton"]
    assert result.manifest["remote_cache"]["warnings"] == remote.warnings
    # the re-run quantize stage wrote the same bytes, so its push repaired the blob
    assert result.artifacts["quantize"].onnx_path.endswith("quantize/model.onnx")
    assert client.get_object(Bucket=MOTO_BUCKET, Key=blob)["Body"].read() == good


def stage_context(folder: Path, engine: bytes, recipe) -> tuple[StageContext, dict]:
    """A finished build stage in ``folder`` whose engine holds ``engine``; (ctx, stage.json)."""
    run_dir = folder / "artifacts" / recipe.name
    (run_dir / "build").mkdir(parents=True)
    (run_dir / "build" / "model.engine").write_bytes(engine)
    ctx = StageContext(recipe.model_copy(update={"work_dir": str(folder / "artifacts")}), folder / "r.yaml",
                       run_dir, "build", Progress(quiet=True))
    art = {"status": "ok", "reason": "", "engine_path": str(run_dir / "build" / "model.engine")}
    return ctx, {"key": "k", "artifact": art, "record": {"status": "ok"}}


def test_two_runners_pushing_one_key_at_once_both_succeed_and_the_first_writer_wins(runner_a, tmp_path):
    _, _, recipe = runner_a
    key = "0" * 64
    gate = threading.Barrier(2)
    pushes = []
    for name, engine in (("x", b"engine built by x"), ("y", b"engine built by y, not byte-equal")):
        remote = cache()
        look = remote._exists

        def exists_then_wait(key, look=look):  # both see no entry before either writes one
            found = look(key)
            if "/stages/" in key:
                gate.wait(timeout=60)
            return found

        remote._exists = exists_then_wait
        pushes.append((remote, *stage_context(tmp_path / name, engine, recipe)))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(lambda p: p[0].push(p[1], key, p[2]), pushes))
    assert sorted(outcomes) == ["present", "pushed"]
    winner = pushes[outcomes.index("pushed")]
    ctx, _ = stage_context(tmp_path / "z", b"", recipe)
    shutil.rmtree(ctx.run_dir / "build")
    got = cache().pull(ctx, key)
    assert got is not None and got["artifact"]["engine_path"] == str(ctx.run_dir / "build" / "model.engine")
    assert (ctx.run_dir / "build" / "model.engine").read_bytes() == (winner[1].run_dir / "build" / "model.engine").read_bytes()


def test_the_cache_url_comes_from_the_option_or_the_environment(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert RemoteCache.from_url(None) is None
    monkeypatch.setenv(ENV, "s3://bucket/team/cache")
    assert RemoteCache.from_url(None).url == "s3://bucket/team/cache"
    assert RemoteCache.from_url("s3://other/p").url == "s3://other/p"
    with pytest.raises(PipelineError, match=r"--cache '/tmp/cache': expected s3://bucket/prefix") as e:
        RemoteCache.from_url("/tmp/cache")
    assert e.value.exit_code == EXIT_BAD_INPUT


def test_a_bucket_that_refuses_the_upload_is_a_warned_failed_push_not_a_crash(runner_a, tmp_path):
    _, _, recipe = runner_a
    remote = RemoteCache(S3Location.parse(f"s3://no-such-bucket/{PREFIX}"))
    ctx, stage_json = stage_context(tmp_path / "x", b"an engine", recipe)
    assert remote.push(ctx, "1" * 64, stage_json) == "failed"
    assert len(remote.warnings) == 1 and "push failed" in remote.warnings[0]
    assert "the stage stays in the local cache only" in remote.warnings[0]


def test_an_entry_of_the_wrong_shape_is_a_miss_with_a_warning(runner_a, tmp_path):
    """A triton entry whose repository index is not a mapping of mappings (another runner's bad
    data) is a miss with a warning, not an internal error."""
    import boto3

    _, _, recipe = runner_a
    ctx, _ = stage_context(tmp_path / "w", b"", recipe)
    ctx = StageContext(ctx.recipe.model_copy(update={"output_dir": str(tmp_path / "w" / "repo")}), ctx.recipe_path,
                       ctx.run_dir, "triton", Progress(quiet=True))
    key = "2" * 64
    bad = {"format": FORMAT, "stage": "triton", "key": key, "artifact": {}, "record": {"status": "ok"},
           "files": {}, "models": {}, "index": {"tiny_fp8": "garbage"}}
    boto3.client("s3").put_object(Bucket=MOTO_BUCKET, Key=f"{PREFIX}/stages/triton/{key}.json",
                                  Body=json.dumps(bad).encode())
    remote = cache()
    assert remote.pull(ctx, key) is None
    assert len(remote.warnings) == 1 and "AttributeError" in remote.warnings[0]
    assert "treated as a miss, the stage runs here" in remote.warnings[0]
