"""Runners: one interface over the artifacts the pipeline can serve.

A :class:`Runner` has ``name``, ``inputs`` (TensorSpecs, symbolic dims as
names or -1) and ``run(feeds) -> outputs`` with numpy arrays keyed by tensor
name. Validate measures every artifact through it, so the gate can measure
what ships:

* :class:`OrtRunner`: an ONNX graph in ONNX Runtime (pipeline.ort_sessions's
  session: CUDA provider first when usable, basic optimizations for Q/DQ).
* :func:`tensorrt_runner`: a serialized TensorRT engine (``model.plan``).
  Polygraphy's ``TrtRunner`` when polygraphy is importable, else
  :class:`TensorRTRunner` on the tensorrt Python runtime (``execute_async_v3``
  with torch CUDA tensors as device buffers). Both pick, per call, the first
  optimization profile whose min/max range holds every input shape.

Every TensorRT call sits in an annotated function, type-checked against
``tensorrt-stubs`` (tests/unit/trt/test_typecheck.py).
"""
from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from pipeline.artifacts import TensorSpec
from pipeline.errors import PipelineError

if TYPE_CHECKING:
    import tensorrt as trt
    import torch


class RunnerError(PipelineError):
    """Feeds a runner cannot take (unknown / missing input, shape outside every profile) or an engine
    that does not load or run."""


@runtime_checkable
class Runner(Protocol):
    """Run a model on numpy feeds. ``inputs``: the model's inputs (dims: int, or a name / -1 when dynamic)."""

    name: str

    @property
    def inputs(self) -> list[TensorSpec]: ...

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


#: ONNX Runtime type strings -> numpy dtype names.
_ORT_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64",
               "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(int8)": "int8",
               "tensor(uint8)": "uint8", "tensor(bool)": "bool", "tensor(bfloat16)": "bfloat16"}


