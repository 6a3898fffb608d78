"""What the parsed TensorRT network holds, and the build stage's report section (``build/engine.md``).

Read from the strongly typed network before the build (so it needs no GPU and
works for both backends): layer counts by type, the Q/DQ layers the parser
kept, and the GEMMs (matrix multiply, convolution, deconvolution) whose two
operands both come from a DequantizeLayer of INT8/FP8 data (through
shuffles: transposes and reshapes). Those are the GEMMs TensorRT may run in
INT8/FP8; a GEMM the quantize stage quantized that is not among them would
run in higher precision than validate measured.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

GEMM_TYPES = ("MATRIX_MULTIPLY", "CONVOLUTION", "DECONVOLUTION")
_LOW_PRECISION = ("INT8", "FP8")
_PASS_THROUGH = ("SHUFFLE",)
SECTION_FILE = "engine.md"


@dataclass
class NetworkSummary:
    """``layers_by_type``: LayerType name -> count; ``qdq_layers``: Quantize + Dequantize layers;
    ``gemms``: GEMM layers; ``low_precision_gemms``: layer name -> "INT8"/"FP8" of those
    with both operands dequantized from that type."""

    layers_by_type: dict[str, int]
    qdq_layers: int
    gemms: int
    low_precision_gemms: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize_network(network: Any) -> NetworkSummary:
    """Summarize a parsed ``INetworkDefinition`` (either TensorRT module)."""
    layers = [network.get_layer(i) for i in range(network.num_layers)]
    producer = {layer.get_output(j).name: layer for layer in layers for j in range(layer.num_outputs)}
    types = Counter(layer.type.name for layer in layers)
    low: dict[str, str] = {}
    for layer in layers:
        if layer.type.name in GEMM_TYPES and layer.num_inputs >= 2:
            kinds = {_dequantized_from(layer.get_input(k), producer) for k in (0, 1)}
            if len(kinds) == 1 and None not in kinds:
                low[layer.name] = str(kinds.pop())
    return NetworkSummary(dict(sorted(types.items())), types["QUANTIZE"] + types["DEQUANTIZE"],
                          sum(types[t] for t in GEMM_TYPES), low)


def _dequantized_from(tensor: Any, producer: dict[str, Any]) -> str | None:
    """"INT8"/"FP8" if ``tensor`` is a DequantizeLayer's output of such data (via shuffles)."""
    seen = 0
    while tensor is not None and seen < 16:
        layer = producer.get(tensor.name)
        if layer is None:
            return None
        if layer.type.name == "DEQUANTIZE":
            dtype = layer.get_input(0).dtype.name
            return dtype if dtype in _LOW_PRECISION else None
        if layer.type.name not in _PASS_THROUGH:
            return None
        tensor, seen = layer.get_input(0), seen + 1
    return None


def gemm_mismatch(summary: NetworkSummary, quantized_nodes: list[str] | None) -> list[str]:
    """The quantize stage's quantized GEMMs (ONNX node names, which the parser keeps as
    layer names) that are not low-precision GEMMs in the network; [] when not known."""
    if quantized_nodes is None:
        return []
    return [n for n in quantized_nodes if n not in summary.low_precision_gemms]


def mismatch_warning(missing: list[str], quantized: int) -> str:
    shown = ", ".join(missing[:10]) + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else "")
    return (f"{len(missing)} of the {quantized} GEMMs the quantize stage quantized have no INT8/FP8 operands in "
            f"the TensorRT network, so TensorRT runs them in higher precision than validate measured: {shown}")


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
        ("timing cache", stamp["timing_cache"]),
        ("where it runs", stamp["runs_on"]),
    ]
    lines = ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    layers = ", ".join(f"{t} {n}" for t, n in (net.get("layers_by_type") or {}).items())
    text = "\n".join(lines) + f"\n\nLayers by type: {layers}\n"
    if warnings:
        text += "\n" + "\n".join(f"- WARNING: {w}" for w in warnings) + "\n"
    return text
