"""The quantize stage's weight-only precisions (``quantize.weights``): INT4/INT8 blocks taken from a GGUF
file (``source``), rounded from FP32 (``rtn``, ``awq``), and NVFP4 with its decoded FP32 twin; each
writes TensorRT's graph and, where it differs, ONNX Runtime's (``model_cpu.onnx``)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import onnx

from pipeline import onnx_io
from pipeline.checks import graph as graph_checks
from pipeline.artifacts import ExportArtifact, QuantizedArtifact
from pipeline.context import StageContext
from pipeline.errors import QuantizationError
from pipeline.quant import qdq
from pipeline.recipe.precisions import facts
from pipeline.stages.quantize.calibration import calibration_data, rows
from pipeline.stages.quantize.graphs import CPU_GRAPH, save


def from_gguf(ctx: StageContext, model: onnx.ModelProto, src: Path, out: Path) -> QuantizedArtifact:
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
        if has_tied_lm_head(model) and any(t.name == int4.EMBEDDING for t in reader.tensors):
            done.append(int4.rewrite_tied_lm_head(model, reader, base_dir=str(src.parent)))  # SmolLM2's
        int4.raise_opset(model)
    if not done:
        raise gguf_blocks.GGUFWeightError(
            f"model.source: no weight GEMM of the exported graph holds a tensor of {path} (quantize.weights.method: "
            "source needs the graph exported from that GGUF file)")
    wrong = {t.tensor: size for t, (bits, size) in zip(done, forms(done)) if bits == 4 and size != w.block_size}
    if wrong:
        shown = ", ".join(f"{name} ({size})" for name, size in sorted(wrong.items())[:3])
        raise gguf_blocks.GGUFWeightError(
            f"quantize.weights.block_size: {w.block_size}, but {path.name}'s INT4 tensors have other blocks: {shown}; "
            "method source keeps the file's blocks: set block_size to the file's")
    cpu, halves, shared = runtime_graphs(model, src)
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
    info.update(runtime_graphs_info(halves, shared))
    ctx.progress.print(f"  quantize: {len(done)} GEMMs weight-only ("
                       + ", ".join(f"{n} {k}" for k, n in formats.items())
                       + f"), {len(excluded)} left FP32; max |weight - GGML's| {info['max_weight_error']:g}")
    art = save(QuantizedArtifact(str(out), ctx.recipe.quantize.precision, [t.node for t in done], excluded, info),
                model, src)
    return with_cpu_graph(art, cpu if halves or shared else None, out, src)

def runtime_graphs(model: onnx.ModelProto, src: Path) -> tuple[onnx.ModelProto, list[str], object]:
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

def runtime_graphs_info(halves: list[str], shared) -> dict:
    """The stage summary's record of :func:`runtime_graphs` (empty when it changed nothing)."""
    info: dict = {}
    if halves or shared:
        info["cpu_graph"] = {"file": CPU_GRAPH, "int8_gemms_as_int4_halves": halves,
                             "note": "what ONNX Runtime validates and serves: INT8 blocks as two INT4 halves "
                                     "(pipeline.quant.int4.int4_halves), the embedding on its FP32 table"}
    if shared:
        info["engine_graph_tied_table"] = dataclasses.asdict(shared)
    return info

def with_cpu_graph(art: QuantizedArtifact, cpu: onnx.ModelProto | None, out: Path, src: Path) -> QuantizedArtifact:
    """``art`` with ONNX Runtime's graph saved beside it as :data:`CPU_GRAPH` (``cpu`` None: the one graph)."""
    if cpu is None:
        return art
    path = onnx_io.save_model_atomic(cpu, out.with_name(CPU_GRAPH), base_dir=src.parent)
    onnx_io.require_loadable(str(path), "quantize")
    return dataclasses.replace(art, cpu_onnx_path=str(path))

#: the twin of a weight-only graph ONNX Runtime's CPU provider cannot run (NVFP4), weights decoded to
#: FP32 (QuantizedArtifact.cpu_onnx_path): what validate and the Triton repository run
DECODED_GRAPH = "model.decoded.onnx"

def decoded(ctx: StageContext, model: onnx.ModelProto, src: Path, out: Path) -> QuantizedArtifact:
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
    return save(art, model, src)

