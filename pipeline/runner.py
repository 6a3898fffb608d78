"""Run the stages in order with a content-addressed cache; write the manifest.

A stage's cache key hashes its recipe sections, its upstream stages' keys and
the tool versions. A stage whose key matches the ``stage.json`` left by an
earlier finished run (and whose files still exist) is not run again.
``stage.json`` is written last, atomically, so an interrupted stage is simply
re-run next time.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pydantic import TypeAdapter

from pipeline import artifacts as A
from pipeline import interrupts
from pipeline import manifest as M
from pipeline.context import Progress, StageContext
from pipeline.errors import LockHeld
from pipeline.faults import fault_point
from pipeline.memory import PeakRSS
from pipeline.provenance import code_hash
from pipeline.recipe import Recipe


@dataclass(frozen=True)
class StageDef:
    name: str
    deps: tuple[str, ...]
    artifact: type
    fn: Callable[..., Any]  # fn(ctx, *dep_artifacts) -> artifact

    def key_sections(self, recipe: Recipe) -> Any:
        return _SECTIONS[self.name](recipe)


def _export_sections(r: Recipe) -> Any:
    points = r.export.check_points or r.build.profiles[0].model_dump(mode="json")
    return [r.model.model_dump(mode="json"), r.export.model_dump(mode="json"), points]


_SECTIONS: dict[str, Callable[[Recipe], Any]] = {
    "export": _export_sections,
    "quantize": lambda r: [r.quantize.model_dump(mode="json"), r.validate_.data.model_dump(mode="json")],
    "build": lambda r: [r.build.model_dump(mode="json"), r.triton.serving and r.triton.serving.model_dump(mode="json")],
    "validate": lambda r: [r.validate_.model_dump(mode="json"), r.quantize.precision],
    "triton": lambda r: [r.triton.model_dump(mode="json"), r.model.kind, r.output_dir,
                         r.validate_.generation and r.validate_.generation.model_dump()],
}


def _stages() -> list[StageDef]:
    from pipeline.stages import build, export, quantize, triton, validate

    return [
        StageDef("export", (), A.ExportArtifact, export.run),
        StageDef("quantize", ("export",), A.QuantizedArtifact, quantize.run),
        StageDef("build", ("export", "quantize"), A.BuildArtifact, _build),
        # validate measures the engine when one was built: the gate is on what ships
        StageDef("validate", ("export", "quantize", "build"), A.ValidationArtifact, validate.run),
        StageDef("triton", ("export", "quantize", "build"), A.TritonArtifact, triton.run),
    ]


def _build(ctx: StageContext, exp: A.ExportArtifact, q: A.QuantizedArtifact) -> A.BuildArtifact:
    from pipeline.stages import build

    return build.run(ctx.recipe, q.onnx_path, exp.inputs, ctx.stage_dir,
                     quantized_nodes=q.quantized_nodes, source_onnx=exp.onnx_path)


@dataclass
class RunResult:
    manifest: dict
    manifest_path: Path
    passed: bool
    artifacts: dict[str, Any] = field(default_factory=dict)


def stage_key(stage: StageDef, recipe: Recipe, dep_keys: list[str], versions: dict) -> str:
    payload = {"stage": stage.name, "sections": stage.key_sections(recipe), "deps": dep_keys, "versions": versions}
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
    M.write_json_atomic(stage_dir / "stage.json", {"key": key, "artifact": A.to_jsonable(art), "record": record})


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
                 locked: bool = False) -> RunResult:
    """Run every stage and write the manifest (with ``only``: the stages through the last one
    named, no manifest written, no gate; for tests and tools).

    Args:
        locked: refuse (exit 2) a recipe whose quantize stage would run the accuracy-budget
            search because its pinned tuning result is missing or stale (:mod:`pipeline.quant.pin`).

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
            arts = _walk(recipe, recipe_path, run_dir, progress, man := {}, upto=last)[0]
            return RunResult(man, run_dir / "manifest.json", True, arts)
        return _run(recipe, recipe_path, run_dir, progress, locked=locked)


