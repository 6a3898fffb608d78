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
plan, see pipeline.targets): the build refuses a local TensorRT or compute
capability that differs from it, and FP8 on a GPU below compute capability
8.9. The stamp records what the engine was built with;
:func:`pipeline.trt.stamp.check_stamp` compares it with the declared target at deploy time.

The TensorRT calls live in :mod:`pipeline.trt.builder`, the trtexec script in
:mod:`pipeline.trt.trtexec`, availability, preflight and stamp in :mod:`pipeline.trt.stamp`.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import onnx

from pipeline.trt import backends as engine_backends
from pipeline.trt import report as engine_report
from pipeline.trt import profiles
from pipeline.artifacts import BuildArtifact, ExportArtifact, QuantizedArtifact, TensorSpec
from pipeline.context import StageContext
from pipeline.trt.backends import TENSORRT
from pipeline.trt.builder import (
    INSERTED_OPS, BuilderCrash, EngineBuildError, FailureContext, build_engine, inserted_nodes, node_ops, run_child,
)
from pipeline.trt.stamp import builder_key, local_target, make_stamp, preflight, unavailable_reason
from pipeline.trt.trtexec import trtexec_command, write_trtexec_script
from pipeline.trt import embedding
from pipeline.onnx_io import data_file_name, graph_specs
from pipeline.fsutil import write_bytes_atomic, write_text_atomic
from pipeline.checks.graph import check_qdq_graph
from pipeline.recipe.schema import Recipe

log = logging.getLogger(__name__)

ENGINE_NAME = "model.plan"
STAMP_NAME = "engine_stamp.json"
SCRIPT_NAME = "trtexec.sh"
CRASH_DIR = "crash"  # build --bisect-crash: the smallest crashing subgraph (pipeline.trt.bisect)
NOT_CHECKED = "serving runtime not checked: no engine built"
#: stamp fields copied into BuildArtifact.engine (the manifest's numbers)
HEADLINE = ("backend_label", "tensorrt_version", "targets", "check_only", "engine_bytes", "build_wall_s",
            "builder_peak_rss_mib")


NAME = "build"
NEEDS = ("export", "quantize")
#: reads no manifest input of its own (the graph comes from quantize)
KEY_INPUTS: tuple[str, ...] = ()
ARTIFACT = BuildArtifact


def key_sections(r: Recipe) -> list:
    """What of the recipe the build reads: its section and the serving target it must match."""
    return [r.build.model_dump(mode="json"), r.triton.serving and r.triton.serving.model_dump(mode="json")]


def key_extra(ctx: StageContext) -> dict:
    """What of this machine decides the engine (:func:`builder_key`)."""
    return {"builder": builder_key()}


def run(ctx: StageContext, exp: ExportArtifact, q: QuantizedArtifact) -> BuildArtifact:
    """The stage: :func:`build_from_onnx` on the quantized graph, into the stage folder."""
    start = time.perf_counter()
    art = build_from_onnx(ctx.recipe, q.onnx_path, exp.inputs, ctx.stage_dir,
                          quantized_nodes=q.quantized_nodes, source_onnx=exp.onnx_path, bisect_crash_s=ctx.bisect_crash_s)
    what = art.summary if art.status == "ok" else f"skipped: {art.reason}"
    ctx.progress.done(f"build: {what}", time.perf_counter() - start)
    return art


