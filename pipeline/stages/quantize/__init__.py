"""Stage 2, quantize: explicit Q/DQ (FP8 E4M3, INT8) calibrated on real text, weight-only INT4 blocks
taken from a GGUF file (``quantize.weights.method: source``) or rounded from the FP32 weights (``rtn``,
``awq``), or FP16."""
from __future__ import annotations

import dataclasses
import fnmatch
import json
from pathlib import Path

import numpy as np
import onnx
from onnx.external_data_helper import load_external_data_for_model

from pipeline import onnx_io
from pipeline.checks import graph as graph_checks
from pipeline.artifacts import ExportArtifact, QuantizedArtifact
from pipeline.context import RunStart, StageContext
from pipeline.errors import QuantizationError
from pipeline.quant.feeds import save_batches
from pipeline.models import registry
from pipeline.recipe.schema import ExcludeConfig, Recipe
from pipeline.quant import autocast, budget, calibrate, pin, qdq, smoothquant
from pipeline.recipe.precisions import facts

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
        return _save(QuantizedArtifact(str(out), q.precision, [], []), model, src)
    if facts(q.precision).cast:
        return _fp16(model, src, out, q.precision)
    if facts(q.precision).weight_only:
        if facts(q.precision).cpu_decoded:  # nvfp4
            return _decoded_weight_only(ctx, model, src, out)
        if q.weights is not None and q.weights.method != "source":
            return _rounded(ctx, exp, model, src, out)
        return _weight_only(ctx, model, src, out)
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
        model, kept, src, rot_info = _rotated(ctx, model, src, targets, kept)
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
        amax = _pinned_amax(pinned, acts, ctx.pin.path, retune)
        before = len(kept)
        kept = _pinned_kept(model, kept, targets, pinned, ctx.pin.path, retune, q.tuning)
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
        _write_candidate(ctx, amax, pin.graph_consumers(targets, amax), chan, found)
        extra["tuning"] = {"source": pin.SEARCHED if found else "calibrated", "reason": ctx.pin.reason if ctx.pin else ""}
    excluded = [t for t in targets if t.node not in {k.node for k in kept}]
    extra["quantized_fraction"] = len(kept) / len(targets)
    model = qdq.insert_qdq(model, kept, amax, fmt, q.per_channel_weights, base_dir=weights, inplace=True)
    graph_checks.check_qdq_graph(model, base_dir=weights)
    model = autocast.cast_rest(model, q.rest_precision, base_dir=weights)  # fp32: unchanged
    feeds_path = save_batches(ctx.stage_dir / CALIBRATION_FEEDS, batches)  # forward to validate's baselines
    info = {"method": q.calibration.method, "samples": int(sum(_rows(b) for b in batches)),
            "seq_len": q.calibration.seq_len, **shortfall, "amax": {k: round(v, 6) for k, v in amax.items()}, **extra}
    art = QuantizedArtifact(str(out), q.precision, [t.node for t in kept], [t.node for t in excluded], info,
                            calibration_feeds_path=str(feeds_path))
    art = _save(art, model, Path(cal_src))
    return _save_cpu_graph(art) if q.reduce_range else art


ROTATED = "rotated_fp32.onnx"


def _rotated(ctx: StageContext, model: onnx.ModelProto, src: Path, targets: list[qdq.Target],
             kept: list[qdq.Target]) -> tuple[onnx.ModelProto, list[qdq.Target], Path, dict]:
    """``quantize.rotate``: R1 and R2 folded into the FP32 graph (:func:`pipeline.quant.rotate.rotate`),
    saved as ``<stage>/rotated_fp32.onnx`` and read back lazily, so what follows (SmoothQuant,
    calibration, the search, Q/DQ) sees it as the exported graph. The GEMMs to quantize are the same
    nodes as before (the MatMul added before a tied lm_head is not one of them).

    Raises:
        QuantizationError: the graph is not Llama-shaped (:func:`pipeline.quant.rotate.rotate`).
    """
    from pipeline.quant import rotate

    load_external_data_for_model(model, str(src.parent))
    with ctx.progress.step("rotate: Hadamard R1 (residual stream) and R2 (v -> o) folded into the weights"):
        report = rotate.rotate(model, targets)
    path = ctx.stage_dir / ROTATED
    onnx_io.save_model_atomic(model, path)
    del model
    model = onnx.load(str(path), load_external_data=False)
    names = {t.node for t in kept}
    kept = [t for t in qdq.find_targets(model, list(ctx.recipe.quantize.quantize_op_types)) if t.node in names]
    return model, kept, path, report.summary()