class OrtRunner:
    """An ONNX graph in ONNX Runtime (:func:`pipeline.ort_sessions.ort_session`). ``user_graph``: the
    graph is the user's model as exported (an ONNX Runtime error exits 2), not one the pipeline
    made (exit 3; :class:`pipeline.ort_sessions.OrtRunError`)."""

    def __init__(self, onnx_path: str | Path, name: str | None = None, user_graph: bool = True):
        from pipeline.ort_sessions import ort_session
        from pipeline.runners.weights_fed import WeightsFed

        # a Q/DQ graph as the served python-onnxruntime model runs it: the weights' Q/DQ once
        self.session = WeightsFed.load(str(onnx_path)) or ort_session(str(onnx_path))
        self.name = name or f"onnxruntime ({Path(onnx_path).name})"
        self.graph, self.user_graph = str(onnx_path), user_graph
        self._inputs: list[TensorSpec] | None = None  # read on first use

    @property
    def inputs(self) -> list[TensorSpec]:
        if self._inputs is None:
            self._inputs = [TensorSpec(i.name, _ORT_DTYPES.get(i.type, i.type), [_dim(d) for d in i.shape])
                            for i in self.session.get_inputs()]
        return self._inputs

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """All graph outputs for ``feeds`` (input name -> array of the input's dtype).

        Raises:
            RunnerError: an input is missing or unknown (names both lists).
            OrtRunError: ONNX Runtime failed (names the node and the feeds' shapes).
        """
        check_feed_names(self.name, [s.name for s in self.inputs], feeds)
        return dict(zip(self.output_names, self.run_names(None, feeds)))

    def run_names(self, names: Sequence[str] | None, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """``session.run(names, feeds)`` with ONNX Runtime's errors as :class:`pipeline.ort_sessions.OrtRunError`."""
        from pipeline.ort_sessions import run_checked

        return run_checked(self.session, None if names is None else list(names), feeds,
                           graph=f"{self.name} {self.graph}", user_graph=self.user_graph)


def _dim(d: Any) -> int | str:
    return d if isinstance(d, int) else str(d or -1)


def check_feed_names(runner: str, expected: Sequence[str], feeds: Mapping[str, np.ndarray]) -> None:
    """Raises RunnerError unless ``feeds`` has exactly the names ``expected``."""
    missing, unknown = sorted(set(expected) - set(feeds)), sorted(set(feeds) - set(expected))
    if missing or unknown:
        raise RunnerError(f"{runner}: feeds lack {missing} and have unknown {unknown}; inputs are {list(expected)}")


# --- TensorRT ------------------------------------------------------------------------------

Range = tuple[list[int], list[int]]  # (min shape, max shape) of one input in one profile


def pick_profile(ranges: Sequence[Mapping[str, Range]], shapes: Mapping[str, Sequence[int]], runner: str = "") -> int:
    """Index of the first profile whose min/max holds every input shape.

    Args:
        ranges: per profile, input name -> (min shape, max shape); inputs absent
            from a profile are not constrained by it.
        shapes: input name -> shape of this call's feed.

    Raises:
        RunnerError: no profile fits; names each input's shape and each profile's range.
    """
    for index, profile in enumerate(ranges):
        if all(_fits(shapes[n], lo, hi) for n, (lo, hi) in profile.items() if n in shapes):
            return index
    lines = [f"profile {i}: " + ", ".join(f"{n} {lo}..{hi}" for n, (lo, hi) in p.items()) for i, p in enumerate(ranges)]
    got = ", ".join(f"{n} {list(s)}" for n, s in shapes.items())
    raise RunnerError(f"{runner}: input shapes ({got}) fit no optimization profile of the engine:\n  " + "\n  ".join(lines))


def _fits(shape: Sequence[int], lo: Sequence[int], hi: Sequence[int]) -> bool:
    return len(shape) == len(lo) == len(hi) and all(a <= s <= b for s, a, b in zip(shape, lo, hi))


def tensorrt_runner(engine_path: str | Path) -> Runner:
    """A runner for a serialized engine: Polygraphy's TrtRunner when polygraphy is
    importable, else :class:`TensorRTRunner`.

    Raises:
        RunnerError: the engine file is missing or TensorRT cannot deserialize it.
    """
    if importlib.util.find_spec("polygraphy") is not None:
        return PolygraphyRunner(engine_path)
    return TensorRTRunner(engine_path)


def _load_plan(engine_path: str | Path) -> bytes:
    path = Path(engine_path)
    if not path.is_file():
        raise RunnerError(f"engine {path} not found; re-run the build stage")
    return path.read_bytes()


#: TensorRT DataType name -> (torch dtype name, numpy dtype name of the returned array).
_TRT_DTYPES = {"FLOAT": ("float32", "float32"), "HALF": ("float16", "float16"), "BF16": ("bfloat16", "float32"),
               "INT64": ("int64", "int64"), "INT32": ("int32", "int32"), "INT8": ("int8", "int8"),
               "UINT8": ("uint8", "uint8"), "BOOL": ("bool", "bool")}


class TensorRTRunner:
    """A TensorRT engine on CUDA device 0, run with the tensorrt Python runtime.

    Inputs are copied to torch CUDA tensors, output buffers are allocated per
    call from the shapes TensorRT infers, ``execute_async_v3`` runs on a torch
    stream. BF16 outputs come back as float32 (numpy has no bfloat16).
    """

    def __init__(self, engine_path: str | Path, name: str = "tensorrt"):
        import tensorrt as trt
        import torch

        self.name = f"{name} ({Path(engine_path).name})"
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)  # kept alive as long as the engine
        self._engine = deserialize(self._runtime, _load_plan(engine_path), self.name)
        self._context = create_context(self._engine, self.name)
        self._stream = torch.cuda.Stream()
        self._input_names, self.output_names = io_names(self._engine)
        self._inputs = [TensorSpec(n, tensor_dtype(self._engine, n)[1], tensor_shape(self._engine, n))
                        for n in self._input_names]
        self._ranges = profile_ranges(self._engine, self._input_names)
        self._active = 0

    @property
    def inputs(self) -> list[TensorSpec]:
        return self._inputs

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """All engine outputs for ``feeds``.

        Raises:
            RunnerError: missing/unknown input, shapes outside every profile, or
                TensorRT refused a shape or the execution.
        """
        import torch

        check_feed_names(self.name, self._input_names, feeds)
        index = pick_profile(self._ranges, {n: a.shape for n, a in feeds.items()}, self.name)
        if index != self._active:
            select_profile(self._context, index, self._stream.cuda_stream, self.name)
            self._active = index
        keep: list[torch.Tensor] = []  # buffers must outlive the execution
        for spec in self._inputs:
            tensor = _device_copy(feeds[spec.name], tensor_dtype(self._engine, spec.name)[0])
            keep.append(tensor)
            bind_input(self._context, spec.name, list(feeds[spec.name].shape), tensor.data_ptr(), self.name)
        outputs: dict[str, torch.Tensor] = {}
        for out in self.output_names:
            shape = output_shape(self._context, out)
            outputs[out] = _device_empty(shape, tensor_dtype(self._engine, out)[0])
            bind_output(self._context, out, outputs[out].data_ptr(), self.name)
        execute(self._context, self._stream.cuda_stream, self.name)
        self._stream.synchronize()
        return {n: _host(t) for n, t in outputs.items()}


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def _device_copy(array: np.ndarray, torch_dtype: str) -> torch.Tensor:
    """``array`` on CUDA in ``torch_dtype``, in a buffer of at least one element
    (a zero-length past still gets a valid address)."""
    import torch

    host = torch.from_numpy(np.ascontiguousarray(array)).to(_torch_dtype(torch_dtype))
    buf = torch.empty(max(host.numel(), 1), dtype=host.dtype, device="cuda")
    buf[: host.numel()].copy_(host.reshape(-1), non_blocking=False)
    return buf


