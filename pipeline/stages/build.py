"""Stage 3, build: explicit-Q/DQ ONNX -> TensorRT engine (``model.plan``).

The network is *strongly typed*: precision comes from the Q/DQ nodes and the
tensor types in the graph, so no FP16/INT8 builder flags are set (TensorRT 10;
TensorRT 11 always builds strongly typed). One optimization profile per recipe
profile; the timing cache at ``build.timing_cache`` is loaded and saved.

Whatever happens, the stage first writes ``trtexec.sh``: the equivalent
``trtexec`` command line, so an engine can be rebuilt (or the build debugged)
on a machine that has TensorRT but not this tool. Without an importable
``tensorrt`` package or a CUDA GPU the stage returns status ``"skipped"`` and
checks nothing about the serving runtime (its reason says so).

Where an engine would be built, the recipe must declare ``triton.serving``
(the Triton container / TensorRT version and GPU model that will load the
plan, see pipeline.serving_targets): the build refuses a local TensorRT or compute
capability that differs from it, and FP8 on a GPU below compute capability
8.9. The stamp records what the engine was built with; :func:`check_stamp`
compares it with the declared target at deploy time.

Every call into TensorRT sits in a small annotated function so mypy checks it
against ``tensorrt-stubs`` (tests/test_build_typecheck.py).
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import onnx

from pipeline import engine_backends, engine_report, profiles, serving_targets
from pipeline.artifacts import BuildArtifact, ExportArtifact, QuantizedArtifact, ResolvedProfile, TensorSpec
from pipeline.context import StageContext
from pipeline.engine_backends import TENSORRT, Backend
from pipeline.errors import EXIT_INTERNAL, PipelineError
from pipeline.fsutil import sha256_file, write_bytes_atomic, write_text_atomic
from pipeline.graph_checks import check_qdq_graph
from pipeline.memory import PeakRSS
from pipeline.recipe import BuildConfig, Recipe

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)

ENGINE_NAME = "model.plan"
STAMP_NAME = "engine_stamp.json"
SCRIPT_NAME = "trtexec.sh"
NOT_CHECKED = "serving runtime not checked: no engine built"
#: stamp fields copied into BuildArtifact.engine (the manifest's numbers)
HEADLINE = ("backend_label", "tensorrt_version", "targets", "check_only", "engine_bytes", "build_wall_s",
            "builder_peak_rss_mib")


class EngineBuildError(PipelineError):
    """The ONNX parser or the TensorRT builder rejected the graph or the profiles."""


class InsertedNodeRejected(EngineBuildError):
    """TensorRT rejected a node the pipeline inserted (a Q/DQ node, a cast): a bug in the pipeline."""

    exit_code = EXIT_INTERNAL


class ServingRuntimeError(EngineBuildError):
    """This machine cannot build an engine the declared serving runtime loads (or none is declared)."""


NAME = "build"
NEEDS = ("export", "quantize")
ARTIFACT = BuildArtifact


def key_sections(r: Recipe) -> list:
    """What of the recipe the build reads: its section and the serving target it must match."""
    return [r.build.model_dump(mode="json"), r.triton.serving and r.triton.serving.model_dump(mode="json")]


def key_extra(ctx: StageContext) -> dict:
    """What of this machine decides the engine (:func:`builder_key`)."""
    return {"builder": builder_key()}


def run(ctx: StageContext, exp: ExportArtifact, q: QuantizedArtifact) -> BuildArtifact:
    """The stage: :func:`build_from_onnx` on the quantized graph, into the stage folder."""
    return build_from_onnx(ctx.recipe, q.onnx_path, exp.inputs, ctx.stage_dir,
                           quantized_nodes=q.quantized_nodes, source_onnx=exp.onnx_path)


def build_from_onnx(
    recipe: Recipe,
    quantized_onnx: str,
    inputs: list[TensorSpec],
    out_dir: Path,
    *,
    quantized_nodes: list[str] | None = None,
    source_onnx: str | None = None,
) -> BuildArtifact:
    """Resolve profiles, write ``trtexec.sh`` and, where possible, build the engine.

    Which builder runs is :func:`pipeline.engine_backends.choose`'s answer to
    ``build.backend``: datacenter TensorRT (needs a CUDA GPU; writes ``model.plan``)
    or TensorRT-RTX (no GPU needed; writes ``model.rtx-<sm>.engine``, or
    ``check.rtx-sm89.engine`` for a parse-and-build check standing in for a target
    TensorRT-RTX lacks).

    Args:
        recipe: the run's recipe (``build`` section; ``engine_hash`` for the stamp).
        quantized_onnx: path of the explicit-Q/DQ ONNX model.
        inputs: the graph's inputs (symbolic dims as names).
        out_dir: stage folder; receives ``trtexec.sh``, the engine, ``engine_stamp.json``
            and ``engine.md`` (the report section).
        quantized_nodes: the GEMMs the quantize stage quantized (ONNX node names),
            compared with the network's INT8/FP8 GEMMs; None: not compared.
        source_onnx: the exported graph before quantization; nodes of
            ``quantized_onnx`` missing there were inserted by the pipeline.

    Returns:
        BuildArtifact with status ``"ok"`` (engine and stamp written; ``backend`` says
        which; ``reason`` holds warnings such as a GEMM mismatch, another GPU model of
        the same compute capability, or a timing cache started afresh) or
        ``"skipped"`` with the reason (no builder usable here, or ``backend: none``).

    Raises:
        ProfileError: the recipe profiles do not fit the graph's inputs.
        EngineBuildError: the ONNX file is missing or its inputs differ from
            ``inputs``; an input name cannot be written in trtexec syntax; the
            parser or builder failed on a node of the user's model (exit 2).
        InsertedNodeRejected: the parser or builder failed on a node the
            pipeline inserted (a Q/DQ node, a cast): a bug (exit 3).
        GraphCheckError: the Q/DQ graph breaks a TensorRT rule (checked before
            building).
        ServingRuntimeError: datacenter TensorRT only: ``triton.serving`` is
            missing, or the local TensorRT / compute capability differs from it,
            or FP8 on a GPU below compute capability 8.9 (all checked before building).
        BackendChoiceError: ``build.backend: tensorrt-rtx`` without a target it can build.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / engine_report.SECTION_FILE).unlink(missing_ok=True)
    onnx_path = Path(quantized_onnx).resolve()
    model = _load_graph(onnx_path, inputs)
    shape_tensors = set(profiles.shape_tensor_inputs(model))
    resolved = profiles.resolve_profiles(list(recipe.build.profiles), inputs, shape_tensors)
    dynamic = dynamic_inputs(inputs)
    cache_path = Path(recipe.build.timing_cache).resolve()
    rel = lambda p: Path(os.path.relpath(p, out_dir))  # noqa: E731  the script cds to its folder
    script = write_trtexec_script(
        out_dir / SCRIPT_NAME,
        trtexec_command(rel(onnx_path), rel(out_dir / ENGINE_NAME), resolved, dynamic, recipe.build, rel(cache_path)),
        make_dirs=[rel(cache_path.parent)],
    )
    plan = engine_backends.choose(recipe, unavailable_reason())
    if plan.backend is None:
        reason = f"{plan.reason}; equivalent build command written to {script}; {NOT_CHECKED}"
        log.warning("build skipped: %s", reason)
        return BuildArtifact("skipped", reason, None, None, str(script), resolved)
    notes = preflight(recipe, local_target(), script) if plan.backend is TENSORRT else list(plan.notes)
    check_qdq_graph(model, base_dir=str(onnx_path.parent))
    engine_path = out_dir / engine_name(plan)
    context = FailureContext(resolved, dynamic, inserted_nodes(model, source_onnx), _node_ops(model))
    built = build_engine(plan.backend, plan.targets, onnx_path, recipe.build, cache_path, notes, context)
    write_bytes_atomic(engine_path, built.plan)
    stamp = make_stamp(recipe, onnx_path, resolved, plan, built, engine_path)
    stamp["onnx_qdq_nodes"] = sum(n.op_type in _INSERTED_OPS for n in model.graph.node)
    notes = _gemm_warnings(built.network, quantized_nodes) + notes
    stamp_path = _write_records(out_dir, stamp, quantized_nodes, notes)
    for note in notes:
        log.warning("build: %s", note)
    headline = {k: stamp[k] for k in HEADLINE}
    return BuildArtifact("ok", "; ".join(notes), str(engine_path), str(stamp_path), str(script), resolved,
                         backend=plan.backend.name, engine=headline)


