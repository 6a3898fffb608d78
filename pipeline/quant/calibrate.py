"""Activation statistics (amax) from real data: streaming and mergeable.

Per tensor, only running statistics are kept, never the activations: the
range (min, max, min |x|) and, for the histogram methods, bin counts over a
fixed range. :func:`merge_stats` reduces two such objects, so batches split
over processes or hosts calibrate like one run (ranges first, then
histograms over the merged ranges).

The FP32 graph gets only the calibrated tensors as outputs (the logits and
the KV cache are dropped, with every node they alone need); each range is
reduced inside the graph (ReduceMin/ReduceMax), so ``max`` never copies an
activation out of ONNX Runtime. The session runs unoptimized, as ONNX
Runtime's own calibrator does, so the values match it bit for bit.

``max`` is the abs-max. ``percentile`` and ``entropy`` are ONNX Runtime's
histogram methods (entropy = KL-divergence threshold, Migacz, "8-bit
Inference with TensorRT", GTC 2017), computed by its HistogramCollector from
our histograms, which equal the ones it would build over all batches at once.
``mse`` and ``kl`` are one clip search (:func:`pipeline.quant.clip.clip_amax`): from the |x| histogram, the
amax that minimises the expected squared quantization error of the target format
(clipping plus rounding), or the KL divergence of the histogram after quantization. The
same search clips weights (:func:`pipeline.quant.clip.weight_clip_ratio`, recipe ``quantize.weight_clip``).
"""
from __future__ import annotations

import contextlib
import io
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import onnx
from onnx import helper

from pipeline import onnx_io
from pipeline.errors import QuantizationError
from pipeline.memory import release_freed
from pipeline.ort_sessions import run_checked
from pipeline.quant.clip import CLIP_LOSSES, clip_amax
from pipeline.quant.qdq import QFormat

METHODS = ("max", "percentile", "entropy", "mse", "kl")
NUM_BINS = 2048  # histogram bins (ORT's default 128 leaves entropy one threshold candidate: the max)
ENTROPY_QUANTIZED_BINS = 128
_ABS_HIST = {"percentile", "mse", "kl"}  # histograms of |x| over [min |x|, max |x|]; entropy: of x, symmetric


@dataclass(frozen=True)
class TensorStats:
    """Running statistics of one activation (float32 scalars, NaN ignored).

    ``hist``/``edges``: int64 counts and ``len(hist) + 1`` edges, or None before
    the histogram pass.
    """
    lo: np.floating
    hi: np.floating
    abs_lo: np.floating
    hist: np.ndarray | None = None
    edges: np.ndarray | None = None

    def merged(self, other: "TensorStats", name: str = "") -> "TensorStats":
        """Both together. Raises ValueError: histograms over different ranges."""
        hist, edges = self.hist, self.edges
        if (hist is None) != (other.hist is None):
            raise ValueError(f"calibration stats of {name!r}: one side has a histogram, the other none")
        if hist is not None:
            if not np.array_equal(edges, other.edges):
                raise ValueError(f"calibration stats of {name!r}: histograms over different ranges; merge the "
                                 "ranges first and bin every part over the merged ones")
            hist = hist + other.hist
        return TensorStats(np.fmin(self.lo, other.lo), np.fmax(self.hi, other.hi),
                           np.fmin(self.abs_lo, other.abs_lo), hist, edges)

    @property
    def abs_hi(self) -> np.floating:
        return np.fmax(np.abs(self.lo), np.abs(self.hi))


@dataclass(frozen=True)
class CalibrationStats:
    """Per-tensor :class:`TensorStats` of one method over some batches (``batches``: how many)."""
    method: str
    tensors: dict[str, TensorStats]
    batches: int

    def amax(self, fmt: QFormat, percentile: float = 99.99) -> dict[str, float]:
        """amax per tensor (float). Raises QuantizationError: a histogram method without histograms."""
        if self.method == "max":
            return {t: float(np.nanmax([np.abs(s.lo), np.abs(s.hi)])) for t, s in self.tensors.items()}
        if any(s.hist is None for s in self.tensors.values()):
            raise QuantizationError(f"calibration method {self.method!r} needs histograms; these stats hold "
                                    "ranges only (collect_stats with ranges=...)")
        if self.method in CLIP_LOSSES:
            return {t: clip_amax(s.hist, s.edges, fmt, self.method) for t, s in self.tensors.items()}
        return _ort_thresholds(self, percentile)


