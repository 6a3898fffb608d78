"""ONNX Runtime sessions: CUDA when present, CPU otherwise."""
from __future__ import annotations

import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from pipeline.errors import EXIT_BAD_INPUT, EXIT_INTERNAL, ExportError, PipelineError
from pipeline.onnx_io import relative_location


def providers() -> list[str]:
    """CUDAExecutionProvider first when this onnxruntime build has it and a GPU answers."""
    avail = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in avail and _usable(p)]


def _usable(provider: str) -> bool:
    if provider != "CUDAExecutionProvider":
        return True
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# ORT's level-2+ graph transformers mishandle FP8 Q/DQ on CPU: the QDQ fusions
# build an invalid MatMulIntegerToFloat, and with those disabled another
# transformer still gives wrong numbers (seen with onnxruntime 1.31). Basic
# optimisations keep the exact simulated-quantization semantics: values are
# quantized and dequantized, the GEMM runs in FP32.
#
# INT8 Q/DQ at level 2+ runs ORT's integer kernels (MiniLM INT8 at batch 8 x 64:
# 31.1 ms at "all" against 40.6 ms at "basic", FP32 31.4 ms), but on x86 CPUs
# without VNNI (AVX2 / AVX-512F) those kernels multiply u8 activations by s8
# weights in int16 pairs (vpmaddubsw), which saturate once |weight| > 64:
# 2 * 255 * 127 > 32767. Measured here (onnxruntime 1.31.1, AVX2): full-range
# INT8 weights give outputs 31 % (max relative) away from the basic level's;
# weights within [-64, 64] (ORT's "reduce_range") give 3e-7
# (tests/unit/base/test_ort_sessions.py). So:
#   FP8 Q/DQ                              -> "basic"
#   INT8 Q/DQ with a weight beyond +-64   -> "basic" (exact on every CPU)
#   INT8 Q/DQ, 7-bit weights; FP32; FP16  -> "all"
#   weight-only blocks (INT4/INT8 DequantizeLinear with block_size, FP32 activations) -> "all",
#     with session config MATMULNBITS_FP32: level "all" fuses each DequantizeLinear + MatMul into
#     com.microsoft.MatMulNBits, whose default accuracy_level 4 would quantize the activations to
#     INT8; level 1 computes in FP32 (pipeline.quant.int4). No integer activation kernel runs, so
#     the +-64 rule does not apply to those weights.
# The served config (pipeline.triton.config.compute_config) asks for the same level and entries.
# 7-bit weights are the recipe's quantize.reduce_range (pipeline.quant.qdq.quant_format);
# docs/quantization.md gives the speed they buy.

#: level name (as the python-onnxruntime template's ``graph_optimization_level``) -> ORT enum.
ORT_LEVELS = {
    "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}

#: ONNX Runtime session config entries a graph of weight-only blocks runs with (validate and the
#: served python-onnxruntime model alike): MatMulNBits computes in FP32 (accuracy level 1)
MATMULNBITS_FP32 = {"session.qdq_matmulnbits_accuracy_level": "1"}

_FLOAT8 = frozenset(getattr(onnx.TensorProto, n) for n in (
    "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ") if hasattr(onnx.TensorProto, n))
_QDQ = ("QuantizeLinear", "DequantizeLinear")


def has_fp8_qdq(model: onnx.ModelProto) -> bool:
    """True when a QuantizeLinear/DequantizeLinear node of the main graph works in a
    float8 type: an FP8 ``output_dtype`` attribute, or an FP8 initializer among its
    inputs (zero point, or a weight stored in FP8). Reads no weight data."""
    fp8_inits = {t.name for t in model.graph.initializer if t.data_type in _FLOAT8}
    for node in model.graph.node:
        if node.op_type not in _QDQ:
            continue
        if any(name in fp8_inits for name in node.input):
            return True
        if any(a.name == "output_dtype" and a.i in _FLOAT8 for a in node.attribute):
            return True
    return False


#: largest |int8 weight| the non-VNNI x86 integer kernels multiply without int16 saturation.
SATURATION_SAFE_INT8 = 64


def int8_weights_saturate(model: onnx.ModelProto, base_dir: str = "") -> bool:
    """True when an INT8 initializer dequantized by a DequantizeLinear (a quantized
    weight) holds a value beyond +-:data:`SATURATION_SAFE_INT8`. Reads those weights
    (external data from ``base_dir``)."""
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT8}
    for node in model.graph.node:
        if _block_size(node):  # weight-only blocks: MatMulNBits, FP32 activations, no int16 products
            continue
        w = inits.get(node.input[0]) if node.op_type == "DequantizeLinear" and node.input else None
        if w is not None and int(np.abs(numpy_helper.to_array(w, base_dir).astype(np.int16)).max(initial=0)) \
                > SATURATION_SAFE_INT8:
            return True
    return False