def _gemm_warnings(network: engine_report.NetworkSummary, quantized_nodes: list[str] | None) -> list[str]:
    missing = engine_report.gemm_mismatch(network, quantized_nodes)
    return [engine_report.mismatch_warning(missing, len(quantized_nodes or []))] if missing else []


def _write_records(out_dir: Path, stamp: dict[str, Any], quantized_nodes: list[str] | None, notes: list[str]) -> Path:
    """Write ``engine_stamp.json`` and the report section ``engine.md``; returns the stamp's path."""
    stamp_path = out_dir / STAMP_NAME
    write_bytes_atomic(stamp_path, json.dumps(stamp, indent=2).encode())
    count = None if quantized_nodes is None else len(quantized_nodes)
    write_text_atomic(out_dir / engine_report.SECTION_FILE, engine_report.section_markdown(stamp, count, notes))
    return stamp_path


def engine_name(plan: engine_backends.BuildPlan) -> str:
    """``model.plan`` (datacenter), ``model.rtx-sm89.engine``, or ``check.rtx-sm89.engine`` (a check)."""
    if plan.backend is TENSORRT:
        return ENGINE_NAME
    return f"{'check' if plan.check_only else 'model'}.rtx-{'-'.join(plan.targets)}.engine"


# --- serving runtime: checked before building ---------------------------------------------


