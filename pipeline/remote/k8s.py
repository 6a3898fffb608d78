"""Kubernetes manifests that serve a recipe's published models with Triton.

    python -m pipeline deploy k8s RECIPE [--storage-uri s3://bucket/prefix] [--target T] [--image IMG]
                                         [--local-model-cache NODE_GROUP]

Writes two alternatives into ``<work_dir>/<recipe>/deploy/`` (apply one of them), and with
``--local-model-cache NODE_GROUP`` a third:

* ``kserve/``: ``s3-credentials.yaml`` (Secret + ServiceAccount) and
  ``inferenceservice.yaml``, a KServe ``InferenceService`` with the Triton
  model format; KServe's storage initializer copies ``storageUri`` to
  ``/mnt/models`` and its Triton runtime serves it (HTTP on 8080).
* ``plain/``: ``s3-credentials.yaml``, ``deployment.yaml`` (tritonserver reading
  the ``s3://`` repository itself), ``service.yaml`` (8000 HTTP, 8001 gRPC, 8002
  metrics), ``hpa.yaml`` (autoscaling/v2 on the average queue time per request)
  and ``prometheus-adapter-rules.yaml``: that HPA metric is not built into
  Kubernetes; prometheus-adapter makes it from Triton's
  ``nv_inference_queue_duration_us`` and ``nv_inference_request_success``
  counters, with the rule in that file (merge it into the adapter's rules).
* ``kserve-localmodelcache/``: the ``kserve/`` InferenceService plus a KServe
  ``LocalModelCache`` (serving.kserve.io/v1alpha1, cluster-scoped) whose
  ``sourceModelUri`` is the same ``storageUri``: KServe downloads the repository once
  onto the nodes of ``NODE_GROUP`` (a ``LocalModelNodeGroup`` the cluster admin made) and
  InferenceServices with that exact URI start from the node-local copy instead of S3.
  ``modelSize`` is the published bytes (or the local repository's) + 10 %. The download
  job reads the S3 credentials through ``serviceAccountName``, which must live in KServe's
  download job namespace (``localModel.jobNamespace``, default
  :data:`KSERVE_JOB_NAMESPACE`): ``localmodelcache.yaml`` carries a Secret and
  ServiceAccount there.

No cluster is needed to write them (and there is none here): the tests
validate the plain objects against the Kubernetes schemas (kubernetes-validate)
and the InferenceService and LocalModelCache against minimal schemas of their CRDs.

Inputs, in order of precedence:

* storage: ``--storage-uri``, else the last ``published`` entry of
  ``<work_dir>/<recipe>/manifest.json`` (``python -m pipeline publish``).
* target (compute model runtime): ``--target``, else ``triton.target`` when not
  ``auto``, else the repository's target (:func:`repository_target`: the published
  entry's, or with a ``--storage-uri`` that no entry names the local repository's), else
  ``tensorrt`` when the recipe declares ``triton.serving`` (an engine for a GPU) and
  ``onnxruntime`` otherwise. ``tensorrt`` requests one ``nvidia.com/gpu``. A ``--target``
  other than the repository's known one is refused (exit 2): ``tensorrt`` for an ONNX-only
  repository requested a GPU and a runtime that has no engine to load.
* ``--max-replicas``: 1 to :data:`MAX_REPLICAS`; ``--image``: an image reference
  (:func:`image_problem`); ``--out``: not inside the recipe's model repository
  (:func:`out_problem`). Each is exit 2 before anything is written.
* image: ``--image``, else ``triton.serving.container``
  (``nvcr.io/nvidia/tritonserver:<tag>``), else a container whose TensorRT equals
  ``triton.serving.tensorrt``, else :data:`DEFAULT_RELEASE` (24.10, Triton 2.51.0:
  the release of the tritonserver in the pytriton wheel these repositories are
  tested with). The python-backend models (LLM generation, encoder tokenizer,
  ``python-onnxruntime``) import ``tokenizers`` (and ``onnxruntime``), which the
  stock image lacks: build a derived image (``FROM <image>`` + ``pip install``)
  and pass it with ``--image``.
* ``/dev/shm`` (an emptyDir in memory; Docker's ``--shm-size``): for an LLM, every
  decode step of a request moves its KV cache through the python backend's
  shared memory, in and out. The size is the deploy notes' own
  (:func:`pipeline.models.text_generation.triton.shm_size` of the last build's
  exported graph and profiles, from its ``manifest.json``); 256 MiB for a graph
  without a KV cache, or before a build.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from pipeline.errors import PipelineError
from pipeline.fsutil import folder_problem, user_path
from pipeline.run.report import last_manifest
from pipeline.targets import DEFAULT_RELEASE  # Triton 2.51.0, the pytriton wheel's tritonserver
from pipeline.recipe.kinds import KV_PAST_RE
from pipeline.recipe.kinds import facts as kind_facts

BASE_SHM_MIB = 256
HTTP, GRPC, METRICS = 8000, 8001, 8002
KSERVE_HTTP = 8080  # KServe's Triton runtime starts tritonserver with --http-port=8080
QUEUE_METRIC = "triton_queue_time_us_per_request"
KSERVE_JOB_NAMESPACE = "kserve-localmodel-jobs"  # KServe's default localModel.jobNamespace
CACHE_HEADROOM = 1.10  # modelSize over the repository's bytes


#: KServe names an InferenceService's predictor ``<name>-predictor`` (kserve/kserve PR #4208,
#: ``PredictorServiceName``); in serverless mode Knative names its revision ``<that>-00001``
#: and the revision's Service ``<revision>-private`` (knative/serving issue #3236). Each is a
#: DNS-1035 label, at most 63 characters, so the InferenceService name may have 63 - 24.
KSERVE_CHILD_SUFFIX = "-predictor-00001-private"
LABEL_MAX = 63
NAME_MAX = LABEL_MAX - len(KSERVE_CHILD_SUFFIX)  # 39
_HASH_CHARS = 8


def dns_name(text: str, limit: int = LABEL_MAX) -> str:
    """``text`` as a DNS-1123 label of at most ``limit`` characters. Unchanged where it is
    one already; else lower case, ``-`` for other characters, cut to fit, and ended with
    ``-`` + the first 8 hex digits of sha256(``text``), so two texts that the cut or the
    lower-casing would merge (``name`` and ``name-canary`` cut to one prefix, ``A_b``
    and ``a-b``) keep different names."""
    if re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", text) and len(text) <= limit:
        return text
    import hashlib

    digest = hashlib.sha256(text.encode()).hexdigest()[:_HASH_CHARS]
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    head = name[:limit - _HASH_CHARS - 1].rstrip("-")
    return f"{head}-{digest}" if head else f"t{digest}"


def resource_name(recipe_name: str) -> str:
    """The InferenceService / Deployment / Service / HPA name of a recipe:
    ``triton-<recipe name>`` as a label short enough for KServe's child names
    (:data:`NAME_MAX`; :func:`dns_name`). The domain KServe derives in raw mode,
    ``<name>-predictor-<namespace>``, also counts the namespace: keep both short."""
    return dns_name(f"triton-{recipe_name}", NAME_MAX)


def resolve_image(recipe, image: str | None = None) -> str:
    """The Triton image for ``recipe`` (see the module docstring)."""
    from pipeline import targets as serving_targets

    if image:
        return image
    declared = recipe.triton.serving
    if declared is not None and declared.container:
        return serving_targets.container_image(declared.container)
    if declared is not None and declared.tensorrt and serving_targets.containers_with(declared.tensorrt):
        return serving_targets.container_image(serving_targets.containers_with(declared.tensorrt)[0])
    return serving_targets.container_image(DEFAULT_RELEASE)


def resolve_target(recipe, published: dict | None, target: str | None = None) -> str:
    """The compute model's runtime (see the module docstring)."""
    if target:
        return target
    if recipe.triton.target != "auto":
        return recipe.triton.target
    if published and published.get("target"):
        return published["target"]
    return "tensorrt" if recipe.triton.serving is not None else "onnxruntime"