def _device_empty(shape: list[int], torch_dtype: str) -> torch.Tensor:
    import torch

    numel = int(np.prod(shape)) if shape else 1
    return torch.empty(max(numel, 1), dtype=_torch_dtype(torch_dtype), device="cuda")[:numel].view(shape)


def _host(t: torch.Tensor) -> np.ndarray:
    import torch

    t = t.float() if t.dtype == torch.bfloat16 else t
    return t.cpu().numpy()


# Each TensorRT call in an annotated function (checked against tensorrt-stubs).


def deserialize(runtime: trt.Runtime, plan: bytes, runner: str) -> trt.ICudaEngine:
    """Raises RunnerError when TensorRT returns no engine (other version, other GPU, corrupt file)."""
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:
        raise RunnerError(f"{runner}: TensorRT could not deserialize the engine (built by another TensorRT "
                          "version, for another GPU, or a corrupt file); rebuild it here")
    return engine


def create_context(engine: trt.ICudaEngine, runner: str) -> trt.IExecutionContext:
    context = engine.create_execution_context()
    if context is None:
        raise RunnerError(f"{runner}: TensorRT could not create an execution context (GPU memory?)")
    return context


def io_names(engine: trt.ICudaEngine) -> tuple[list[str], list[str]]:
    """(input names, output names) in engine order."""
    import tensorrt as trt

    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
    return inputs, [n for n in names if n not in inputs]


def tensor_dtype(engine: trt.ICudaEngine, name: str) -> tuple[str, str]:
    """(torch dtype name, numpy dtype name) of tensor ``name``.

    Raises:
        RunnerError: a TensorRT type this runner has no buffer type for (e.g. FP8 I/O).
    """
    kind = engine.get_tensor_dtype(name).name
    if kind not in _TRT_DTYPES:
        raise RunnerError(f"engine tensor {name!r}: TensorRT type {kind} is not supported as I/O here; "
                          f"supported: {', '.join(_TRT_DTYPES)}")
    return _TRT_DTYPES[kind]


def dims_list(dims: trt.Dims) -> list[int]:
    """A Dims as a list of ints (-1: dynamic)."""
    return [int(dims[i]) for i in range(len(dims))]


def tensor_shape(engine: trt.ICudaEngine, name: str) -> list[int | str]:
    return list(dims_list(engine.get_tensor_shape(name)))


def profile_ranges(engine: trt.ICudaEngine, inputs: Sequence[str]) -> list[dict[str, Range]]:
    """Per optimization profile: input -> (min, max) shape (inputs with a dynamic axis only)."""
    out: list[dict[str, Range]] = []
    for p in range(engine.num_optimization_profiles):
        ranges: dict[str, Range] = {}
        for name in inputs:
            if -1 in dims_list(engine.get_tensor_shape(name)):
                lo, _, hi = engine.get_tensor_profile_shape(name, p)
                ranges[name] = (dims_list(lo), dims_list(hi))
        out.append(ranges)
    return out


