"""``pipeline deploy k8s`` manifests, generated from the recipe files alone
(no build) with a fixed storage URI. There is no cluster here: validation is offline.

* Plain objects (Deployment, Service, HPA, ConfigMap, Secret, ServiceAccount): the Kubernetes
  schemas of kubernetes-validate, strict (unknown fields refused).
* InferenceService: the KServe SDK was not installed (kserve 0.21 resolves next to numpy<2 but
  pins psutil<6, a downgrade of a main dependency of this venv, and pulls ~30 packages). Instead
  it is checked against tests/data/kserve-inferenceservice-v1beta1.schema.json, a minimal
  JSON Schema written by hand for the fields we use (the CRD could not be downloaded here), and
  its PodSpec / Container parts (volumes, resources, probes, mounts) with kubernetes-validate
  as a Pod.
* LocalModelCache (``--local-model-cache``): tests/data/kserve-localmodelcache-v1alpha1.schema.json,
  written by hand from the CRD's openAPIV3Schema (its ``$comment`` says which).
* Golden files under tests/golden/deploy/ for fp8-llm (target tensorrt: GPU) and int8-encoder
  (target resolved from the recipe: onnxruntime, CPU). Regenerate: UPDATE_GOLDEN=1.
"""
from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from conftest import ROOT
from pipeline.cli import app as cli
from pipeline.errors import PipelineError
from pipeline.recipe.load import load_recipe
from pipeline.remote import k8s

K8S_VERSION = "1.33.0"
GOLDEN = ROOT / "tests" / "golden" / "deploy"
ISVC_SCHEMA = json.loads((ROOT / "tests" / "data" / "kserve-inferenceservice-v1beta1.schema.json").read_text())
CACHE_SCHEMA = json.loads((ROOT / "tests" / "data" / "kserve-localmodelcache-v1alpha1.schema.json").read_text())
KSERVE_MODEL_FIELDS = {"modelFormat", "runtime", "runtimeVersion", "protocolVersion", "storageUri"}
CASES = {"fp8-llm": "tensorrt", "int8-encoder": None}


@pytest.fixture(autouse=True)
def no_endpoint_env(monkeypatch):
    for key in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(key, raising=False)