def merge_stats(a: CalibrationStats, b: CalibrationStats) -> CalibrationStats:
    """The statistics of both parts' batches together (associative, commutative).

    Raises:
        ValueError: different methods or tensors, or histograms over different ranges.
    """
    if a.method != b.method or a.tensors.keys() != b.tensors.keys():
        raise ValueError(f"calibration stats differ in method ({a.method} vs {b.method}) or tensors")
    return CalibrationStats(a.method, {t: s.merged(b.tensors[t], t) for t, s in a.tensors.items()},
                            a.batches + b.batches)


def collect_stats(onnx_path: str | Path, tensors: list[str], batches: Iterable[dict[str, np.ndarray]],
                  method: str, *, ranges: CalibrationStats | None = None,
                  scratch_dir: str | Path | None = None) -> CalibrationStats:
    """Streaming statistics of ``tensors`` over ``batches`` (one batch in memory at a time).

    Args:
        onnx_path: FP32 graph, inline or with external data beside it (any size).
        tensors: activation names (inputs of the GEMMs to quantize).
        batches: feed dicts for the graph.
        method: one of :data:`METHODS`.
        ranges: for the histogram methods, the ranges (merged over every part of the data)
            to bin over; None: ranges only (the first pass; ``max`` needs nothing more).
        scratch_dir: where the temporary augmented graph of an inline model goes.

    Raises:
        QuantizationError: unknown method, no batch, or a tensor not in the graph.
        OrtRunError: ONNX Runtime failed on a batch (exit 2: the exported graph).
    """
    if method not in METHODS:
        raise QuantizationError(f"calibration method {method!r}: expected one of {list(METHODS)}")
    hist = ranges is not None and method != "max"
    with _session(Path(onnx_path), tensors, scratch_dir, fetch_values=hist) as (sess, names):
        graph = f"the calibration copy of {onnx_path}"
        parts = [_batch_stats(method, sess, names, tensors, feeds, ranges, graph) for feeds in batches]
    if not parts:
        raise QuantizationError("calibration: no calibration batch")
    total = parts[0]
    for part in parts[1:]:
        total = merge_stats(total, part)
    return total


def collect_amax(onnx_path: str | Path, tensors: list[str], batches: list[dict[str, np.ndarray]],
                 method: str, fmt: QFormat, percentile: float = 99.99,
                 scratch_dir: str | Path | None = None) -> dict[str, float]:
    """amax per tensor name, over all calibration batches (:func:`collect_stats`; the
    histogram methods take two passes: ranges, then histograms over them).

    Raises:
        QuantizationError: as :func:`collect_stats`.
    """
    stats = collect_stats(onnx_path, tensors, batches, method, scratch_dir=scratch_dir)
    if method != "max":
        stats = collect_stats(onnx_path, tensors, batches, method, ranges=stats, scratch_dir=scratch_dir)
    return stats.amax(fmt, percentile)


def _batch_stats(method: str, sess, names: dict, tensors: list[str], feeds: dict,
                 ranges: CalibrationStats | None, graph: str) -> CalibrationStats:
    """One batch's stats: the in-graph ranges, and with ``ranges`` its histograms over them."""
    fetch = [o.name for o in sess.get_outputs()]
    out = dict(zip(fetch, run_checked(sess, fetch, feeds, user_graph=True, graph=graph)))
    stats = {}
    for t in tensors:
        lo, hi, abs_lo = (out[n][()] for n in names[t])
        hist = _histogram(method, out[t], ranges.tensors[t]) if ranges is not None and method != "max" else (None, None)
        stats[t] = TensorStats(lo, hi, abs_lo, *hist)
    return CalibrationStats(method, stats, 1)


