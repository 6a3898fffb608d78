"""The quantize stage's graph files: the result written and proved loadable, and the 7-bit INT8 CPU twin."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import onnx

from pipeline import onnx_io
from pipeline.artifacts import QuantizedArtifact
from pipeline.quant import qdq



#: the CPU graph of a 7-bit INT8 quantize stage (QuantizedArtifact.cpu_onnx_path)
CPU_GRAPH = "model_cpu.onnx"

def save_cpu_graph(art: QuantizedArtifact) -> QuantizedArtifact:
    """Write :data:`CPU_GRAPH` beside ``art.onnx_path``: the same values with UINT8 activations
    (:func:`pipeline.quant.qdq.uint8_activations`), and prove it loads."""
    path = Path(art.onnx_path)
    model = onnx.load(str(path), load_external_data=False)  # external weights are copied one at a time
    qdq.uint8_activations(model)  # zero points are small: always inline
    cpu = path.with_name(CPU_GRAPH)
    onnx_io.save_model_atomic(model, cpu, base_dir=path.parent)
    onnx_io.require_loadable(str(cpu), "quantize")
    return dataclasses.replace(art, cpu_onnx_path=str(cpu))

def save(art: QuantizedArtifact, model: onnx.ModelProto, src: Path) -> QuantizedArtifact:
    """Write the graph (tensors still on disk are read from ``src``'s folder) and prove it loads."""
    onnx_io.save_model_atomic(model, art.onnx_path, base_dir=src.parent)
    onnx_io.require_loadable(art.onnx_path, "quantize")
    return art
