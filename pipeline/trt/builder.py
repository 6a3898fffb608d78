"""TensorRT and TensorRT-RTX engine builds, one code path: parse the explicit-Q/DQ ONNX file
into a strongly typed network, add the optimization profiles, attach the timing cache and
build a serialized engine. A parser or builder failure names the node, its operator and the
profiles' shapes, and whose fault it is (:class:`FailureContext`).

Every call into TensorRT sits in a small annotated function so mypy checks it against
``tensorrt-stubs`` (tests/unit/trt/test_typecheck.py). The build stage
(:mod:`pipeline.stages.build`) drives this module.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import onnx

from pipeline.trt import report as engine_report
from pipeline.artifacts import ResolvedProfile
from pipeline.trt.backends import TENSORRT, Backend
from pipeline.errors import EXIT_INTERNAL, PipelineError
from pipeline.fsutil import write_bytes_atomic
from pipeline.memory import PeakRSS
from pipeline.recipe.schema import BuildConfig

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)


class EngineBuildError(PipelineError):
    """The ONNX parser or the TensorRT builder rejected the graph or the profiles."""


class InsertedNodeRejected(EngineBuildError):
    """TensorRT rejected a node the pipeline inserted (a Q/DQ node, a cast): a bug in the pipeline."""

    exit_code = EXIT_INTERNAL


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


# --- failures: which node, which shapes, whose fault ---------------------------------------

INSERTED_OPS = ("QuantizeLinear", "DequantizeLinear")


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
    return frozenset(n.name for n in model.graph.node if n.op_type in INSERTED_OPS)


def node_ops(model: onnx.ModelProto) -> dict[str, str]:
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
    with PeakRSS() as mem, no_collection():
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


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """Collect garbage now, then hold Python's cyclic garbage collector off until the block ends.

    TensorRT calls the Python logger while it holds its own locks. A collection started inside that
    callback can free an earlier build's IBuilder (left in a reference cycle, e.g. by an exception's
    traceback), whose destructor waits on the same lock: a deadlock, seen with TensorRT-RTX 1.7.1
    (createInferBuilder -> PyLogger.log -> IBuilder dealloc -> pthread_mutex_lock). Objects whose
    last reference goes are still freed at once; only cycles wait for the block's end."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


#: Parser warnings that hold for every graph of this tool, logged at debug: INT64 graph inputs
#: (token ids, masks) are what the export writes, and TensorRT 10+ binds them as INT64.
ROUTINE_WARNINGS = ("has Int64 binding",)


def make_logger(backend: Backend, sink: list[str]) -> trt.ILogger:
    """A TensorRT logger forwarding to ``logging``; errors also go to ``sink``; the
    :data:`ROUTINE_WARNINGS` at debug."""
    mod = backend.module()

    class _Logger(mod.ILogger):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            mod.ILogger.__init__(self)

        def log(self, severity: trt.ILogger.Severity, msg: str) -> None:
            if int(severity) <= int(mod.ILogger.Severity.ERROR):
                sink.append(msg)
                log.error("%s: %s", backend.name, msg)
            elif int(severity) <= int(mod.ILogger.Severity.WARNING) and not any(r in msg for r in ROUTINE_WARNINGS):
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
