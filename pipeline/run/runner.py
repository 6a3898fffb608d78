"""Run the stages in order with a content-addressed cache; write the manifest.

Each module of :data:`STAGES` declares itself: ``NAME``, ``NEEDS`` (the stages whose
artifacts it takes, in order), ``ARTIFACT`` (its artifact type), ``key_sections(recipe)``
(what of the recipe it reads) and ``run(ctx, *needed_artifacts)``; optionally
``KEY_INPUTS`` (prefixes of the manifest inputs it reads; default all), ``key_extra(ctx)``
(more key inputs), ``GATED`` (skipped once a verdict failed) and
``cached_problems(artifact, recipe_name)`` (why a cached artifact no longer counts). The
runner knows no recipe section and no stage by name: it walks them.

A stage's cache key hashes its recipe sections, its upstream stages' keys, the tool
versions, its own code (the import closure of its module) and the content of the input
files it reads (a new tuning split re-runs quantize onward, not the export). A stage whose key matches the ``stage.json`` left by an
earlier finished run (and whose files still exist) is not run again.
``stage.json`` is written last, atomically, so an interrupted stage is simply
re-run next time.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Protocol

from pydantic import TypeAdapter

from pipeline import artifacts as A
from pipeline import fsutil, interrupts, provenance
from pipeline.run import report as M
from pipeline.context import Progress, RunStart, StageContext
from pipeline.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERNAL,
    InternalError,
    LockHeld,
    PipelineError,
    StorageFault,
    storage_fault,
    storage_oserror,
)
from pipeline.faults import fault_point
from pipeline.fsutil import remove_scratch
from pipeline.memory import PeakRSS, frozen_between_stages, memory_fault, release_freed
from pipeline.provenance import code_hash, portable
from pipeline.recipe.schema import Recipe


#: The stage modules, in the order a run walks them (each after the stages it needs).
STAGES = ("pipeline.stages.export", "pipeline.stages.quantize", "pipeline.stages.build",
          "pipeline.stages.validate", "pipeline.stages.triton")


@dataclass(frozen=True)
class StageDef:
    """One stage module, as the runner sees it (the module's own declarations)."""
    module: ModuleType

    @property
    def name(self) -> str:
        return self.module.NAME

    @property
    def deps(self) -> tuple[str, ...]:
        return tuple(self.module.NEEDS)

    @property
    def artifact(self) -> type:
        return self.module.ARTIFACT

    @property
    def fn(self) -> Callable[..., Any]:  # fn(ctx, *needed artifacts) -> artifact
        return self.module.run

    @property
    def gated(self) -> bool:
        return bool(getattr(self.module, "GATED", False))

    def key_sections(self, recipe: Recipe) -> Any:
        return self.module.key_sections(recipe)

    def key_extra(self, ctx: StageContext) -> dict:
        extra = getattr(self.module, "key_extra", None)
        return extra(ctx) if extra else {}

    def cached_problems(self, art: Any, recipe: Recipe) -> list[str]:
        check = getattr(self.module, "cached_problems", None)
        return check(art, recipe) if check else []

    def before_run(self, start: RunStart) -> dict:
        """The module's ``before_run`` hook (:class:`pipeline.context.RunStart`): its StageContext fields."""
        hook = getattr(self.module, "before_run", None)
        return dict(hook(start) or {}) if hook else {}

    def key_inputs(self, inputs: dict[str, str | None]) -> dict[str, str | None]:
        """The manifest inputs (name -> sha256) the stage reads itself: those named by the module's
        ``KEY_INPUTS`` prefixes, every one when it declares none. What upstream stages read enters
        through their keys."""
        prefixes = getattr(self.module, "KEY_INPUTS", None)
        return dict(inputs) if prefixes is None else {k: v for k, v in inputs.items() if k.startswith(tuple(prefixes))}

    @property
    def engine_free(self) -> bool:
        """Whether no TensorRT version enters the key (``ENGINE_FREE``): a CPU runner without
        TensorRT and a GPU runner with it share the stage (:mod:`pipeline.remote.cache`)."""
        return bool(getattr(self.module, "ENGINE_FREE", False))


def _stages() -> list[StageDef]:
    """The stages of :data:`STAGES`, checked: each needs only stages walked before it.

    Raises:
        InternalError: a stage needs one that is unknown or comes later.
    """
    stages = [StageDef(importlib.import_module(name)) for name in STAGES]
    seen: list[str] = []
    for stage in stages:
        if missing := [d for d in stage.deps if d not in seen]:
            raise InternalError(f"stage {stage.name} ({stage.module.__name__}) needs {missing}, "
                              f"which do not run before it (order: {[s.name for s in stages]})")
        seen.append(stage.name)
    return stages


class SharedCache(Protocol):
    """A stage cache shared by runners (:class:`pipeline.remote.cache.RemoteCache`), handed
    in by the CLI: this layer does not import the remote one."""

    url: str

    def pull(self, ctx: StageContext, key: str) -> dict | None:
        """Place the stage's files for ``key``; its ``{"artifact", "record"}``, or None (a miss)."""

    def push(self, ctx: StageContext, key: str, stage_json: dict) -> str:
        """Share a stage that ran (``stage.json``'s content); "pushed", "present", "failed" or "off"."""

    def summary(self) -> dict:
        """The manifest's ``remote_cache`` entry."""


@dataclass
class RunResult:
    manifest: dict
    manifest_path: Path
    passed: bool
    artifacts: dict[str, Any] = field(default_factory=dict)


def stage_key(stage: StageDef, recipe: Recipe, dep_keys: list[str], versions: dict) -> str:
    payload = {"stage": stage.name, "sections": portable(stage.key_sections(recipe)), "deps": dep_keys,
               "versions": versions}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _load_cached(stage: StageDef, stage_dir: Path, key: str) -> Any | None:
    marker = stage_dir / "stage.json"
    if not marker.is_file():
        return None
    data = json.loads(marker.read_text())
    if data.get("key") != key:
        return None
    art = TypeAdapter(stage.artifact).validate_python(data["artifact"])
    paths = _paths(art)
    if not all(Path(p).exists() for p in paths):
        return None
    # An ONNX output that no longer loads (truncated or missing data file) is a miss.
    from pipeline.onnx_io import check_loadable

    return None if any(check_loadable(p) for p in paths if p.endswith(".onnx")) else art


def _paths(art: Any) -> list[str]:
    """Files and folders a cached artifact needs (for a repository: each model folder)."""
    d = A.to_jsonable(art)
    paths = [v for k, v in d.items() if isinstance(v, str) and (k.endswith("_path") or k == "repository")]
    return paths + [str(Path(d["repository"]) / m) for m in d.get("models", [])]


def _commit(stage_dir: Path, key: str, art: Any, record: dict) -> None:
    fsutil.write_json_atomic(stage_dir / "stage.json", {"key": key, "artifact": A.to_jsonable(art), "record": record})


@contextlib.contextmanager
def run_lock(run_dir: Path):
    """Exclusive lock per recipe run dir; a second build fails at once, clearly."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / ".lock"
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            raise LockHeld(
                f"another build holds {path} (pid {fh.read().strip() or '?'}); wait for it to finish"
            ) from None
        fh.seek(0), fh.truncate(), fh.write(str(os.getpid())), fh.flush()
        yield


def run_pipeline(recipe: Recipe, recipe_path: Path, *, quiet: bool = False, only: list[str] | None = None,
                 locked: bool = False, remote: SharedCache | None = None, unpinned: str = "",
                 bisect_crash_s: float | None = None) -> RunResult:
    """Run every stage and write the manifest (with ``only``: the stages through the last one
    named, no manifest written, no gate; for tests and tools).

    Args:
        locked: refuse (exit 2) a recipe whose quantize stage would run the accuracy-budget
            search because its pinned tuning result is missing or stale (:mod:`pipeline.quant.pin`).
        remote: a shared stage cache: a local miss is pulled from it when its key is there
            (verified; the manifest's stage record says ``cache_source: remote``), and every
            stage that ran is pushed to it. None: the local cache alone.
        unpinned: why no pinned tuning result applies (``build --test``'s random copy); the
            quantize stage then calibrates and searches, and the manifest gives this reason.
        bisect_crash_s: when the engine builder crashes, the build stage reduces the graph to
            the smallest crashing subgraph within this many seconds (``build --bisect-crash``).

    Returns a RunResult; ``passed`` is False when an accuracy gate failed.

    Raises:
        PipelineError: a stage failed; the manifest records which, and why.
        RecipeError: ``locked`` and no matching pin.
    """
    run_dir = Path(recipe.work_dir) / recipe.name
    progress = Progress(quiet)
    with run_lock(run_dir):
        if only:
            last = max((s.name for s in _stages() if s.name in only), key=[s.name for s in _stages()].index)
            arts = _walk(recipe, recipe_path, run_dir, progress, man := {}, upto=last, remote=remote,
                         bisect_crash_s=bisect_crash_s)[0]
            return RunResult(man, run_dir / "manifest.json", True, arts)
        return _run(recipe, recipe_path, run_dir, progress, locked=locked, remote=remote, unpinned=unpinned,
                    bisect_crash_s=bisect_crash_s)


def run_tune(recipe: Recipe, recipe_path: Path, *, quiet: bool = False) -> tuple[A.QuantizedArtifact, Path]:
    """``tune``: export (cached) and quantize with calibration and the search run anew, ignoring
    any pin; returns the quantize artifact and its candidate pin (``quantize/tuned.json``).

    Raises:
        PipelineError: as :func:`run_pipeline`; GateFailed when the budget is unreachable.
    """
    from pipeline.quant import pin

    run_dir = Path(recipe.work_dir) / recipe.name
    with run_lock(run_dir):
        arts = _walk(recipe, recipe_path, run_dir, Progress(quiet), {}, pin_ignore=pin.TUNE_IGNORES, upto="quantize")[0]
    return arts["quantize"], run_dir / "quantize" / pin.CANDIDATE


def _key_versions(versions: dict) -> dict:
    """What of :func:`pipeline.provenance.tool_versions` enters stage keys: tool versions, never
    the CPU or the whole package's code hash (each stage adds its own code's,
    :func:`pipeline.provenance.code_hash`, and the hashes of the inputs it reads, never their paths)."""
    return {k: v for k, v in versions.items() if k not in ("trt-pipeline", "cpu")}


#: tool versions that enter only the keys of stages that are not ENGINE_FREE
_ENGINE_TOOLS = ("tensorrt", "tensorrt-rtx")


def _run(recipe: Recipe, recipe_path: Path, run_dir: Path, progress: Progress, *, locked: bool = False,
         remote: SharedCache | None = None, unpinned: str = "", bisect_crash_s: float | None = None) -> RunResult:
    _note_another_recipe(recipe, recipe_path, run_dir, progress)
    remove_scratch(run_dir)  # a killed run's half-written manifest.json / report.md (the run lock is held)
    man: dict = {}
    arts, _ = _walk(recipe, recipe_path, run_dir, progress, man, locked=locked, remote=remote, pin_ignore=unpinned,
                    bisect_crash_s=bisect_crash_s)
    return _finish(man, arts, run_dir, recipe)


def _walk(recipe: Recipe, recipe_path: Path, run_dir: Path, progress: Progress, man: dict, *,
          locked: bool = False, pin_ignore: str = "", upto: str | None = None,
          remote: SharedCache | None = None, bisect_crash_s: float | None = None) -> tuple[dict, dict]:
    """Run the stages in order (through ``upto``), filling ``man``; returns (artifacts, keys). The hooks of
    the stages walked (``before_run``: the quantize stage's pin lookup and ``--locked`` check, the triton
    stage's publish repair) run first, before any stage."""
    versions = provenance.tool_versions()
    hashed = provenance.inputs(M.input_sources(recipe, Path(recipe_path).parent))  # once: manifest, pin, keys
    man.update(M.new_manifest(recipe, recipe_path, versions, hashed))
    versions = _key_versions(versions)
    inputs = {k: v.get("sha256") for k, v in hashed.items()}
    start = RunStart(recipe, Path(recipe_path), progress, hashed, man, locked=locked, pin_ignore=pin_ignore)
    fields: dict[str, Any] = {}
    for stage in _walked(upto):
        fields.update(stage.before_run(start))
    arts: dict[str, Any] = {}
    keys: dict[str, str] = {}
    with frozen_between_stages():
        _walk_stages(recipe, recipe_path, run_dir, progress, man, fields, versions, inputs, arts, keys, upto, remote,
                     bisect_crash_s)
    return arts, keys


def _walked(upto: str | None) -> list[StageDef]:
    """The stages a walk through ``upto`` (None: all) runs, in order."""
    stages = _stages()
    names = [s.name for s in stages]
    return stages if upto is None else stages[:names.index(upto) + 1]


def _walk_stages(recipe, recipe_path, run_dir, progress, man, fields, versions, inputs, arts, keys, upto, remote,
                 bisect_crash_s=None):
    for stage in _stages():
        interrupts.check()  # a SIGTERM whose KeyboardInterrupt a GC callback swallowed (CLI handler)
        ctx = StageContext(recipe, recipe_path, run_dir, stage.name, progress, bisect_crash_s=bisect_crash_s, **fields)
        code = {"code": code_hash(stage.module.__name__)}
        tools = {k: v for k, v in versions.items() if not (stage.engine_free and k in _ENGINE_TOOLS)}
        keys[stage.name] = stage_key(stage, recipe, [keys[d] for d in stage.deps],
                                     {**tools, **code, "inputs": stage.key_inputs(inputs), **stage.key_extra(ctx)})
        if stage.gated and not all(getattr(a, "passed", True) for a in arts.values()):
            man["stages"][stage.name] = M.stage_record("skipped", "accuracy gate failed: nothing is published")
            continue
        arts[stage.name] = _run_stage(stage, ctx, keys[stage.name], arts, man, remote)
        if remote is not None:
            man["remote_cache"] = remote.summary()
        if stage.name == upto:
            break


def _note_another_recipe(recipe: Recipe, recipe_path: Path, run_dir: Path, progress: Progress) -> None:
    """Say so when ``run_dir`` holds the last run of another recipe file of the same name (a copy
    built from the same folder): this run replaces its results and what it published."""
    last = M.last_manifest(run_dir).get("recipe_path")
    if last and Path(last).resolve() != Path(recipe_path).resolve():
        progress.print(f"[yellow]note: {run_dir}/ holds the last run of {last}, a recipe of the same name "
                       f"({recipe.name}); this run of {recipe_path} replaces its results and its models in "
                       f"{recipe.output_dir}/ (give the copy its own name to keep both)[/yellow]")


def _run_stage(stage: StageDef, ctx: StageContext, key: str, arts: dict, man: dict,
               remote: SharedCache | None = None) -> Any:
    cached = _usable(stage, ctx, key, "local")
    source = "local"
    if cached is None and remote is not None:
        cached, source = _pull(stage, ctx, key, remote), "remote"
    if cached is not None:
        prev = json.loads((ctx.run_dir / stage.name / "stage.json").read_text())["record"]
        man["stages"][stage.name] = {**prev, "cache_hit": True, "cache_source": source, "wall_s": 0.0}
        ctx.progress.print(f"[bold]{stage.name}[/bold]: cached{' (remote)' if source == 'remote' else ''} "
                           f"({prev['status']})")
        return cached
    art = _execute(stage, ctx, key, arts, man)
    if remote is not None:
        remote.push(ctx, key, json.loads((ctx.run_dir / stage.name / "stage.json").read_text()))
    return art


def _usable(stage: StageDef, ctx: StageContext, key: str, where: str) -> Any | None:
    """The stage's committed artifact for ``key`` if it still counts (files there; for
    triton, published and intact), else None (with a line when a published one no longer counts)."""
    cached = _load_cached(stage, ctx.run_dir / stage.name, key)
    problems = stage.cached_problems(cached, ctx.recipe) if cached is not None else []
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        what = "republishing" if where == "local" else "the stage runs here"
        ctx.progress.print(f"[yellow]{stage.name}[/yellow]: {problems[0]}{more}; {what}")
        return None
    return cached


def _pull(stage: StageDef, ctx: StageContext, key: str, remote: SharedCache) -> Any | None:
    """The stage from the shared cache, committed locally, when it is there and checks out."""
    data = remote.pull(ctx, key)
    if data is None:
        return None
    try:
        art: Any = TypeAdapter(stage.artifact).validate_python(data["artifact"])
    except ValueError as e:
        ctx.progress.print(f"[yellow]{stage.name}[/yellow]: remote entry does not read as "
                           f"{stage.artifact.__name__} ({e}); the stage runs here")
        return None
    _commit(ctx.run_dir / stage.name, key, art, data["record"])
    cached = _usable(stage, ctx, key, "remote")
    if cached is None:
        (ctx.run_dir / stage.name / "stage.json").unlink(missing_ok=True)
    return cached


def _execute(stage: StageDef, ctx: StageContext, key: str, arts: dict, man: dict) -> Any:
    ctx.progress.print(f"[bold]{stage.name}[/bold] ...")
    # The old record goes first: a crash while the stage rewrites its files must not leave a
    # record that a later run with the old key would trust.
    (ctx.run_dir / stage.name / "stage.json").unlink(missing_ok=True)
    remove_scratch(ctx.run_dir / stage.name)  # a killed run's half-written files (the run lock is held)
    start, mem = time.perf_counter(), PeakRSS()
    try:
        with mem:
            fault_point(f"stage:{stage.name}:start")
            art = stage.fn(ctx, *(arts[d] for d in stage.deps))
            fault_point(f"stage:{stage.name}:end")
    except (Exception, KeyboardInterrupt) as e:
        err = (_memory_fault(e, stage.name, mem.peak_mib) or _storage_fault(e, stage.name, ctx.run_dir / stage.name)
               or _named_ort_error(e, stage.name))
        man["stages"][stage.name] = M.stage_record("failed", f"{type(err).__name__}: {err}", time.perf_counter() - start,
                                                   mem.peak_mib)
        M.write_run_outputs(man, ctx.run_dir)
        if err is not e:
            raise err from e
        raise
    release_freed()  # the next stage's peak starts from what this one still holds
    status = getattr(art, "status", "ok")
    note = getattr(art, "reason", "") or getattr(art, "summary", "")
    record = M.stage_record(status, note, time.perf_counter() - start, mem.peak_mib)
    man["stages"][stage.name] = {**record, "cache_hit": False}
    _commit(ctx.run_dir / stage.name, key, art, record)
    return art


def _memory_fault(e: BaseException, stage: str, peak_mib: float):
    """A MemoryFault (exit 4) for an allocation failure, unless the error is one of ours with an
    exit code of its own (a gate, bad input, the environment): those keep it."""
    if isinstance(e, PipelineError) and e.exit_code != EXIT_INTERNAL:
        return None
    return memory_fault(e, stage, peak_mib)


def _storage_fault(e: BaseException, stage: str, folder: Path) -> StorageFault | None:
    """A StorageFault (exit 4) naming the stage for a full, over-quota, read-only or cross-device file
    system under ``e``, and its folder: the failing file's, or the stage's own (``folder``) where the
    OS error names no file (torch's exporter, TensorRT's builder); the error it came through follows.
    None when ``e`` is no such fault, or is one of ours with an exit code of its own but for bad
    input (a StorageFault already, a gate)."""
    if isinstance(e, PipelineError) and e.exit_code not in (EXIT_BAD_INPUT, EXIT_INTERNAL):
        return None
    err = storage_oserror(e)
    if err is None:
        return None
    fault = storage_fault(e, None if err.filename else folder)
    first = str(e).splitlines()[0] if str(e) and e is not err else ""
    return StorageFault(f"stage {stage}: {fault}" + (f"\n  (while: {first[:300]})" if first else ""))


def _named_ort_error(e: BaseException, stage: str) -> BaseException:
    """An ONNX Runtime failure named by its stage: an :class:`OrtRunError` gets ``stage``; a bare
    onnxruntime exception (a call site that does not say which graph) becomes one, exit 3."""
    from pipeline.ort_sessions import OrtRunError, is_ort_error

    if isinstance(e, OrtRunError):
        e.stage = e.stage or stage
    elif is_ort_error(e):
        return OrtRunError(e, "a graph", None, user_graph=False, stage=stage)
    return e


def _finish(man: dict, arts: dict, run_dir: Path, recipe: Recipe) -> RunResult:
    val = next(a for a in arts.values() if isinstance(a, A.ValidationArtifact))  # the verdict
    man["metrics"] = val.metrics
    man["gates"] = [{**A.to_jsonable(g), "message": g.message} for g in val.gates]
    man["verdict"] = "pass" if val.passed else "fail"
    man["artifacts"] = {k: A.to_jsonable(v) for k, v in arts.items()}
    man["sections"] = _report_sections(run_dir)
    if val.passed and (kept := _kept_publishes(man, run_dir)):
        man["published"] = kept
    path = M.write_run_outputs(man, run_dir)
    return RunResult(man, path, val.passed, arts)


def _kept_publishes(man: dict, run_dir: Path) -> list[dict]:
    """The last passing run's ``published`` entries (``publish``: its models in S3), kept when
    this run's triton stage was a cache hit with the same artifact: the same models, so what
    was published is still this run's. Else none (``deploy k8s`` then asks to publish again)."""
    import json

    if not man["stages"].get("triton", {}).get("cache_hit"):
        return []
    last = M.last_manifest(run_dir)
    same = json.loads(json.dumps(man["artifacts"].get("triton"))) == (last.get("artifacts") or {}).get("triton")
    return list(last.get("published") or []) if last.get("verdict") == "pass" and same else []


#: report.md sections that stages leave as Markdown files in their folders.
_SECTION_FILES = {"Quantization sensitivity": "quantize/sensitivity.md",
                  "Accuracy budget": "quantize/budget.md",
                  "Engine build": "build/engine.md",
                  "Engine vs ONNX Runtime": "validate/engine_vs_onnxruntime.md",
                  "Deploy notes": "triton/deploy_notes.md"}


def _report_sections(run_dir: Path) -> dict[str, dict]:
    return {title: {"markdown": (run_dir / rel).read_text(), "file": rel}
            for title, rel in _SECTION_FILES.items() if (run_dir / rel).is_file()}