def _block_size(node: onnx.NodeProto) -> int:
    """A DequantizeLinear's ``block_size`` (0: none, or not a DequantizeLinear)."""
    if node.op_type != "DequantizeLinear":
        return 0
    return next((a.i for a in node.attribute if a.name == "block_size"), 0)


def has_block_weights(model: onnx.ModelProto) -> bool:
    """True when a DequantizeLinear of the main graph is blocked (``block_size``): weight-only INT4/INT8
    weights (:mod:`pipeline.quant.int4`). Reads no weight data."""
    return any(_block_size(n) for n in model.graph.node)


def session_config(model: str | Path | onnx.ModelProto) -> dict[str, str]:
    """ONNX Runtime session config entries the graph runs with, validated and served:
    :data:`MATMULNBITS_FP32` for weight-only blocks, else none."""
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model), load_external_data=False)
    return dict(MATMULNBITS_FP32) if has_block_weights(model) else {}


def optimization_level(model: str | Path | onnx.ModelProto, base_dir: str = "") -> str:
    """The ONNX Runtime graph optimization level a graph is validated and served at
    (the rule in the comment above): ``"basic"`` for FP8 Q/DQ and for INT8 Q/DQ
    with full-range weights, ``"all"`` for every other graph. Used by
    :func:`ort_session` and :func:`pipeline.triton.config.compute_config`, so
    validate measures what is served.

    Args:
        model: a path to an ``.onnx`` file, or a ModelProto (possibly loaded without
            external data; ``base_dir`` then names the folder holding it).

    Raises:
        OSError / google.protobuf.message.DecodeError: the file cannot be read as ONNX.
    """
    if not isinstance(model, onnx.ModelProto):
        base_dir = base_dir or str(Path(model).parent)
        model = onnx.load(str(model), load_external_data=False)
    if has_fp8_qdq(model) or int8_weights_saturate(model, base_dir):
        return "basic"
    return "all"


def ort_session(path: str, level: str | None = None, *, prepack: bool = True,
                arena: bool = True) -> ort.InferenceSession:
    """An InferenceSession for ``path`` (CUDA EP first when usable), at the graph's
    :func:`optimization_level`; ``level`` (a key of :data:`ORT_LEVELS`) overrides it, for
    benchmarks only: validate and serving always use the graph's own.

    ``arena=False``: no CPU memory arena (which keeps a run's peak activations), for sessions run a
    few times where memory matters more than speed; the results are the same. ``prepack=False``:
    no prepacked copy of each GEMM weight; the GEMM kernels then differ from a prepacking
    session's in the last bits (up to ~2e-6 relative; the search's reference runs so since
    ``pin.SEARCH_VERSION`` 3). The graph's :func:`session_config` entries are always set."""
    graph = onnx.load(str(path), load_external_data=False)
    level = level or optimization_level(graph, str(Path(path).parent))
    return session_from(path, path, session_options(level, prepack, arena, config=session_config(graph)))


def session_options(level: str, prepack: bool = True, arena: bool = True,
                    config: Mapping[str, str] | None = None) -> ort.SessionOptions:
    """:func:`ort_session`'s options at ``level`` (a key of :data:`ORT_LEVELS`), with the session
    config entries ``config`` (:func:`session_config`)."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = ORT_LEVELS[level]
    if not prepack:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    for key, value in (config or {}).items():
        opts.add_session_config_entry(key, value)
    opts.enable_cpu_mem_arena = arena
    return opts


def session_from(source: str | bytes, path: str, opts: ort.SessionOptions) -> ort.InferenceSession:
    """An InferenceSession of ``source`` (a path, or a serialized graph) on :func:`providers`, with
    the optimizers a graph of ``path``'s size needs off."""
    return ort.InferenceSession(source, sess_options=opts, providers=providers(),
                                disabled_optimizers=_large_model_optimizers(path))


