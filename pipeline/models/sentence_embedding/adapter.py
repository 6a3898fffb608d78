"""The sentence-embedding adapter (:class:`pipeline.models.base.ModelAdapter`): an encoder pooled
as its sentence-transformers folder says, measured by word-similarity Spearman and cosine to FP32, served
as text -> tokenizer model -> compute model (an ensemble)."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from pipeline.artifacts import TensorSpec
from pipeline.errors import ExportError
from pipeline.checks import export as export_checks
from pipeline.models.base import BenchWorkload, LoadedModel
from pipeline.models.common import OnnxRuntimeRunners, SourceFiles, text_batches
from pipeline.sources.model import package_file
from pipeline.models.sentence_embedding.model import (INPUTS, OUTPUT, PooledEncoder, load_encoder, only, random_feeds,
                                                       read_pooling)
from pipeline.recipe.schema import ModelSource

log = logging.getLogger(__name__)


class SentenceEmbeddingAdapter(OnnxRuntimeRunners, SourceFiles):
    """A pooled sentence encoder (``model.kind: sentence-embedding``).

    One instance serves one run: :meth:`load` records the vocabulary size and the model's
    inputs (:func:`~pipeline.models.sentence_embedding.model.model_inputs`) that
    :meth:`export` and :meth:`dynamic_axes` read; everything after export reads the stage
    artifacts (the graph's inputs: ``ExportArtifact.inputs``).
    """

    kind: ClassVar[str] = "sentence-embedding"

    def __init__(self, source: ModelSource | None):
        self.source = source
        self.vocab: int | None = None
        self.inputs: tuple[str, ...] = INPUTS  # until load: every input the kind may have

    def load(self, ctx) -> LoadedModel:
        """The FP32 encoder wrapped as :class:`PooledEncoder` with the folder's pooling
        (:func:`read_pooling`, logged), its tokenizer and the export example (batch 2,
        sequence 7; row 1 padded) for the inputs its forward takes.

        Raises:
            ModelFileError: the package or folder is missing.
            ExportError: the folder's sentence-transformers modules cannot be exported.
        """
        with ctx.progress.step(f"load {self.source.source.describe()}"):
            model, tok = load_encoder(self.source)
            pooling = read_pooling(package_file(self.source))
        log.info("export: %s", pooling.note)
        self.vocab = int(model.config.vocab_size)
        module = PooledEncoder(model, pooling).eval()
        self.inputs = module.input_names
        log.info("export: graph inputs %s (%s.forward)", list(self.inputs), type(model).__name__)
        return LoadedModel(module, tok, random_feeds(self.vocab, batch=2, sequence=7, names=self.inputs),
                           self.inputs, (OUTPUT,))

    def graph_io(self, loaded: LoadedModel, export_cfg) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """Inputs int64 ``[batch, sequence]`` (:attr:`inputs`, the model's), output ``embeddings``
        float32 ``[batch, H]`` (``H`` is not known before export: -1)."""
        axes = self.dynamic_axes(export_cfg)
        ins = [TensorSpec(n, "int64", [axes[n].get(a, -1) for a in range(2)]) for n in self.inputs]
        return ins, [TensorSpec(OUTPUT, "float32", [ins[0].shape[0], -1])]

    def dynamic_axes(self, export_cfg) -> dict[str, dict[int, str]]:
        """The recipe's axes for the model's inputs (:attr:`inputs`); inputs it leaves out get
        the axes of ``input_ids``. Axes of a kind input the model does not take (a recipe's
        ``token_type_ids`` for DistilBERT) are left out, and logged.

        Raises:
            ExportError: ``export.dynamic_axes`` names no ``input_ids``, or an input no encoder has.
        """
        axes = {k: dict(v) for k, v in export_cfg.dynamic_axes.items()}
        if "input_ids" not in axes:
            raise ExportError("export.dynamic_axes: an encoder needs input_ids, e.g. {0: batch, 1: sequence}")
        unknown = sorted(set(axes) - set(INPUTS))
        if unknown:
            raise ExportError(f"export.dynamic_axes: the encoder has no input(s) {unknown}; inputs are {list(INPUTS)}")
        unused = sorted(set(axes) - set(self.inputs))
        if unused:
            log.info("export.dynamic_axes: %s not used: the model's forward takes no such input", unused)
        return {n: axes.get(n, dict(axes["input_ids"])) for n in self.inputs}

    def export(self, module: PooledEncoder, export_cfg, out: Path) -> None:
        """torch.onnx.export(dynamo=True), dims named as in the recipe, output ``embeddings``.

        Raises:
            ExportError: the exporter failed; its message is kept.
        """
        # Example sizes above 1 and distinct, so the exporter specialises nothing.
        feeds = random_feeds(self.vocab, batch=2, sequence=7, names=module.input_names)
        export_checks.export_module(module, feeds, self.dynamic_axes(export_cfg), out, opset=export_cfg.opset,
                                    output_names=[OUTPUT])

    def sample_feeds(self, module, inputs, point: dict[str, int], seed: int) -> dict[str, np.ndarray]:
        """Random feeds at ``point`` (needs dims ``batch`` and ``sequence``) for the graph's ``inputs``.

        Raises:
            ExportError: the point lacks ``batch`` or ``sequence``.
        """
        missing = {"batch", "sequence"} - point.keys()
        if missing:
            raise ExportError(f"export.check_points: point {point} lacks {sorted(missing)}")
        vocab = int(module.model.config.vocab_size)
        return random_feeds(vocab, point["batch"], point["sequence"], seed, names=[s.name for s in inputs])

    def torch_outputs(self, module: PooledEncoder, feeds: dict[str, np.ndarray]):
        """``(embeddings,)``: float32 ``[B, H]``."""
        return (module(*(torch.from_numpy(feeds[n]) for n in module.input_names)),)

    def calibration_feeds(self, exp, data, cal) -> list[dict[str, np.ndarray]]:
        """Batches of ``cal.samples`` token windows int64 ``[<=cal.batch_size, cal.seq_len]`` of
        the documents of ``data`` for the graph's inputs (``exp.inputs``): mask all ones, token
        types (where the graph has them) all zeros."""
        return text_batches(exp, data, cal, lambda _exp, ids: window_feeds(ids, [s.name for s in exp.inputs]))

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


def window_feeds(ids: np.ndarray, names: Sequence[str] = INPUTS) -> dict[str, np.ndarray]:
    """Feeds of the inputs ``names`` for token windows int64 ``[B, S]``: mask all ones, token types all zeros."""
    ids = ids.astype(np.int64)
    return only({"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}, names)