def last_published(run_dir: Path) -> dict | None:
    """The last ``published`` entry of ``run_dir/manifest.json``, or None."""
    entries = last_manifest(run_dir).get("published") or []
    return entries[-1] if entries else None


def shm_mib(recipe) -> tuple[int, str]:
    """``/dev/shm`` size in MiB and how it was sized (a comment for the manifests): for a graph
    with a KV cache, :func:`pipeline.models.text_generation.triton.shm_size` of the last build
    (its ``manifest.json``: the exported graph's inputs and outputs, the resolved profiles), the
    number its deploy notes give; else :data:`BASE_SHM_MIB`.

    Raises:
        TritonConfigError: the last build's KV cache inputs are incomplete.
    """
    from pipeline.artifacts import ResolvedProfile, TensorSpec
    from pipeline.models.text_generation import triton

    try:
        man = last_manifest(Path(recipe.work_dir) / recipe.name)
        export = man["artifacts"]["export"]
        inputs = [TensorSpec(**spec) for spec in export["inputs"]]
        outputs = [TensorSpec(**spec) for spec in export["outputs"]]
        profiles = [ResolvedProfile(**p) for p in man["artifacts"]["build"]["profiles"]]
    except (KeyError, TypeError):
        inputs = []
    if not any(KV_PAST_RE.match(spec.name) for spec in inputs):
        return BASE_SHM_MIB, f"{BASE_SHM_MIB} MiB base (no KV cache geometry)"
    size = triton.shm_size(recipe, inputs, outputs, profiles)
    return size.mib, size.how()