#: ONNX Runtime graph optimizers that rewrite initializers from their values: constant folding,
#: the transpose optimizer (transposes a constant weight in place), the Conv fusions with a
#: following BatchNormalization / Mul / Add, the NCHWc layout transformer and the MatMul scale fusion.
WEIGHT_READING_OPTIMIZERS = ["TransposeOptimizer", "ConstantFolding", "ConvBNFusion", "ConvMulFusion",
                             "ConvAddFusion", "NchwcTransformer", "MatMulScaleFusion"]
#: ops whose presence turns a shared session's optimizations off altogether: ONNX Runtime also folds
#: a BatchNormalization into the MatMul before it, an optimizer without a name to disable.
_FUSED_WITH_WEIGHTS = {"Conv", "ConvTranspose", "BatchNormalization"}


class SharedWeights:
    """A graph's FP32 initializers held once, in numpy, for many in-memory ONNX Runtime sessions
    of variants of that graph (the accuracy-budget search's switch graphs, its noise probe).

    A session from :meth:`session` reads each shared initializer from the one array
    (``SessionOptions.add_initializer``, which does not copy it) instead of from the graph, where
    :meth:`strip` left a placeholder: external data in a sparse file of zeros that ONNX Runtime
    validates and never reads. ONNX Runtime puts the arrays in after its graph optimizations, so
    the optimizers that rewrite initializer values (:data:`WEIGHT_READING_OPTIMIZERS`), which
    would read the placeholder's zeros, are off, no level above basic runs, and a graph with a
    Conv or BatchNormalization runs unoptimized (a Transpose of a weight then runs each time, with
    the values it would have folded to). Weight prepacking is off too (a prepacked copy of every
    weight per session is what sharing saves), so the GEMM kernels may differ from a prepacking
    session's in the last bits; and the
    CPU memory arena is off, so a run's activations are freed after it instead of held at their
    peak (SmolLM2-135M's switch graph at 8 x 128 tokens: 1.4 GiB held with the arena, none
    without, at the same speed). Measured here (onnxruntime 1.31.1, a 64 MiB MatMul weight, three
    sessions): +64 MiB of resident memory per session without sharing, +0.3 MiB with it.

    Args:
        model: the graph whose FP32 initializers of ``min_bytes`` or more (float32, stored in the
            proto) are shared; it is not modified.
        weights_dir: the folder of ``model``'s external data when it was loaded without it
            (``onnx.load(..., load_external_data=False)``): every external float32 initializer is
            then shared as a read-only memory map of its file (page cache, no copy in this
            process's heap), and other external initializers are read into :meth:`strip`'s copy.
    """

    PLACEHOLDER = "shared-weights.zeros"

    def __init__(self, model: onnx.ModelProto, min_bytes: int = 1 << 20, weights_dir: str | Path | None = None):
        from onnx import numpy_helper

        self.arrays: dict[str, np.ndarray] = {}
        self._weights_dir = weights_dir
        for t in model.graph.initializer:
            if t.data_type != onnx.TensorProto.FLOAT:
                continue
            if t.data_location == onnx.TensorProto.EXTERNAL:
                if weights_dir is not None:
                    self.arrays[t.name] = _mapped(t, Path(weights_dir))
            elif 4 * int(np.prod(t.dims)) >= min_bytes:
                self.arrays[t.name] = numpy_helper.to_array(t)
        self.values = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in self.arrays.items()}
        self._dir = tempfile.TemporaryDirectory(prefix="pipeline-shared-weights-")
        self._size = 0
        self._grow(max((a.nbytes for a in self.arrays.values()), default=0))

    def _grow(self, nbytes: int) -> None:
        """The placeholder file covers ``nbytes`` (sparse: no disk, no memory)."""
        if nbytes > self._size:
            with open(Path(self._dir.name) / self.PLACEHOLDER, "wb") as f:
                f.truncate(nbytes)
            self._size = nbytes

    def add(self, name: str, array: np.ndarray) -> onnx.TensorProto:
        """Share one more float32 ``array`` under ``name``; returns its placeholder initializer,
        for a graph that :meth:`session` runs (e.g. a weight's dequantized values, computed once
        rather than by a DequantizeLinear node in every run)."""
        self.arrays[name] = np.ascontiguousarray(array, dtype=np.float32)
        self.values[name] = ort.OrtValue.ortvalue_from_numpy(self.arrays[name])
        self._grow(self.arrays[name].nbytes)
        return self.placeholder(name, list(array.shape))

    def placeholder(self, name: str, dims: list[int]) -> onnx.TensorProto:
        """The graph's stand-in for shared array ``name``: FLOAT ``dims``, external data in the
        sparse placeholder file."""
        ph = onnx.TensorProto(name=name, data_type=onnx.TensorProto.FLOAT, dims=dims,
                              data_location=onnx.TensorProto.EXTERNAL)
        for key, value in (("location", self.PLACEHOLDER), ("offset", "0"), ("length", str(self.arrays[name].nbytes))):
            ph.external_data.add(key=key, value=value)
        return ph

    def strip(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """A copy of ``model`` whose shared initializers are placeholders (every other field and
        initializer copied): what :meth:`session` takes, at the size of the unshared part."""
        out = onnx.ModelProto()
        _copy_fields(model, out, skip="graph")
        _copy_fields(model.graph, out.graph, skip="initializer")
        for t in model.graph.initializer:
            if t.name in self.arrays:
                out.graph.initializer.append(self.placeholder(t.name, list(t.dims)))
                continue
            copied = out.graph.initializer.add()
            copied.CopyFrom(t)
            if t.data_location == onnx.TensorProto.EXTERNAL and self._weights_dir is not None:
                from onnx.external_data_helper import load_external_data_for_tensor

                load_external_data_for_tensor(copied, str(self._weights_dir))  # a small non-float one
                copied.data_location = onnx.TensorProto.DEFAULT
                del copied.external_data[:]
        return out

    def session(self, model: onnx.ModelProto, opts: ort.SessionOptions) -> ort.InferenceSession:
        """A CPU session of ``model`` (:meth:`strip`'s output, or any graph whose initializers of
        these names are placeholders) reading the shared arrays; ``opts`` gets the overrides."""
        opts.add_session_config_entry("session.disable_prepacking", "1")
        opts.enable_cpu_mem_arena = False
        basic = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        if any(n.op_type in _FUSED_WITH_WEIGHTS for n in model.graph.node):
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        elif int(opts.graph_optimization_level) > int(basic):  # extended / all fuse weights too (attention, scales)
            opts.graph_optimization_level = basic
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path", self._dir.name)
        names = {t.name for t in model.graph.initializer}
        for name, value in self.values.items():
            if name in names:
                opts.add_initializer(name, value)
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"],
                                    disabled_optimizers=WEIGHT_READING_OPTIMIZERS)
        sess._pipeline_shared = self  # the arrays (and the placeholder file) outlive the session
        return sess


