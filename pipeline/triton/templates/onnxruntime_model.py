"""Triton python-backend model: runs ``model.onnx`` with ONNX Runtime on CPU.

Written into ``<repo>/<model>/<version>/model.py`` by pipeline.triton.repository,
next to the ONNX file named by the config parameter ``onnx_file``. Inputs and
outputs are the config's, in the graph's dtypes and shapes. The parameter
``graph_optimization_level`` (``disabled`` | ``basic`` | ``extended`` | ``all``)
sets the session's graph optimizations (``basic`` for Q/DQ graphs). The parameter
``session_config`` (a JSON object, optional) holds ONNX Runtime session config entries
set on the session: ``{"session.qdq_matmulnbits_accuracy_level": "1"}`` for weight-only
INT4 blocks, so that their fused MatMulNBits compute in FP32 as validate ran them.

Weights (parameter ``dequantize_weights`` = ``once``, set for Q/DQ graphs):
every DequantizeLinear of a weight (its inputs all initializers: a quantized
weight, its scale and zero point; or a QuantizeLinear of a float weight) is
run once at load, by ONNX Runtime's own Q/DQ kernels, removed from the graph,
and its FP32 result is fed as a graph input of the same name at every call. Consumers see the same values and
still a non-constant tensor (ONNX Runtime prepacks only constant GEMM
operands), so outputs are bit-identical to the unchanged graph at the same
optimization level (pipeline's tests compare them); only the per-call
dequantization of every weight is gone (on the fp8-llm graph, 2 CPU cores:
~360 ms -> ~110 ms per decode step). Memory: the FP32 weights stay resident
(4 bytes per weight).

Threads: parameter ``intra_op_threads`` when > 0; else, with several model
instances, the CPUs this process may use divided among them (N instances do
not oversubscribe the CPU); else ONNX Runtime's default (one per physical
core).

Batching (config ``max_batch_size`` > 0): the requests of one ``execute`` call
are grouped by the shapes of their inputs past the batch axis (and dtypes);
each group is concatenated along axis 0, run once and split back per request.
Requests of different shapes (e.g. different sequence lengths) cannot share a
tensor, so each such group runs separately. With ``max_batch_size`` 0 every
request runs on its own. A failing group answers each of its requests with an
error response; the other groups are unaffected.
"""
import json
import os
import tempfile

import numpy as np
import onnx
import onnxruntime as ort
try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # outside Triton: the pipeline's validate dequantizes weights as served (dequantize_once)
    pb_utils = None