def model_names(recipe) -> list[str]:
    """The recipe's Triton models, the front model (generation / ensemble) last: the compute
    model, then those its kind's adapter serves (:meth:`ModelAdapter.served_models`)."""
    from pipeline.models import registry

    return [recipe.triton.model_name, *registry.adapter(recipe.model).served_models(recipe)]


def queue_target_us(recipe) -> int:
    """HPA target: average queue time per request, 10 % of the recipe's latency SLO
    (LLM: TTFT), in microseconds."""
    slo = recipe.serve.slo
    budget_ms = slo.ttft_ms if kind_facts(recipe.model.kind).generates else slo.latency_ms
    return int(budget_ms * 1000 * 0.1)


# --- objects -----------------------------------------------------------------------------------------


def _labels(name: str, recipe) -> dict[str, str]:
    return {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "trt-pipeline",
            "trt-pipeline/recipe": dns_name(recipe.name)}


def _scrape_annotations() -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS), "prometheus.io/path": "/metrics"}


def deploy_pin(recipe, recipe_path: str | Path | None, target: str) -> tuple[dict | None, str]:
    """The serving pin (:mod:`pipeline.triton.pin`) that fits the deployment: its hardware class is
    the recipe's declared one, its compute runtime the deployed ``target``'s, and its graph the local
    repository's (``repository.json``'s hash of the compute model's graph file, where that is known).
    Returns (the pin, a line for the manifests' header) or (None, why it is not used).

    Raises:
        RecipeError: (exit 2) the pin file is not a valid serving pin.
    """
    from pipeline.triton import pin

    if recipe_path is None:
        return None, ""
    path = pin.pin_path(recipe_path, recipe.name)
    if not path.is_file():
        return None, f"serving pin: none ({pin.tune_command(recipe_path)} writes {path.name})"
    data = pin.read(path, pin.tune_command(recipe_path))
    match, model = data["match"], recipe.triton.model_name
    why = []
    if match["hardware"] != (pin.hardware_class(recipe) or "undeclared"):
        why.append(f"hardware class {match['hardware']!r}, the recipe declares {pin.hardware_class(recipe)!r}")
    if match["runtimes"].get(model) != pin.RUNTIME_NAMES.get(target):
        why.append(f"measured on {match['runtimes'].get(model)}, deployed as {pin.RUNTIME_NAMES.get(target)}")
    index = Path(recipe.output_dir) / "repository.json"
    files = (json.loads(index.read_text()).get("models", {}).get(model, {}).get("files", {})
             if index.is_file() else {})
    graph = next((h for rel, h in files.items() if rel.endswith(("/model.onnx", "/model.plan"))), None)
    if graph is not None and match["graphs"].get(model) != graph:
        why.append(f"tuned on graph {str(match['graphs'].get(model))[:12]}, the repository's is {graph[:12]}")
    if why:
        return None, f"serving pin {path.name} not used: " + "; ".join(why)
    counts = ", ".join(f"{m}: {c.get('instance_count')} instances" for m, c in data["chosen"].items())
    return data, f"serving pin {path.name}: {counts} (in the published configs); {data.get('summary', '')}"


def pinned_cpus(data: dict | None, recipe) -> str:
    """The CPU request: the cores the pinned config was measured for (``cpu:N``) when a pin fits,
    at least the instances x threads it runs; else 2."""
    if data is None:
        return "2"
    used = sum(int(c.get("instance_count") or 1) * int(c.get("intra_op_threads") or 0) for c in data["chosen"].values())
    hardware = data["match"]["hardware"]
    declared = int(hardware.split(":", 1)[1]) if hardware.startswith("cpu:") and hardware[4:].isdigit() else 0
    return str(max(declared, used, 1))


def _resources(gpu: bool, cpus: str = "2") -> dict:
    res: dict[str, dict] = {"requests": {"cpu": cpus, "memory": "4Gi"}, "limits": {"memory": "8Gi"}}
    if gpu:
        res["requests"]["nvidia.com/gpu"] = 1
        res["limits"]["nvidia.com/gpu"] = 1
    return res


def _probes(port: int) -> dict:
    """Readiness / liveness on Triton's health endpoints; a startup probe gives model loading 10 minutes."""
    def probe(path: str, **extra) -> dict:
        return {"httpGet": {"path": path, "port": port}, "periodSeconds": 10, **extra}

    return {"startupProbe": probe("/v2/health/live", failureThreshold=60),
            "readinessProbe": probe("/v2/health/ready", failureThreshold=3),
            "livenessProbe": probe("/v2/health/live", failureThreshold=3)}


def _shm_volume(mib: int) -> tuple[dict, dict]:
    return ({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{mib}Mi"}},
            {"name": "dshm", "mountPath": "/dev/shm"})


def _s3_env(secret: str) -> list[dict]:
    return [{"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": k}}}
            for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")]


