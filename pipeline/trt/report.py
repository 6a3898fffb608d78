"""What the parsed TensorRT network holds, and the build stage's report section (``build/engine.md``).

Read from the strongly typed network before the build (so it needs no GPU and
works for both backends): layer counts by type, the Q/DQ layers the parser
kept, and the GEMMs (matrix multiply, convolution, deconvolution) whose two
operands both come from a DequantizeLayer of INT8/FP8 data (through
shuffles: transposes and reshapes). Those are the GEMMs TensorRT may run in
INT8/FP8; a GEMM the quantize stage quantized that is not among them would
run in higher precision than validate measured. A weight-only GEMM (``quantize.precision:
int4``, ``nvfp4``) has its weight dequantized from INT4/INT8/FP4 blocks and an FP32 activation by design:
those are counted apart (``weight_only_gemms``), not as left in high precision.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

GEMM_TYPES = ("MATRIX_MULTIPLY", "CONVOLUTION", "DECONVOLUTION")
_LOW_PRECISION = ("INT8", "FP8")
#: weight types of weight-only GEMMs (blocked DequantizeLinear on the weight alone)
_WEIGHT_ONLY = ("INT4", "INT8", "FP4")
_PASS_THROUGH = ("SHUFFLE",)
SECTION_FILE = "engine.md"


@dataclass
class NetworkSummary:
    """``layers_by_type``: LayerType name -> count; ``qdq_layers``: Quantize + Dequantize layers;
    ``gemms``: GEMM layers; ``low_precision_gemms``: layer name -> "INT8"/"FP8" of those
    with both operands dequantized from that type; ``weight_only_gemms``: layer name ->
    "INT4"/"INT8" of those whose weight (input 1) alone is dequantized from that type."""

    layers_by_type: dict[str, int]
    qdq_layers: int
    gemms: int
    low_precision_gemms: dict[str, str]
    weight_only_gemms: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize_network(network: Any) -> NetworkSummary:
    """Summarize a parsed ``INetworkDefinition`` (either TensorRT module)."""
    layers = [network.get_layer(i) for i in range(network.num_layers)]
    producer = {layer.get_output(j).name: layer for layer in layers for j in range(layer.num_outputs)}
    types = Counter(layer.type.name for layer in layers)
    low: dict[str, str] = {}
    weight_only: dict[str, str] = {}
    for layer in layers:
        if layer.type.name in GEMM_TYPES and layer.num_inputs >= 2:
            act, weight = (_dequantized_from(layer.get_input(k), producer) for k in (0, 1))
            if act == weight and act in _LOW_PRECISION:
                low[layer.name] = str(act)
            elif act is None and weight in _WEIGHT_ONLY:
                weight_only[layer.name] = str(weight)
    return NetworkSummary(dict(sorted(types.items())), types["QUANTIZE"] + types["DEQUANTIZE"],
                          sum(types[t] for t in GEMM_TYPES), low, weight_only)


def _dequantized_from(tensor: Any, producer: dict[str, Any]) -> str | None:
    """The data type name ("INT8", "FP8", "INT4", ...) if ``tensor`` is a DequantizeLayer's
    output (via shuffles), else None."""
    seen = 0
    while tensor is not None and seen < 16:
        layer = producer.get(tensor.name)
        if layer is None:
            return None
        if layer.type.name == "DEQUANTIZE":
            return str(layer.get_input(0).dtype.name)
        if layer.type.name not in _PASS_THROUGH:
            return None
        tensor, seen = layer.get_input(0), seen + 1
    return None


def gemm_mismatch(summary: NetworkSummary, quantized_nodes: list[str] | None) -> list[str]:
    """The quantize stage's quantized GEMMs (ONNX node names, which the parser keeps as
    layer names) that are neither low-precision nor weight-only GEMMs in the network; [] when not known."""
    if quantized_nodes is None:
        return []
    return [n for n in quantized_nodes if n not in summary.low_precision_gemms and n not in summary.weight_only_gemms]


def mismatch_warning(missing: list[str], quantized: int) -> str:
    shown = ", ".join(missing[:10]) + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else "")
    return (f"{len(missing)} of the {quantized} GEMMs the quantize stage quantized have no INT8/FP8 operands (nor "
            f"an INT4/INT8 block weight) in the TensorRT network, so TensorRT runs them in higher precision than "
            f"validate measured: {shown}")


def block_weight_formats(model: Any) -> dict[str, dict[str, Any]]:
    """Weight-only GEMMs of an ONNX graph (loaded without its external data: reads dims and types
    only) by ONNX form: ``{"INT4 block 32 + offsets": {"gemms": 210, "weights": n, "bits_per_weight":
    6.0, "floor_bits": 6.0}, ...}``.

    A weight-only GEMM is a MatMul whose ``B`` is a blocked DequantizeLinear (``block_size``) of an
    INT4/INT8 or FLOAT4E2M1 initializer. ``bits_per_weight`` counts what the graph stores: the value,
    its block scale (an FP8 block scale of NVFP4, itself a DequantizeLinear of an FP8 initializer by
    an FP32 tensor scale, counts 8 bits plus the tensor scale's 32 over the tensor's weights) and,
    where :mod:`pipeline.quant.int4` added one, the block's float offset (``<prefix>.offsets``
    beside ``<prefix>.values``). ``floor_bits`` is the format's own size with FP32 scales
    (:func:`floor_bits`): the two differ only if a scale or offset is stored wider than the format needs.
    """
    from onnx import TensorProto, helper

    inits = {t.name: t for t in model.graph.initializer}
    dq = {n.output[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear"}
    bits = {TensorProto.INT4: 4, TensorProto.INT8: 8, TensorProto.UINT4: 4, TensorProto.UINT8: 8,
            TensorProto.FLOAT4E2M1: 4}
    width = lambda t: 8 * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize  # noqa: E731
    out: dict[str, dict[str, Any]] = {}
    for n in model.graph.node:
        d = dq.get(n.input[1]) if n.op_type == "MatMul" and len(n.input) > 1 else None
        if d is None:
            continue
        block = next((a.i for a in d.attribute if a.name == "block_size"), 0)
        values = inits.get(d.input[0])
        if not block or values is None or values.data_type not in bits:
            continue
        count = int(np.prod(values.dims, dtype=np.int64))
        scale = inits.get(d.input[1])
        if values.data_type == TensorProto.FLOAT4E2M1:  # NVFP4: scales = DQ(FP8 block scales, FP32 tensor scale)
            sdq = dq.get(d.input[1])
            fp8, tensor = (inits.get(sdq.input[0]), inits.get(sdq.input[1])) if sdq is not None else (None, None)
            label = f"NVFP4 block {block}"
            per = 4 + (width(fp8) if fp8 is not None else 32) / block + (
                width(tensor) * max(1, int(np.prod(tensor.dims, dtype=np.int64))) / count if tensor is not None else 0)
            floor = floor_bits(label, count)
        else:
            scale_bits = width(scale) if scale is not None else 32
            offsets = (inits.get(values.name.removesuffix(".values") + ".offsets")
                       if values.name.endswith(".values") else None)
            label = f"INT{bits[values.data_type]} block {block}" + (" + offsets" if offsets is not None else "")
            per = bits[values.data_type] + scale_bits / block + (width(offsets) / block if offsets is not None else 0)
            floor = floor_bits(label)
        row = out.setdefault(label, {"gemms": 0, "weights": 0, "bits_per_weight": 0.0, "floor_bits": 0.0})
        row["bits_per_weight"] = (row["bits_per_weight"] * row["weights"] + per * count) / (row["weights"] + count)
        row["floor_bits"] = (row["floor_bits"] * row["weights"] + floor * count) / (row["weights"] + count)
        row["gemms"] += 1
        row["weights"] += count
    return out


def floor_bits(label: str, weights: int | None = None) -> float:
    """The bits per weight of a block form with FP32 scales, from its definition:
    ``INT{b} block {s}``: ``b + 32/s`` (GGUF Q4_0: 5.0, Q8_0: 9.0 at s = 32), ``+ offsets``:
    another ``32/s`` (Q4_1 / Q4_K: 6.0); ``NVFP4 block 16``: ``4 + 8/16`` (the FP8 E4M3 block
    scales) ``+ 32/weights`` (one FP32 tensor scale; 4.5 when ``weights`` is None).

    Raises:
        ValueError: ``label`` is none of these forms.
    """
    parts = label.split()
    if len(parts) < 3 or parts[1] != "block" or not parts[2].isdigit():
        raise ValueError(f"{label!r} is not a block form ('INT4 block 32', 'NVFP4 block 16')")
    block = int(parts[2])
    if parts[0] == "NVFP4":
        return 4 + 8 / block + (32 / weights if weights else 0.0)
    if not parts[0].startswith("INT") or not parts[0][3:].isdigit():
        raise ValueError(f"{label!r}: unknown value type {parts[0]!r}")
    return int(parts[0][3:]) + 32 / block + (32 / block if label.endswith("+ offsets") else 0.0)


def bits_per_weight(formats: dict[str, dict[str, Any]]) -> float | None:
    """Mean bits per weight over :func:`block_weight_formats`' rows (None when there are none)."""
    weights = sum(r["weights"] for r in formats.values())
    return sum(r["bits_per_weight"] * r["weights"] for r in formats.values()) / weights if weights else None