def _histogram(method: str, x: np.ndarray, r: TensorStats) -> tuple[np.ndarray, np.ndarray]:
    """Counts and edges of ``x`` over the range ``r``: exactly what ONNX Runtime's
    HistogramCollector builds in one call over all batches (same edges, same dtypes)."""
    x = x.ravel()
    if method in _ABS_HIST:
        hist, edges = np.histogram(np.absolute(x), bins=NUM_BINS, range=(r.abs_lo, r.abs_hi))
        return hist, edges.astype(x.dtype)
    threshold = np.array(max(abs(r.lo), abs(r.hi)), dtype=x.dtype)
    return np.histogram(x, NUM_BINS, range=(-threshold, threshold))


def _ort_thresholds(stats: CalibrationStats, percentile: float) -> dict[str, float]:
    """ONNX Runtime's percentile / entropy thresholds from our histograms, as abs-max."""
    from onnxruntime.quantization.calibrate import HistogramCollector

    col = HistogramCollector(method=stats.method, symmetric=True, num_bins=NUM_BINS,
                             num_quantized_bins=ENTROPY_QUANTIZED_BINS, percentile=percentile, scenario="same")
    for t, s in stats.tensors.items():
        if stats.method == "percentile":
            col.histogram_dict[t] = (s.hist, s.edges, s.lo, s.hi)
        else:
            col.histogram_dict[t] = (s.hist, s.edges, s.lo, s.hi, np.array(max(abs(s.lo), abs(s.hi)), s.lo.dtype))
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its progress
        found = col.compute_collection_result()
    return {t: float(np.max(np.abs(np.asarray(v[:2], np.float64)))) for t, v in found.items()}


@contextlib.contextmanager
def _session(src: Path, tensors: list[str], scratch_dir, *, fetch_values: bool):
    """An unoptimized CPU session of ``src`` whose outputs are each tensor's min, max and
    min |x| (and, with ``fetch_values``, the tensor itself), nothing else; yields
    ``(session, {tensor: (min, max, min_abs) output names})``.

    The graph of a model with external data is written beside it (its data files are
    read in place) and removed afterwards; an inline one goes to a scratch folder."""
    import onnxruntime as ort

    model = onnx.load(str(src), load_external_data=False)
    names = _augment(model, tensors, fetch_values)
    external = bool(onnx_io.external_files(model))
    with tempfile.TemporaryDirectory(dir=scratch_dir, prefix="calibrate-") as tmp:
        path = (src.parent / f".calibrate-{uuid.uuid4().hex}.onnx") if external else Path(tmp) / "augmented.onnx"
        try:
            onnx_io.save_graph(model, path)
            del model
            opts = ort.SessionOptions()
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # ORT's calibrator's values
            opts.log_severity_level = 3
            sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        finally:
            if external:
                path.unlink(missing_ok=True)
        yield sess, names


def _augment(model: onnx.ModelProto, tensors: list[str], fetch_values: bool) -> dict[str, tuple[str, str, str]]:
    """Make ``model`` compute only what ``tensors`` need, with their ranges (and values) as
    its only outputs. Raises QuantizationError: a tensor is not in the graph."""
    g = model.graph
    produced = {o for n in g.node for o in n.output} | {i.name for i in g.input}
    missing = [t for t in tensors if t not in produced]
    if missing:
        raise QuantizationError(f"calibration: tensors {missing[:5]} are not in the graph ({len(missing)} in all)")
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.value_info, *g.input, *g.output]}
    _prune(g, set(tensors))
    outputs, names, nodes = [], {}, []
    for i, t in enumerate(tensors):
        elem = types.get(t) or onnx.TensorProto.FLOAT
        absn, lo, hi, alo = (f"calib_{i}_{k}" for k in ("abs", "min", "max", "absmin"))
        nodes += [helper.make_node("ReduceMin", [t], [lo], keepdims=0),  # no axes: all, at every opset
                  helper.make_node("ReduceMax", [t], [hi], keepdims=0),
                  helper.make_node("Abs", [t], [absn]), helper.make_node("ReduceMin", [absn], [alo], keepdims=0)]
        outputs += [helper.make_tensor_value_info(n, elem, []) for n in (lo, hi, alo)]
        if fetch_values:
            outputs.append(helper.make_tensor_value_info(t, elem, None))
        names[t] = (lo, hi, alo)
    g.node.extend(nodes)
    del g.output[:]
    g.output.extend(outputs)
    return names