def local_target() -> serving_targets.Target:
    """This machine as a build target: tensorrt package version and CUDA device 0."""
    capability, name = gpu_info()
    return serving_targets.Target(tensorrt_version(), capability, name)


def preflight(recipe: Recipe, local: serving_targets.Target, script: Path) -> list[str]:
    """Refuse a build whose engine the declared serving runtime could not load.

    Args:
        recipe: its ``triton.serving`` is the declared target; ``quantize.precision``.
        local: this machine (TensorRT version, compute capability, GPU name).
        script: the written ``trtexec.sh``, named in the refusal.

    Returns:
        Warnings (e.g. another GPU model with the same compute capability).

    Raises:
        ServingRuntimeError: FP8 on a GPU below compute capability 8.9 (here or
            declared); ``triton.serving`` missing; a different TensorRT
            major.minor.patch or compute capability than declared.
    """
    fp8 = recipe.quantize.precision == "fp8"
    problem = serving_targets.fp8_problem(local.compute_capability, f"this GPU ({local.gpu_name})") if fp8 else None
    if problem:
        raise ServingRuntimeError(f"build: {problem}; build on a GPU of compute capability 8.9 or later")
    cfg = recipe.triton.serving
    if cfg is None:
        raise ServingRuntimeError(
            f"build: TensorRT {local.tensorrt} and a {local.gpu_name} (compute capability {local.compute_capability}) "
            "are present, so an engine would be built, but the recipe does not declare triton.serving, the runtime "
            "that will load it. Add e.g. triton: {serving: {container: '25.01-trtllm-python-py3', gpu: 'H100'}} or "
            "{tensorrt: '10.8.0', gpu: 'H100'}" + _containers_hint(local.tensorrt)
        )
    declared = serving_targets.declared_target(cfg)
    problem = serving_targets.fp8_problem(declared.compute_capability, f"the serving GPU ({declared.gpu_name})") if fp8 else None
    if problem:
        raise ServingRuntimeError(f"build: {problem} (recipe triton.serving.gpu)")
    result = serving_targets.compare(local, declared, "this machine")
    if result.errors:
        raise ServingRuntimeError(
            "build: refusing to build an engine the declared serving runtime cannot load:\n  "
            + "\n  ".join(result.errors) + "\n" + _where_to_build(declared, script)
        )
    return result.warnings


def _containers_hint(version: str) -> str:
    tags = serving_targets.containers_with(version)
    return f"; known containers with TensorRT {version}: {', '.join(tags)}" if tags else ""