def rounded(ctx: StageContext, exp: ExportArtifact, model: onnx.ModelProto, src: Path, out: Path
             ) -> QuantizedArtifact:
    """``quantize.weights.method: rtn`` or ``awq``: every weight GEMM (but ``quantize.exclude``'s) as
    symmetric absmax INT4 blocks of ``block_size`` along K (:func:`pipeline.quant.int4.rewrite_rtn`;
    a tied lm_head as INT8 blocks of 32), after, for ``awq``, the AWQ scales searched on the
    calibration batches and folded into the FP32 graph (:func:`pipeline.quant.awq.fold`). Activations
    stay FP32. ``calibration`` records the method, the GEMM count per ONNX form and, for awq, the
    search per fold point and its block output error against rtn's.

    Raises:
        QuantizationError: (exit 2) ``block_size`` does not divide a GEMM's K and ``pad`` is false
            (names the GEMM and K; with ``pad``, ``calibration.padding`` records the GEMMs padded and the
            bytes the zero rows add);
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
        extra["awq"], clips = awq.fold(model, kept, batches, w.block_size, pad=w.pad, progress=ctx.progress)
        extra.update(shortfall)
        info.update(samples=int(sum(rows(b) for b in batches)), seq_len=q.calibration.seq_len)
        a = extra["awq"]
        ctx.progress.print(f"  quantize: awq scaled {a['scaled_points']} of {len(a['fold_points'])} fold points; block "
                           f"output error {a['block_output_error']:.4g} ({a['block_output_error_clipped']:.4g} with "
                           f"{a['clipped_blocks']} of {a['blocks']} blocks clipped) vs rtn {a['block_output_error_rtn']:.4g}")
    with ctx.progress.step(f"quantize: {w.method} INT4 blocks of {w.block_size}"):
        done = int4.rewrite_rtn(model, block_size=w.block_size, base_dir=base, skip={t.node for t in excluded},
                                clips=clips, pad=w.pad)
    if w.pad:  # what the zero rows cost: INT4 values, two per byte (the scales are one per block either way)
        grown = [t for t in done if t.padded_k]
        extra["padding"] = {"gemms": len(grown), "rows_added": sum(t.padded_k - t.k for t in grown),
                            "bytes_added": sum((t.padded_k - t.k) * t.n // 2 for t in grown),
                            "int4_value_bytes": sum((t.padded_k or t.k) * t.n // 2 for t in done
                                                    if t.onnx_form.startswith("INT4"))}
    cpu, halves, shared = runtime_graphs(model, src)
    graph_checks.check_qdq_graph(model, base_dir=base)
    counts = Counter(t.onnx_form for t in done)
    rewritten = {t.node for t in done}
    info.update(gemm_formats=dict(sorted(counts.items(), key=lambda kv: -kv[1])),
                max_relative_error=max((t.max_relative_error for t in done), default=0.0),
                quantized_fraction=len([t for t in kept if t.node in rewritten]) / max(len(targets), 1), **extra,
                **runtime_graphs_info(halves, shared))
    ctx.progress.print(f"  quantize: {len(done)} GEMMs weight-only ("
                       + ", ".join(f"{n} {k}" for k, n in info["gemm_formats"].items())
                       + f"), {len(excluded)} left FP32")
    art = QuantizedArtifact(str(out), q.precision, [t.node for t in done],
                            [t.node for t in targets if t.node not in rewritten], info)
    return with_cpu_graph(save(art, model, src), cpu if halves or shared else None, out, src)

def has_tied_lm_head(model: onnx.ModelProto) -> bool:
    """A MatMul reads ``Transpose(table)`` of an initializer a Gather also reads (a tied embedding)."""
    inits = {t.name for t in model.graph.initializer}
    gathered = {n.input[0] for n in model.graph.node if n.op_type == "Gather" and n.input[0] in inits}
    transposed = {n.output[0] for n in model.graph.node if n.op_type == "Transpose" and n.input[0] in gathered}
    return any(n.op_type == "MatMul" and len(n.input) > 1 and n.input[1] in transposed for n in model.graph.node)

def forms(done) -> list[tuple[int, int]]:
    """(bits, block size) of each rewritten GEMM's ONNX form (``"INT4 block 32 + offsets"``)."""
    return [(int(t.onnx_form.split()[0][3:]), int(t.onnx_form.split()[2])) for t in done]