def run_tune(recipe: Recipe, recipe_path: Path, *, quiet: bool = False) -> tuple[A.QuantizedArtifact, Path]:
    """``tune``: export (cached) and quantize with calibration and the search run anew, ignoring
    any pin; returns the quantize artifact and its candidate pin (``quantize/tuned.json``).

    Raises:
        PipelineError: as :func:`run_pipeline`; GateFailed when the budget is unreachable.
    """
    from pipeline.quant import pin

    run_dir = Path(recipe.work_dir) / recipe.name
    with run_lock(run_dir):
        arts = _walk(recipe, recipe_path, run_dir, Progress(quiet), {}, pin_ignore=True, upto="quantize")[0]
    return arts["quantize"], run_dir / "quantize" / pin.CANDIDATE


def _key_versions(versions: dict, inputs: dict) -> dict:
    """What of :func:`pipeline.provenance.tool_versions` and the manifest's inputs enters stage
    keys: tool versions and input hashes, never paths, the CPU or the whole package's code hash
    (each stage adds its own code's, :func:`pipeline.provenance.code_hash`)."""
    kept = {k: v for k, v in versions.items() if k not in ("trt-pipeline", "cpu")}
    return {**kept, "inputs": {k: v.get("sha256") for k, v in inputs.items()}}


#: stage -> the module whose import closure is its code (default ``pipeline.stages.<name>``)
_STAGE_MODULES: dict[str, str] = {}


def _run(recipe: Recipe, recipe_path: Path, run_dir: Path, progress: Progress, *, locked: bool = False) -> RunResult:
    _repair_published(recipe, progress)
    man: dict = {}
    arts, _ = _walk(recipe, recipe_path, run_dir, progress, man, locked=locked)
    return _finish(man, arts, run_dir, recipe)


def _walk(recipe: Recipe, recipe_path: Path, run_dir: Path, progress: Progress, man: dict, *,
          locked: bool = False, pin_ignore: bool = False, upto: str | None = None) -> tuple[dict, dict]:
    """Run the stages in order (through ``upto``), filling ``man``; returns (artifacts, keys)."""
    from pipeline.quant import pin

    versions = M.tool_versions()
    man.update(M.new_manifest(recipe, recipe_path, versions))
    versions = _key_versions(versions, man["inputs"])
    found = pin.lookup(recipe, recipe_path, man["inputs"], ignore=pin_ignore)
    if locked:
        pin.check_locked(recipe, found)
    man["tuning"] = {"source": pin.PINNED if found.pinned is not None else pin.SEARCHED,
                     "pin": str(found.path), "reason": found.reason}
    arts: dict[str, Any] = {}
    keys: dict[str, str] = {}
    for stage in _stages():
        interrupts.check()  # a SIGTERM whose KeyboardInterrupt a GC callback swallowed (CLI handler)
        ctx = StageContext(recipe, recipe_path, run_dir, stage.name, progress, pin=found)
        extra = {"pin": found.key()} if stage.name == "quantize" else {}
        code = {"code": code_hash(_STAGE_MODULES.get(stage.name, f"pipeline.stages.{stage.name}"))}
        keys[stage.name] = stage_key(stage, recipe, [keys[d] for d in stage.deps], {**versions, **code, **extra})
        gate_failed = "validate" in arts and not arts["validate"].passed
        if stage.name == "triton" and gate_failed:
            man["stages"]["triton"] = M.stage_record("skipped", "accuracy gate failed: nothing is published")
            continue
        arts[stage.name] = _run_stage(stage, ctx, keys[stage.name], arts, man)
        if stage.name == upto:
            break
    return arts, keys


def _repair_published(recipe: Recipe, progress: Progress) -> None:
    """Complete a publish into output_dir that a crash interrupted (see pipeline.triton.publish)."""
    from pipeline.triton import publish

    note = publish.recover(Path(recipe.output_dir))
    if note:
        progress.print(f"[yellow]{note}[/yellow]")
    publish.remove_leftovers(Path(recipe.output_dir), recipe.name)