def section_markdown(stamp: dict[str, Any], quantized_count: int | None, warnings: list[str]) -> str:
    """The report section for one engine, from its ``engine_stamp.json`` dict."""
    net = stamp.get("network") or {}
    kind = "parse-and-build CHECK (not a deployable engine)" if stamp.get("check_only") else "engine"
    rows = [
        ("backend", f"{stamp['backend_label']} {stamp['tensorrt_version']}"),
        ("built", kind),
        ("target", ", ".join(stamp.get("targets") or [stamp.get("compute_capability", "?")])),
        ("engine file", f"`{stamp['engine_file']}`, {stamp['engine_bytes']:,} bytes"),
        ("build wall time", f"{stamp['build_wall_s']:.2f} s (parse + build)"),
        ("builder peak RSS", f"{stamp['builder_peak_rss_mib']:.0f} MiB"),
        ("profiles", ", ".join(p["name"] for p in stamp["profiles"])),
        ("Q/DQ layers kept", f"{net.get('qdq_layers', '?')} (ONNX graph: {stamp.get('onnx_qdq_nodes', '?')} "
                             "Q/DQ nodes)"),
        ("GEMMs with INT8/FP8 operands", f"{len(net.get('low_precision_gemms', {}))} of {net.get('gemms', '?')} "
                                         "engine matrix multiplies, attention's included (quantize stage: "
                                         f"{'?' if quantized_count is None else quantized_count} weight GEMMs)"),
        *_weight_only_rows(stamp),
        *_lookup_rows(stamp),
        *_fp16_rows(stamp),
        ("timing cache", stamp["timing_cache"]),
        ("where it runs", stamp["runs_on"]),
    ]
    lines = ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    layers = ", ".join(f"{t} {n}" for t, n in (net.get("layers_by_type") or {}).items())
    text = "\n".join(lines) + f"\n\nLayers by type: {layers}\n"
    if warnings:
        text += "\n" + "\n".join(f"- WARNING: {w}" for w in warnings) + "\n"
    return text