def _prune(g: onnx.GraphProto, needed: set[str]) -> None:
    """Drop the nodes and initializers no tensor in ``needed`` depends on (the logits'
    projection, the KV cache's concatenations); the rest keeps its order."""
    keep = [False] * len(g.node)
    want = set(needed)
    for i in range(len(g.node) - 1, -1, -1):
        node = g.node[i]
        if want.intersection(node.output):
            keep[i] = True
            want.update(_node_inputs(node))
    kept = [n for n, k in zip(g.node, keep) if k]
    del g.node[:]
    g.node.extend(kept)
    inits = [t for t in g.initializer if t.name in want]
    del g.initializer[:]
    g.initializer.extend(inits)


def _node_inputs(node: onnx.NodeProto) -> set[str]:
    """A node's inputs, with the outer-scope names its subgraphs read."""
    names = {i for i in node.input if i}
    for attr in node.attribute:
        for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
            for n in sub.node:
                names |= _node_inputs(n)
    return names


def mse_amax(hist: np.ndarray, edges: np.ndarray, fmt: QFormat, candidates: int = 128) -> float:
    """:func:`pipeline.quant.clip.clip_amax` with the squared-error loss (calibration method ``mse``)."""
    return clip_amax(hist, edges, fmt, "mse", candidates)


