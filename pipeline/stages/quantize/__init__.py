"""Stage 2, quantize: explicit Q/DQ (FP8 E4M3, INT8) calibrated on real text, weight-only INT4 blocks
taken from a GGUF file (``quantize.weights.method: source``) or rounded from the FP32 weights (``rtn``,
``awq``), NVFP4, or FP16.

This module is the stage (its declarations, :func:`run`, the pin hook :func:`before_run`); its parts:
:mod:`.calibration` (calibration batches, or the pinned result, and the candidate pin), :mod:`.tuning`
(the accuracy-budget search's feeds and scorer), :mod:`.transforms` (rotation; SmoothQuant is
:func:`pipeline.quant.smoothquant.prepare`), :mod:`.weight_only` (INT4 / NVFP4 weights) and
:mod:`.graphs` (writing the result)."""
from __future__ import annotations

from pathlib import Path

import onnx
from onnx.external_data_helper import load_external_data_for_model

from pipeline.checks import graph as graph_checks
from pipeline.artifacts import ExportArtifact, QuantizedArtifact
from pipeline.context import RunStart, StageContext
from pipeline.errors import QuantizationError
from pipeline.quant.feeds import save_batches
from pipeline.recipe.schema import Recipe
from pipeline.quant import autocast, budget, calibrate, pin, qdq, smoothquant
from pipeline.recipe.precisions import facts
from pipeline.stages.quantize.calibration import (CALIBRATION_FEEDS, calibration_data, pinned_amax, pinned_kept, rows,
                                                  write_candidate)
from pipeline.stages.quantize.graphs import save, save_cpu_graph
from pipeline.stages.quantize.transforms import rotated
from pipeline.stages.quantize.tuning import score_logits, tuning_feeds
from pipeline.stages.quantize.weight_only import decoded, from_gguf, rounded

NAME = "quantize"
NEEDS = ("export",)
#: the manifest inputs it reads (stage keys): its data, and the eval data it keeps calibration apart from
KEY_INPUTS = ("quantize.", "validate.data")
ARTIFACT = QuantizedArtifact
#: no TensorRT version in the key: CPU and GPU runners share this stage (remote cache)
ENGINE_FREE = True


def key_sections(r: Recipe) -> list:
    """What of the recipe quantize reads: its section and the eval data (kept out of calibration)."""
    return [r.quantize.model_dump(mode="json"), r.validate_.data.model_dump(mode="json")]


def key_extra(ctx: StageContext) -> dict:
    """The pinned tuning result the stage applies (:mod:`pipeline.quant.pin`), by its key."""
    return {"pin": ctx.pin.key()}


