"""The compute graph, called once per step: :class:`InProcessCompute` (ONNX Runtime in this process,
target python-onnxruntime, with :class:`OutputBuffers`) or :class:`BLSCompute` (the compute model
through BLS)."""
import importlib.util
import math
import os
import tempfile
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


_ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64"}


def _import_file(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class OutputBuffers:
    """Reused memory for a compute call's outputs, two sets used in turn (``turn`` flips per
    call), so the outputs of one call stay intact while the next call, which may read them as
    inputs, writes the other set. A set's array for an output grows by ``GROWTH`` when a call
    needs more (at least ``MIN_ELEMENTS``), so a decode step, one position longer each time,
    reallocates rarely."""

    GROWTH, MIN_ELEMENTS = 1.25, 4096

    def __init__(self):
        self.sets, self.turn = ({}, {}), 0

    def array(self, name, shape, dtype):
        """An uninitialised contiguous array ``shape`` of ``dtype`` in the current set's memory."""
        size, store = math.prod(shape), self.sets[self.turn]
        flat = store.get(name)
        if flat is None or flat.dtype != dtype or flat.size < size:
            flat = store[name] = np.empty(max(int(size * self.GROWTH), self.MIN_ELEMENTS), dtype)
        return flat[:size].reshape(shape)


class InProcessCompute:
    """The compute graph in this process with ONNX Runtime (target python-onnxruntime): no BLS
    round trip of the KV cache. FP8/INT8 weights are dequantized once at load with the sibling
    compute model's own ``dequantize_once`` (its model.py is imported, not copied), so logits
    are bit-identical to the compute model's."""

    def __init__(self, repository, params, output_names):
        import onnx
        import onnxruntime as ort

        path = os.path.join(repository, params["compute_onnx"])
        helper = _import_file(os.path.join(os.path.dirname(path), "model.py"), "generate_compute_helper")
        options = ort.SessionOptions()
        options.graph_optimization_level = helper.LEVELS[params.get("graph_optimization_level", "all")]
        helper.apply_session_config(options, params)  # weight-only INT4: MatMulNBits in FP32
        options.intra_op_num_threads = int(params.get("intra_op_threads", "0"))  # 0: ONNX Runtime's default
        model = onnx.load(path)
        weights = helper.dequantize_once(model) if params.get("dequantize_weights") == "once" else {}
        self.weights = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in weights.items()}
        self.ort = ort
        with tempfile.TemporaryDirectory() as scratch:
            self.session = ort.InferenceSession(helper.session_source(model, scratch), sess_options=options,
                                                providers=["CPUExecutionProvider"])
        self.output_names = output_names
        types = {o.name: o.type for o in self.session.get_outputs()}
        unknown = [f"{n} ({types.get(n)})" for n in output_names if types.get(n) not in _ORT_TYPES]
        if unknown:
            raise ValueError(f"{path}: outputs {unknown} are missing or not float32/float16/float64; the "
                             f"generation model needs {output_names}")
        self.dtypes = {n: np.dtype(_ORT_TYPES[t]) for n, t in types.items() if t in _ORT_TYPES}
        self.local = threading.local()

    def __call__(self, feeds, names=None):
        """feeds {name: array} -> outputs in ``names`` order (default ``output_names``). Inputs
        are read and outputs written in place (IOBinding on numpy buffers): no copy of the KV cache
        in or out. Output shapes: logits [B, n, vocab], present [B, H, P + n, D] (from the feeds).

        The outputs are views of this thread's :class:`OutputBuffers`: valid until this thread's
        call after next, so one call's present can be the next call's past (no copy, and no
        fresh pages for the kernel to zero at every step)."""
        batch, n = feeds["input_ids"].shape
        total = feeds["attention_mask"].shape[1]
        binding = self.session.io_binding()
        for name, array in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        for name, value in self.weights.items():
            binding.bind_ortvalue_input(name, value)
        buffers = self._buffers()
        buffers.turn ^= 1
        outputs = []
        for name in names or self.output_names:
            dtype = self.dtypes[name]
            if name == "logits":
                shape = (batch, n, self.vocab(feeds))
            elif name == "last_logits":
                shape = (batch, self.vocab(feeds))
            else:
                past = feeds[name.replace("present.", "past_key_values.")]
                shape = (batch, past.shape[1], total, past.shape[3])
            array = buffers.array(name, shape, dtype)
            binding.bind_output(name, "cpu", 0, dtype, list(shape), array.ctypes.data)
            outputs.append(array)
        self.session.run_with_iobinding(binding)
        return outputs

    def _buffers(self):
        """This thread's output buffers (scheduler thread, or each request's thread when
        continuous batching is off)."""
        if not hasattr(self.local, "buffers"):
            self.local.buffers = OutputBuffers()
        return self.local.buffers

    def vocab(self, feeds):
        """Vocabulary size: the logits output's last dim (symbolic: found by one run, then kept)."""
        if not hasattr(self, "_vocab"):
            name = self.output_names[0]
            dim = next(o for o in self.session.get_outputs() if o.name == name).shape[-1]
            if not isinstance(dim, int):
                values = {n: self.ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a)) for n, a in feeds.items()}
                values.update(self.weights)
                dim = self.session.run_with_ort_values([name], values)[0].numpy().shape[-1]
            self._vocab = int(dim)
        return self._vocab


class BLSCompute:
    """The compute model through BLS (tensorrt_plan, onnxruntime_onnx or python-onnxruntime)."""

    def __init__(self, model_name, output_names):
        self.model_name, self.output_names = model_name, output_names
        self.memory = {}
        if hasattr(pb_utils, "PreferredMemory"):  # BLS outputs on CPU even from a GPU model
            self.memory = {"preferred_memory": pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0)}

    def __call__(self, feeds, names=None):
        names = list(names or self.output_names)
        response = pb_utils.InferenceRequest(
            model_name=self.model_name, requested_output_names=names,
            inputs=[pb_utils.Tensor(n, np.ascontiguousarray(a)) for n, a in feeds.items()], **self.memory,
        ).exec()
        if response.has_error():
            raise RuntimeError(f"{self.model_name}: {response.error().message()}")
        return [pb_utils.get_output_tensor_by_name(response, n).as_numpy() for n in names]