def select_profile(context: trt.IExecutionContext, index: int, stream: int, runner: str) -> None:
    if not context.set_optimization_profile_async(index, stream):
        raise RunnerError(f"{runner}: TensorRT refused optimization profile {index}")


def bind_input(context: trt.IExecutionContext, name: str, shape: list[int], address: int, runner: str) -> None:
    if not context.set_input_shape(name, shape):
        raise RunnerError(f"{runner}: TensorRT refused shape {shape} for input {name!r}")
    context.set_tensor_address(name, address)


def output_shape(context: trt.IExecutionContext, name: str) -> list[int]:
    return dims_list(context.get_tensor_shape(name))


def bind_output(context: trt.IExecutionContext, name: str, address: int, runner: str) -> None:
    if not context.set_tensor_address(name, address):
        raise RunnerError(f"{runner}: TensorRT refused the buffer of output {name!r}")


def execute(context: trt.IExecutionContext, stream: int, runner: str) -> None:
    if not context.execute_async_v3(stream):
        raise RunnerError(f"{runner}: execute_async_v3 failed (see the TensorRT log above)")


class PolygraphyRunner:
    """A TensorRT engine through Polygraphy's ``TrtRunner`` (it owns buffers and the stream);
    the optimization profile is chosen per call as in :class:`TensorRTRunner`."""

    def __init__(self, engine_path: str | Path, name: str = "tensorrt (polygraphy)"):
        from polygraphy.backend.trt import EngineFromBytes, TrtRunner

        self.name = f"{name} ({Path(engine_path).name})"
        self._runner = TrtRunner(EngineFromBytes(_load_plan(engine_path)))
        self._runner.activate()
        engine = self._runner.engine
        self._input_names, self.output_names = io_names(engine)
        self._inputs = [TensorSpec(n, tensor_dtype(engine, n)[1], tensor_shape(engine, n)) for n in self._input_names]
        self._ranges = profile_ranges(engine, self._input_names)
        self._active = 0

    @property
    def inputs(self) -> list[TensorSpec]:
        return self._inputs

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """All engine outputs for ``feeds``. Raises RunnerError as :meth:`TensorRTRunner.run`."""
        check_feed_names(self.name, self._input_names, feeds)
        index = pick_profile(self._ranges, {n: a.shape for n, a in feeds.items()}, self.name)
        if index != self._active:
            self._runner.set_profile(index)
            self._active = index
        out = self._runner.infer(feeds, check_inputs=False)
        return {n: np.asarray(out[n]) for n in self.output_names}


class SessionView:
    """A runner seen as an ONNX Runtime session (``run(names, feeds) -> list``), for code
    written against sessions (the kinds' metrics in pipeline/models/<kind>/metrics.py).
    An :class:`OrtRunner` runs only the requested outputs, exactly as its session would."""

    def __init__(self, runner: Runner):
        self.runner = runner

    def run(self, names: Sequence[str] | None, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        if isinstance(self.runner, OrtRunner):
            return self.runner.run_names(names, feeds)
        out = self.runner.run(feeds)
        return list(out.values()) if names is None else [out[n] for n in names]


class TorchRunner:
    """A ``torch.nn.Module`` as a runner: inputs positional in ``input_names`` order,
    outputs (a tensor or a tuple of tensors) named by ``output_names``; no grad, CPU.

    Used where torch is the reference (the export check; kinds whose source has no ONNX).
    """

    def __init__(self, module: Any, input_names: Sequence[str], output_names: Sequence[str],
                 name: str = "torch"):
        self.module, self.name = module, name
        self.input_names, self.output_names = list(input_names), list(output_names)

    @property
    def inputs(self) -> list[TensorSpec]:
        return [TensorSpec(n, "", []) for n in self.input_names]  # dtypes/shapes: whatever the module takes

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Outputs as numpy arrays by name.

        Raises:
            RunnerError: an input is missing or unknown, or the module returns a
                different number of outputs than ``output_names``.
        """
        import torch

        check_feed_names(self.name, self.input_names, feeds)
        with torch.no_grad():
            out = self.module(*(torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in self.input_names))
        out = out if isinstance(out, (tuple, list)) else (out,)
        if len(out) != len(self.output_names):
            raise RunnerError(f"{self.name}: the module returned {len(out)} outputs; expected {self.output_names}")
        return {n: t.detach().numpy() for n, t in zip(self.output_names, out)}