def _mapped(t: onnx.TensorProto, folder: Path) -> np.ndarray:
    """External float32 initializer ``t`` as a read-only memory map of its file in ``folder``
    (a copy when its offset is not 4-byte aligned).

    Raises:
        ValueError: its location leaves ``folder``, or its ``length`` is not 4 bytes per element.
    """
    info = {e.key: e.value for e in t.external_data}
    shape = tuple(int(d) for d in t.dims)
    where = relative_location(info["location"])
    if where is None:
        raise ValueError(f"initializer {t.name}: external data location {info['location']!r} is outside {folder}")
    if "length" in info and int(info["length"]) != 4 * int(np.prod(shape)):
        raise ValueError(f"initializer {t.name}: external data length {info['length']} is not 4 x {shape} bytes")
    arr = np.memmap(folder / where, dtype="<f4", mode="r", offset=int(info.get("offset", 0)), shape=shape or (1,))
    return arr if arr.flags.aligned and shape else np.array(arr).reshape(shape)


def _copy_fields(src, dst, skip: str) -> None:
    """Copy every set field of protobuf message ``src`` into ``dst`` but ``skip``."""
    for fd, value in src.ListFields():
        if fd.name == skip:
            continue
        target = getattr(dst, fd.name)
        if hasattr(value, "extend") or hasattr(target, "extend"):
            target.extend(value)
        elif hasattr(target, "CopyFrom"):
            target.CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


# Above 2 GiB, ORT's transpose optimizer and constant folding fold a Transpose of
# a large weight (a tied lm_head reading the embedding) into a new initializer
# that ORT then refuses to embed (its 2 GiB limit for in-memory initializers).
_LARGE_MODEL_DISABLED = ["TransposeOptimizer", "ConstantFolding"]