LEVELS = {
    "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
_PROTO_LIMIT = 2**31 - 1  # protobuf cannot serialise a message of 2 GiB or more


def constant_dequantize_nodes(model):
    """DequantizeLinear nodes of weights, with the QuantizeLinear feeding one where there is one.

    A weight DQ reads only initializers, or a QuantizeLinear that reads only
    initializers and feeds nothing else (a float weight quantized in the graph).
    Returns ``(nodes to run once, DQ output names)``.
    """
    names = {t.name for t in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    readers = {}
    for n in model.graph.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1

    def constant(node):
        return all(i in names for i in node.input if i)

    nodes, outputs = [], []
    for n in model.graph.node:
        if n.op_type != "DequantizeLinear" or not all(i in names for i in n.input[1:] if i):
            continue
        q = producer.get(n.input[0])
        if n.input[0] in names:
            nodes.append(n)
        elif q is not None and q.op_type == "QuantizeLinear" and constant(q) and readers[n.input[0]] == 1:
            nodes += [q, n]
        else:
            continue
        outputs.append(n.output[0])
    return nodes, outputs


def dequantize_once(model):
    """Move the weight Q/DQ nodes (:func:`constant_dequantize_nodes`) out of ``model`` (in place).

    Returns ``{DQ output name: float array}``, computed by an ONNX Runtime
    session holding only those nodes; each output becomes a graph input of
    ``model`` and initializers no node reads any more are dropped.
    """
    nodes, outputs = constant_dequantize_nodes(model)
    if not nodes:
        return {}
    wanted = {i for n in nodes for i in n.input if i}
    types = {t.name: t.data_type for t in model.graph.initializer}  # DQ output type = its scale's type
    dq_scale = {n.output[0]: n.input[1] for n in nodes if n.op_type == "DequantizeLinear"}
    graph = onnx.helper.make_graph(
        nodes, "dequantize_weights", [],
        [onnx.helper.make_tensor_value_info(o, types[dq_scale[o]], None) for o in outputs],
        [t for t in model.graph.initializer if t.name in wanted],
    )
    values = _run_constant_graph(graph, model)
    drop = {id(n) for n in nodes}
    kept = [n for n in model.graph.node if id(n) not in drop]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    used = {i for n in kept for i in n.input} | {o.name for o in model.graph.output}
    unused = [t for t in model.graph.initializer if t.name not in used]
    for tensor in unused:
        model.graph.initializer.remove(tensor)
    for name, value in values.items():
        elem = onnx.helper.np_dtype_to_tensor_dtype(value.dtype)
        model.graph.input.append(onnx.helper.make_tensor_value_info(name, elem, value.shape))
    return values


def _run_constant_graph(graph, model):
    dq = onnx.helper.make_model(graph, opset_imports=model.opset_import)
    dq.ir_version = model.ir_version
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    with tempfile.TemporaryDirectory() as scratch:
        session = ort.InferenceSession(session_source(dq, scratch), options, providers=["CPUExecutionProvider"])
        names = [o.name for o in graph.output]
        return dict(zip(names, session.run(names, {})))


def session_source(model, scratch):
    """Serialized bytes, or a path with external data when the model is too large for protobuf."""
    if model.ByteSize() < _PROTO_LIMIT:
        return model.SerializeToString()
    path = os.path.join(scratch, "model.onnx")
    onnx.save(model, path, save_as_external_data=True, location="model.onnx.data")
    return path


def apply_session_config(options, params):
    """Set the session config entries of parameter ``session_config`` (JSON object) on ``options``."""
    for key, value in json.loads(params.get("session_config") or "{}").items():
        options.add_session_config_entry(str(key), str(value))
    return options


def intra_op_threads(config, params):
    """ONNX Runtime intra-op threads for one instance (0: ONNX Runtime's default)."""
    given = int(params.get("intra_op_threads", "0"))
    if given > 0:
        return given
    instances = sum(int(g.get("count", 1)) for g in config.get("instance_group", [])) or 1
    return 0 if instances == 1 else max(1, len(os.sched_getaffinity(0)) // instances)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        folder = os.path.join(args["model_repository"], args["model_version"])
        path = os.path.join(folder, params.get("onnx_file", "model.onnx"))
        options = ort.SessionOptions()
        options.graph_optimization_level = LEVELS[params.get("graph_optimization_level", "all")]
        options.intra_op_num_threads = intra_op_threads(config, params)
        apply_session_config(options, params)
        model = onnx.load(path)
        weights = dequantize_once(model) if params.get("dequantize_weights") == "once" else {}
        self.weights = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in weights.items()}
        with tempfile.TemporaryDirectory() as scratch:
            self.session = ort.InferenceSession(session_source(model, scratch), sess_options=options,
                                                providers=["CPUExecutionProvider"])
        del model
        self.batched = int(config.get("max_batch_size", 0)) > 0
        self.input_names = [t["name"] for t in config["input"]]
        self.output_names = [t["name"] for t in config["output"]]

    def execute(self, requests):
        feeds = [self._feeds(request) for request in requests]
        responses = [None] * len(requests)
        for indices in self._groups(feeds):
            try:
                outputs = self._run([feeds[i] for i in indices])
            except Exception as e:  # one bad group must not fail the others
                for i in indices:
                    responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"onnxruntime: {e}"))
                continue
            for i, tensors in zip(indices, outputs):
                responses[i] = pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor(n, np.ascontiguousarray(a)) for n, a in tensors.items()]
                )
        return responses

    def _feeds(self, request):
        feeds = {}
        for name in self.input_names:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                feeds[name] = tensor.as_numpy()
        return feeds

    def _groups(self, feeds):
        """Indices of requests that can run as one batch."""
        if not self.batched:
            return [[i] for i in range(len(feeds))]
        groups = {}
        for i, feed in enumerate(feeds):
            key = tuple((n, a.shape[1:], a.dtype.str) for n, a in sorted(feed.items()))
            groups.setdefault(key, []).append(i)
        return list(groups.values())

    def _session_run(self, feeds):
        """session.run with the precomputed weights added; a list of arrays in output order."""
        if not self.weights:
            return self.session.run(self.output_names, feeds)
        values = {n: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a)) for n, a in feeds.items()}
        values.update(self.weights)
        return [v.numpy() for v in self.session.run_with_ort_values(self.output_names, values)]

    def _run(self, feeds):
        """Run one group; returns per-request {output name: array}."""
        if len(feeds) == 1:
            return [dict(zip(self.output_names, self._session_run(feeds[0])))]
        merged = {n: np.concatenate([f[n] for f in feeds], axis=0) for n in feeds[0]}
        results = self._session_run(merged)
        sizes = [next(iter(f.values())).shape[0] for f in feeds]
        cuts = np.cumsum(sizes)[:-1]
        per_output = [np.split(r, cuts, axis=0) for r in results]
        return [dict(zip(self.output_names, parts)) for parts in zip(*per_output)]