def run(ctx: StageContext, exp: ExportArtifact) -> QuantizedArtifact:
    """Write ``quantize/model.onnx`` in the recipe's precision, and the calibration
    batches it was calibrated on (``quantize/calibration_feeds.npz``,
    ``QuantizedArtifact.calibration_feeds_path``) for later stages: validate never calls back here.

    The FP32 graph is read lazily (weights stay on disk until used), the
    result replaces any earlier ``model.onnx`` by rename (never in place) and
    goes to ``model.onnx.data`` when it reaches the external-data threshold
    (protobuf's 2 GiB by default).

    Raises:
        QuantizationError: bad exclusions, too little or out-of-profile
            calibration data, FP8 below opset 19, or an invalid scale; a pinned result
            (:mod:`pipeline.quant.pin`) that does not fit the exported graph: its amax tensors feed
            other GEMMs (``consumers``) or are missing, its per-channel amax do not fit, or its
            exclusions name no weight GEMM, leave none quantized or go below
            ``tuning.min_quantized_fraction`` (each names the pin file and the key).
        GraphCheckError: the result breaks a TensorRT Q/DQ rule.
        EnvironmentFault: the written file cannot be loaded back.
    """
    q = ctx.recipe.quantize
    out = ctx.stage_dir / "model.onnx"
    src = Path(exp.onnx_path)
    (ctx.stage_dir / pin.CANDIDATE).unlink(missing_ok=True)  # an earlier run's candidate is never this run's
    model = onnx.load(str(src), load_external_data=False)  # graph only: weights are read when needed
    if not facts(q.precision).qdq and not facts(q.precision).cast:
        return save(QuantizedArtifact(str(out), q.precision, [], []), model, src)
    if facts(q.precision).cast:
        return _fp16(model, src, out, q.precision)
    if facts(q.precision).weight_only:
        if facts(q.precision).cpu_decoded:  # nvfp4
            return decoded(ctx, model, src, out)
        if q.weights is not None and q.weights.method != "source":
            return rounded(ctx, exp, model, src, out)
        return from_gguf(ctx, model, src, out)
    _check_opset(model, q.precision)
    targets = qdq.find_targets(model, list(q.quantize_op_types))
    kept, excluded = qdq.apply_exclusions(model, targets, q.exclude)
    if not kept:
        raise QuantizationError("quantize: no weight GEMM is left to quantize after exclusions")
    fmt = qdq.quant_format(q.precision, q.reduce_range, q.weight_clip)
    batches, shortfall = calibration_data(ctx, exp)
    if shortfall:
        ctx.progress.print(f"[yellow]quantize: {shortfall['shortfall']}[/yellow]")
    pinned = ctx.pin.pinned if ctx.pin is not None else None
    retune = pin.tune_command(ctx.recipe_path)
    bound = pinned is not None and pin.check_consumers(pinned, targets, ctx.pin.path, retune)
    cal_src, extra, chan = src, {}, {}
    if q.rotate:  # Hadamard R1/R2 folded into the FP32 weights; calibration runs on the rotated graph
        model, kept, src, rot_info = rotated(ctx, model, src, targets, kept)
        cal_src, extra = src, {"rotate": rot_info}
    if q.smoothquant is not None:  # weights loaded, FP32 graph smoothed
        try:
            model, kept, cal_src, smooth_info, chan = smoothquant.prepare(
                q.smoothquant, ctx.stage_dir, ctx.progress, src, model, kept, batches,
                pin.channel_amax(pinned) if pinned else None, fmt, q.per_channel_weights)
        except QuantizationError as e:
            if pinned is None:
                raise
            raise QuantizationError(f"{ctx.pin.path}: channel_amax: {e}; re-tune ({retune})") from None  # does not fit
        extra.update({"smoothquant": smooth_info} if smooth_info else {})
    acts = sorted({t.act for t in kept})
    if pinned is not None:
        amax = pinned_amax(pinned, acts, ctx.pin.path, retune)
        before = len(kept)
        kept = pinned_kept(model, kept, targets, pinned, ctx.pin.path, retune, q.tuning)
        extra["tuning"] = {"source": pin.PINNED, "file": str(ctx.pin.path), "metrics": pinned.get("metrics", {}),
                           "excluded": before - len(kept), "graph_checked": bound}
        ctx.progress.print(f"  quantize: {ctx.pin.describe()} ({len(targets) - len(kept)} of {len(targets)} GEMMs in "
                           f"high precision, {before - len(kept)} of them by the pin; no calibration, no search)")
        if not bound:
            ctx.progress.print(f"[yellow]  quantize: {ctx.pin.path} has no `consumers` (written before them): its "
                               f"amax are applied by tensor name, unchecked against the exported graph; re-tune "
                               f"({retune}) to bind them[/yellow]")
    else:
        if q.tuning is not None and ctx.pin is not None and ctx.pin.reason:  # e.g. a recipe copied without its pin
            ctx.progress.print(f"  quantize: {ctx.pin.describe()}; calibrating and searching")
        with ctx.progress.step(f"calibrate: {q.calibration.method} over {len(batches)} batches, {len(acts)} tensors"):
            amax = calibrate.collect_amax(cal_src, acts, batches, q.calibration.method, fmt, q.calibration.percentile,
                                          scratch_dir=ctx.stage_dir)
    found = None
    weights = str(Path(cal_src).parent)  # where on-disk weights live: the export's, or the smoothed graph's
    if q.tuning is not None and pinned is None:  # sensitivity, and the accuracy-budget search (GateFailed when unreachable)
        kept, found, _ = budget.tune(q, tuning_feeds(ctx, exp), score_logits, budget.reference_session(exp.onnx_path),
                                     model, kept, len(excluded), amax, fmt, weights_dir=weights,
                                     out_dir=ctx.stage_dir, progress=ctx.progress)
        if found is not None:
            extra["accuracy_budget"] = {**found.to_json(), "snippet": found.snippet(list(q.exclude.nodes))}
    if pinned is None:
        write_candidate(ctx, amax, pin.graph_consumers(targets, amax), chan, found)
        extra["tuning"] = {"source": pin.SEARCHED if found else "calibrated", "reason": ctx.pin.reason if ctx.pin else ""}
    excluded = [t for t in targets if t.node not in {k.node for k in kept}]
    extra["quantized_fraction"] = len(kept) / len(targets)
    model = qdq.insert_qdq(model, kept, amax, fmt, q.per_channel_weights, base_dir=weights, inplace=True)
    graph_checks.check_qdq_graph(model, base_dir=weights)
    model = autocast.cast_rest(model, q.rest_precision, base_dir=weights)  # fp32: unchanged
    feeds_path = save_batches(ctx.stage_dir / CALIBRATION_FEEDS, batches)  # forward to validate's baselines
    info = {"method": q.calibration.method, "samples": int(sum(rows(b) for b in batches)),
            "seq_len": q.calibration.seq_len, **shortfall, "amax": {k: round(v, 6) for k, v in amax.items()}, **extra}
    art = QuantizedArtifact(str(out), q.precision, [t.node for t in kept], [t.node for t in excluded], info,
                            calibration_feeds_path=str(feeds_path))
    art = save(art, model, Path(cal_src))
    return save_cpu_graph(art) if q.reduce_range else art


def _check_opset(model: onnx.ModelProto, precision: str) -> None:
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    need = facts(precision).min_opset
    if opset < need:
        raise QuantizationError(f"export.opset: {precision.upper()} Q/DQ needs opset >= {need}, the graph has opset {opset}")


def _fp16(model: onnx.ModelProto, src: Path, out: Path, precision: str) -> QuantizedArtifact:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    load_external_data_for_model(model, str(src.parent))  # the converter needs the values
    half = convert_float_to_float16(model, keep_io_types=True)
    del model
    art = QuantizedArtifact(str(out), precision, [], [], {"method": "cast", "keep_io_types": True})
    return save(art, half, src)


def before_run(start: RunStart) -> dict:
    """Before any stage: find the recipe's tuning pin (:func:`pipeline.quant.pin.lookup`) for every stage's
    context, record in the manifest whether this run is pinned, and, for ``build --locked``, refuse a run
    whose search would run.

    Raises:
        RecipeError: (exit 2) the pin file is not a valid pin; ``--locked`` without a matching pin.
    """
    found = pin.lookup(start.recipe, start.recipe_path, start.inputs, ignore=start.pin_ignore)
    if start.locked:
        pin.check_locked(start.recipe, found)
    start.manifest["tuning"] = {"source": pin.PINNED if found.pinned is not None else pin.SEARCHED,
                                "pin": str(found.path), "reason": found.reason}
    return {"pin": found}
