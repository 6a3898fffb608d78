"""Sentence-embedding encoder adapter (BERT family, e.g. all-MiniLM-L6-v2) and its metrics.

Graph I/O (``H`` hidden size, 384 for MiniLM-L6):

* ``input_ids``, ``attention_mask``, ``token_type_ids``: int64 ``[batch, sequence]``
* output ``embeddings``: float32 ``[batch, H]``, the mean of the last hidden
  states over the positions where ``attention_mask`` is 1, L2-normalised
  (the sentence-transformers pooling of all-MiniLM-L6-v2, inside the graph).

Metrics (:func:`encoder_metrics`): Spearman correlation between the cosine
similarity of embedded word pairs and human scores (WordSim353, SimLex-999),
for FP32 and the quantized graph, both in ONNX Runtime; the drop in points
(x100); the mean FP32-vs-quantized cosine on held-out sentences; and the same
numbers for ONNX Runtime's ``quantize_static`` defaults (``naive_ort_*``).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import torch
from onnxruntime.quantization import CalibrationDataReader

from pipeline.errors import AccuracyError, ExportError
from pipeline.models.llm import package_file
from pipeline.recipe import ModelSource

INPUTS = ("input_ids", "attention_mask", "token_type_ids")
OUTPUT = "embeddings"
WORD_SETS = ("wordsim353", "simlex999")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'])")


def load_encoder(source: ModelSource):
    """Load the encoder (FP32, eval mode) and its tokenizer from the package folder, offline.

    Returns ``(transformers model, tokenizer)``.

    Raises:
        ExportError: the package or folder is missing (from ``package_file``).
    """
    from transformers import AutoModel, AutoTokenizer

    folder = str(package_file(source))
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModel.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    return model.eval(), tok


class MeanPooledEncoder(torch.nn.Module):
    """``(input_ids, attention_mask, token_type_ids) -> embeddings`` float32 ``[B, H]``.

    Masked mean of ``last_hidden_state`` (the mask count is clamped at 1e-9 as
    sentence-transformers does), then L2 normalisation.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids):
        hidden = self.model(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2.0, dim=-1)