def credentials(name: str, recipe, endpoint: str | None, namespace: str | None = None) -> list[dict]:
    """Secret (placeholders: fill in before applying) + ServiceAccount KServe's storage
    initializer reads it through (endpoint annotations when the store is not AWS); in
    ``namespace`` where given, else the one they are applied to."""
    annotations = {}
    if endpoint:
        scheme, _, host = endpoint.partition("://")
        annotations = {"serving.kserve.io/s3-endpoint": host, "serving.kserve.io/s3-usehttps": "1" if scheme == "https" else "0"}
    secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
              "metadata": {"name": f"{name}-s3", "labels": _labels(name, recipe), "annotations": annotations},
              "stringData": {"AWS_ACCESS_KEY_ID": "REPLACE-ME", "AWS_SECRET_ACCESS_KEY": "REPLACE-ME",
                             "AWS_DEFAULT_REGION": "us-east-1"}}
    account = {"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": {"name": f"{name}-s3", "labels": _labels(name, recipe)}, "secrets": [{"name": f"{name}-s3"}]}
    if namespace:
        for obj in (secret, account):
            obj["metadata"]["namespace"] = namespace
    return [secret, account]


def local_model_cache(name: str, recipe, *, storage_uri: str, node_group: str, size_bytes: int) -> dict:
    """KServe ``LocalModelCache`` (serving.kserve.io/v1alpha1): ``storage_uri`` cached on the
    nodes of ``node_group``, ``modelSize`` = ``size_bytes`` + 10 % in MiB (at least 1Mi)."""
    mib = max(1, math.ceil(size_bytes * CACHE_HEADROOM / 2**20))
    return {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelCache",
            "metadata": {"name": name, "labels": _labels(name, recipe)},
            "spec": {"sourceModelUri": storage_uri, "modelSize": f"{mib}Mi", "nodeGroups": [node_group],
                     "serviceAccountName": f"{name}-s3"}}


def repository_bytes(recipe, published: dict | None) -> int | None:
    """Bytes of the recipe's models: the published entry's ``bytes``, else the local
    repository's (``output_dir``, this recipe's models in ``repository.json``); None if neither."""
    if published and published.get("bytes"):
        return int(published["bytes"])
    from pipeline.triton.publish import published_models

    repo = Path(recipe.output_dir)
    models = published_models(repo, recipe.name) if repo.is_dir() else []
    files = [p for m in models for p in (repo / m).rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) if files else None


def gpu_affinity(recipe, gpu: bool) -> dict:
    """``{"affinity": ...}`` requiring a node whose ``nvidia.com/gpu.product`` is one of
    ``triton.serving.gpus`` (GPU feature discovery's values, :func:`pipeline.targets.datacenter_sku`), for a
    GPU runtime of a recipe that lists them; else ``{}``. The repository holds one engine per listed
    compute capability (``cc_model_filenames``): on another GPU Triton falls back to
    ``default_model_filename``, an engine of another architecture, and fails to deserialize it.

    Raises:
        PipelineError: a listed GPU without a known ``nvidia.com/gpu.product`` value (exit 2).
    """
    from pipeline import targets as serving_targets

    serving = recipe.triton.serving
    if not gpu or serving is None or not serving.gpus:
        return {}
    try:
        products = [serving_targets.datacenter_sku(g).product for g in serving.gpus]
    except ValueError as e:
        raise PipelineError(f"triton.serving.gpus: {e}") from None
    term = {"matchExpressions": [{"key": serving_targets.GPU_PRODUCT_LABEL, "operator": "In", "values": products}]}
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [term]}}}}


def inference_service(name: str, recipe, *, storage_uri: str, image: str, gpu: bool, shm: int,
                      max_replicas: int, cpus: str = "2") -> dict:
    """KServe ``InferenceService`` (serving.kserve.io/v1beta1), Triton model format."""
    volume, mount = _shm_volume(shm)
    container = {
        "modelFormat": {"name": "triton"}, "protocolVersion": "v2",
        "runtimeVersion": image.rsplit(":", 1)[-1], "storageUri": storage_uri,
        "args": ["--model-control-mode=explicit", *(f"--load-model={m}" for m in model_names(recipe))],
        "resources": _resources(gpu, cpus), "volumeMounts": [mount], **_probes(KSERVE_HTTP),
    }
    annotations = {"serving.kserve.io/enable-prometheus-scraping": "true", **_scrape_annotations()}
    return {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
            "metadata": {"name": name, "labels": _labels(name, recipe), "annotations": annotations},
            "spec": {"predictor": {"serviceAccountName": f"{name}-s3", "minReplicas": 1, "maxReplicas": max_replicas,
                                   "volumes": [volume], "model": container, **gpu_affinity(recipe, gpu)}}}