def _where_to_build(declared: serving_targets.Target, script: Path) -> str:
    """How to build the same engine where TensorRT and the GPU match the declaration."""
    rel = os.path.relpath(script)
    under_cwd = not rel.startswith("..")  # then mounting the working folder brings the script's inputs along
    shown = rel if under_cwd else str(script)
    image = declared.image
    if image is None:
        tags = serving_targets.containers_with(declared.tensorrt)
        image = serving_targets.container_image(tags[0]) if tags else None
    where = f"inside {image}" if image else f"where TensorRT {declared.tensorrt} is installed"
    docker = f"  (e.g. docker run --rm --gpus all -v \"$PWD\":/work -w /work {image} sh {shown})"
    return (
        f"Build on a {declared.gpu_name} (compute capability {declared.compute_capability}) {where}, with "
        f"trtexec on PATH: sh {shown}" + (docker if image and under_cwd else "")
        + f"; or install tensorrt=={'.'.join(map(str, serving_targets.tensorrt_triple(declared.tensorrt)))}.* here"
    )


def _load_graph(onnx_path: Path, inputs: list[TensorSpec]) -> onnx.ModelProto:
    """The graph without external weights; its inputs must be ``inputs``."""
    if not onnx_path.is_file():
        raise EngineBuildError(f"build: quantized ONNX model {onnx_path} not found")
    model = onnx.load(str(onnx_path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    graph_inputs = [v.name for v in model.graph.input if v.name not in inits]
    expected = [s.name for s in inputs]
    if sorted(graph_inputs) != sorted(expected):
        raise EngineBuildError(
            f"build: {onnx_path} has inputs {graph_inputs}, but the upstream artifact lists {expected}"
        )
    return model


def dynamic_inputs(inputs: list[TensorSpec]) -> list[str]:
    """Names of inputs with at least one non-static axis (name, or size < 1)."""
    return [s.name for s in inputs if any(isinstance(d, str) or d < 1 for d in s.shape)]


# --- trtexec equivalent ------------------------------------------------------------------


def trtexec_command(
    onnx_path: Path,
    engine_path: Path,
    resolved: list[ResolvedProfile],
    dynamic: list[str],
    build: BuildConfig,
    timing_cache: Path,
) -> list[str]:
    """argv of the trtexec build equivalent to :func:`build_engine`.

    Shapes are given for the ``dynamic`` inputs only (trtexec wants all
    three of min/opt/max); with more than one profile each group is preceded
    by ``--profile=N``. Workspace is in MiB (``--memPoolSize=workspace:<N>M``).

    Raises:
        EngineBuildError: an input name holds a comma or a single quote, which
            trtexec's shape syntax cannot express.
    """
    argv = ["trtexec", f"--onnx={onnx_path}", f"--saveEngine={engine_path}", "--stronglyTyped"]
    for index, prof in enumerate(resolved):
        if len(resolved) > 1:
            argv.append(f"--profile={index}")
        for kind, flag in (("min", "--minShapes"), ("opt", "--optShapes"), ("max", "--maxShapes")):
            specs = [f"{_trtexec_name(n)}:{_trtexec_dims(prof.shapes[n][kind])}" for n in dynamic]
            if specs:
                argv.append(f"{flag}={','.join(specs)}")
    argv += [
        f"--timingCacheFile={timing_cache}",
        f"--memPoolSize=workspace:{build.workspace_mib}M",
        f"--builderOptimizationLevel={build.builder_optimization_level}",
        "--skipInference",
    ]
    return argv


def _trtexec_name(name: str) -> str:
    """A tensor name in a trtexec shape spec; names with ':' are wrapped in single quotes."""
    if "," in name or "'" in name:
        raise EngineBuildError(
            f"build: input name {name!r} holds ',' or \"'\", which trtexec shape specs cannot express; "
            "rename the input at export"
        )
    return f"'{name}'" if ":" in name else name


def _trtexec_dims(shape: list[int]) -> str:
    return "x".join(str(d) for d in shape) if shape else "scalar"


def write_trtexec_script(path: Path, argv: list[str], make_dirs: Sequence[Path] = ()) -> Path:
    """Write ``argv`` as an executable sh script, one argument per line, that
    first changes to its own folder and creates ``make_dirs``. Returns ``path``."""
    body = " \\\n  ".join(_sh_quote(a) for a in argv)
    mkdir = "".join(f"mkdir -p {_sh_quote(str(d))}\n" for d in make_dirs)
    path.write_text(
        "#!/bin/sh\n# Equivalent trtexec build (generated by pipeline.stages.build).\n"
        "# Paths are relative to this script's folder.\n"
        f'cd "$(dirname "$0")" || exit 1\n{mkdir}{body}\n'
    )
    path.chmod(0o755)
    return path


def _sh_quote(arg: str) -> str:
    """Shell-quote; prefer double quotes so trtexec's 'name:0' quoting stays readable."""
    if "'" in arg and not any(c in arg for c in '$`"\\!'):
        return f'"{arg}"'
    return shlex.quote(arg)


# --- availability, stamp ------------------------------------------------------------------


def unavailable_reason() -> str | None:
    """Why datacenter TensorRT cannot build here, or None if tensorrt and a CUDA GPU are present."""
    import torch

    gpu = torch.cuda.is_available()
    problem = engine_backends.import_problem(TENSORRT)
    if problem:
        return problem + ("" if gpu else "; no CUDA GPU visible either")
    return None if gpu else "no CUDA GPU visible"


def builder_key() -> str:
    """What of this machine decides the engine, for the build stage's cache key: the local
    GPU where datacenter TensorRT builds for it, else that it cannot (TensorRT-RTX builds for
    declared targets, or the stage skips). The tool versions are in the key already."""
    if unavailable_reason() is not None:
        return "no datacenter TensorRT build here"
    capability, name = gpu_info()
    return f"datacenter TensorRT on a {name} (compute capability {capability})"


def gpu_info() -> tuple[str, str]:
    """(compute capability as "major.minor", GPU name) of CUDA device 0."""
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    return f"{major}.{minor}", torch.cuda.get_device_name(0)


@dataclass
class BuiltEngine:
    """A serialized engine and how it was made: ``wall_s`` (parse + build, seconds),
    ``peak_rss_mib`` (this process's peak resident memory meanwhile, MiB), ``network``
    (what the parsed network held), ``timing_cache`` (what happened to it, for the report)."""

    plan: memoryview
    wall_s: float
    peak_rss_mib: float
    network: engine_report.NetworkSummary
    timing_cache: str


def make_stamp(
    recipe: Recipe,
    onnx_path: Path,
    resolved: list[ResolvedProfile],
    plan: engine_backends.BuildPlan,
    built: BuiltEngine,
    engine_path: Path,
) -> dict[str, Any]:
    """What an engine was built with and for. Datacenter TensorRT: the local GPU
    (``compute_capability``, ``gpu_name``); TensorRT-RTX: ``targets`` (``["sm89"]``),
    ``compute_capability`` their capabilities joined by ",", ``gpu_name`` None."""
    backend = plan.backend or TENSORRT
    if backend is TENSORRT:
        capability, gpu_name = gpu_info()
        targets = [serving_targets.sm_name(capability)]
        runs_on = f"Triton's tensorrt_plan backend with TensorRT {backend.version()} on a {gpu_name}"
    else:
        capability, gpu_name, targets = ",".join(serving_targets.sm_capability(t) for t in plan.targets), None, plan.targets
        runs_on = rtx_runs_on(plan.targets)
    return {
        "backend": backend.name,
        "backend_label": backend.label,
        "tensorrt_version": backend.version(),
        "compute_capability": capability,
        "gpu_name": gpu_name,
        "targets": targets,
        "check_only": plan.check_only,
        "recipe_hash": recipe.engine_hash,
        "onnx_sha256": sha256_file(onnx_path),  # the .onnx file only, not external data
        "profiles": [asdict(p) for p in resolved],
        "engine_file": engine_path.name,
        "engine_bytes": len(built.plan),
        "build_wall_s": round(built.wall_s, 3),
        "builder_peak_rss_mib": round(built.peak_rss_mib, 1),
        "timing_cache": built.timing_cache,
        "runs_on": runs_on,
        "network": built.network.to_json(),
    }


def rtx_runs_on(targets: Sequence[str]) -> str:
    """Where a TensorRT-RTX engine for ``targets`` runs, and how to load it."""
    gpus = [f"{t} ({', '.join(g.upper() for g, c in serving_targets.GPU_CAPABILITY.items() if c == serving_targets.sm_capability(t))})"
            for t in targets]
    return ("the TensorRT-RTX runtime (tensorrt_rtx_bindings.Runtime(logger).deserialize_cuda_engine(bytes)) on a "
            f"GPU of {', '.join(gpus)}; not Triton's tensorrt_plan backend, which links datacenter TensorRT")


def check_stamp(stamp: dict[str, Any], target: serving_targets.Target, recipe_hash: str) -> serving_targets.Comparison:
    """Compare an engine's stamp with the DECLARED serving target (not this machine).

    A plan loads only in the TensorRT major.minor.patch that built it and on
    GPUs of its compute capability (e.g. "9.0"); ``recipe_hash`` is
    ``Recipe.engine_hash`` of the current recipe. A TensorRT-RTX engine never
    passes: Triton's ``tensorrt_plan`` backend links datacenter TensorRT.

    Returns:
        ``errors``: one line per missing or mismatching field (backend, TensorRT
        version, compute capability, recipe hash); ``warnings``: a different
        GPU model with the same compute capability.
    """
    if stamp.get("backend", TENSORRT.name) != TENSORRT.name:
        return serving_targets.Comparison([
            f"backend: engine built by {stamp.get('backend_label', stamp['backend'])} "
            f"{stamp.get('tensorrt_version', '?')}, which Triton's tensorrt_plan backend (datacenter TensorRT "
            f"{target.tensorrt}) cannot load; serve the ONNX graph, or build with datacenter TensorRT on the "
            f"serving GPU {target.gpu_name} (build.backend: tensorrt)"], [])
    errors: list[str] = []
    for key in ("tensorrt_version", "compute_capability", "gpu_name", "recipe_hash"):
        if key not in stamp:
            errors.append(f"{key}: missing from the engine stamp; rebuild the engine")
    if "recipe_hash" in stamp and str(stamp["recipe_hash"]) != recipe_hash:
        errors.append(f"recipe_hash: engine has {stamp['recipe_hash']!r}, the recipe {recipe_hash!r} "
                      "(the recipe changed since the engine was built); rebuild the engine")
    if errors:
        return serving_targets.Comparison(errors, [])
    built = serving_targets.Target(str(stamp["tensorrt_version"]), str(stamp["compute_capability"]), str(stamp["gpu_name"]))
    result = serving_targets.compare(built, target, "engine")
    return serving_targets.Comparison([f"{e}; rebuild the engine" for e in result.errors], result.warnings)


# --- failures: which node, which shapes, whose fault ---------------------------------------

_INSERTED_OPS = ("QuantizeLinear", "DequantizeLinear")


@dataclass(frozen=True)
class FailureContext:
    """What a parser/builder failure message needs: the profiles' shapes, the nodes the
    pipeline inserted (ONNX node names) and every node's op type."""

    resolved: list[ResolvedProfile]
    dynamic: list[str]
    inserted: frozenset[str]
    ops: dict[str, str]

    def shapes(self) -> str:
        """One line per profile: each dynamic input's min / opt / max shape."""
        lines = []
        for prof in self.resolved:
            parts = [f"{n} min {prof.shapes[n]['min']} opt {prof.shapes[n]['opt']} max {prof.shapes[n]['max']}"
                     for n in self.dynamic]
            lines.append(f"  profile {prof.name!r}: " + ("; ".join(parts) or "static shapes only"))
        return "\n".join(lines)

    def error(self, text: str, nodes: Sequence[str]) -> EngineBuildError:
        """The error to raise for a failure at ``nodes``: InsertedNodeRejected (exit 3) when one
        was inserted by the pipeline, else EngineBuildError (exit 2)."""
        ours = [n for n in nodes if n in self.inserted]
        message = f"{text}\nprofile shapes:\n{self.shapes()}"
        if ours:
            return InsertedNodeRejected(
                f"{message}\n{', '.join(ours)}: inserted by the pipeline (quantize stage), so this is a pipeline "
                "bug; please report it with quantize/model.onnx")
        return EngineBuildError(f"{message}\nthe failing node is part of the model itself: TensorRT cannot build it; "
                                "change the model or export it differently (e.g. another opset)")


def inserted_nodes(model: onnx.ModelProto, source_onnx: str | None) -> frozenset[str]:
    """Names of the nodes the pipeline added: those missing from the exported graph
    ``source_onnx``, or (without it) every QuantizeLinear/DequantizeLinear node."""
    if source_onnx is not None and Path(source_onnx).is_file():
        source = {n.name for n in onnx.load(source_onnx, load_external_data=False).graph.node}
        return frozenset(n.name for n in model.graph.node if n.name not in source)
    return frozenset(n.name for n in model.graph.node if n.op_type in _INSERTED_OPS)


def _node_ops(model: onnx.ModelProto) -> dict[str, str]:
    return {n.name: n.op_type for n in model.graph.node if n.name}


def _nodes_named_in(messages: Sequence[str], ops: dict[str, str]) -> list[str]:
    """ONNX node names that a builder log mentions (longest names first, each once)."""
    text = "\n".join(messages)
    return [n for n in sorted(ops, key=len, reverse=True) if n in text]


# --- TensorRT / TensorRT-RTX (one path; type-checked against tensorrt-stubs) ---------------


def tensorrt_version() -> str:
    """The datacenter tensorrt package's version."""
    return TENSORRT.version()


def build_engine(
    backend: Backend,
    targets: Sequence[str],
    onnx_path: Path,
    build: BuildConfig,
    timing_cache: Path,
    notes: list[str],
    context: FailureContext,
) -> BuiltEngine:
    """Parse, configure and build with ``backend``; save the timing cache where it has one.

    ``targets``: compute capabilities for a cross-target backend (TensorRT-RTX;
    ignored by datacenter TensorRT). ``notes`` receives what the report should say
    (e.g. the timing cache was unreadable and an empty one was used).

    Raises:
        EngineBuildError / InsertedNodeRejected: parser errors (each with node name
            and operator), an invalid optimization profile, or a failed build (with
            the builder's error log); all with the profiles' shapes.
    """
    messages: list[str] = []
    start = time.perf_counter()
    with PeakRSS() as mem:
        logger = make_logger(backend, messages)
        builder: trt.Builder = backend.module().Builder(logger)
        network = create_network(backend, builder)
        parse_onnx(backend, network, logger, onnx_path, context)
        summary = engine_report.summarize_network(network)
        config = create_config(backend, builder, build)
        backend.select_targets(config, targets)
        cache = attach_timing_cache(config, timing_cache, notes) if backend.timing_cache else None
        for prof in context.resolved:
            add_profile(backend, builder, config, prof, context.dynamic)
        plan = builder.build_serialized_network(network, config)
    if plan is None:
        log_tail = "\n".join(messages[-30:])
        raise context.error(f"{backend.label} build_serialized_network failed for {onnx_path}:\n{log_tail}",
                            _nodes_named_in(messages, context.ops))
    if cache is not None:
        save_timing_cache(cache, timing_cache)
        cache_note = f"{timing_cache} (loaded and saved)"
    else:
        cache_note = (f"not used: {backend.label} ignores timing caches (its timing-cache calls are deprecated "
                      f"no-ops), so build.timing_cache {timing_cache} was neither read nor written")
    return BuiltEngine(memoryview(plan), time.perf_counter() - start, mem.peak_mib, summary, cache_note)


def make_logger(backend: Backend, sink: list[str]) -> trt.ILogger:
    """A TensorRT logger forwarding to ``logging``; errors also go to ``sink``."""
    mod = backend.module()

    class _Logger(mod.ILogger):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            mod.ILogger.__init__(self)

        def log(self, severity: trt.ILogger.Severity, msg: str) -> None:
            if int(severity) <= int(mod.ILogger.Severity.ERROR):
                sink.append(msg)
                log.error("%s: %s", backend.name, msg)
            elif int(severity) <= int(mod.ILogger.Severity.WARNING):
                log.warning("%s: %s", backend.name, msg)
            else:
                log.debug("%s: %s", backend.name, msg)

    logger: trt.ILogger = _Logger()
    return logger


def create_network(backend: Backend, builder: trt.Builder) -> trt.INetworkDefinition:
    """An empty strongly typed network."""
    flag = backend.module().NetworkDefinitionCreationFlag.STRONGLY_TYPED
    return builder.create_network(1 << int(flag))


def parse_onnx(
    backend: Backend, network: trt.INetworkDefinition, logger: trt.ILogger, onnx_path: Path, context: FailureContext
) -> None:
    """Parse the ONNX file (external data next to it) into ``network``.

    Raises:
        EngineBuildError / InsertedNodeRejected: every parser error with node name and operator.
    """
    parser: trt.OnnxParser = backend.module().OnnxParser(network, logger)
    if parser.parse_from_file(str(onnx_path)):
        return
    lines, nodes = [], []
    for i in range(parser.num_errors):
        err: trt.ParserError = parser.get_error(i)
        name = err.node_name()
        op = err.node_operator() or context.ops.get(name, "?")
        where = f"node {name!r} ({op})" if name else "graph (no node)"
        lines.append(f"  {where}: {err.desc()} [{err.code()}]")
        nodes.append(name)
    raise context.error(f"{backend.label} {backend.version()} ONNX parser rejected {onnx_path}:\n" + "\n".join(lines),
                        nodes)


def create_config(backend: Backend, builder: trt.Builder, build: BuildConfig) -> trt.IBuilderConfig:
    """Builder config: workspace limit (MiB) and optimization level; no precision flags."""
    config = builder.create_builder_config()
    config.set_memory_pool_limit(backend.module().MemoryPoolType.WORKSPACE, build.workspace_mib << 20)
    config.builder_optimization_level = build.builder_optimization_level
    return config


def attach_timing_cache(config: trt.IBuilderConfig, path: Path, notes: list[str]) -> trt.ITimingCache:
    """Load the timing cache at ``path`` (or start empty) and attach it to ``config``.

    ``create_timing_cache`` returns None for a corrupt file, and
    ``set_timing_cache`` refuses a cache from another GPU or TensorRT version;
    either way an empty cache is used (it overwrites the file after the
    build) and a line saying so is appended to ``notes``.

    Raises:
        EngineBuildError: TensorRT cannot create even an empty timing cache.
    """
    data = path.read_bytes() if path.is_file() else b""
    cache = config.create_timing_cache(data)
    if cache is None:
        notes.append(f"timing cache {path} is unreadable (corrupt or truncated); started an empty one, "
                     "which replaces the file after this build")
    elif config.set_timing_cache(cache, False):
        return cache
    else:
        notes.append(f"timing cache {path} does not match this GPU/TensorRT; started an empty one")
    cache = config.create_timing_cache(b"")
    if cache is None or not config.set_timing_cache(cache, False):
        raise EngineBuildError("TensorRT could not create an empty timing cache")
    return cache


def save_timing_cache(cache: trt.ITimingCache, path: Path) -> None:
    """Serialize the (updated) timing cache to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, memoryview(cache.serialize()))


def add_profile(
    backend: Backend, builder: trt.Builder, config: trt.IBuilderConfig, prof: ResolvedProfile, dynamic: list[str]
) -> int:
    """Add one optimization profile (dynamic inputs only). Returns its index.

    Raises:
        EngineBuildError: TensorRT rejected the profile; ``set_shape`` raising
            RuntimeError (inconsistent min/opt/max) names the profile and input.
    """
    dims = backend.module().Dims
    profile = builder.create_optimization_profile()
    for name in dynamic:
        shape = prof.shapes[name]
        try:
            profile.set_shape(name, dims(shape["min"]), dims(shape["opt"]), dims(shape["max"]))
        except RuntimeError as e:
            raise EngineBuildError(
                f"build.profiles {prof.name!r}, input {name!r}: TensorRT rejected min {shape['min']}, "
                f"opt {shape['opt']}, max {shape['max']} ({e}); each axis needs min <= opt <= max, the same rank "
                "in all three and the input's rank"
            ) from e
    index = config.add_optimization_profile(profile)
    if index < 0:
        shapes = "; ".join(f"{n} min {prof.shapes[n]['min']} opt {prof.shapes[n]['opt']} max {prof.shapes[n]['max']}"
                           for n in dynamic)
        raise EngineBuildError(f"build.profiles {prof.name!r}: TensorRT rejected the optimization profile ({shapes}); "
                               "each axis needs min <= opt <= max, the same rank in all three and the input's rank")
    return index