def random_feeds(vocab: int, batch: int, sequence: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random valid int64 ``[batch, sequence]`` feeds; row ``i`` has ``i`` trailing pad positions
    (at most ``sequence - 1``), so the masked pooling is exercised."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, vocab, (batch, sequence), dtype=np.int64)
    mask = np.ones((batch, sequence), np.int64)
    for i in range(batch):
        pad = min(i, sequence - 1)
        if pad:
            mask[i, -pad:] = 0
            ids[i, -pad:] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


class EncoderAdapter:
    """Loads, exports and feeds a mean-pooled, normalised sentence encoder."""

    def __init__(self, source: ModelSource):
        self.source = source
        self.vocab: int | None = None

    def load(self, ctx):
        """Returns ``(MeanPooledEncoder, tokenizer)``."""
        with ctx.progress.step(f"load {self.source.package}/{self.source.path}"):
            model, tok = load_encoder(self.source)
        self.vocab = int(model.config.vocab_size)
        return MeanPooledEncoder(model).eval(), tok

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

    def export(self, module: MeanPooledEncoder, export_cfg, out: Path) -> None:
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

    def torch_outputs(self, module: MeanPooledEncoder, feeds: dict[str, np.ndarray]):
        """``(embeddings,)``: float32 ``[B, H]``."""
        return (module(*(torch.from_numpy(feeds[n]) for n in INPUTS)),)

    @staticmethod
    def feeds_for_ids(exp, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Feeds for token windows int64 ``[B, S]``: mask all ones, token types all zeros."""
        ids = ids.astype(np.int64)
        return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}


# --- validation -------------------------------------------------------------------------


def tokenize(tok, texts: list[str], max_len: int) -> dict[str, np.ndarray]:
    """Tokenizer feeds (with [CLS]/[SEP], padded to the longest, truncated at ``max_len``).

    Returns int64 ``[len(texts), S]`` arrays for every name in ``INPUTS``.
    """
    enc = tok(texts, padding=True, truncation=True, max_length=max_len, return_tensors="np")
    ids = enc["input_ids"].astype(np.int64)
    types = enc.get("token_type_ids")
    return {"input_ids": ids, "attention_mask": enc["attention_mask"].astype(np.int64),
            "token_type_ids": np.zeros_like(ids) if types is None else types.astype(np.int64)}


def embed(sess, tok, texts: list[str], batch: int, max_len: int) -> np.ndarray:
    """Embeddings of ``texts`` from an ORT session: float32 ``[len(texts), H]``."""
    out = [sess.run([OUTPUT], tokenize(tok, texts[i : i + batch], max_len))[0] for i in range(0, len(texts), batch)]
    return np.concatenate(out, axis=0)


def row_cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine of matching rows of two float ``[N, H]`` arrays: float64 ``[N]``."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    norm = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return (a * b).sum(1) / np.maximum(norm, 1e-12)


def held_out_sentences(docs: list[str], limit: int, min_chars: int = 20) -> list[str]:
    """Up to ``limit`` sentences (at least ``min_chars`` characters) of ``docs``, in order.

    Raises:
        AccuracyError: the documents give no sentence.
    """
    out = [s for d in docs for s in _SENTENCE_END.split(d) if len(s) >= min_chars][:limit]
    if not out:
        raise AccuracyError("validate.split gives no sentence; nothing would be compared")
    return out


def word_vectors(sess, tok, words: list[str], batch: int) -> dict[str, np.ndarray]:
    """Embedding (float32 ``[H]``) of each word, embedded alone as ``[CLS] word [SEP]``."""
    vecs = embed(sess, tok, words, batch, max_len=32)
    return dict(zip(words, vecs))


def pair_spearman(vectors: dict[str, np.ndarray], pairs: list[tuple[str, str]], human: np.ndarray) -> float:
    """Spearman rho between pair cosines and human scores (float64 ``[n]``); NaN when a
    cosine is not finite (a broken candidate model)."""
    from scipy.stats import spearmanr

    a = np.stack([vectors[x] for x, _ in pairs])
    b = np.stack([vectors[y] for _, y in pairs])
    cos = row_cosine(a, b)
    return float(spearmanr(cos, human).statistic) if np.isfinite(cos).all() else math.nan


def _one_model(sess, tok, sets: dict, sentences: list[str], batch: int, max_len: int) -> tuple[dict, np.ndarray]:
    """Spearman per word set and the count of non-finite embedding rows (words and
    sentences) for one session; also the sentence embeddings, float32 ``[N, H]``."""
    words = sorted({w for pairs, _ in sets.values() for p in pairs for w in p})
    vecs = word_vectors(sess, tok, words, batch)
    res: dict = {f"spearman_{n}": pair_spearman(vecs, pairs, human) for n, (pairs, human) in sets.items()}
    emb = embed(sess, tok, sentences, batch, max_len)
    bad_words = int((~np.isfinite(np.stack(list(vecs.values())))).any(1).sum())
    res["nonfinite_rows"] = bad_words + int((~np.isfinite(emb)).any(1).sum())
    return res, emb


def similarity_metrics(sessions: dict, tok, sentences: list[str], batch: int, max_len: int) -> dict[str, dict]:
    """Per label of ``sessions`` (the first is the FP32 reference): Spearman per word set,
    non-finite row count and, for the others, mean / min cosine to the reference on
    ``sentences`` (a non-finite row counts as cosine -1).

    Returns ``{label: {"spearman_<set>": rho, "nonfinite_rows": n, "mean_cosine": c, "min_cosine": c}}``.

    Raises:
        AccuracyError: the reference embeddings hold NaN or Inf.
    """
    from pipeline import data

    sets = {name: data.word_pairs(name) for name in WORD_SETS}
    out: dict[str, dict] = {}
    ref = None
    for label, sess in sessions.items():
        res, emb = _one_model(sess, tok, sets, sentences, batch, max_len)
        if ref is None:
            if res["nonfinite_rows"]:
                raise AccuracyError(f"validate: the FP32 reference produced {res['nonfinite_rows']} non-finite embeddings")
            ref = emb
        else:
            cos = np.nan_to_num(row_cosine(ref, emb), nan=-1.0)
            res.update(mean_cosine=float(cos.mean()), min_cosine=float(cos.min()))
        out[label] = res
    return out


def drop_points(ref: dict, cand: dict) -> dict[str, float]:
    """Spearman drop per word set in points (``100 * (ref - cand)``) and their max (NaN if any is)."""
    drops = {f"spearman_drop_{n}": 100.0 * (ref[f"spearman_{n}"] - cand[f"spearman_{n}"]) for n in WORD_SETS}
    return {**drops, "spearman_drop_max": float(np.max(list(drops.values())))}


class _FeedReader(CalibrationDataReader):
    """ORT calibration reader over a list of feed dicts."""

    def __init__(self, batches: list[dict[str, np.ndarray]]):
        self._it = iter(batches)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)


def _softmax_nodes(onnx_path: str) -> list[str]:
    import onnx

    return [n.name for n in onnx.load(onnx_path, load_external_data=False).graph.node if n.op_type == "Softmax"]


def naive_ort_model(ctx, exp, precision: str) -> str:
    """ONNX Runtime ``quantize_static`` with its QDQ defaults on the FP32 export and the
    recipe's calibration batches; FP8 uses E4M3FN activation and weight types, the
    Distribution calibrator (the only one ``quantize_static`` accepts for float8) and
    leaves Softmax nodes unquantized (ORT's float8 path fails on them).

    Returns the path of the written model (in the validate stage folder).

    Raises:
        QuantizationError: too little calibration data (from ``calibration_batches``).
    """
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    from pipeline.stages.quantize import calibration_batches

    out = ctx.stage_dir / f"naive_ort_{precision}.onnx"
    kw: dict = {"quant_format": QuantFormat.QDQ}
    if precision == "fp8":
        # quantize_static accepts only the Distribution calibrator for float8 types, and its
        # fixed [0, 1] range for Softmax outputs carries no avg/std, which float8 scales need
        # (AttributeError in ORT 1.31): Softmax nodes are left out, everything else is default.
        kw.update(activation_type=QuantType.QFLOAT8E4M3FN, weight_type=QuantType.QFLOAT8E4M3FN,
                  calibrate_method=CalibrationMethod.Distribution, nodes_to_exclude=_softmax_nodes(exp.onnx_path))
    with ctx.progress.step(f"validate: naive ORT quantize_static ({precision})"):
        quantize_static(exp.onnx_path, str(out), _FeedReader(calibration_batches(ctx, exp)), **kw)
    return str(out)


def encoder_metrics(ctx, exp, q) -> dict:
    """Accuracy of the quantized encoder vs FP32 (both in ONNX Runtime), and of ORT's naive PTQ.

    Reads ``validate.split`` (held-out sentences: at most ``max_windows`` of them,
    ``seq_len`` tokens max, ``batch_size`` rows per run) and the word-similarity sets.

    Returns a flat dict: ``spearman_<set>_fp32``, ``spearman_<set>_<precision>``,
    ``spearman_drop_<set>`` and ``spearman_drop_max`` (points), ``mean_cosine``,
    ``min_cosine``, ``nonfinite_rows``, ``eval_sentences``, and the same with a
    ``naive_ort_`` prefix (int8/fp8 only). A broken candidate gives NaN, never an error.

    Raises:
        AccuracyError: NaN/Inf in the FP32 reference, or no held-out sentence.
        DataError: the split reaches past the corpus.
    """
    from pipeline import data
    from pipeline.models import registry
    from pipeline.runtime import ort_session

    v = ctx.recipe.validate_
    tok = registry.load_tokenizer(exp.tokenizer_dir)
    sentences = held_out_sentences(data.load_documents(v.dataset, v.split), v.max_windows)
    sessions = {"reference": ort_session(exp.onnx_path), "candidate": ort_session(q.onnx_path)}
    if q.precision in ("int8", "fp8"):
        sessions["naive_ort"] = ort_session(naive_ort_model(ctx, exp, q.precision))
    with ctx.progress.step(f"validate: word similarity + cosine ({len(sessions)} models)"):
        res = similarity_metrics(sessions, tok, sentences, v.batch_size, v.seq_len)
    return _flatten(res, q.precision, len(sentences))


def _flatten(res: dict[str, dict], precision: str, n_sentences: int) -> dict:
    ref, cand = res["reference"], res["candidate"]
    out: dict = {"eval_sentences": n_sentences}
    for n in WORD_SETS:
        out[f"spearman_{n}_fp32"] = ref[f"spearman_{n}"]
        out[f"spearman_{n}_{precision}"] = cand[f"spearman_{n}"]
    out.update(drop_points(ref, cand))
    out.update({k: cand[k] for k in ("mean_cosine", "min_cosine", "nonfinite_rows")})
    if "naive_ort" in res:
        naive = res["naive_ort"]
        out.update({f"naive_ort_spearman_{n}": naive[f"spearman_{n}"] for n in WORD_SETS})
        out.update({f"naive_ort_{k}": val for k, val in drop_points(ref, naive).items()})
        out.update({f"naive_ort_{k}": naive[k] for k in ("mean_cosine", "min_cosine", "nonfinite_rows")})
    return {**out, **nan_reasons(out, res, precision)}


def nan_reasons(flat: dict, res: dict[str, dict], precision: str) -> dict[str, str]:
    """``<metric>_reason`` for each NaN metric of :func:`_flatten`'s output: the model
    whose embeddings were non-finite, else an undefined (constant-input) Spearman.
    The JSON writer turns the NaN into ``null`` and keeps this reason."""
    out = {}
    for key, value in flat.items():
        if not (isinstance(value, float) and math.isnan(value)):
            continue
        label = "naive_ort" if key.startswith("naive_ort_") else "candidate"
        who = "ONNX Runtime's naive quantize_static model" if label == "naive_ort" else f"the {precision} model"
        bad = res[label]["nonfinite_rows"]
        out[f"{key}_reason"] = (
            f"{who} gave {bad} non-finite embedding row(s), so the Spearman correlation is undefined" if bad
            else f"the Spearman correlation of {who} is undefined (constant similarities)")
    return out
