"""Activation statistics (amax) from real data, with ONNX Runtime's calibrators.

``max`` uses ORT's MinMax calibrator; ``percentile`` and ``entropy`` use its
histogram calibrators (entropy = KL-divergence threshold, Migacz, "8-bit
Inference with TensorRT", GTC 2017). ``mse`` picks, from the same histogram,
the amax that minimises the expected squared quantization error of the
target format (clipping plus rounding), computed here.

ORT reads the graph from its path (it writes a transient shape-inferred copy
of the graph beside it; the weights stay where they are: onnx refuses
hard-linked data files, and a copy would cost the model's size in disk and
time), and the augmented graph goes to a scratch folder, with external data
when the model is large: a graph over 2 GiB cannot be serialized to bytes.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Iterable

import numpy as np
import onnx
from onnxruntime.quantization.calibrate import (
    CalibrationDataReader,
    CalibrationMethod,
    create_calibrator,
)

from pipeline import onnx_io
from pipeline.errors import QuantizationError
from pipeline.quant.qdq import QFormat
from pipeline.ort_sessions import OrtRunError, is_ort_error, run_checked

_ORT_METHOD = {
    "max": CalibrationMethod.MinMax,
    "percentile": CalibrationMethod.Percentile,
    "entropy": CalibrationMethod.Entropy,
    "mse": CalibrationMethod.Percentile,  # only for its histograms; the threshold is ours
}


class _Reader(CalibrationDataReader):
    def __init__(self, batches: Iterable[dict[str, np.ndarray]]):
        self._it = iter(batches)
        self.last: dict[str, np.ndarray] | None = None  # the batch ONNX Runtime runs now

    def get_next(self):
        self.last = next(self._it, None)
        return self.last


def collect_amax(onnx_path: str | Path, tensors: list[str], batches: list[dict[str, np.ndarray]],
                 method: str, fmt: QFormat, percentile: float = 99.99,
                 scratch_dir: str | Path | None = None) -> dict[str, float]:
    """amax per tensor name, over all calibration batches.

    Args:
        onnx_path: FP32 graph, inline or with external data beside it (any size).
        tensors: activation names to report (inputs of the GEMMs to quantize).
        batches: feed dicts for the graph.
        method: ``max``, ``percentile``, ``entropy`` or ``mse``.
        scratch_dir: where the temporary folder for the augmented graph goes
            (None: the system temp folder).

    Raises:
        QuantizationError: a requested tensor got no statistics.
        OrtRunError: ONNX Runtime failed on a batch (exit 2: the exported graph).
    """
    extra: dict = {"symmetric": True}
    if method in ("percentile", "mse"):
        extra.update(percentile=percentile, num_bins=2048)
    elif method == "entropy":  # ORT's default 128 bins leave one threshold candidate: the max
        extra.update(num_bins=2048, num_quantized_bins=128)
    large = onnx_io.files_on_disk_bytes(onnx_path) >= onnx_io.external_data_threshold()
    with tempfile.TemporaryDirectory(dir=scratch_dir, prefix="calibrate-") as tmp:
        cal = create_calibrator(
            Path(onnx_path), op_types_to_calibrate=["MatMul", "Gemm", "Conv"],
            augmented_model_path=str(Path(tmp) / "augmented.onnx"),
            calibrate_method=_ORT_METHOD[method], extra_options=extra,
            use_external_data_format=large, providers=["CPUExecutionProvider"],
        )
        reader = _Reader(batches)
        try:
            cal.collect_data(reader)
        except Exception as e:
            if not is_ort_error(e):
                raise
            raise OrtRunError(e, f"the calibration copy of {onnx_path}", reader.last, user_graph=True) from e
        if method == "mse":
            amax = {t: mse_amax(*cal.collector.histogram_dict[t][:2], fmt) for t in tensors
                    if t in cal.collector.histogram_dict}
        else:
            data = cal.compute_data()
            amax = {t: float(np.max(np.abs(np.asarray(data[t].range_value, np.float64)))) for t in tensors if t in data}
    missing = [t for t in tensors if t not in amax]
    if missing:
        raise QuantizationError(f"calibration produced no statistics for {missing[:5]} ({len(missing)} tensors)")
    return amax


def mse_amax(hist: np.ndarray, edges: np.ndarray, fmt: QFormat, candidates: int = 128) -> float:
    """amax minimising expected squared error of |x| under the histogram.

    ``hist``/``edges`` describe the symmetric value histogram (ORT layout);
    each candidate clips at amax and rounds to the format's grid.
    """
    centers = np.abs((edges[:-1] + edges[1:]) / 2)
    weights = hist.astype(np.float64)
    top = float(centers[weights > 0].max()) if (weights > 0).any() else float(np.abs(edges).max())
    best, best_err = top, np.inf
    for amax in np.linspace(top / candidates, top, candidates):
        err = float(np.sum(weights * (centers - _fake_quant(centers, amax, fmt)) ** 2))
        if err < best_err:
            best, best_err = amax, err
    return best


def _fake_quant(x: np.ndarray, amax: float, fmt: QFormat) -> np.ndarray:
    scale = amax / fmt.qmax
    y = np.clip(x / scale, -fmt.qmax, fmt.qmax)
    y = np.round(y) if fmt.np_type is np.int8 else y.astype(fmt.np_type).astype(np.float64)
    return y * scale


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
        OrtRunError: ONNX Runtime failed on a batch (exit 2: the exported graph).
    """
    import onnxruntime as ort
    from onnx import TensorProto, helper

    if not batches:
        raise QuantizationError("per-channel calibration: no calibration batch")
    known = {o for n in model.graph.node for o in n.output} | {i.name for i in model.graph.input}
    missing = [t for t in tensors if t not in known]
    if missing:
        raise QuantizationError(f"per-channel calibration: tensors {missing[:5]} are not in the graph")
    aug = onnx.ModelProto()
    aug.CopyFrom(model)
    present = {o.name for o in aug.graph.output}
    aug.graph.output.extend(helper.make_tensor_value_info(t, TensorProto.FLOAT, None)
                            for t in tensors if t not in present)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(aug.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    del aug
    amax: dict[str, np.ndarray] = {}
    for feeds in batches:
        for name, value in zip(tensors, run_checked(sess, tensors, feeds, user_graph=True,
                                                    graph="the FP32 graph with its GEMM inputs as outputs")):
            m = np.abs(value.reshape(-1, value.shape[-1])).max(axis=0).astype(np.float64)
            amax[name] = m if name not in amax else np.maximum(amax[name], m)
    return amax
