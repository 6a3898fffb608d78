"""The ``generic`` kind: any module, measured by agreement with its FP32 outputs.

Sources: ``entry:`` (a user callable returning the module and example inputs,
exported with :func:`pipeline.checks.export.export_module`) or ``onnx:`` (an
already exported graph, copied and verified, never re-exported).

* graph I/O: the callable's example inputs by name (their order is the module's
  positional order), dims named by ``export.dynamic_axes``; outputs named by the
  module's ``output_names`` attribute when it has one, else ``output`` (one
  output) or ``output_0``, ``output_1``, ...; for ``onnx:`` the graph's own I/O;
* reference: the FP32 graph in ONNX Runtime (for ``entry:`` the export check has
  already matched it with torch; for ``onnx:`` no torch comparison is made);
* candidate: the quantized graph in ONNX Runtime, or the TensorRT engine;
* metrics: :mod:`pipeline.models.generic.metrics` on ``validate.data``'s samples;
* calibration / eval feeds: :mod:`pipeline.models.generic.feeds` (npz, or jsonl
  numeric rows);
* Triton: the compute model alone; bench: the compute model fed the validate
  samples (recorded feeds), one batch-1 request each.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import onnx

from pipeline import onnx_io
from pipeline.checks import export as export_checks
from pipeline.artifacts import TensorSpec
from pipeline.errors import ExportError, RecipeError
from pipeline.models.base import BenchWorkload, LoadedModel, add_engine_metrics
from pipeline.models.common import OnnxRuntimeRunners, SourceFiles
import pipeline.models.generic.feeds as F
from pipeline.models.generic.metrics import agreement
from pipeline.sources.model import EntrySource, ModelFileError, OnnxSource, check_entry_axes, external_data_files
from pipeline.recipe.kinds import source_problem
from pipeline.sources.model import load_tokenizer

NO_TORCH = ("model.source is an ONNX graph exported elsewhere: ONNX Runtime FP32 is the reference and no torch "
            "comparison was made; the export checks only prove the graph runs at every check point")


class GenericAdapter(OnnxRuntimeRunners, SourceFiles):
    """Adapter of ``kind: generic`` (see the module docstring)."""

    kind: ClassVar[str] = "generic"

    def __init__(self, model_section):
        source = getattr(model_section, "source", None)
        if model_section is not None and not isinstance(source, (EntrySource, OnnxSource)):  # None: unbound
            problem = source_problem(self.kind, source.tag, source.describe()) if source is not None else "none given"
            raise RecipeError(f"model.source: {problem}")  # the loader refuses this first, with file:line
        self.source = source
        self.example: dict[str, np.ndarray] = {}
        #: a note for the report: what the FP32 reference is and what was not compared.
        self.reference_note = NO_TORCH if isinstance(source, OnnxSource) else \
            "ONNX Runtime FP32, matched against torch at every export check point"

    # --- export -------------------------------------------------------------------------

    def load(self, ctx) -> LoadedModel:
        """``entry:``: import and call the user function, check its example against
        ``export.dynamic_axes``. ``onnx:``: read the graph's I/O (no module).

        Raises:
            ModelFileError: the entry file or function fails, or returns the wrong types.
            ExportError: the example contradicts ``export.dynamic_axes`` (names input and axis).
        """
        source = self._bound(ctx)
        if isinstance(source, OnnxSource):
            model = onnx.load(str(source.location()), load_external_data=False)
            ins, outs = onnx_io.graph_specs(model)
            tok = source.tokenizer_dir()
            processor = load_tokenizer(tok) if tok is not None else None
            return LoadedModel(None, processor, {}, tuple(s.name for s in ins), tuple(s.name for s in outs))
        with ctx.progress.step(f"load {source.describe()}"):
            module, example = source.load()
        check_entry_axes(example, ctx.recipe.export.dynamic_axes)
        self.example = example
        names = _output_names(module, self.torch_outputs(module, example))
        return LoadedModel(module, None, dict(example), tuple(example), names)

    def _bound(self, ctx):
        if self.source._base_dir is None:
            self.source = self.source.bind(Path(ctx.recipe_path).parent)
        return self.source

    def graph_io(self, loaded: LoadedModel, export_cfg) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """Inputs from the example (dims named by ``export.dynamic_axes``); outputs from a torch
        run, axis 0 named like the inputs' batch dim where the sizes match. ``onnx:``: the graph's.

        Raises:
            ExportError: ``export.dynamic_axes`` names an input the model lacks.
        """
        if loaded.module is None:
            return onnx_io.graph_specs(onnx.load(str(self.source.location()), load_external_data=False))
        axes = self.dynamic_axes(export_cfg)
        ins = [TensorSpec(n, a.dtype.name, [axes.get(n, {}).get(i, s) for i, s in enumerate(a.shape)])
               for n, a in loaded.example_feeds.items()]
        batch = next((d[0] for d in axes.values() if 0 in d), None)
        example_batch = next((np.shape(loaded.example_feeds[n])[0] for n, d in axes.items() if 0 in d), None)
        outs = []
        for name, t in zip(loaded.output_names, self.torch_outputs(loaded.module, dict(loaded.example_feeds))):
            shape: list[int | str] = list(t.shape)
            if batch is not None and shape and shape[0] == example_batch:
                shape[0] = batch
            outs.append(TensorSpec(name, str(t.dtype).replace("torch.", ""), shape))
        return ins, outs

    def dynamic_axes(self, export_cfg) -> dict[str, dict[int, str]]:
        """The recipe's ``export.dynamic_axes`` as given (a generic model implies none).

        Raises:
            ExportError: an axis names an input the entry example lacks.
        """
        axes = {k: dict(v) for k, v in export_cfg.dynamic_axes.items()}
        if self.example:
            check_entry_axes(self.example, axes)
        return axes

    def export(self, module, export_cfg, out: Path) -> None:
        """``entry:``: torch.onnx.export (dynamo) with the recipe's named dims; ``onnx:``: copy
        the graph (and its external data) to ``out``, unnamed or duplicate-named nodes named.

        Raises:
            ExportError: the exporter failed, or an example size is 0/1 on a dynamic axis.
            ModelFileError: ``onnx:``: an external data file is missing or shorter than a tensor needs.
        """
        if module is None:
            src = self.source.location()
            external_data_files(src, "model.source")  # a missing or short data file, named, before the copy
            model = onnx.load(str(src), load_external_data=False)
            if not model.graph.node and not model.graph.input:  # protobuf reads an empty file as an empty model
                raise ModelFileError(f"model.source.onnx: {src} holds no ONNX graph ({src.stat().st_size} bytes); "
                                     "valid: a model saved with onnx.save or torch.onnx.export")
            onnx_io.name_nodes(model)  # quantization addresses nodes by name
            onnx_io.save_model_atomic(model, out, base_dir=src.parent)
            return
        names = _output_names(module, self.torch_outputs(module, self.example))
        export_checks.export_module(module, self.example, self.dynamic_axes(export_cfg), out,
                                   opset=export_cfg.opset, output_names=names)

    def sample_feeds(self, module, inputs: list[TensorSpec], point: dict[str, int], seed: int) -> dict:
        """Random valid feeds at ``point`` (:func:`pipeline.models.generic.feeds.random_feeds`)."""
        return F.random_feeds(inputs, point, seed)

    def torch_outputs(self, module, feeds: dict) -> tuple:
        """The module's outputs on ``feeds`` (positional, in the example's input order), as a tuple
        of tensors. ``onnx:`` (no module): the source graph's ONNX Runtime outputs, as tensors,
        so the export check proves only that the copy runs with the right shapes.

        Raises:
            ExportError: the module fails on the feeds; ``onnx:``: ONNX Runtime cannot load the graph.
        """
        import torch

        if module is None:
            sess = _source_session(self.source.location())
            got = sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})
            return tuple(torch.from_numpy(np.asarray(g)) for g in got)
        order = list(self.example) or list(feeds)
        with torch.no_grad():
            try:
                out = module(*(torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in order))
            except Exception as e:  # user code
                shapes = {n: list(np.shape(feeds[n])) for n in order}
                raise ExportError(f"model.source.entry: the module fails on inputs {shapes}: "
                                  f"{type(e).__name__}: {e}") from e
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    # --- quantize / validate ---------------------------------------------------------------

    def calibration_feeds(self, exp, data, cal) -> list[dict]:
        """Up to ``cal.samples`` recorded samples of ``data`` (npz, or jsonl numeric rows),
        in batches of ``cal.batch_size``.

        Raises:
            DataError: the data is another record kind, or malformed (names file and line).
        """
        return F.batches(F.samples(data, exp.inputs, cal.samples), cal.batch_size)

    def metrics(self, ctx, exp, q, engine=None) -> tuple[dict[str, Any], dict]:
        """Agreement of the candidate with the FP32 reference on ``validate.data``'s samples
        (at most ``validate.max_windows``, in batches of ``validate.batch_size``); with
        ``engine``, the engine's as ``engine.<metric>``.

        Raises:
            AccuracyError: NaN/Inf in the reference, or an output missing.
            DataError: the validate data cannot be read.
        """
        v = ctx.recipe.validate_
        data = _validate_data(ctx)
        cut = F.batches(F.samples(data, exp.inputs, getattr(v, "max_windows", None)), v.batch_size)
        with ctx.progress.step(f"validate: {q.precision} against the reference on {data.describe()}"):
            ref = _run_all(self.reference_runner(exp), cut)
            metrics: dict[str, Any] = {"eval_samples": int(len(next(iter(ref.values())))),
                                       "eval_data": data.describe(), "reference": self.reference_note}
            metrics.update(agreement(ref, _run_all(self.candidate_runner(q), cut)))
        if engine is not None:
            with ctx.progress.step("validate: the engine against the reference"):
                add_engine_metrics(metrics, agreement(ref, _run_all(engine, cut)))
        return metrics, {}

    # --- serving -----------------------------------------------------------------------------

    def triton_models(self, recipe, export, compute, build, staging: Path) -> list:
        """None: the compute model alone serves a generic model."""
        return []

    def served_models(self, recipe) -> list[str]:
        """No model besides the compute model."""
        return []

    def front_model(self, recipe) -> str | None:
        """None: clients call the compute model."""
        return None

    def bench_workload(self, recipe, tokenizer_dir: str) -> BenchWorkload:
        """The compute model, one request per validate sample (batch 1, recorded feeds).

        Raises:
            DataError: the validate data cannot be read.
        """
        from pipeline.onnx_io import graph_specs

        run_dir = Path(recipe.work_dir) / recipe.name
        graph = onnx.load(str(run_dir / "export" / "model.onnx"), load_external_data=False)
        ins, _ = graph_specs(graph)
        data = recipe.validate_.data
        recorded = F.samples(data, ins, getattr(recipe.validate_, "max_windows", None))
        n = len(next(iter(recorded.values())))
        requests = [{k: a[i : i + 1] for k, a in recorded.items()} for i in range(n)]
        return BenchWorkload(recipe.triton.model_name, False, requests, f"{n} recorded samples of {data.describe()}")


def _source_session(path: Path):
    """An ONNX Runtime session for the ``onnx:`` source graph at ``path``.

    Raises:
        ExportError: ONNX Runtime cannot load it (names the file and ONNX Runtime's message).
    """
    from pipeline.ort_sessions import load_session

    return load_session(path, path)


def _output_names(module, outputs: tuple) -> tuple[str, ...]:
    names = getattr(module, "output_names", None)
    if names is not None:
        names = tuple(names() if callable(names) else names)
        if len(names) != len(outputs):
            raise ExportError(f"model.source.entry: the module's output_names {list(names)} do not match its "
                              f"{len(outputs)} outputs")
        return names
    return ("output",) if len(outputs) == 1 else tuple(f"output_{i}" for i in range(len(outputs)))


def _validate_data(ctx):
    """``validate.data`` bound to the recipe folder.

    Raises:
        RecipeError: the recipe has no ``validate.data`` (a generic model has no built-in eval set).
    """
    from pipeline.sources import data as datasets

    spec = getattr(ctx.recipe.validate_, "data", None)
    if spec is None:
        raise RecipeError("validate.data: a generic model needs eval samples: {type: npz, path: ...} or "
                          "{type: jsonl, path: ..., field: inputs}")
    return datasets.load(spec, Path(ctx.recipe_path).parent, where="validate.data")


def _run_all(runner, cut: list[dict]) -> dict[str, np.ndarray]:
    outs: dict[str, list[np.ndarray]] = {}
    for feeds in cut:
        for name, value in runner.run(feeds).items():
            outs.setdefault(name, []).append(np.asarray(value))
    return {k: np.concatenate(v) for k, v in outs.items()}
