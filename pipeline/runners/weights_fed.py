"""Validate's Q/DQ candidate run as the served python-onnxruntime model runs it: the weights'
Q/DQ once, at load, by the template's own ``dequantize_once`` (``templates/onnxruntime_model.py``)."""
from __future__ import annotations

import tempfile

import numpy as np
import onnx
import onnxruntime as ort

from pipeline.ort_sessions import optimization_level, providers, session_from, session_options
from pipeline.triton.templates import onnxruntime_model as served


class WeightsFed:
    """An InferenceSession of a Q/DQ graph whose weight DequantizeLinear nodes ran once, at load
    (the served python-onnxruntime template's ``dequantize_once``): their FP32 results are fed as
    graph inputs at every run. Consumers see the same values, still not constants (so no GEMM
    weight is prepacked, as before), so outputs are bit-identical to the graph's at the same
    level; only the per-run dequantization of every weight is gone (fp8-llm's graph, a batch-1
    decode step: 103 ms -> 25 ms, docs/serving.md). Memory: 4 bytes per weight, held.

    ``run`` (``session.run`` with the weights added), ``get_inputs`` (the graph's inputs less the
    weights), the rest of InferenceSession's reading methods, and :meth:`as_written` for timing
    what Triton's ONNX Runtime backend runs."""

    #: largest share of the available memory the FP32 weights may take; a larger graph runs as written
    MEMORY_SHARE = 0.15

    def __init__(self, session: ort.InferenceSession, weights: dict[str, np.ndarray], path: str,
                 opts: ort.SessionOptions):
        self._session, self.weights, self._path, self._opts = session, weights, path, opts

    @classmethod
    def load(cls, path: str) -> "WeightsFed | None":
        """The session for ``path`` at its :func:`pipeline.ort_sessions.optimization_level`; None (run
        the graph as written) unless that is ``basic`` and ONNX Runtime runs on the CPU alone (as the
        template does), or when it has no weight DequantizeLinear, a
        subgraph or an initializer listed as a graph input, or when the FP32 weights would take more
        than :data:`MEMORY_SHARE` of the available memory."""
        import psutil

        if optimization_level(path) != "basic" or providers() != ["CPUExecutionProvider"]:
            return None  # on a GPU, weights fed at every run would cross to the device at every run
        opts = session_options("basic")
        graph = onnx.load(path, load_external_data=False)
        nodes, _ = served.constant_dequantize_nodes(graph)
        if not nodes or _not_rewritable(graph) or \
                _float_bytes(graph, nodes) > cls.MEMORY_SHARE * psutil.virtual_memory().available:
            return None
        del graph
        try:
            model = onnx.load(path)
            weights = served.dequantize_once(model)
            with tempfile.TemporaryDirectory(prefix="pipeline-weights-fed-") as scratch:
                session = session_from(served.session_source(model, scratch), path, opts)
        except Exception:  # a graph the rewrite does not fit (a user's): run it as written, its errors named there
            return None
        return cls(session, weights, path, opts)

    def run(self, names, feeds) -> list[np.ndarray]:
        return self._session.run(names, {**feeds, **self.weights})

    def get_inputs(self):
        return [i for i in self._session.get_inputs() if i.name not in self.weights]

    def as_written(self) -> ort.InferenceSession:
        """A new session of the graph as written (its weights dequantized at every run), at the same options."""
        return session_from(self._path, self._path, self._opts)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._session, name)


def _not_rewritable(model: onnx.ModelProto) -> bool:
    """A graph whose weights :class:`WeightsFed` leaves in place: subgraphs (If / Loop / Scan bodies
    may read an initializer the top-level rewrite would drop) or an initializer listed as an input."""
    inits = {t.name for t in model.graph.initializer}
    subgraphs = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                    for n in model.graph.node for a in n.attribute)
    return subgraphs or any(i.name in inits for i in model.graph.input)


def _float_bytes(model: onnx.ModelProto, nodes) -> int:
    """Bytes of the FP32 values of the weights ``nodes`` (DequantizeLinear, or QuantizeLinear of a
    float weight) dequantize."""
    dims = {t.name: t.dims for t in model.graph.initializer}
    return sum(4 * int(np.prod(dims[n.input[0]])) for n in nodes if n.input[0] in dims)
