"""The model-kind contract: what every kind (``model.kind``) tells the stages.

One adapter class per kind lives in ``pipeline/models/<kind>/`` (package names
with underscores: ``text_generation``, ``sentence_embedding``,
``image_classification``, ``generic``); :mod:`pipeline.models.registry` maps
the recipe's kind to it. Stages (``pipeline/stages/``), ``pipeline/triton/``
and ``pipeline/serve/`` call these members and never test the kind.

Life of an adapter: ``registry.adapter(recipe.model)`` makes one per run,
bound to the recipe's model source. :meth:`ModelAdapter.load` returns a
:class:`LoadedModel` (frozen); the export members read what they need from
the module they are handed. Everything after export reads the stage
artifacts (``ExportArtifact`` / ``QuantizedArtifact``), never the torch module,
so a cached export needs no reload. The export members (:meth:`ModelAdapter.dynamic_axes`,
``export``, ``sample_feeds``) may read geometry that ``load`` recorded on the
adapter (layers, vocabulary): call ``load`` first.

Conventions for every member below:

* feeds: ``dict[str, np.ndarray]`` keyed by graph input name, in the graph's
  dtypes (token ids / masks int64, activations float32), batch on axis 0;
* shapes use the symbolic dim names of ``export.dynamic_axes`` (``batch``,
  ``sequence``, ...); a graph dim with neither a size nor a name reads as ``"?"``
  (:func:`pipeline.onnx_io.graph_specs`, the one graph I/O reader), and
  :meth:`ModelAdapter.graph_io` writes ``-1`` for a size known only after export;
* runners follow :class:`pipeline.runners.base.Runner` (``run(feeds) -> {output: array}``);
* errors are :class:`pipeline.errors.PipelineError` subclasses naming the recipe
  key, file, input or axis, and what would be valid.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Protocol, runtime_checkable

import numpy as np

from pipeline.artifacts import TensorSpec

if TYPE_CHECKING:
    from pipeline.artifacts import BuildArtifact, ExportArtifact, QuantizedArtifact
    from pipeline.context import StageContext
    from pipeline.sources.data import DataSource
    from pipeline.recipe.schema import CalibrationConfig, ExportConfig, Recipe
    from pipeline.runners.base import Runner

Feeds = dict[str, np.ndarray]
#: Prefix of the metrics measured through a TensorRT engine (``engine.mean_cosine``).
ENGINE_PREFIX = "engine."


def add_engine_metrics(metrics: dict, engine: dict) -> None:
    """Merge the engine's metrics into ``metrics`` as ``engine.<name>``; their ``stderr_basis``
    records join ``metrics``' own under the same prefixed names."""
    from pipeline.recipe.gates import BASIS_KEY

    basis = engine.get(BASIS_KEY, {})
    metrics.update({f"{ENGINE_PREFIX}{k}": v for k, v in engine.items() if k != BASIS_KEY})
    if basis:
        metrics.setdefault(BASIS_KEY, {}).update({f"{ENGINE_PREFIX}{k}": b for k, b in basis.items()})


@dataclass(frozen=True)
class LoadedModel:
    """A model loaded for export (FP32, eval mode). Immutable: stages share it.

    Attributes:
        module: the ``torch.nn.Module`` to export, with the graph's inputs as
            positional arguments in :attr:`input_names` order.
        processor: the tokenizer / image processor (anything with
            ``save_pretrained(folder)``), or None when the kind needs none; the
            export stage saves it to ``export/tokenizer/`` (``ExportArtifact.tokenizer_dir``).
        example_feeds: the export example, numpy arrays by input name; every
            dynamic dim of size >= 2 and distinct, so the exporter specialises nothing.
        input_names / output_names: graph I/O names, in the module's order.
    """

    module: Any
    processor: Any
    example_feeds: Mapping[str, np.ndarray] = field(default_factory=dict)
    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class BenchWorkload:
    """What ``pipeline/serve/bench.py`` drives for one kind.

    Attributes:
        model: the Triton model the sweep sends to (generation model, ensemble, ...).
        streaming: True for decoupled streamed generation (TTFT / TPOT), False
            for one response per request (latency percentiles).
        requests: one feed dict per distinct request, numpy arrays by the model's
            input names (``text``: object ``[1, 1]`` bytes; ``input_ids``: int64 ``[n]``).
        describe: one line for the report, e.g. "64 held-out sentences".
    """

    model: str
    streaming: bool
    requests: list[Feeds]
    describe: str


