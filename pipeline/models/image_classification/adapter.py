"""The image-classification adapter (:class:`pipeline.models.base.ModelAdapter`): an
already exported ONNX classifier (``model.source`` an ``.onnx`` file: ``onnx:``, or a
``package`` file), measured by top-1 accuracy against labels and agreement with
FP32, served as image bytes -> preprocessing model -> compute model (ensemble).

The shipped recipe's model is PaddleOCR's text-direction classifier from the
``rapidocr-onnxruntime`` wheel (0 / 180 degrees, :mod:`.graph`). There is no
torch module: "export" writes the prepared graph (:func:`.graph.prepare`) and
the export check compares it with the shipped graph in ONNX Runtime.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from pipeline.artifacts import TensorSpec
from pipeline.sources.data import DataError
from pipeline.errors import AccuracyError, ExportError
from pipeline.models.base import BenchWorkload, LoadedModel, add_engine_metrics
from pipeline.models.common import OnnxRuntimeRunners, SourceFiles
from pipeline.models.image_classification import graph, metrics, preprocess, serving
from pipeline.models.image_classification.data import batches, labelled_inputs
from pipeline.recipe.precisions import REFERENCE


@dataclass(frozen=True)
class ShippedGraph:
    """The classifier as shipped: its ONNX file and I/O names (the "module" of this kind)."""

    path: Path
    input_name: str
    output_name: str
    height: int
    width: int
    classes: int


class ImageClassificationAdapter(OnnxRuntimeRunners, SourceFiles):
    """An ONNX image classifier with one ``[batch, 3, H, W]`` input and one ``[batch, classes]`` output."""

    kind: ClassVar[str] = "image-classification"

    def __init__(self, source: Any):
        self.source = source
        self.shipped: ShippedGraph | None = None

    def load(self, ctx) -> LoadedModel:
        """The shipped graph's I/O, its :class:`.preprocess.ImageProcessor` (saved by the export
        stage) and an export example (batch 2, the classifier's H x W).

        Raises:
            ExportError: the source is not an ``.onnx`` file with one 4-D image input
                and one ``[batch, classes]`` output.
        """
        self.shipped = read_graph(_location(self.source))
        s = self.shipped
        example = random_images(2, s.height, s.width, seed=0)
        processor = preprocess.ImageProcessor(s.height, s.width)
        return LoadedModel(s, processor, {s.input_name: example}, (s.input_name,), (s.output_name,))

    def graph_io(self, loaded: LoadedModel, export_cfg) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """``x`` float32 ``[batch, 3, H, W]`` (recipe dim names, else the fixed sizes) ->
        float32 ``[batch, classes]``."""
        s = loaded.module
        dims = self._dims(export_cfg)
        return ([TensorSpec(s.input_name, "float32", list(dims))],
                [TensorSpec(s.output_name, "float32", [dims[0], s.classes])])

    def dynamic_axes(self, export_cfg) -> dict[str, dict[int, str]]:
        """The recipe's axes; only the image input, and its axes 0 (batch), 2, 3 may be dynamic.

        Raises:
            ExportError: another input or the channel axis is named, or axis 0 is not.
        """
        name = self._shipped().input_name
        axes = {k: dict(v) for k, v in export_cfg.dynamic_axes.items()}
        extra = sorted(set(axes) - {name})
        if extra or 0 not in axes.get(name, {}) or not set(axes[name]) <= {0, 2, 3}:
            raise ExportError(f"export.dynamic_axes: {axes}; valid: {{{name}: {{0: batch}}}} (axes 2, 3: "
                              f"height, width optional) for the classifier's input {name!r}")
        return axes

    def export(self, module: ShippedGraph, export_cfg, out: Path) -> None:
        """Write the prepared graph (constants folded, BatchNorm folded into the Convs,
        ``export.opset``, dims named or fixed as :meth:`dynamic_axes` says) to ``out``.

        Raises:
            ExportError: ONNX Runtime or the opset converter refuses the graph.
        """
        graph.prepare(module.path, out, dims=self._dims(export_cfg), opset=export_cfg.opset)

    def sample_feeds(self, module: ShippedGraph, inputs, point: dict[str, int], seed: int) -> dict[str, np.ndarray]:
        """Random images in the normalised range [-1, 1] at ``point`` (dim name -> size).

        Raises:
            ExportError: the point lacks the batch dim (or a dynamic height/width).
        """
        dims = list(inputs[0].shape)
        missing = [d for d in dims if isinstance(d, str) and d not in point]
        if missing:
            raise ExportError(f"export.check_points: point {point} lacks {missing}; valid: every dynamic dim "
                              f"of {module.input_name} ({dims})")
        n, _, h, w = (point[d] if isinstance(d, str) else d for d in dims)
        return {module.input_name: random_images(n, h, w, seed)}

    def torch_outputs(self, module: ShippedGraph, feeds: dict[str, np.ndarray]) -> tuple:
        """The shipped graph's outputs in ONNX Runtime (no torch module exists for an
        ONNX source): the export check then compares the prepared graph with it."""
        import torch

        from pipeline.runners.base import OrtRunner

        out = OrtRunner(module.path, name="shipped graph").run(feeds)
        return (torch.from_numpy(out[module.output_name]),)

    def calibration_feeds(self, exp, data, cal) -> list[dict[str, np.ndarray]]:
        """At most ``cal.samples`` preprocessed images of ``data`` (evenly across its classes),
        float32 ``[<= cal.batch_size, 3, H, W]`` per batch.

        Raises:
            DataError: ``data`` holds neither images nor npz feeds.
        """
        name, h, w = _input(exp)
        x, _ = labelled_inputs(data, name, cal.samples, (h, w))
        return batches(x, name, cal.batch_size)

    def metrics(self, ctx, exp, q, engine=None) -> tuple[dict[str, Any], dict[str, Any]]:
        """Top-1 accuracy of FP32 and candidate against ``validate.data``'s labels,
        the drop (points) and the argmax agreement (:mod:`.metrics`); with ``engine``
        also ``engine.<metric>``. A candidate with NaN/Inf scores gets NaN metrics.

        Raises:
            AccuracyError: NaN/Inf in the FP32 scores, or no labels in the data.
            DataError: the validate data cannot be read, or its labels are not class
                indices of the model (``[0, classes)``, one per sample).
        """
        v = ctx.recipe.validate_
        name, h, w = _input(exp)
        x, labels = labelled_inputs(v.data, name, None, (h, w))
        if labels is None:
            raise AccuracyError(f"validate.data: {v.data.describe()} has no labels; valid: an image folder "
                                f"(subfolder = label) or an npz with a labels array")
        out = exp.outputs[0].name
        _check_label_folders(v.data, exp.outputs[0].shape[-1])
        runs = {REFERENCE: self.reference_runner(exp), "candidate": self.candidate_runner(q)}
        if engine is not None:
            runs["engine"] = engine
        scores = {k: _scores(r, x, name, out, v.batch_size) for k, r in runs.items()}
        if not np.all(np.isfinite(scores[REFERENCE])):
            raise AccuracyError(f"validate: the FP32 reference {exp.onnx_path} gives NaN/Inf scores")
        try:
            result = _compare(scores[REFERENCE], scores["candidate"], labels)
            if "engine" in scores:
                add_engine_metrics(result, _compare(scores[REFERENCE], scores["engine"], labels))
        except ValueError as e:  # labels that do not fit the model's classes
            raise DataError(f"validate.data: {v.data.describe()}: {e}") from None
        return result, {}

    def triton_models(self, recipe, export, compute, build, staging: Path) -> list[Any]:
        """The preprocessing model (image bytes -> graph input) and the ensemble
        (:func:`.serving.stage`).

        Raises:
            TritonConfigError: the compute graph is not one ``[batch, 3, H, W]`` input.
        """
        if compute is None:
            return []
        return serving.stage(compute, recipe.triton.version, recipe.triton.max_batch_size, staging)

    def served_models(self, recipe) -> list[str]:
        """``<model>_preprocess`` and ``<model>_ensemble``, in the order :meth:`triton_models` writes them."""
        name = recipe.triton.model_name
        return [serving.preprocess_model_name(name), serving.ensemble_model_name(name)]

    def front_model(self, recipe) -> str | None:
        """The image -> class-probabilities ensemble."""
        return self.served_models(recipe)[-1]

    def bench_workload(self, recipe, tokenizer_dir: str) -> BenchWorkload:
        """One request per held-out image of ``validate.data``: its PNG/JPEG bytes,
        object ``[1, 1]``, sent to the ensemble (for an npz source: its feeds,
        ``[1, 3, H, W]``, sent to the compute model).

        Raises:
            DataError: the validate data cannot be read.
        """
        data = recipe.validate_.data
        model = recipe.triton.model_name
        if data.record_kind == "images":
            requests = [{serving.IMAGE_INPUT: np.array([[Path(p).read_bytes()]], dtype=object)}
                        for p, _ in data.items()]
            return BenchWorkload(serving.ensemble_model_name(model), False, requests,
                                 f"{len(requests)} held-out images ({data.describe()})")
        name = self._shipped().input_name if self.shipped else "x"
        x, _ = labelled_inputs(data, name)
        requests = [{name: x[i:i + 1]} for i in range(len(x))]
        return BenchWorkload(model, False, requests, f"{len(requests)} held-out samples ({data.describe()})")

    def _shipped(self) -> ShippedGraph:
        if self.shipped is None:
            self.shipped = read_graph(_location(self.source))
        return self.shipped

    def _dims(self, export_cfg) -> tuple[str | int, ...]:
        s = self._shipped()
        named = self.dynamic_axes(export_cfg)[s.input_name]
        return tuple(named.get(a, size) for a, size in enumerate((-1, 3, s.height, s.width)))


def read_graph(path: Path) -> ShippedGraph:
    """The I/O of an image-classifier ONNX file; a symbolic H / W takes the
    PaddleOCR classifier's 48 x 192 (:mod:`.preprocess`).

    Raises:
        ExportError: not an ``.onnx`` file, or not one ``[batch, 3, H, W]`` float
            input and one ``[batch, classes]`` output.
    """
    import onnx

    if Path(path).suffix != ".onnx" or not Path(path).is_file():
        raise ExportError(f"model.source: {path} is not an .onnx file; the image-classification kind takes an "
                          f"exported classifier ({{onnx: ./model.onnx}} or a package's .onnx file)")
    model = onnx.load(str(path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    ins = [i for i in model.graph.input if i.name not in inits]

    def shape(v) -> list:
        return [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in v.type.tensor_type.shape.dim]

    in_shape = shape(ins[0]) if len(ins) == 1 else []
    out_shape = shape(model.graph.output[0]) if len(model.graph.output) == 1 else []
    if len(in_shape) != 4 or in_shape[1] != 3 or len(out_shape) != 2 or not out_shape[1]:
        raise ExportError(f"model.source: {path} has inputs {[(i.name, shape(i)) for i in ins]} and outputs "
                          f"{[(o.name, shape(o)) for o in model.graph.output]}; valid: one [batch, 3, H, W] "
                          f"input and one [batch, classes] output")
    return ShippedGraph(Path(path), ins[0].name, model.graph.output[0].name, in_shape[2] or preprocess.HEIGHT,
                        in_shape[3] or preprocess.WIDTH, out_shape[1])


def _location(source) -> Path:
    """The graph file of the recipe's ``model`` section, or of a bare ``model.source``.

    Raises:
        ModelFileError: the file or package is missing.
    """
    return getattr(source, "source", source).location()


def random_images(n: int, h: int, w: int, seed: int) -> np.ndarray:
    """float32 ``[n, 3, h, w]`` uniform in [-1, 1] (the normalised pixel range), deterministic in ``seed``."""
    return np.random.default_rng(seed).uniform(-1, 1, (n, 3, h, w)).astype(np.float32)


def _input(exp) -> tuple[str, int, int]:
    spec = exp.inputs[0]
    h, w = spec.shape[2], spec.shape[3]
    return (spec.name, h if isinstance(h, int) and h > 0 else preprocess.HEIGHT,
            w if isinstance(w, int) and w > 0 else preprocess.WIDTH)


def _scores(runner, x: np.ndarray, name: str, output: str, batch: int) -> np.ndarray:
    return np.concatenate([runner.run(f)[output] for f in batches(x, name, batch)])


def _compare(ref: np.ndarray, cand: np.ndarray, labels: np.ndarray) -> dict:
    if not np.all(np.isfinite(cand)):
        out = dict.fromkeys(metrics.METRICS, float("nan"))
        out["top1_accuracy_fp32"], out["samples"] = metrics.accuracy(ref, labels), int(len(ref))
        return out
    return metrics.compare(ref, cand, labels)


def _check_label_folders(data, classes) -> None:
    """An image folder's labels are its sorted subfolder names, so a class without a folder
    shifts every later label: refuse fewer folders than the model scores classes.

    Raises:
        DataError: names the folder, its label folders and the model's class count.
    """
    if not hasattr(data, "classes") or not isinstance(classes, int):
        return
    found = data.classes()
    if len(found) < classes:
        raise DataError(f"validate.data.path: {data.location()} has {len(found)} label folder(s) {found} but the "
                        f"model scores {classes} classes; label i is the i-th sorted folder name, so a missing "
                        "class shifts the others; valid: one folder, with images, per class")