@functools.cache
def exported_artifacts(name: str) -> dict:
    """The export and build records of ``name`` as ``manifest.json`` gives them (graph inputs and
    outputs, resolved profiles): for an LLM, the KV layout and vocabulary its architecture returns
    (:func:`kv_layout` on the model built from the GGUF's config on the meta device: no weights
    read, no build)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from dataclasses import asdict

    from pipeline.artifacts import TensorSpec
    from pipeline.sources.model import package_file
    from pipeline.models.text_generation.model import kv_layout
    from pipeline.trt.profiles import resolve_profiles

    recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml")
    if recipe.model.kind != "text-generation":
        inputs = [{"name": n, "dtype": "int64", "shape": ["batch", "sequence"]} for n in recipe.export.dynamic_axes]
        return {"export": {"inputs": inputs, "outputs": []}, "build": {"profiles": []}}
    path = package_file(recipe.model)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    with torch.device("meta"):
        layout = kv_layout(AutoModelForCausalLM.from_config(config))
    axes = recipe.export.dynamic_axes
    inputs = [{"name": n, "dtype": "int64", "shape": [axes[n][0], axes[n][1]]} for n in ("input_ids", "attention_mask")] + [
        {"name": n, "dtype": "float32", "shape": ["batch", layout.kv_heads, "past_sequence", layout.head_dim]}
        for n in layout.past_names()]
    outputs = [{"name": "logits", "dtype": "float32", "shape": ["batch", "sequence", config.vocab_size]}]
    profiles = resolve_profiles(list(recipe.build.profiles), [TensorSpec(**i) for i in inputs], set())
    return {"export": {"inputs": inputs, "outputs": outputs}, "build": {"profiles": [asdict(p) for p in profiles]}}


def generate(name: str, tmp_path: Path) -> dict[str, str]:
    """The manifests of recipe ``name`` after a build (a manifest.json with its export and build records)."""
    recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml", {"work_dir": str(tmp_path / "work")})
    run_dir = tmp_path / "work" / recipe.name
    run_dir.mkdir(parents=True)
    (run_dir / "manifest.json").write_text(json.dumps({"artifacts": exported_artifacts(name)}))
    target = k8s.resolve_target(recipe, None, CASES[name])
    out = tmp_path / "deploy"
    k8s.write_manifests(recipe, out, storage_uri=f"s3://models/trt-pipeline/{name}", target=target)
    return {p.relative_to(out).as_posix(): p.read_text() for p in sorted(out.rglob("*.yaml"))}


def validate_isvc(isvc: dict) -> None:
    """The minimal CRD schema, then the predictor's pod and container fields as a Pod."""
    jsonschema.validate(isvc, ISVC_SCHEMA)
    predictor = isvc["spec"]["predictor"]
    container = {k: v for k, v in predictor["model"].items() if k not in KSERVE_MODEL_FIELDS}
    pod_spec = {k: v for k, v in predictor.items() if k not in ("model", "minReplicas", "maxReplicas", "scaleMetric", "scaleTarget")}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "predictor"},
           "spec": {**pod_spec, "containers": [{"name": "kserve-container", "image": "kserve-runtime", **container}]}}
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", list(CASES))
def test_manifests_match_golden_files_and_validate(name, tmp_path):
    files = generate(name, tmp_path)
    assert sorted(files) == ["kserve/inferenceservice.yaml", "kserve/s3-credentials.yaml", "plain/deployment.yaml",
                             "plain/hpa.yaml", "plain/prometheus-adapter-rules.yaml", "plain/s3-credentials.yaml",
                             "plain/service.yaml"]
    for rel, text in files.items():
        golden = GOLDEN / name / rel
        if os.environ.get("UPDATE_GOLDEN"):
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(text)
        assert text == golden.read_text(), f"{rel} differs from {golden} (UPDATE_GOLDEN=1 rewrites it)"
        for obj in yaml.safe_load_all(text):
            if obj["kind"] == "InferenceService":
                validate_isvc(obj)
            else:
                kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_llm_manifests_carry_gpu_shm_probes_metrics_and_model_control(tmp_path):
    files = generate("fp8-llm", tmp_path)
    dep = yaml.safe_load(files["plain/deployment.yaml"])
    pod = dep["spec"]["template"]
    c, = pod["spec"]["containers"]
    assert c["image"] == "nvcr.io/nvidia/tritonserver:24.10-py3"  # no triton.serving: the documented default
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["args"][:4] == ["--model-repository=s3://models/trt-pipeline/fp8-llm", "--model-control-mode=explicit",
                             "--load-model=smollm2_fp8", "--load-model=smollm2_generate"]
    assert (c["readinessProbe"]["httpGet"], c["livenessProbe"]["httpGet"]) == (
        {"path": "/v2/health/ready", "port": 8000}, {"path": "/v2/health/live", "port": 8000})
    assert pod["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": "8002",
                                              "prometheus.io/path": "/metrics"}
    # KV cache: 2 x 8 sequences x 513 tokens x 30 layers x 3 KV heads x 64 x 4 B = 180.4 MiB, in and out,
    # plus last_logits 8 x 49152 x 4 B: 362.2 MiB; + 25 % = 452.8 MiB, rounded up to 512 MiB, the deploy notes' size
    assert (2 * 2 * 8 * 513 * 30 * 3 * 64 * 4 + 8 * 49152 * 4) * 1.25 / 2**20 == pytest.approx(452.8, abs=0.05)
    assert pod["spec"]["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "512Mi"}}]
    assert c["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
    isvc = yaml.safe_load(files["kserve/inferenceservice.yaml"])["spec"]["predictor"]
    assert (isvc["model"]["storageUri"], isvc["model"]["runtimeVersion"]) == ("s3://models/trt-pipeline/fp8-llm", "24.10-py3")
    assert isvc["model"]["readinessProbe"]["httpGet"]["port"] == 8080  # KServe's Triton runtime listens there
    hpa = yaml.safe_load(files["plain/hpa.yaml"])["spec"]["metrics"][0]["pods"]
    assert hpa == {"metric": {"name": "triton_queue_time_us_per_request"},
                   "target": {"type": "AverageValue", "averageValue": "100000"}}  # 10 % of ttft_ms 1000
    rules = yaml.safe_load(yaml.safe_load(files["plain/prometheus-adapter-rules.yaml"])["data"]["config.yaml"])
    assert rules["rules"][0]["name"]["as"] == "triton_queue_time_us_per_request"
    assert "prometheus-adapter must serve it" in files["plain/prometheus-adapter-rules.yaml"]


def test_encoder_manifests_run_on_cpu_and_load_the_ensemble_last(tmp_path):
    c, = yaml.safe_load(generate("int8-encoder", tmp_path)["plain/deployment.yaml"])["spec"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert [a for a in c["args"] if a.startswith("--load-model")] == [
        "--load-model=minilm_int8", "--load-model=minilm_int8_tokenizer", "--load-model=minilm_int8_ensemble"]


def test_validators_refuse_what_a_cluster_would(tmp_path):
    files = generate("int8-encoder", tmp_path)
    isvc = yaml.safe_load(files["kserve/inferenceservice.yaml"])
    misspelt = json.loads(json.dumps(isvc))
    misspelt["spec"]["predictor"]["model"]["storageURI"] = misspelt["spec"]["predictor"]["model"].pop("storageUri")
    with pytest.raises(kubernetes_validate.ValidationError, match="storageURI"):
        validate_isvc(misspelt)
    bad_uri = json.loads(json.dumps(isvc))
    bad_uri["spec"]["predictor"]["model"]["storageUri"] = "models/x"
    with pytest.raises(jsonschema.ValidationError, match="does not match"):
        validate_isvc(bad_uri)
    dep = yaml.safe_load(files["plain/deployment.yaml"])
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = [8000]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


def test_deploy_uses_the_published_entry_or_refuses(tmp_path, monkeypatch, capsys):
    import argparse

    recipe_path = tmp_path / "enc.yaml"
    data = yaml.safe_load((ROOT / "recipes" / "int8-encoder.yaml").read_text())
    data["work_dir"] = str(tmp_path / "artifacts")
    recipe_path.write_text(yaml.safe_dump(data))
    parser = argparse.ArgumentParser()
    k8s.add_deploy_arguments(parser)
    with pytest.raises(PipelineError, match="no `published` entry; publish first") as e:
        k8s.cmd_deploy(parser.parse_args(["k8s", str(recipe_path)]))
    assert "make " not in str(e.value)  # a recipe outside recipes/: the make forms would read another file
    shipped = parser.parse_args(["k8s", str(ROOT / "recipes" / "int8-encoder.yaml"), "--set", f"work_dir={tmp_path / 'w'}"])
    with pytest.raises(PipelineError, match="make publish RECIPE=int8-encoder TO=s3://...") as e:
        k8s.cmd_deploy(shipped)
    assert "(make deploy RECIPE=int8-encoder ARGS='--storage-uri s3://...')" in str(e.value)
    run_dir = tmp_path / "artifacts" / "int8-encoder"
    run_dir.mkdir(parents=True)
    published = {"to": "s3://models/p", "triton_url": "s3://minio.svc:9000/models/p", "target": "python-onnxruntime"}
    (run_dir / "manifest.json").write_text(json.dumps({"verdict": "pass", "published": [published]}))
    assert k8s.cmd_deploy(parser.parse_args(["k8s", str(recipe_path)])) == 0
    assert "is a stock Triton image, without the packages" in capsys.readouterr().out
    assert k8s.cmd_deploy(parser.parse_args(["k8s", str(recipe_path), "--image", "registry/triton-tok:1"])) == 0
    assert "stock Triton image" not in capsys.readouterr().out
    assert k8s.cmd_deploy(parser.parse_args(["k8s", str(recipe_path)])) == 0
    c, = yaml.safe_load((run_dir / "deploy" / "plain" / "deployment.yaml").read_text())["spec"]["template"]["spec"]["containers"]
    assert c["args"][0] == "--model-repository=s3://minio.svc:9000/models/p"
    secret, _account = yaml.safe_load_all((run_dir / "deploy" / "kserve" / "s3-credentials.yaml").read_text())
    assert secret["metadata"]["annotations"] == {"serving.kserve.io/s3-endpoint": "minio.svc:9000", "serving.kserve.io/s3-usehttps": "0"}
    isvc = yaml.safe_load((run_dir / "deploy" / "kserve" / "inferenceservice.yaml").read_text())
    assert isvc["spec"]["predictor"]["model"]["storageUri"] == "s3://models/p"
    assert "target python-onnxruntime (CPU)" in (run_dir / "deploy" / "plain" / "deployment.yaml").read_text()


def test_without_a_build_the_shm_is_the_base_size(tmp_path):
    """The KV geometry is the exported graph's (never config.json's): before a build there is none."""
    recipe = load_recipe(ROOT / "recipes" / "fp8-llm.yaml", {"work_dir": str(tmp_path)})
    assert k8s.shm_mib(recipe) == (k8s.BASE_SHM_MIB, f"{k8s.BASE_SHM_MIB} MiB base (no KV cache geometry)")


@pytest.mark.parametrize("name, models", [
    ("fp8-llm", ["smollm2_fp8", "smollm2_generate"]),
    ("int8-encoder", ["minilm_int8", "minilm_int8_tokenizer", "minilm_int8_ensemble"]),
    ("int8-textline-orientation", ["textline_cls_int8", "textline_cls_int8_preprocess", "textline_cls_int8_ensemble"]),
])
def test_each_kind_loads_the_models_its_adapter_serves(name, models):
    """An image classifier was given a _tokenizer/_ensemble pair it does not have."""
    assert k8s.model_names(load_recipe(ROOT / "recipes" / f"{name}.yaml")) == models


def test_a_generic_model_is_served_by_its_compute_model_alone():
    recipe = load_recipe(ROOT / "examples" / "custom-model" / "recipe.yaml")
    assert recipe.model.kind == "generic"
    assert k8s.model_names(recipe) == [recipe.triton.model_name]


def test_long_and_colliding_recipe_names_fit_kserve_child_names_and_stay_distinct():
    long = "a" * 55
    name = k8s.resource_name(long)
    assert len(name) <= k8s.NAME_MAX and len(name + k8s.KSERVE_CHILD_SUFFIX) <= 63
    assert len(f"{name}-predictor") <= 63 and name.startswith("triton-aaaa")
    base = "r" * 62
    names = {k8s.resource_name(n) for n in (base, f"{base}-canary", "My_Model", "my-model", "my_model")}
    assert len(names) == 5 and all(len(n) <= k8s.NAME_MAX for n in names)
    assert all(re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", n) for n in names)
    assert k8s.resource_name("fp8-llm") == "triton-fp8-llm"  # a name that fits is kept as it is
    assert k8s.resource_name(long) == name  # deterministic: re-applying replaces the same objects


def validate_any(obj: dict) -> None:
    if obj["kind"] == "InferenceService":
        validate_isvc(obj)
    elif obj["kind"] == "LocalModelCache":
        jsonschema.validate(obj, CACHE_SCHEMA)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_local_model_cache_variant_caches_the_same_uri_on_a_node_group_and_validates(tmp_path):
    recipe = load_recipe(ROOT / "recipes" / "fp8-llm.yaml")
    plain = k8s.manifests(recipe, storage_uri="s3://models/p", target="tensorrt")
    files = k8s.manifests(recipe, storage_uri="s3://models/p", target="tensorrt", node_group="gpu-nodes",
                          size_bytes=3_000_000_000)
    assert sorted(set(files) - set(plain)) == ["kserve-localmodelcache/inferenceservice.yaml",
                                               "kserve-localmodelcache/localmodelcache.yaml",
                                               "kserve-localmodelcache/s3-credentials.yaml"]
    for _, objects in files.values():
        for obj in yaml.safe_load_all(k8s.render("", objects)):
            validate_any(obj)
    secret, account, cache = files["kserve-localmodelcache/localmodelcache.yaml"][1]
    isvc, = files["kserve-localmodelcache/inferenceservice.yaml"][1]
    assert cache["spec"] == {"sourceModelUri": "s3://models/p", "modelSize": "3148Mi",  # 3e9 B + 10 %, in MiB
                             "nodeGroups": ["gpu-nodes"], "serviceAccountName": account["metadata"]["name"]}
    assert isvc["spec"]["predictor"]["model"]["storageUri"] == cache["spec"]["sourceModelUri"]  # KServe matches on it
    assert secret["metadata"]["namespace"] == account["metadata"]["namespace"] == k8s.KSERVE_JOB_NAMESPACE
    assert [s["name"] for s in account["secrets"]] == [secret["metadata"]["name"]]
    with pytest.raises(PipelineError, match="--local-model-cache: the size of fp8-llm's models is unknown"):
        k8s.manifests(recipe, storage_uri="s3://models/p", target="tensorrt", node_group="gpu-nodes")


def test_the_local_model_cache_schema_refuses_what_the_crd_does():
    cache = k8s.local_model_cache("enc", load_recipe(ROOT / "recipes" / "int8-encoder.yaml"), storage_uri="s3://m/p",
                                  node_group="g", size_bytes=10)
    assert cache["spec"]["modelSize"] == "1Mi"
    jsonschema.validate(cache, CACHE_SCHEMA)
    for path, value, why in ((("nodeGroups",), [], "should be non-empty|is too short"),
                             (("modelSize",), "ten gigs", "'ten gigs' does not match"),
                             (("nodeGroup",), "g", "Additional properties are not allowed")):
        bad = json.loads(json.dumps(cache))
        bad["spec"][path[0]] = value
        with pytest.raises(jsonschema.ValidationError, match=why):
            jsonschema.validate(bad, CACHE_SCHEMA)


def test_deploy_sizes_the_cache_from_the_published_entry(tmp_path):
    import argparse

    recipe_path = tmp_path / "enc.yaml"
    data = yaml.safe_load((ROOT / "recipes" / "int8-encoder.yaml").read_text())
    data["work_dir"], data["output_dir"] = str(tmp_path / "artifacts"), str(tmp_path / "repo")
    recipe_path.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "artifacts" / "int8-encoder"
    run_dir.mkdir(parents=True)
    parser = argparse.ArgumentParser()
    k8s.add_deploy_arguments(parser)
    published = {"to": "s3://models/p", "triton_url": "s3://models/p", "target": "onnxruntime"}
    (run_dir / "manifest.json").write_text(json.dumps({"verdict": "pass", "published": [published]}))
    args = parser.parse_args(["k8s", str(recipe_path), "--local-model-cache", "workers"])
    with pytest.raises(PipelineError, match="size of int8-encoder's models is unknown"):
        k8s.cmd_deploy(args)
    (run_dir / "manifest.json").write_text(json.dumps({"verdict": "pass", "published": [{**published, "bytes": 2**30}]}))
    assert k8s.cmd_deploy(args) == 0
    *_, cache = yaml.safe_load_all((run_dir / "deploy" / "kserve-localmodelcache" / "localmodelcache.yaml").read_text())
    assert cache["spec"]["modelSize"] == "1127Mi" and cache["spec"]["sourceModelUri"] == "s3://models/p"


def test_the_deploy_notes_and_the_manifests_give_one_shm_size(tmp_path):
    from pipeline.artifacts import ResolvedProfile, TensorSpec
    from pipeline.models.text_generation.triton import write_deploy_notes

    files = generate("fp8-llm", tmp_path)
    recipe = load_recipe(ROOT / "recipes" / "fp8-llm.yaml", {"work_dir": str(tmp_path / "work")})
    rec = json.loads((tmp_path / "work" / recipe.name / "manifest.json").read_text())["artifacts"]
    notes = write_deploy_notes(recipe, [TensorSpec(**s) for s in rec["export"]["inputs"]],
                               [TensorSpec(**s) for s in rec["export"]["outputs"]],
                               [ResolvedProfile(**p) for p in rec["build"]["profiles"]]).read_text()
    assert "`--shm-size=512m`" in notes and "`deploy k8s` gives its /dev/shm the same 512 MiB" in notes
    assert "sizeLimit: 512Mi" in files["plain/deployment.yaml"] and "# /dev/shm 512 MiB: 8 sequences x 513 tokens" in (
        files["plain/deployment.yaml"])


def test_deploy_flags_are_checked_and_an_old_cache_variant_goes(tmp_path, capsys):
    recipe = str(ROOT / "recipes" / "int8-encoder.yaml")
    repo = tmp_path / "repo"  # a local publish, whose bytes size the LocalModelCache
    (repo / "minilm_int8" / "1").mkdir(parents=True)
    (repo / "minilm_int8" / "1" / "model.onnx").write_bytes(b"x" * 100)
    (repo / "repository.json").write_text(json.dumps({"models": {"minilm_int8": {"recipe": "int8-encoder",
                                                                                 "files": {}}}}))
    out = tmp_path / "deploy"
    base = ["deploy", "k8s", recipe, "--storage-uri", "s3://models/p", "--set", f"output_dir={repo}", "--out", str(out)]
    assert cli.main([*base, "--local-model-cache", "gpu-nodes"]) == 0
    assert (out / "kserve-localmodelcache" / "localmodelcache.yaml").is_file()
    assert cli.main(base) == 0  # without the flag: no stale variant naming an old URI and image
    assert sorted(p.name for p in out.iterdir()) == ["kserve", "plain"]
    capsys.readouterr()
    assert cli.main([*base, "--local-model-cache", "Bad_Name!"]) == 2
    assert "--local-model-cache 'Bad_Name!': not a Kubernetes object name" in capsys.readouterr().err
    assert cli.main(["deploy", "k8s", recipe, "--storage-uri", "notauri"]) == 2
    assert "error: --storage-uri 'notauri': expected s3://bucket/prefix" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert cli.main([*base[:-1], str(tmp_path / "file" / "d")]) == 2
    assert f"--out {tmp_path / 'file' / 'd'}: cannot be written ({tmp_path / 'file'} is a file" in capsys.readouterr().err


def test_deploy_out_with_a_tilde_writes_into_the_home_folder(tmp_path, monkeypatch, capsys):
    """``--out ~/deploy`` made a literal ``./~/deploy`` folder."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    recipe = str(ROOT / "recipes" / "int8-encoder.yaml")
    assert cli.main(["deploy", "k8s", recipe, "--storage-uri", "s3://models/p", "--set",
                     f"output_dir={tmp_path / 'repo'}", "--out", "~/deploy"]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "home" / "deploy").iterdir()) == ["kserve", "plain"]
    assert not (tmp_path / "~").exists()


def test_deploy_refuses_an_out_in_the_repository_a_wrong_target_a_bad_image_and_huge_replicas(tmp_path, capsys):
    """Each was written with exit 0 (manifests inside the model repository, a GPU and
    target tensorrt for an ONNX-only repository, an image no runtime pulls, 2**31 replicas)."""
    recipe = str(ROOT / "recipes" / "int8-encoder.yaml")
    repo, work = tmp_path / "repo", tmp_path / "work"
    (repo / "minilm_int8" / "1").mkdir(parents=True)
    (repo / "repository.json").write_text(json.dumps({"models": {"minilm_int8": {
        "recipe": "int8-encoder", "files": {}, "target": "onnxruntime"}}}))
    base = ["deploy", "k8s", recipe, "--set", f"output_dir={repo}", "--set", f"work_dir={work}"]
    uri = ["--storage-uri", "s3://models/p"]
    refused = {
        ("--out", str(repo / "deploy")): f"--out {repo / 'deploy'}: it is inside the model repository {repo}",
        ("--out", str(repo)): f"--out {repo}: it is inside the model repository {repo}",
        ("--out", str(work / "int8-encoder" / "serve_repository" / "x")): "it is inside the model repository",
        ("--target", "tensorrt"): "--target tensorrt: the repository at s3://models/p serves its compute model as an "
                                  "ONNX graph with ONNX Runtime (onnxruntime_onnx; no engine), target 'onnxruntime' "
                                  f"({repo / 'repository.json'}); valid: onnxruntime",
        ("--image", "bad image"): "--image 'bad image': not an image reference; valid: [registry[:port]/]name[:tag]",
        ("--image", "Triton:24.10"): "--image 'Triton:24.10': not an image reference",
        ("--max-replicas", "2147483648"): f"--max-replicas 2147483648: valid: 1 to {k8s.MAX_REPLICAS}",
        ("--max-replicas", "1000000"): f"--max-replicas 1000000: valid: 1 to {k8s.MAX_REPLICAS}",
        ("--max-replicas", "0"): "--max-replicas 0: valid: 1 to",
    }
    for flag, message in refused.items():
        capsys.readouterr()
        assert cli.main([*base, *uri, *flag]) == 2, flag
        assert message in capsys.readouterr().err, flag
    assert not (repo / "deploy").exists() and not (work / "int8-encoder" / "deploy").exists()
    ok = ["--image", "registry.local:5000/team/triton-tok:24.10@sha256:" + "a" * 64, "--max-replicas", str(k8s.MAX_REPLICAS)]
    assert cli.main([*base, *uri, *ok]) == 0
    assert "target onnxruntime (CPU)" in (work / "int8-encoder" / "deploy" / "plain" / "deployment.yaml").read_text()
    # the published entry's target rules where deploy reads it
    (work / "int8-encoder" / "manifest.json").write_text(json.dumps({"verdict": "pass", "published": [
        {"to": "s3://models/q", "triton_url": "s3://models/q", "target": "tensorrt"}]}))
    assert cli.main([*base, "--target", "onnxruntime"]) == 2
    assert "--target onnxruntime: the repository at s3://models/q serves its compute model as a TensorRT engine" in (
        capsys.readouterr().err)
    assert cli.main([*base, "--target", "tensorrt"]) == 0


def test_a_serving_pin_that_fits_the_target_sets_the_cpu_request_and_one_that_does_not_is_named(tmp_path):
    from pipeline.triton import pin

    recipe = load_recipe(ROOT / "recipes" / "int8-encoder.yaml", {"work_dir": str(tmp_path / "work"),
                                                                  "output_dir": str(tmp_path / "repo"),
                                                                  "serve": {"cpu_cores": 4}})
    recipe_path = tmp_path / "int8-encoder.yaml"
    chosen = {"minilm_int8": {"role": "compute", "instance_count": 2, "max_batch_size": 32,
                              "dynamic_batching": None, "intra_op_threads": 2}}
    for runtime, fits in (("onnxruntime_onnx", True), ("python-onnxruntime", False)):
        fields = {"hardware": "cpu:4", "graphs": {"minilm_int8": "a" * 64}, "runtimes": {"minilm_int8": runtime}}
        pin.write(pin.pin_path(recipe_path, recipe.name), fields, chosen, [], "2 instances", {})
        files = k8s.manifests(recipe, storage_uri="s3://models/x", target="onnxruntime", recipe_path=recipe_path)
        header, (isvc,) = files["kserve/inferenceservice.yaml"]
        cpu = isvc["spec"]["predictor"]["model"]["resources"]["requests"]["cpu"]
        if fits:
            assert cpu == "4" and "minilm_int8: 2 instances" in header
        else:
            assert cpu == "2" and "measured on python-onnxruntime, deployed as onnxruntime_onnx" in header
