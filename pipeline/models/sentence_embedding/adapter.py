"""The sentence-embedding adapter (:class:`pipeline.models.base.ModelAdapter`): an encoder pooled
as its sentence-transformers folder says, measured by word-similarity Spearman and cosine to FP32, served
as text -> tokenizer model -> compute model (an ensemble)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from pipeline.artifacts import TensorSpec
from pipeline.errors import ExportError
from pipeline.models.base import BenchWorkload, LoadedModel
from pipeline.models.common import OnnxRuntimeRunners, SourceFiles, text_batches
from pipeline.model_source import package_file
from pipeline.models.sentence_embedding.model import INPUTS, OUTPUT, PooledEncoder, load_encoder, random_feeds, read_pooling
from pipeline.recipe import ModelSource

log = logging.getLogger(__name__)


class SentenceEmbeddingAdapter(OnnxRuntimeRunners, SourceFiles):
    """A pooled sentence encoder (``model.kind: sentence-embedding``).

    One instance serves one run: :meth:`load` records the vocabulary size that
    :meth:`export` reads; everything after export reads the stage artifacts.
    """

    kind: ClassVar[str] = "sentence-embedding"
    generates: ClassVar[bool] = False
    metric_names: ClassVar[frozenset[str]] = frozenset(
        {"spearman_drop_max", "spearman_drop_wordsim353", "spearman_drop_simlex999", "mean_cosine", "min_cosine"})

    def __init__(self, source: ModelSource | None):
        self.source = source
        self.vocab: int | None = None

    def load(self, ctx) -> LoadedModel:
        """The FP32 encoder wrapped as :class:`PooledEncoder` with the folder's pooling
        (:func:`read_pooling`, logged), its tokenizer and the export example (batch 2,
        sequence 7; row 1 padded).

        Raises:
            ModelFileError: the package or folder is missing.
            ExportError: the folder's sentence-transformers modules cannot be exported.
        """
        with ctx.progress.step(f"load {self.source.source.describe()}"):
            model, tok = load_encoder(self.source)
            pooling = read_pooling(package_file(self.source))
        log.info("export: %s", pooling.note)
        self.vocab = int(model.config.vocab_size)
        return LoadedModel(PooledEncoder(model, pooling).eval(), tok, random_feeds(self.vocab, batch=2, sequence=7),
                           INPUTS, (OUTPUT,))

    def graph_io(self, loaded: LoadedModel, export_cfg) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """Inputs int64 ``[batch, sequence]`` (:data:`INPUTS`), output ``embeddings`` float32
        ``[batch, H]`` (``H`` is not known before export: -1)."""
        axes = self.dynamic_axes(export_cfg)
        ins = [TensorSpec(n, "int64", [axes[n].get(a, -1) for a in range(2)]) for n in INPUTS]
        return ins, [TensorSpec(OUTPUT, "float32", [ins[0].shape[0], -1])]

    def dynamic_axes(self, export_cfg) -> dict[str, dict[int, str]]:
        """The recipe's axes; inputs it leaves out get the axes of ``input_ids``.

        Raises:
            ExportError: ``export.dynamic_axes`` names no ``input_ids``, or an input the model lacks.
        """
        axes = {k: dict(v) for k, v in export_cfg.dynamic_axes.items()}
        if "input_ids" not in axes:
            raise ExportError("export.dynamic_axes: an encoder needs input_ids, e.g. {0: batch, 1: sequence}")
        unknown = sorted(set(axes) - set(INPUTS))
        if unknown:
            raise ExportError(f"export.dynamic_axes: the encoder has no input(s) {unknown}; inputs are {list(INPUTS)}")
        for name in INPUTS:
            axes.setdefault(name, dict(axes["input_ids"]))
        return axes

    def export(self, module: PooledEncoder, export_cfg, out: Path) -> None:
        """torch.onnx.export(dynamo=True), dims named as in the recipe, output ``embeddings``.

        Raises:
            ExportError: the exporter failed; its message is kept.
        """
        axes = self.dynamic_axes(export_cfg)
        dims: dict[str, torch.export.Dim] = {}

        def dim(name: str):
            return dims.setdefault(name, torch.export.Dim(name, min=1, max=8192))

        shapes = {n: {a: dim(d) for a, d in axes[n].items()} for n in INPUTS}
        # Example sizes above 1 and distinct, so the exporter specialises nothing.
        feeds = random_feeds(self.vocab, batch=2, sequence=7)
        args = tuple(torch.from_numpy(feeds[n]) for n in INPUTS)
        try:
            torch.onnx.export(
                module, args, str(out), dynamo=True, dynamic_shapes=shapes,
                input_names=list(INPUTS), output_names=[OUTPUT],
                opset_version=export_cfg.opset, external_data=False, verbose=False,
            )
        except Exception as e:  # the exporter raises many types; keep its text
            raise ExportError(f"export: torch.onnx.export failed: {type(e).__name__}: {e}") from e

    def sample_feeds(self, module, inputs, point: dict[str, int], seed: int) -> dict[str, np.ndarray]:
        """Random feeds at ``point`` (needs dims ``batch`` and ``sequence``).

        Raises:
            ExportError: the point lacks ``batch`` or ``sequence``.
        """
        missing = {"batch", "sequence"} - point.keys()
        if missing:
            raise ExportError(f"export.check_points: point {point} lacks {sorted(missing)}")
        vocab = int(module.model.config.vocab_size)
        return random_feeds(vocab, point["batch"], point["sequence"], seed)

    def torch_outputs(self, module: PooledEncoder, feeds: dict[str, np.ndarray]):
        """``(embeddings,)``: float32 ``[B, H]``."""
        return (module(*(torch.from_numpy(feeds[n]) for n in INPUTS)),)

    def calibration_feeds(self, exp, data, cal) -> list[dict[str, np.ndarray]]:
        """Batches of ``cal.samples`` token windows int64 ``[<=cal.batch_size, cal.seq_len]`` of
        the documents of ``data``: mask all ones, token types all zeros."""
        return text_batches(exp, data, cal, lambda _exp, ids: window_feeds(ids))

    def metrics(self, ctx, exp, q, engine=None) -> tuple[dict, dict]:
        """:func:`pipeline.models.sentence_embedding.metrics.encoder_metrics` of
        :meth:`candidate_runner` against :meth:`reference_runner`; no tokens."""
        from pipeline.models.sentence_embedding.metrics import encoder_metrics

        return encoder_metrics(ctx, exp, q, engine, self.reference_runner(exp), self.candidate_runner(q)), {}

    def triton_models(self, recipe, export, compute, build, staging: Path) -> list:
        """The tokenizer model (text -> the graph's int64 inputs) and the text -> embedding ensemble."""
        from pipeline.models.sentence_embedding.triton import stage_text_models

        return stage_text_models(recipe, export, compute, build, staging)

    def served_models(self, recipe) -> list[str]:
        """The tokenizer model and the ensemble (``<model>_tokenizer``, ``<model>_ensemble``)."""
        from pipeline.triton.repository import ensemble_model_name, tokenizer_model_name

        name = recipe.triton.model_name
        return [tokenizer_model_name(name), ensemble_model_name(name)]

    def front_model(self, recipe) -> str | None:
        """The text -> embedding ensemble."""
        return self.served_models(recipe)[-1]

    def bench_workload(self, recipe, tokenizer_dir: str) -> BenchWorkload:
        """Single sentences (``text`` object ``[1, 1]``) to the ensemble: validate's held-out
        sentences (:func:`~pipeline.models.sentence_embedding.metrics.validate_sentences`), 64 at most."""
        from pipeline.models.sentence_embedding.metrics import validate_sentences
        from pipeline.triton.repository import ensemble_model_name

        sentences = validate_sentences(recipe.validate_, limit=min(64, recipe.validate_.max_windows))
        requests = [{"text": np.array([[s.encode()]], dtype=np.object_)} for s in sentences]
        return BenchWorkload(ensemble_model_name(recipe.triton.model_name), False, requests,
                             f"{len(sentences)} held-out sentences (validate's)")


def window_feeds(ids: np.ndarray) -> dict[str, np.ndarray]:
    """Feeds for token windows int64 ``[B, S]``: mask all ones, token types all zeros."""
    ids = ids.astype(np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}