def _publish_problems(stage: StageDef, art: Any, recipe_name: str) -> list[str]:
    """Why a cached triton stage no longer counts (empty: it does): its models must still be
    assigned to this recipe in repository.json and byte-identical to what it published."""
    if stage.name != "triton":
        return []
    from pipeline.triton import publish

    return publish.verify_repository(Path(art.repository), art.models, recipe=recipe_name)


def _run_stage(stage: StageDef, ctx: StageContext, key: str, arts: dict, man: dict) -> Any:
    cached = _load_cached(stage, ctx.run_dir / stage.name, key)
    problems = _publish_problems(stage, cached, ctx.recipe.name) if cached is not None else []
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        ctx.progress.print(f"[yellow]{stage.name}[/yellow]: {problems[0]}{more}; republishing")
        cached = None
    if cached is not None:
        prev = json.loads((ctx.run_dir / stage.name / "stage.json").read_text())["record"]
        man["stages"][stage.name] = {**prev, "cache_hit": True, "wall_s": 0.0}
        ctx.progress.print(f"[bold]{stage.name}[/bold]: cached ({prev['status']})")
        return cached
    ctx.progress.print(f"[bold]{stage.name}[/bold] ...")
    # The old record goes first: a crash while the stage rewrites its files must not leave a
    # record that a later run with the old key would trust.
    (ctx.run_dir / stage.name / "stage.json").unlink(missing_ok=True)
    start = time.perf_counter()
    try:
        with PeakRSS() as mem:
            fault_point(f"stage:{stage.name}:start")
            art = stage.fn(ctx, *(arts[d] for d in stage.deps))
            fault_point(f"stage:{stage.name}:end")
    except (Exception, KeyboardInterrupt) as e:
        err = _named_ort_error(e, stage.name)
        man["stages"][stage.name] = M.stage_record("failed", f"{type(err).__name__}: {err}", time.perf_counter() - start)
        M.write_outputs(man, ctx.run_dir)
        if err is not e:
            raise err from e
        raise
    status = getattr(art, "status", "ok")
    note = getattr(art, "reason", "") or getattr(art, "summary", "")
    record = M.stage_record(status, note, time.perf_counter() - start, mem.peak_mib)
    man["stages"][stage.name] = {**record, "cache_hit": False}
    _commit(ctx.run_dir / stage.name, key, art, record)
    return art


def _named_ort_error(e: BaseException, stage: str) -> BaseException:
    """An ONNX Runtime failure named by its stage: an :class:`OrtRunError` gets ``stage``; a bare
    onnxruntime exception (a call site that does not say which graph) becomes one, exit 3."""
    from pipeline.runtime import OrtRunError, is_ort_error

    if isinstance(e, OrtRunError):
        e.stage = e.stage or stage
    elif is_ort_error(e):
        return OrtRunError(e, "a graph", None, user_graph=False, stage=stage)
    return e


def _finish(man: dict, arts: dict, run_dir: Path, recipe: Recipe) -> RunResult:
    val: A.ValidationArtifact = arts["validate"]
    man["metrics"] = val.metrics
    man["gates"] = [{**A.to_jsonable(g), "message": g.message} for g in val.gates]
    man["verdict"] = "pass" if val.passed else "fail"
    man["artifacts"] = {k: A.to_jsonable(v) for k, v in arts.items()}
    man["sections"] = _report_sections(run_dir)
    path = M.write_outputs(man, run_dir)
    return RunResult(man, path, val.passed, arts)


#: report.md sections that stages leave as Markdown files in their folders.
_SECTION_FILES = {"Quantization sensitivity": "quantize/sensitivity.md",
                  "Accuracy budget": "quantize/budget.md",
                  "Engine build": "build/engine.md",
                  "Engine vs ONNX Runtime": "validate/engine_vs_onnxruntime.md",
                  "Deploy notes": "triton/deploy_notes.md"}


def _report_sections(run_dir: Path) -> dict[str, dict]:
    return {title: {"markdown": (run_dir / rel).read_text(), "file": rel}
            for title, rel in _SECTION_FILES.items() if (run_dir / rel).is_file()}