#: the CPU graph of a 7-bit INT8 quantize stage (QuantizedArtifact.cpu_onnx_path)
CPU_GRAPH = "model_cpu.onnx"


def _save_cpu_graph(art: QuantizedArtifact) -> QuantizedArtifact:
    """Write :data:`CPU_GRAPH` beside ``art.onnx_path``: the same values with UINT8 activations
    (:func:`pipeline.quant.qdq.uint8_activations`), and prove it loads."""
    path = Path(art.onnx_path)
    model = onnx.load(str(path), load_external_data=False)  # external weights are copied one at a time
    qdq.uint8_activations(model)  # zero points are small: always inline
    cpu = path.with_name(CPU_GRAPH)
    onnx_io.save_model_atomic(model, cpu, base_dir=path.parent)
    onnx_io.require_loadable(str(cpu), "quantize")
    return dataclasses.replace(art, cpu_onnx_path=str(cpu))


def _pinned_amax(pinned: dict, acts: list[str], path: Path, retune: str) -> dict[str, float]:
    """The pinned amax of ``acts`` (:func:`pipeline.quant.pin.read` checked each is finite and > 0).

    Raises:
        QuantizationError: the pin lacks a tensor (the graph changed under a matching pin).
    """
    missing = [a for a in acts if a not in pinned["amax"]]
    if missing:
        raise QuantizationError(f"{path}: amax: no pinned amax for {missing[:3]} ({len(missing)} tensors); the graph "
                                f"changed since it was tuned: re-tune ({retune}), or bump pin.SEARCH_VERSION")
    return {a: float(pinned["amax"][a]) for a in acts}


def _pinned_kept(model: onnx.ModelProto, kept: list[qdq.Target], targets: list[qdq.Target], pinned: dict,
                 path: Path, retune: str, tuning) -> list[qdq.Target]:
    """``kept`` without the pin's high-precision scopes, matched exactly as ``quantize.exclude.nodes``,
    held to the recipe's own bounds: each entry names a weight GEMM of the graph (``targets``), at
    least one GEMM stays quantized, and no fewer than ``tuning.min_quantized_fraction`` of them.

    Raises:
        QuantizationError: (exit 2) an entry matches no weight GEMM, or the pin's exclusions leave
            none quantized or go below the floor; names the file, the key and the GEMM counts.
    """
    if not pinned["excluded"]:
        return kept
    for i, pat in enumerate(pinned["excluded"]):
        if not any(fnmatch.fnmatchcase(t.node, pat) or fnmatch.fnmatchcase(t.scope, pat) for t in targets):
            raise QuantizationError(f"{path}: excluded[{i}]: {pat!r} matches no weight GEMM (module scope or node "
                                    f"name) of the exported graph; re-tune ({retune})")
    left = qdq.apply_exclusions(model, kept, ExcludeConfig(nodes=pinned["excluded"]))[0]
    floor = tuning.min_quantized_fraction if tuning is not None else 0.0
    if not left or len(left) / len(targets) < floor:
        why = ("leaves no weight GEMM quantized" if not left else
               f"goes below quantize.tuning.min_quantized_fraction ({floor:g})")
        raise QuantizationError(
            f"{path}: excluded: its {len(pinned['excluded'])} entries keep {len(kept) - len(left)} more GEMMs in high "
            f"precision, {len(left)} of {len(targets)} ({len(left) / len(targets):.1%}) quantized: that {why}; "
            f"re-tune ({retune})")
    return left


