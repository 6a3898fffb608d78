"""Stage 4, validate: accuracy of the optimized model against the FP32
reference, and the recipe's gates, on what ships.

Both graphs run in ONNX Runtime. Where the build stage made a TensorRT engine
(status ``ok``), the same eval also runs through the engine
(:mod:`pipeline.runners.base`); its metrics are keyed ``engine.<metric>``, the
gates apply to them, and ``validate/engine_vs_onnxruntime.md`` puts the two
side by side. Without an engine the metrics say that the ONNX graph was
validated and is what gets served."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pipeline.models import text as text_data
from pipeline.runners import base as runners
from pipeline.artifacts import BuildArtifact, ExportArtifact, QuantizedArtifact, ValidationArtifact
from pipeline.context import StageContext
from pipeline.errors import RecipeError
from pipeline.fsutil import sha256_file, strict_jsonable, write_json_atomic, write_text_atomic
from pipeline.models import registry
from pipeline.models.base import ENGINE_PREFIX
from pipeline.provenance import code_hash
from pipeline.recipe.schema import Recipe
from pipeline.recipe.gates import evaluate
from pipeline.recipe.precisions import REFERENCE, facts

NAME = "validate"
# validate measures the engine when one was built: the gate is on what ships
NEEDS = ("export", "quantize", "build")
#: the manifest inputs it reads (stage keys): the eval data
KEY_INPUTS = ("validate.",)
ARTIFACT = ValidationArtifact
ENGINE = ENGINE_PREFIX  # prefix of the engine's metrics


def key_sections(r: Recipe) -> list:
    """What of the recipe validate reads: its section (data, gates) and the precision."""
    return [r.validate_.model_dump(mode="json"), r.quantize.precision]
COMPARISON_FILE = "engine_vs_onnxruntime.md"


def run(ctx: StageContext, exp: ExportArtifact, q: QuantizedArtifact, b: BuildArtifact | None = None) -> ValidationArtifact:
    """Measure, then gate. Never raises on a failed gate: the runner decides the exit code.

    Args:
        b: the build stage's artifact; with status ``ok`` the engine is measured
            too and the gates apply to its ``engine.*`` metrics.

    Raises:
        AccuracyError: the FP32 reference produced NaN (broken reference or input).
        RecipeError: ``quantize.rest_precision: bf16`` without an engine (BF16 is validated
            only through TensorRT); a statistical gate test whose metric came out
            without a standard error (:func:`pipeline.recipe.gates.evaluate`).
        RunnerError: the engine does not load or run.
    """
    engine = engine_path(b)
    _check_bf16(ctx, engine, b)
    memo = ctx.stage_dir / "metrics.json"
    args = (ctx, exp, q, b) if engine else (ctx, exp, q)
    key = _metrics_key(*args[:3], engine) if engine else _metrics_key(ctx, exp, q)
    cached = json.loads(memo.read_text()) if memo.is_file() else {}
    if cached.get("key") == key:
        metrics, tokens = cached["metrics"], cached["tokens"]
    else:
        metrics, tokens = measure(*args)
        metrics = strict_jsonable(metrics)  # NaN/inf -> null + <metric>_reason, as the cache holds them
        write_json_atomic(memo, {"key": key, "metrics": metrics, "tokens": tokens}, strict=True)
    if engine:
        write_text_atomic(ctx.stage_dir / COMPARISON_FILE, comparison_markdown(metrics))
    else:  # the metrics cache does not depend on the build; what it says about the engine does
        metrics = {**metrics, "validated_artifact": onnx_validated_note(q, b)}
    gates = evaluate(ctx.recipe.validate_.gates, metrics, prefix=ENGINE if engine else "")
    return ValidationArtifact(metrics, gates, tokens)


def engine_path(b: BuildArtifact | None) -> str | None:
    """The datacenter TensorRT engine to run, or None: none built (skipped), or a
    TensorRT-RTX engine, which is not what Triton serves and which this stage does not run."""
    return b.plan_path if b is not None else None


def onnx_validated_note(q: QuantizedArtifact, b: BuildArtifact | None) -> str:
    """``validated_artifact`` when ONNX Runtime measured the graph (no engine run)."""
    why = unrun_engine_note(b) or ": no TensorRT engine was built, so this graph is what gets served"
    row = facts(q.precision)
    if row.cpu_decoded:  # NVFP4: ONNX Runtime ran the decoded twin, TensorRT builds the FP4 graph
        return (f"ONNX graph {q.ort_path} in ONNX Runtime ({row.cpu_simulation}; the {q.precision.upper()} graph "
                f"TensorRT builds is {q.onnx_path}){why}")
    return f"ONNX graph {q.ort_path} in ONNX Runtime{why}"


def unrun_engine_note(b: BuildArtifact | None) -> str:
    """Why an engine that was built is not measured here ("" when none was built)."""
    if b is None or b.status != "ok" or not b.engine_path or b.plan_path is not None:
        return ""
    stamp = json.loads(Path(b.stamp_path).read_text()) if b.stamp_path and Path(b.stamp_path).is_file() else {}
    what = "a parse-and-build check" if stamp.get("check_only") else "an engine"
    targets = ", ".join(stamp.get("targets") or ["?"])
    return (f"; {what} was built for {targets} by {stamp.get('backend_label', b.backend)} "
            f"({Path(b.engine_path).name}), not run: no GPU with the TensorRT-RTX runtime here, and Triton serves "
            "the ONNX graph")


def _check_bf16(ctx: StageContext, engine: str | None, b: BuildArtifact | None) -> None:
    rest = getattr(ctx.recipe.quantize, "rest_precision", REFERENCE)
    if not facts(rest).ort_cpu and engine is None:
        why = (unrun_engine_note(b).removeprefix("; ") or b.reason) if b is not None else "no build stage"
        raise RecipeError(
            "quantize.rest_precision: bf16 is validated only through a TensorRT engine (ONNX Runtime's CPU "
            f"provider lacks BF16 kernels), and no TensorRT engine is run here ({why}); use fp16 here, or build on a GPU")


def measure(ctx: StageContext, exp: ExportArtifact, q: QuantizedArtifact,
            b: BuildArtifact | None = None) -> tuple[dict, dict]:
    """Metrics (and greedy tokens, for generation kinds) from the kind's adapter
    (:meth:`pipeline.models.base.ModelAdapter.metrics`); ``engine.*`` ones too when
    ``b`` holds an engine, and ``validated_artifact`` saying what was measured."""
    engine = engine_path(b)
    runner = runners.tensorrt_runner(engine) if engine else None
    metrics, tokens = registry.adapter(ctx.recipe.model).metrics(ctx, exp, q, runner)
    metrics.update(quantization_metrics(q))
    if runner is None:
        metrics["validated_artifact"] = onnx_validated_note(q, b)
    else:
        metrics["validated_artifact"] = (f"TensorRT engine {engine} ({runner.name}): gates use the engine.* metrics; "
                                         "ONNX Runtime's numbers of the same graph are shown beside them")
    return metrics, tokens


def quantization_metrics(q: QuantizedArtifact) -> dict:
    """``quantized_fraction`` (weight GEMMs with Q/DQ / all weight GEMMs the quantize stage
    considered, in [0, 1]; gateable) and ``gemms_high_precision`` (count) for FP8/INT8;
    nothing for FP32/FP16 graphs."""
    total = len(q.quantized_nodes) + len(q.excluded_nodes)
    if not facts(q.precision).qdq or total == 0:
        return {}
    return {"quantized_fraction": len(q.quantized_nodes) / total, "gemms_high_precision": len(q.excluded_nodes)}


def comparison_markdown(metrics: dict) -> str:
    """A table of every metric measured both ways: ONNX Runtime beside the engine."""
    rows = ["| metric | ONNX Runtime | TensorRT engine |", "|---|---|---|"]
    for key, value in metrics.items():
        if key.startswith(ENGINE) and not key.endswith("_reason"):
            base = key[len(ENGINE):]
            rows.append(f"| {base} | {_cell(metrics.get(base))} | {_cell(value)} |")
    return "# ONNX Runtime and the TensorRT engine, same eval\n\n" + "\n".join(rows) + "\n"


def _cell(v) -> str:
    if v is None:
        return "n/a"
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _metrics_key(ctx: StageContext, exp: ExportArtifact, q: QuantizedArtifact, engine: str | None = None) -> str:
    """Everything the metrics depend on; the gates are left out, so a gate-only
    change re-evaluates the gates without re-measuring."""
    cfg = {"validate": ctx.recipe.validate_.model_dump(mode="json", exclude={"gates"}),
           "quantize": ctx.recipe.quantize.model_dump(mode="json")}  # naive baselines: its feeds
    parts = [json.dumps(cfg, sort_keys=True), sha256_file(exp.onnx_path), sha256_file(q.onnx_path), q.precision,
             *([sha256_file(q.ort_path)] if q.ort_path != q.onnx_path else []),  # the graph validate runs
             code_hash(__name__), sha256_file(engine) if engine else "no engine", text_data.recipe_data_sha256(ctx.recipe)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()