@runtime_checkable
class ModelAdapter(Protocol):
    """Everything the pipeline needs to know about one model kind.

    Members in stage order: load / graph I/O / export / sample feeds (export),
    calibration feeds (quantize), runners and metrics (validate), Triton models
    (triton), bench workload (serve).
    """

    #: the recipe's ``model.kind`` this adapter serves, e.g. ``"text-generation"``.
    kind: ClassVar[str]

    def check_files(self) -> None:
        """Refuse, before any stage (``check`` and the export stage), a source that lacks
        files a later stage needs (text-generation: a loadable fast tokenizer and an EOS id).
        Default (:class:`pipeline.models.common.SourceFiles`): nothing beyond the weights.

        Raises:
            ModelFileError: names the folder and the missing files (exit 2).
        """
        ...

    def check_recipe(self, recipe: Recipe) -> list[str]:
        """Refuse, before any stage (``check`` and the export stage), a source that contradicts the
        recipe (text-generation: learned positions and a build profile past their table); return
        warnings for what it serves unlike the recipe says (a rotary model's context past its
        ``max_position_embeddings``). Default (:class:`pipeline.models.common.SourceFiles`): none.

        Raises:
            ModelFileError: names both sides of the contradiction (exit 2).
        """
        ...

    def save_processor(self, loaded: LoadedModel, folder: Path) -> None:
        """Write ``loaded.processor`` (not None) into ``folder`` (``ExportArtifact.tokenizer_dir``),
        with whatever the served models read from it. Default: ``save_pretrained``."""
        ...

    def load(self, ctx: StageContext) -> LoadedModel:
        """Load the recipe's model source (FP32, eval mode), offline.

        Raises:
            ExportError: the package, file or folder is missing or unreadable.
        """
        ...

    def graph_io(self, loaded: LoadedModel, export_cfg: ExportConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """The graph's inputs and outputs as the export of ``loaded`` will write them:
        names, numpy dtype names and shapes with the recipe's dim names (fixed sizes as
        ints, ``-1`` where the size is known only after export).

        Raises:
            ExportError: ``export.dynamic_axes`` names an input the model lacks.
        """
        ...

    def dynamic_axes(self, export_cfg: ExportConfig) -> dict[str, dict[int, str]]:
        """Input name -> {axis: dim name}: the recipe's axes plus the ones the kind implies
        (the KV cache's ``past_sequence``, inputs sharing ``input_ids``' axes).

        Raises:
            ExportError: the recipe's axes name an input the kind does not have.
        """
        ...

    def export(self, module: Any, export_cfg: ExportConfig, out: Path) -> None:
        """Write the FP32 ONNX graph of ``module`` to ``out`` (weights may go to
        external data beside it), dims named as :meth:`dynamic_axes` says.

        Raises:
            ExportError: the exporter failed (its message is kept).
        """
        ...

    def sample_feeds(self, module: Any, inputs: list[TensorSpec], point: dict[str, int], seed: int) -> Feeds:
        """Random but valid feeds at one shape point (dim name -> size), for the export
        shape checks; deterministic in ``seed``.

        Raises:
            ExportError: the point lacks a dim the kind needs (names it).
        """
        ...

    def torch_outputs(self, module: Any, feeds: Feeds) -> tuple:
        """The module's outputs (torch tensors, graph output order) on ``feeds``:
        the torch reference of the export check (see :class:`pipeline.runners.base.TorchRunner`)."""
        ...

    def calibration_feeds(self, exp: ExportArtifact, data: DataSource, cal: CalibrationConfig) -> list[Feeds]:
        """Calibration batches from ``data``: at most ``cal.samples`` samples, in
        batches of ``cal.batch_size`` rows (the last may be smaller), shaped as the
        graph's inputs (e.g. int64 ``[batch, cal.seq_len]`` token windows). The
        quantize stage counts samples on axis 0, checks ``cal.min_samples`` and
        writes the batches into its artifact for later stages.

        Raises:
            DataError: ``data`` is not a record kind this model can read.
        """
        ...

    def reference_runner(self, exp: ExportArtifact) -> Runner:
        """The FP32 reference the candidate is measured against: the exported graph in
        ONNX Runtime (a torch runner where the kind compares with torch)."""
        ...

    def candidate_runner(self, q: QuantizedArtifact, engine: str | None = None) -> Runner:
        """The optimized model: the TensorRT engine at ``engine`` when one was built,
        else ``q``'s graph in ONNX Runtime.

        Raises:
            RunnerError: the engine does not load.
        """
        ...

    def metrics(self, ctx: StageContext, exp: ExportArtifact, q: QuantizedArtifact,
                engine: Runner | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """Accuracy of the candidate against the reference on ``validate``'s held-out
        data: ``(metrics, tokens)``. ``metrics`` holds every name of
        the kind's gate metrics (:attr:`pipeline.recipe.kinds.KindFacts.gate_metrics`; NaN, never an error, for a broken candidate); with
        ``engine`` also ``engine.<metric>`` measured through it. ``tokens``: greedy
        token ids per label for generation kinds, else ``{}``.

        Raises:
            AccuracyError: NaN/Inf in the FP32 reference, or no held-out sample.
            DataError: the validate data cannot be read.
        """
        ...

    def triton_models(self, recipe: Recipe, export: ExportArtifact, compute: Any, build: BuildArtifact,
                      staging: Path) -> list[Any]:
        """The models the kind serves beside the compute model (``compute``, a
        ``pipeline.triton.repository.StagedModel``): tokenizer, generation,
        image preprocessing, ensemble. Each is written into ``staging/<name>/`` and
        returned as a StagedModel for :mod:`pipeline.triton.repository` to check and
        publish. ``[]`` when the compute model alone serves the kind.

        Raises:
            TritonConfigError: a config the compute graph cannot serve (names the model and tensor).
        """
        ...

    def served_models(self, recipe: Recipe) -> list[str]:
        """Names of the models :meth:`triton_models` writes for ``recipe``, in its order
        (cheap: no files read); the repository serves ``[compute, *these]``."""
        ...

    def front_model(self, recipe: Recipe) -> str | None:
        """The model clients send requests to (generation model, ensemble), or None when
        the compute model alone serves the kind."""
        ...

    def bench_workload(self, recipe: Recipe, tokenizer_dir: str) -> BenchWorkload:
        """The requests ``pipeline.serve.bench`` sends, built from the validate data
        (the same held-out samples validate measured).

        Raises:
            DataError: the validate data cannot be read.
        """
        ...