def _write_candidate(ctx: StageContext, amax: dict[str, float], consumers: dict[str, list[str]], chan: dict,
                     found) -> None:
    """``quantize/tuned.json``: what ``tune`` pins (:func:`pipeline.quant.pin.candidate`)."""
    from pipeline.fsutil import write_text_atomic
    from pipeline.provenance import tool_versions

    if ctx.pin is None or (found is not None and found.status != "met"):
        return
    search = ({"status": found.status, "bound": found.bound, "trials": len(found.trials),
               "notes": found.notes} if found else {"status": "no search (no accuracy_budget)"})
    versions = tool_versions()
    data = pin.candidate(ctx.pin.fields, excluded=found.excluded_scopes if found else [], amax=amax,
                         consumers=consumers, channel_amax=chan, metrics=found.metrics if found else {}, search=search,
                         recorded={"versions": versions, "cpu": versions.get("cpu", "")})
    write_text_atomic(ctx.stage_dir / pin.CANDIDATE, json.dumps(data, indent=1) + "\n")


def _save(art: QuantizedArtifact, model: onnx.ModelProto, src: Path) -> QuantizedArtifact:
    """Write the graph (tensors still on disk are read from ``src``'s folder) and prove it loads."""
    onnx_io.save_model_atomic(model, art.onnx_path, base_dir=src.parent)
    onnx_io.require_loadable(art.onnx_path, "quantize")
    return art


def _weight_only(ctx: StageContext, model: onnx.ModelProto, src: Path, out: Path) -> QuantizedArtifact:
    """``quantize.weights.method: source``: every weight GEMM whose FP32 weight is a GGUF tensor's
    decode (the model source's file) becomes that tensor's blocks as blocked DequantizeLinear + MatMul
    (:func:`pipeline.quant.int4.rewrite_matmuls`, and the tied lm_head), the opset raised to 21.
    No calibration: activations stay FP32. ``calibration`` records the GEMM count per GGML type and
    ONNX form (``gemm_formats``), the file, and how far the forms are from GGML's weights.

    Raises:
        GGUFWeightError: (exit 2) the model file is not a GGUF file; a GEMM's GGUF tensor has a type
            with no block form; a module's weight is not its tensor's decode; the file's INT4 blocks are
            not ``quantize.weights.block_size`` wide; no GEMM matched the file.
        QuantizationError: an op of the graph means something else at opset 21.
    """
    from collections import Counter

    from pipeline.quant import gguf_blocks, int4
    from pipeline.sources.model import package_file

    w = ctx.recipe.quantize.weights
    assert w is not None  # the schema requires it for a weight-only precision
    path = package_file(ctx.recipe.model)
    targets = qdq.find_targets(model, list(ctx.recipe.quantize.quantize_op_types))
    with ctx.progress.step(f"quantize: weight-only blocks from {path.name}"):
        reader = gguf_blocks.open_gguf(path)
        done = int4.rewrite_matmuls(model, reader, base_dir=str(src.parent))
        if _has_tied_lm_head(model) and any(t.name == int4.EMBEDDING for t in reader.tensors):
            done.append(int4.rewrite_tied_lm_head(model, reader, base_dir=str(src.parent)))  # SmolLM2's
        int4.raise_opset(model)
    if not done:
        raise gguf_blocks.GGUFWeightError(
            f"model.source: no weight GEMM of the exported graph holds a tensor of {path} (quantize.weights.method: "
            "source needs the graph exported from that GGUF file)")
    wrong = {t.tensor: size for t, (bits, size) in zip(done, _forms(done)) if bits == 4 and size != w.block_size}
    if wrong:
        shown = ", ".join(f"{name} ({size})" for name, size in sorted(wrong.items())[:3])
        raise gguf_blocks.GGUFWeightError(
            f"quantize.weights.block_size: {w.block_size}, but {path.name}'s INT4 tensors have other blocks: {shown}; "
            "method source keeps the file's blocks: set block_size to the file's")
    cpu, halves, shared = _runtime_graphs(model, src)
    graph_checks.check_qdq_graph(model, base_dir=str(src.parent))
    rewritten = {t.node for t in done}
    excluded = [t.node for t in targets if t.node not in rewritten]
    counts = Counter(f"{t.ggml_type} -> {t.onnx_form}" for t in done)
    formats = dict(sorted(counts.items(), key=lambda kv: -kv[1]))
    info = {"method": w.method, "source": str(path), "block_size": w.block_size, "gemm_formats": formats,
            "row_orders": dict(Counter(t.row_order for t in done)),
            "rounded_offsets": sum(t.rounded_offsets for t in done), "blocks": sum(t.blocks for t in done),
            "max_weight_error": max(t.max_weight_error for t in done),
            "quantized_fraction": len(done) / (len(done) + len(excluded))}
    info.update(_runtime_graphs_info(halves, shared))
    ctx.progress.print(f"  quantize: {len(done)} GEMMs weight-only ("
                       + ", ".join(f"{n} {k}" for k, n in formats.items())
                       + f"), {len(excluded)} left FP32; max |weight - GGML's| {info['max_weight_error']:g}")
    art = _save(QuantizedArtifact(str(out), ctx.recipe.quantize.precision, [t.node for t in done], excluded, info),
                model, src)
    return _with_cpu_graph(art, cpu if halves or shared else None, out, src)