def _weight_only_rows(stamp: dict[str, Any]) -> list[tuple[str, str]]:
    """Report rows of a graph with weight-only GEMMs (none without): the network's count by weight
    type, and the ONNX forms with their GEMM count and bits per weight."""
    formats = stamp.get("weight_formats") or {}
    if not formats:
        return []
    net = stamp.get("network") or {}
    by_type = Counter((net.get("weight_only_gemms") or {}).values())
    engine = ", ".join(f"{t} {n}" for t, n in sorted(by_type.items())) or "none"
    forms = "; ".join(f"{label}: {r['gemms']} GEMM{'s' * (r['gemms'] != 1)}, {r['bits_per_weight']:.2f} bits/weight"
                      + (f" (floor with FP32 scales {r['floor_bits']:.2f})" if "floor_bits" in r else "")
                      for label, r in formats.items())
    mean = bits_per_weight(formats)
    return [("weight-only GEMMs (block weights, FP32 activations)", f"{sum(by_type.values())} in the network "
             f"({engine})"),
            ("weight formats (ONNX graph)", f"{forms}; mean {mean:.2f} bits per weight (value + scale "
             "+ offset per block, as stored)")]


def _lookup_rows(stamp: dict[str, Any]) -> list[tuple[str, str]]:
    """``build.embedding_lookup: runtime``: what the engine takes, and the table beside it."""
    lookup = stamp.get("embedding_lookup")
    if not lookup:
        return []
    tensors = " + ".join(f"{name} {t['dtype']} {t['shape']}" for name, t in lookup["tensors"].items())
    block = f", blocks of {lookup['block_size']}" if lookup.get("block_size") else ""
    return [("embedding lookup", f"outside the engine (build.embedding_lookup: runtime): it takes "
             f"{lookup['engine_input']} [..., {lookup['hidden']}] {lookup['dtype']} in place of {lookup['replaces']}; "
             f"the table is `{lookup['file']}`, {lookup['bytes']:,} bytes ({tensors}{block}; {lookup['decode']})")]


def _fp16_rows(stamp: dict[str, Any]) -> list[tuple[str, str]]:
    """The engine's bytes against an FP16 engine of the same graph (``build.compare_fp16``), and with
    the lookup outside, the engine and its table against the FP16 engine and its FP16 table."""
    fp16 = stamp.get("fp16_engine_bytes")
    if not fp16:
        return [("engine vs FP16", stamp["fp16_engine_note"])] if stamp.get("fp16_engine_note") else []
    lookup, table16 = stamp.get("embedding_lookup"), stamp.get("fp16_table_bytes")
    cut = ", its lookup outside too" if lookup and table16 else ""
    rows = [("engine vs FP16", f"{stamp['engine_bytes']:,} bytes against {fp16:,} for an FP16 engine of the same "
             f"exported graph{cut}, same targets and profiles: {stamp['engine_bytes'] / fp16:.3f}x "
             "(build.compare_fp16)")]
    if lookup and table16:
        ours, theirs = stamp["engine_bytes"] + lookup["bytes"], fp16 + table16
        rows.append(("engine + table vs FP16", f"{ours:,} bytes against {theirs:,} (its FP16 table "
                     f"{table16:,}): {ours / theirs:.3f}x"))
    return rows
