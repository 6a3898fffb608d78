"""Triton python-backend model: runs ``model.onnx`` with ONNX Runtime on CPU.

Written into ``<repo>/<model>/<version>/model.py`` by pipeline.triton.repository,
next to the ONNX file named by the config parameter ``onnx_file``. Inputs and
outputs are the config's, in the graph's dtypes and shapes. The parameter
``graph_optimization_level`` (``disabled`` | ``basic`` | ``extended`` | ``all``)
sets the session's graph optimizations (``basic`` for Q/DQ graphs).

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

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils

LEVELS = {
    "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        folder = os.path.join(args["model_repository"], args["model_version"])
        path = os.path.join(folder, params.get("onnx_file", "model.onnx"))
        options = ort.SessionOptions()
        options.graph_optimization_level = LEVELS[params.get("graph_optimization_level", "all")]
        self.session = ort.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])
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

    def _run(self, feeds):
        """Run one group; returns per-request {output name: array}."""
        if len(feeds) == 1:
            return [dict(zip(self.output_names, self.session.run(self.output_names, feeds[0])))]
        merged = {n: np.concatenate([f[n] for f in feeds], axis=0) for n in feeds[0]}
        results = self.session.run(self.output_names, merged)
        sizes = [next(iter(f.values())).shape[0] for f in feeds]
        cuts = np.cumsum(sizes)[:-1]
        per_output = [np.split(r, cuts, axis=0) for r in results]
        return [dict(zip(self.output_names, parts)) for parts in zip(*per_output)]