def _runtime_graphs(model: onnx.ModelProto, src: Path) -> tuple[onnx.ModelProto, list[str], object]:
    """Split a weight-only graph (in place) into what each runtime runs best, both exact:

    * returned, ONNX Runtime's (validate and the served python-onnxruntime model): every INT8 block
      GEMM as two INT4 halves (:func:`pipeline.quant.int4.split_int8_blocks`: MatMulNBits has FP32
      kernels at accuracy level 1 for 4 bits only), the embedding Gather on its FP32 table;
    * ``model``, TensorRT's: the embedding Gather on the tied lm_head's INT8 blocks when they decode to
      its table exactly (:func:`pipeline.quant.int4.share_tied_table`: one table, no FP32 copy).

    Returns ``(cpu_graph, int8 GEMMs split into halves, SharedTable or None)``."""
    from pipeline.quant import int4

    cpu = onnx.ModelProto()
    cpu.CopyFrom(model)
    halves = int4.split_int8_blocks(cpu, base_dir=str(src.parent))
    shared = int4.share_tied_table(model, base_dir=str(src.parent))
    return cpu, halves, shared


def _runtime_graphs_info(halves: list[str], shared) -> dict:
    """The stage summary's record of :func:`_runtime_graphs` (empty when it changed nothing)."""
    info: dict = {}
    if halves or shared:
        info["cpu_graph"] = {"file": CPU_GRAPH, "int8_gemms_as_int4_halves": halves,
                             "note": "what ONNX Runtime validates and serves: INT8 blocks as two INT4 halves "
                                     "(pipeline.quant.int4.int4_halves), the embedding on its FP32 table"}
    if shared:
        info["engine_graph_tied_table"] = dataclasses.asdict(shared)
    return info


def _with_cpu_graph(art: QuantizedArtifact, cpu: onnx.ModelProto | None, out: Path, src: Path) -> QuantizedArtifact:
    """``art`` with ONNX Runtime's graph saved beside it as :data:`CPU_GRAPH` (``cpu`` None: the one graph)."""
    if cpu is None:
        return art
    path = onnx_io.save_model_atomic(cpu, out.with_name(CPU_GRAPH), base_dir=src.parent)
    onnx_io.require_loadable(str(path), "quantize")
    return dataclasses.replace(art, cpu_onnx_path=str(path))