def deployment(name: str, recipe, *, repository: str, image: str, gpu: bool, shm: int, cpus: str = "2") -> dict:
    """apps/v1 Deployment: tritonserver on the ``s3://`` repository, explicit model control."""
    volume, mount = _shm_volume(shm)
    args = [f"--model-repository={repository}", "--model-control-mode=explicit",
            *(f"--load-model={m}" for m in model_names(recipe)),
            f"--http-port={HTTP}", f"--grpc-port={GRPC}", f"--metrics-port={METRICS}"]
    container = {"name": "tritonserver", "image": image, "command": ["tritonserver"], "args": args,
                 "ports": [{"name": "http", "containerPort": HTTP}, {"name": "grpc", "containerPort": GRPC},
                           {"name": "metrics", "containerPort": METRICS}],
                 "env": _s3_env(f"{name}-s3"), "resources": _resources(gpu, cpus), "volumeMounts": [mount],
                 **_probes(HTTP)}
    labels = _labels(name, recipe)
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
                     "template": {"metadata": {"labels": labels, "annotations": _scrape_annotations()},
                                  "spec": {"containers": [container], "volumes": [volume],
                                           **gpu_affinity(recipe, gpu)}}}}


def service(name: str, recipe) -> dict:
    """v1 Service on the Deployment's HTTP, gRPC and metrics ports."""
    ports = [{"name": n, "port": p, "targetPort": n} for n, p in (("http", HTTP), ("grpc", GRPC), ("metrics", METRICS))]
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "labels": _labels(name, recipe), "annotations": _scrape_annotations()},
            "spec": {"selector": {"app.kubernetes.io/name": name}, "ports": ports}}


def hpa(name: str, recipe, *, max_replicas: int) -> dict:
    """autoscaling/v2 HPA on :data:`QUEUE_METRIC` (a Pods metric from prometheus-adapter)."""
    metric = {"type": "Pods", "pods": {"metric": {"name": QUEUE_METRIC},
                                       "target": {"type": "AverageValue", "averageValue": str(queue_target_us(recipe))}}}
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": name, "labels": _labels(name, recipe)},
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                     "minReplicas": 1, "maxReplicas": max_replicas, "metrics": [metric]}}


def adapter_rules(name: str, recipe) -> dict:
    """ConfigMap with the prometheus-adapter rule behind :data:`QUEUE_METRIC`: per pod,
    rate(queue time) / rate(successful requests) of the compute model, over 1 minute."""
    match = f'model="{recipe.triton.model_name}"'
    rule = {
        "seriesQuery": f'nv_inference_queue_duration_us{{namespace!="",pod!="",{match}}}',
        "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
        "name": {"matches": "^nv_inference_queue_duration_us$", "as": QUEUE_METRIC},
        "metricsQuery": (f"sum(rate(nv_inference_queue_duration_us{{<<.LabelMatchers>>,{match}}}[1m])) by (<<.GroupBy>>)"
                         f" / clamp_min(sum(rate(nv_inference_request_success{{<<.LabelMatchers>>,{match}}}[1m]))"
                         " by (<<.GroupBy>>), 1e-9)"),
    }
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"{name}-prometheus-adapter-rules", "labels": _labels(name, recipe)},
            "data": {"config.yaml": yaml.safe_dump({"rules": [rule]}, sort_keys=False, width=1000)}}


# --- files -------------------------------------------------------------------------------------------


