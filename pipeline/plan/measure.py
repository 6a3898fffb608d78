"""Measurements on this machine that ``pipeline plan`` checks its formulas against.

* :func:`copy_bandwidth`: a numpy copy benchmark (STREAM "copy" convention:
  each run reads and writes the array once, so 2 x its bytes move), median of
  several runs, GB/s.
* :func:`present_kv_bytes`: one ONNX Runtime run of an exported causal LM at a
  small shape; the bytes of its ``present.*`` outputs (the KV cache it returns).
* :func:`decode_tokens_per_s`: a few batch-1 decode steps of the graph the CPU
  serves (``python-onnxruntime``: weight DequantizeLinear run once at load, as
  the served model does), timed; median tokens/s.
"""
from __future__ import annotations

import contextlib
import importlib.util
import statistics
import sys
import time
import types
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from pipeline.errors import PipelineError
from pipeline.recipe.kinds import KV_PAST_RE, KV_PRESENT_RE, past_name



def copy_bandwidth(size_mib: int = 256, repeats: int = 7) -> dict:
    """Memory bandwidth of this machine from ``np.copyto`` of a ``size_mib`` MiB float64 array.

    The array should be far larger than the last-level cache (256 MiB is).
    One untimed warm-up run touches both arrays first.

    Returns:
        ``{"median_gbs", "runs_gbs": [...], "bytes_per_run", "size_mib", "repeats",
        "method"}``; GB/s = 10^9 bytes/s, bytes per run = 2 x array bytes (read + write).

    Raises:
        ValueError: ``size_mib`` or ``repeats`` below 1.
    """
    if size_mib < 1 or repeats < 1:
        raise ValueError(f"copy_bandwidth: size_mib ({size_mib}) and repeats ({repeats}) must be >= 1")
    src = np.ones(size_mib * 2**20 // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # warm-up: page faults of dst happen here, not in a timed run
    moved = 2 * src.nbytes
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        runs.append(moved / (time.perf_counter() - start) / 1e9)
    return {"median_gbs": statistics.median(runs), "runs_gbs": runs, "bytes_per_run": moved,
            "size_mib": size_mib, "repeats": repeats,
            "method": "numpy copyto of a float64 array, read + write counted (STREAM copy)"}


def present_kv_bytes(onnx_path: str | Path, batch: int = 2, sequence: int = 3, past: int = 5) -> dict:
    """Run the exported graph once on CPU at [batch, sequence] new tokens after ``past`` cached
    ones; sum the bytes of every ``present.*`` output (shape [batch, kv_heads, past + sequence, head_dim]).

    Returns:
        ``{"bytes", "batch", "sequence", "past", "tokens": past + sequence, "outputs": n}``.

    Raises:
        PipelineError: the graph has no ``present.*`` output, or an input this
            function cannot feed (it feeds input_ids, attention_mask, position_ids
            and past_key_values.*).
    """
    session = _session(str(onnx_path), {})
    outputs = [o.name for o in session.get_outputs() if KV_PRESENT_RE.match(o.name)]
    if not outputs:
        raise PipelineError(f"{onnx_path}: no present.* outputs; the KV-cache check needs a causal LM "
                            "exported with its cache as graph I/O")
    feeds = _feeds(session, batch, sequence, past, np.random.default_rng(0), {})
    got = session.run(outputs, feeds)
    return {"bytes": int(sum(a.nbytes for a in got)), "batch": batch, "sequence": sequence, "past": past,
            "tokens": past + sequence, "outputs": len(outputs)}


def decode_tokens_per_s(served_onnx: str | Path, prompt_tokens: int = 16, steps: int = 8) -> dict:
    """Batch-1 decode speed of the CPU-served graph: a ``prompt_tokens`` prefill, then
    ``steps`` one-token steps fed with the returned KV cache, each timed.

    Returns:
        ``{"tokens_per_s": 1 / median step s, "step_ms": [...], "mean_context": tokens in
        the cache on average over the steps, "prompt_tokens", "steps", "graph"}``.

    Raises:
        PipelineError: as :func:`present_kv_bytes`; ``steps`` or ``prompt_tokens`` below 1.
    """
    if steps < 1 or prompt_tokens < 1:
        raise PipelineError(f"decode measurement: steps ({steps}) and prompt_tokens ({prompt_tokens}) must be >= 1")
    weights, model = _served_weights(Path(served_onnx))
    session = _session(model, weights)
    outputs = [o.name for o in session.get_outputs()]
    rng = np.random.default_rng(0)
    result = dict(zip(outputs, session.run(outputs, {**weights, **_feeds(session, 1, prompt_tokens, 0, rng, weights)})))
    times, context = [], prompt_tokens
    for _ in range(steps):
        feeds = _feeds(session, 1, 1, context, rng, weights)
        feeds.update({past_name(n): result[n] for n in outputs if KV_PRESENT_RE.match(n)})
        start = time.perf_counter()
        result = dict(zip(outputs, session.run(outputs, {**weights, **feeds})))
        times.append(time.perf_counter() - start)
        context += 1
    return {"tokens_per_s": 1.0 / statistics.median(times), "step_ms": [t * 1e3 for t in times],
            "mean_context": prompt_tokens + (steps + 1) / 2, "prompt_tokens": prompt_tokens, "steps": steps,
            "graph": str(served_onnx)}


def _served_weights(path: Path) -> tuple[dict[str, np.ndarray], onnx.ModelProto]:
    """The graph as the python-onnxruntime model serves it: weight Q/DQ run once, fed as inputs."""
    model = onnx.load(str(path))
    if not any(n.op_type == "DequantizeLinear" for n in model.graph.node):
        return {}, model
    with _template("onnxruntime_model.py") as template:
        return template.dequantize_once(model), model


@contextlib.contextmanager
def _template(name: str) -> Iterator[types.ModuleType]:
    """Import a Triton model template outside Triton (its ``triton_python_backend_utils``
    import is answered by an empty stand-in, removed again afterwards)."""
    source = resources.files("pipeline.triton") / "templates" / name
    saved = sys.modules.get("triton_python_backend_utils")
    sys.modules["triton_python_backend_utils"] = types.ModuleType("triton_python_backend_utils")
    try:
        with resources.as_file(source) as file:
            spec = importlib.util.spec_from_file_location(f"_plan_{Path(name).stem}", file)
            assert spec and spec.loader
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        yield module
    finally:
        if saved is None:
            sys.modules.pop("triton_python_backend_utils", None)
        else:
            sys.modules["triton_python_backend_utils"] = saved


def _session(model: str | onnx.ModelProto, weights: dict) -> ort.InferenceSession:
    """CPU session; Q/DQ graphs at ONNX Runtime's basic level (as pipeline.ort_sessions and the served model)."""
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(model, load_external_data=False)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    qdq = any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in proto.graph.node) or bool(weights)
    opts.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_BASIC if qdq
                                     else ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])


def _feeds(session: ort.InferenceSession, batch: int, sequence: int, past: int,
           rng: np.random.Generator, skip: dict) -> dict[str, np.ndarray]:
    """Random token ids, an all-ones mask, positions past..past+sequence-1 and random past tensors."""
    feeds: dict[str, np.ndarray] = {}
    for spec in session.get_inputs():
        name = spec.name
        if name in skip:
            continue
        if name == "input_ids":
            feeds[name] = rng.integers(0, 100, size=(batch, sequence), dtype=np.int64)
        elif name == "attention_mask":
            feeds[name] = np.ones((batch, past + sequence), dtype=np.int64)
        elif name == "position_ids":
            feeds[name] = np.tile(np.arange(past, past + sequence, dtype=np.int64), (batch, 1))
        elif KV_PAST_RE.match(name):
            _, heads, _, head_dim = spec.shape
            dtype = np.float16 if "float16" in spec.type else np.float32
            feeds[name] = rng.standard_normal((batch, heads, past, head_dim)).astype(dtype)
        else:
            raise PipelineError(f"graph input {name!r} {spec.shape}: the plan's measurement feeds only "
                                "input_ids, attention_mask, position_ids and past_key_values.*")
    return feeds