#: the twin of a weight-only graph ONNX Runtime's CPU provider cannot run (NVFP4), weights decoded to
#: FP32 (QuantizedArtifact.cpu_onnx_path): what validate and the Triton repository run
DECODED_GRAPH = "model.decoded.onnx"


def _decoded_weight_only(ctx: StageContext, model: onnx.ModelProto, src: Path, out: Path) -> QuantizedArtifact:
    """``quantize.precision: nvfp4`` (``weights.method: rtn``): every weight GEMM's FP32 weight is
    rounded to NVFP4 (:func:`pipeline.quant.nvfp4.quantize`) and written as two DequantizeLinear +
    MatMul in ``model.onnx`` (opset raised to 23, IR 11: TensorRT builds this), and, decoded exactly
    to FP32, in :data:`DECODED_GRAPH` at the export's opset (what ONNX Runtime validates and serves:
    "FP4 simulated: decoded to FP32 on this CPU"). A GGUF model source is re-quantized from its
    FP32 dequantization (the export), and ``calibration`` says so. ``quantize.exclude`` keeps GEMMs
    FP32 (nodes by name or module scope, op types).

    Raises:
        QuantizationError: (exit 2) a GEMM's K is not a multiple of 16 (names the MatMul, its
            initializer and K), a weight is not finite, no GEMM is left, or an op means something
            else at opset 21 than at the export's opset. Nothing is written then.
    """
    from collections import Counter

    from pipeline.quant import nvfp4
    from pipeline.sources.model import package_file

    q = ctx.recipe.quantize
    targets = qdq.find_targets(model, list(q.quantize_op_types))
    kept, _ = qdq.apply_exclusions(model, targets, q.exclude)
    skip = frozenset(t.node for t in targets if t.node not in {k.node for k in kept})
    decoded = onnx.ModelProto()
    decoded.CopyFrom(model)
    with ctx.progress.step(f"quantize: NVFP4 weights (rtn, blocks of {nvfp4.BLOCK}) of {len(kept)} GEMMs"):
        done = nvfp4.rewrite_matmuls(model, decoded, base_dir=str(src.parent), skip=skip)
    if not done:
        raise QuantizationError("quantize: no weight GEMM (a MatMul on a 2-D FP32 initializer) to write in NVFP4 "
                                "is left after quantize.exclude")
    rewritten = {t.node for t in done}
    excluded = [t.node for t in targets if t.node not in rewritten]
    source = getattr(ctx.recipe.model.source, "file", None) or getattr(ctx.recipe.model.source, "path", None) or ""
    gguf = str(source).endswith(".gguf")
    simulated = facts(q.precision).cpu_simulation
    weights = sum(t.k * t.n for t in done)
    info = {"method": q.weights.method, "block_size": nvfp4.BLOCK,
            "gemm_formats": dict(Counter(f"FP32 -> {nvfp4.FORM}" for _ in done)),
            "weights_from": (f"the GGUF file {package_file(ctx.recipe.model).name} dequantized to FP32 (the export), "
                             "then re-quantized to NVFP4 (rtn): a second rounding" if gguf else
                             "the FP32 export, rounded to NVFP4 (rtn)"),
            "max_weight_error": max(t.max_abs_error for t in done),
            "rel_rms_weight_error": sum(t.rel_rms_error * t.k * t.n for t in done) / weights,
            "cpu_graph": f"{simulated} ({DECODED_GRAPH}, opset of the export; TensorRT builds model.onnx)",
            "quantized_fraction": len(done) / (len(done) + len(excluded))}
    ctx.progress.print(f"  quantize: {len(done)} GEMMs NVFP4 weight-only, {len(excluded)} left FP32; "
                       f"weight rel. RMS error {info['rel_rms_weight_error']:.3g}; {simulated}")
    onnx_io.save_model_atomic(decoded, out.with_name(DECODED_GRAPH), base_dir=src.parent)
    del decoded
    onnx_io.require_loadable(str(out.with_name(DECODED_GRAPH)), "quantize")
    art = QuantizedArtifact(str(out), q.precision, [t.node for t in done], excluded, info,
                            cpu_onnx_path=str(out.with_name(DECODED_GRAPH)))
    return _save(art, model, src)