def manifests(recipe, *, storage_uri: str, target: str, image: str | None = None, max_replicas: int = 4,
              node_group: str | None = None, size_bytes: int | None = None,
              recipe_path: str | Path | None = None) -> dict[str, tuple[str, list[dict]]]:
    """relative file name -> (header comment, objects) for both alternatives, and with
    ``node_group`` the LocalModelCache one (``size_bytes``: the repository's bytes). With
    ``recipe_path``, a serving pin that fits the deployment (:func:`deploy_pin`) sets the CPU
    request and the header names its instance counts; one that does not is named there.

    Raises:
        PipelineError: ``storage_uri`` is not an s3:// URL; ``node_group`` without ``size_bytes``.
    """
    from pipeline.remote.s3 import S3Location

    loc = S3Location.parse(storage_uri, "--storage-uri")
    name = resource_name(recipe.name)
    img, gpu = resolve_image(recipe, image), target == "tensorrt"
    shm, shm_why = shm_mib(recipe)
    pinned, pin_line = deploy_pin(recipe, recipe_path, target)
    cpus = pinned_cpus(pinned, recipe)
    about = (f"recipe {recipe.name}, target {target} ({'1 GPU' if gpu else 'CPU'}), image {img}\n"
             f"models (explicit model control, front model last): {', '.join(model_names(recipe))}\n"
             f"/dev/shm {shm} MiB: {shm_why}\n" + (f"{pin_line}; CPU request {cpus}\n" if recipe_path else "") +
             "python-backend models need `tokenizers` (and `onnxruntime`) in the image: see pipeline/remote/k8s.py")
    creds = credentials(name, recipe, loc.endpoint)
    creds_note = "S3 credentials: replace the REPLACE-ME values (or create the Secret yourself) before applying"
    adapter_note = (f"The HPA in hpa.yaml scales on {QUEUE_METRIC}, a custom metric Kubernetes does not have:\n"
                    "prometheus-adapter must serve it. Merge this rule into the adapter's configuration\n"
                    "(helm chart value rules.custom, or its config.yaml) and restart the adapter.")
    isvc = inference_service(name, recipe, storage_uri=loc.url, image=img, gpu=gpu, shm=shm, max_replicas=max_replicas,
                             cpus=cpus)
    files = {
        "kserve/s3-credentials.yaml": (creds_note, creds),
        "kserve/inferenceservice.yaml": (about, [isvc]),
        "plain/s3-credentials.yaml": (creds_note, creds),
        "plain/deployment.yaml": (about, [deployment(name, recipe, repository=loc.triton_url if loc.endpoint else loc.url,
                                                     image=img, gpu=gpu, shm=shm, cpus=cpus)]),
        "plain/service.yaml": ("HTTP 8000, gRPC 8001, metrics 8002 (Prometheus scrapes /metrics)", [service(name, recipe)]),
        "plain/hpa.yaml": (f"scales on {QUEUE_METRIC} (average queue time per request, µs; target "
                           f"{queue_target_us(recipe)} = 10 % of the recipe's latency SLO): needs "
                           "prometheus-adapter with the rule in prometheus-adapter-rules.yaml",
                           [hpa(name, recipe, max_replicas=max_replicas)]),
        "plain/prometheus-adapter-rules.yaml": (adapter_note, [adapter_rules(name, recipe)]),
    }
    if node_group is not None:
        files.update(_cached_variant(name, recipe, loc, node_group, size_bytes, about, isvc, creds))
    return files


def _cached_variant(name: str, recipe, loc, node_group: str, size_bytes: int | None, about: str, isvc: dict,
                    creds: list[dict]) -> dict[str, tuple[str, list[dict]]]:
    """``kserve-localmodelcache/``: the InferenceService, its credentials, and the
    LocalModelCache with the download job's credentials in :data:`KSERVE_JOB_NAMESPACE`."""
    if not size_bytes:
        raise PipelineError(f"--local-model-cache: the size of {recipe.name}'s models is unknown (no `bytes` in the "
                            f"published entry and no local repository in {recipe.output_dir}); publish first")
    cache = local_model_cache(name, recipe, storage_uri=loc.url, node_group=node_group, size_bytes=size_bytes)
    note = (f"KServe LocalModelCache: {loc.url} cached on the nodes of LocalModelNodeGroup {node_group!r}; the\n"
            f"InferenceService (same storageUri) starts from that copy. The download job reads S3 through\n"
            f"ServiceAccount {name}-s3 in namespace {KSERVE_JOB_NAMESPACE} (KServe's localModel.jobNamespace):\n"
            "replace the REPLACE-ME values. Needs localModel.enabled in KServe's inferenceservice-config.")
    job_creds = credentials(name, recipe, loc.endpoint, namespace=KSERVE_JOB_NAMESPACE)
    return {"kserve-localmodelcache/s3-credentials.yaml": ("S3 credentials of the InferenceService: replace the "
                                                           "REPLACE-ME values before applying", creds),
            "kserve-localmodelcache/localmodelcache.yaml": (note, [*job_creds, cache]),
            "kserve-localmodelcache/inferenceservice.yaml": (about, [isvc])}


class _Dumper(yaml.SafeDumper):
    """No anchors / aliases (kubectl reads them, people do not); multi-line strings as ``|`` blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def render(comment: str, objects: list[dict]) -> str:
    """YAML documents with a ``#`` comment header (keys in the order written)."""
    head = "".join(f"# {line}\n" if line else "#\n" for line in comment.splitlines())
    return head + "---\n".join(yaml.dump(o, Dumper=_Dumper, sort_keys=False, width=1000) for o in objects)


#: the largest ``--max-replicas``. Kubernetes takes any int32 (2147483647) and KServe any int, but
#: one Deployment of 1000 Triton pods (each with a GPU for the ``tensorrt`` target) is already far
#: beyond a cluster of Kubernetes' tested scale (5000 nodes); a larger number is a typo, and an
#: HPA allowed to reach it turns one queue-time spike into a cluster's worth of pending pods.
MAX_REPLICAS = 1000

#: an image reference as Docker and containerd parse it (github.com/distribution/reference):
#: ``[host[:port]/]path[:tag][@algorithm:hex]``, the path in lower case
_ALNUM, _SEP = r"[a-z0-9]+", r"(?:[._]|__|-+)"
_PATH = rf"{_ALNUM}(?:{_SEP}{_ALNUM})*"
_HOST_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_IMAGE_REF = re.compile(
    rf"(?:(?:{_HOST_PART}(?:\.{_HOST_PART})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?/)?"  # registry
    rf"(?P<name>{_PATH}(?:/{_PATH})*)"
    r"(?::[\w][\w.-]{0,127})?"  # tag
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?",  # digest
    re.ASCII)