def build_from_onnx(
    recipe: Recipe,
    quantized_onnx: str,
    inputs: list[TensorSpec],
    out_dir: Path,
    *,
    quantized_nodes: list[str] | None = None,
    source_onnx: str | None = None,
    bisect_crash_s: float | None = None,
) -> BuildArtifact:
    """Resolve profiles, write ``trtexec.sh`` and, where possible, build the engine.

    Which builder runs is :func:`pipeline.trt.backends.choose`'s answer to
    ``build.backend``: datacenter TensorRT (needs a CUDA GPU; writes ``model.plan``)
    or TensorRT-RTX (no GPU needed; writes ``model.rtx-<sm>.engine``, or
    ``check.rtx-sm89.engine`` for a parse-and-build check standing in for a target
    TensorRT-RTX lacks).

    Args:
        recipe: the run's recipe (``build`` section; ``engine_hash`` for the stamp).
        quantized_onnx: path of the explicit-Q/DQ ONNX model.
        inputs: the graph's inputs (symbolic dims as names).
        out_dir: stage folder; receives ``trtexec.sh``, the engine, ``engine_stamp.json``
            and ``engine.md`` (the report section); with ``build.embedding_lookup: runtime`` also
            :data:`ENGINE_GRAPH` (what the engine is built from: the graph without its embedding
            Gather, taking ``inputs_embeds``) and ``embedding.safetensors`` (the table,
            :mod:`pipeline.trt.embedding`).
        quantized_nodes: the GEMMs the quantize stage quantized (ONNX node names),
            compared with the network's INT8/FP8 GEMMs; None: not compared.
        source_onnx: the exported graph before quantization; nodes of
            ``quantized_onnx`` missing there were inserted by the pipeline.
        bisect_crash_s: when the builder crashes, reduce the graph to the smallest subgraph
            that still crashes it within this many seconds (:mod:`pipeline.trt.bisect`; saved
            under ``crash/``); None: do not.

    Returns:
        BuildArtifact with status ``"ok"`` (engine and stamp written; ``backend`` says
        which; ``reason`` holds warnings such as a GEMM mismatch, another GPU model of
        the same compute capability, or a timing cache started afresh) or
        ``"skipped"`` with the reason (no builder usable here, or ``backend: none``).

    Raises:
        ProfileError: the recipe profiles do not fit the graph's inputs.
        EngineBuildError: the ONNX file is missing or its inputs differ from
            ``inputs``; ``embedding_lookup: runtime`` finds no embedding Gather it can cut
            (:func:`pipeline.trt.embedding.cut`); an input name cannot be written in trtexec
            syntax; the parser or builder failed on a node of the user's model (exit 2).
        InsertedNodeRejected: the parser or builder failed on a node the
            pipeline inserted (a Q/DQ node, a cast): a bug (exit 3).
        BuilderCrash: the builder's process died (a signal such as SIGFPE) while parsing or
            building: names the step, signal, targets and graph, and the ways around it (exit 3).
        MemoryFault: the builder's process was killed with SIGKILL (the OOM killer; exit 4).
        GraphCheckError: the Q/DQ graph breaks a TensorRT rule (checked before
            building).
        ServingRuntimeError: datacenter TensorRT only: ``triton.serving`` is
            missing, or the local TensorRT / compute capability differs from it,
            or FP8 on a GPU below compute capability 8.9 (all checked before building).
        BackendChoiceError: ``build.backend: tensorrt-rtx`` without a target it can build.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in (engine_report.SECTION_FILE, ENGINE_GRAPH, data_file_name(ENGINE_GRAPH), embedding.TABLE_FILE):
        (out_dir / stale).unlink(missing_ok=True)
    shutil.rmtree(out_dir / CRASH_DIR, ignore_errors=True)  # an earlier run's bisect
    onnx_path = Path(quantized_onnx).resolve()
    model = _load_graph(onnx_path, inputs)
    found = None
    if recipe.build.embedding_lookup == "runtime":  # cut in memory; written once the profiles fit
        found = embedding.cut(model, base_dir=onnx_path.parent)
        inputs = graph_specs(model)[0]
    shape_tensors = set(profiles.shape_tensor_inputs(model))
    resolved = profiles.resolve_profiles(list(recipe.build.profiles), inputs, shape_tensors)
    dynamic = dynamic_inputs(inputs)
    cache_path = Path(recipe.build.timing_cache).resolve()
    rel = lambda p: Path(os.path.relpath(p, out_dir))  # noqa: E731  the script cds to its folder
    command = trtexec_command(rel(out_dir / ENGINE_GRAPH if found else onnx_path), rel(out_dir / ENGINE_NAME),
                              resolved, dynamic, recipe.build, rel(cache_path))
    lookup = None
    if found is not None:
        onnx_path, model, lookup = _lookup_outside(model, found, onnx_path, out_dir)
    script = write_trtexec_script(out_dir / SCRIPT_NAME, command, make_dirs=[rel(cache_path.parent)])
    plan = engine_backends.choose(recipe, unavailable_reason())
    if plan.backend is None:
        reason = f"{plan.reason}; equivalent build command written to {script}; {NOT_CHECKED}"
        return BuildArtifact("skipped", reason, None, None, str(script), resolved)
    notes = preflight(recipe, local_target(), script) if plan.backend is TENSORRT else list(plan.notes)
    check_qdq_graph(model, base_dir=str(onnx_path.parent))
    engine_path = out_dir / engine_name(plan)
    context = FailureContext(resolved, dynamic, inserted_nodes(model, source_onnx), node_ops(model))
    try:
        built = build_engine(plan.backend, plan.targets, onnx_path, recipe.build, cache_path, notes, context)
    except BuilderCrash as crash:
        if bisect_crash_s is None:
            raise
        raise _bisected(crash, plan, onnx_path, recipe, context, out_dir / CRASH_DIR, bisect_crash_s,
                        quantized_nodes) from None
    write_bytes_atomic(engine_path, built.plan)
    stamp = make_stamp(recipe, onnx_path, resolved, plan, built, engine_path)
    stamp["onnx_qdq_nodes"] = sum(n.op_type in INSERTED_OPS for n in model.graph.node)
    if lookup is not None:
        stamp["embedding_lookup"] = lookup
    formats = engine_report.block_weight_formats(model)  # weight-only (int4, nvfp4) GEMMs: bits per weight by form
    if formats:
        stamp["weight_formats"] = formats
        stamp["weight_bits_per_weight"] = engine_report.bits_per_weight(formats)
    if recipe.build.compare_fp16:
        stamp.update(_fp16_engine(plan, source_onnx, recipe, cache_path, context, out_dir))
        if stamp.get("fp16_engine_bytes"):
            stamp["engine_bytes_vs_fp16"] = stamp["engine_bytes"] / stamp["fp16_engine_bytes"]
            if lookup is not None and stamp.get("fp16_table_bytes"):
                stamp["engine_and_table_bytes_vs_fp16"] = (stamp["engine_bytes"] + lookup["bytes"]) / (
                    stamp["fp16_engine_bytes"] + stamp["fp16_table_bytes"])
    notes = _gemm_warnings(built.network, quantized_nodes) + notes
    stamp_path = _write_records(out_dir, stamp, quantized_nodes, notes)
    for note in notes:
        log.warning("build: %s", note)
    headline = {k: stamp[k] for k in HEADLINE}
    if lookup is not None:
        headline["embedding_table_bytes"] = lookup["bytes"]
    return BuildArtifact("ok", "; ".join(notes), str(engine_path), str(stamp_path), str(script), resolved,
                         backend=plan.backend.name, engine=headline)


#: the scratch folder of build.compare_fp16's FP16 graph and engine (removed after the build)
FP16_COMPARE_DIR = ".fp16-compare"


def _fp16_engine(plan: engine_backends.BuildPlan, source_onnx: str | None, recipe: Recipe, cache_path: Path,
                 context: FailureContext, out_dir: Path) -> dict[str, Any]:
    """``build.compare_fp16``: build the exported FP32 graph cast to FP16 (:func:`pipeline.quant.autocast.
    cast_rest` to fp16: weights and activations FP16 but the I/O and the ops kept FP32 for range,
    strongly typed as every graph here) with the same backend, targets and profiles, and return
    ``{"fp16_engine_bytes": n}`` (the caller adds ``engine_bytes_vs_fp16``); the graph and engine are not kept.
    With ``build.embedding_lookup: runtime`` its lookup is cut out the same way (:func:`pipeline.trt.embedding.cut`)
    and ``fp16_table_bytes`` gives its table's bytes.
    A check build (``check_only``), no exported graph, or a failed FP16 build gives
    ``{"fp16_engine_note": why}`` instead: the comparison never fails the stage."""
    from pipeline import onnx_io
    from pipeline.errors import PipelineError
    from pipeline.quant import autocast

    if plan.check_only or not source_onnx or plan.backend is None:
        why = "a parse-and-build check is not a deployable engine" if plan.check_only else "no exported graph"
        return {"fp16_engine_note": f"not compared with FP16: {why}"}
    folder = out_dir / FP16_COMPARE_DIR
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        src = Path(source_onnx)
        half = autocast.cast_rest(onnx.load(str(src), load_external_data=False), "fp16", base_dir=str(src.parent))
        extra = {}
        if recipe.build.embedding_lookup == "runtime":
            extra["fp16_table_bytes"] = embedding.cut(half, base_dir=src.parent).nbytes
        onnx_io.save_model_atomic(half, folder / "model.fp16.onnx", base_dir=src.parent)
        del half
        probe = FailureContext(context.resolved, context.dynamic, frozenset(), {})
        built = build_engine(plan.backend, plan.targets, folder / "model.fp16.onnx", recipe.build,
                             folder / "timing.cache", [], probe)
        size = len(built.plan)
    except PipelineError as e:
        return {"fp16_engine_note": f"not compared with FP16: its build failed: {str(e).splitlines()[0]}"}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"fp16_engine_bytes": size, **extra}


#: build.embedding_lookup: runtime: the graph the engine is built from (the quantized graph without its
#: embedding Gather), kept beside it so that trtexec.sh rebuilds the same engine
ENGINE_GRAPH = "model.engine_input.onnx"


def _lookup_outside(model: onnx.ModelProto, found: embedding.EmbeddingCut, onnx_path: Path, out_dir: Path
                    ) -> tuple[Path, onnx.ModelProto, dict[str, Any]]:
    """``build.embedding_lookup: runtime``: save ``model``, already cut by :func:`pipeline.trt.embedding.cut`
    (which gave ``found``; its external weights, if any, relative to ``onnx_path``'s folder), as
    :data:`ENGINE_GRAPH` and the table as :data:`pipeline.trt.embedding.TABLE_FILE` in ``out_dir``.
    Returns the graph's path, the graph (without external weights) and the stamp's ``embedding_lookup``
    record."""
    from pipeline import onnx_io

    path = onnx_io.save_model_atomic(model, out_dir / ENGINE_GRAPH, base_dir=onnx_path.parent)
    record = embedding.write_table(found, out_dir)
    return path, onnx.load(str(path), load_external_data=False), record


def _bisected(crash: BuilderCrash, plan: engine_backends.BuildPlan, onnx_path: Path, recipe: Recipe,
              context: FailureContext, folder: Path, time_limit_s: float,
              quantized_nodes: list[str] | None) -> BuilderCrash:
    """``crash`` with what :func:`pipeline.trt.bisect.reduce_crash` found: each candidate is built
    in a child as the graph was (no plan kept, a scratch timing cache) and counts when the child
    dies of the same signal."""
    from pipeline.trt import bisect as engine_bisect

    def crashes(path: Path, resolved: list, dynamic: list[str]) -> bool:
        probe = FailureContext(resolved, dynamic, frozenset(), {})
        args = (plan.backend, plan.targets, path, recipe.build, folder / ".bisect.tmp-timing.cache", probe)
        out = run_child(args, keep_plan=False, timeout_s=max(1.0, deadline - time.perf_counter()), quiet=True)
        return out.crashed and out.signal_name == crash.signal_name

    deadline = time.perf_counter() + time_limit_s
    log.warning("build: %s crashed; bisecting the graph for up to %.0f s (build --bisect-crash)",
                plan.backend.label if plan.backend else "the builder", time_limit_s)
    red = engine_bisect.reduce_crash(onnx_path, context.resolved, context.dynamic, crashes, folder, time_limit_s,
                                     quantized_nodes)
    return BuilderCrash(f"{crash}\n{red.describe()}", signal_name=crash.signal_name, step=crash.step,
                        exitcode=crash.exitcode)


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