def _rounded(ctx: StageContext, exp: ExportArtifact, model: onnx.ModelProto, src: Path, out: Path
             ) -> QuantizedArtifact:
    """``quantize.weights.method: rtn`` or ``awq``: every weight GEMM (but ``quantize.exclude``'s) as
    symmetric absmax INT4 blocks of ``block_size`` along K (:func:`pipeline.quant.int4.rewrite_rtn`;
    a tied lm_head as INT8 blocks of 32), after, for ``awq``, the AWQ scales searched on the
    calibration batches and folded into the FP32 graph (:func:`pipeline.quant.awq.fold`). Activations
    stay FP32. ``calibration`` records the method, the GEMM count per ONNX form and, for awq, the
    search per fold point and its block output error against rtn's.

    Raises:
        QuantizationError: (exit 2) ``block_size`` does not divide a GEMM's K (names the GEMM and K);
            too little calibration data (awq); the folded graph is not equivalent (awq); an op of the
            graph means something else at opset 21.
    """
    from collections import Counter

    from pipeline.quant import awq, int4

    q = ctx.recipe.quantize
    w = q.weights
    targets = qdq.find_targets(model, ["MatMul"])
    kept, excluded = qdq.apply_exclusions(model, targets, q.exclude)
    info: dict = {"method": w.method, "block_size": w.block_size}
    extra: dict = {}
    clips: dict = {}
    base = str(src.parent)
    if w.method == "awq":
        batches, shortfall = calibration_data(ctx, exp)
        if shortfall:
            ctx.progress.print(f"[yellow]quantize: {shortfall['shortfall']}[/yellow]")
        with ctx.progress.step("awq: loading the FP32 weights"):
            awq.load_weights(model, src)
        extra["awq"], clips = awq.fold(model, kept, batches, w.block_size, progress=ctx.progress)
        extra.update(shortfall)
        info.update(samples=int(sum(_rows(b) for b in batches)), seq_len=q.calibration.seq_len)
        a = extra["awq"]
        ctx.progress.print(f"  quantize: awq scaled {a['scaled_points']} of {len(a['fold_points'])} fold points; block "
                           f"output error {a['block_output_error']:.4g} ({a['block_output_error_clipped']:.4g} with "
                           f"{a['clipped_blocks']} of {a['blocks']} blocks clipped) vs rtn {a['block_output_error_rtn']:.4g}")
    with ctx.progress.step(f"quantize: {w.method} INT4 blocks of {w.block_size}"):
        done = int4.rewrite_rtn(model, block_size=w.block_size, base_dir=base, skip={t.node for t in excluded},
                                clips=clips)
    cpu, halves, shared = _runtime_graphs(model, src)
    graph_checks.check_qdq_graph(model, base_dir=base)
    counts = Counter(t.onnx_form for t in done)
    rewritten = {t.node for t in done}
    info.update(gemm_formats=dict(sorted(counts.items(), key=lambda kv: -kv[1])),
                max_relative_error=max((t.max_relative_error for t in done), default=0.0),
                quantized_fraction=len([t for t in kept if t.node in rewritten]) / max(len(targets), 1), **extra,
                **_runtime_graphs_info(halves, shared))
    ctx.progress.print(f"  quantize: {len(done)} GEMMs weight-only ("
                       + ", ".join(f"{n} {k}" for k, n in info["gemm_formats"].items())
                       + f"), {len(excluded)} left FP32")
    art = QuantizedArtifact(str(out), q.precision, [t.node for t in done],
                            [t.node for t in targets if t.node not in rewritten], info)
    return _with_cpu_graph(_save(art, model, src), cpu if halves or shared else None, out, src)