def image_problem(image: str) -> str | None:
    """Why ``image`` is not an image reference a container runtime pulls, or None."""
    match = _IMAGE_REF.fullmatch(image)
    if match is None:
        return "not an image reference"
    if len(match.group("name")) > 255:
        return "its repository name is longer than 255 characters"
    return None


def repository_target(recipe, published: dict | None, storage_uri: str | None) -> tuple[str, str] | None:
    """The runtime of the compute model in the repository that is deployed, and where that
    was read: the published entry's ``target`` (the entry of ``storage_uri`` where given, else
    the last one), else, with ``storage_uri`` naming no entry, the local repository's
    (``output_dir``'s ``repository.json`` entry of the recipe's compute model: what
    ``publish`` would upload); None when neither says."""
    from pipeline.triton.publish import read_index

    entries = last_manifest(Path(recipe.work_dir) / recipe.name).get("published") or []
    if storage_uri:
        named = [e for e in entries if isinstance(e, dict) and storage_uri.rstrip("/") in
                 (str(e.get("to", "")).rstrip("/"), str(e.get("triton_url", "")).rstrip("/"))]
        published = named[-1] if named else None
    if published and published.get("target"):
        return str(published["target"]), f"the published entry of {published.get('to')} in manifest.json"
    if storage_uri and published is None:
        repo = Path(recipe.output_dir)
        try:
            entry = read_index(repo).get(recipe.triton.model_name) if (repo / "repository.json").is_file() else None
        except PipelineError:
            return None
        if entry and entry.get("recipe") == recipe.name and entry.get("target"):
            return str(entry["target"]), f"{repo / 'repository.json'}"
    return None


def out_problem(recipe, out: Path) -> str | None:
    """Why ``out`` cannot take the manifests: it is, or is inside, a model repository of the
    recipe (``output_dir``, or the serve copy ``<work_dir>/<recipe>/serve_repository``), where
    Triton would take its folders for models and ``verify-repo`` fail on them."""
    target = out.resolve()
    for repo in (Path(recipe.output_dir), Path(recipe.work_dir) / recipe.name / "serve_repository"):
        if target == repo.resolve() or repo.resolve() in target.parents:
            return (f"it is inside the model repository {repo} (Triton would read its folders as models and "
                    "verify-repo would fail on them); valid: a folder outside it")
    return None


#: the folders :func:`manifests` writes under ``out_dir``
VARIANTS = ("kserve", "plain", "kserve-localmodelcache")
#: a Kubernetes object name (DNS-1123 subdomain), e.g. a LocalModelNodeGroup's
_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def write_manifests(recipe, out_dir: Path, **kwargs: Any) -> list[Path]:
    """Write :func:`manifests` under ``out_dir``; returns the files written. A variant folder
    an earlier call wrote and this one does not (``kserve-localmodelcache/`` without
    ``node_group``) is removed: it would name an old URI and image."""
    import shutil

    files = manifests(recipe, **kwargs)
    for variant in set(VARIANTS) - {rel.split("/")[0] for rel in files}:
        shutil.rmtree(out_dir / variant, ignore_errors=True)
    written = []
    for rel, (comment, objects) in files.items():
        path = out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(comment, objects))
        written.append(path)
    return written


def add_deploy_arguments(parser: argparse.ArgumentParser) -> None:
    """``k8s RECIPE [--storage-uri URI] [--target T] [--image IMG] [--out DIR] [--max-replicas N]
    [--local-model-cache NODE_GROUP]``."""
    parser.add_argument("platform", choices=["k8s"], help="k8s: Kubernetes manifests (KServe and plain)")
    parser.add_argument("recipe", help="path to a recipe YAML, e.g. recipes/fp8-llm.yaml")
    parser.add_argument("--storage-uri", metavar="s3://BUCKET/PREFIX",
                        help="the published repository (default: the manifest's last `published` entry)")
    parser.add_argument("--target", choices=["tensorrt", "onnxruntime", "python-onnxruntime"],
                        help="compute model runtime (default: triton.target, the published target, ...)")
    parser.add_argument("--image", help="Triton image (default: from triton.serving, else tritonserver:24.10-py3)")
    parser.add_argument("--out", type=user_path, help="output folder (default: <work_dir>/<recipe>/deploy)")
    parser.add_argument("--max-replicas", type=int, default=4,
                        help=f"HPA / KServe maxReplicas, 1 to {MAX_REPLICAS} (default 4)")
    parser.add_argument("--local-model-cache", metavar="NODE_GROUP",
                        help="also write kserve-localmodelcache/: a KServe LocalModelCache of the repository on the "
                             "nodes of this LocalModelNodeGroup, and its InferenceService")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override, as for build")


