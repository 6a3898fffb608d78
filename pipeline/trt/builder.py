"""TensorRT and TensorRT-RTX engine builds, one code path: parse the explicit-Q/DQ ONNX file
into a strongly typed network, add the optimization profiles, attach the timing cache and
build a serialized engine. A parser or builder failure names the node, its operator and the
profiles' shapes, and whose fault it is (:class:`FailureContext`).

Each parse + build runs in a child process (:func:`build_engine`, as Model Navigator does): a
native crash inside TensorRT (a SIGFPE or SIGSEGV in ``build_serialized_network``) kills the
child, not the pipeline, and becomes a :class:`BuilderCrash` naming the step, the signal, the
target and the graph. The child is a fork of a fork server (:mod:`multiprocessing`'s
``forkserver``): a fresh interpreter that imported this module once, so a child starts in
milliseconds, holds none of the parent's threads, locks or CUDA state, and builds the bytes an
in-process build would (the plan comes back through a pipe as it is).

Every call into TensorRT sits in a small annotated function so mypy checks it against
``tensorrt-stubs`` (tests/unit/trt/test_typecheck.py). The build stage
(:mod:`pipeline.stages.build`) drives this module.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx
import psutil

from pipeline.trt import report as engine_report
from pipeline.artifacts import ResolvedProfile
from pipeline.trt.backends import TENSORRT, Backend
from pipeline.errors import EXIT_INTERNAL, InternalError, MemoryFault, PipelineError
from pipeline.faults import fault_point
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


class BuilderCrash(PipelineError):
    """The builder's process died of a signal (SIGFPE, SIGSEGV, SIGABRT, ...) or exited without
    a result while parsing or building a graph the checks accepted: a defect in TensorRT /
    TensorRT-RTX, or in the quantized graph the pipeline handed it, not bad input (exit 3).
    ``signal_name`` is None when the child exited without a signal; ``step`` is where it was."""

    exit_code = EXIT_INTERNAL

    def __init__(self, message: str, *, signal_name: str | None = None, step: str = "", exitcode: int | None = None):
        super().__init__(message)
        self.signal_name, self.step, self.exitcode = signal_name, step, exitcode


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


#: Run each parse + build in a child process (:func:`build_engine`). Tests that put a fake
#: ``tensorrt`` module into ``sys.modules`` or patch this module's functions set it False: a
#: child of the fork server imports the real modules afresh.
ISOLATED = True
#: Modules the fork server imports once, so each child starts with them.
_PRELOAD = ["pipeline.trt.builder"]
#: The steps a child reports before it enters them (what a crash message names).
STEPS = {"start": "starting the builder", "parse": "OnnxParser.parse_from_file",
         "configure": "setting up the builder config and profiles", "build": "build_serialized_network",
         "serialize": "returning the plan"}
#: Seconds a child that sent its answer may take to exit before it is killed.
EXIT_WAIT_S = 60.0
#: Signals that mean a native defect (a crash), not an outside kill.
CRASH_SIGNALS = {"SIGFPE": "floating-point exception", "SIGSEGV": "segmentation fault", "SIGABRT": "abort",
                 "SIGBUS": "bus error", "SIGILL": "illegal instruction", "SIGTRAP": "trap", "SIGSYS": "bad system call"}


def build_engine(
    backend: Backend,
    targets: Sequence[str],
    onnx_path: Path,
    build: BuildConfig,
    timing_cache: Path,
    notes: list[str],
    context: FailureContext,
) -> BuiltEngine:
    """Parse, configure and build with ``backend`` (:func:`build_here`) in a child process
    (:data:`ISOLATED`); save the timing cache where it has one.

    ``targets``: compute capabilities for a cross-target backend (TensorRT-RTX;
    ignored by datacenter TensorRT). ``notes`` receives what the report should say
    (e.g. the timing cache was unreadable and an empty one was used).

    Raises:
        EngineBuildError / InsertedNodeRejected: parser errors (each with node name and
            operator), an invalid optimization profile, or a failed build (with the builder's
            error log); all with the profiles' shapes.
        BuilderCrash: the builder's process died of a signal or exited without a result (exit 3).
        MemoryFault: it was killed with SIGKILL, as the kernel's OOM killer does (exit 4).
    """
    args = (backend, list(targets), onnx_path, build, timing_cache, context)
    if not ISOLATED:
        return build_here(backend, targets, onnx_path, build, timing_cache, context, notes)
    outcome = run_child(args)
    if outcome.result is not None:
        built, child_notes = outcome.result
        notes += child_notes
        return built
    raise outcome.error(backend, targets, onnx_path, context)


def build_here(
    backend: Backend,
    targets: Sequence[str],
    onnx_path: Path,
    build: BuildConfig,
    timing_cache: Path,
    context: FailureContext,
    notes: list[str],
    step: Callable[[str], None] = lambda name: None,
) -> BuiltEngine:
    """The build itself, in this process: parse, configure, build, save the timing cache.
    ``step(name)`` is called before each of :data:`STEPS`; :func:`build_engine` documents the rest."""
    messages: list[str] = []
    start = time.perf_counter()
    with PeakRSS() as mem, no_collection():
        logger = make_logger(backend, messages)
        builder: trt.Builder = backend.module().Builder(logger)
        network = create_network(backend, builder)
        step("parse")
        fault_point("builder:parse")
        parse_onnx(backend, network, logger, onnx_path, context)
        summary = engine_report.summarize_network(network)
        step("configure")
        config = create_config(backend, builder, build)
        backend.select_targets(config, targets)
        cache = attach_timing_cache(config, timing_cache, notes) if backend.timing_cache else None
        for prof in context.resolved:
            add_profile(backend, builder, config, prof, context.dynamic)
        step("build")
        fault_point("builder:build", present=(network.get_layer(i).name for i in range(network.num_layers)))
        plan = builder.build_serialized_network(network, config)
    if plan is None:
        log_tail = "\n".join(messages[-30:])
        raise context.error(f"{backend.label} build_serialized_network failed for {onnx_path}:\n{log_tail}",
                            _nodes_named_in(messages, context.ops))
    step("serialize")
    if cache is not None:
        save_timing_cache(cache, timing_cache)
        cache_note = f"{timing_cache} (loaded and saved)"
    else:
        cache_note = (f"not used: {backend.label} ignores timing caches (its timing-cache calls are deprecated "
                      f"no-ops), so build.timing_cache {timing_cache} was neither read nor written")
    return BuiltEngine(memoryview(plan), time.perf_counter() - start, mem.peak_mib, summary, cache_note)


# --- the child process ---------------------------------------------------------------------


@dataclass
class ChildOutcome:
    """What a build child left: ``result`` (the engine and the notes) when it built, else how it
    ended: ``raised`` (an error it raised and sent back), or ``exitcode`` (negative: the signal
    that killed it), the ``step`` it was in, its last log lines and its peak resident memory."""

    result: tuple[BuiltEngine, list[str]] | None = None
    raised: BaseException | None = None
    exitcode: int | None = None
    step: str = "start"
    log_tail: list[str] = field(default_factory=list)
    peak_rss_mib: float = 0.0
    timed_out: bool = False

    @property
    def signal_name(self) -> str | None:
        """``SIGFPE`` etc. when a signal killed the child, else None."""
        if self.exitcode is None or self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    @property
    def crashed(self) -> bool:
        """The child died without a result or an error of its own (a signal, or an exit)."""
        return self.result is None and self.raised is None and not self.timed_out

    def error(self, backend: Backend, targets: Sequence[str], onnx_path: Path, context: FailureContext) -> BaseException:
        """The exception for a child that did not build: the one it raised, or
        :class:`MemoryFault` (SIGKILL) / :class:`BuilderCrash` (any other death)."""
        if self.raised is not None:
            return self.raised
        return crash_error(self, backend, targets, onnx_path, context)


def crash_error(outcome: ChildOutcome, backend: Backend, targets: Sequence[str], onnx_path: Path,
                context: FailureContext) -> PipelineError:
    """:class:`MemoryFault` for a child killed with SIGKILL (the kernel's OOM killer, most likely),
    else :class:`BuilderCrash` naming the step, the signal, the target and the graph, with the ways
    around it."""
    sig = outcome.signal_name
    what = f"{backend.label} {backend.version()}"
    target = f"for {', '.join(targets)}" if backend.cross_targets and targets else "for this machine's GPU"
    step = STEPS.get(outcome.step, outcome.step)
    tail = "".join(f"\n  {line}" for line in outcome.log_tail[-8:])
    if sig == "SIGKILL":
        vm = psutil.virtual_memory()
        return MemoryFault(
            f"build: the {what} builder process was killed with SIGKILL in {step} {target} on {onnx_path}, as the "
            f"kernel's OOM killer does: its resident memory had reached {outcome.peak_rss_mib:,.0f} MiB; this machine "
            f"has {vm.total / 2**30:.1f} GiB, {vm.available / 2**30:.1f} GiB available now. Free memory (other jobs), "
            "lower build.workspace_mib or build.builder_optimization_level, or build on a machine with more; earlier "
            "stages stay cached" + (f"\nlast builder messages:{tail}" if tail else ""))
    how = (f"crashed with {sig} ({CRASH_SIGNALS[sig]})" if sig in CRASH_SIGNALS
           else f"was killed by {sig}" if sig else f"exited with status {outcome.exitcode} without a result")
    return BuilderCrash(
        f"build: {what} {how} in {step} {target} on {onnx_path}; the builder ran in a child process, so only it "
        "died: earlier stages stay cached\n"
        f"profile shapes:\n{context.shapes()}\n"
        + (f"last builder messages:{tail}\n" if tail else "")
        + f"A native crash of the builder on a graph the checks accepted is a defect in {what} (or in the quantized "
        "graph the pipeline made), not in the recipe (exit 3). Ways around it:\n"
        "  - build --bisect-crash: reduce the graph to the smallest subgraph that still crashes, saved with the "
        "names of its nodes, to exclude them from quantization (quantize.exclude.nodes)\n"
        "  - build.backend: none: no engine; the ONNX graph is validated and served with ONNX Runtime\n"
        f"  - another {backend.label} version; report the crash to NVIDIA with the graph",
        signal_name=sig, step=outcome.step, exitcode=outcome.exitcode)


def run_child(args: tuple, *, keep_plan: bool = True, timeout_s: float | None = None, quiet: bool = False) -> ChildOutcome:
    """Run :func:`build_here` on ``args`` (backend, targets, onnx_path, build, timing_cache, context)
    in a child process (a fork of the fork server) and wait for it, forwarding its log records to
    this process's loggers and sampling its resident memory. ``keep_plan`` False: the plan is not
    sent back (a crash probe). The child is killed when the wait ends early (Ctrl-C, SIGTERM) or
    runs past ``timeout_s`` (then ``timed_out``). ``quiet``: its records are logged at debug
    level here (a bisect's many builds)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    ours, theirs = ctx.Pipe(duplex=False)
    level = log.getEffectiveLevel()  # records below it are not even made in the child
    proc = ctx.Process(target=_child_main, args=(theirs, dict(os.environ), os.getcwd(), level, args, keep_plan),
                       name="engine-builder", daemon=True)
    with _main_script_hidden():
        proc.start()
    theirs.close()
    outcome = ChildOutcome()
    try:
        _receive(ours, proc, outcome, None if timeout_s is None else time.monotonic() + timeout_s, quiet)
        # after its answer the child only exits: a builder whose destructor hangs is killed
        proc.join(0 if outcome.timed_out else EXIT_WAIT_S if outcome.result or outcome.raised else None)
    finally:
        if proc.exitcode is None:
            proc.kill()
            proc.join()
        ours.close()
    if outcome.result is None and outcome.raised is None:
        outcome.exitcode = proc.exitcode
    return outcome


@contextlib.contextmanager
def _main_script_hidden() -> Iterator[None]:
    """Start a child without the parent's ``__main__``: multiprocessing's children first import the
    parent's main script (as ``__mp_main__``), which would re-run a caller's script that lacks the
    ``if __name__ == "__main__":`` guard. The child's code lives in this module and needs none of it."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def _receive(conn: Any, proc: Any, outcome: ChildOutcome, deadline: float | None, quiet: bool = False) -> None:
    """Read the child's messages until it sends its result or dies (then drain what it sent), or
    ``deadline`` (``time.monotonic()``) passes."""
    watch = _RssWatch(proc.pid)
    while True:
        if not conn.poll(0.05):
            watch.sample(outcome)
            if deadline is not None and time.monotonic() > deadline:
                outcome.timed_out = True
                return
            if proc.is_alive():
                continue
            if not conn.poll(0):
                return
        try:
            kind, *rest = conn.recv()
        except (EOFError, OSError):  # died mid-message, or closed its end
            return
        if kind == "log":
            name, level, text = rest
            logging.getLogger(name).log(logging.DEBUG if quiet else level, "%s", text)
            if level >= logging.WARNING:
                outcome.log_tail = (outcome.log_tail + [text])[-30:]
        elif kind == "step":
            outcome.step = rest[0]
        elif kind == "raised":
            outcome.raised = rest[0]
            return
        elif kind == "failed":  # an error that would not pickle: its type and traceback as text
            outcome.raised = InternalError(f"engine build child process: {rest[0]}\n{rest[1]}")
            return
        elif kind == "built":
            meta, child_notes = rest
            try:
                plan = conn.recv_bytes() if meta.pop("has_plan") else b""
            except (EOFError, OSError):
                return
            outcome.result = (BuiltEngine(memoryview(plan), **meta), child_notes)
            return


class _RssWatch:
    """The child's resident memory, sampled while the parent waits (its peak, for a SIGKILL's message)."""

    def __init__(self, pid: int | None):
        try:
            self.proc: psutil.Process | None = psutil.Process(pid)
        except (psutil.Error, TypeError):
            self.proc = None

    def sample(self, outcome: ChildOutcome) -> None:
        if self.proc is None:
            return
        try:
            outcome.peak_rss_mib = max(outcome.peak_rss_mib, self.proc.memory_info().rss / 2**20)
        except psutil.Error:
            self.proc = None


class _PipeLog(logging.Handler):
    """In the child: log records go to the parent, which logs them there."""

    def __init__(self, send: Callable[[tuple], None]):
        super().__init__(logging.DEBUG)
        self.send = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.send(("log", record.name, record.levelno, record.getMessage()))
        except Exception:  # noqa: BLE001  the parent went away: nothing to log to
            pass


def _child_main(conn: Any, env: dict[str, str], cwd: str, level: int, args: tuple, keep_plan: bool) -> None:
    """The child: the parent's environment and folder, SIGINT left to the parent (it kills the
    child), a SIGKILL when the parent dies; then :func:`build_here` and its result or error sent
    back through ``conn``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    lock = threading.Lock()  # TensorRT may log from its own threads

    def send(message: tuple) -> None:
        with lock:
            conn.send(message)

    root = logging.getLogger()
    root.handlers[:] = [_PipeLog(send)]
    root.setLevel(level)
    notes: list[str] = []
    try:
        backend, targets, onnx_path, build, timing_cache, context = args
        built = build_here(backend, targets, onnx_path, build, timing_cache, context, notes,
                           step=lambda name: send(("step", name)))
    except Exception as e:  # noqa: BLE001  sent to the parent, which raises it
        if not isinstance(e, PipelineError):  # a bug: keep where it happened for error.log
            e.add_note(f"raised in the engine build child process:\n{traceback.format_exc()}")
        try:
            send(("raised", e))
        except Exception:  # noqa: BLE001  it does not pickle
            send(("failed", f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    meta = {"wall_s": built.wall_s, "peak_rss_mib": built.peak_rss_mib, "network": built.network,
            "timing_cache": built.timing_cache, "has_plan": keep_plan}
    with lock:
        conn.send(("built", meta, notes))
        if keep_plan:
            conn.send_bytes(built.plan)
    conn.close()


def _die_with_parent() -> None:
    """Linux: the kernel SIGKILLs this process when its parent dies (``PR_SET_PDEATHSIG``), so a
    killed build leaves no builder running; elsewhere nothing."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


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