def load_session(path: str | Path, source: Path | None = None):
    """A lean ONNX Runtime session for ``path`` (:func:`ort_session`, no prepacking, no arena), for checks.

    Args:
        source: the ``model.source.onnx`` graph that ``path`` is a copy of, if any.

    Raises:
        ExportError: ONNX Runtime cannot load the graph; names the file (and the
            source graph) and ONNX Runtime's message.
    """
    try:
        return ort_session(str(path), prepack=False, arena=False)  # checks: a few runs, memory before speed
    except Exception as e:  # onnxruntime raises its own Fail / InvalidGraph / NotImplemented types
        copy = f" (copied to {path})" if source is not None and Path(path) != Path(source) else ""
        what = f"model.source.onnx {source}{copy}" if source is not None else f"the exported graph {path}"
        raise ExportError(f"export: ONNX Runtime cannot load {what}: {type(e).__name__}: {str(e).strip()[:600]}. "
                          "The graph must load in ONNX Runtime (check its opset, custom-op domains and "
                          "external data files)") from e


def _large_model_optimizers(path: str) -> list[str]:
    from pipeline.onnx_io import PROTOBUF_LIMIT, files_on_disk_bytes

    return _LARGE_MODEL_DISABLED if files_on_disk_bytes(path) >= PROTOBUF_LIMIT else []


# --- ONNX Runtime failures on real data ----------------------------------------------------------------

_ORT_NODE = re.compile(r"running (\w+) node\. Name:'([^']*)'")


def is_ort_error(exc: BaseException) -> bool:
    """True for the exception types onnxruntime raises (Fail, InvalidArgument, RuntimeException, ...)."""
    return type(exc).__module__.startswith("onnxruntime")


class OrtRunError(PipelineError):
    """ONNX Runtime raised while a later stage (calibration, validate, serve check) ran a graph.

    The message names the stage, the graph, the node ONNX Runtime named (op type and name, when
    it says) and every input's dtype and shape. Exit 2 when the graph is the user's model as
    exported (``user_graph``: export verified it at its check points, but it fails on these
    inputs); exit 3 when the pipeline made the graph (a quantized copy) or the feeds: our bug.
    """

    def __init__(self, err: BaseException, graph: str, feeds: Mapping[str, np.ndarray] | None, *,
                 user_graph: bool, stage: str = ""):
        text = " ".join(str(err).split())
        found = _ORT_NODE.search(text)
        self.node = (found.group(2), found.group(1)) if found else None  # (name, op type)
        self.reason = text.split("Status Message:", 1)[-1].strip()[:400]
        self.graph, self.user_graph, self.stage = graph, user_graph, stage
        self.shapes = {n: f"{np.asarray(v).dtype} {list(np.shape(v))}" for n, v in (feeds or {}).items()}
        self.exit_code = EXIT_BAD_INPUT if user_graph else EXIT_INTERNAL
        super().__init__(text)

    def __str__(self) -> str:
        node = f" at node '{self.node[0]}' ({self.node[1]})" if self.node else " (ONNX Runtime named no node)"
        shapes = ", ".join(f"{n} {s}" for n, s in self.shapes.items()) or "unknown"
        why = ("export verified this graph at export.check_points, but it fails on these inputs: add a check "
               "point of these shapes to reproduce it at export, and fix the model code behind that node"
               if self.user_graph else "the pipeline made this graph or its inputs; this is a bug, please report it")
        return (f"{self.stage or 'onnxruntime'}: ONNX Runtime failed running {self.graph}{node} on inputs "
                f"{shapes}: {self.reason}. {why}")


def run_checked(session, names, feeds: Mapping[str, np.ndarray], *, graph: str, user_graph: bool,
                stage: str = "") -> list[np.ndarray]:
    """``session.run(names, feeds)``, an ONNX Runtime error raised as :class:`OrtRunError`
    (naming ``graph``, the node and the feeds' shapes; exit 2 when ``user_graph``, else 3)."""
    try:
        return session.run(names, feeds)
    except Exception as e:
        if not is_ort_error(e):
            raise
        raise OrtRunError(e, graph, feeds, user_graph=user_graph, stage=stage) from e