def collect_channel_amax(model: onnx.ModelProto, tensors: list[str],
                         batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Per-channel abs-max of activations (last axis = channel), over all batches.

    ONNX Runtime's calibrators report one range per tensor; SmoothQuant needs one
    per input channel of each GEMM. The graph is augmented with ``tensors`` as
    extra outputs and run once per batch in ONNX Runtime (CPU).

    Args:
        model: FP32 graph with its weights loaded (inline; under 2 GiB serialized).
        tensors: float activation names; each is ``[..., C]``.
        batches: feed dicts for the graph.

    Returns:
        name -> float64 ``[C]`` abs-max over every position of every batch.

    Raises:
        QuantizationError: no batch, or a tensor is not in the graph.
    """

    if not batches:
        raise QuantizationError("per-channel calibration: no calibration batch")
    sess = _session_with_outputs(model, tensors, "per-channel calibration")
    amax: dict[str, np.ndarray] = {}
    for feeds in batches:
        for name, value in zip(tensors, run_checked(sess, tensors, feeds, user_graph=True,
                                                    graph="the FP32 graph with its GEMM inputs as outputs")):
            m = np.abs(value.reshape(-1, value.shape[-1])).max(axis=0).astype(np.float64)
            amax[name] = m if name not in amax else np.maximum(amax[name], m)
    return amax


#: the seed of the calibration rows sampled for a scale search (:func:`collect_rows`)
ROW_SEED = 0


def collect_rows(model: onnx.ModelProto, tensors: list[str], batches: list[dict[str, np.ndarray]],
                 rows: int, seed: int = ROW_SEED) -> dict[str, np.ndarray]:
    """Sampled rows of activations (last axis = channel): what a fold-point scale search
    (:mod:`pipeline.quant.fold_search`, AWQ's ``mean |x|`` and the block output error) needs, where
    amax is not enough.

    The same positions are taken from every tensor: ``rows`` of all ``P`` positions (the product of
    each output's leading dims, summed over batches), chosen once by ``numpy.random.default_rng(seed)``
    without replacement and kept in position order, so the result depends on the batches, ``rows``
    and ``seed`` only. All positions when ``P <= rows``. The graph runs as in
    :func:`collect_channel_amax` (ONNX Runtime, CPU, the tensors as extra outputs).

    Args:
        model: FP32 graph with its weights loaded (inline; under 2 GiB serialized).
        tensors: float activation names, each ``[..., C]`` with the same leading dims per batch.
        batches: feed dicts for the graph.
        rows: positions to keep (>= 1).

    Returns:
        name -> float32 ``[min(rows, P), C]``.

    Raises:
        QuantizationError: no batch, ``rows`` < 1, a tensor not in the graph, or tensors whose
            leading dims differ within a batch.
    """

    if not batches:
        raise QuantizationError("activation rows: no calibration batch")
    if rows < 1:
        raise QuantizationError(f"activation rows: rows = {rows}, need >= 1")
    sess = _session_with_outputs(model, tensors, "activation rows", arena=False)
    parts: dict[str, list[np.ndarray]] = {t: [] for t in tensors}
    pick, start = None, 0
    for i, feeds in enumerate(batches):
        values = run_checked(sess, tensors, feeds, user_graph=True,
                             graph="the FP32 graph with its fold-point inputs as outputs")
        counts = {int(np.prod(v.shape[:-1])) for v in values}
        if len(counts) != 1:
            raise QuantizationError(f"activation rows: batch {i}: the tensors have different leading dims "
                                    f"({sorted(counts)} positions)")
        n = counts.pop()
        if pick is None:  # positions per batch are the same for every tensor; P from the first pass' sizes
            total = n * len(batches) if all(_rows_like(b, batches[0]) for b in batches) else None
            pick = _positions(total, rows, seed) if total is not None else None
        sel = (pick[(pick >= start) & (pick < start + n)] - start) if pick is not None else slice(None)
        for t, v in zip(tensors, values):
            parts[t].append(np.ascontiguousarray(v.reshape(-1, v.shape[-1])[sel], np.float32))
        start += n
    out = {t: np.concatenate(p) for t, p in parts.items()}
    if pick is None:  # uneven batches: sample over the concatenation (same positions for every tensor)
        keep = _positions(start, rows, seed)
        out = {t: v[keep] for t, v in out.items()}
    del sess
    release_freed()  # the session's weights and activations, before the caller's search holds the rows
    return out


def _rows_like(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}


def _positions(total: int, rows: int, seed: int) -> np.ndarray:
    """Sorted int64 positions: ``rows`` of ``range(total)`` (all when ``total <= rows``)."""
    if total <= rows:
        return np.arange(total, dtype=np.int64)
    return np.sort(np.random.default_rng(seed).choice(total, size=rows, replace=False)).astype(np.int64)


def _session_with_outputs(model: onnx.ModelProto, tensors: list[str], what: str, *, arena: bool = True):
    """An ONNX Runtime CPU session of ``model`` with each of ``tensors`` (float32) added as a graph
    output, at ONNX Runtime's default level, warnings off. The outputs are added to ``model`` for
    the serialization only and removed after it (no copy of the graph: a copy holds the weights
    again, 1.8 GiB at 0.5 B parameters). ``arena=False``: no CPU memory
    arena (a run's activations are freed after it, not held at their peak; the results are the same).

    Raises:
        QuantizationError: a tensor is not an output of a node nor a graph input (names up to 5, after ``what``).
    """
    import onnxruntime as ort
    from onnx import TensorProto, helper

    known = {o for n in model.graph.node for o in n.output} | {i.name for i in model.graph.input}
    missing = [t for t in tensors if t not in known]
    if missing:
        raise QuantizationError(f"{what}: tensors {missing[:5]} are not in the graph")
    outputs = model.graph.output
    kept = len(outputs)
    present = {o.name for o in outputs}
    outputs.extend(helper.make_tensor_value_info(t, TensorProto.FLOAT, None) for t in tensors if t not in present)
    try:
        serialized = model.SerializeToString()
    finally:
        del outputs[kept:]
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.enable_cpu_mem_arena = arena
    return ort.InferenceSession(serialized, opts, providers=["CPUExecutionProvider"])