def _has_tied_lm_head(model: onnx.ModelProto) -> bool:
    """A MatMul reads ``Transpose(table)`` of an initializer a Gather also reads (a tied embedding)."""
    inits = {t.name for t in model.graph.initializer}
    gathered = {n.input[0] for n in model.graph.node if n.op_type == "Gather" and n.input[0] in inits}
    transposed = {n.output[0] for n in model.graph.node if n.op_type == "Transpose" and n.input[0] in gathered}
    return any(n.op_type == "MatMul" and len(n.input) > 1 and n.input[1] in transposed for n in model.graph.node)


def _forms(done) -> list[tuple[int, int]]:
    """(bits, block size) of each rewritten GEMM's ONNX form (``"INT4 block 32 + offsets"``)."""
    return [(int(t.onnx_form.split()[0][3:]), int(t.onnx_form.split()[2])) for t in done]


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
    return _save(art, half, src)


CALIBRATION_FEEDS = "calibration_feeds.npz"


def calibration_data(ctx: StageContext, exp: ExportArtifact) -> tuple[list[dict[str, np.ndarray]], dict]:
    """Calibration batches from the kind's adapter (:meth:`ModelAdapter.calibration_feeds`
    on the calibration split), and the shortfall.

    Returns ``(batches, shortfall)``: ``shortfall`` is empty when ``samples``
    samples (rows on axis 0) were found, else ``{"samples_requested": n, "shortfall": text}``
    for the console, the stage summary and the report.

    Raises:
        QuantizationError: fewer samples than ``min_samples`` (the recipe schema
            already refused batch/sequence sizes outside the first profile).
        DataError: the calibration data cannot be read.
    """
    cal = ctx.recipe.quantize.calibration
    batches = registry.adapter(ctx.recipe.model).calibration_feeds(exp, cal.data, cal)
    found = sum(_rows(b) for b in batches)
    where = cal.data.describe()
    if found < cal.min_samples:
        raise QuantizationError(
            f"quantize.calibration: {where} gives {found} windows of "
            f"{cal.seq_len} tokens, below min_samples={cal.min_samples}; widen the split or shorten seq_len"
        )
    shortfall: dict = {}
    if found < cal.samples:
        text = (f"calibrated on {found} of the {cal.samples} requested samples: {where} holds only "
                f"{found} windows of {cal.seq_len} tokens (min_samples={cal.min_samples})")
        shortfall = {"samples_requested": cal.samples, "shortfall": text}
    return batches, shortfall


def _rows(batch: dict[str, np.ndarray]) -> int:
    """Samples in one feed batch: axis 0 of its first input."""
    return int(next(iter(batch.values())).shape[0]) if batch else 0


def score_logits(session, feeds: dict):
    """The causal LM's scoring function for the tuning search: float32 logits ``[batch, seq, vocab]``."""
    return session.run(["logits"], feeds)[0]


def tuning_feeds(ctx: StageContext, exp) -> list[dict]:
    """The tuning split as feed dicts (the model kind's calibration feeds, ``quantize.tuning.max_windows``
    windows), after checking it is disjoint from the calibration and validate data.

    Raises:
        DataError: the tuning data overlaps calibration or validate data (names both).
        QuantizationError: it gives no window of ``calibration.seq_len`` tokens.
    """
    q = ctx.recipe.quantize
    budget.check_data(ctx.recipe)
    cal = q.calibration.model_copy(update={"samples": q.tuning.max_windows, "min_samples": 1})
    feeds = registry.adapter(ctx.recipe.model).calibration_feeds(exp, q.tuning.data, cal)
    if not feeds:
        raise QuantizationError(f"quantize.tuning.data: {q.tuning.data.describe()} gives no window of {cal.seq_len} tokens")
    return feeds


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