def _make_name(recipe_path: str) -> str | None:
    """The ``RECIPE=`` of a recipe in this checkout's ``recipes/`` (the only ones the Makefile
    reads), else None."""
    path = Path(recipe_path).resolve()
    return path.stem if path.parent == Path(__file__).resolve().parents[2] / "recipes" else None


def cmd_deploy(args: argparse.Namespace) -> int:
    """``python -m pipeline deploy k8s RECIPE``: write the manifests, print the kubectl commands.

    Raises:
        PipelineError: exit 2: no ``--storage-uri`` and nothing published; ``--max-replicas`` outside
            1 to :data:`MAX_REPLICAS`; an ``--image`` that is not an image reference; ``--out`` in a
            model repository of the recipe (:func:`out_problem`) or not writable; a ``--target`` other
            than the one the repository was built for (:func:`repository_target`).
    """
    from pipeline.recipe.load import load_from_args

    recipe = load_from_args(args)
    run_dir = Path(recipe.work_dir) / recipe.name
    published = last_published(run_dir)
    uri = args.storage_uri or (published or {}).get("triton_url") or (published or {}).get("to")
    if not uri:
        publish = f".venv/bin/python -m pipeline publish {args.recipe} --to s3://bucket/prefix"
        make = _make_name(args.recipe)
        raise PipelineError(f"{run_dir / 'manifest.json'}: no `published` entry; publish first ({publish}"
                            + (f"; make publish RECIPE={make} TO=s3://...) or pass --storage-uri (make deploy "
                               f"RECIPE={make} ARGS='--storage-uri s3://...')" if make else ") or pass --storage-uri"))
    if not 1 <= args.max_replicas <= MAX_REPLICAS:
        raise PipelineError(f"--max-replicas {args.max_replicas}: valid: 1 to {MAX_REPLICAS} (the HPA's and the "
                            "InferenceService's maxReplicas; docs/publishing-and-kubernetes.md)")
    if args.image is not None and (why := image_problem(args.image)) is not None:
        raise PipelineError(f"--image {args.image!r}: {why}; valid: [registry[:port]/]name[:tag][@sha256:digest], "
                            "the name in lower case (e.g. nvcr.io/nvidia/tritonserver:24.10-py3)")
    group = getattr(args, "local_model_cache", None)
    if group is not None and not (len(group) <= 253 and _K8S_NAME.match(group)):
        raise PipelineError(f"--local-model-cache {group!r}: not a Kubernetes object name; valid: lower-case "
                            "letters, digits, '-' and '.', starting and ending with a letter or digit")
    out = Path(args.out) if args.out else run_dir / "deploy"
    if (inside := out_problem(recipe, out)) is not None:
        raise PipelineError(f"--out {out}: {inside}")
    problem = folder_problem(out)
    if problem is not None:
        raise PipelineError(f"--out {out}: cannot be written ({problem}); valid: a folder this user can create files in")
    known = repository_target(recipe, published, args.storage_uri)
    target = resolve_target(recipe, {"target": known[0]} if known else None, args.target)
    if args.target and known and known[0] != args.target:
        what = {"tensorrt": "a TensorRT engine (tensorrt_plan), on a GPU",
                "onnxruntime": "an ONNX graph with ONNX Runtime (onnxruntime_onnx; no engine)",
                "python-onnxruntime": "an ONNX graph with ONNX Runtime inside the python backend"}
        raise PipelineError(f"--target {args.target}: the repository at {uri} serves its compute model as "
                            f"{what.get(known[0], known[0])}, target {known[0]!r} ({known[1]}); valid: {known[0]} "
                            "(or leave --target out); a tensorrt deployment needs a recipe built with an engine")
    size = repository_bytes(recipe, published if not args.storage_uri else None) if group else None
    files = write_manifests(recipe, out, storage_uri=uri, target=target, image=args.image, max_replicas=args.max_replicas,
                            node_group=group, size_bytes=size, recipe_path=args.recipe)
    print("\n".join(str(f) for f in files))
    if args.image is None and (target == "python-onnxruntime" or model_names(recipe)[1:]):
        image = resolve_image(recipe)
        print(f"note: {image} is a stock Triton image, without the packages this repository's python-backend "
              "models import (tokenizers, onnxruntime; Pillow for images): build a derived image "
              f"(FROM {image} + pip install) and pass it with --image (docs/publishing-and-kubernetes.md)")
    folder = lambda name: shlex.quote(f"{out / name}/")  # noqa: E731  a path with spaces stays one argument
    print(f"KServe:  kubectl apply -f {folder('kserve')}\nplain:   kubectl apply -f {folder('plain')}")
    if group:
        print(f"KServe with a node-local copy: kubectl apply -f {folder('kserve-localmodelcache')}")
    return 0
